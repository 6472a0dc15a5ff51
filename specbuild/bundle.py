"""The bundle directory: the one contract between `build` (compile) and `runtime`.

Layout (DESIGN.md):

    bundle/
      bundle.json      schema, versions, roles, tokenizer fingerprint, limits, defaults
      tokenizer.json   one tokenizer for every role (HF `tokenizers` format)
      target/          model.json + weights.safetensors (runtime layout, see below)
      draft/           same, when a draft model is compiled in

Runtime weight layout of a role (names in weights.safetensors), all linear weights
stored (out_features, in_features):

    embed                     [vocab, hidden]
    layers.{i}.attn_norm      [hidden]
    layers.{i}.qkv            [(heads + 2 * kv_heads) * head_dim, hidden]   q, k, v fused
    layers.{i}.qkv_bias       [(heads + 2 * kv_heads) * head_dim]           Qwen2 only
    layers.{i}.o              [hidden, heads * head_dim]
    layers.{i}.mlp_norm       [hidden]
    layers.{i}.gate_up        [2 * intermediate, hidden]                    gate then up
    layers.{i}.down           [hidden, intermediate]
    norm                      [hidden]
    lm_head                   [vocab, hidden]    absent when tie_word_embeddings

Both build and runtime import this module; it imports neither.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from specbuild.errors import BundleError

SCHEMA_VERSION = 1
ROLES = ("target", "draft")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder role. Units: counts; rope_theta in radians' base."""

    architecture: str  # "llama" (Llama 2/3, SmolLM2, Mistral) or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict (llama3 supported) or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attn_bias: bool = False  # bias on q/k/v (Qwen2)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise BundleError(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise BundleError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise BundleError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BundleError(f"model.json has unknown keys {sorted(unknown)}")
        return cls(**data)

    def weight_names(self) -> list[str]:
        """Every tensor name the runtime layout holds for this config."""
        names = ["embed", "norm"]
        if not self.tie_word_embeddings:
            names.append("lm_head")
        for i in range(self.num_layers):
            p = f"layers.{i}."
            names += [p + n for n in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")]
            if self.attn_bias:
                names.append(p + "qkv_bias")
        return names

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab_size, h), "norm": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm"] = (h,)
            shapes[p + "qkv"] = (qkv, h)
            shapes[p + "o"] = (h, self.num_heads * d)
            shapes[p + "mlp_norm"] = (h,)
            shapes[p + "gate_up"] = (2 * self.intermediate_size, h)
            shapes[p + "down"] = (h, self.intermediate_size)
            if self.attn_bias:
                shapes[p + "qkv_bias"] = (qkv,)
        return shapes


@dataclass(frozen=True)
class Limits:
    """Hard limits the runtime enforces; requests beyond them are refused with the limit."""

    max_seq_len: int = 2048
    max_batch_size: int = 8
    max_draft_len: int = 8

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_seq_len", 16, 1 << 20), ("max_batch_size", 1, 4096), ("max_draft_len", 0, 64)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise BundleError(f"{name}={v!r} is out of range [{lo}, {hi}]")


@dataclass(frozen=True)
class BundleMeta:
    """The contents of bundle.json."""

    roles: dict[str, dict[str, Any]]  # role -> {"path": str, "source": str, ...}
    tokenizer_fingerprint: str
    limits: Limits = field(default_factory=Limits)
    backend: str = "torch"
    default_sampling: dict[str, Any] = field(default_factory=dict)
    default_speculation: dict[str, Any] = field(default_factory=dict)
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos/eos ids, chat template
    schema_version: int = SCHEMA_VERSION
    specbuild_version: str = ""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BundleMeta":
        version = data.get("schema_version")
        if not isinstance(version, int):
            raise BundleError(f"bundle.json has no integer schema_version (got {version!r})")
        if version > SCHEMA_VERSION:
            raise BundleError(
                f"bundle schema_version {version} is newer than this specbuild supports "
                f"({SCHEMA_VERSION}); upgrade specbuild or recompile the bundle"
            )
        data = dict(data)
        data["limits"] = Limits(**data.get("limits", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def tokenizer_fingerprint(tokenizer_json: str) -> str:
    """SHA-256 over the vocabulary *and* token order (id -> string) plus added tokens.

    Two tokenizers with the same fingerprint map the same strings to the same ids, which
    is what speculation needs (draft and target must agree on ids), not just equal size.
    """
    data = json.loads(tokenizer_json)
    model = data.get("model", {})
    vocab = model.get("vocab", {})
    items = sorted(vocab.items(), key=lambda kv: kv[1]) if isinstance(vocab, dict) else list(vocab)
    added = sorted((t["id"], t["content"]) for t in data.get("added_tokens", []))
    h = hashlib.sha256()
    h.update(json.dumps([model.get("type"), items, added]).encode())
    # merges and pre-tokenisation decide how strings split into ids: part of the identity
    h.update(json.dumps(model.get("merges", [])).encode())
    h.update(json.dumps(data.get("pre_tokenizer")).encode())
    h.update(json.dumps(data.get("normalizer")).encode())
    return "sha256:" + h.hexdigest()


def read_meta(bundle_dir: str) -> BundleMeta:
    path = os.path.join(bundle_dir, "bundle.json")
    if not os.path.isdir(bundle_dir):
        raise BundleError(f"bundle directory {bundle_dir!r} does not exist")
    if not os.path.isfile(path):
        raise BundleError(f"{bundle_dir!r} is not a bundle: no bundle.json (run `specbuild compile` first)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from None
    return BundleMeta.from_json(data)


def write_meta(bundle_dir: str, meta: BundleMeta) -> None:
    os.makedirs(bundle_dir, exist_ok=True)
    with open(os.path.join(bundle_dir, "bundle.json"), "w", encoding="utf-8") as f:
        json.dump(meta.to_json(), f, indent=2)
        f.write("\n")


def read_model_config(role_dir: str) -> ModelConfig:
    path = os.path.join(role_dir, "model.json")
    if not os.path.isfile(path):
        raise BundleError(f"{role_dir!r} has no model.json")
    with open(path, encoding="utf-8") as f:
        return ModelConfig.from_json(json.load(f))


def write_model_config(role_dir: str, config: ModelConfig) -> None:
    os.makedirs(role_dir, exist_ok=True)
    with open(os.path.join(role_dir, "model.json"), "w", encoding="utf-8") as f:
        json.dump(config.to_json(), f, indent=2)
        f.write("\n")


def check_fingerprint(bundle_dir: str, meta: BundleMeta) -> str:
    """Re-hash tokenizer.json and compare with bundle.json; return the tokenizer JSON."""
    path = os.path.join(bundle_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise BundleError(f"bundle {bundle_dir!r} has no tokenizer.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    got = tokenizer_fingerprint(text)
    if got != meta.tokenizer_fingerprint:
        raise BundleError(
            f"tokenizer.json fingerprint {got[:19]}... does not match bundle.json's "
            f"{meta.tokenizer_fingerprint[:19]}...: the bundle was modified; recompile it"
        )
    for role, info in meta.roles.items():
        fp = info.get("tokenizer_fingerprint", meta.tokenizer_fingerprint)
        if fp != meta.tokenizer_fingerprint:
            raise BundleError(
                f"role {role!r} was compiled with tokenizer {fp[:19]}..., the bundle's is "
                f"{meta.tokenizer_fingerprint[:19]}...: every role must tokenize identically"
            )
    return text
