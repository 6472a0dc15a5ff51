"""Load-time checks of built TensorRT-LLM engines (pure: no TensorRT-LLM needed).

Engine configs here have the layout trtllm-build writes (`pretrained_config` = the
checkpoint's config.json, `build_config` with the build flags; the speculative decoding
mode as its IntFlag value), so each check is exercised on what a real build records.
"""

from __future__ import annotations

import pytest

from specbuild.errors import BundleError, SpecbuildError
from specbuild.backends.tensorrt_llm import MODE_BITS, EngineLimitError, accepted_prefix, check_draft_target_engines, check_engine_limits, check_engine_version, engine_limits, engine_modes, fit_draft_logits, leader_plan, sampled_speculation_default

TREE = {"name": "t9", "num_drafts": 9, "max_depth": 4}


def engine_config(mode: str = "none", max_draft_len: int = 0, batch: int = 8, seq: int = 512, logits: bool = False,
                  tp: int = 1, pp: int = 1, heads: int = 0, ckpt_draft: int = 0, gpus_per_node: int = 8) -> dict:
    pre = {"architecture": "MedusaForCausalLM" if mode == "medusa" else "LlamaForCausalLM", "vocab_size": 320,
           "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "gpus_per_node": gpus_per_node}}
    if mode == "medusa":
        pre.update(num_medusa_heads=heads, max_draft_len=ckpt_draft)
    build = {"max_batch_size": batch, "max_seq_len": seq, "max_input_len": seq, "max_draft_len": max_draft_len,
             "speculative_decoding_mode": MODE_BITS[mode], "gather_generation_logits": logits}
    return {"version": "0.19.0", "pretrained_config": pre, "build_config": build}


def test_modes_from_bits_and_names():
    assert engine_modes(MODE_BITS["draft_tokens_external"]) == ["draft_tokens_external"]
    assert engine_modes(MODE_BITS["medusa"] | MODE_BITS["none"]) == ["none", "medusa"]
    assert engine_modes("SpeculativeDecodingMode.MEDUSA") == ["medusa"]
    assert engine_modes(None) == ["none"]
    with pytest.raises(BundleError, match="unknown speculative_decoding_mode 'warp'"):
        engine_modes("warp")


def test_limits_read_from_the_engine_config():
    lim = engine_limits(engine_config("draft_tokens_external", max_draft_len=5, batch=4, seq=300, logits=True, tp=2))
    assert (lim["max_batch_size"], lim["max_seq_len"], lim["max_draft_len"]) == (4, 300, 5)
    assert lim["modes"] == ["draft_tokens_external"] and lim["gather_generation_logits"]
    assert (lim["tp"], lim["world_size"]) == (2, 2)
    # older engines store max_input_len + max_output_len instead of max_seq_len
    old = {"build_config": {"max_batch_size": 2, "max_input_len": 100, "max_output_len": 28}}
    assert engine_limits(old)["max_seq_len"] == 128
    # Medusa: max_draft_len comes from the checkpoint when the build leaves it out
    assert engine_limits(engine_config("medusa", heads=4, ckpt_draft=9))["max_draft_len"] == 9


def test_engine_without_max_draft_len_names_the_flags():
    """The anchor's user gets "Number of draft tokens (56) > maximum (0)" at the first request;
    here the load fails first and says how to rebuild."""
    cfg = engine_config("none")
    with pytest.raises(EngineLimitError) as e:
        check_engine_limits(cfg, mode="draft_tokens_external", max_draft_len=56)
    msg = str(e.value)
    assert "the target engine cannot serve this bundle" in msg
    assert "--speculative_decoding_mode draft_tokens_external --max_draft_len 56" in msg
    # mode right, length too short: the anchor's numbers plus the flag
    cfg = engine_config("draft_tokens_external", max_draft_len=0)
    with pytest.raises(EngineLimitError, match=r"Number of draft tokens \(56\) > maximum \(0\); "
                                               r"rebuild with --max_draft_len 56"):
        check_engine_limits(cfg, mode="draft_tokens_external", max_draft_len=56)
    check_engine_limits(engine_config("draft_tokens_external", max_draft_len=56), mode="draft_tokens_external",
                        max_draft_len=56)


def test_batch_and_sequence_limits():
    cfg = engine_config(batch=4, seq=256)
    with pytest.raises(EngineLimitError, match=r"max_batch_size 8 > maximum \(4\); rebuild with --max_batch_size 8 "
                                               r"or run with --max-batch-size 4"):
        check_engine_limits(cfg, max_batch_size=8)
    with pytest.raises(EngineLimitError, match=r"max_seq_len 512 > maximum \(256\); rebuild with --max_seq_len 512"):
        check_engine_limits(cfg, max_seq_len=512)
    # every problem is reported at once, not just the first
    with pytest.raises(EngineLimitError) as e:
        check_engine_limits(cfg, role="draft", max_batch_size=8, max_seq_len=512)
    assert str(e.value).count("rebuild with") == 2 and str(e.value).startswith("the draft engine")
    assert check_engine_limits(cfg, max_batch_size=4, max_seq_len=256)["max_batch_size"] == 4


def test_medusa_tree_against_the_engine():
    with pytest.raises(EngineLimitError, match="without --speculative_decoding_mode medusa"):
        check_engine_limits(engine_config("none"), mode="medusa", tree=TREE)
    small = engine_config("medusa", heads=4, ckpt_draft=6)
    with pytest.raises(EngineLimitError, match=r"Number of draft tokens \(9, the nodes of Medusa tree 't9'\) > "
                                               r"maximum \(6\); rewrite the checkpoint with `specbuild compile "
                                               r"--max-draft-len 9`"):
        check_engine_limits(small, mode="medusa", tree=TREE)
    shallow = engine_config("medusa", heads=3, ckpt_draft=9)
    with pytest.raises(EngineLimitError, match="is 4 deep but the engine has 3 heads"):
        check_engine_limits(shallow, mode="medusa", tree=TREE)
    check_engine_limits(engine_config("medusa", heads=4, ckpt_draft=9), mode="medusa", tree=TREE)


def test_sampled_acceptance_needs_generation_logits():
    with pytest.raises(EngineLimitError, match="rebuild with --gather_generation_logits"):
        check_engine_limits(engine_config("draft_tokens_external", 4), mode="draft_tokens_external", max_draft_len=4,
                            needs_generation_logits=True)
    check_engine_limits(engine_config("draft_tokens_external", 4, logits=True), mode="draft_tokens_external",
                        max_draft_len=4, needs_generation_logits=True)


def test_sampled_speculation_is_refused_without_generation_logits():
    plain = engine_config("draft_tokens_external", 4)
    for role in ("target", "draft"):
        with pytest.raises(EngineLimitError, match=rf"the {role} engine .* sampled speculation \(temperature > 0 "
                                                   r"with draft tokens\) is refused.* built without "
                                                   r"--gather_generation_logits; rebuild with --gather_generation_"
                                                   r"logits \(`specbuild compile --trtllm-gather-generation-logits`"):
            check_engine_limits(plain, role=role, mode="draft_tokens_external" if role == "target" else "none",
                                max_draft_len=4 if role == "target" else 0, sampled_speculation=True)
    lim = check_engine_limits(engine_config("draft_tokens_external", 4, logits=True), mode="draft_tokens_external",
                              max_draft_len=4, sampled_speculation=True)
    assert lim["gather_generation_logits"] is True
    assert check_engine_limits(plain, mode="draft_tokens_external", max_draft_len=4)["gather_generation_logits"] is False


def test_which_defaults_are_sampled_speculation():
    from specbuild.sampling.params import SamplingParams
    from specbuild.speculation.config import SpeculationConfig

    hot, cold = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    draft, ngram, none = (SpeculationConfig.make(None, method=m) for m in ("draft", "ngram", "none"))
    assert sampled_speculation_default("draft_tokens_external", hot, draft) is True
    assert sampled_speculation_default("draft_tokens_external", cold, draft) is False
    # prompt lookup and plain decoding accept no logits; Medusa engines are checked as greedy-only elsewhere
    assert sampled_speculation_default("draft_tokens_external", hot, ngram) is False
    assert sampled_speculation_default("draft_tokens_external", hot, none) is False
    assert sampled_speculation_default("medusa", hot, draft) is False


def test_world_size_and_vocab():
    with pytest.raises(EngineLimitError, match=r"built for tp\*pp = 4 ranks \(tp 2, pp 2\) but 1 were launched; "
                                               r"run it under `mpirun -n 4`"):
        check_engine_limits(engine_config(tp=2, pp=2), world_size=1)
    with pytest.raises(EngineLimitError, match="vocab_size 320 != the bundle's 321"):
        check_engine_limits(engine_config(), vocab_size=321)


def test_leader_plan_binds_rank_mod_gpus_per_node():
    lim = engine_limits(engine_config(tp=4, gpus_per_node=2))
    assert [leader_plan(r, 4, lim, visible_gpus=2) for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(SpecbuildError, match=r"built for tp\*pp = 4 ranks .* MPI world size is 2; launch with "
                                             r"`mpirun -n 4"):
        leader_plan(0, 2, lim, visible_gpus=2)
    lim8 = engine_limits(engine_config(tp=2))  # gpus_per_node 8 (the writer's default) on a 1-GPU node
    with pytest.raises(SpecbuildError, match="rank 1 binds GPU 1 .* shows 1 GPU\\(s\\); rebuild with --gpus_per_node 1"):
        leader_plan(1, 2, lim8, visible_gpus=1)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 6, 7], [4]) == 0
    assert accepted_prefix([], [4]) == 0
    assert accepted_prefix([5, 6, 7], [5, 0]) == 1  # the target stopped (end id) after one draft


