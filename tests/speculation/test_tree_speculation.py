"""Tree speculation through the engine with an oracle-ish tree drafter (a noisy copy of
the target ranks the candidates), so the tree path (mask, positions, tree verification,
KV compaction) is tested independently of Medusa heads."""

from __future__ import annotations

import os

import pytest
import torch

from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.speculation.tree import TreeSpec, load_tree
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.speculation.proposers.base import Draft, DrafterBase
from specbuild.sampling.params import SamplingParams
from specbuild.engine.sequence import Request
from specbuild.speculation.config import SpeculationConfig
from specbuild.bench.verify_dist import check, last_logits
from tiny import make_tiny_hf

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21], list(range(30, 70))]


class NoisyTreeProposer(DrafterBase):
    """Builds each node's token as the ranks[i]-th most likely token of (target logits +
    noise) after the node's parent path: deterministic candidates, like Medusa's top-k."""

    name = "medusa"

    def __init__(self, engine: Engine, trees: dict, noise: float = 0.3) -> None:
        self.engine, self.trees, self.noise = engine, trees, noise
        self.proposed = 0

    def propose(self, seqs, gammas):
        out = []
        for seq, gamma in zip(seqs, gammas):
            tree: TreeSpec = self.trees[seq.spec.tree or "default"]
            if gamma == 0:
                out.append(None)
                continue
            gen = torch.Generator().manual_seed(seq.total_len)
            node_tokens = [seq.all_ids[-1]]
            ranked = {}
            for i in range(1, tree.num_nodes):
                parent = tree.parents[i]
                if parent not in ranked:
                    path = []
                    p = parent
                    while p > 0:
                        path.append(node_tokens[p])
                        p = tree.parents[p]
                    logits = last_logits(self.engine, seq.all_ids + path[::-1])
                    logits = logits + self.noise * torch.randn(logits.shape, generator=gen, dtype=logits.dtype)
                    ranked[parent] = torch.argsort(logits, descending=True).tolist()
                node_tokens.append(ranked[parent][tree.ranks[i]])
            self.proposed += tree.num_drafts
            out.append(Draft(node_tokens[1:], None, tree.parents, list(tree.depths[1:]),
                             tree.ancestor_mask_tensor(), method="medusa"))
        return out

    def rollback(self, seq, length):
        pass

    def release(self, seq):
        pass


def tree_engine(root, dtype: str) -> Engine:
    """A tiny target in `dtype` whose Medusa slot is the noisy tree proposer (three trees)."""
    target = make_tiny_hf(str(root / "t"), scale=4.0, seed=3)
    bundle = compile_bundle(target, str(root / "b"), CompileOptions(dtype=dtype, max_draft_len=16))
    eng = Engine(bundle, EngineConfig(max_batch_size=4))
    trees = {"default": TreeSpec.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
             "chain": TreeSpec.chain(4), "mc10": load_tree("mc_sim_7b_top10")}
    eng.speculator.proposers["medusa"] = NoisyTreeProposer(eng, trees)
    return eng


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tree_engine(tmp_path_factory.mktemp("tree"), "float64")


def run(engine, tree=None, method="medusa", prompts=PROMPTS, max_tokens=30, trees=None, **sampling):
    reqs = []
    for i, p in enumerate(prompts):
        t = trees[i] if trees else tree
        spec = SpeculationConfig.make(None, method=method, gamma=4) if method != "none" else None
        if spec is not None and t is not None:
            spec = SpeculationConfig.make(spec, tree=t)
        reqs.append(Request(prompt_ids=p, speculation=spec or SpeculationConfig.make(None, method="none"),
                            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)))
    return engine.generate(reqs)


def test_greedy_tree_speculation_equals_plain_for_mixed_trees(engine):
    plain = run(engine, method="none")
    for trees in (["default"] * 3, ["chain"] * 3, ["default", "chain", "mc10"]):
        before = engine.speculator.proposers["medusa"].proposed
        spec = run(engine, trees=trees)
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain], trees
        assert engine.speculator.proposers["medusa"].proposed > before
        assert sum(r["stats"]["accepted"] for r in spec) > 0
        assert max(r["stats"]["mean_accepted_tokens"] for r in spec) > 1.3
    assert engine.cache.free_blocks == engine.cache.num_blocks


