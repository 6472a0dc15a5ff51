"""specbuild's own CPU kernels for int4 and int8 weight-only linears, built at first use.

Why a kernel of the project's own: torch's `_weight_int4pack_mm_for_cpu` streams the
weights at 10-13 GB/s on 2-core AVX-512 servers (an Intel Xeon and an AMD EPYC measured;
memory copies run at 40-60 GB/s), and its cost grows almost linearly with the rows of a
verify pass. llama.cpp's ggml kernels (the other candidate, through llama-cpp-python) quantise
the activations to int8 blocks, which changes the arithmetic that defines the target model, and
come as a whole runtime rather than a linear a torch graph can call; no maintained library on
the registries offers a torch-callable int4 x bfloat16 linear for x86 CPUs with a fixed,
row-count independent summation order. cpu_kernels.cpp holds the kernels; docs/cpu-kernels.md
the design and the measurements.

    available()              the kernel library, or None (with why in status())
    status()                 a dict: available, isa, reason, the build path
    repack_int4(...)         nibbles/scales/zeros -> the layout int4_mm streams
    repack_int8(...)         int8 rows + scales -> the layout int8_mm streams
    int4_mm / int8_mm        the ops (torch.ops.specbuild_cpu.*; opaque to torch.compile)
    repack_int4_q8(...)      int4 values/scales/zeros -> the layout int4_q8_mm streams
    int4_q8_mm / q8_quantize int4 weights x inputs quantised per row to int8 blocks of 32
                             (the int4-a8 format); q8_paths() / q8_path() its ISA paths
    repack_int8_q8 / int8_q8_mm  int8 weights x the same int8 input blocks (the lm_head under
                             --lm-head-activations int8 | auto; AVX512-VNNI or AVX2, the same bits)

int4 with int8 inputs (int4_q8_mm) is the project's own for the same reason: torch 2.13's CPU
build has no x86 int4 x int8 kernel (`_dyn_quant_matmul_4bit` is ARM KleidiAI only), and
llama.cpp's ggml, whose Q4_1 x Q8_1 dot products it follows in spirit, comes as a whole
runtime rather than a torch op. (int8_q8_mm likewise: torch's `_int_mm` multiplies int8 by int8
but takes no scale per block of 32 inputs, so the block sums could not be scaled before they
are added.) It has a layout of its own (repack_int4_q8): vpdpbusd
multiplies the four bytes of a 32-bit lane by four broadcast input bytes, so four
consecutive inputs of a column must sit in one lane, and the fp32 scales are stored with
m = zero - 8 * scale (the GGUF's own Q4_1 minimum, exactly, for carried Q4_1 weights).

Build: the C++ source is compiled once per (torch version, source, compiler) into
kernel_dir()/<key>/ with the compiler `--compile` already needs ($CXX, else c++/g++),
against torch's headers and its own OpenMP runtime, and loaded with torch.ops.load_library.
(torch.utils.cpp_extension.load would need the ninja build tool; the one command it would run
is run here directly.) Without a compiler, or when the build fails, the int4/int8 formats run
torch's kernels and status()["reason"] says why.

$SPECBUILD_CPU_KERNEL: `auto` (default: ours where a quick measurement at load finds it faster),
`torch` (never ours), `specbuild` (ours wherever the CPU has AVX2; an error when it cannot be
built), `avx2` (ours, the AVX2 code path even on an AVX-512 CPU: for tests and comparisons).
int4-a8 weights always run int4_q8_mm (torch has no kernel for them; `avx2` picks its AVX2 path).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch

from specbuild.errors import BundleError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
COLS = 16  # output columns per block (cpu_kernels.cpp)
ISA_NAMES = {1: "AVX2", 2: "AVX-512 BF16", 3: "AVX-512 BF16 (far prefetch)", 4: "AVX-512 FMA"}
INT8_NAMES = {1: "AVX2", 2: "AVX-512", 3: "AVX-512 (one-row tiles too)"}  # int8's levels (int4's 4 runs as 2)


def level_name(kind: str, level: int) -> str:
    """The name of `kind`'s ("int4", "int8") ISA level, as the load line prints it."""
    return (INT8_NAMES if kind == "int8" else ISA_NAMES).get(level, ISA_NAMES.get(level, str(level)))
# int4_q8_mm's `path`; 5 is 2's instructions and 6 is 1's with the weight prefetch further ahead, 7 is 2's
# with no software prefetch in tiles of up to 4 rows, 8 none in tiles of 1-2 rows and 5's in wider ones
# (the same bits)
Q8_PATHS = {1: "AVX2", 2: "AVX512-VNNI", 3: "AVX-VNNI", 4: "AVX512-VL VNNI ymm", 5: "AVX512-VNNI far prefetch",
            6: "AVX2 far prefetch", 7: "AVX512-VNNI no prefetch in few-row tiles",
            8: "AVX512-VNNI far prefetch in wide tiles"}
Q8_BLOCK = 32  # inputs per int8 block (one float32 scale each)
_lock = threading.Lock()
_state: dict = {}
_choices: dict = {}  # (kind, act dtype) -> ISA level (0: torch's kernel)
_ours: dict = {}  # (kind, act dtype) -> the best of specbuild's levels, even where torch's kernel won


