"""specbuild's prompt lookup as a TensorRT-LLM `Drafter`, for the LLM API's
`UserProvidedDecodingConfig(drafter=...)` (backends/tensorrt_llm_api.py, `ngram_impl="specbuild"`).

Why a module of its own, imported only where TensorRT-LLM (or its test stand-in) is: the drafter
travels to TensorRT-LLM's executor worker inside the LLM arguments, and that worker is another
process. With tensor_parallel_size 1 the LLM API runs its executor in a proxy-spawned worker
over mpi4py unless TLLM_WORKER_USE_SINGLE_PROCESS=1 (`tensorrt_llm/executor/executor.py`,
commit 005bc848: "For single-gpu case: Partition the workload to multiple process ...
ExecutorBindingsProxy(... mpi_session=None, # use mpi4py"), and with tp > 1 through its MPI
session, whose worker tasks NVIDIA keeps at module level "so it is picklable"
(`tensorrt_llm/llmapi/mpi_session.py`, commit 00a1352a, `_worker_identity_barrier`). A class
defined inside a function does not pickle by reference; this one is a module-level class whose
settings are plain attributes, so `pickle` and `cloudpickle` both carry it by name and the
worker rebuilds it by importing this module.

The base class is TensorRT-LLM's `tensorrt_llm._torch.speculative.drafter.Drafter`, resolved
when this module is imported (the stand-in named by SPECBUILD_TEST_TRTLLM_LLMAPI in tests). Its
constructor differs by release: `Drafter(max_concurrency=None)` in the 1.0 files read (commits
1ff19bbc, 83ab45a5; the latter's `pad_draft_tokens_for_cuda_graph` reads `self.max_draft_len`,
so the subclass sets it), `Drafter(max_draft_len, max_total_draft_tokens, ...)` later. Where the
base class declares `_needs_padding_kv_extension` (later drafter.py: "Drafters that use
TorchSampler (NGram, two-model) compute py_rewind_len from len(py_draft_tokens), which includes
padding. They must set this to True"), this drafter sets it True, as NVIDIA's own user-provided
prompt-lookup drafter does (`NVIDIA/TensorRT-LLM/tests/unittest/_torch/speculative/hw_agnostic/test_user_provided.py`,
commit a1a20970: `_needs_padding_kv_extension = True`): a user-provided drafter's requests are
sampled by TorchSampler.
"""

from __future__ import annotations

import inspect


def _drafter_base() -> type:
    from specbuild.backends.tensorrt_llm import LLMAPI_STUB_ENV, load_stand_in

    pkg = load_stand_in(LLMAPI_STUB_ENV, "package", "TensorRT-LLM's LLM API")
    if pkg is None:
        from tensorrt_llm._torch.speculative.drafter import Drafter  # noqa: PLC0415 (only where it is installed)

        return Drafter
    return pkg._torch.speculative.drafter.Drafter  # the stand-in: attributes, not importable submodules


_Base = _drafter_base()
_TAKES_LEN = "max_draft_len" in inspect.signature(_Base.__init__).parameters


class PromptLookupDrafter(_Base):
    """Proposes, for every generation request, what specbuild's prompt lookup
    (speculation/proposers/ngram.lookup) proposes on the torch backend: the tokens that followed
    the latest earlier occurrence of the longest suffix of ngram_max down to ngram_min tokens, at
    most max_draft_len of them. It keeps no state between steps."""

    if hasattr(_Base, "_needs_padding_kv_extension"):
        _needs_padding_kv_extension = True

    def __init__(self, max_draft_len: int, ngram_min: int = 1, ngram_max: int = 3) -> None:
        for name, value in (("max_draft_len", max_draft_len), ("ngram_min", ngram_min), ("ngram_max", ngram_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if ngram_min > ngram_max:
            raise ValueError(f"ngram_min={ngram_min} is above ngram_max={ngram_max}")
        if _TAKES_LEN:
            super().__init__(max_draft_len=max_draft_len, max_total_draft_tokens=max_draft_len)
        else:
            super().__init__()
        self.max_draft_len = max_draft_len
        self.max_total_draft_tokens = max_draft_len
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        import numpy as np

        from specbuild.speculation.proposers.ngram import lookup

        for req in scheduled_requests.generation_requests:
            ids = np.asarray(list(req.get_tokens(0)), dtype=np.int64)
            req.py_draft_tokens = list(lookup(ids, self.ngram_min, self.ngram_max, self.max_draft_len))
