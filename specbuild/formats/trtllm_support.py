"""What a TensorRT-LLM install can run: which versions carry which path, and the kernel, dtype
and parallel rules a speculative engine must meet. Pure: nothing here imports TensorRT-LLM.

Every rule was read in NVIDIA/TensorRT-LLM's sources (Apache-2.0; facts only, no code taken).
Versions are of the stored files the rule was read in (commit, and the release it belongs to
where the file says so); no run on a real TensorRT-LLM has checked them here.

- Two paths. The engine path (checkpoint -> `trtllm-build` -> `tensorrt_llm.bindings.executor`)
  is what `formats/trtllm_checkpoint.py`, `compiler/trtllm_build.py` and
  `backends/tensorrt_llm.py` drive; it was read at v0.19 and is gone
  from main after v1.2.x (`NVIDIA/TensorRT-LLM/docs/source/legacy/tensorrt-backend-removal.md`, commit 335107a7:
  no `trtllm-build`, no `TrtLlmArgs`, PyTorch the sole backend). The LLM API on the PyTorch
  backend (`backends/tensorrt_llm_api.py`) needs 1.0 or later: in the 1.x `llmapi/llm_args.py`
  files read (those with DraftTargetDecodingConfig/Eagle3DecodingConfig) `LlmArgs =
  TorchLlmArgs`, while the 0.x `llmapi/llm.py` read (commit 00966934) builds TensorRT engines
  (`_build_model`, `EngineConfig`); the 1.0 boundary itself is NVIDIA's release note (PyTorch
  the default backend from 1.0), not a tagged file read here.
- Head sizes: `MMHA_SUPPORTED_HEAD_SIZES` {32, 48, 64, 80, 96, 104, 112, 128, 144, 160, 192,
  224, 256}; anything else stops with "unsupported head_size" (the masked-MHA dispatch in
  `cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/`, which has one
  `instantiation/decoderMaskedMultiheadAttention{N}_{half,bf16,float}.cu` per size and none
  for 16).
- Which modes reach the speculative XQA kernels (engine path). Medusa and EAGLE engines feed
  a token tree: the engine gets `spec_decoding_position_offsets` / `spec_decoding_packed_mask`
  inputs, and the attention plugin's `is_spec_decoding_enabled` field is set from
  `spec_decoding_packed_mask is not None` (read in a stored gpt_attention plugin builder whose
  path the index did not name; `tensorrt_llm/functional.py` holds gpt_attention). Draft/target engines
  (`draft_tokens_external`) get neither: `tensorrt_llm/models/generation_mixin.py` (commit
  03ec464e) builds them only `if speculative_decoding_draft_tokens_external == False and
  max_draft_len > 0` ("Use positional offsets and packed mask only when not in SpS spec
  decoding"). The target verifies the drafts as a context chunk over its reused KV blocks, so
  the XQA group rule and XQA's dtype rule below are for Medusa/EAGLE (tree) engines only.
- Speculative (tree) generation feeds several query tokens per request (`multi_query_tokens`),
  which only XQA serves: `decoderXQARunner.cpp` (commit 02947a22) takes the JIT kernels only on
  Hopper with an FP8 KV cache and `64 % group == 0`, otherwise the precompiled ones, whose
  "MultiQueryToken kernels can support any num_q_heads_over_kv that is power of 2"
  (`decoderXQAImplPrecompiled.cpp`, commit 000a01de = v1.0.0rc4). Both sets are powers of two
  (<= 64 for JIT). The group is per rank: q heads / tp over max(kv heads, tp) / tp.
- Dtypes: Medusa FP16/BF16 and draft/target FP16/BF16/FP8 in the speculative-decoding support
  matrix (`examples/draft_target_model/README.md`: "FP16 / BF16 / FP8 (both draft and target
  model)"); XQA has fp16/bf16 kernels, and in fp32 the attention plugin falls back to unfused
  attention (`plugins/gptAttentionCommon`). FP8 needs a quantized checkpoint, which specbuild
  does not write, so the engine path takes float16 or bfloat16 for any speculative mode: for
  Medusa/EAGLE because of XQA, for draft/target because the support matrix lists no float32
  (its target also needs paged context FMHA for KV block reuse, a fused-attention feature).
- LLM-API path (PyTorch backend), `tensorrt_llm/_torch/speculative/interface.py` (commit
  00b6d5a2): `attention_need_spec_dec_mode` puts the target of every two-model mode (draft
  target, NGram, user-provided drafter, two-model EAGLE-3) into "multi-token query mode" on
  TRTLLM attention (`use_case_2 = not use_one_engine() and not is_draft_model ... and
  is_trtllm_attention`), and one-model EAGLE-3 always (`use_case_1 = self.use_one_engine()`;
  other stored versions gate it on `get_sm_version() < 120` as well, so on SM >= 120 the EAGLE-3
  refusal below may be one a release would not make); `extend_ctx` (generation
  requests with drafts treated as chunked context instead) is False on TRTLLM attention where
  `xqa_supported = get_sm_version() < 120`. So on SM < 120 with the LLM API's default TRTLLM
  attention a speculating target goes through the same multi-query XQA kernels (group and
  dtype rules above); on SM >= 120 two-model targets go through chunked context instead, and a
  non-TRTLLM attention backend (`attn_backend="FLASHINFER"`, which NVIDIA's own
  `NVIDIA/TensorRT-LLM/tests/unittest/_torch/speculative/test_user_provided.py` runs) never takes that path. One
  older stored `interface.py` (the 1.0 line) returns spec-dec mode only for one-model EAGLE-3
  (`attention_need_spec_dec_mode(self)` without arguments) and treats drafts as chunked context
  except on SM 100 (`get_sm_version() != 100`). The rule therefore differs by release, so it is
  asked of the installed release (`backends/tensorrt_llm_api.release_multi_query` calls its
  `SpeculativeDecodingMode.attention_need_spec_dec_mode` and `extend_ctx` for the mode of the very
  speculative_config the LLM gets); `table_multi_query` (below) holds the documented answer per
  release line, used only where those functions cannot be asked.
- Lengths: `tensorrt_llm/builder.py` adds max_draft_len to max_seq_len for every speculative
  mode ("Increasing max_seq_len ... by max_draft_len"), so a built engine records more than the
  `--max_seq_len` flag.
- Medusa is tensor parallel only in the support matrix (no pp).
- Draft/target: both executors run in leader mode on one MPI world; NVIDIA's multi-GPU
  draft/target setups give each its own device list (orchestrator mode, participant ids), which
  specbuild does not drive, so the draft/target engine path is one GPU (tp = pp = 1) for both.
  The draft's generation logits are [k, pad_vocab(V, draft_tp)] and the target compares them
  with its own padded vocabulary, so the two tp sizes must be equal anyway.
- Mapping: `tensorrt_llm/mapping.py` splits pipeline stages as `num_layers // pp` in several
  releases (the uneven `tensor_split` came later) and older releases have no `cp_size`; the
  writer therefore requires pp to divide the layers and writes only keys every release reads.
"""