class KernelBuildError(BundleError):
    """specbuild's CPU kernels could not be built or loaded (and SPECBUILD_CPU_KERNEL asked for them)."""


def mode() -> str:
    value = os.environ.get("SPECBUILD_CPU_KERNEL", "auto").strip().lower() or "auto"
    if value not in ("auto", "torch", "specbuild", "avx2"):
        raise BundleError(f"SPECBUILD_CPU_KERNEL={value!r} is not one of auto, torch, specbuild, avx2")
    return value


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_key(cxx: str) -> str:
    with open(SOURCE, "rb") as f:
        src = f.read()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = cxx
    h = hashlib.sha256(src + version.encode() + torch.__version__.encode() + repr(sys.version_info[:2]).encode())
    return f"torch{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


def kernel_dir() -> str:
    """Where built kernels are kept: $SPECBUILD_KERNEL_DIR, else $XDG_CACHE_HOME/specbuild/kernels,
    else ~/.cache/specbuild/kernels (apart from the cost cache: a build is keyed by its inputs
    and never goes stale, so tests that give the cost cache a fresh directory share it)."""
    return os.environ.get("SPECBUILD_KERNEL_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specbuild", "kernels")


def build(cxx: str | None = None) -> str:
    """Compile cpu_kernels.cpp (once per key) and return the shared library's path; raises
    KernelBuildError with the compiler's message when there is no compiler or it fails."""
    from torch.utils import cpp_extension

    cxx = cxx or _compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found ($CXX, c++, g++ or clang++): specbuild's CPU kernels need one "
                               "(the same one `--compile` uses); install g++ or set CXX")
    out_dir = os.path.join(kernel_dir(), build_key(cxx))
    lib = os.path.join(out_dir, "specbuild_cpu.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    tmp = f"{lib}.{os.getpid()}.tmp"
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-DNDEBUG",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{p}" for p in cpp_extension.include_paths()], SOURCE, "-o", tmp,
           f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{torch_lib}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building specbuild's CPU kernels with {cxx} failed: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise KernelBuildError(f"building specbuild's CPU kernels with {cxx} failed (exit {proc.returncode}):\n{tail}")
    os.replace(tmp, lib)
    return lib


