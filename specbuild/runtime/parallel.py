"""MPI roles and the draft link's transport: one DistContext, non-blocking transfers with deadlines.

    mpirun -disable-auto-cleanup -n 2 specbuild serve BUNDLE --parallel-draft

`DistContext.create` is the one place that reads the launcher's environment (PMI_RANK,
PMI_SIZE) and mpi4py; everything else gets the context passed down. Roles: world size 1
is `single` (no MPI is imported at all); with `--parallel-draft` and world size 2, rank 0
is the `verifier` (HTTP, scheduler, target) and rank 1 the `drafter`. Anything else is
refused at start-up with a message that says what is supported.

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
from typing import Callable

import numpy as np

from ..errors import SpecbuildError

log = logging.getLogger("specbuild.parallel")

GUARD_ENV = "SPECBUILD_RANK_GUARDED"  # set in a guard's child: it is the real rank
SUPPORTED = ("supported: 1 process (standard speculation), or `mpirun -disable-auto-cleanup -n 2 "
             "specbuild serve BUNDLE --parallel-draft` (rank 0 verifies, rank 1 drafts); "
             "tensor parallelism is not implemented yet")


def launcher_rank_size() -> tuple[int, int]:
    """(rank, world size) announced by an MPI launcher in the environment; (0, 1) alone."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if os.environ.get(size_var):
            return int(os.environ.get(rank_var, "0")), int(os.environ[size_var])
    return 0, 1


def check_world(world_size: int, parallel_draft: bool) -> None:
    """Refuse the world sizes this runtime does not support (SpecbuildError, one line)."""
    if parallel_draft and world_size != 2:
        raise SpecbuildError(f"--parallel-draft needs exactly 2 MPI ranks, got world size {world_size}; "
                             + SUPPORTED)
    if not parallel_draft and world_size != 1:
        raise SpecbuildError(f"world size {world_size} is not supported without --parallel-draft; " + SUPPORTED)


def guard() -> None:
    """Run this same command line as a child and mirror its fate (never returns).

    The child inherits the launcher's PMI file descriptor (close_fds=False). A child killed
    by signal N makes the guard exit with 128 + N instead of dying of it (see the module doc).
    """
    env = {**os.environ, GUARD_ENV: "1"}
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
    rc = child.wait()
    sys.stdout.flush()
    os._exit(rc if rc >= 0 else 128 - rc)


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

    def __init__(self, rank: int = 0, world_size: int = 1, comm=None, mpi=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.role = "single" if world_size == 1 else ("verifier" if rank == 0 else "drafter")
        self.peer = 1 - rank if world_size == 2 else None
        self.comm = comm
        self.mpi = mpi  # the mpi4py.MPI module (None when single)
        self.peer_lost = threading.Event()
        self.reason: str | None = None  # why the link was abandoned
        self._graveyard: list[Pending] = []
        self._lock = threading.Lock()

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, parallel_draft: bool) -> "DistContext":
        """The context of this process. Under a launcher with --parallel-draft, the first call
        in the launched process becomes the guard (never returns); its child goes on here."""
        rank, size = launcher_rank_size()
        check_world(size, parallel_draft)
        if size == 1:
            return cls()
        if os.environ.get(GUARD_ENV) != "1":
            guard()
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
