"""The EAGLE corpus builder and training at scale on the tiny model: the corpus keeps the
Spec-Bench eval split out (even text copied from it into a local file), deduplicates, writes a
manifest and resumes where a stopped build left off with the same answers; feature shards are
streamed one at a time; a resumed training run equals the uninterrupted one; held-out
evaluation runs after each epoch; --ship keeps the better head; and the whole chain
build-corpus -> train-eagle -> ship -> compile -> eagle decoding runs end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from specbuild.errors import SpecbuildError
from specbuild.train import corpus as cp
from specbuild.train.eagle import EagleTrainConfig, ShardStream, read_shard, train_eagle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_cfg(local_root: str, **kw) -> cp.CorpusConfig:
    base = dict(self_instruct=5, local_files=6, local_roots=(local_root,), excerpt_chars=120, heldout_prompts=3,
                temperatures=(0.0, 1.0), max_prompt_tokens=200, max_answer_tokens=24, limit=8, batch=4,
                ignore_eos=True)
    return cp.CorpusConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The EAGLE tests' tiny target (scale 4, seed 3: peaked enough to learn from, as in
    tests/speculation/test_eagle.py) and its float32 bundle."""
    from tiny import make_tiny_hf

    from specbuild.compiler.compile import CompileOptions, compile_bundle

    root = tmp_path_factory.mktemp("eagle_tiny")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    bundle = compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float32", max_draft_len=10,
                                                                          max_seq_len=256))
    return {"target": target, "bundle": bundle}


@pytest.fixture(scope="module")
def tiny_bundle(tiny) -> str:
    return tiny["bundle"]


@pytest.fixture(scope="module")
def eval_turns() -> list[str]:
    return cp.spec_bench_split(cp.CorpusConfig())[2]


@pytest.fixture(scope="module")
def local_root(tmp_path_factory, eval_turns) -> str:
    root = tmp_path_factory.mktemp("site")
    (root / "pkg").mkdir()
    (root / "pkg" / "a.py").write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n")
    (root / "pkg" / "copy_of_a.py").write_text((root / "pkg" / "a.py").read_text())  # a duplicate
    (root / "README.md").write_text("# pkg\n\nA package that adds and subtracts numbers for you.\n")
    short = min((t for t in eval_turns if 40 <= len(t) <= 110), key=len)
    (root / "leak.txt").write_text(short + "\n")  # Spec-Bench eval-split text on the machine
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)  # not text: skipped
    return str(root)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tiny_bundle, local_root) -> dict:
    out = str(tmp_path_factory.mktemp("corpus") / "c")
    manifest = cp.build_corpus(tiny_bundle, out, small_cfg(local_root), progress=False, log=lambda m: None)
    return {"dir": out, "manifest": manifest}


def test_corpus_sources_manifest_and_no_eval_prompt(corpus, eval_turns):
    m, out = corpus["manifest"], corpus["dir"]
    assert m["complete"]
    assert all(m["sources"][s]["prompts"] >= 1 for s in cp.SOURCES), m["sources"]
    assert m["totals"]["prompts"] == 8 and m["totals"]["answers"] == 16  # --limit 8, two temperatures
    assert m["answers_by_temperature"] == {"0": 8, "1": 8}
    assert m["dropped"]["eval_split"] >= 1 and m["dropped"]["duplicate"] >= 1
    assert m["heldout"]["answers"] == m["heldout"]["prompts"] >= 1
    assert m["files"]["answers.jsonl"] == os.path.getsize(os.path.join(out, "answers.jsonl"))
    prompts = cp.read_jsonl(os.path.join(out, cp.PROMPTS))
    held = cp.read_jsonl(os.path.join(out, cp.HELDOUT))
    split = cp.spec_bench_split(cp.CorpusConfig())
    train_ids = {str(r["id"]) for r in split[0]}
    eval_keys = {cp.fold(t) for t in eval_turns}
    for p in prompts + held:
        key = cp.fold(p["text"])
        assert key not in eval_keys and not any(e in key for e in eval_keys)
        if p["source"].startswith("spec_bench"):
            assert p["qid"] in train_ids
    assert len({cp.fold(p["text"]) for p in prompts + held}) == len(prompts) + len(held)
    assert not {p["id"] for p in held} & {a["prompt_id"] for a in cp.read_jsonl(os.path.join(out, cp.ANSWERS))}
    # the held-out prompts are train-eagle's own held-out Spec-Bench prompts (seeded order), those that fit
    from specbuild.engine.engine import Engine

    engine = Engine(m["bundle"])
    fits = [str(r["id"]) for r in split[0][:3]
            if len(engine.encode(engine.render_chat([{"role": "user", "content": r["text"]}]),
                                 add_special_tokens=False)) <= 200]
    assert fits and [h["qid"] for h in held] == fits and m["heldout"]["prompts"] == len(fits)