from __future__ import annotations

from typing import Any

ENGINE_PATH_MIN = (0, 19)
ENGINE_PATH_END = (1, 3)  # first release line without trtllm-build / the executor bindings
LLMAPI_PATH_MIN = (1, 0)
ENGINE_PATH_PIN = "tensorrt_llm>=0.19,<1.3"
LLMAPI_PATH_PIN = "tensorrt_llm>=1.0"

SPECULATIVE_DTYPES = ("float16", "bfloat16")
MMHA_HEAD_SIZES = (32, 48, 64, 80, 96, 104, 112, 128, 144, 160, 192, 224, 256)
SPECULATIVE_MODES = ("medusa", "draft_tokens_external", "eagle")
TREE_MODES = ("medusa", "eagle")  # packed mask -> the spec-decoding (multi-query) XQA path; not draft/target
# Speculative XQA kernels by head size. The JIT kernels take head_size % 16 == 0 within [16, 256] only
# (cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/decoderXQAImplJIT/kernelUtils.cpp, supportConfigQGMMA
# and supportConfigHMMA, stored 1.x file); the precompiled ones are cubins per head size, whose list was not read
# here: those head sizes get a note (xqa_head_size_note) that the first GPU run settles it.
XQA_HEAD_SIZE_STEP, XQA_HEAD_SIZE_MAX = 16, 256
XQA_FREE_SM = 120  # interface.py: xqa_supported = get_sm_version() < 120 (two-model targets use chunked context above)
REMOVAL_DOC = "docs/source/legacy/tensorrt-backend-removal.md"