# ---- issue 17: engines a GPU would refuse, refused at load ---------------------------------------
def with_model(cfg: dict, **pre) -> dict:
    cfg["pretrained_config"].update({"num_attention_heads": 4, "num_key_value_heads": 2, "head_size": 32,
                                     "hidden_size": 64, "dtype": "bfloat16", **pre})
    return cfg


def test_engine_kernels_checked_at_load():
    ok = with_model(engine_config("medusa", heads=4, ckpt_draft=9))
    check_engine_limits(ok, mode="medusa", tree=TREE)
    fp32 = with_model(engine_config("medusa", heads=4, ckpt_draft=9), dtype="float32")
    with pytest.raises(EngineLimitError, match=r"built with dtype float32: medusa speculation .* XQA kernels.*"
                                               r"recompile with --trtllm-dtype bfloat16 or float16"):
        check_engine_limits(fp32, mode="medusa", tree=TREE)
    check_engine_limits(with_model(engine_config("none"), dtype="float32"))  # plain fp32 has kernels
    with pytest.raises(EngineLimitError, match="head size 16 has no TensorRT-LLM attention kernel"):
        check_engine_limits(with_model(engine_config("none"), head_size=16))
    smol = dict(num_attention_heads=9, num_key_value_heads=3, head_size=64, hidden_size=576)
    with pytest.raises(EngineLimitError, match=r"9 query heads over 3 KV heads: 3 query heads per KV head at tp=1"):
        check_engine_limits(with_model(engine_config("medusa", heads=4, ckpt_draft=9), **smol), mode="medusa",
                            tree=TREE)
    # issue 31 row 1: a draft/target target gets no packed mask (generation_mixin.py), so no XQA group rule
    check_engine_limits(with_model(engine_config("draft_tokens_external", 4), **smol), mode="draft_tokens_external",
                        max_draft_len=4)


