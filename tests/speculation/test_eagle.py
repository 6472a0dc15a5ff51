"""EAGLE-3 heads: the decoder's aux features, the checkpoint layout (round trip byte for
byte and an independent reading of the safetensors bytes), train-eagle on a tiny target,
greedy equality with drafts proposed and accepted, the sampled distribution (chi-square)
with a broken variant that fails, and the dynamic tree's node budget."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from stats_util import broken_tree_rule
import torch

from specbuild.bench.verify_dist import check
from specbuild.compiler.compile import CompileOptions, compile_bundle
from specbuild.compiler.eagle_role import export_eagle
from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.errors import CheckpointError
from specbuild.formats import eagle3
from specbuild.model.decoder import ForwardBatch
from specbuild.sampling.params import SamplingParams
from specbuild.speculation import speculator as speculator_mod
from specbuild.speculation.config import SpeculationConfig
from specbuild.train.eagle import EagleTrainConfig, target_features, train_eagle
from tiny import make_tiny_hf


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    bundle = compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float32", max_draft_len=10))
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": " ".join(f"word{(i * 7 + j) % 23}" for j in range(12))}) + "\n")
    head = str(root / "head")
    report = train_eagle(bundle, str(data), head, EagleTrainConfig(
        draft_vocab=200, max_prompts=12, eval_prompts=3, max_answer_tokens=24, ignore_eos=True, steps=150, lr=3e-3),
        progress=False, log=lambda m: None)
    with_head = compile_bundle(target, str(root / "bundle_eagle"), CompileOptions(dtype="float32", max_draft_len=10),
                               eagle=head)
    held = [json.loads(line)["prompt_ids"] for line in open(os.path.join(head, "answers_eval.jsonl"))]
    return {"root": root, "target": target, "bundle": bundle, "head": head, "report": report,
            "with_head": with_head, "prompts": held}


def test_decoder_hands_out_aux_features_only_when_asked(trained):
    engine = Engine(trained["bundle"], EngineConfig())
    ids = [5, 6, 7, 8, 9, 10]
    n = len(ids)
    cache = engine.cache
    cache.add(-5)
    try:
        cache.reserve(-5, n)
        slots = cache.slots(-5, 0, n)
        batch = ForwardBatch(torch.tensor(ids), torch.arange(n), slots, slots, torch.ones(n, n, dtype=torch.bool).tril(),
                             torch.tensor([n - 1]))
        out = engine.model.forward(batch, cache)
        plain = out.logits
        assert out.aux is None and out.hidden is None  # no aux_layers: nothing extra
        out = engine.model.forward(batch, cache, aux_layers=(0, 1, 0), aux_rows=torch.tensor([1, 4]))
        logits, feats = out.logits, out.aux
    finally:
        cache.release(-5)
    h = engine.target_config.hidden_size
    assert torch.equal(logits, plain) and feats.shape == (2, 3 * h)
    emb = engine.model.w["embed"][torch.tensor([6, 9])]
    assert torch.allclose(feats[:, :h], emb) and torch.allclose(feats[:, 2 * h:], emb)  # layer 0 input = embedding
    # the features of a row do not depend on later rows (chunked prefill sees the same)
    full, _ = target_features(engine.model, cache, ids, (1, 1, 1))
    part, _ = target_features(engine.model, cache, ids[:4], (1, 1, 1))
    assert torch.allclose(full[:4], part, atol=1e-5)


def read_safetensors_by_hand(path: str) -> dict[str, np.ndarray]:
    """An independent reader of the file format: 8-byte little-endian header size, a JSON
    header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes."""
    dtypes = {"F32": np.float32, "I64": np.int64, "BOOL": np.bool_, "F16": np.float16}
    with open(path, "rb") as f:
        raw = f.read()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + size + a:8 + size + b], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def test_checkpoint_layout_round_trip_and_independent_reading(trained, tmp_path):
    head = trained["head"]
    config, tensors = eagle3.read_eagle3(head)
    eagle3.write_eagle3(str(tmp_path / "again"), config, tensors)
    for name in (eagle3.CONFIG, eagle3.WEIGHTS):
        assert open(os.path.join(head, name), "rb").read() == open(tmp_path / "again" / name, "rb").read(), name
    # export-eagle from the compiled bundle gives the same bytes back
    export_eagle(trained["with_head"], str(tmp_path / "exported"))
    for name in (eagle3.CONFIG, eagle3.WEIGHTS):
        assert open(os.path.join(head, name), "rb").read() == open(tmp_path / "exported" / name, "rb").read(), name
    # independent reading: the names, shapes and maps the loaders expect
    raw = read_safetensors_by_hand(os.path.join(head, eagle3.WEIGHTS))
    cfg = json.load(open(os.path.join(head, eagle3.CONFIG)))
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(trained["report"]["aux_layers"])
    expect = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h), "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * d), "midlayer.hidden_norm.weight": (h,),
              "midlayer.input_layernorm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.mlp.gate_proj.weight": (cfg["intermediate_size"], h),
              "midlayer.mlp.up_proj.weight": (cfg["intermediate_size"], h),
              "midlayer.mlp.down_proj.weight": (h, cfg["intermediate_size"]), "norm.weight": (h,),
              "lm_head.weight": (n, h), "d2t": (n,), "t2d": (v,)}
    assert {k: tuple(a.shape) for k, a in raw.items()} == expect
    assert raw["d2t"].dtype == np.int64 and raw["t2d"].dtype == np.bool_
    target_ids = np.arange(n) + raw["d2t"]  # vLLM: targets = arange(draft_vocab) + d2t
    assert (np.flatnonzero(raw["t2d"]) == np.sort(target_ids)).all()
    for k, a in raw.items():
        assert np.array_equal(a, tensors[k].numpy()), k


def test_compile_refuses_a_head_for_another_target(trained, tmp_path):
    config, tensors = eagle3.read_eagle3(trained["head"])
    bad = dict(config, hidden_size=config["hidden_size"] * 2, target_hidden_size=config["hidden_size"] * 2)
    tensors = dict(tensors, **{"fc.weight": torch.zeros(bad["hidden_size"], 3 * bad["hidden_size"])})
    eagle3.write_eagle3(str(tmp_path / "bad"), bad, tensors)
    with pytest.raises(CheckpointError, match="hidden size"):
        compile_bundle(trained["target"], str(tmp_path / "b"), CompileOptions(dtype="float32"), eagle=str(tmp_path / "bad"))
    shutil.copytree(trained["head"], tmp_path / "nofc")
    t = dict(eagle3.read_eagle3(str(tmp_path / "nofc"))[1])
    del t["fc.weight"]
    eagle3.write_eagle3(str(tmp_path / "nofc"), config, t)
    with pytest.raises(CheckpointError, match="fc.weight"):
        eagle3.read_eagle3(str(tmp_path / "nofc"))


def test_training_reports_acceptance_by_position(trained):
    rep = trained["report"]
    before, after = rep["eval_before"], rep["eval_after"]
    assert len(after["acceptance_by_position"]) == EagleTrainConfig().ttt_steps + 2
    assert after["acceptance_by_position"][0] > before["acceptance_by_position"][0]
    assert after["expected_accepted_per_pass"] > 1.2


def run(engine, method, prompts, max_tokens=24, **sampling):
    return engine.generate([Request(prompt_ids=p, speculation=SpeculationConfig.make(None, method=method),
                                    sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
                            for p in prompts])


def test_greedy_eagle_equals_plain_and_accepts(trained):
    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=4))
    prompts = trained["prompts"] + [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21]]
    plain = run(engine, "none", prompts)
    spec = run(engine, "eagle", prompts)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    drafted = sum(r["stats"]["drafted"] for r in spec)
    accepted = sum(r["stats"]["accepted"] for r in spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    auto = run(engine, "auto", prompts)
    assert [r["token_ids"] for r in auto] == [r["token_ids"] for r in plain]
    assert engine.cache.free_blocks == engine.cache.num_blocks


def test_hybrid_merges_the_heads_candidates_losslessly(trained):
    """With a head in the bundle, `hybrid` asks it too: the head reads the features of
    hybrid's requests (its Needs, through the parts hybrid declares) and its trees join the
    merged one; greedy output stays plain decoding's."""
    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=4))
    hyb = engine.speculator.proposers["hybrid"]
    assert hyb.eagle is engine.speculator.proposers["eagle"] and "eagle" in hyb.needs.parts
    prompts = trained["prompts"] + [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21]]
    plain = run(engine, "none", prompts)
    spec = run(engine, "hybrid", prompts)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert hyb.got["eagle"] > 0  # the head had features to draft from: they reached it
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    assert hyb.eagle.states == {} and engine.cache.free_blocks == engine.cache.num_blocks