def release(version: str) -> tuple[int, ...] | None:
    """'1.2.0rc3' -> (1, 2, 0); None when the string is not a version (packaging's parser)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(version)).release
    except InvalidVersion:
        return None


def _cmp(rel: tuple[int, ...], bound: tuple[int, ...]) -> int:
    a, b = rel[:len(bound)] + (0,) * max(0, len(bound) - len(rel)), bound
    return (a > b) - (a < b)


def engine_path_problem(version: str) -> str | None:
    """Why TensorRT-LLM `version` cannot run the engine path (trtllm-build + executor), or None."""
    rel = release(version)
    if rel is None:
        return (f"TensorRT-LLM reports version {version!r}, which is not a version; the engine path is checked "
                f"for {ENGINE_PATH_PIN}: reinstall TensorRT-LLM from NVIDIA's index")
    if _cmp(rel, ENGINE_PATH_MIN) < 0:
        return (f"TensorRT-LLM {version} is installed; the engine path was checked against {ENGINE_PATH_PIN} "
                f"(executor keywords and build flags of older releases differ): pip install '{ENGINE_PATH_PIN}' "
                "from NVIDIA's index")
    if _cmp(rel, ENGINE_PATH_END) >= 0:
        return (f"TensorRT-LLM {version} is installed, which has no trtllm-build or executor bindings (removed "
                f"after 1.2.x, see {REMOVAL_DOC}): serve the bundle through the LLM API path (--backend tensorrt-llm "
                f"picks it on {LLMAPI_PATH_PIN}), or pip install '{ENGINE_PATH_PIN}' for the engine path")
    return None


def llmapi_path_problem(version: str) -> str | None:
    """Why TensorRT-LLM `version` cannot run the LLM-API (PyTorch backend) path, or None."""
    rel = release(version)
    if rel is None or _cmp(rel, LLMAPI_PATH_MIN) < 0:
        return (f"TensorRT-LLM {version} is installed; the LLM-API path needs {LLMAPI_PATH_PIN} (before 1.0 "
                "tensorrt_llm.LLM is the TensorRT-engine LLM): pip install 'tensorrt_llm>=1.0' from NVIDIA's index, "
                f"or use the engine path ({ENGINE_PATH_PIN})")
    return None


def installed_version() -> tuple[str | None, str]:
    """(version, "") of the importable tensorrt_llm, or (None, why it is not importable)."""
    try:
        import tensorrt_llm
    except Exception as e:  # ImportError, or a broken CUDA/TensorRT install underneath
        return None, f"import tensorrt_llm failed: {type(e).__name__}: {e}"
    return str(getattr(tensorrt_llm, "__version__", "unknown")), ""


# ---- kernels, dtypes, parallel layout --------------------------------------------------------
def xqa_group(num_heads: int, num_kv_heads: int, tp: int = 1) -> int:
    """Query heads per KV head on one rank (KV heads are duplicated up to tp when fewer)."""
    return (num_heads // tp) // (max(num_kv_heads, tp) // tp)


def kernel_problems(config: Any, *, role: str, mode: str, dtype: str, tp: int = 1) -> list[str]:
    """What the attention kernels refuse for this model as `role` in engine-path speculative
    `mode` (none | draft_tokens_external | medusa | eagle); each entry names the flag to change.
    `config` is a ModelConfig (head_dim, num_heads, num_kv_heads). The XQA rules (dtype, group)
    are for the tree modes only; draft/target gets the support matrix's dtype rule."""
    out: list[str] = []
    if config.head_dim not in MMHA_HEAD_SIZES:
        out.append(f"the {role}'s head size {config.head_dim} has no TensorRT-LLM attention kernel (masked MHA "
                   f"takes {', '.join(map(str, MMHA_HEAD_SIZES))}): use another model")
    if mode in TREE_MODES:
        out += _xqa_problems(config, role=role, what=f"{mode} speculation on TensorRT-LLM", dtype=dtype, tp=tp,
                             fix="--tp")
    elif mode == "draft_tokens_external" and dtype not in SPECULATIVE_DTYPES:
        out.append(f"--trtllm-dtype {dtype}: draft/target speculation on TensorRT-LLM is supported in FP16/BF16/FP8 "
                   "only (examples/draft_target_model/README.md support matrix; the target needs paged context FMHA "
                   "for KV block reuse): use --trtllm-dtype bfloat16 or float16")
    return out


