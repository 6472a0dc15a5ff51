"""MPI roles and the draft link's transport: one DistContext, non-blocking transfers with deadlines.

    mpirun -disable-auto-cleanup -n 2 specbuild serve BUNDLE --parallel-draft
    mpirun -n TP*PP specbuild serve BUNDLE        (TensorRT-LLM engines built for TP*PP ranks)

`DistContext.create` is the one place that checks the launcher's world size (PMI_RANK,
PMI_SIZE) against what the bundle needs (`bundle_world`); everything else gets the context
passed down. Roles: world size 1 is `single` (no MPI is imported at all); with
`--parallel-draft` and world size 2, rank 0 is the `verifier` (HTTP, scheduler, target) and
rank 1 the `drafter`; on a bundle served by TensorRT-LLM engines built for tp*pp > 1 ranks,
under `mpirun -n tp*pp`, rank 0 is the `leader` (it takes every request) and the others
are `worker`s (`follow_leader`). Anything else is refused at start-up with one line that
names the world size, what the bundle needs and the command to use.

Leader mode is TensorRT-LLM's own (reference §5): every rank builds its executor over its
engine file on GPU `rank % gpus_per_node`; TensorRT-LLM does the MPI, specbuild makes no MPI
call, imports no mpi4py and runs no guard there. It is launched *without*
`-disable-auto-cleanup`: a rank that dies leaves the others' collectives hanging, so the
launcher taking every rank down is the wanted outcome. A clean shutdown is ordered by the
leader: rank 0 shuts its executors down, which releases the workers' `shutdown()`; every
rank then exits normally (MPI_Finalize at exit, which TensorRT-LLM's mpi4py registers).

MineDraft (`--parallel-draft`) is different: its two ranks must survive each other.

What PyPI's mpich (5.0.2, hydra launcher) does when a rank dies, measured on this box,
and what follows:

- A rank that exits with a status: the launcher sends SIGUSR1 to the other ranks, and
  without `-disable-auto-cleanup` kills them within a second. The flag is in the launcher
  script; SIGUSR1 is caught here and means "the peer is gone".
- A rank killed by a signal (SIGKILL, a segfault): the launcher SIGKILLs every other rank,
  flag or not. So the process mpirun starts is a small guard (`guard()`, no MPI, no torch)
  that runs the real rank as its child, forwards SIGTERM/SIGINT/SIGHUP/SIGUSR1 to it and
  exits with 128 + signal when the child is killed: the launcher then sees an ordinary
  exit status. (Killing a guard itself still takes every rank down.)
- No rank outlives its launcher. The rank runs in its own session (see `guard`), so a
  SIGKILL of mpirun's process group (a CI timeout, a test fixture) reaches mpirun, its proxy
  and the guards but not the ranks, and a kill -9 of mpirun alone takes its proxy and then
  the guards' parent away. Two ties close that: the rank asks the kernel for SIGKILL when its
  guard dies (prctl PR_SET_PDEATHSIG, `die_with_parent`), and the guard watches its own parent
  (the launcher's proxy): once that is gone it sends the rank one SIGTERM (the ordinary
  shutdown) and SIGKILL after `ORPHAN_GRACE_S`.
- After the peer is gone a pending receive never completes and MPI_Finalize hangs. So the
  communicator has MPI.ERRORS_RETURN, every transfer is Isend/Irecv polled with Test until
  a deadline (no blocking MPI call anywhere; blocking calls would also spin a core), a
  failed or late transfer abandons the link for good (`abandon`), and no rank ever calls
  MPI_Finalize (mpi4py.rc.finalize = False): a rank's exit never synchronises with its
  peer. Buffers of abandoned transfers are kept alive until exit, so a late peer can never
  write into freed memory.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specbuild.backends.launch import launcher_rank_size
from specbuild.errors import SpecbuildError

log = logging.getLogger("specbuild.parallel")

GUARD_ENV = "SPECBUILD_RANK_GUARDED"  # set in a guard's child: it is the real rank
GUARD_PID_ENV = "SPECBUILD_RANK_GUARD_PID"  # the guard's pid, in its child
ORPHAN_GRACE_S = 5.0  # a rank whose launcher is gone gets this long to shut down after SIGTERM
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SUPPORTED = ("supported: 1 process (standard speculation), `mpirun -disable-auto-cleanup -n 2 "
             "specbuild serve BUNDLE --parallel-draft` (rank 0 verifies, rank 1 drafts), or `mpirun -n TP*PP "
             "specbuild serve BUNDLE` for a bundle whose TensorRT-LLM engines were built for TP*PP ranks "
             "(TensorRT-LLM leader mode)")


@dataclass(frozen=True)
class WorldNeed:
    """How many MPI ranks serving a bundle takes. On the torch backend: one process (two with
    --parallel-draft). On TensorRT-LLM: the target engine's tp*pp ranks (leader mode)."""

    backend: str = "torch"  # the backend the bundle will run on
    ranks: int = 1  # TensorRT-LLM: the engines' mapping world_size (tp * pp)
    tp: int = 1
    pp: int = 1
    why: str = ""  # why `--backend auto` chose this backend

    @property
    def leader_mode(self) -> bool:
        return self.backend == "tensorrt-llm"