def test_sampled_eagle_trees_match_exact_distribution(trained):
    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=8))
    r = check(engine, trained["prompts"][0], 1.0, 3, SpeculationConfig.make(None, method="eagle", gamma=3), 600)
    assert r.drafted > 0 and r.accepted > 0 and r.accepted < r.drafted, r
    assert r.p_value > 0.001, r


def test_the_check_rejects_a_broken_rule_on_eagle_trees(trained, monkeypatch):
    monkeypatch.setattr(speculator_mod, "verify_tree_sampled", broken_tree_rule)
    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=8))
    r = check(engine, trained["prompts"][0], 1.0, 3, SpeculationConfig.make(None, method="eagle", gamma=3), 600)
    assert r.drafted > 0 and r.accepted < r.drafted
    assert r.p_value < 1e-4, r


def test_node_budget_follows_the_verify_cost(trained):
    engine = Engine(trained["with_head"], EngineConfig())
    prop = engine.speculator.proposers["eagle"]
    scores = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1]
    prop.verify_cost = lambda width: 1.0 + 0.01 * width  # wide passes nearly free: take many nodes
    assert prop.budget(scores, 6) == 6
    prop.verify_cost = lambda width: float(width)  # cost grows with width: a short chain
    assert prop.budget(scores, 6) == 1