def test_block_reuse_needs_paged_context_fmha(caplog):
    """Issue 31 row 5: an engine without paged context FMHA has its KV block reuse turned off by
    TensorRT-LLM; a draft/target target needs reuse, so it is refused with the flag to rebuild."""
    def built(mode, paged, **kw):
        cfg = engine_config(mode, **kw)
        cfg["build_config"]["plugin_config"] = {"use_paged_context_fmha": paged}
        return cfg

    assert engine_limits(engine_config())["paged_context_fmha"] is None  # not recorded: nothing claimed
    with pytest.raises(EngineLimitError, match=r"built without --use_paged_context_fmha enable, so TensorRT-LLM "
                                               r"turns KV cache block reuse off.*rebuild with --use_paged_context_fmha"):
        check_engine_limits(built("draft_tokens_external", False, max_draft_len=4), mode="draft_tokens_external",
                            max_draft_len=4)
    check_engine_limits(built("draft_tokens_external", True, max_draft_len=4), mode="draft_tokens_external",
                        max_draft_len=4)
    with caplog.at_level("WARNING", logger="specbuild.trtllm"):
        check_engine_limits(built("none", False))  # plain: served, reuse lost, said once
    assert "built without --use_paged_context_fmha enable" in caplog.text


def test_engine_path_versions():
    for good in ("0.19.0", "0.21.0rc1", "1.0.0", "1.2.1"):
        check_engine_version(good)
    with pytest.raises(EngineLimitError, match=r"^TensorRT-LLM 0.18.2 is installed; the engine path was checked "
                                               r"against tensorrt_llm>=0.19,<1.3.*pip install"):
        check_engine_version("0.18.2")
    for gone in ("1.3.0", "1.3.0rc1", "2.1.0"):
        with pytest.raises(EngineLimitError, match=rf"^TensorRT-LLM {gone} is installed, which has no trtllm-build or "
                                                   r"executor bindings.*LLM API path"):
            check_engine_version(gone)