def test_corpus_resumes_where_it_stopped(tmp_path, tiny_bundle, local_root, corpus):
    out = str(tmp_path / "c")
    stopped = cp.build_corpus(tiny_bundle, out, small_cfg(local_root, time_limit=1e-9), progress=False,
                              log=lambda m: None)
    assert not stopped["complete"] and stopped["totals"]["answers"] == 0
    shutil.copyfile(os.path.join(corpus["dir"], cp.SELF_INSTRUCT), os.path.join(out, cp.SELF_INSTRUCT))
    full = cp.read_jsonl(os.path.join(corpus["dir"], cp.ANSWERS))
    with open(os.path.join(out, cp.ANSWERS), "w") as f:  # a run killed after 5 answers, mid-line
        for rec in full[:5]:
            f.write(json.dumps(rec) + "\n")
        f.write(json.dumps(full[5])[:30])
    again = cp.build_corpus(tiny_bundle, out, small_cfg(local_root), progress=False, log=lambda m: None)
    assert again["complete"] and again["totals"]["answers"] == len(full)
    got = cp.read_jsonl(os.path.join(out, cp.ANSWERS))
    assert got[:5] == full[:5]  # kept, not regenerated
    assert {a["id"]: a["answer_ids"] for a in got} == {a["id"]: a["answer_ids"] for a in full}


def test_corpus_refuses_bad_values(tiny_bundle, tmp_path):
    with pytest.raises(SpecbuildError, match="--temperatures"):
        cp.CorpusConfig(temperatures=(3.0,))
    with pytest.raises(SpecbuildError, match="--batch 0"):
        cp.CorpusConfig(batch=0)
    with pytest.raises(SpecbuildError, match="not a directory"):
        cp.local_files((str(tmp_path / "nope"),), 3, 0)
    with pytest.raises(SpecbuildError, match="manifest"):
        cp.load_corpus(str(tmp_path), 320)


def train_cfg(**kw) -> EagleTrainConfig:
    base = dict(draft_vocab=200, max_rows=32, shard_positions=128, lr=3e-3, checkpoint_minutes=60.0)
    return EagleTrainConfig(**{**base, **kw})


def head_weights(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(d, "model.safetensors"))


def test_shards_stream_one_at_a_time_and_resume_equals_uninterrupted(tmp_path, tiny_bundle, corpus):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ra = train_eagle(tiny_bundle, None, a, train_cfg(steps=14), progress=False, log=lambda m: None,
                     corpus=corpus["dir"])
    assert ra["feature_shards"] >= 3  # 16 answers of ~100-220 positions, 128 per shard
    index = json.load(open(os.path.join(a, "features", "shard.json")))
    stream = ShardStream(os.path.join(a, "features"), index, 32, 0)
    for k in range(stream.per_epoch):
        stream.item(k)
    assert stream.loads == len(index)  # an epoch reads each shard once, one in memory at a time
    assert len(set(stream.plan(0))) == stream.per_epoch  # every window once per epoch
    assert stream.plan(1) != stream.plan(0) and sorted(stream.plan(1)) == sorted(stream.plan(0))
    seqs = [s for e in index for s in read_shard(os.path.join(a, "features", e["file"]))]
    assert sum(s["ids"].numel() for s in seqs) == ra["train_rows"]
    assert seqs[0]["feats"].dtype == torch.bfloat16 and seqs[0]["feats"].shape[1] == 3 * 64

    logs = []
    rb = train_eagle(tiny_bundle, None, b, train_cfg(steps=14, stop_step=6), progress=False, log=logs.append,
                     corpus=corpus["dir"])
    assert rb["steps"] == 6
    rb = train_eagle(tiny_bundle, None, b, train_cfg(steps=14), resume=True, progress=False, log=logs.append,
                     corpus=corpus["dir"])
    assert rb["steps"] == 14 and any("resumed at step 6" in m for m in logs)
    wa, wb = head_weights(a), head_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert ra["eval_after"] == rb["eval_after"]


def test_heldout_eval_after_each_epoch_and_positions_subset(tmp_path, tiny_bundle, corpus):
    r = train_eagle(tiny_bundle, None, str(tmp_path / "h"), train_cfg(epochs=2.0), progress=False,
                    log=lambda m: None, corpus=corpus["dir"])
    assert [e["epoch"] for e in r["epochs"]] == [1, 2]
    assert r["epochs"][-1]["step"] == r["steps"] == 2 * r["windows_per_epoch"]
    assert r["epochs"][-1]["acceptance_by_position"] == r["eval_after"]["acceptance_by_position"]
    assert r["eval_after"]["chains"] > 0
    sub = train_eagle(tiny_bundle, None, str(tmp_path / "s"), train_cfg(steps=2, max_positions=400),
                      progress=False, log=lambda m: None, corpus=corpus["dir"])
    assert 0 < sub["train_rows"] <= 400 < r["train_rows"] and sub["train_sequences"] < r["train_sequences"]
    assert sub["eval_after"]["chains"] == r["eval_after"]["chains"]  # the same fixed held-out set