def _xqa_problems(config: Any, *, role: str, what: str, dtype: str, tp: int, fix: str) -> list[str]:
    out: list[str] = []
    if dtype not in SPECULATIVE_DTYPES:
        out.append(f"--trtllm-dtype {dtype}: {what} runs its generation through XQA kernels, which have "
                   "float16/bfloat16 only (Medusa and draft/target support FP16/BF16; float32 falls back to unfused "
                   "attention): use --trtllm-dtype bfloat16 or float16")
    d = config.head_dim
    if d % XQA_HEAD_SIZE_STEP or not XQA_HEAD_SIZE_STEP <= d <= XQA_HEAD_SIZE_MAX:
        out.append(f"the {role}'s head size {d}: {what} needs TensorRT-LLM's speculative XQA kernels, which take "
                   f"head sizes that are multiples of {XQA_HEAD_SIZE_STEP} up to {XQA_HEAD_SIZE_MAX} only "
                   "(decoderXQAImplJIT/kernelUtils.cpp): use a model with such a head size, or draft/target "
                   "speculation (--draft), which does not use them")
    group = xqa_group(config.num_heads, config.num_kv_heads, tp)
    if group & (group - 1) or group > 64:
        out.append(f"the {role} has {config.num_heads} query heads over {config.num_kv_heads} KV heads: "
                   f"{group} query heads per KV head at tp={tp}, and {what} needs TensorRT-LLM's speculative "
                   "(multi-query) XQA kernels, which take power-of-two groups only (decoderXQAImplPrecompiled; the "
                   f"Hopper JIT needs 64 % group == 0): use a model with a power-of-two group, or a {fix} that makes "
                   f"it one ({', '.join(map(str, _group_fixing_tps(config))) or 'none exists'})")
    return out


INTERFACE_FILE = "tensorrt_llm/_torch/speculative/interface.py"
# The documented table, used only where the installed release's own decision functions cannot be asked
# (release_multi_query in backends/tensorrt_llm_api.py asks them). Read in INTERFACE_FILE by release:
# - before 1.1 (an older stored file, the 1.0 line): `attention_need_spec_dec_mode(self)` is
#   `is_eagle3_one_model()` alone; two-model targets (draft, ngram, user-provided) take their drafts as
#   chunked context (`extend_ctx`), never the multi-token query kernels;
# - 1.1 and 1.2 (commit 00b6d5a2's rule): two-model targets on TRTLLM attention run in multi-token query
#   mode (`use_case_2`) unless `extend_ctx` (xqa_supported = get_sm_version() < 120) sends them to chunked
#   context; one-model EAGLE-3 always (`use_case_1 = self.use_one_engine()`);
# - 1.3 on: as 1.1/1.2, but DraftTargetDecodingConfig's mode is DRAFT_TARGET_ONE_MODEL, an external drafter
#   and so `use_one_engine()`: draft/target joins EAGLE-3 in multi-token query mode on every SM.
MULTI_QUERY_TWO_MODEL_FROM = (1, 1)
DRAFT_ONE_MODEL_FROM = (1, 3)


def table_multi_query(version: str, method: str, sm: int | None) -> bool:
    """Whether the target of `method` runs in multi-token query mode on TRTLLM attention under
    TensorRT-LLM `version` on SM `sm` (None: unknown, taken as < 120), by the table above."""
    if method == "none":
        return False
    rel = release(version) or ENGINE_PATH_END  # unknown: the newest rule
    one_model = method == "eagle3" or (method == "draft" and _cmp(rel, DRAFT_ONE_MODEL_FROM) >= 0)
    if one_model:
        return True
    if _cmp(rel, MULTI_QUERY_TWO_MODEL_FROM) < 0:
        return False
    return sm is None or sm < XQA_FREE_SM


