"""TensorRT-LLM engines: the `trtllm-build` command line of each role, `build.sh`, the build
itself where TensorRT-LLM is importable, and the bundle's whole `trtllm/` subtree.

Layout written under the bundle (paths in commands and metadata are relative to `trtllm/`,
so the bundle can move):

    trtllm/
      trtllm.json              metadata: limits, mode, tree, roles and their files, commands
      build.sh                 the exact build commands (run it where TensorRT-LLM is installed)
      checkpoints/target/      config.json + rank{N}.safetensors (MedusaForCausalLM with heads)
      checkpoints/draft/       same, for a separate draft model
      engines/target/ ...      written by trtllm-build

Flags (TensorRT-LLM v0.19's build documentation, examples/draft_target_model/README.md and
examples/medusa/README.md of NVIDIA/TensorRT-LLM): every role gets --max_batch_size,
--max_seq_len and --max_input_len (= max_seq_len, so the build never sees the default 1024
above a shorter max_seq_len); Medusa: --speculative_decoding_mode medusa (max_draft_len is
read from the checkpoint); draft/target: the target --speculative_decoding_mode
draft_tokens_external --max_draft_len K; with logits-based acceptance both gather generation
logits (the target's to verify, the draft's to be returned for rejection sampling).

Every engine gets --use_paged_context_fmha enable, because the executor runs every engine with
KV block reuse on (backends/tensorrt_llm.py) and block reuse needs paged context FMHA:
`cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp` (commit 00825c4e,
executorConfigIsValid / fixExecutorConfig) turns reuse off with "KV cache reuse disabled because
model was not built with paged context FMHA support", and an older stored version of that file
stops instead ("When KV cache block reuse is set, model has to be built with paged context FMHA
support"); a draft/target target without reuse then fails "KV cache block reuse must be enabled
for speculative decoding target model". The flag's default was off in older releases
(`tensorrt_llm/plugin/plugin.py`, commit 035b99e0 and earlier: `_use_paged_context_fmha`
default False, so the CLI default is "disable") and on in later ones ("Allow advanced features
like KV cache reuse and chunked context"), so passing it is harmless where it is the default.
Except on float32 engines: context FMHA has float16/bfloat16 kernels only, so a float32 engine
(plain only: compile refuses float32 for speculative modes) is built without the flag, with
`paged_context_fmha_note` saying so, and the executor runs it without block reuse
(backends/tensorrt_llm.py), which an engine without paged context FMHA cannot have.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from typing import Any, Callable, Sequence

import torch

from specbuild.bundle import Limits
from specbuild.errors import SpecbuildError
from specbuild.formats.checkpoints import Checkpoint
from specbuild.formats.trtllm_checkpoint import check_parallel, normalize_medusa, write_trtllm_checkpoint
from specbuild.formats.trtllm_support import (ENGINE_PATH_END, draft_target_layout_problems, engine_path_problem,
                                              installed_version, kernel_problems, release, xqa_head_size_note)

TRTLLM_DIR = "trtllm"
META_FILE = "trtllm.json"
BUILD_SCRIPT = "build.sh"
EXECUTABLE = "trtllm-build"
PAGED_CONTEXT_FMHA = "--use_paged_context_fmha"
FMHA_DTYPES = ("float16", "bfloat16")  # context FMHA's kernels (fused multi-head attention: fp16/bf16)


def paged_context_fmha_note(dtype: str | None) -> str | None:
    """Why engines of `dtype` are built without --use_paged_context_fmha enable, or None."""
    if dtype is None or dtype in FMHA_DTYPES:
        return None
    return (f"--trtllm-dtype {dtype}: engines are built without {PAGED_CONTEXT_FMHA} enable (context FMHA has "
            f"{'/'.join(FMHA_DTYPES)} kernels only), so they run without KV block reuse and recompute repeated "
            "prompt prefixes; use --trtllm-dtype bfloat16 or float16 to reuse them")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def build_commands(*, target_checkpoint: str, target_engine: str, draft_checkpoint: str | None = None,
                   draft_engine: str | None = None, medusa: bool = False, max_batch_size: int,
                   max_seq_len: int, max_draft_len: int | None = None, gather_generation_logits: bool = False,
                   executable: str = EXECUTABLE, dtype: str | None = None) -> dict[str, list[str]]:
    """role ("target", "draft") -> the argv of its `trtllm-build` (draft/target, Medusa or plain).
    dtype: the checkpoints' (None: not known here); float32 engines get no paged context FMHA."""
    _positive("max_batch_size", max_batch_size)
    _positive("max_seq_len", max_seq_len)
    if medusa and draft_checkpoint is not None:
        raise ValueError("a target with Medusa heads and a separate draft model cannot be combined in one engine")
    if (draft_checkpoint is None) != (draft_engine is None):
        raise ValueError("draft_checkpoint and draft_engine go together")

    def base(ckpt: str, engine: str) -> list[str]:
        return [executable, "--checkpoint_dir", ckpt, "--output_dir", engine,
                "--max_batch_size", str(max_batch_size), "--max_seq_len", str(max_seq_len),
                "--max_input_len", str(max_seq_len)]

    # every float16/bfloat16 engine runs with KV block reuse (module docstring); float32 has no context FMHA
    paged = [] if paged_context_fmha_note(dtype) else [PAGED_CONTEXT_FMHA, "enable"]
    target = base(target_checkpoint, target_engine) + paged
    if medusa:
        return {"target": target + ["--speculative_decoding_mode", "medusa"]}
    if draft_checkpoint is None:
        return {"target": target}
    k = _positive("max_draft_len", max_draft_len)
    logits = ["--gather_generation_logits"] if gather_generation_logits else []
    return {
        "target": target + ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(k)] + logits,
        "draft": base(draft_checkpoint, draft_engine) + paged + logits,
    }