def test_ship_keeps_the_better_head(tmp_path, tiny_bundle, corpus):
    ship = str(tmp_path / "shipped")
    weak = train_eagle(tiny_bundle, None, str(tmp_path / "weak"), train_cfg(steps=1, lr=1e-6), progress=False,
                       log=lambda m: None, corpus=corpus["dir"], ship=ship)
    assert weak["ship"]["shipped"] and weak["ship"]["baseline_eval"] is None  # nothing there yet
    strong = train_eagle(tiny_bundle, None, str(tmp_path / "strong"), train_cfg(steps=120), progress=False,
                         log=lambda m: None, corpus=corpus["dir"], ship=ship)
    s = strong["ship"]
    assert s["baseline_eval"] == weak["eval_after"]  # the shipped head, evaluated again on the same chains
    assert s["new_eval"]["expected_accepted_per_pass"] > s["baseline_eval"]["expected_accepted_per_pass"]
    assert s["shipped"]
    shipped = head_weights(ship)
    assert all(torch.equal(shipped[k], v) for k, v in head_weights(str(tmp_path / "strong")).items())
    assert json.load(open(os.path.join(ship, "train_report.json")))["steps"] == 120
    again = train_eagle(tiny_bundle, None, str(tmp_path / "weak2"), train_cfg(steps=1, lr=1e-6), progress=False,
                        log=lambda m: None, corpus=corpus["dir"], ship=ship)
    assert not again["ship"]["shipped"]
    assert again["ship"]["baseline_eval"] == strong["eval_after"]
    after = head_weights(ship)
    assert all(torch.equal(after[k], shipped[k]) for k in shipped)  # the better head stays


def test_init_starts_from_the_given_head(tmp_path, tiny_bundle, corpus):
    first = train_eagle(tiny_bundle, None, str(tmp_path / "first"), train_cfg(steps=60, draft_vocab=150),
                        progress=False, log=lambda m: None, corpus=corpus["dir"])
    logs = []
    warm = train_eagle(tiny_bundle, None, str(tmp_path / "warm"), train_cfg(steps=2, lr=1e-4), progress=False,
                       log=logs.append, corpus=corpus["dir"], init=str(tmp_path / "first"))
    assert warm["eval_before"] == first["eval_after"]  # it starts where that head ended, on the same chains
    assert warm["draft_vocab"] == 150  # that head's draft vocabulary, not --draft-vocab's 200
    assert torch.equal(head_weights(str(tmp_path / "warm"))["d2t"], head_weights(str(tmp_path / "first"))["d2t"])
    assert any("starting from the head in" in m for m in logs)
    fresh = train_eagle(tiny_bundle, None, str(tmp_path / "fresh"), train_cfg(steps=2, lr=1e-4), progress=False,
                        log=lambda m: None, corpus=corpus["dir"])
    assert fresh["eval_before"] != first["eval_after"] and fresh["draft_vocab"] == 200


