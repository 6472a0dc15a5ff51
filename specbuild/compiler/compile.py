"""compile(target, drafters, options) -> bundle directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file

from specbuild import __version__
from specbuild.bundle import BundleMeta, Limits, tokenizer_fingerprint, write_meta, write_model_config
from specbuild.compiler.draft_role import is_draft_dir, resolve_drafter, write_draft_role
from specbuild.errors import CheckpointError, SpecbuildError
from specbuild.formats.checkpoints import Checkpoint, read_checkpoint, to_runtime_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


@dataclass(frozen=True)
class CompileOptions:
    """quantize: the layers' linear weights (none | int8 per row | int4 per group_size
    inputs), weight-only, their inputs rounded to `activations` (bfloat16 | float32).
    embedding_format / lm_head_format: dense (= dtype), float32, bfloat16, float16, int8, int4.
    formats: dense copies (float32 | bfloat16) of quantized weights that the runtime builds
    at load for wide verification (float32 copies give the same numbers)."""

    dtype: str = "float32"
    max_seq_len: int = 2048
    max_batch_size: int = 8
    max_draft_len: int = 8
    backend: str = "torch"  # torch | tensorrt-llm (adds trtllm/ checkpoints + engines)
    tp: int = 1
    pp: int = 1
    trtllm_dtype: str = "float16"
    # tensorrt-llm with a draft model: engines gather generation logits (sampled acceptance)
    trtllm_gather_generation_logits: bool = False
    quantize: str = "none"
    group_size: int = 32
    activations: str = "bfloat16"
    embedding_format: str = "dense"
    lm_head_format: str = "dense"
    # float32 | int8: an int8 lm_head's inputs rounded to int8 blocks of 32 (opt-in, lossy)
    lm_head_activations: str = "float32"
    formats: tuple[str, ...] = ("float32",)

    def __post_init__(self) -> None:
        from specbuild.compiler.quantize import check_quant_options

        check_quant_options(self)
        if self.backend not in ("torch", "tensorrt-llm"):
            raise SpecbuildError(f"--backend {self.backend!r} is not one of torch, tensorrt-llm")
        if self.trtllm_gather_generation_logits and self.backend != "tensorrt-llm":
            raise SpecbuildError("--trtllm-gather-generation-logits builds TensorRT-LLM engines: it needs "
                                 "--backend tensorrt-llm")
        if self.dtype not in DTYPES:
            raise SpecbuildError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        Limits(self.max_seq_len, self.max_batch_size, self.max_draft_len)  # validates ranges


def write_role(bundle_dir: str, role: str, ckpt: Checkpoint, dtype: str,
               options: CompileOptions | None = None) -> dict[str, Any]:
    """Write <bundle>/<role>/model.json + weights.safetensors (+ quant.json when a weight
    is quantized or in another dtype, see compiler/quantize.py); return the role's entry."""
    from specbuild.compiler.quantize import quantize_role

    role_dir = os.path.join(bundle_dir, role)
    weights = to_runtime_layout(ckpt, DTYPES[dtype])
    quant = quantize_role(ckpt, weights, dtype, options) if options is not None else None
    config = dataclasses.replace(ckpt.config, dtype=dtype)
    write_model_config(role_dir, config)
    save_file(weights, os.path.join(role_dir, "weights.safetensors"), metadata={"format": "specbuild-runtime-v1"})
    extra = {}
    if quant is not None:
        with open(os.path.join(role_dir, "quant.json"), "w") as f:
            json.dump(quant, f, indent=1)
        extra = {k: quant[k] for k in ("quantize", "activations", "lm_head_activations", "formats", "bytes_by_format",
                                       "conversions") if k in quant}
    return {**extra,
        "path": role,
        "source": os.path.abspath(ckpt.source) if ckpt.source else "",
        "source_format": ckpt.source_format,
        "dtype": dtype,
        "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "tokenizer_fingerprint": tokenizer_fingerprint(ckpt.tokenizer_json),
    }