def test_eagle_drafts_are_charged_their_measured_cost(trained):
    """The cost model charges an EAGLE draft level what it costs (measured at load next to
    the verify costs), not zero: a free draft made the depth controller and `auto` draft
    with the head where it did not pay."""
    engine = Engine(trained["with_head"], EngineConfig())
    costs = engine.speculator.controller.costs
    assert costs["eagle"].draft_cost > 0
    assert costs["ngram"].draft_cost == 0.0  # a table lookup is not timed as a model


def test_the_head_runs_int8_on_the_cpu_and_keeps_its_drafts(trained, monkeypatch):
    """Where specbuild's CPU kernel is built the served head's linears are int8 (drafts only);
    its logits stay close to the float head's, and SPECBUILD_CPU_KERNEL=torch keeps it float."""
    from specbuild.model import cpu_kernels

    if not cpu_kernels.isa():
        pytest.skip(f"specbuild's CPU kernel is not available: {cpu_kernels.status()['reason']}")
    quant = Engine(trained["with_head"], EngineConfig()).speculator.proposers["eagle"].head
    monkeypatch.setenv("SPECBUILD_CPU_KERNEL", "torch")
    plain = Engine(trained["with_head"], EngineConfig()).speculator.proposers["eagle"].head
    assert set(quant.packed) == {k for k, v in quant.w.items() if v.dim() == 2} and not plain.packed
    torch.manual_seed(0)
    out = torch.randn(6, plain.config.hidden_size)
    a, b = quant.logits(out), plain.logits(out)
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_eagle_faults_stay_in_their_request(trained, monkeypatch, sampled):
    """tests/engine/test_fault_isolation.py's checks on the trained EAGLE bundle: a fault in
    one request (its head, verification, NaN rows) leaves its neighbours' tokens unchanged."""
    from faults import check_isolation

    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=4))
    prompts = trained["prompts"][:2] + [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]]
    check_isolation(engine, "eagle", prompts, monkeypatch, sampled, drafts_independent=True)


