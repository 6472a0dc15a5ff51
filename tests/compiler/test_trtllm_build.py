"""TensorRT-LLM engine build: trtllm-build flags per role, build.sh, the bundle's trtllm/
subtree, and the build itself (real only where tensorrt_llm imports and a GPU is present)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
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
    assert flags(cmds["target"]) == {"checkpoint_dir": "c/t", "output_dir": "e/t", **LIMITS}
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
    return make_tiny_hf(str(root / "target"), vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, seed=5)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return make_tiny_hf(str(root / "draft"), vocab=VOCAB, hidden=32, layers=1, heads=2, kv_heads=1, inter=64, seed=6)


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
    meta = write_trtllm_bundle_part(str(tmp_path), target, draft=draft, tp=4, pp=2, draft_tp=1, draft_pp=1,
                                    dtype="float32", max_batch_size=2, max_seq_len=128, max_draft_len=5,
                                    gather_generation_logits=True)
    assert meta["mode"] == "draft_tokens_external" and meta["tree"] is None
    assert (meta["roles"]["target"]["world_size"], meta["roles"]["draft"]["world_size"]) == (8, 1)
    assert meta["roles"]["draft"]["architecture"] == "LlamaForCausalLM"
    t, d = (flags(meta["build_commands"][r]) for r in ("target", "draft"))
    assert (t["speculative_decoding_mode"], t["max_draft_len"], t["use_paged_context_fmha"]) == (
        "draft_tokens_external", "5", "enable")
    assert d["use_paged_context_fmha"] == "enable" and "speculative_decoding_mode" not in d
    assert "gather_generation_logits" in t and "gather_generation_logits" in d
    back = read_trtllm_checkpoint(str(tmp_path / "trtllm" / meta["roles"]["draft"]["checkpoint_dir"]))
    assert all(torch.equal(back.tensors[n], draft.tensors[n]) for n in draft.tensors)


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
    monkeypatch.setattr(trtllm_build, "tensorrt_llm_available", lambda: (True, "test"))
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
        assert build["max_batch_size"] == 2 and build["max_seq_len"] == 128