def check_same_tokenizer(target: Checkpoint, other: Checkpoint, role: str) -> None:
    """Refuse a drafter whose ids differ from the target's for the same strings."""
    a, b = json.loads(target.tokenizer_json), json.loads(other.tokenizer_json)
    va, vb = a.get("model", {}).get("vocab", {}), b.get("model", {}).get("vocab", {})
    if len(va) != len(vb):
        raise CheckpointError(f"{role} tokenizer has {len(vb)} tokens, the target's has {len(va)}: "
                              "draft and target must tokenize identically")
    for tok, idx in va.items():
        if vb.get(tok) != idx:
            raise CheckpointError(f"{role} tokenizer maps {tok!r} to id {vb.get(tok)}, the target to {idx}: "
                                  "draft and target must tokenize identically")
    if tokenizer_fingerprint(target.tokenizer_json) != tokenizer_fingerprint(other.tokenizer_json):
        raise CheckpointError(f"{role} tokenizer has the target's vocabulary but different merges, "
                              "pre-tokenizer or special tokens: draft and target must tokenize identically")


def compile_bundle(target: str | Checkpoint, out_dir: str, options: CompileOptions = CompileOptions(),
                   draft: str | Checkpoint | None = None, medusa: str | None = None, tree: str | None = None,
                   eagle: str | None = None, speculation: dict | None = None,
                   sampling: dict | None = None, progress=None) -> str:
    """Read the sources, write the bundle atomically (temp dir, then rename). Returns out_dir."""
    say = progress or (lambda msg: None)
    say(f"reading target {target if isinstance(target, str) else target.source}")
    tgt = read_checkpoint(target) if isinstance(target, str) else target
    draft = resolve_drafter(draft) if isinstance(draft, str) else draft
    medusa = resolve_drafter(medusa)
    own_draft = isinstance(draft, str) and is_draft_dir(draft)  # a train-draft directory (shares the target's)
    if own_draft and options.backend == "tensorrt-llm":
        raise SpecbuildError(f"--draft {draft!r} is a specbuild draft (shared embedding, reduced vocabulary); "
                             "for --backend tensorrt-llm export it first with `specbuild export-draft`")
    drf = None
    if draft is not None and not own_draft:
        say(f"reading draft {draft if isinstance(draft, str) else draft.source}")
        drf = read_checkpoint(draft) if isinstance(draft, str) else draft
        check_same_tokenizer(tgt, drf, "draft")
        if drf.config.vocab_size != tgt.config.vocab_size:
            raise CheckpointError(f"draft vocab_size {drf.config.vocab_size} != target vocab_size "
                                  f"{tgt.config.vocab_size}")
    if options.max_seq_len > tgt.config.max_position_embeddings and not tgt.config.rope_scaling:
        say(f"note: max_seq_len {options.max_seq_len} exceeds the model's trained context "
            f"{tgt.config.max_position_embeddings}")
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".specbuild-", dir=parent)
    try:
        roles = {"target": write_role(tmp, "target", tgt, options.dtype, options)}
        say(f"wrote target ({roles['target']['bytes'] / 1e6:.1f} MB, {options.dtype})")
        if own_draft:
            roles["draft"] = write_draft_role(tmp, draft, tgt.config, tgt.tokenizer_json,
                                              tgt.config.tie_word_embeddings, options.dtype)
            say(f"wrote draft ({roles['draft']['bytes'] / 1e6:.1f} MB of its own; embedding and output rows "
                "shared with the target)")
        elif drf is not None:
            roles["draft"] = write_role(tmp, "draft", drf, options.dtype, options)
            say(f"wrote draft ({roles['draft']['bytes'] / 1e6:.1f} MB)")
        limits = Limits(options.max_seq_len, options.max_batch_size, options.max_draft_len)
        if medusa is not None:
            from specbuild.compiler.medusa_role import write_medusa_role

            if options.lm_head_format not in ("dense", options.dtype) or \
                    (tgt.config.tie_word_embeddings and options.embedding_format not in ("dense", options.dtype)):
                raise SpecbuildError(
                    f"--medusa shares the target's lm_head, which --lm-head-format/--embedding-format "
                    f"{options.lm_head_format}/{options.embedding_format} stores quantized; Medusa heads "
                    "need it dense: drop those flags (the layers may still be quantized)")

            roles["medusa"] = write_medusa_role(tmp, medusa, tree, progress=say)
            roles["medusa"]["tokenizer_fingerprint"] = tokenizer_fingerprint(tgt.tokenizer_json)
            if limits.max_draft_len < roles["medusa"]["tree_nodes"]:
                limits = dataclasses.replace(limits, max_draft_len=roles["medusa"]["tree_nodes"])
        elif tree is not None:
            raise SpecbuildError("--tree needs --medusa HEADS (the tree is drafted by Medusa heads)")
        if eagle is not None:
            from specbuild.compiler.eagle_role import write_eagle_role

            roles["eagle"] = write_eagle_role(tmp, resolve_drafter(eagle), tgt.config, options.dtype)
            roles["eagle"]["tokenizer_fingerprint"] = tokenizer_fingerprint(tgt.tokenizer_json)
            say(f"wrote eagle head ({roles['eagle']['bytes'] / 1e6:.1f} MB of its own; embedding shared)")
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(tgt.tokenizer_json)
        if options.backend == "tensorrt-llm":
            from specbuild.compiler.trtllm_build import build_engines, write_trtllm_bundle_part

            heads, tree_paths, max_draft = None, None, (options.max_draft_len if drf is not None else None)
            if medusa is not None:  # heads with the target's lm_head written as copies, the bundle's tree
                from specbuild.speculation.tree import load_tree
                from specbuild.compiler.medusa_role import read_medusa

                mw = read_medusa(medusa)
                lm = tgt.tensors.get("lm_head.weight", tgt.tensors["model.embed_tokens.weight"])
                heads = mw.tensors(lm)
                spec = load_tree(os.path.join(tmp, "medusa", "tree.json"), allow_files=True)
                tree_paths, max_draft = [list(p) for p in spec.paths], spec.num_drafts
            eagle3_dir = None
            if eagle is not None:  # the head where TensorRT-LLM's EAGLE-3 loader reads it: trtllm/hf/eagle3
                from specbuild.compiler.eagle_role import write_standalone

                eagle3_dir = os.path.join(tmp, ".eagle3-trtllm")
                write_standalone(os.path.join(tmp, roles["eagle"]["path"]), eagle3_dir, options.trtllm_dtype)
            say(f"writing TensorRT-LLM checkpoints (tp={options.tp}, pp={options.pp}, {options.trtllm_dtype})")
            part = write_trtllm_bundle_part(
                tmp, tgt, drf, medusa=heads, tree_paths=tree_paths, tp=options.tp, pp=options.pp,
                dtype=options.trtllm_dtype, max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
                max_draft_len=max_draft, gather_generation_logits=options.trtllm_gather_generation_logits,
                eagle3_dir=eagle3_dir)
            if eagle3_dir is not None:
                shutil.rmtree(eagle3_dir)
            for note in part["notes"]:
                say(f"note: {note}")
            if build_engines(os.path.join(tmp, "trtllm")):
                say("TensorRT-LLM engines built")
            else:
                from specbuild.compiler.trtllm_build import engine_build_plan

                say(f"engines not built here ({engine_build_plan()[1]}): checkpoints written; run trtllm/build.sh "
                    "on a machine with TensorRT-LLM 0.19-1.2 to build the engines")
        default_spec = speculation or {"method": "medusa" if medusa is not None else
                                       "draft" if drf is not None or own_draft else "none"}
        meta = BundleMeta(
            roles=roles,
            tokenizer_fingerprint=tokenizer_fingerprint(tgt.tokenizer_json),
            limits=limits,
            default_sampling=sampling or {"temperature": 0.0, "max_tokens": 128},
            default_speculation=default_spec,
            special_tokens=tgt.special,
            specbuild_version=__version__,
            backend=options.backend,
        )
        write_meta(tmp, meta)
        if os.path.exists(out_dir):
            if not os.path.isfile(os.path.join(out_dir, "bundle.json")) and os.listdir(out_dir):
                raise SpecbuildError(f"--out {out_dir!r} exists and is not a bundle; refusing to overwrite it")
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