def test_a_tree_on_an_eagle_request_is_refused(trained):
    from specbuild.errors import RequestError

    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=2))
    with pytest.raises(RequestError, match="tree=.*applies to speculation methods medusa, recycle, auto, not 'eagle'"):
        engine.submit(Request(prompt_ids=[5, 6], speculation={"method": "eagle", "tree": [[0], [0, 0]]}))
    with pytest.raises(RequestError, match="not 'ngram'"):
        engine.submit(Request(prompt_ids=[5, 6], speculation={"method": "ngram", "tree": "chain_2"}))
    assert engine.cache.used_blocks == 0 and not engine.waiting


def test_eagle_extreme_sampling_parameters(trained):
    """Temperature 1e-38, top_p 1e-45, top_k 1 and the other extremes on EAGLE trees: a 4xx,
    the greedy or the seeded answer (tests/helpers/extreme.py)."""
    from extreme import check_extreme

    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=2))
    check_extreme(engine, ["none", "eagle"], trained["prompts"][0], examples=10)


@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_the_head_is_served_compiled_losslessly(trained, tmp_path, fmt):
    """Under compile=True every forward of a bundle with a head runs the one graph family that
    also returns the head's aux layers (Decoder.compile), called directly like the plain
    graphs: greedy EAGLE equals plain decoding with drafts accepted, in the rounded formats
    whose rows are bit-exact (int4 weights, bfloat16 throughout), and no graph compiles
    inside a request. (Two graphs, one with and one without the aux outputs, differed in the
    last bits at 16-17 rows on the int4 SmolLM2 bundle: scripts/compiled_aux_check.py.)"""
    from torch._dynamo.utils import counters

    opts = {"int4": dict(dtype="float32", quantize="int4", lm_head_format="int8"), "bfloat16": dict(dtype="bfloat16")}
    bundle = compile_bundle(trained["target"], str(tmp_path / fmt), CompileOptions(max_draft_len=10, **opts[fmt]),
                            eagle=trained["head"])
    engine = Engine(bundle, EngineConfig(max_batch_size=4, compile=True))
    assert "eagle" in engine.methods and engine.model.compiled_aux
    stack = engine.model.compiled
    if fmt == "int4":  # int4 on specbuild's kernels: the fused C++ stack, which returns the aux layers every call
        assert type(stack).__name__ == "FusedStack" and engine.model.fused_why is None
    else:
        assert all(key[1] == engine.model.compiled_aux for key in stack.fns)  # one graph family
        assert any(d is not None for d in stack.direct.values())  # called directly
    graphs = counters["stats"]["unique_graphs"]
    prompts = trained["prompts"] + [[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8], [20, 21]]
    plain = run(engine, "none", prompts)
    spec = run(engine, "eagle", prompts)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["accepted"] for r in spec) > 0
    assert counters["stats"]["unique_graphs"] == graphs
    assert engine.cache.used_blocks == 0


@pytest.mark.parametrize("method", ["eagle", "hybrid"])
def test_eagle_second_turn_reuses_the_prefix_with_the_heads_features(trained, method):
    """Prefix caching under EAGLE-3: the head reads the target's features at every row, so its
    drafter keeps the features of full blocks of accepted text; a second turn takes those blocks
    from the prefix cache, the head gets their features, drafts and is accepted, and the output
    equals the engine's without the cache. Another salt finds no features and computes all."""
    on = Engine(trained["with_head"], EngineConfig(max_batch_size=4))
    off = Engine(trained["with_head"], EngineConfig(max_batch_size=4, prefix_cache=False))
    turn1 = trained["prompts"][0] * 3  # a few blocks of text the head was trained on
    got, accepted = {}, 0
    for name, engine in (("on", on), ("off", off)):
        first = run(engine, method, [turn1])[0]
        got[name] = run(engine, method, [turn1 + first["token_ids"] + [20, 21, 22]])[0]
        accepted += first["stats"]["accepted"] + got[name]["stats"]["accepted"]
    assert got["on"]["token_ids"] == got["off"]["token_ids"]
    assert got["on"]["stats"]["cached_tokens"] >= len(turn1) // 16 * 16 > 0
    assert got["off"]["stats"]["cached_tokens"] == 0
    assert got["on"]["stats"]["drafted"] > 0 and accepted > 0
    eagle = on.speculator.proposers["eagle"]
    assert eagle.store and eagle.stored_bytes > 0
    salted = on.generate([Request(prompt_ids=turn1 + [20, 21], cache_salt="other",
                                  speculation=SpeculationConfig.make(None, method=method),
                                  sampling=SamplingParams(max_tokens=4, ignore_eos=True))])[0]
    assert salted["stats"]["cached_tokens"] == 0
    on.cache.check()