def test_kv_after_tree_steps_equals_plain_prefill(engine):
    h = engine.submit(Request(prompt_ids=PROMPTS[2], speculation=SpeculationConfig.make(None, method="medusa", gamma=4,
                                                                                        tree="mc10"),
                              sampling=SamplingParams(max_tokens=40, ignore_eos=True)))
    for _ in range(8):
        engine.step()
    seq = h.seq
    assert seq.tally.accepted > 0 and not seq.finished
    n = seq.num_cached
    cache = engine.cache
    slots = cache.slots(seq.seq_id, 0, n)
    k_spec, v_spec = cache.rows(slots)
    # a plain prefill of the same tokens in a scratch sequence
    from specbuild.model.decoder import ForwardBatch

    cache.add(-3)
    cache.reserve(-3, n)
    s2 = cache.slots(-3, 0, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    engine.model.forward(ForwardBatch(torch.tensor(seq.all_ids[:n]), torch.arange(n), s2, s2, mask,
                                      torch.tensor([n - 1])), cache)
    k2, v2 = cache.rows(s2)
    assert torch.allclose(k2, k_spec, atol=1e-9) and torch.allclose(v2, v_spec, atol=1e-9)
    cache.release(-3)
    h.result()


def test_sampled_tree_speculation_matches_exact_distribution(engine):
    r = check(engine, PROMPTS[0], 1.0, 3, SpeculationConfig.make(None, method="medusa", gamma=4, tree="default"), 600)
    assert r.drafted > 0 and r.accepted > 0
    assert r.p_value > 0.001, r


@pytest.fixture(scope="module")
def medusa_bundle(tmp_path_factory, tiny_bundle):
    """The tiny bundle compiled with Medusa heads trained on its own answers (seconds)."""
    import json

    from specbuild.train.medusa import MedusaTrainConfig, train_medusa

    root = tmp_path_factory.mktemp("medusa")
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for i in range(14):
            f.write(json.dumps({"prompt": " ".join(f"word{(i * 7 + j) % 23}" for j in range(12))}) + "\n")
    heads = str(root / "heads")
    train_medusa(tiny_bundle, str(data), heads,
                 MedusaTrainConfig(num_heads=3, steps=300, batch_positions=32, lr=1e-2, max_prompts=12, eval_prompts=2,
                                   max_answer_tokens=24, bf16="off", ignore_eos=True), progress=False,
                 log=lambda m: None)
    source = json.load(open(os.path.join(tiny_bundle, "bundle.json")))["roles"]["target"]["source"]
    return compile_bundle(source, str(root / "bundle"), CompileOptions(dtype="float32"), medusa=heads,
                          tree="mc_sim_7b_top10")


def test_compiled_medusa_bundle_is_lossless_and_accepts(medusa_bundle):
    engine = Engine(medusa_bundle, EngineConfig(max_batch_size=4))
    assert engine.default_speculation.method == "medusa" and "medusa" in engine.methods
    prompts = [engine.encode(" ".join(f"word{(3 * j) % 23}" for j in range(10))), [40, 41, 42]]
    plain = run(engine, method="none", prompts=prompts, max_tokens=24)
    for tree in (None, "chain_2", "mc_sim_7b_top10"):
        spec = run(engine, tree=tree, prompts=prompts, max_tokens=24)
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain], tree
        assert sum(r["stats"]["drafted"] for r in spec) > 0
    assert sum(r["stats"]["accepted"] for r in spec) > 0
    with pytest.raises(ValueError, match="depth 4 but the bundle has 3 Medusa heads"):
        engine.submit(Request(prompt_ids=[1, 2], speculation=SpeculationConfig.make(None, method="medusa",
                                                                                    tree="chain_4")))


def test_medusa_refuses_a_quantized_shared_lm_head(medusa_bundle, tmp_path):
    import json

    source = json.load(open(os.path.join(medusa_bundle, "bundle.json")))["roles"]["target"]["source"]
    heads = json.load(open(os.path.join(medusa_bundle, "bundle.json")))["roles"]["medusa"]["source"]
    with pytest.raises(Exception, match="Medusa heads need it dense"):
        compile_bundle(source, str(tmp_path / "q"), CompileOptions(quantize="int8", lm_head_format="int8"),
                       medusa=heads)
    assert not os.path.exists(tmp_path / "q")