def xqa_head_size_note(config: Any, mode: str) -> str | None:
    """A note for a tree-mode (Medusa) engine: its speculative XQA kernels are precompiled per head size."""
    if mode not in TREE_MODES:
        return None
    return (f"{mode} engines run generation on TensorRT-LLM's precompiled speculative XQA kernels, compiled per head "
            f"size; head size {config.head_dim} passes the JIT kernels' rule (decoderXQAImplJIT/kernelUtils.cpp), "
            "but which sizes a release's precompiled set carries was not read: scripts/gpu_trtllm_e2e.sh's Medusa "
            "stage checks it on the GPU")


def llmapi_kernel_problems(config: Any, *, method: str, version: str, dtype: str, tp: int = 1,
                           sm: int | None = None, attn_backend: str | None = None,
                           multi_query: bool | None = None) -> list[str]:
    """What the LLM API (PyTorch backend) of TensorRT-LLM `version` would refuse at its first
    speculative step for this target: a target in multi-token query mode on TRTLLM attention (the
    default, attn_backend None) runs on the speculative XQA kernels. `multi_query`: the installed
    release's own answer (backends/tensorrt_llm_api.release_multi_query); None where it could not
    be asked, and then `table_multi_query` decides by version and SM (sm: major*10+minor, None =
    unknown, taken as < 120). `config` has head_dim, num_heads, num_kv_heads."""
    out: list[str] = []
    if config.head_dim not in MMHA_HEAD_SIZES:
        out.append(f"the target's head size {config.head_dim} has no TensorRT-LLM attention kernel (masked MHA "
                   f"takes {', '.join(map(str, MMHA_HEAD_SIZES))}): use another model")
    if method == "none" or (attn_backend or "TRTLLM").upper() != "TRTLLM":
        return out
    asked = multi_query is not None
    if not (multi_query if asked else table_multi_query(version, method, sm)):
        return out  # the drafts go through chunked context (extend_ctx), not the multi-query XQA kernels
    where = "" if sm is None else f" on SM {sm}"
    how = (f"as TensorRT-LLM {version}'s own {INTERFACE_FILE} answers" if asked else
           f"by specbuild's table of {INTERFACE_FILE} for release {version}, whose functions could not be asked")
    problems = _xqa_problems(config, role="target", what=f"{method} speculation on TensorRT-LLM {version}'s LLM API "
                             f"(multi-token query mode on TRTLLM attention{where}, {how})",
                             dtype=dtype, tp=tp, fix="tensor_parallel_size (--tp)")
    return [p + "; or attn_backend='FLASHINFER' (--trtllm-attn-backend FLASHINFER), which does not take that path"
            for p in problems]


def _group_fixing_tps(config: Any) -> list[int]:
    out = []
    for tp in range(1, config.num_heads + 1):
        if config.num_heads % tp or (config.num_kv_heads % tp and tp % config.num_kv_heads):
            continue
        g = xqa_group(config.num_heads, config.num_kv_heads, tp)
        if not g & (g - 1) and g <= 64:
            out.append(tp)
    return out


def draft_target_layout_problems(*, tp: int, pp: int, draft_tp: int, draft_pp: int) -> list[str]:
    """Parallel layouts the draft/target engine path refuses: more than one GPU, or different tp
    for draft and target (Medusa's pp and every pipeline split are check_parallel's)."""
    out: list[str] = []
    if draft_tp != tp:
        out.append(f"draft tp {draft_tp} != target tp {tp}: the draft's generation logits are padded to its own "
                   "tp's vocabulary and the target compares them with its own padded vocabulary; use the same tp")
    if tp * pp != 1 or draft_tp * draft_pp != 1:
        out.append(f"draft/target with target tp*pp = {tp * pp} and draft tp*pp = {draft_tp * draft_pp}: both "
                   "executors would run in leader mode on one MPI world, which can hang (NVIDIA's multi-GPU "
                   "draft/target setups give each engine its own devices in orchestrator mode, which specbuild does "
                   f"not drive): use --tp 1 --pp 1, or Medusa for several GPUs, or the LLM-API path ({LLMAPI_PATH_PIN})")
    return out