def test_draft_target_engines_one_gpu_same_tp():
    one = engine_limits(engine_config("draft_tokens_external", 4))
    check_draft_target_engines(one, engine_limits(engine_config()))
    check_draft_target_engines(engine_limits(engine_config("medusa", tp=2)), None)  # Medusa: any tp
    with pytest.raises(EngineLimitError, match="leader mode on one MPI world, which can hang"):
        check_draft_target_engines(engine_limits(engine_config("draft_tokens_external", 4, tp=2)),
                                   engine_limits(engine_config(tp=2)))
    with pytest.raises(EngineLimitError, match="draft tp 2 != target tp 1"):
        check_draft_target_engines(one, engine_limits(engine_config(tp=2)))


def test_draft_logits_fit_the_targets_padded_vocabulary():
    import torch

    logits = torch.arange(2 * 302, dtype=torch.float32).reshape(2, 302)  # V 301 padded for draft tp 2
    out = fit_draft_logits(logits, 301, 304)  # the target at tp 4 pads to 304
    assert out.shape == (2, 304) and torch.equal(out[:, :301], logits[:, :301])
    assert (out[:, 301:] == torch.finfo(torch.float32).min).all()
    assert fit_draft_logits(None, 301, 304) is None


def test_stand_in_turns_reuse_off_without_paged_context_fmha(tmp_path):
    """The engine-path stand-in does what trtGptModelInflightBatching.cpp does: block reuse off
    (warned) for an engine without paged context FMHA, and then a draft/target target fails."""
    import json

    from trtllm_stub import StubExecutor, _Rec

    def engine(mode, paged, **kw):
        cfg = engine_config(mode, **kw)
        cfg["build_config"]["plugin_config"] = {"use_paged_context_fmha": paged}
        path = tmp_path / f"{mode}-{paged}" / "trtllm" / "engines" / "target"
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(cfg))
        return str(path)

    reuse = _Rec(kv_cache_config=_Rec(enable_block_reuse=True), decoding_config=_Rec())
    with pytest.raises(RuntimeError, match="KV cache block reuse must be enabled for speculative decoding target"):
        StubExecutor(engine("draft_tokens_external", False, max_draft_len=4), "decoder_only", reuse)
    assert StubExecutor(engine("draft_tokens_external", True, max_draft_len=4), "decoder_only", reuse).block_reuse
    assert StubExecutor(engine("none", False), "decoder_only", reuse).block_reuse is False