def write_build_script(path: str, commands: dict[str, Sequence[str]]) -> str:
    """An executable bash script running `commands` from its own directory; returns path."""
    lines = [
        "#!/usr/bin/env bash",
        "# Builds this bundle's TensorRT-LLM engines (written by `specbuild compile --backend tensorrt-llm`).",
        "# Needs TensorRT-LLM (`pip install tensorrt_llm` from NVIDIA's index) on a machine with an NVIDIA GPU.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
    ]
    for role, argv in commands.items():
        lines += [f"# {role}", shlex.join(argv)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o755)
    return path


def tensorrt_llm_available() -> tuple[bool, str]:
    """(True, version) when `import tensorrt_llm` works, else (False, the reason)."""
    version, why = installed_version()
    return (True, version) if version is not None else (False, why)


def engine_build_plan() -> tuple[bool, str]:
    """(True, version) when this machine can run trtllm-build for the engine path; (False, why)
    when TensorRT-LLM is absent (the checkpoints are the product) or is a release without the
    engine path (>= 1.3: the LLM-API path serves the bundle). A release older than the pinned
    range raises SpecbuildError: nothing here can run on it."""
    ok, version = tensorrt_llm_available()
    if not ok:
        return False, version
    problem = engine_path_problem(version)
    rel = release(version)
    if problem and rel is not None and rel[:2] >= ENGINE_PATH_END:
        return False, problem
    if problem:
        raise SpecbuildError(problem)
    if shutil.which(EXECUTABLE) is None and not _module_exists("tensorrt_llm.commands.build"):
        raise SpecbuildError(f"TensorRT-LLM {version} is importable but neither {EXECUTABLE} is on PATH nor "
                             "tensorrt_llm.commands.build importable: reinstall TensorRT-LLM (its wheel installs "
                             f"{EXECUTABLE}) or put its bin directory on PATH")
    return True, version


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or a stand-in module without a spec
        return False


def _executable() -> list[str]:
    found = shutil.which(EXECUTABLE)
    return [found] if found else [sys.executable, "-m", "tensorrt_llm.commands.build"]


def build_engines(trtllm_dir: str, commands: dict[str, Sequence[str]] | None = None, *,
                  run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> bool:
    """Run the build commands (default: those in trtllm.json) in `trtllm_dir` when TensorRT-LLM
    is importable; False when it is not (nothing run: the checkpoints are the product).
    A failing build raises SpecbuildError with the role, the exit code and the output's end."""
    ok, _ = engine_build_plan()
    if not ok:
        return False
    meta_path = os.path.join(trtllm_dir, META_FILE)
    meta = None
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    if commands is None:
        if meta is None:
            raise SpecbuildError(f"{trtllm_dir!r} has no {META_FILE}: write the checkpoints first")
        commands = meta["build_commands"]
    for role, argv in commands.items():
        argv = list(argv)
        if argv[0] == EXECUTABLE:
            argv = _executable() + argv[1:]
        proc = run(argv, cwd=trtllm_dir, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).splitlines()[-20:])
            raise SpecbuildError(f"trtllm-build for the {role} failed (exit {proc.returncode}): {tail}")
    if meta is not None:
        meta["engines_built"] = True
        with open(meta_path, "w") as f:
            json.dump(meta, f, indent=2)
    return True