TORCH = WorldNeed()


def bundle_world(bundle_dir: str, backend: str = "auto") -> WorldNeed:
    """The backend this bundle runs on here (`backend.resolve_backend`) and the ranks it takes:
    the TensorRT-LLM target engine's tp*pp from its config.json, or one process on torch."""
    from specbuild.backends.select import resolve_backend

    name, why = resolve_backend(bundle_dir, backend)
    if name == "torch":
        return WorldNeed(why=why if backend == "auto" else "")
    from specbuild.backends.select import trtllm_path
    from specbuild.backends.tensorrt_llm import engine_dirs, engine_limits, read_engine_config

    if trtllm_path(bundle_dir)[0] == "llmapi":  # TensorRT-LLM's LLM API spawns its own workers: one process
        return WorldNeed("tensorrt-llm", 1, 1, 1)
    lim = engine_limits(read_engine_config(engine_dirs(bundle_dir)["target"]))
    return WorldNeed("tensorrt-llm", lim["world_size"], lim["tp"], lim["pp"])


def check_world(world_size: int, parallel_draft: bool, need: WorldNeed = TORCH, command: str = "serve") -> None:
    """Refuse the world sizes this runtime does not support for `need` (SpecbuildError, one
    line naming the world size, what the bundle needs and the command line to use)."""
    if parallel_draft and world_size != 2:
        raise SpecbuildError(f"--parallel-draft needs exactly 2 MPI ranks, got world size {world_size}; "
                             + SUPPORTED)
    if parallel_draft:
        return
    if need.leader_mode and world_size != need.ranks:
        fix = (f"launch it with `mpirun -n {need.ranks} specbuild {command} BUNDLE`" if need.ranks > 1
               else f"run `specbuild {command} BUNDLE` without mpirun")
        raise SpecbuildError(f"MPI world size {world_size} does not match this bundle's TensorRT-LLM engines, "
                             f"built for tp*pp = {need.ranks} rank{'s' if need.ranks > 1 else ''} "
                             f"(tp {need.tp}, pp {need.pp}): {fix}")
    if not need.leader_mode and world_size != 1:
        chose = f" (--backend auto chose torch: {need.why})" if need.why else ""
        raise SpecbuildError(f"world size {world_size} is not supported without --parallel-draft on the torch "
                             f"backend{chose}; " + SUPPORTED)


