"""Medusa heads: reading both layouts, checks, the bundle role with shared lm_head, export
round trips, the runtime head module against a plain reference, the proposer's tree tokens,
and train-medusa on a tiny model."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbuild.compiler.medusa_role import add_medusa, check_heads, export_medusa, parse_heads, read_medusa, write_medusa_role
from specbuild.bundle import read_meta
from specbuild.errors import CheckpointError, RequestError, SpecbuildError
from specbuild.speculation.tree import TreeSpec, load_tree
from specbuild.speculation.medusa_heads import MedusaHeads, load_medusa, reference_medusa_logits
from specbuild.speculation.proposers.base import Observation
from specbuild.speculation.proposers.medusa import MedusaProposer
from specbuild.speculation.state import SpecState

HIDDEN, VOCAB = 64, 320  # tests/helpers/tiny.py defaults


def fd_heads(num_heads: int, num_layers: int, lm_heads: dict[int, torch.Tensor] | None = None,
             hidden: int = HIDDEN, vocab: int = VOCAB, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for h in range(num_heads):
        for l in range(num_layers):
            out[f"{h}.{l}.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.1
            out[f"{h}.{l}.linear.bias"] = torch.randn(hidden, generator=gen) * 0.1
        lm = (lm_heads or {}).get(h)
        out[f"{h}.{num_layers}.weight"] = lm if lm is not None else torch.randn(vocab, hidden, generator=gen)
    return out


def to_trt(fd: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in fd.items():
        parts = name.split(".")
        h, l = parts[0], int(parts[1])
        if l == num_layers:
            out[f"medusa_heads.{h}.lm_head.weight"] = t
        else:
            out[f"medusa_heads.{h}.medusa_layers.{l}.linear.{parts[-1]}"] = t
    return out


def target_lm_head(bundle: str) -> torch.Tensor:
    return load_file(os.path.join(bundle, "target", "weights.safetensors"))["lm_head"]


@pytest.fixture()
def bundle_copy(tiny_bundle, tmp_path) -> str:
    dst = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, dst)
    return dst


# ---- reading -----------------------------------------------------------------------------------
def test_reads_both_layouts_identically(tmp_path):
    fd = fd_heads(3, 2)
    save_file(fd, str(tmp_path / "fd.safetensors"))
    save_file(to_trt(fd, 2), str(tmp_path / "trt.safetensors"))
    os.makedirs(tmp_path / "dir")
    save_file({f"medusa_head.{k}": v for k, v in fd.items()}, str(tmp_path / "dir" / "medusa_lm_head.safetensors"))
    json.dump({"medusa_num_heads": 3, "medusa_num_layers": 2}, open(tmp_path / "dir" / "config.json", "w"))
    a, b, c = (read_medusa(str(tmp_path / f)) for f in ("fd.safetensors", "trt.safetensors", "dir"))
    assert (a.layout, b.layout, c.layout) == ("fasterdecoding", "tensorrt-llm", "fasterdecoding")
    for w in (a, b, c):
        assert (w.num_heads, w.num_layers) == (3, 2)
        got = w.tensors()
        assert set(got) == set(fd)
        assert all(torch.equal(got[k], fd[k]) for k in fd)


def test_layout_errors_name_the_tensor():
    fd = fd_heads(2, 1)
    with pytest.raises(CheckpointError, match=r"'0\.0\.linear\.wieght'"):
        parse_heads({**fd, "0.0.linear.wieght": fd["0.0.linear.weight"]})
    missing = {k: v for k, v in fd.items() if k != "1.0.linear.bias"}
    with pytest.raises(CheckpointError, match="head 1 layer 0 lacks its linear.bias"):
        parse_heads(missing)
    with pytest.raises(CheckpointError, match="mixes"):
        parse_heads({**fd, **{k: v for k, v in to_trt(fd, 1).items() if "lm_head" in k}})
    with pytest.raises(CheckpointError, match="medusa_num_heads=4 but the tensors hold 2"):
        parse_heads(fd, "x", {"medusa_num_heads": 4})
    with pytest.raises(CheckpointError, match=r"'0\.3\.weight' is not a head's lm_head"):
        parse_heads({**fd, "0.3.weight": fd["0.1.weight"]})
    no_lm = {k: v for k, v in fd.items() if k != "1.1.weight"}
    with pytest.raises(CheckpointError, match=r"head 1 has no lm_head \('1\.1\.weight'\)"):
        check_heads(parse_heads(no_lm), _config(), torch.zeros(VOCAB, HIDDEN))


def _config():
    from specbuild.bundle import ModelConfig

    return ModelConfig("llama", VOCAB, HIDDEN, 128, 2, 4, 2, 16)


def test_shape_errors_against_the_target(bundle_copy, tmp_path):
    wide = fd_heads(2, 1, hidden=HIDDEN * 2)
    save_file(wide, str(tmp_path / "wide.safetensors"))
    with pytest.raises(CheckpointError, match=r"0\.0\.linear\.weight has shape \(128, 128\).*hidden size 64"):
        write_medusa_role(bundle_copy, str(tmp_path / "wide.safetensors"))
    vocab = fd_heads(2, 1, lm_heads={1: torch.randn(VOCAB - 1, HIDDEN)})
    with pytest.raises(CheckpointError, match=rf"head 1 lm_head has shape \({VOCAB - 1}, {HIDDEN}\).*\({VOCAB}, {HIDDEN}\)"):
        write_medusa_role(bundle_copy, parse_heads(vocab, "vocab"))
    padded = torch.cat([torch.randn(VOCAB, HIDDEN), torch.ones(4, HIDDEN)])  # padding that is not zero
    with pytest.raises(CheckpointError, match="not zero padding"):
        write_medusa_role(bundle_copy, parse_heads(fd_heads(2, 1, lm_heads={0: padded}), "pad"))


def test_tree_depth_against_heads(bundle_copy):
    heads = parse_heads(fd_heads(3, 1), "three")
    with pytest.raises(CheckpointError, match=r"depth 4 but the Medusa heads guess only 3 tokens ahead"):
        write_medusa_role(bundle_copy, heads, "mc_sim_7b_63")
    entry = write_medusa_role(bundle_copy, heads, "chain_3")
    assert entry["tree"] == "chain_3" and entry["tree_nodes"] == 3


# ---- the bundle role: shared lm_head --------------------------------------------------------------
def test_shared_lm_head_detected_and_recorded(bundle_copy, tmp_path):
    target = target_lm_head(bundle_copy)
    fd = fd_heads(3, 1, lm_heads={0: target.clone(), 2: target.half()})  # an fp16 copy is still the target's
    padded = torch.cat([fd["1.1.weight"], torch.zeros(2, HIDDEN)])  # TensorRT-LLM vocab padding
    save_file(to_trt({**fd, "1.1.weight": padded}, 1), str(tmp_path / "heads.safetensors"))
    entry = add_medusa(bundle_copy, str(tmp_path / "heads.safetensors"), "mc_sim_7b_top10")
    assert entry["shares"] == {"0.1.weight": "target/lm_head", "2.1.weight": "target/lm_head"}
    stored = load_file(os.path.join(bundle_copy, "medusa", "heads.safetensors"))
    assert "0.1.weight" not in stored and "2.1.weight" not in stored
    assert torch.equal(stored["1.1.weight"], fd["1.1.weight"])
    meta = read_meta(bundle_copy)
    assert meta.roles["medusa"]["shares"] == entry["shares"]
    assert meta.limits.max_draft_len >= 10 and meta.default_speculation["method"] == "medusa"
    assert load_tree(os.path.join(bundle_copy, "medusa", "tree.json"), allow_files=True) == load_tree("mc_sim_7b_top10")
    # at run time the shared heads use the target's own tensor: no copy
    weights = load_file(os.path.join(bundle_copy, "target", "weights.safetensors"))
    role = load_medusa(bundle_copy, weights)
    assert role.heads.lm_heads[0] is weights["lm_head"] and role.heads.lm_heads[2] is weights["lm_head"]
    assert role.tree.num_drafts == 10 and not role.heads.all_shared


def test_tied_embedding_is_shared_as_embed(tiny_hf_dir, tmp_path):
    from tiny import make_tiny_hf

    from specbuild.compiler.compile import CompileOptions, compile_bundle

    src = make_tiny_hf(str(tmp_path / "tied"), tie=True, seed=3)
    bundle = compile_bundle(src, str(tmp_path / "b"), CompileOptions(max_seq_len=64))
    embed = load_file(os.path.join(bundle, "target", "weights.safetensors"))["embed"]
    entry = add_medusa(bundle, parse_heads(fd_heads(2, 1, lm_heads={0: embed, 1: embed}), "tied"))
    assert entry["shares"] == {"0.1.weight": "target/embed", "1.1.weight": "target/embed"}
    assert entry["tree"] == "chain_2"  # the default tree is deeper than 2 heads
    assert load_medusa(bundle, load_file(os.path.join(bundle, "target", "weights.safetensors"))).heads.all_shared


# ---- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fasterdecoding", "tensorrt-llm"])
def test_export_round_trip(bundle_copy, tmp_path, fmt):
    target = target_lm_head(bundle_copy)
    fd = fd_heads(3, 2, lm_heads={1: target.clone()})
    add_medusa(bundle_copy, parse_heads(fd, "src"), "mc_sim_7b_top10")
    out = str(tmp_path / fmt)
    paths = export_medusa(bundle_copy, fmt, out)
    raw = load_file(paths[0])
    lm_name = "1.2.weight" if fmt == "fasterdecoding" else "medusa_heads.1.lm_head.weight"
    assert lm_name in raw and torch.equal(raw[lm_name], target)  # the shared lm_head written as a copy
    ptrs = {t.data_ptr() for t in raw.values()}
    assert len(ptrs) == len(raw)
    back = read_medusa(out)
    assert back.layout == fmt and (back.num_heads, back.num_layers) == (3, 2)
    got = back.tensors()
    assert set(got) == set(fd) and all(torch.equal(got[k], fd[k]) for k in fd)
    cfg = json.load(open(os.path.join(out, "config.json")))
    key = "medusa_num_heads" if fmt == "fasterdecoding" else "num_medusa_heads"
    assert cfg[key] == 3
    # compiling the export again finds the same sharing
    again = str(tmp_path / "again")
    shutil.copytree(bundle_copy, again)
    assert add_medusa(again, out)["shares"] == {"1.2.weight": "target/lm_head"}


# ---- runtime heads ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers", [0, 1, 2])
def test_heads_forward_matches_reference(num_layers):
    gen = torch.Generator().manual_seed(num_layers)
    shared = torch.randn(VOCAB, HIDDEN, generator=gen)
    fd = fd_heads(4, num_layers, seed=7)
    del fd[f"0.{num_layers}.weight"], fd[f"3.{num_layers}.weight"]  # heads 0 and 3 share
    hidden = torch.randn(5, HIDDEN, generator=gen)
    heads = MedusaHeads(fd, 4, num_layers, shared)
    got = heads.forward(hidden)
    want = reference_medusa_logits(fd, 4, num_layers, shared, hidden)
    assert got.shape == (5, 4, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(heads.forward(hidden, 2).double(), want[:, :2], rtol=1e-5, atol=1e-4)
    all_shared = {k: v for k, v in fd.items() if "linear" in k}
    heads = MedusaHeads(all_shared, 4, num_layers, shared)
    assert heads.all_shared
    torch.testing.assert_close(heads.forward(hidden).double(),
                               reference_medusa_logits(all_shared, 4, num_layers, shared, hidden), rtol=1e-5, atol=1e-4)


# ---- the proposer ----------------------------------------------------------------------------------
def forced_heads(num_heads: int, vocab: int = 40, seed: int = 0) -> tuple[MedusaHeads, torch.Tensor]:
    """Heads with no residual layers whose logits on hidden e_j are a known random order:
    returns (heads, order [num_heads, hidden, vocab]) with order[h, j] best first."""
    gen = torch.Generator().manual_seed(seed)
    hidden = 3
    weights, order = {}, []
    for h in range(num_heads):
        scores = torch.stack([torch.randperm(vocab, generator=gen).float() for _ in range(hidden)], 1)  # [V, hidden]
        weights[f"{h}.0.weight"] = scores
        order.append(scores.T.argsort(dim=-1, descending=True))
    return MedusaHeads(weights, num_heads, 0, None), torch.stack(order)


def test_proposer_builds_tree_tokens_from_forced_logits():
    heads, order = forced_heads(3)
    prop = MedusaProposer(heads, load_tree("mc_sim_7b_top10"))
    tree, chain = load_tree("mc_sim_7b_top10"), TreeSpec.chain(2)
    hidden = torch.eye(3)[[1, 2, 0]]  # row b reads basis vector (1, 2, 0)[b]
    drafts = prop.propose_from_hidden(hidden, [tree, None, chain])
    assert drafts[1] is None
    for b, spec in ((0, tree), (2, chain)):
        basis = (1, 2, 0)[b]
        want = [int(order[d - 1, basis, r]) for d, r in zip(spec.depths[1:], spec.ranks[1:])]
        d = drafts[b]
        assert d.tokens == want and len(d) == spec.num_drafts and d.method == "medusa" and d.probs is None
        assert d.parents == spec.parents and d.depths == list(spec.depths[1:])
        assert torch.equal(d.tree_mask, spec.ancestor_mask_tensor())
    # node [1, 0]: the 2nd guess of head 0, then the best guess of head 1
    node = tree.index[(1, 0)]
    assert drafts[0].tokens[node - 1] == int(order[1, 1, 0]) and tree.parents[node] == tree.index[(1,)]


def test_propose_uses_current_hidden_gamma_and_request_tree():
    heads, order = forced_heads(3)
    prop = MedusaProposer(heads, load_tree("mc_sim_7b_top10"))

    ids = iter(range(1, 100))

    def seq(total_len, tree=None):
        return SimpleNamespace(seq_id=next(ids), spec_state=SpecState(), total_len=total_len,
                               spec=SimpleNamespace(tree=tree))

    fresh, stale, chain, none_yet = seq(10), seq(10), seq(7, "chain_3"), seq(5)
    for s, basis in ((fresh, 0), (stale, 1), (chain, 2)):  # the pass kept total_len - 1 tokens
        prop.observe(s, Observation(s.total_len - 1, 0, None, hidden=torch.eye(3)[basis]))
    stale.total_len = 12  # tokens appended since: the hidden is not the root's
    drafts = prop.propose([fresh, stale, chain, none_yet], [2, 4, 4, 4])
    assert drafts[1] is None and drafts[3] is None
    assert drafts[0].depths and max(drafts[0].depths) == 2  # gamma 2 prunes the depth-3 tree
    assert len(drafts[0]) == len([p for p in load_tree("mc_sim_7b_top10").paths if len(p) <= 2])
    assert drafts[2].tokens == [int(order[h, 2, 0]) for h in range(3)]
    assert prop.propose([fresh], [0]) == [None]
    with pytest.raises(RequestError, match="depth 4 but the bundle has 3 Medusa heads"):
        prop.validate_tree("mc_sim_7b_63")
    prop.release(fresh)
    assert prop.hidden_of(fresh) is None and fresh.seq_id not in prop.hidden


# ---- train-medusa --------------------------------------------------------------------------------
def write_prompts(path, n: int) -> str:
    words = ["the cat", "a tree", "in the", "the sea", "at noon", "is on", "we saw", "the end"]
    with open(path, "w") as f:
        for i in range(n):
            rec = {"question_id": 9000 + i, "turns": [f"{words[i % 8]} {words[(3 * i) % 8]} {i}"]} if i % 2 \
                else {"prompt": f"{words[(5 * i) % 8]} then {words[i % 8]}"}
            f.write(json.dumps(rec) + "\n")
    return str(path)


def test_train_medusa_learns_and_resumes(tiny_bundle, tmp_path):
    from specbuild.train.medusa import MedusaTrainConfig, train_medusa

    data = write_prompts(tmp_path / "data.jsonl", 14)
    out = str(tmp_path / "heads")
    cfg = MedusaTrainConfig(num_heads=2, num_layers=1, steps=80, batch_positions=32, lr=1e-2, max_prompts=12,
                            eval_prompts=2, max_answer_tokens=24, bf16="off", ignore_eos=True)
    report = train_medusa(tiny_bundle, data, out, cfg, progress=False, log=lambda m: None)
    assert report["steps"] == 80 and report["train_prompts"] == 12 and report["eval_prompts"] >= 1
    first, last = sum(report["first_losses"][:5]) / 5, sum(report["last_losses"][-5:]) / 5
    assert last < 0.7 * first, (first, last)
    before, after = report["accuracy_before"], report["accuracy_after"]
    assert len(after) == 2 and after[0]["positions"] > 0
    assert after[0]["top1"] > before[0]["top1"]
    ranks = report["rank_accuracy"]  # per head and rank; rank 0 is top-1
    assert len(ranks) == 2 and len(ranks[0]) == 10 and ranks[0][0] == pytest.approx(after[0]["top1"], abs=1e-3)
    assert sum(ranks[0][:5]) == pytest.approx(after[0]["top5"], abs=1e-3)
    trees = report["sparse_trees"]
    assert [t["drafts"] for t in trees][:3] == [2, 3, 4]
    assert all(a["expected_accepted"] <= b["expected_accepted"] for a, b in zip(trees, trees[1:]))
    from specbuild.speculation.tree import load_tree

    assert load_tree(trees[2]["file"], allow_files=True).num_drafts == 4
    heads = read_medusa(out)  # FasterDecoding layout; the shared lm_head is not stored
    assert (heads.num_heads, heads.num_layers, heads.lm_heads) == (2, 1, {})
    assert json.load(open(os.path.join(out, "config.json")))["shared_lm_head"] is True
    answers = open(os.path.join(out, "answers_train.jsonl")).read()
    ckpt_before = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)

    resumed = train_medusa(tiny_bundle, data, out, MedusaTrainConfig(**{**cfg.__dict__, "steps": 100}), resume=True,
                           progress=False, log=lambda m: None)
    assert resumed["steps"] == 100
    assert open(os.path.join(out, "answers_train.jsonl")).read() == answers  # answers reused, not regenerated
    ckpt = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert ckpt["step"] == 100 and ckpt["history"][:80] == ckpt_before["history"]
    assert not torch.equal(ckpt["model"]["weight"], ckpt_before["model"]["weight"])

    # --extra-answers: more sequences (e.g. sampled answers) join the training positions;
    # an answer to an eval prompt is refused so the accuracy report stays held out
    recs = [json.loads(line) for line in open(os.path.join(out, "answers_train.jsonl"))]
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({**r, "id": f"{r['id']}~1"}) + "\n" for r in recs[:4]))
    more = train_medusa(tiny_bundle, data, str(tmp_path / "more"),
                        MedusaTrainConfig(**{**cfg.__dict__, "steps": 5, "extra_answers": (str(extra),)}),
                        progress=False, log=lambda m: None)
    assert more["train_positions"] > report["train_positions"]
    evals = [json.loads(line) for line in open(os.path.join(out, "answers_eval.jsonl"))]
    extra.write_text(json.dumps({**evals[0], "id": f"{evals[0]['id']}~3"}) + "\n")
    with pytest.raises(SpecbuildError, match="is an eval prompt"):
        train_medusa(tiny_bundle, data, str(tmp_path / "bad"),
                     MedusaTrainConfig(**{**cfg.__dict__, "steps": 5, "extra_answers": (str(extra),)}),
                     progress=False, log=lambda m: None)


def test_trained_heads_draft_what_the_target_says(tiny_bundle, tmp_path):
    """End to end on the convention: heads trained on the target's answers, read from the
    hidden at the row that chose the root, propose trees whose nodes the target's greedy
    verification accepts. Measured: 30 of 36 possible nodes accepted; heads trained one
    token off (head k on token t + 3 + k) get 0, so the bound has power."""
    from specbuild.train.medusa import MedusaTrainConfig, train_medusa
    from specbuild.engine.engine import Engine
    from specbuild.model.decoder import ForwardBatch
    from specbuild.sampling.acceptance import verify_tree_greedy

    data = write_prompts(tmp_path / "data.jsonl", 14)
    out = str(tmp_path / "heads")
    train_medusa(tiny_bundle, data, out, MedusaTrainConfig(num_heads=3, steps=300, batch_positions=32, lr=1e-2,
                                                           max_prompts=12, eval_prompts=2, max_answer_tokens=24,
                                                           bf16="off", ignore_eos=True), progress=False, log=lambda m: None)
    bundle = str(tmp_path / "bundle")
    shutil.copytree(tiny_bundle, bundle)
    add_medusa(bundle, out, "mc_sim_7b_top10")
    engine = Engine(bundle)
    role = load_medusa(bundle, engine.model.w)
    prop = MedusaProposer(role.heads, role.tree)
    model, cache = engine.model, engine.model.new_cache(8, 16)
    drafted = accepted = 0
    for line in open(os.path.join(out, "answers_train.jsonl")).readlines()[:12]:
        rec = json.loads(line)
        ids = rec["prompt_ids"] + rec["answer_ids"][:1]  # the root: the target's first answer token
        t = len(ids)
        slots = torch.arange(t)
        hidden = model.forward(ForwardBatch(torch.tensor(ids), slots, slots, slots,
                                            torch.ones(t, t, dtype=torch.bool).tril(), torch.tensor([t - 2])),
                               cache, return_hidden=True).hidden
        seq = SimpleNamespace(seq_id=-1, spec_state=SpecState(), total_len=t, spec=SimpleNamespace(tree=None))
        prop.observe(seq, Observation(t - 1, 0, None, hidden=hidden[0]))
        draft = prop.propose([seq], [8])[0]
        # verify: feed root + tree nodes with the tree mask over the cached prefix
        n = len(draft) + 1
        tokens = torch.tensor([ids[-1]] + draft.tokens)
        mask = torch.cat([torch.ones(n, t - 1, dtype=torch.bool), draft.tree_mask], 1)
        positions = torch.tensor(draft.depths, dtype=torch.int64)
        batch = ForwardBatch(tokens, torch.cat([torch.tensor([0]), positions]) + t - 1,
                             torch.arange(t - 1, t - 1 + n), torch.arange(t - 1 + n), mask, torch.arange(n))
        logits = model.forward(batch, cache).logits
        result = verify_tree_greedy(draft.parents, tokens, logits)
        drafted += 1
        accepted += len(result.accepted_nodes)
        assert list(result.tokens[:-1]) == rec["answer_ids"][1:1 + len(result.accepted_nodes)]
    assert drafted == 12 and accepted >= 18, accepted


def test_medusa_depths_are_charged_their_measured_cost(bundle_copy):
    """Each Medusa depth runs one head and the full-vocabulary output layer it shares with the
    target; the cost model charges it (measured at load), not zero."""
    from specbuild.engine.engine import Engine, EngineConfig

    add_medusa(bundle_copy, parse_heads(fd_heads(3, 1), "three"), "chain_3")
    engine = Engine(bundle_copy, EngineConfig())
    costs = engine.speculator.controller.costs
    assert "medusa" in engine.speculator.proposers and costs["medusa"].draft_cost > 0
    assert costs["ngram"].draft_cost == 0.0