def test_bench_rows_per_tree_and_verify_costs(medusa_bundle, tmp_path):
    """`bench --tree a,b --verify-costs`: a Medusa row per tree (lossless, speculating) and
    one timed forward per verify width (decode step, chain of 5, each tree)."""
    import json

    from click.testing import CliRunner

    from specbuild.bench.specbench import format_table
    from specbuild.cli.main import main

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "qa",
                                        "turns": [" ".join(f"word{(i * 5 + j) % 23}" for j in range(10))]}) + "\n"
                            for i in range(3)))
    result = CliRunner().invoke(main, ["bench", medusa_bundle, "--dataset", str(data), "--split", "all",
                                       "--max-tokens", "12", "--repeats", "1", "--speculation", "medusa",
                                       "--tree", "chain_2,mc_sim_7b_top10", "--verify-costs", "--threads", "1",
                                       "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    names = [r["name"] for r in report["rows"]]
    assert names == ["specbuild none", "specbuild medusa[chain_2]", "specbuild medusa[mc_sim_7b_top10]"]
    for r in report["rows"][1:]:
        o = r["groups"]["overall"]
        assert o["mismatches"] == 0 and o["compared"] == 3 and o["drafted"] > 0 and o["accepted"] > 0, r["name"]
    # the wider tree proposes more nodes per pass than the 2-node chain
    assert report["rows"][2]["groups"]["overall"]["drafted"] > report["rows"][1]["groups"]["overall"]["drafted"]
    shapes = {s["name"]: s for s in report["verify_costs"]["shapes"]}
    assert [(s["nodes"], s["width"]) for s in shapes.values()] == [(0, 1), (5, 6), (2, 3), (10, 11)]
    assert shapes["decode step"]["x_step"] == 1.0 and all(s["min_ms"] > 0 for s in shapes.values())
    table = format_table(report)
    assert "verify cost by width" in table and "mc_sim_7b_top10" in table
    bad = CliRunner().invoke(main, ["bench", medusa_bundle, "--speculation", "ngram", "--tree", "chain_2",
                                    "--no-progress"])
    assert bad.exit_code == 2 and "--tree applies to Medusa rows" in bad.output


def test_heads_config_names_the_default_tree(medusa_bundle, tmp_path):
    """A heads directory whose config.json carries `specbuild_tree` (the trainer's measured
    choice) compiles with that tree unless --tree overrides it; a bad one is refused."""
    import json
    import shutil

    meta = json.load(open(os.path.join(medusa_bundle, "bundle.json")))
    heads = str(tmp_path / "heads")
    shutil.copytree(os.path.dirname(meta["roles"]["medusa"]["source"]), heads)
    cfg_path = os.path.join(heads, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "specbuild_tree": "chain_2"}, open(cfg_path, "w"))
    source = meta["roles"]["target"]["source"]
    b = compile_bundle(source, str(tmp_path / "b1"), CompileOptions(dtype="float32"), medusa=heads)
    assert json.load(open(os.path.join(b, "bundle.json")))["roles"]["medusa"]["tree_nodes"] == 2
    b = compile_bundle(source, str(tmp_path / "b2"), CompileOptions(dtype="float32"), medusa=heads,
                       tree="mc_sim_7b_top10")
    assert json.load(open(os.path.join(b, "bundle.json")))["roles"]["medusa"]["tree_nodes"] == 10
    json.dump({**cfg, "specbuild_tree": "chain_9"}, open(cfg_path, "w"))
    with pytest.raises(Exception, match="depth 9"):
        compile_bundle(source, str(tmp_path / "b3"), CompileOptions(dtype="float32"), medusa=heads)


def test_a_request_tree_is_a_preset_or_inline_paths_never_a_file(medusa_bundle, tmp_path):
    """Whatever the front end (HTTP, Triton, Python), a request's tree opens no file; inline
    paths work and stay lossless; the CLI's --tree file is read by the CLI into paths."""
    import json

    from specbuild.errors import RequestError
    from specbuild.speculation.tree import tree_argument

    engine = Engine(medusa_bundle, EngineConfig(max_batch_size=4))
    path = tmp_path / "tree.json"
    path.write_text(json.dumps([[0], [0, 0], [1], [0, 0, 0]]))
    for tree in (str(path), "/etc/passwd"):
        with pytest.raises(RequestError, match="never a file"):
            engine.submit(Request(prompt_ids=[40, 41, 42], speculation={"method": "medusa", "tree": tree}))
    prompts = [engine.encode(" ".join(f"word{(i * 7 + j) % 23}" for j in range(12))) for i in range(3)]
    plain = run(engine, method="none", prompts=prompts, max_tokens=30)
    inline = run(engine, tree=tree_argument(str(path)), prompts=prompts, max_tokens=30)
    assert [r["token_ids"] for r in inline] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["drafted"] for r in inline) > 0
    assert sum(r["stats"]["accepted"] for r in inline) > 0