def die_with_parent(sig: int, parent: int) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux prctl
    PR_SET_PDEATHSIG through ctypes; no package does just this). `parent`: the pid the parent
    should have; if it is gone already (it died before this call) the signal comes at once.
    Returns False where prctl is not available (the guard's own watch still holds then)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return ok


def guard() -> None:
    """Run this same command line as a child and mirror its fate (never returns).

    The child inherits the launcher's PMI file descriptor (close_fds=False). A child killed
    by signal N makes the guard exit with 128 + N instead of dying of it (see the module doc).
    The child dies with the guard (`die_with_parent`, set up in `DistContext.create`), and the
    guard ends the child when its own parent, the launcher's proxy, is gone.
    """
    launcher = os.getppid()
    env = {**os.environ, GUARD_ENV: "1", GUARD_PID_ENV: str(os.getpid())}
    # its own process group: a signal the launcher sends to our group reaches the child once,
    # through `forward`, not twice (twice means "forced exit" to the server)
    child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env=env, close_fds=False,
                             start_new_session=True)

    def forward(signum, frame) -> None:
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    orphaned_at = None
    while True:
        try:
            rc = child.wait(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        if orphaned_at is None and os.getppid() != launcher:  # nobody is left to stop the rank
            orphaned_at = time.monotonic()
            forward(signal.SIGTERM, None)
        elif orphaned_at is not None and time.monotonic() - orphaned_at > ORPHAN_GRACE_S:
            child.kill()
    try:
        sys.stdout.flush()
    except OSError:  # the launcher that read our stdout is gone
        pass
    os._exit(rc if rc >= 0 else 128 - rc)


def follow_leader(engine, say: Callable[[str], None] = log.info) -> bool:
    """Leader mode, on a rank that is not the leader (`engine.is_leader` False): keep this
    rank's part of the engine running until rank 0 shuts its engine down, then return True.
    On the leader, a single process or the torch backend: return False at once.

    This is what TensorRT-LLM's own front ends do (tensorrtllm_backend's model.py: ranks that
    cannot enqueue wait in the executor's shutdown() until the leader is done). The leader owns
    shutdown: mpirun forwards SIGINT/SIGTERM to every rank, and a worker that left then would
    take rank 0's in-flight requests (and, with mpich, rank 0 itself) down; so the first such
    signal here is noted and ignored, and a second one leaves at once (as rank 0's does).
    `generate` and `serve` both call it right after `open_engine`."""
    if getattr(engine, "is_leader", True):
        return False
    rank = getattr(engine, "rank", "?")
    say(f"rank {rank}: GPU {getattr(engine, 'device', '?')}, serving its part of the engine until rank 0 "
        "shuts down (only rank 0 takes requests)")
    done = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            engine.wait_as_worker()  # TensorRT-LLM: returns once the leader's shutdown() released it
        except BaseException as e:  # noqa: BLE001 (raised again in the main thread)
            failed.append(e)
        finally:
            done.set()

    signalled: list[int] = []

    def on_signal(signum, frame) -> None:
        if signalled:  # a second signal: leave without waiting
            sys.stderr.write(f"rank {rank}: forced exit\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        signalled.append(signum)
        say(f"rank {rank}: {signal.Signals(signum).name} noted; waiting for rank 0 to shut the engine down")

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        threading.Thread(target=wait, name="specbuild-worker-rank", daemon=True).start()
        while not done.wait(0.5):  # the main thread stays free to run the signal handlers
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failed:
        raise failed[0]
    say(f"rank {rank}: released by rank 0")
    return True


class Pending:
    """One posted transfer: the MPI request and the buffer it reads or writes."""

    __slots__ = ("request", "buffer")

    def __init__(self, request, buffer: np.ndarray) -> None:
        self.request = request
        self.buffer = buffer


class DistContext:
    """Rank, world size and role, decided once; the link to the peer rank (if any).

    `healthy` is False once the peer died (SIGUSR1 from the launcher), missed a deadline
    or a transfer failed; from then on no MPI call is made again.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, comm=None, mpi=None, leader_mode: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        if world_size == 1:
            self.role = "single"
        elif leader_mode:  # TensorRT-LLM's: it owns the MPI traffic, there is no link here
            self.role = "leader" if rank == 0 else "worker"
        else:
            self.role = "verifier" if rank == 0 else "drafter"
        self.peer = 1 - rank if world_size == 2 and not leader_mode else None
        self.comm = comm
        self.mpi = mpi  # the mpi4py.MPI module (None when single)
        self.peer_lost = threading.Event()
        self.reason: str | None = None  # why the link was abandoned
        self._graveyard: list[Pending] = []
        self._lock = threading.Lock()

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, parallel_draft: bool, need: WorldNeed = TORCH, command: str = "serve") -> "DistContext":
        """The context of this process, its world size checked against `need` (`bundle_world`).
        Under a launcher with --parallel-draft, the first call in the launched process becomes
        the guard (never returns); its child goes on here. In leader mode nothing MPI happens
        here (TensorRT-LLM's executor does it)."""
        rank, size = launcher_rank_size()
        check_world(size, parallel_draft, need, command)
        if size == 1:
            return cls()
        if not parallel_draft:  # check_world let it through: TensorRT-LLM leader mode
            return cls(rank, size, leader_mode=True)
        if os.environ.get(GUARD_ENV) != "1":
            guard()
        if os.environ.get(GUARD_PID_ENV, "").isdigit():  # this rank ends when its guard does
            die_with_parent(signal.SIGKILL, int(os.environ[GUARD_PID_ENV]))
        # before MPI_Init, which can take a while: the launcher's SIGUSR1 must not kill us
        peer_lost = threading.Event()
        signal.signal(signal.SIGUSR1, lambda signum, frame: peer_lost.set())
        try:
            import mpi4py
        except ImportError:
            raise SpecbuildError("--parallel-draft needs mpi4py and mpich: pip install mpi4py mpich "
                                 "(scripts/setup.sh installs them)") from None
        mpi4py.rc.finalize = False  # MPI_Finalize would hang on a dead peer: never call it
        mpi4py.rc.thread_level = "multiple"  # the engine thread talks MPI, not the main thread
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        ctx = cls(comm.Get_rank(), comm.Get_size(), comm, MPI)
        ctx.peer_lost = peer_lost
        if ctx.world_size != size:
            raise SpecbuildError(f"MPI reports world size {ctx.world_size}, the launcher said {size}")
        return ctx

    # ---- state -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        if self.comm is not None and self.peer_lost.is_set():
            self.abandon("the draft rank's process ended (launcher notice)" if self.rank == 0
                         else "the verifier rank's process ended (launcher notice)")
        return self.comm is not None

    def abandon(self, reason: str) -> None:
        """Stop using the link for good: no MPI call is made after this (thread-safe, once)."""
        with self._lock:
            if self.comm is None:
                return
            self.comm = None
            self.reason = reason
        log.warning("rank %d: abandoning the MPI link to rank %s: %s", self.rank, self.peer, reason)

    # ---- transfers -----------------------------------------------------------------------------
    def isend(self, array: np.ndarray, tag: int) -> Pending | None:
        """Post a send of a contiguous numpy buffer; None when the link is (or becomes) unusable."""
        return self._post(array, tag, send=True)

    def irecv(self, array: np.ndarray, tag: int) -> Pending | None:
        return self._post(array, tag, send=False)

    def _post(self, array: np.ndarray, tag: int, send: bool) -> Pending | None:
        assert array.flags.c_contiguous
        if not self.healthy:
            return None
        try:
            fn = self.comm.Isend if send else self.comm.Irecv
            pending = Pending(fn(array, self.peer, tag), array)
        except Exception as e:  # MPI.Exception under ERRORS_RETURN
            self.abandon(f"posting a {'send' if send else 'receive'} failed: {e}")
            return None
        self._graveyard.append(pending)  # dropped again once complete (see wait)
        return pending

    def wait(self, pendings: list[Pending | None], deadline: float | None,
             stop: Callable[[], bool] | None = None) -> bool:
        """Poll until every transfer completed (True), or the deadline (time.monotonic), the
        peer's loss, a failed Test or `stop()` (False; the link is abandoned except on stop)."""
        if any(p is None for p in pendings):
            return False
        todo = list(pendings)
        nap = 2e-5
        while todo:
            if not self.healthy:
                return False
            try:
                todo = [p for p in todo if not p.request.Test()]
            except Exception as e:
                self.abandon(f"a transfer failed: {e}")
                return False
            if not todo:
                break
            if deadline is not None and time.monotonic() > deadline:
                self.abandon("the peer missed its deadline")
                return False
            if stop is not None and stop():
                return False
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
        with self._lock:
            done = {id(p) for p in pendings}
            self._graveyard = [p for p in self._graveyard if id(p) not in done]
        return True

    def probe(self, tag: int, stop: Callable[[], bool] | None = None, deadline: float | None = None) -> int | None:
        """Wait for a message with `tag` from the peer; its length in int64 items, or None
        (link lost, stop() or deadline; a deadline here does not abandon the link)."""
        status = self.mpi.Status()
        nap = 2e-5
        while self.healthy:
            try:
                if self.comm.Iprobe(source=self.peer, tag=tag, status=status):
                    return status.Get_count(self.mpi.INT64_T)
            except Exception as e:
                self.abandon(f"probing failed: {e}")
                return None
            if (stop is not None and stop()) or (deadline is not None and time.monotonic() > deadline):
                return None
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)
        return None

    def recv_now(self, count: int, tag: int, deadline: float) -> np.ndarray | None:
        """Receive a message already seen by `probe`: int64 [count], or None."""
        buf = np.empty(count, dtype=np.int64)
        return buf if self.wait([self.irecv(buf, tag)], deadline) else None

    def notify(self, array: np.ndarray, tag: int, deadline_s: float = 1.0) -> bool:
        """Send a small message and wait for it at most deadline_s (stop, release notices)."""
        return self.wait([self.isend(array, tag)], time.monotonic() + deadline_s)