def test_an_eagle_sequence_takes_only_blocks_whose_features_are_kept(trained):
    """Features evicted (the store emptied here) while the target's blocks stay recorded: an
    EAGLE sequence computes the prompt (and its head drafts from complete features), a plain
    request beside it still reuses the blocks."""
    engine = Engine(trained["with_head"], EngineConfig(max_batch_size=4))
    turn1 = trained["prompts"][0] * 3
    run(engine, "eagle", [turn1])
    eagle = engine.speculator.proposers["eagle"]
    eagle.store.clear()
    eagle.stored_bytes = 0
    again = run(engine, "eagle", [turn1 + [20, 21]])[0]
    assert again["stats"]["cached_tokens"] == 0 and again["stats"]["drafted"] > 0
    plain = run(engine, "none", [turn1 + [20, 22]])[0]
    assert plain["stats"]["cached_tokens"] >= len(turn1) // 16 * 16


def test_the_drafting_layer_computes_the_heads_layer(trained):
    """layer_rows (the served head's drafting layer: fused int8 weights, rows_attention over the
    state's buffers) gives layer()'s outputs up to the int8 inputs' rounding, for a causal feed
    after cached positions and for a tree level whose rows see chosen ancestors, and writes the
    new rows' K/V where asked."""
    from specbuild.speculation.eagle_head import causal_index, rows_index
    from specbuild.speculation.proposers.eagle import EagleState

    prop = Engine(trained["with_head"], EngineConfig()).speculator.proposers["eagle"]
    if not prop.rows:
        pytest.skip("the head drafts through layer() here (no int8 head or no rows_attention kernel)")
    head, c = prop.head, prop.head.config
    torch.manual_seed(0)

    def close(a, b):
        assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()

    emb, hid = torch.randn(7, c.hidden_size), torch.randn(7, c.hidden_size)
    pos = torch.arange(7)
    out_ref, k_ref, v_ref = head.layer(emb[:5], hid[:5], pos[:5], None, None, None)
    st = EagleState()
    st.room(2, c.num_kv_heads, c.head_dim, torch.float32, "cpu")  # too small: the feed grows it
    st.room(5, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    out = head.layer_rows(emb[:5], hid[:5], pos[:5], st.kb, st.vb, 0, causal_index(0, 5))
    close(out, out_ref)
    close(st.kb[:5], k_ref)
    close(st.vb[:5], v_ref)
    st.n = 5
    # two more positions after the five cached
    out_ref, k2, _ = head.layer(emb[5:], hid[5:], pos[5:], k_ref, v_ref, None)
    st.room(9, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    assert torch.equal(st.k, st.kb[:5]) and st.k.shape[0] == 5  # growing kept the cached rows
    out = head.layer_rows(emb[5:], hid[5:], pos[5:], st.kb, st.vb, 5, causal_index(5, 2))
    close(out, out_ref)
    close(st.kb[5:7], k2)
    # a tree level: row 0 sees the cache and scratch row 5, row 1 only the cache (and itself)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, :5] = True
    mask[0, 5] = mask[0, 6] = mask[1, 7] = True
    past_k, past_v = st.kb[:6].clone(), st.vb[:6].clone()
    ref, _, _ = head.layer(emb[:2], hid[:2], torch.tensor([6, 6]), past_k, past_v, mask)
    out = head.layer_rows(emb[:2], hid[:2], torch.tensor([6, 6]), st.kb, st.vb, 6, rows_index([[5, 6], [7]], 5))
    close(out, ref)
    st.cut(3)
    assert st.n == 3 and st.k.shape[0] == 3


def test_the_served_head_drafts_on_int8_inputs_in_one_block(trained):
    """Where the int8 x int8 kernel runs, the drafting level's six weights are int8-q8 packs in
    one block (model/arena.py), and drafting with them keeps greedy output equal to plain
    decoding while drafts are proposed and accepted."""
    from specbuild.model import cpu_kernels

    engine = Engine(trained["with_head"], EngineConfig())
    head = engine.speculator.proposers["eagle"].head
    if not cpu_kernels.int8_q8_path():
        pytest.skip("specbuild's int8 x int8 kernel does not run here")
    assert set(head.q8) == {"fc.weight", "qkv", "midlayer.self_attn.o_proj.weight", "gate_up",
                            "midlayer.mlp.down_proj.weight", "lm_head.weight"}
    bufs = [buf for buf, _, _ in head.q8.values()]  # in the order a level reads them, back to back
    assert all(0 <= b.data_ptr() - (a.data_ptr() + a.numel()) < 64 for a, b in zip(bufs, bufs[1:]))
    prompts = trained["prompts"][:3]
    plain = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                                     speculation=SpeculationConfig.make(None, method="none")) for p in prompts])
    spec = engine.generate([Request(prompt_ids=p, sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                                    speculation=SpeculationConfig.make(None, method="eagle")) for p in prompts])
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
    assert sum(o["stats"]["drafted"] for o in spec) > 0 and sum(o["stats"]["accepted"] for o in spec) > 0