@pytest.fixture(scope="module")
def engine_bf16(tmp_path_factory):
    return tree_engine(tmp_path_factory.mktemp("tree_bf16"), "bfloat16")


def test_bfloat16_tree_speculation_equals_plain_with_batched_invariant_attention(engine_bf16):
    """bfloat16 hidden states: attention runs one batched row-invariant call per sequence
    (tree nodes off the first branch gather their own keys), and tree and chain speculation,
    batched with other sequences, give plain decoding's tokens exactly."""
    assert engine_bf16.model.row_invariant and engine_bf16.model.dtype == torch.bfloat16
    plain = run(engine_bf16, method="none")
    for trees in (["default"] * 3, ["default", "chain", "mc10"]):
        spec = run(engine_bf16, trees=trees)
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain], trees
        assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    chain = run(engine_bf16, method="ngram")
    assert [r["token_ids"] for r in chain] == [r["token_ids"] for r in plain]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_medusa_faults_stay_in_their_request(medusa_bundle, monkeypatch, sampled):
    """tests/engine/test_fault_isolation.py's checks on the trained Medusa bundle: a fault
    in one request (heads, verification, NaN rows) leaves its neighbours' tokens unchanged."""
    from faults import check_isolation

    engine = Engine(medusa_bundle, EngineConfig(max_batch_size=4))
    prompts = [engine.encode(" ".join(f"word{(3 * j) % 23}" for j in range(10))), [40, 41, 42],
               engine.encode(" ".join(f"word{(7 * j) % 23}" for j in range(12))),
               engine.encode(" ".join(f"word{(14 + j) % 23}" for j in range(12)))]  # the heads' own training text
    # a fixed depth (gamma 3): every step drafts the whole tree, whatever the depth controller
    # would learn from calibrated costs, so acceptance depends on the heads alone
    check_isolation(engine, "medusa", prompts, monkeypatch, sampled, drafts_independent=True, max_tokens=24, gamma=3)


def test_medusa_extreme_sampling_parameters(medusa_bundle):
    """The issue's trigger (temperature 1e-38 made every Medusa tree verification raise, for
    every request in the batch) and the other extremes: a 4xx, the greedy or the seeded
    answer (tests/helpers/extreme.py)."""
    from extreme import check_extreme

    engine = Engine(medusa_bundle, EngineConfig(max_batch_size=2))
    check_extreme(engine, ["none", "medusa"], engine.encode(" ".join(f"word{(3 * j) % 23}" for j in range(10))),
                  examples=10)


def test_medusa_second_turn_reuses_the_prefix_and_matches_the_uncached_engine(medusa_bundle):
    """Prefix caching under Medusa: the heads read the last prompt row, which is always computed,
    so a second turn reuses the first turn's blocks and still drafts and accepts. The bundle is
    float32 (not row-invariant): greedy tokens must match the engine without the cache."""
    on = Engine(medusa_bundle, EngineConfig(max_batch_size=4))
    off = Engine(medusa_bundle, EngineConfig(max_batch_size=4, prefix_cache=False))
    turn1 = on.encode(" ".join(f"word{(3 * j) % 23}" for j in range(12)))
    out, accepted = {}, 0
    for name, engine in (("on", on), ("off", off)):
        first = run(engine, prompts=[turn1], max_tokens=16)[0]
        out[name] = run(engine, prompts=[turn1 + first["token_ids"] + on.encode(" word3 word6")], max_tokens=24)[0]
        accepted += first["stats"]["accepted"] + out[name]["stats"]["accepted"]
    assert out["on"]["token_ids"] == out["off"]["token_ids"]
    assert out["on"]["stats"]["cached_tokens"] >= len(turn1) // 16 * 16 > 0
    assert out["off"]["stats"]["cached_tokens"] == 0
    assert out["on"]["stats"]["drafted"] > 0 and accepted > 0
    on.cache.check()