def test_end_to_end_build_train_ship_decode(tmp_path, tiny, tiny_bundle, local_root, capsys):
    """scripts/build_eagle_corpus.py -> specbuild train-eagle --corpus --ship -> compile --eagle
    -> greedy eagle decoding equal to plain, with drafts proposed and accepted."""
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine, EngineConfig
    from specbuild.engine.sequence import Request
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    c = str(tmp_path / "corpus")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "build_eagle_corpus.py"), tiny_bundle,
                          "--out", c, "--self-instruct", "3", "--local-files", "3", "--local-root", local_root,
                          "--excerpt-chars", "120", "--heldout-prompts", "2", "--temperatures", "0,0.7",
                          "--max-prompt-tokens", "200", "--max-answer-tokens", "24", "--limit", "6",
                          "--ignore-eos", "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["totals"]["answers"] == 12
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from build_eagle_corpus import main
    finally:
        sys.path.pop(0)
    assert main([tiny_bundle, "--out", c, "--temperatures", "hot"]) == 2
    assert "--temperatures 'hot'" in capsys.readouterr().err
    assert main([tiny_bundle, "--out", c, "--batch", "0"]) == 2
    assert "--batch 0 is out of range" in capsys.readouterr().err
    head, ship = str(tmp_path / "head"), str(tmp_path / "ship")
    run = subprocess.run([sys.executable, "-m", "specbuild.cli", "train-eagle", tiny_bundle, "--corpus", c, "--out",
                          head, "--draft-vocab", "200", "--steps", "80", "--lr", "3e-3", "--ship", ship,
                          "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    rep = json.loads(run.stdout)
    assert rep["ship"]["shipped"] and rep["eval_after"]["acceptance_by_position"][0] > 0
    bundle = compile_bundle(tiny["target"], str(tmp_path / "bundle"), CompileOptions(dtype="float32", max_draft_len=10),
                            eagle=ship)
    engine = Engine(bundle, EngineConfig())
    prompt = [int(t) for t in json.loads(open(os.path.join(c, cp.HELDOUT_ANSWERS)).readline())["prompt_ids"]]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = engine.generate([Request(prompt_ids=prompt, sampling=sp, speculation=SpeculationConfig.make(None, method="none"))])
    spec = engine.generate([Request(prompt_ids=prompt, sampling=sp,
                                    speculation=SpeculationConfig.make(None, method="eagle"))])
    assert spec[0]["token_ids"] == plain[0]["token_ids"]
    st = spec[0]["stats"]
    assert st["drafted"] > 0 and st["accepted"] > 0, st


def test_self_instruct_tasks_get_their_kinds_instruction():
    jobs = cp.self_instruct_jobs(cp.CorpusConfig(self_instruct=10))
    assert [j["kind"] for j in jobs[:5]] == list(cp.SEED_TASKS) and "photosynthesis" in jobs[0]["text"]
    assert jobs[5]["text"] != jobs[0]["text"]  # the next topic
    para = "Bees make honey from the nectar of flowers they visit."
    assert cp.clean_task({"kind": "summary", "answer_text": f' "{para}" '}).endswith(
        "Summarize the text above in one sentence.")
    assert cp.clean_task({"kind": "question", "answer_text": para}) == para
    assert cp.clean_task({"kind": "question", "answer_text": "short"}) is None


def test_shared_features_dir_reuses_shards_of_the_same_bundle_only(tmp_path, tiny, tiny_bundle, corpus):
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    feat = str(tmp_path / "feat")
    first = train_eagle(tiny_bundle, None, str(tmp_path / "a"), train_cfg(steps=1), progress=False, log=lambda m: None,
                        corpus=corpus["dir"], features_dir=feat)
    assert first["shards_computed"] == first["feature_shards"] >= 3
    again = train_eagle(tiny_bundle, None, str(tmp_path / "b"), train_cfg(steps=1, max_positions=300), progress=False,
                        log=lambda m: None, corpus=corpus["dir"], features_dir=feat)
    assert again["shards_computed"] == 0 and again["train_rows"] <= 300
    other = compile_bundle(tiny["target"], str(tmp_path / "bundle_bf16"),
                           CompileOptions(dtype="bfloat16", max_draft_len=10, max_seq_len=256))
    moved = train_eagle(other, None, str(tmp_path / "c"), train_cfg(steps=1), progress=False, log=lambda m: None,
                        corpus=corpus["dir"], features_dir=feat)
    assert moved["shards_computed"] == moved["feature_shards"]  # another bundle: its own features


def test_hf_generate_answers_equal_the_engines_greedy_answers(tmp_path, tiny, local_root):
    """--hf-generate (transformers' generate over the model the bundle came from, padded
    batches; the GPU path) gives the engine's greedy answers token for token in float32, EOS
    included, and a sampled answer per prompt at the other temperature."""
    pytest.importorskip("transformers")
    # no self-instruct tasks: they are sampled, so the two builds would write different prompts
    cfg = small_cfg(local_root, self_instruct=0, ignore_eos=False, max_answer_tokens=16, batch=3)
    a = cp.build_corpus(tiny["bundle"], str(tmp_path / "engine"), cfg, progress=False, log=lambda m: None)
    logs = []
    b = cp.build_corpus(tiny["bundle"], str(tmp_path / "hf"), cfg, progress=False, log=logs.append,
                        hf_source=tiny["target"])
    assert a["complete"] and b["complete"]
    assert any("transformers generate" in m for m in logs)
    for name in (cp.ANSWERS, cp.HELDOUT_ANSWERS):
        ea = {r["id"]: r for r in cp.read_jsonl(str(tmp_path / "engine" / name))}
        hb = {r["id"]: r for r in cp.read_jsonl(str(tmp_path / "hf" / name))}
        assert set(ea) == set(hb) and ea
        greedy = [k for k in ea if ea[k]["temperature"] == 0.0]
        assert greedy
        for k in greedy:
            assert hb[k]["prompt_ids"] == ea[k]["prompt_ids"]
            assert hb[k]["answer_ids"] == ea[k]["answer_ids"], k
        sampled = [k for k in hb if hb[k]["temperature"] > 0]
        assert all(1 <= len(hb[k]["answer_ids"]) <= 16 for k in sampled)
    assert b["totals"]["answers"] == a["totals"]["answers"] > 0
