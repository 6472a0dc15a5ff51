"""train-draft: the trainable draft matches the runtime decoder, it learns, resumes, compiles
into a bundle that shares the target's embedding (reduced vocabulary), drafts tokens that the
target accepts with identical greedy output, and exports to a Hugging Face directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specbuild.train.draft import DraftTrainConfig, TrainDraft, draft_config, init_from_target, make_vocab_map, train_draft
from specbuild.errors import SpecbuildError


def write_prompts(path, n: int) -> str:
    words = ["the cat", "a tree", "in the", "the sea", "at noon", "is on", "we saw", "the end"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"{words[(5 * i) % 8]} then {words[i % 8]} {i}"}) + "\n")
    return str(path)


def test_vocab_map_keeps_frequent_tokens_and_eos():
    seqs = [{"answer_ids": [5, 5, 5, 9, 9, 7]}]
    vm = make_vocab_map(seqs, vocab=20, size=4, always=(19,))
    assert vm.tolist() == [5, 7, 9, 19]  # 19 forced, then by count
    assert make_vocab_map(seqs, vocab=20, size=6, always=(19,)).tolist() == [0, 1, 5, 7, 9, 19]  # then lowest ids
    with pytest.raises(SpecbuildError, match="exceeds"):
        make_vocab_map(seqs, vocab=20, size=21)


def test_train_module_matches_runtime_reference(tiny_bundle):
    """The padded-batch training forward equals runtime.model.reference_forward on the same
    weights (the draft the bundle will run), per sequence, padding ignored."""
    from specbuild.engine.engine import Engine
    from specbuild.model.decoder import reference_forward

    engine = Engine(tiny_bundle)
    tcfg = engine.target_config
    dcfg = draft_config(tcfg, DraftTrainConfig(layers=2, hidden=tcfg.intermediate_size // 2))
    weights = init_from_target(engine.model.w, tcfg, dcfg, (0, 1))
    vocab_map = torch.tensor([0, 3, 10, 40, 41, 100, 200, 300])
    model = TrainDraft(dcfg, weights, engine.model.w["embed"], engine.model.lm_head[vocab_map])
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, tcfg.vocab_size, (9,), generator=gen), torch.randint(0, tcfg.vocab_size, (5,), generator=gen)
    ids = torch.zeros(2, 9, dtype=torch.int64)
    ids[0], ids[1, :5] = a, b
    got = model(ids)  # [2, 9, 8]
    full = {**weights, "embed": engine.model.w["embed"], "lm_head": engine.model.lm_head[vocab_map]}
    for row, seq in ((0, a), (1, b)):
        want = reference_forward(dcfg, full, seq)  # [T, 8]
        torch.testing.assert_close(got[row, :len(seq)], want, rtol=1e-4, atol=1e-4)


def test_train_draft_compile_generate_export(tiny_bundle, tmp_path):
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.compiler.draft_role import export_draft
    from specbuild.engine.engine import Engine
    from specbuild.sampling.params import SamplingParams
    from specbuild.engine.sequence import Request

    data = write_prompts(tmp_path / "data.jsonl", 24)
    out = str(tmp_path / "draft")
    cfg = DraftTrainConfig(layers=1, draft_vocab=160, tokens=14 * 24, sampled_share=0.5, max_answer_tokens=24,
                           eval_prompts=2, epochs=40.0, batch_seqs=4, lr=3e-3, ignore_eos=True, save_dtype="float32")
    report = train_draft(tiny_bundle, data, out, cfg, progress=False, log=lambda m: None)
    assert report["train_answers"] == 14 and report["eval_prompts"] == 2
    first, last = sum(report["first_losses"][:5]) / 5, sum(report["last_losses"][-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert report["eval_after"]["kl"] < report["eval_before"]["kl"]
    answers = open(os.path.join(out, "answers_greedy.jsonl")).read()
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)

    resumed = train_draft(tiny_bundle, data, out, DraftTrainConfig(**{**cfg.__dict__, "epochs": 44.0}), resume=True,
                          progress=False, log=lambda m: None)
    assert resumed["steps"] > report["steps"]
    assert open(os.path.join(out, "answers_greedy.jsonl")).read() == answers  # reused, not regenerated
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["history"][:report["steps"]] \
        == ckpt["history"]

    bundle = compile_bundle(_hf_source(tiny_bundle), str(tmp_path / "bundle"), CompileOptions(max_seq_len=256),
                            draft=out)
    meta = json.load(open(os.path.join(bundle, "bundle.json")))
    role = meta["roles"]["draft"]
    assert role["shares"] == {"embed": "target/embed", "lm_head": "target/lm_head"}
    assert role["vocab_map"] == "draft/vocab_map.safetensors" and role["draft_vocab"] == 160
    from safetensors import safe_open

    with safe_open(os.path.join(bundle, "draft", "weights.safetensors"), "pt") as f:
        assert not {"embed", "lm_head"} & set(f.keys())  # shared, not stored again
    assert meta["default_speculation"]["method"] == "draft"

    engine = Engine(bundle)
    # prompts it was trained on: the draft fits them, so acceptance checks the plumbing
    # (shared embedding, output rows at vocab_map, scatter into the target's vocabulary)
    prompts = [json.loads(line)["prompt_ids"] for line in open(os.path.join(out, "answers_greedy.jsonl"))][:3]
    drafted = accepted = 0
    for prompt in prompts:
        plain = engine.generate([Request(prompt_ids=prompt, sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                                         speculation={"method": "none"})])[0]
        spec = engine.generate([Request(prompt_ids=prompt, sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                                        speculation={"method": "draft", "gamma_max": 4})])[0]
        assert spec["token_ids"] == plain["token_ids"]
        drafted += spec["stats"]["drafted"]
        accepted += spec["stats"]["accepted"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)

    exported = export_draft(bundle, str(tmp_path / "hf"))
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    vm = torch.tensor(json.load(open(os.path.join(tmp_path, "hf", "vocab_map.json")))["vocab_map"])
    ids = torch.tensor([prompts[0]])
    hf_logits = hf(ids).logits[0, -1]
    assert exported["draft_vocab"] == 160
    assert torch.all(hf_logits[~torch.isin(torch.arange(hf_logits.shape[0]), vm)] == 0)  # zero rows outside
    from specbuild.model.decoder import reference_forward
    from specbuild.engine.engine import shared_draft_weights, load_weights

    w, vmap = shared_draft_weights(bundle, role, load_weights(os.path.join(bundle, "draft"), "cpu"), engine.model.w)
    want = reference_forward(engine.speculator.proposers["draft"].model.config, w, ids[0])[-1]
    torch.testing.assert_close(hf_logits[vmap], want, rtol=1e-3, atol=1e-3)

    # `bench --peers transformers` exports the train-draft role on the fly for HF's assisted generation
    from click.testing import CliRunner

    from specbuild.cli.main import main

    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"word{i} word2 word3"]}) + "\n"
                         for i in (1, 2)))
    result = CliRunner().invoke(main, ["bench", bundle, "--dataset", str(q), "--split", "all", "--max-tokens", "6",
                                       "--repeats", "1", "--speculation", "draft", "--peers", "transformers",
                                       "--threads", "1", "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r["groups"]["overall"] for r in json.loads(result.stdout)["rows"]}
    assert set(rows) == {"specbuild none", "specbuild draft", "transformers plain", "transformers prompt_lookup",
                         "transformers assisted"}
    assert rows["transformers assisted"]["generated_tokens"] > 0


def _hf_source(bundle: str) -> str:
    return json.load(open(os.path.join(bundle, "bundle.json")))["roles"]["target"]["source"]


def test_config_errors_name_the_value():
    with pytest.raises(SpecbuildError, match="--layers 0"):
        DraftTrainConfig(layers=0)
    with pytest.raises(SpecbuildError, match="--sampled-share"):
        DraftTrainConfig(sampled_share=2.0)