def _register_fakes() -> None:
    @torch.library.register_fake("specbuild_cpu::int4_mm")
    def _(x, packed, n, group_size, f32_scales, isa):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specbuild_cpu::int8_mm")
    def _(x, packed, n, isa):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specbuild_cpu::int4_q8_mm")
    def _(x, packed, n, group_size, f16_scales, path):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("specbuild_cpu::int8_q8_mm")
    def _(x, packed, n, path=0):
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    @torch.library.register_fake("specbuild_cpu::q8_quantize")
    def _(x):
        t, k = x.shape
        return (x.new_empty(t, k, dtype=torch.int8), x.new_empty(t, k // Q8_BLOCK, dtype=torch.float32),
                x.new_empty(t, k // Q8_BLOCK, dtype=torch.float32))

    @torch.library.register_fake("specbuild_cpu::rows_attention")
    def _(q, k_cache, v_cache, index, scale):
        return q.new_empty(q.shape)


def _load() -> dict:
    """Build and load once per process; the state dict (available, isa, reason, path)."""
    with _lock:
        if _state:
            return _state
        state = {"available": False, "isa": 0, "reason": "", "path": None}
        try:
            import platform

            if platform.machine().lower() not in ("x86_64", "amd64"):
                raise KernelBuildError(f"specbuild's CPU kernels are x86-64 only (this is {platform.machine()})")
            path = build()
            torch.ops.load_library(path)
            _register_fakes()
            isa = int(torch.ops.specbuild_cpu.isa_level())
            if isa == 0:
                raise KernelBuildError("this CPU has neither AVX2+FMA nor AVX-512: specbuild's CPU kernels need one")
            state.update(available=True, isa=isa, path=path, reason=f"built at {path}")
            torch.ops.specbuild_cpu.pool_config(pool_mode(), pool_spin_us())
        except KernelBuildError as e:
            state["reason"] = str(e)
        except (OSError, RuntimeError) as e:  # load_library / op registration
            state["reason"] = f"loading specbuild's CPU kernels failed: {e}"
        _state.update(state)
        return _state


def status() -> dict:
    return dict(_load())


def isa() -> int:
    """The ISA level the kernels run at in this process: 2 AVX-512 BF16, 1 AVX2 (forced by
    SPECBUILD_CPU_KERNEL=avx2 or all the CPU has), 0 unavailable."""
    st = _load()
    if not st["available"]:
        return 0
    return 1 if mode() == "avx2" else st["isa"]


FMA_OVER_BF16 = 1.25  # see choose(); 1.9-2.6 on the Xeon of 2026-12-03, ~1.0 on the one of 2026-12-02 (docs/cpu-kernels.md)


def dot_rates(reps: int = 20) -> tuple[float, float]:
    """(vdpbf16ps, vfmadd231ps) multiply-adds per ns on one core, best of `reps` ~0.1 ms loops each
    (interleaved, after a warm-up; ~6 ms in all);
    0 for an instruction the CPU lacks."""
    _load()
    dp, fm = torch.ops.specbuild_cpu.dot_rates(reps)
    return float(dp), float(fm)


def has_isa4() -> bool:
    """Whether level 4 (int4 with bfloat16 inputs through fp32 multiply-adds: AVX-512F/BW/VL and
    FMA, no BF16 needed) can run here; never under SPECBUILD_CPU_KERNEL=avx2."""
    st = _load()
    return bool(st["available"] and mode() != "avx2" and torch.ops.specbuild_cpu.has_isa4())


def q8_paths() -> list[int]:
    """The int4_q8_mm paths this CPU runs (Q8_PATHS' keys), [] when the kernels are unavailable."""
    if not _load()["available"]:
        return []
    mask = int(torch.ops.specbuild_cpu.q8_paths())
    return [p for p in Q8_PATHS if mask >> p & 1]


def q8_path() -> int:
    """The path int4-a8 weights run in this process: AVX512-VNNI (its prefetch near, 2, far, 5,
    none in tiles of up to 4 rows, 7, or none up to 2 rows and far in wider tiles, 8: whichever
    takes the least time for one row plus four rows in a quick interleaved measurement on sample
    weights (medians of 9 rounds), once per process, said in one line on stderr), else AVX-VNNI,
    else AVX2 (near, 1, or far, 6, chosen the same way; SPECBUILD_CPU_KERNEL=avx2 forces 1;
    SPECBUILD_Q8_PATH=N forces path N); 0 when none can run. Every path gives the same bits, so
    this is a speed choice only."""
    paths = q8_paths()
    if not paths:
        return 0
    if mode() == "avx2":
        return 1
    forced = os.environ.get("SPECBUILD_Q8_PATH", "").strip()
    if forced:  # a benchmark's A/B (the same bits on every path)
        if not forced.isdigit() or int(forced) not in paths:
            raise KernelBuildError(f"SPECBUILD_Q8_PATH={forced!r} is not a path this CPU runs: "
                                   + ", ".join(f"{p} ({Q8_PATHS[p]})" for p in paths))
        return int(forced)
    base = next(p for p in (2, 3, 1) if p in paths)
    far = {2: 5, 1: 6}.get(base)
    if far not in paths:
        return base
    with _lock:
        if "q8" in _choices:
            return _choices["q8"]
    cands = (base, far) + tuple(p for p in (7, 8) if base == 2 and p in paths)
    # one row (a decode step) and four (a verify pass, a batch), each candidate on both, the sum
    # decides: the paths differ in how they prefetch in few-row and in wide tiles, and within the
    # noise of a one-row pass (~1.0-1.1 ms for all on an AMD EPYC Zen 4) a one-row choice left
    # servers started minutes apart on paths whose four-row passes cost 1.6 and 2.3 ms
    both = _q8_stream_costs(cands)
    costs, wide = {p: c[0] for p, c in both.items()}, {p: c[1] for p, c in both.items()}
    pick = min(cands, key=lambda p: (costs[p] + wide[p], p))
    _q8_stream_sample.cache_clear()  # the 48 MB of sample weights, built once for both measurements
    with _lock:
        if "q8" not in _choices:
            _choices["q8"] = pick
            print(f"specbuild: int4-a8 linears run the int4 x int8 kernel's {Q8_PATHS[pick]} path (medians, one "
                  f"row over {Q8_STREAM_MB} MB of sample weights: " +
                  "; ".join(f"{Q8_PATHS[p]} {c:.2f} ms" for p, c in costs.items()) +
                  "; four rows: " + "; ".join(f"{Q8_PATHS[p]} {c:.2f} ms" for p, c in wide.items()) +
                  "; the same bits)", file=sys.stderr)
        return _choices["q8"]


Q8_STREAM_MB = 48  # what the near/far prefetch choice streams: past the last-level cache, as a decode step does


@functools.lru_cache(maxsize=1)
def _q8_stream_sample() -> tuple[int, int, bool, list[torch.Tensor]]:
    """(n, k, fp16 scales, copies): Q8_STREAM_MB of copies of one packed [n, k] int4 sample
    matrix; q8_path clears it once it has chosen."""
    gen = torch.Generator().manual_seed(0)
    n, k = 6144, 1536
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()  # fp16 scales, as the GGUF holds them
    m = (torch.randn(n, k // 32, generator=gen) * 0.01).half().float()
    z = m + 8.0 * s
    f16 = q8_fp16_exact(s, z)
    packed = repack_int4_q8(q, s, z, 32, f16)
    nbytes = packed.numel() * packed.element_size()
    return n, k, f16, [packed.clone() for _ in range(max(2, Q8_STREAM_MB * 2 ** 20 // nbytes))]


def _q8_stream_costs(paths: tuple[int, ...], repeats: int = 9) -> dict[int, tuple[float, float]]:
    """Milliseconds for one row and for four rows through Q8_STREAM_MB of int4 weights (copies
    of one sample matrix, so every pass reads them from memory) on each of `paths`: both widths
    of every path in each round, the paths' order rotated round by round, medians of `repeats`
    rounds after a warm-up. The prefetch distance decides how well a one-row pass streams
    weights from memory; on weights that fit the caches (the layer-sized samples) the near and
    far paths measured the same to 0.01 ms on an AMD EPYC, where a decode step ran 15% faster
    far. Medians, not the best of 5 rounds per width: path 8 was a tenth to a third of a
    millisecond faster than path 5 on one row in 19 of 24 servers' draws, yet the best-of-5
    sums gave 5 or 2 to 5 of those 24 servers (AMD EPYC, 2026-12-08)."""
    n, k, f16, copies = _q8_stream_sample()
    xs = {rows: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) for rows in (1, 4)}
    times: dict[tuple[int, int], list[float]] = {(p, rows): [] for p in paths for rows in xs}
    for r in range(repeats + 1):
        i = r % len(paths)
        for p in paths[i:] + paths[:i]:
            for rows, x in xs.items():
                t0 = time.perf_counter()
                for w in copies:
                    int4_q8_mm(x, w, n, 32, f16, p)
                if r:
                    times[(p, rows)].append(time.perf_counter() - t0)
    return {p: (statistics.median(times[(p, 1)]) * 1e3, statistics.median(times[(p, 4)]) * 1e3) for p in paths}


# ---- the kernels' thread pool (cpu_kernels.cpp, namespace pool) -------------------------------
POOL_MODES = {"0": 0, "off": 0, "omp": 0, "1": 1, "on": 1, "always": 1, "auto": 2}


def pool_mode() -> int:
    """$SPECBUILD_POOL: `auto` (default: torch's OpenMP threads while the cores are free, the
    kernels' own pool while the thread governor sees others' load on them), `1`/`on` (the pool
    always), `0`/`off` (OpenMP always). The same bits on every setting."""
    value = os.environ.get("SPECBUILD_POOL", "auto").strip().lower() or "auto"
    if value not in POOL_MODES:
        raise BundleError(f"SPECBUILD_POOL={value!r} is not one of auto, 1 (on), 0 (off)")
    return POOL_MODES[value]


def pool_spin_us() -> int:
    """$SPECBUILD_POOL_SPIN_US: how long a pool helper spins for the next job before it sleeps
    while the cores are free (default 50 microseconds: the gaps between the kernels of one step;
    under others' load helpers sleep at once, docs/cpu-kernels.md "The kernels' pool")."""
    value = os.environ.get("SPECBUILD_POOL_SPIN_US", "50").strip()
    if not value.isdigit() or int(value) > 100_000:
        raise BundleError(f"SPECBUILD_POOL_SPIN_US={value!r} must be a whole number of microseconds in 0..100000")
    return int(value)


def pool_contended(on: bool) -> None:
    """Tell the kernels whether others' load shares these cores (the thread governor calls this);
    under SPECBUILD_POOL=auto it moves the kernels' loops onto the pool while `on`."""
    if _load()["available"]:
        torch.ops.specbuild_cpu.pool_contended(bool(on))


def kernels_mode(mode: str, threads: int = 0) -> None:
    """Where the kernels' loops run on free cores (the thread governor's choice, model/threads.py):
    "pool" (their own pool, `threads` wide, while the caller keeps torch's own ops on one thread:
    the step's small ops then pay no OpenMP wake-up) or "openmp" (torch's OpenMP at torch's
    thread count; under others' load they still move onto the pool, pool_contended). The same
    bits either way."""
    if mode not in ("pool", "openmp"):
        raise ValueError(f"kernels mode {mode!r} is not one of pool, openmp")
    if not 0 <= threads <= 1024:
        raise ValueError(f"threads={threads} must be 0..1024")
    pool_config(1 if mode == "pool" else 2)
    if _load()["available"]:
        torch.ops.specbuild_cpu.pool_threads(threads if mode == "pool" else 0)


def pool_config(mode: int | None = None, spin_us: int | None = None) -> None:
    """Set the pool's mode (0 OpenMP, 1 always, 2 auto) and helpers' spin in this process (tests,
    benchmarks); None leaves a setting as it is."""
    if _load()["available"]:
        torch.ops.specbuild_cpu.pool_config(-1 if mode is None else int(mode), -1 if spin_us is None else int(spin_us))


def pool_stats() -> dict:
    """The pool's state: mode, contended, on (the kernels' loops run on it now), helpers started,
    jobs, chunks run by helpers and by callers, spin_us, and the caller's waits for chunks a
    helper was running (count, total ns, those over 1 ms: a helper preempted mid-chunk); {} where
    the kernels are unavailable."""
    if not _load()["available"]:
        return {}
    keys = ("mode", "contended", "on", "helpers", "jobs", "helper_chunks", "caller_chunks", "spin_us",
            "waits", "wait_ns", "long_waits")
    return dict(zip(keys, (int(v) for v in torch.ops.specbuild_cpu.pool_stats())))


STACK_PARTS = ("norm", "qkv linear", "rope, K/V write", "attention", "o linear", "residual add", "mlp norm",
               "gate_up linear", "silu * up", "down linear", "residual add 2", "call set-up")


def stack_profile(on: bool) -> dict[str, float]:
    """The fused stack's timers (int4_stack's parts, summed in C++ since the last call; off by
    default): turns them on or off and returns what they counted, ms per stack call by part
    ({} when no call ran). A diagnostic: scripts/step_parts.py prints it."""
    if not _load()["available"]:
        return {}
    ns = torch.ops.specbuild_cpu.stack_profile(int(bool(on)))
    calls = int(ns[-1])
    if not calls:
        return {}
    return {name: float(v) / calls / 1e6 for name, v in zip(STACK_PARTS, ns[:-1])}


def pool_check(items: int, grain: int = 1, reps: int = 100) -> dict:
    """Runs the pool's contract check (cpu_kernels.cpp pool_check) on torch's thread count:
    {"early": items not run exactly once when their job returned, "late": ... after all jobs
    (a chunk run after its job returned), "helper_chunks": chunks the helpers took}."""
    _load()
    early, late, helper = torch.ops.specbuild_cpu.pool_check(items, grain, reps)
    return {"early": int(early), "late": int(late), "helper_chunks": int(helper)}


# ---- layouts ---------------------------------------------------------------------------------
def repack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                f32_scales: bool) -> torch.Tensor:
    """q: [N, K] values 0..15; scales, zeros: [N, K / group_size]. Returns the 1-d uint8 buffer
    int4_mm streams (layout in cpu_kernels.cpp): per block of 16 columns, per group, the
    nibble octets then 16 scales and 16 zeros (float32 when f32_scales, else bfloat16). The
    columns past N (to a multiple of 16) hold zeros."""
    n, k = q.shape
    g = group_size
    if k % g or g % 8:
        raise ValueError(f"int4 kernel: group_size {g} must be a multiple of 8 dividing in_features {k}")
    pad = -n % COLS
    q = q.to(torch.int16)
    sdt = torch.float32 if f32_scales else torch.bfloat16
    scales, zeros = scales.to(sdt), zeros.to(sdt)
    if pad:
        q = torch.cat([q, q.new_full((pad, k), 8)])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    nb, ng = (n + pad) // COLS, k // g
    # [nb, col, ng, octet, j, parity]: input 8 * octet + 2 * j + parity of the group
    v = q.view(nb, COLS, ng, g // 8, 4, 2).permute(0, 2, 3, 1, 5, 4)  # [nb, ng, octet, col, parity, j]
    words = v[..., 0] | (v[..., 1] << 4) | (v[..., 2] << 8) | (v[..., 3] << 12)  # int16 (wraps: bits kept)
    nibbles = words.contiguous().view(torch.uint8).view(nb, ng, g * 8)
    s = scales.view(nb, COLS, ng).permute(0, 2, 1).contiguous().view(torch.uint8).view(nb, ng, -1)
    z = zeros.view(nb, COLS, ng).permute(0, 2, 1).contiguous().view(torch.uint8).view(nb, ng, -1)
    return _aligned(torch.cat([nibbles, s, z], -1).reshape(-1))


def repack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K] int8; scales: [N]. Returns the 1-d int8 buffer int8_mm streams: per
    block of 16 columns, K rows of 16 values then 16 float32 scales (columns past N zero)."""
    n, k = qweight.shape
    pad = -n % COLS
    qw, sc = qweight.to(torch.int8), scales.float()
    if pad:
        qw = torch.cat([qw, qw.new_zeros(pad, k)])
        sc = torch.cat([sc, sc.new_zeros(pad)])
    nb = (n + pad) // COLS
    values = qw.view(nb, COLS, k).transpose(1, 2).reshape(nb, k * COLS)
    s = sc.view(nb, COLS).contiguous().view(torch.int8).view(nb, COLS * 4)
    return _aligned(torch.cat([values, s], 1).reshape(-1))


def repack_int8_q8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K] int8; scales: [N]. Returns the 1-d uint8 buffer int8_q8_mm streams (layout
    in cpu_kernels.cpp): per block of 16 columns, K / 4 chunks of 64 bytes (byte 4c + j: column
    c's input 4o + j plus 128, the unsigned operand vpdpbusd takes), then 16 float32 scales.
    Columns past N (to a multiple of 16) hold weight 0 and scale 0."""
    n, k = qweight.shape
    if k % Q8_BLOCK:
        raise ValueError(f"int8 x int8 kernel: in_features {k} must be a multiple of {Q8_BLOCK} (the input blocks)")
    pad = -n % COLS
    u = (qweight.to(torch.int16) + 128).to(torch.uint8)
    sc = scales.float()
    if pad:
        u = torch.cat([u, u.new_full((pad, k), 128)])
        sc = torch.cat([sc, sc.new_zeros(pad)])
    nb = (n + pad) // COLS
    chunks = u.view(nb, COLS, k // 4, 4).permute(0, 2, 1, 3).reshape(nb, k * COLS)  # [nb, chunk, col, j]
    s = sc.view(nb, COLS).contiguous().view(torch.uint8).view(nb, COLS * 4)
    return _aligned(torch.cat([chunks, s], 1).reshape(-1))


# int8_q8_mm's `path` (the same bits on each); 7: 2's instructions, no software prefetch in few-row tiles
INT8_Q8_PATHS = {1: "AVX2", 2: "AVX512-VNNI", 7: "AVX512-VNNI no prefetch in few-row tiles"}


def int8_q8_available() -> bool:
    """Whether int8_q8_mm (the lm_head with int8 input blocks) runs here: AVX512-VNNI or AVX2
    (SPECBUILD_CPU_KERNEL=avx2 keeps it to AVX2)."""
    return bool(_load()["available"]) and bool(torch.ops.specbuild_cpu.int8_q8_available())


def int8_q8_path() -> int:
    """The int8_q8_mm path this process runs: AVX512-VNNI where it runs (unless
    SPECBUILD_CPU_KERNEL=avx2), without the software prefetch in few-row tiles where the int4
    x int8 kernel's measurement chose that (q8_path: the same question of how this machine
    streams weights to a few rows; where it chose 8, whose far prefetch in wide tiles made the
    lm_head's 3-4 row tiles slower, 7 too), else AVX2; 0 where neither does."""
    if not int8_q8_available():
        return 0
    if mode() == "avx2" or 2 not in q8_paths():
        return 1
    return 7 if q8_path() in (7, 8) else 2


def int8_q8_mm(x: torch.Tensor, packed: torch.Tensor, n: int, path: int = 0) -> torch.Tensor:
    return torch.ops.specbuild_cpu.int8_q8_mm(x, packed, n, path)


def q8_scales_and_m(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, m = zero - 8 * scale): weight = q * scale + m. 8 * scale is exact, so m
    has one rounding (none for weights carried from GGUF Q4_1: m is the block's own minimum)."""
    s = scales.float()
    return s, zeros.float() - 8.0 * s


def q8_fp16_exact(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether every scale and m is an fp16 value (then repack_int4_q8 may store them in fp16:
    same bits, 20 bytes per 32 weights instead of 24). True for GGUF Q4_1 weights."""
    s, m = q8_scales_and_m(scales, zeros)
    return all(bool(torch.equal(t.half().float(), t)) for t in (s, m))


def repack_int4_q8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   f16_scales: bool = False) -> torch.Tensor:
    """q: [N, K] values 0..15; scales, zeros: [N, K / group_size] (weight = (q - 8) * scale +
    zero). Returns the 1-d uint8 buffer int4_q8_mm streams (layout in cpu_kernels.cpp): per
    block of 16 columns, per group, G / 8 chunks of 64 bytes (byte 4c + j: column c's input
    8o + j in the low nibble, 8o + 4 + j in the high one), then 16 scales and 16
    m = zero - 8 * scale (weight = q * scale + m), float32, or fp16 when `f16_scales` (only
    where q8_fp16_exact holds: a ValueError otherwise). Columns past N (to a multiple of 16)
    are zero."""
    n, k = q.shape
    g = group_size
    if k % g or g % Q8_BLOCK:
        raise ValueError(f"int4 x int8 kernel: group_size {g} must be a multiple of {Q8_BLOCK} dividing "
                         f"in_features {k}")
    if f16_scales and not q8_fp16_exact(scales, zeros):
        raise ValueError("int4 x int8 kernel: f16_scales needs every scale and zero - 8 * scale to be an fp16 value")
    pad = -n % COLS
    q = q.to(torch.uint8)
    s, m = q8_scales_and_m(scales, zeros)
    if f16_scales:
        s, m = s.half(), m.half()
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        s = torch.cat([s, s.new_zeros(pad, s.shape[1])])
        m = torch.cat([m, m.new_zeros(pad, m.shape[1])])
    nb, ng = (n + pad) // COLS, k // g
    v = q.view(nb, COLS, ng, g // 8, 2, 4).permute(0, 2, 3, 1, 4, 5)  # [nb, ng, chunk, col, half, j]
    chunks = (v[..., 0, :] | (v[..., 1, :] << 4)).contiguous().view(nb, ng, g * 8)
    sb = s.view(nb, COLS, ng).permute(0, 2, 1).contiguous().view(torch.uint8).view(nb, ng, -1)
    mb = m.view(nb, COLS, ng).permute(0, 2, 1).contiguous().view(torch.uint8).view(nb, ng, -1)
    return _aligned(torch.cat([chunks, sb, mb], -1).reshape(-1))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t).copy_(t)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, n: int, group_size: int, f32_scales: bool, isa_level: int):
    if not _state:
        _load()
    return torch.ops.specbuild_cpu.int4_mm(x, packed, n, group_size, f32_scales, isa_level)


def int8_mm(x: torch.Tensor, packed: torch.Tensor, n: int, isa_level: int):
    if not _state:
        _load()
    return torch.ops.specbuild_cpu.int8_mm(x, packed, n, isa_level)


def int4_q8_mm(x: torch.Tensor, packed: torch.Tensor, n: int, group_size: int, f16_scales: bool, path: int):
    if not _state:
        _load()
    return torch.ops.specbuild_cpu.int4_q8_mm(x, packed, n, group_size, f16_scales, path)


def q8_quantize(x: torch.Tensor):
    """x [T, K] -> (q int8 [T, K], dx float32 [T, K / 32], qsum float32 [T, K / 32]): the int8
    blocks int4_q8_mm multiplies (x ~= q * dx per block)."""
    if not _state:
        _load()
    return torch.ops.specbuild_cpu.q8_quantize(x)


ROWS_ATTENTION_HEAD_DIMS = (*range(8, 129, 8), 256)  # what rows_attention is built for (cpu_kernels.cpp)


def rows_attention_usable(dtype: torch.dtype, head_dim: int, device) -> bool:
    """Whether rows_attention can run a model's attention here: float32 queries and cache (the
    model's dtype) on the CPU, a head_dim it is built for, the kernels available, and SPECBUILD_CPU_KERNEL not
    `torch` (which keeps every forward on torch's own ops)."""
    if mode() == "torch" or torch.device(device).type != "cpu":
        return False
    if dtype != torch.float32 or head_dim not in ROWS_ATTENTION_HEAD_DIMS:
        return False
    return bool(_load()["available"])


def rows_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Each query row of q [T, H, D] over its own cache slots: index int64 [T + 1 + total] holds
    the rows' offsets (index[0] = 0, index[T] = total) and then every row's slots in position
    order (attention.rows_index builds it). float32; a row with no keys comes out zero. A row's
    bits depend only on its query, its keys and their order (cpu_kernels.cpp)."""
    if not _state:
        _load()
    return torch.ops.specbuild_cpu.rows_attention(q, k_cache, v_cache, index, scale)


# ---- which kernel runs ---------------------------------------------------------------------
SAMPLE_SHAPES = ((576, 576), (1536, 576), (576, 1536))  # SmolLM2-135M-like; the choice is per CPU, not per model
SAMPLE_WIDTHS = (1, 5)
# int8 runs lm_heads (and the EAGLE head's wide linears): weights far past a core's L2, where the
# one-row AVX-512 tiles stream 3x faster than the AVX2 ones on a Xeon (0.64 against 1.95 ms for
# SmolLM2's [49152, 576] lm_head, 2026-12-05) while on the layer-sized samples the two were
# within noise of each other and the choice flipped between processes
INT8_SAMPLE_SHAPES = ((16384, 576),)  # 9.4 MB
# ... and even at 9.4 MB the two one-row codes measured within 5% of each other, while on the
# 28.5 MB lm_head the AVX-512 tiles took 0.62-0.66 ms against 0.79-1.00 (AVX2), so the AVX2
# one-row code (level 2) is kept only where it measures more than 10% faster (an AMD EPYC)
INT8_ROW512_MARGIN = 1.10


def _sample_costs(kind: str, act_dtype: torch.dtype, level: int, repeats: int = 5,
                  levels: tuple[int, ...] = ()) -> dict[str, float]:
    """Milliseconds for one pass over a few sample weights at SAMPLE_WIDTHS (summed), torch's
    kernel ("torch") and ours at `level` ("specbuild") and at each of `levels` (keyed by the
    level) interleaved, best of `repeats` rounds."""
    gen = torch.Generator().manual_seed(0)
    shapes = [s for s in SAMPLE_SHAPES for _ in range(4)] if kind == "int4" else list(INT8_SAMPLE_SHAPES)
    ours, theirs = [], []
    alts: dict[int, list] = {lv: [] for lv in levels}
    for n, k in shapes:
        if kind == "int4":
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
            s = torch.rand(n, k // 32, generator=gen).to(act_dtype) * 0.01
            z = torch.rand(n, k // 32, generator=gen).to(act_dtype) * 0.01
            packed = repack_int4(q, s, z, 32, act_dtype != torch.bfloat16)
            tp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()
            f32 = act_dtype != torch.bfloat16
            ours.append((k, lambda x, p=packed, n=n, f=f32: int4_mm(x, p, n, 32, f, level)))
            for lv, fns in alts.items():
                fns.append((k, lambda x, p=packed, n=n, f=f32, lv=lv: int4_mm(x, p, n, 32, f, lv)))
            theirs.append((k, lambda x, p=tp, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 32, sz)))
        else:
            q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            s = torch.rand(n, generator=gen).to(act_dtype) * 0.01
            packed = repack_int8(q, s)
            ours.append((k, lambda x, p=packed, n=n: int8_mm(x, p, n, level)))
            for lv, fns in alts.items():
                fns.append((k, lambda x, p=packed, n=n, lv=lv: int8_mm(x, p, n, lv)))
            theirs.append((k, lambda x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s)))
    runs = [("specbuild", ours), ("torch", theirs), *alts.items()]
    total = {name: 0.0 for name, _ in runs}
    for w in SAMPLE_WIDTHS:
        xs = {k: torch.randn(w, k, generator=gen).to(act_dtype) for k in (576, 1536)}
        best = {name: float("inf") for name in total}
        for r in range(repeats + 1):
            for name, fns in runs:
                t0 = time.perf_counter()
                for k, fn in fns:
                    fn(xs[k])
                if r:
                    best[name] = min(best[name], time.perf_counter() - t0)
        for name in total:
            total[name] += best[name] * 1e3
    return total


def choose(kind: str, act_dtype: torch.dtype, device: torch.device | str = "cpu") -> int:
    """The ISA level of specbuild's kernel for `kind` ("int4", "int8") weights with `act_dtype`
    inputs on `device`, or 0 for torch's kernel; decided once per process and kind (a quick
    interleaved measurement on sample weights under SPECBUILD_CPU_KERNEL=auto) and announced
    in one line on stderr."""
    if torch.device(device).type != "cpu" or act_dtype not in (torch.bfloat16, torch.float32):
        return 0
    key = (kind, act_dtype)
    with _lock:
        if key in _choices:
            return _choices[key]
    m = mode()
    if m == "torch":
        return _announce(key, 0, "SPECBUILD_CPU_KERNEL=torch")
    level = isa()
    if level == 0:
        if m in ("specbuild", "avx2"):
            raise KernelBuildError(f"SPECBUILD_CPU_KERNEL={m}: {status()['reason']}")
        return _announce(key, 0, status()["reason"].splitlines()[0])
    # int4 with bfloat16 inputs on AVX-512: the fp32 multiply-add path (level 4, its own bits)
    # where the core's vfmadd runs FMA_OVER_BF16 times vdpbf16ps's multiply-adds or more (or there
    # is no BF16), decided by instruction rates so that every process on a machine computes the
    # same bits; else the BF16 path, with its prefetch near (2) or far (3, the same bits) as the
    # memory system decides, measured (cpu_kernels.cpp)
    alts: tuple[int, ...] = ()
    rates = ""
    if kind == "int4" and act_dtype == torch.bfloat16 and has_isa4():
        dp, fm = dot_rates()
        rates = f"; multiply-adds per ns: vfmadd {fm:.0f}, vdpbf16ps {dp:.0f}"
        if level < 2 or fm >= FMA_OVER_BF16 * dp:
            level = 4
    if level == 2 and (kind == "int8" or act_dtype == torch.bfloat16):
        alts = (3,)  # int4: prefetch further ahead; int8: one-row tiles in AVX-512 (the same bits)
    if m in ("specbuild", "avx2") and not (alts and m == "specbuild"):
        return _announce(key, level, f"SPECBUILD_CPU_KERNEL={m}{rates}")
    costs = _sample_costs(kind, act_dtype, level, levels=alts)
    ours = min([level, *alts], key=lambda lv: costs["specbuild" if lv == level else lv])
    if kind == "int8" and ours == 2 and 3 in alts and costs[3] <= INT8_ROW512_MARGIN * costs["specbuild"]:
        ours = 3  # within the margin: the AVX-512 one-row tiles, which win on lm_head-sized weights
        rates += f"; one-row tiles kept within {INT8_ROW512_MARGIN:.2f}x (they win on lm_head-sized weights)"
    mine = costs["specbuild" if ours == level else ours]
    paths = "; ".join(f"{level_name(kind, lv)} {costs['specbuild' if lv == level else lv]:.2f} ms"
                      for lv in (level, *alts))
    if m == "specbuild":  # ours in any case: only its paths are compared
        return _announce(key, ours, f"SPECBUILD_CPU_KERNEL={m}; sample weights at widths "
                                    f"{'/'.join(map(str, SAMPLE_WIDTHS))}: {paths}{rates}")
    why = (f"sample weights at widths {'/'.join(map(str, SAMPLE_WIDTHS))}: specbuild {mine:.2f} ms, "
           f"torch {costs['torch']:.2f} ms")
    if alts:
        why += f"; {paths}"
    why += rates
    return _announce(key, ours if mine < costs["torch"] else 0, why, ours=ours)


def ours_level(kind: str, act_dtype: torch.dtype) -> int:
    """The fastest of specbuild's own levels for `kind` with `act_dtype` inputs (choose() decides
    it once; 0 where specbuild's kernels cannot run): for callers that run specbuild's kernel
    whichever kernel the target's weights take (the EAGLE head's int8 linears)."""
    choose(kind, act_dtype)
    with _lock:
        return _ours.get((kind, act_dtype), 0)


def _announce(key: tuple, level: int, why: str, ours: int | None = None) -> int:
    kind, act = key
    with _lock:
        if key not in _choices:
            _choices[key] = level
            _ours[key] = level if ours is None else ours
            which = f"specbuild's {level_name(kind, level)} kernel" if level else "torch's kernel"
            act_name = str(act).removeprefix("torch.")
            print(f"specbuild: {kind} linears ({act_name} inputs) run {which} ({why})", file=sys.stderr)
        return _choices[key]


def reset_choices() -> None:
    """Forget the per-process choices (tests that change SPECBUILD_CPU_KERNEL)."""
    with _lock:
        _choices.clear()
        _ours.clear()
