"""TensorRT-LLM engine build: trtllm-build flags per role, build.sh, the bundle's trtllm/
subtree, and the build itself (real only where tensorrt_llm imports and a GPU is present)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import shlex
import sys

import pytest
import torch
from tiny import make_tiny_hf

from specbuild.compiler import trtllm_build
from specbuild.formats.checkpoints import read_hf_dir
from specbuild.formats.trtllm_checkpoint import read_trtllm_checkpoint, read_trtllm_medusa
from specbuild.compiler.trtllm_build import build_commands, build_engines, tensorrt_llm_available, write_build_script, write_trtllm_bundle_part
from specbuild.errors import BundleError, SpecbuildError
from specbuild.speculation.tree import TreeSpec

VOCAB = 301


def flags(argv: list[str]) -> dict[str, str | None]:
    """--name value / bare --name -> {name: value or None}; argv[0] is the executable."""
    out, i = {}, 1
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i][2:]] = argv[i + 1]
            i += 2
        else:
            out[argv[i][2:]] = None
            i += 1
    return out


LIMITS = {"max_batch_size": "4", "max_seq_len": "512", "max_input_len": "512"}


def test_flags_medusa():
    cmds = build_commands(target_checkpoint="c/t", target_engine="e/t", medusa=True, max_batch_size=4, max_seq_len=512)
    assert list(cmds) == ["target"] and cmds["target"][0] == "trtllm-build"
    assert flags(cmds["target"]) == {"checkpoint_dir": "c/t", "output_dir": "e/t", **LIMITS,
                                     "use_paged_context_fmha": "enable",  # the executor turns KV block reuse on
                                     "speculative_decoding_mode": "medusa"}  # max_draft_len: from the checkpoint


@pytest.mark.parametrize("gather", [False, True])
def test_flags_draft_target(gather):
    cmds = build_commands(target_checkpoint="c/t", target_engine="e/t", draft_checkpoint="c/d", draft_engine="e/d",
                          max_batch_size=4, max_seq_len=512, max_draft_len=6, gather_generation_logits=gather)
    logits = {"gather_generation_logits": None} if gather else {}
    assert flags(cmds["target"]) == {"checkpoint_dir": "c/t", "output_dir": "e/t", **LIMITS,
                                     "use_paged_context_fmha": "enable",
                                     "speculative_decoding_mode": "draft_tokens_external", "max_draft_len": "6", **logits}
    assert flags(cmds["draft"]) == {"checkpoint_dir": "c/d", "output_dir": "e/d", **LIMITS,
                                    "use_paged_context_fmha": "enable", **logits}


def test_flags_plain_and_errors():
    cmds = build_commands(target_checkpoint="c/t", target_engine="e/t", max_batch_size=4, max_seq_len=512)
    assert flags(cmds["target"]) == {"checkpoint_dir": "c/t", "output_dir": "e/t", **LIMITS,
                                     "use_paged_context_fmha": "enable"}
    with pytest.raises(ValueError, match="max_draft_len=None"):
        build_commands(target_checkpoint="c", target_engine="e", draft_checkpoint="d", draft_engine="f",
                       max_batch_size=1, max_seq_len=64)
    with pytest.raises(ValueError, match="cannot be combined"):
        build_commands(target_checkpoint="c", target_engine="e", draft_checkpoint="d", draft_engine="f",
                       medusa=True, max_batch_size=1, max_seq_len=64, max_draft_len=3)
    with pytest.raises(ValueError, match="max_batch_size=0"):
        build_commands(target_checkpoint="c", target_engine="e", max_batch_size=0, max_seq_len=64)


def test_build_script_runs_each_command_from_its_directory(tmp_path):
    cmds = build_commands(target_checkpoint="checkpoints/target", target_engine="engines/target",
                          draft_checkpoint="checkpoints/draft", draft_engine="engines/draft",
                          max_batch_size=2, max_seq_len=256, max_draft_len=4, gather_generation_logits=True)
    script = write_build_script(str(tmp_path / "build.sh"), cmds)
    assert os.stat(script).st_mode & stat.S_IXUSR
    text = open(script).read()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    log = tmp_path / "calls.txt"
    (stub_dir / "trtllm-build").write_text(f'#!/usr/bin/env bash\necho "$PWD $*" >> {log}\n')
    (stub_dir / "trtllm-build").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub_dir}:{os.environ['PATH']}"}
    subprocess.run([script], check=True, cwd="/", env=env)
    calls = log.read_text().splitlines()
    assert calls == [f"{tmp_path} {' '.join(argv[1:])}" for argv in cmds.values()]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    # head size 32 (the default 16 has no TensorRT-LLM kernel), 2 query heads per KV head
    return make_tiny_hf(str(root / "target"), vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, seed=5,
                        head_dim=32)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return make_tiny_hf(str(root / "draft"), vocab=VOCAB, hidden=32, layers=1, heads=2, kv_heads=1, inter=64, seed=6,
                        head_dim=32)


def medusa_heads(num_heads: int = 3, hidden: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for h in range(num_heads):
        out[f"{h}.0.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
        out[f"{h}.0.linear.bias"] = torch.randn(hidden, generator=gen)
        out[f"{h}.1.weight"] = torch.randn(VOCAB, hidden, generator=gen)
    return out


def test_bundle_part_medusa(tmp_path, target_dir):
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    meta = write_trtllm_bundle_part(str(tmp_path), read_hf_dir(target_dir), medusa=medusa_heads(), tree_paths=tree,
                                    tp=2, pp=1, dtype="float16", max_batch_size=4, max_seq_len=256)
    root = tmp_path / "trtllm"
    with open(root / "trtllm.json") as f:
        assert json.load(f) == meta
    assert meta["mode"] == "medusa" and meta["limits"] == {"max_batch_size": 4, "max_seq_len": 256, "max_draft_len": 6}
    spec = TreeSpec.from_paths(tree)
    assert meta["tree"]["packed_mask"] == spec.packed_mask.tolist() and meta["tree"]["num_drafts"] == 6
    assert meta["tree"]["position_offsets"] == [0, 1, 1, 2, 2, 2, 3]
    role = meta["roles"]["target"]
    assert role["files"] == ["config.json", "rank0.safetensors", "rank1.safetensors"]
    assert (role["architecture"], role["num_medusa_heads"], role["max_draft_len"], role["world_size"]) == (
        "MedusaForCausalLM", 3, 6, 2)
    assert read_trtllm_medusa(str(root / role["checkpoint_dir"]))["2.1.weight"].dtype == torch.float16
    assert "draft" not in meta["roles"]
    assert flags(meta["build_commands"]["target"])["speculative_decoding_mode"] == "medusa"
    assert os.access(root / "build.sh", os.X_OK)
    # without a tree: a chain with one node per head
    meta = write_trtllm_bundle_part(str(tmp_path / "chain"), read_hf_dir(target_dir), medusa=medusa_heads(),
                                    max_seq_len=256)
    assert meta["tree"]["paths"] == [[0], [0, 0], [0, 0, 0]] and meta["limits"]["max_draft_len"] == 3


def test_bundle_part_draft_target(tmp_path, target_dir, draft_dir):
    target, draft = read_hf_dir(target_dir), read_hf_dir(draft_dir)
    meta = write_trtllm_bundle_part(str(tmp_path), target, draft=draft, dtype="bfloat16", max_batch_size=2,
                                    max_seq_len=128, max_draft_len=5, gather_generation_logits=True)
    assert meta["mode"] == "draft_tokens_external" and meta["tree"] is None
    assert (meta["roles"]["target"]["world_size"], meta["roles"]["draft"]["world_size"]) == (1, 1)
    assert meta["roles"]["draft"]["architecture"] == "LlamaForCausalLM"
    t, d = (flags(meta["build_commands"][r]) for r in ("target", "draft"))
    assert (t["speculative_decoding_mode"], t["max_draft_len"], t["use_paged_context_fmha"]) == (
        "draft_tokens_external", "5", "enable")
    assert d["use_paged_context_fmha"] == "enable" and "speculative_decoding_mode" not in d
    assert "gather_generation_logits" in t and "gather_generation_logits" in d
    back = read_trtllm_checkpoint(str(tmp_path / "trtllm" / meta["roles"]["draft"]["checkpoint_dir"]))
    assert all(torch.equal(back.tensors[n], draft.tensors[n].to(torch.bfloat16)) for n in draft.tensors)


def test_bundle_part_plain_and_errors(tmp_path, target_dir, draft_dir):
    target, draft = read_hf_dir(target_dir), read_hf_dir(draft_dir)
    meta = write_trtllm_bundle_part(str(tmp_path / "plain"), target, max_seq_len=64)
    assert meta["mode"] == "none" and meta["limits"]["max_draft_len"] == 0
    assert list(meta["build_commands"]) == ["target"]
    assert "speculative_decoding_mode" not in flags(meta["build_commands"]["target"])
    bad = tmp_path / "bad"
    with pytest.raises(ValueError, match="cannot be combined"):
        write_trtllm_bundle_part(str(bad), target, draft=draft, medusa=medusa_heads())
    with pytest.raises(ValueError, match="needs Medusa heads"):
        write_trtllm_bundle_part(str(bad), target, tree_paths=[[0]])
    with pytest.raises(ValueError, match="below the tree's 2 draft nodes"):
        write_trtllm_bundle_part(str(bad), target, medusa=medusa_heads(), tree_paths=[[0], [1]], max_draft_len=1)
    with pytest.raises(ValueError, match="only 3 Medusa heads"):
        write_trtllm_bundle_part(str(bad), target, medusa=medusa_heads(), tree_paths=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="tp=4 cannot split the draft"):
        write_trtllm_bundle_part(str(bad), target, draft=draft, tp=4)
    with pytest.raises(BundleError, match="max_draft_len=65"):
        write_trtllm_bundle_part(str(bad), target, draft=draft, max_draft_len=65)
    for heads in (None, medusa_heads()):  # logits serve draft-model acceptance only
        with pytest.raises(ValueError, match="--trtllm-gather-generation-logits .* needs --draft"):
            write_trtllm_bundle_part(str(bad), target, medusa=heads, gather_generation_logits=True)
    assert not bad.exists()  # validated before anything is written


def test_build_engines_without_tensorrt_llm(tmp_path, target_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # `import tensorrt_llm` raises ImportError
    ok, reason = tensorrt_llm_available()
    assert not ok and "import tensorrt_llm failed" in reason
    write_trtllm_bundle_part(str(tmp_path), read_hf_dir(target_dir), max_seq_len=64)
    calls = []
    assert build_engines(str(tmp_path / "trtllm"), run=lambda *a, **k: calls.append(a)) is False
    assert calls == []


def test_build_engines_runs_commands(tmp_path, target_dir, monkeypatch):
    monkeypatch.setattr(trtllm_build, "tensorrt_llm_available", lambda: (True, "0.19.0"))
    monkeypatch.setattr(trtllm_build.shutil, "which", lambda name: f"/opt/bin/{name}")
    meta = write_trtllm_bundle_part(str(tmp_path), read_hf_dir(target_dir), medusa=medusa_heads(), max_seq_len=64)
    root = str(tmp_path / "trtllm")
    calls = []

    def fake_run(argv, **kw):
        calls.append((argv, kw["cwd"]))
        return subprocess.CompletedProcess(argv, 0, "", "")

    assert build_engines(root, run=fake_run) is True
    (argv, cwd), = calls
    assert cwd == root and argv[-len(meta["build_commands"]["target"]) + 1:] == meta["build_commands"]["target"][1:]
    assert json.load(open(os.path.join(root, "trtllm.json")))["engines_built"] is True
    failing = lambda argv, **kw: subprocess.CompletedProcess(argv, 3, "", "line\nboom")  # noqa: E731
    with pytest.raises(SpecbuildError, match=r"trtllm-build for the target failed \(exit 3\): line\nboom"):
        build_engines(root, run=failing)


def _skip_without_tensorrt_llm():
    ok, reason = tensorrt_llm_available()
    if not ok:
        pytest.skip(f"needs TensorRT-LLM: {reason}")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for trtllm-build")


@pytest.mark.tensorrt_llm
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["medusa", "draft"])
def test_real_engine_build(tmp_path, target_dir, draft_dir, kind):
    _skip_without_tensorrt_llm()
    target = read_hf_dir(target_dir)
    extra = {"medusa": medusa_heads(), "tree_paths": [[0], [1], [0, 0]]} if kind == "medusa" else {
        "draft": read_hf_dir(draft_dir), "max_draft_len": 4}
    meta = write_trtllm_bundle_part(str(tmp_path), target, dtype="float16", max_batch_size=2, max_seq_len=128, **extra)
    assert build_engines(str(tmp_path / "trtllm")) is True
    for role in meta["roles"].values():
        engine = tmp_path / "trtllm" / role["engine_dir"]
        assert (engine / "config.json").is_file() and (engine / "rank0.engine").is_file()
        with open(engine / "config.json") as f:
            build = json.load(f)["build_config"]
        # tensorrt_llm/builder.py adds max_draft_len to max_seq_len for every speculative mode (issue 17 row 4)
        added = meta["limits"]["max_draft_len"] if role is meta["roles"]["target"] else 0
        assert build["max_batch_size"] == 2 and build["max_seq_len"] == 128 + added


# ---- issue 17: what a GPU would refuse is refused at compile, naming the flag ----------------------
@pytest.fixture(scope="module")
def head16_dir(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "h16"), vocab=VOCAB, seed=8)  # head size 64 / 4 = 16


@pytest.fixture(scope="module")
def group3_dir(tmp_path_factory):  # SmolLM2's shape in small: 3 query heads per KV head, head size 32
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "g3"), vocab=VOCAB, hidden=96, heads=6, kv_heads=2,
                        inter=128, seed=9, head_dim=32)


def test_speculative_engines_must_be_half_precision(tmp_path, target_dir, draft_dir):
    """Row 2: Medusa and draft/target engines in float32 (the old e2e script and tests) are refused."""
    target, draft = read_hf_dir(target_dir), read_hf_dir(draft_dir)
    with pytest.raises(ValueError, match=r"--trtllm-dtype float32: medusa speculation .* XQA kernels, which have "
                                         r"float16/bfloat16 only.*use --trtllm-dtype bfloat16 or float16"):
        write_trtllm_bundle_part(str(tmp_path / "x"), target, dtype="float32", max_seq_len=64, medusa=medusa_heads())
    # draft/target does not reach XQA's speculative path; its float32 refusal is the support matrix's
    with pytest.raises(ValueError, match=r"--trtllm-dtype float32: draft/target speculation on TensorRT-LLM is "
                                         r"supported in FP16/BF16/FP8 only \(examples/draft_target_model"):
        write_trtllm_bundle_part(str(tmp_path / "x"), target, dtype="float32", max_seq_len=64, draft=draft,
                                 max_draft_len=4)
    assert not (tmp_path / "x").exists()
    # plain decoding has fp32 kernels; half precision serves every mode
    assert write_trtllm_bundle_part(str(tmp_path / "p"), target, dtype="float32", max_seq_len=64)["mode"] == "none"
    write_trtllm_bundle_part(str(tmp_path / "d"), target, draft=draft, dtype="bfloat16", max_seq_len=64,
                             max_draft_len=4)


def test_head_size_without_a_kernel_is_refused(tmp_path, head16_dir, draft_dir):
    """Row 3: head size 16 (every tiny model before) has no masked-MHA kernel, in any mode."""
    with pytest.raises(ValueError, match=r"the target's head size 16 has no TensorRT-LLM attention kernel \(masked "
                                         r"MHA takes 32, 48, 64"):
        write_trtllm_bundle_part(str(tmp_path / "x"), read_hf_dir(head16_dir), dtype="float16", max_seq_len=64)
    with pytest.raises(ValueError, match="the draft's head size 16"):
        write_trtllm_bundle_part(str(tmp_path / "y"), read_hf_dir(draft_dir), draft=read_hf_dir(head16_dir),
                                 dtype="float16", max_seq_len=64, max_draft_len=4)


def test_xqa_group_sizes(tmp_path, group3_dir):
    """Row 5: 3 query heads per KV head (SmolLM2-135M's 9/3) has no speculative XQA kernel; plain
    decoding does not need one; tp 2 makes the group... still 3 per rank, tp 6 makes it 1."""
    from specbuild.formats.trtllm_support import xqa_group

    ckpt = read_hf_dir(group3_dir)
    assert (xqa_group(9, 3), xqa_group(6, 2, tp=2), xqa_group(6, 2, tp=6), xqa_group(32, 8)) == (3, 3, 1, 4)
    heads = medusa_heads(hidden=96)
    with pytest.raises(ValueError, match=r"6 query heads over 2 KV heads: 3 query heads per KV head at tp=1.*"
                                         r"power-of-two groups only.*a --tp that makes it one \(6\)"):
        write_trtllm_bundle_part(str(tmp_path / "x"), ckpt, medusa=heads, dtype="bfloat16", max_seq_len=64)
    write_trtllm_bundle_part(str(tmp_path / "plain"), ckpt, dtype="bfloat16", max_seq_len=64)
    meta = write_trtllm_bundle_part(str(tmp_path / "tp6"), ckpt, medusa=heads, dtype="bfloat16", max_seq_len=64, tp=6)
    assert meta["roles"]["target"]["world_size"] == 6


def test_draft_target_does_not_take_the_xqa_group_rule(tmp_path, group3_dir, draft_dir):
    """Issue 31 row 1: draft/target engines get no packed mask (generation_mixin.py builds the
    spec-decoding inputs only when not draft_tokens_external), so a group of 3 is accepted there
    at tp 1, with its build commands, while Medusa on the same model is still refused."""
    from specbuild.formats.trtllm_support import kernel_problems

    ckpt = read_hf_dir(group3_dir)
    meta = write_trtllm_bundle_part(str(tmp_path / "dt"), ckpt, draft=ckpt, dtype="float16", max_seq_len=64,
                                    max_draft_len=4)
    assert meta["mode"] == "draft_tokens_external"
    t = flags(meta["build_commands"]["target"])
    assert (t["speculative_decoding_mode"], t["max_draft_len"], t["use_paged_context_fmha"]) == (
        "draft_tokens_external", "4", "enable")
    for mode, refused in (("draft_tokens_external", False), ("none", False), ("medusa", True), ("eagle", True)):
        problems = kernel_problems(ckpt.config, role="target", mode=mode, dtype="bfloat16")
        assert bool(problems) is refused and all("3 query heads per KV head" in p for p in problems), (mode, problems)


def test_every_engine_is_built_with_paged_context_fmha(tmp_path, target_dir, draft_dir):
    """Issue 31 row 5: the executor turns KV block reuse on for every engine, and reuse needs
    paged context FMHA (off by default in older releases): plain and Medusa engines get the
    flag too, in trtllm.json and in build.sh."""
    target, draft = read_hf_dir(target_dir), read_hf_dir(draft_dir)
    for name, extra in (("plain", {}), ("medusa", {"medusa": medusa_heads()}),
                        ("draft", {"draft": draft, "max_draft_len": 3})):
        meta = write_trtllm_bundle_part(str(tmp_path / name), target, dtype="float16", max_seq_len=64, **extra)
        script = open(tmp_path / name / "trtllm" / "build.sh").read()
        for role, argv in meta["build_commands"].items():
            assert flags(argv)["use_paged_context_fmha"] == "enable", (name, role)
            assert shlex.join(argv) in script


def test_medusa_is_tensor_parallel_only(tmp_path, target_dir):
    """Row 6: Medusa with pp > 1 was written; its support matrix is tp only."""
    with pytest.raises(ValueError, match=r"pp=2: Medusa on TensorRT-LLM is tensor parallel only.*use --pp 1"):
        write_trtllm_bundle_part(str(tmp_path / "x"), read_hf_dir(target_dir), medusa=medusa_heads(), pp=2,
                                 dtype="bfloat16", max_seq_len=64)
    assert write_trtllm_bundle_part(str(tmp_path / "tp2"), read_hf_dir(target_dir), medusa=medusa_heads(), tp=2,
                                    dtype="bfloat16", max_seq_len=64)["roles"]["target"]["world_size"] == 2


def test_draft_target_is_one_gpu_with_equal_tp(tmp_path, target_dir, draft_dir):
    """Rows 7 and 8: draft/target at tp*pp > 1 (two leader-mode executors on one MPI world) and a
    draft tp that differs from the target's (its logits padded to another vocabulary) are refused."""
    target, draft = read_hf_dir(target_dir), read_hf_dir(draft_dir)
    with pytest.raises(ValueError, match=r"draft/target with target tp\*pp = 2 and draft tp\*pp = 2: both executors "
                                         r"would run in leader mode on one MPI world, which can hang.*--tp 1 --pp 1"):
        write_trtllm_bundle_part(str(tmp_path / "x"), target, draft=draft, tp=2, dtype="bfloat16", max_seq_len=64,
                                 max_draft_len=4)
    with pytest.raises(ValueError, match=r"draft tp 2 != target tp 1: the draft's generation logits are padded"):
        write_trtllm_bundle_part(str(tmp_path / "x"), target, draft=draft, draft_tp=2, dtype="bfloat16",
                                 max_seq_len=64, max_draft_len=4)
    assert not (tmp_path / "x").exists()


def test_engine_build_needs_a_release_with_the_engine_path(tmp_path, monkeypatch):
    """Row 1: only `import tensorrt_llm` was checked; now the release must carry trtllm-build."""
    from specbuild.compiler.trtllm_build import engine_build_plan

    monkeypatch.setattr(trtllm_build.shutil, "which", lambda name: None)
    for version, outcome in (("0.18.2", "raise"), ("1.3.0", False), ("1.3.0rc2", False), ("2.0.0", False),
                             ("0.19.0", "raise"), ("1.2.1", "raise")):  # in range, but no trtllm-build here
        monkeypatch.setattr(trtllm_build, "tensorrt_llm_available", lambda v=version: (True, v))
        if outcome == "raise":
            with pytest.raises(SpecbuildError) as e:
                engine_build_plan()
            assert e.value.args[0].count("\n") == 0 and version in e.value.args[0]
            assert ("tensorrt_llm>=0.19,<1.3" in e.value.args[0]) if version == "0.18.2" else \
                "trtllm-build is on PATH" in e.value.args[0]
        else:
            ok, why = engine_build_plan()
            assert not ok and f"TensorRT-LLM {version} is installed, which has no trtllm-build" in why
            assert "LLM API path" in why and "tensorrt-backend-removal.md" in why
    monkeypatch.setattr(trtllm_build.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(trtllm_build, "tensorrt_llm_available", lambda: (True, "1.2.1"))
    assert engine_build_plan() == (True, "1.2.1")