def test_the_fused_level_computes_the_eager_level(trained):
    """level_rows through cpu_kernels.cpp's eagle_level (one call) against the same level in eager
    ops (layer_rows, then the output layer): outputs, logits of the last rows and the K/V written
    agree up to float rounding, for a feed after cached rows and for a tree level."""
    from specbuild.speculation.eagle_head import causal_index, rows_index
    from specbuild.speculation.proposers.eagle import EagleState

    head = Engine(trained["with_head"], EngineConfig()).speculator.proposers["eagle"].head
    if len(head.q8) != 6 or not head.rows_ready():
        pytest.skip("no int8-q8 head here: the eager level runs")
    c = head.config
    torch.manual_seed(1)
    emb, hid = torch.randn(9, c.hidden_size), torch.randn(9, c.hidden_size)
    states = [EagleState(), EagleState()]
    for st in states:
        st.room(16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
        st.kb.zero_()
        st.vb.zero_()

    def close(a, b):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max())), (a - b).abs().max()

    for at, rows, index, last in ((0, slice(0, 6), causal_index(0, 6), 1), (6, slice(6, 9), causal_index(6, 3), 3),
                                  (9, slice(0, 2), rows_index([[6, 9], [10]], 6), 2)):
        pos = torch.arange(rows.start, rows.stop)
        got, got_lg = head.level_rows(emb[rows], hid[rows], pos, states[0].kb, states[0].vb, at, index, last)
        want = head.layer_rows(emb[rows], hid[rows], pos, states[1].kb, states[1].vb, at, index)
        close(got, want)
        close(got_lg, head.logits(want[-last:]))
        close(states[0].kb, states[1].kb)
        close(states[0].vb, states[1].vb)
    # a feed: the target's features projected inside the call, its causal index built there
    feats = torch.randn(3, 3 * c.hidden_size)
    pos = torch.arange(11, 14)
    got, got_lg = head.level_rows(emb[:3], None, pos, states[0].kb, states[0].vb, 11, None, 1, feats=feats)
    want = head.layer_rows(emb[:3], head.project(feats), pos, states[1].kb, states[1].vb, 11, causal_index(11, 3))
    close(got, want)
    close(got_lg, head.logits(want[-1:]))
    close(states[0].kb[:14], states[1].kb[:14])
    assert head.level_args  # the C++ level ran
