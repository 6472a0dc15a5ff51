"""TensorRT-LLM checkpoints: write them from a `Checkpoint`, and read them back.

A TensorRT-LLM checkpoint (the input of `trtllm-build`) is a directory with `config.json`
and `rank{N}.safetensors`, N = 0 .. tp * pp - 1, each file holding that rank's shards
only (read at v0.19). What this module matches, and where it was
read (NVIDIA/TensorRT-LLM, Apache-2.0; formats only, no code taken):

- names and tp splits: `tensorrt_llm/models/llama/convert.py` (`load_weights_from_hf_model`)
  and `models/qwen/convert.py` (`convert_hf_qwen`): fc = HF gate_proj, gate = HF up_proj,
  qkv per rank = cat(chunk_r(q), chunk_r(k), chunk_r(v)) after `dup_kv_weight` /
  `dup_kv_bias` repeat each KV head tp / kv_heads times (adjacent copies) when
  kv_heads < tp; dense and proj split on dim 1; norms replicated;
- pipeline stages: `tensorrt_llm/mapping.py`: tp_rank = rank % tp, pp_rank = rank // tp
  (cp = 1); `pp_layers` = `torch.tensor_split(arange(L), pp)[pp_rank]` in newer releases,
  `range(pp_rank * L // pp, ...)` in older ones, which agree only when pp divides L, so
  check_parallel requires that (and Medusa: pp = 1, its support matrix being tp only); layer names use the index local to the stage
  (`transformer.layers.{l - layers_range[0]}`); the embedding lives on the first stage,
  `ln_f` and `lm_head` on the last (`is_first_pp_rank` / `is_last_pp_rank`);
- lm_head: padded with zero rows to `pad_vocab_size(V, tp)` (a multiple of tp), then split
  on dim 0; with tied embeddings the embedding is written as lm_head on the last stage;
- Qwen2 is `Qwen2ForCausalLM` with `qwen_type: "qwen2"` (`models/qwen/model.py`: q/k/v
  bias, `dense_bias=False`); `LlamaForCausalLM` with `attn_bias` would expect a dense
  bias too, which Qwen2 lacks;
- Medusa: `examples/medusa/convert_checkpoint.py` writes `MedusaForCausalLM` with
  `num_medusa_heads`, `num_medusa_layers`, `max_draft_len`, `model_type` (+ `qwen_type`),
  and the heads on every rank (`models/medusa/weight.py` `load_medusa_hf`: linear weight,
  bias and lm_head split on dim 0). `models/medusa/model.py` sizes each head's lm_head to
  the padded vocabulary, so the heads' lm_head is padded like the main one.

One extension: TensorRT-LLM sizes each rank's MLP as intermediate // tp
(`layers/linear.py`), so an intermediate size tp does not divide cannot be split. The
writer then pads fc/gate with zero rows and proj with zero columns up to a multiple of tp
(exact: silu(0) * 0 = 0) and records the true size under `config["specbuild"]`; this is
what makes tp = 9 possible for SmolLM2-135M (intermediate 1536).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from specbuild.bundle import ModelConfig
from specbuild.errors import CheckpointError
from specbuild.formats.checkpoints import Checkpoint

TRTLLM_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
MEDUSA_DEFAULT_MAX_DRAFT_LEN = 63  # MedusaConfig default in TensorRT-LLM


# ---- mapping ------------------------------------------------------------------------------
def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp (TensorRT-LLM `pad_vocab_size`)."""
    return -(-vocab_size // tp) * tp


def valid_tp_sizes(config: ModelConfig, *, medusa: bool = False) -> list[int]:
    """Every tp that splits this model: tp divides the attention heads and the KV heads
    split evenly or are duplicated evenly (kv % tp == 0 or tp % kv == 0). Medusa heads
    split their hidden x hidden linear on dim 0, so with heads tp must divide hidden too."""
    sizes = []
    for tp in range(1, config.num_heads + 1):
        if config.num_heads % tp:
            continue
        if config.num_kv_heads % tp and tp % config.num_kv_heads:
            continue
        if medusa and config.hidden_size % tp:
            continue
        sizes.append(tp)
    return sizes


def check_parallel(config: ModelConfig, tp: int, pp: int, *, medusa: bool = False, role: str = "model") -> None:
    """ValueError naming the value and the valid ones when tp or pp cannot split `config`."""
    valid = valid_tp_sizes(config, medusa=medusa)
    if not isinstance(tp, int) or tp not in valid:
        raise ValueError(
            f"tp={tp!r} cannot split the {role} ({config.num_heads} attention heads, "
            f"{config.num_kv_heads} KV heads{', Medusa heads' if medusa else ''}); "
            f"valid tp sizes: {', '.join(map(str, valid))}"
        )
    if not isinstance(pp, int) or not 1 <= pp <= config.num_layers:
        raise ValueError(f"pp={pp!r} must be in [1, {config.num_layers}] (the {role} has {config.num_layers} layers)")
    if medusa and pp != 1:  # Medusa's support matrix is tensor parallel only (formats/trtllm_support.py)
        raise ValueError(f"pp={pp}: Medusa on TensorRT-LLM is tensor parallel only (its support matrix has no "
                         "pipeline parallelism): use --pp 1 and --tp for more GPUs")
    if config.num_layers % pp:
        # tensorrt_llm/mapping.py splits stages as num_layers // pp in several releases of the pinned range
        # (the uneven tensor_split came later): an uneven split would drop layers there
        divisors = [d for d in range(1, config.num_layers + 1) if config.num_layers % d == 0]
        raise ValueError(f"pp={pp} does not divide the {role}'s {config.num_layers} layers (several TensorRT-LLM "
                         f"releases split stages as layers // pp and would drop layers); valid pp sizes: "
                         f"{', '.join(map(str, divisors))}")


def rank_position(rank: int, tp: int) -> tuple[int, int]:
    """rank -> (tp_rank, pp_rank) as tensorrt_llm.Mapping computes them (cp = 1)."""
    return rank % tp, rank // tp


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Global layer indices of each pipeline stage (Mapping.pp_layers: tensor_split)."""
    return [range(int(c[0]), int(c[-1]) + 1) for c in torch.tensor_split(torch.arange(num_layers), pp)]


def padded_intermediate(config: ModelConfig, tp: int) -> int:
    return -(-config.intermediate_size // tp) * tp


# ---- config.json --------------------------------------------------------------------------
def _rotary_scaling(config: ModelConfig) -> dict | None:
    if config.rope_scaling is None:
        return None
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    scaling.setdefault("type", kind)  # TensorRT-LLM reads "type"; HF writes "rope_type"
    scaling.setdefault("rope_type", kind)
    return scaling


def trtllm_config(config: ModelConfig, *, dtype: str, tp: int, pp: int, medusa: dict | None = None) -> dict[str, Any]:
    """config.json for a Llama/Qwen2 target (or its Medusa form: `medusa` = {num_medusa_heads,
    num_medusa_layers, max_draft_len})."""
    if config.architecture == "llama" and config.attn_bias:
        raise ValueError("a Llama checkpoint with attention bias has no TensorRT-LLM Llama form here "
                         "(its o_proj bias is not read); only Qwen2 carries q/k/v bias")
    inter = padded_intermediate(config, tp)
    out: dict[str, Any] = {
        "architecture": "Qwen2ForCausalLM" if config.architecture == "qwen2" else "LlamaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": inter,
        "head_size": config.head_dim,
        "norm_epsilon": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": config.rope_theta,
        "rotary_scaling": _rotary_scaling(config),
        "tie_word_embeddings": config.tie_word_embeddings,
        "mlp_bias": False,
        "attn_bias": config.attn_bias,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        # only the keys every release's Mapping(**mapping) takes: cp_size and moe_* are left to their
        # defaults (1, and tp / 1), since releases before them refuse unknown keywords
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "gpus_per_node": 8},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if config.architecture == "qwen2":
        out["qwen_type"] = "qwen2"
    if inter != config.intermediate_size:
        out["specbuild"] = {"intermediate_size": config.intermediate_size}
    if medusa is not None:
        out["architecture"] = "MedusaForCausalLM"
        out["model_type"] = "qwen2" if config.architecture == "qwen2" else "llama"
        out.update({k: int(medusa[k]) for k in ("num_medusa_heads", "num_medusa_layers", "max_draft_len")})
    return out


# ---- Medusa heads -------------------------------------------------------------------------
_FD_LINEAR = re.compile(r"^(?:medusa_heads\.)?(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_HEAD = re.compile(r"^(?:medusa_heads\.)?(\d+)\.(\d+)\.weight$")
_TRT_LINEAR = re.compile(r"^medusa_heads\.(\d+)\.medusa_layers\.(\d+)\.linear\.(weight|bias)$")
_TRT_HEAD = re.compile(r"^medusa_heads\.(\d+)\.lm_head\.weight$")


def normalize_medusa(heads: dict[str, torch.Tensor], config: ModelConfig,
                     fallback_lm_head: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], int, int]:
    """Medusa heads in FasterDecoding form (`{h}.{l}.linear.weight|bias`, `{h}.{L}.weight`)
    or TensorRT-LLM names -> (FasterDecoding dict, num_heads, num_layers). A head without
    its own lm_head gets `fallback_lm_head` (the target's, shared)."""
    linear: dict[tuple[int, int, str], torch.Tensor] = {}
    head_lm: dict[tuple[int, int | None], torch.Tensor] = {}
    for name, t in heads.items():
        if m := _TRT_LINEAR.match(name) or _FD_LINEAR.match(name):
            linear[(int(m[1]), int(m[2]), m[3])] = t
        elif m := _TRT_HEAD.match(name):
            head_lm[(int(m[1]), None)] = t
        elif m := _FD_HEAD.match(name):
            head_lm[(int(m[1]), int(m[2]))] = t
        else:
            raise CheckpointError(f"Medusa tensor {name!r} is neither FasterDecoding "
                                  "('{h}.{l}.linear.weight') nor TensorRT-LLM ('medusa_heads.{h}...') naming")
    if not linear:
        raise CheckpointError("the Medusa heads hold no '{h}.{l}.linear.weight' tensors")
    num_heads = max(h for h, _, _ in linear) + 1
    num_layers = max(l for _, l, _ in linear) + 1
    hidden, vocab = config.hidden_size, config.vocab_size
    out: dict[str, torch.Tensor] = {}
    for h in range(num_heads):
        for l in range(num_layers):
            for kind, shape in (("weight", (hidden, hidden)), ("bias", (hidden,))):
                t = linear.get((h, l, kind))
                if t is None:
                    raise CheckpointError(f"Medusa head {h} layer {l} lacks its linear.{kind}")
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"Medusa {h}.{l}.linear.{kind} has shape {tuple(t.shape)}, expected {shape}")
                out[f"{h}.{l}.linear.{kind}"] = t
        lm = head_lm.get((h, num_layers), head_lm.get((h, None), fallback_lm_head))
        if lm is None:
            raise CheckpointError(f"Medusa head {h} has no lm_head ('{h}.{num_layers}.weight') and none is shared")
        if tuple(lm.shape) != (vocab, hidden):
            raise CheckpointError(f"Medusa head {h} lm_head has shape {tuple(lm.shape)}, expected {(vocab, hidden)}")
        out[f"{h}.{num_layers}.weight"] = lm
    return out, num_heads, num_layers


# ---- writer -------------------------------------------------------------------------------
def _chunk(t: torch.Tensor, tp: int, tp_rank: int, dim: int = 0) -> torch.Tensor:
    assert t.shape[dim] % tp == 0, (tuple(t.shape), dim, tp)
    return torch.chunk(t, tp, dim=dim)[tp_rank]


def _dup_kv(t: torch.Tensor, kv_heads: int, tp: int) -> torch.Tensor:
    """[kv * d, ...] -> [tp * d, ...]: each KV head repeated tp / kv times, copies adjacent."""
    if kv_heads >= tp:
        return t
    reps = tp // kv_heads
    per_head = t.reshape(kv_heads, t.shape[0] // kv_heads, *t.shape[1:])
    return per_head.repeat_interleave(reps, dim=0).reshape(reps * t.shape[0], *t.shape[1:])


def _pad_rows(t: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    if t.shape[dim] == rows:
        return t
    pad_shape = list(t.shape)
    pad_shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def rank_tensors(ckpt: Checkpoint, rank: int, *, tp: int, pp: int,
                 medusa: dict[str, torch.Tensor] | None = None, num_medusa_layers: int = 0) -> dict[str, torch.Tensor]:
    """One rank's tensors (TensorRT-LLM names, source dtype); `medusa` in FasterDecoding form."""
    c, t = ckpt.config, ckpt.tensors
    tp_rank, pp_rank = rank_position(rank, tp)
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["transformer.vocab_embedding.weight"] = t["model.embed_tokens.weight"]
    inter = padded_intermediate(c, tp)
    layers = pp_layer_ranges(c.num_layers, pp)[pp_rank]
    for local, layer in enumerate(layers):
        src, dst = f"model.layers.{layer}.", f"transformer.layers.{local}."
        a, m = src + "self_attn.", src + "mlp."
        q = _chunk(t[a + "q_proj.weight"], tp, tp_rank)
        k = _chunk(_dup_kv(t[a + "k_proj.weight"], c.num_kv_heads, tp), tp, tp_rank)
        v = _chunk(_dup_kv(t[a + "v_proj.weight"], c.num_kv_heads, tp), tp, tp_rank)
        out[dst + "attention.qkv.weight"] = torch.cat([q, k, v])
        if c.attn_bias:
            qb = _chunk(t[a + "q_proj.bias"], tp, tp_rank)
            kb = _chunk(_dup_kv(t[a + "k_proj.bias"], c.num_kv_heads, tp), tp, tp_rank)
            vb = _chunk(_dup_kv(t[a + "v_proj.bias"], c.num_kv_heads, tp), tp, tp_rank)
            out[dst + "attention.qkv.bias"] = torch.cat([qb, kb, vb])
        out[dst + "attention.dense.weight"] = _chunk(t[a + "o_proj.weight"], tp, tp_rank, dim=1)
        out[dst + "input_layernorm.weight"] = t[src + "input_layernorm.weight"]
        out[dst + "post_layernorm.weight"] = t[src + "post_attention_layernorm.weight"]
        # the trap: TensorRT-LLM computes proj(silu(fc(x)) * gate(x)), so fc is HF gate_proj
        out[dst + "mlp.fc.weight"] = _chunk(_pad_rows(t[m + "gate_proj.weight"], inter), tp, tp_rank)
        out[dst + "mlp.gate.weight"] = _chunk(_pad_rows(t[m + "up_proj.weight"], inter), tp, tp_rank)
        out[dst + "mlp.proj.weight"] = _chunk(_pad_rows(t[m + "down_proj.weight"], inter, dim=1), tp, tp_rank, dim=1)
    vocab_padded = pad_vocab_size(c.vocab_size, tp)
    if pp_rank == pp - 1:
        out["transformer.ln_f.weight"] = t["model.norm.weight"]
        lm_head = t["model.embed_tokens.weight"] if c.tie_word_embeddings else t["lm_head.weight"]
        out["lm_head.weight"] = _chunk(_pad_rows(lm_head, vocab_padded), tp, tp_rank)
    if medusa is not None:  # every rank, as examples/medusa/convert_checkpoint.py writes them
        heads = sorted({int(n.split(".")[0]) for n in medusa})
        for h in heads:
            for l in range(num_medusa_layers):
                p = f"medusa_heads.{h}.medusa_layers.{l}.linear."
                out[p + "weight"] = _chunk(medusa[f"{h}.{l}.linear.weight"], tp, tp_rank)
                out[p + "bias"] = _chunk(medusa[f"{h}.{l}.linear.bias"], tp, tp_rank)
            lm = _pad_rows(medusa[f"{h}.{num_medusa_layers}.weight"], vocab_padded)
            out[f"medusa_heads.{h}.lm_head.weight"] = _chunk(lm, tp, tp_rank)
    return out


def write_trtllm_checkpoint(ckpt: Checkpoint, out_dir: str, *, dtype: str = "float16", tp: int = 1, pp: int = 1,
                            medusa: dict[str, torch.Tensor] | None = None,
                            max_draft_len: int | None = None) -> dict[str, Any]:
    """Write `config.json` + `rank{N}.safetensors` (N < tp * pp) into out_dir; returns the config.

    medusa: Medusa heads (FasterDecoding or TensorRT-LLM names) -> a `MedusaForCausalLM`
    checkpoint; max_draft_len: its draft-token budget (default 63, TensorRT-LLM's)."""
    from safetensors.torch import save_file

    if dtype not in TRTLLM_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(TRTLLM_DTYPES)}")
    c = ckpt.config
    check_parallel(c, tp, pp, medusa=medusa is not None)
    medusa_info = heads = None
    num_layers = 0
    if medusa is not None:
        shared = ckpt.tensors.get("lm_head.weight", ckpt.tensors["model.embed_tokens.weight"])
        heads, num_heads, num_layers = normalize_medusa(medusa, c, shared)
        draft_len = MEDUSA_DEFAULT_MAX_DRAFT_LEN if max_draft_len is None else max_draft_len
        if not isinstance(draft_len, int) or draft_len < 1:
            raise ValueError(f"max_draft_len={draft_len!r} must be a positive integer")
        medusa_info = {"num_medusa_heads": num_heads, "num_medusa_layers": num_layers, "max_draft_len": draft_len}
    config = trtllm_config(c, dtype=dtype, tp=tp, pp=pp, medusa=medusa_info)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    torch_dtype = TRTLLM_DTYPES[dtype]
    for rank in range(tp * pp):
        tensors = rank_tensors(ckpt, rank, tp=tp, pp=pp, medusa=heads, num_medusa_layers=num_layers)
        # clone: safetensors refuses tensors sharing storage (tied lm_head, chunk views)
        tensors = {n: v.to(torch_dtype).contiguous().clone() for n, v in tensors.items()}
        save_file(tensors, os.path.join(out_dir, f"rank{rank}.safetensors"), metadata={"format": "pt"})
    return config


# ---- inverse reader -----------------------------------------------------------------------
def _load_trtllm(path: str) -> tuple[dict[str, Any], list[dict[str, torch.Tensor]]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json: not a TensorRT-LLM checkpoint directory")
    with open(cfg_path) as f:
        config = json.load(f)
    mapping = config.get("mapping", {})
    world = int(mapping.get("world_size", 1))
    if world != int(mapping.get("tp_size", 1)) * int(mapping.get("pp_size", 1)):
        raise CheckpointError(f"{cfg_path}: world_size {world} != tp_size * pp_size (cp/moe layouts are not read)")
    ranks = []
    for rank in range(world):
        fp = os.path.join(path, f"rank{rank}.safetensors")
        if not os.path.isfile(fp):
            raise CheckpointError(f"{path!r}: rank{rank}.safetensors is missing (world_size {world})")
        try:
            ranks.append(load_file(fp))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{fp} is not a readable safetensors file: {e}") from None
    return config, ranks


def _model_config(cfg: dict[str, Any], where: str) -> ModelConfig:
    arch = cfg.get("architecture")
    if arch == "MedusaForCausalLM":
        family = "qwen2" if "qwen" in str(cfg.get("model_type", "")).lower() else "llama"
    elif arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        family = "qwen2" if arch == "Qwen2ForCausalLM" else "llama"
    else:
        raise CheckpointError(f"{where}: architecture {arch!r} is not read "
                              "(supported: LlamaForCausalLM, Qwen2ForCausalLM, MedusaForCausalLM)")
    scaling = cfg.get("rotary_scaling")
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "type" or "rope_type" not in scaling}
    return ModelConfig(
        architecture=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("specbuild", {}).get("intermediate_size", cfg["intermediate_size"])),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        head_dim=int(cfg.get("head_size") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])),
        rms_norm_eps=float(cfg.get("norm_epsilon", 1e-5)),
        rope_theta=float(cfg.get("rotary_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attn_bias=bool(cfg.get("attn_bias", False)),
        dtype=str(cfg.get("dtype", "float32")),
    )


def _undup_kv(t: torch.Tensor, kv_heads: int, tp: int, where: str) -> torch.Tensor:
    """Inverse of _dup_kv: keep the first copy of each KV head, refusing copies that differ."""
    if kv_heads >= tp:
        return t
    reps = tp // kv_heads
    copies = t.reshape(kv_heads, reps, t.shape[0] // tp, *t.shape[1:])
    if not all(torch.equal(copies[:, 0], copies[:, r]) for r in range(1, reps)):
        raise CheckpointError(f"{where}: duplicated KV heads differ between tp ranks")
    return copies[:, 0].reshape(t.shape[0] // reps, *t.shape[1:])


def read_trtllm_checkpoint(path: str, tokenizer_json: str | None = None) -> Checkpoint:
    """A TensorRT-LLM checkpoint (all ranks, any tp/pp) -> `Checkpoint` in HF names, stored
    dtype. Undoes the vocabulary and MLP padding, KV duplication and tp/pp splits.
    tokenizer_json: defaults to `tokenizer.json` in `path` when present, else ""."""
    cfg, ranks = _load_trtllm(path)
    c = _model_config(cfg, path)
    tp, pp = int(cfg["mapping"]["tp_size"]), int(cfg["mapping"]["pp_size"])
    d = c.head_dim
    q_rows = c.num_heads * d // tp
    kv_rows = max(c.num_kv_heads, tp) * d // tp

    def gather(name: str, pp_rank: int, dim: int = 0) -> torch.Tensor:
        parts = []
        for tp_rank in range(tp):
            shard = ranks[pp_rank * tp + tp_rank].get(name)
            if shard is None:
                raise CheckpointError(f"{path}: rank{pp_rank * tp + tp_rank} lacks {name!r}")
            parts.append(shard)
        return torch.cat(parts, dim=dim)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": ranks[0]["transformer.vocab_embedding.weight"]}
    for pp_rank, layers in enumerate(pp_layer_ranges(c.num_layers, pp)):
        for local, layer in enumerate(layers):
            src, dst = f"transformer.layers.{local}.", f"model.layers.{layer}."
            for kind in ("weight", "bias") if c.attn_bias else ("weight",):
                shards = [ranks[pp_rank * tp + r][src + f"attention.qkv.{kind}"] for r in range(tp)]
                split = [s.split([q_rows, kv_rows, kv_rows]) for s in shards]
                out[dst + f"self_attn.q_proj.{kind}"] = torch.cat([s[0] for s in split])
                for i, proj in ((1, "k_proj"), (2, "v_proj")):
                    full = torch.cat([s[i] for s in split])
                    out[dst + f"self_attn.{proj}.{kind}"] = _undup_kv(full, c.num_kv_heads, tp, path)
            out[dst + "self_attn.o_proj.weight"] = gather(src + "attention.dense.weight", pp_rank, dim=1)
            first = ranks[pp_rank * tp]
            out[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"]
            out[dst + "post_attention_layernorm.weight"] = first[src + "post_layernorm.weight"]
            inter = c.intermediate_size
            out[dst + "mlp.gate_proj.weight"] = gather(src + "mlp.fc.weight", pp_rank)[:inter]
            out[dst + "mlp.up_proj.weight"] = gather(src + "mlp.gate.weight", pp_rank)[:inter]
            out[dst + "mlp.down_proj.weight"] = gather(src + "mlp.proj.weight", pp_rank, dim=1)[:, :inter]
    out["model.norm.weight"] = ranks[(pp - 1) * tp]["transformer.ln_f.weight"]
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = gather("lm_head.weight", pp - 1)[: c.vocab_size]
    if tokenizer_json is None:
        tok = os.path.join(path, "tokenizer.json")
        tokenizer_json = ""
        if os.path.isfile(tok):
            with open(tok) as f:
                tokenizer_json = f.read()
    out = {n: t.contiguous() for n, t in out.items()}
    return Checkpoint(c, out, tokenizer_json, {}, source=path, source_format="trtllm")


def read_trtllm_medusa(path: str) -> dict[str, torch.Tensor] | None:
    """The Medusa heads of a `MedusaForCausalLM` checkpoint in FasterDecoding form
    (`{h}.{l}.linear.weight|bias`, `{h}.{L}.weight`, vocabulary unpadded); None otherwise."""
    cfg, ranks = _load_trtllm(path)
    if cfg.get("architecture") != "MedusaForCausalLM":
        return None
    tp = int(cfg["mapping"]["tp_size"])
    vocab, layers = int(cfg["vocab_size"]), int(cfg["num_medusa_layers"])
    last = (int(cfg["mapping"]["pp_size"]) - 1) * tp  # heads are on every stage; read the last

    def gather(name: str) -> torch.Tensor:
        return torch.cat([ranks[last + r][name] for r in range(tp)]).contiguous()

    out: dict[str, torch.Tensor] = {}
    for h in range(int(cfg["num_medusa_heads"])):
        for l in range(layers):
            p = f"medusa_heads.{h}.medusa_layers.{l}.linear."
            out[f"{h}.{l}.linear.weight"] = gather(p + "weight")
            out[f"{h}.{l}.linear.bias"] = gather(p + "bias")
        out[f"{h}.{layers}.weight"] = gather(f"medusa_heads.{h}.lm_head.weight")[:vocab].contiguous()
    return out