def _tree_meta(tree_paths: list | None, num_heads: int) -> dict[str, Any]:
    from specbuild.speculation.tree import TreeSpec

    tree = TreeSpec.chain(num_heads) if tree_paths is None else TreeSpec.from_paths(tree_paths)
    if tree.max_depth > num_heads:
        raise ValueError(f"the tree is {tree.max_depth} deep but there are only {num_heads} Medusa heads "
                         "(one head per depth)")
    return {
        "name": tree.name,
        "paths": [list(p) for p in tree.paths],  # node order (§3)
        "num_drafts": tree.num_drafts,
        "max_depth": tree.max_depth,
        "medusa_choices": tree.medusa_choices_string(),
        "packed_mask": tree.packed_mask.tolist(),  # [n + 1, ceil((n + 1) / 32)] int32
        "position_offsets": list(tree.depths),
    }


def write_trtllm_bundle_part(out_dir: str, target: Checkpoint, draft: Checkpoint | None = None,
                             medusa: dict[str, torch.Tensor] | None = None, tree_paths: list | None = None,
                             tp: int = 1, pp: int = 1, dtype: str = "float16", max_batch_size: int = 8,
                             max_seq_len: int = 2048, max_draft_len: int | None = None, *,
                             draft_tp: int | None = None, draft_pp: int | None = None,
                             gather_generation_logits: bool = False, llmapi: bool = True,
                             eagle3_dir: str | None = None) -> dict[str, Any]:
    """Write `<out_dir>/trtllm/` (checkpoints, build.sh, trtllm.json) for a bundle; returns the
    metadata. Everything is validated before anything is written.

    max_draft_len: Medusa: default the tree's node count (the tree defaults to a chain of one
    node per head) and at least that; draft: default Limits().max_draft_len; plain: 0.
    gather_generation_logits (draft only; `compile --trtllm-gather-generation-logits`): both
    engines are built with --gather_generation_logits, so sampled requests can speculate.
    llmapi: also write each role as a Hugging Face directory (trtllm/hf/<role>, in `dtype`),
    what TensorRT-LLM's LLM API (PyTorch backend, backends/tensorrt_llm_api.py) loads;
    eagle3_dir: an EAGLE-3 draft head directory (in the form Eagle3DecodingConfig reads),
    copied to trtllm/hf/eagle3 for that path."""
    if medusa is not None and draft is not None:
        raise ValueError("--medusa and --draft cannot be combined for the TensorRT-LLM backend")
    if tree_paths is not None and medusa is None:
        raise ValueError("a token tree needs Medusa heads in the TensorRT-LLM backend (draft models propose chains)")
    if eagle3_dir is not None and not os.path.isfile(os.path.join(eagle3_dir, "config.json")):
        raise ValueError(f"eagle3_dir {eagle3_dir!r} has no config.json: not an EAGLE-3 head directory")
    if gather_generation_logits and draft is None:
        raise ValueError("--trtllm-gather-generation-logits is for sampled acceptance of a draft model's tokens "
                         "(external draft tokens) and needs --draft; Medusa on TensorRT-LLM is greedy-only and "
                         "plain decoding compares no logits")
    draft_tp = tp if draft_tp is None else draft_tp
    draft_pp = pp if draft_pp is None else draft_pp
    check_parallel(target.config, tp, pp, medusa=medusa is not None, role="target")
    tree = None
    if medusa is not None:
        shared = target.tensors.get("lm_head.weight", target.tensors["model.embed_tokens.weight"])
        _, num_heads, _ = normalize_medusa(medusa, target.config, shared)
        tree = _tree_meta(tree_paths, num_heads)
        if max_draft_len is None:
            max_draft_len = tree["num_drafts"]
        elif max_draft_len < tree["num_drafts"]:
            raise ValueError(f"max_draft_len={max_draft_len} is below the tree's {tree['num_drafts']} draft nodes")
        mode = "medusa"
    elif draft is not None:
        check_parallel(draft.config, draft_tp, draft_pp, role="draft")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocab_size {draft.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}; TensorRT-LLM compares their logits row for row")
        max_draft_len = Limits().max_draft_len if max_draft_len is None else max_draft_len
        _positive("max_draft_len", max_draft_len)
        mode = "draft_tokens_external"
    else:
        max_draft_len, mode = 0, "none"
    # what the GPU would refuse, refused here first (formats/trtllm_support.py says where each rule is read)
    problems = kernel_problems(target.config, role="target", mode=mode, dtype=dtype, tp=tp)
    if draft is not None:
        problems += kernel_problems(draft.config, role="draft", mode="none", dtype=dtype, tp=draft_tp)
        problems += draft_target_layout_problems(tp=tp, pp=pp, draft_tp=draft_tp, draft_pp=draft_pp)
    if problems:
        raise ValueError("these TensorRT-LLM engines would fail on a GPU: " + "; ".join(problems))
    limits = Limits(max_seq_len=max_seq_len, max_batch_size=max_batch_size, max_draft_len=max_draft_len)

    root = os.path.join(out_dir, TRTLLM_DIR)
    roles: dict[str, dict[str, Any]] = {}
    plan = [("target", target, tp, pp)] + ([("draft", draft, draft_tp, draft_pp)] if draft is not None else [])
    for role, ckpt, role_tp, role_pp in plan:
        rel = f"checkpoints/{role}"
        heads = medusa if role == "target" else None
        cfg = write_trtllm_checkpoint(ckpt, os.path.join(root, rel), dtype=dtype, tp=role_tp, pp=role_pp,
                                      medusa=heads, max_draft_len=max_draft_len if heads is not None else None)
        roles[role] = {
            "architecture": cfg["architecture"], "source": ckpt.source, "tp": role_tp, "pp": role_pp,
            "world_size": role_tp * role_pp, "checkpoint_dir": rel, "engine_dir": f"engines/{role}",
            "files": sorted(os.listdir(os.path.join(root, rel))),
        }
        if heads is not None:
            roles[role].update({k: cfg[k] for k in ("num_medusa_heads", "num_medusa_layers", "max_draft_len")})
    commands = build_commands(
        target_checkpoint=roles["target"]["checkpoint_dir"], target_engine=roles["target"]["engine_dir"],
        draft_checkpoint=roles.get("draft", {}).get("checkpoint_dir"),
        draft_engine=roles.get("draft", {}).get("engine_dir"), medusa=medusa is not None,
        max_batch_size=limits.max_batch_size, max_seq_len=limits.max_seq_len,
        max_draft_len=limits.max_draft_len or None, gather_generation_logits=gather_generation_logits, dtype=dtype)
    write_build_script(os.path.join(root, BUILD_SCRIPT), commands)
    hf_roles: dict[str, str] = {}
    if llmapi:
        from specbuild.formats.hf_export import write_hf_dir

        for role, ckpt, _, _ in plan:
            hf_roles[role] = write_hf_dir(ckpt, os.path.join(root, "hf", role), dtype=dtype)
        if eagle3_dir is not None:
            shutil.copytree(eagle3_dir, os.path.join(root, "hf", "eagle3"))
            hf_roles["eagle3"] = "hf/eagle3"
        hf_roles = {role: f"hf/{role}" for role in hf_roles}
    meta = {
        "format": "specbuild.trtllm", "version": 1, "dtype": dtype, "mode": mode,
        "limits": {"max_batch_size": limits.max_batch_size, "max_seq_len": limits.max_seq_len,
                   "max_draft_len": limits.max_draft_len},
        "gather_generation_logits": gather_generation_logits, "tree": tree, "roles": roles,
        "build_script": BUILD_SCRIPT, "build_commands": commands, "engines_built": False,
        "llmapi": {"models": hf_roles, "tp": tp} if llmapi else None,
        "notes": [n for n in (paged_context_fmha_note(dtype), xqa_head_size_note(target.config, mode)) if n],
    }
    with open(os.path.join(root, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    return meta
