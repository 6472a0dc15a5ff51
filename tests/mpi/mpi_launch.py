"""`mpirun -n 2 ... serve --parallel-draft` for the MPI tests: the launch, its URL, the
processes it started (found by a tag on their command lines) and a teardown that requires
that none outlives its launcher. Every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from http_client import get

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
MPI_HINT = "MPI tests need mpi4py and mpich in the venv: .venv/bin/python -m pip install mpi4py mpich"
CLI = [sys.executable, "-c", "from specbuild.cli import main; main()"]


def need_mpi() -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip(MPI_HINT)
    if not os.access(MPIRUN, os.X_OK):
        pytest.skip(MPI_HINT)


def live(pid: int) -> bool:
    """pid names a process that still runs (a zombie waiting for its parent's wait() does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class MpiServer:
    """The launch; `timeout`: seconds until rank 0 prints its URL (both ranks load meanwhile);
    script=True launches through scripts/mpirun_serve.sh (which execs the same mpirun line)
    with this venv as its SPECBUILD_VENV."""

    def __init__(self, bundle: str, log_path: str, *args: str, timeout: float = 60, script: bool = False) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")
        # a name no other process carries: every process of this launch has it on its command line
        self.tag = f"md-{os.getpid()}-{time.monotonic_ns()}"
        options = ["--host", "127.0.0.1", "--port", "0", "--threads", "1", "--max-batch-size", "4",
                   "--model-name", self.tag, *args]
        env = dict(os.environ)
        if script:
            cmd = ["bash", os.path.join(REPO, "scripts", "mpirun_serve.sh"), bundle, *options]
            env["SPECBUILD_VENV"] = os.path.dirname(os.path.dirname(sys.executable))
        else:
            cmd = [MPIRUN, "-disable-auto-cleanup", "-n", "2", *CLI, "serve", bundle, "--parallel-draft", *options]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     start_new_session=True, env=env)
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"on http://127\.0\.0\.1:(\d+)", self.output())):
            assert self.proc.poll() is None, f"mpirun exited with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"no URL in time:\n{self.output()}"
            time.sleep(0.05)
        self.port = int(m.group(1))
        self.pids = self.launch_pids()
        health = self.health()
        # the ranks (each under its guard) as /health and the log name them, checked against /proc
        self.rank_pids = {health["draft_rank"]["pid"]}
        self.rank_pids |= {int(p) for p in re.findall(r"draft rank ready \(pid (\d+)", self.output())}
        self.rank_pids.add(health["draft_rank"]["verifier_pid"])
        assert self.rank_pids <= self.pids, (self.rank_pids, self.pids)

    def launch_pids(self) -> set[int]:
        """Every live process whose command line carries this launch's tag (mpirun, its proxy,
        the guards and the ranks), besides this test process."""
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if self.tag.encode() in f.read() and live(int(entry)):
                        found.add(int(entry))
            except OSError:
                continue
        return found

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def health(self) -> dict:
        status, text = get(self.port, "/health")
        assert status == 200, text
        return json.loads(text)

    def stop(self) -> None:
        """Kill mpirun's process group (mpirun, its proxy, the guards), as a user's Ctrl-\\ or
        a CI timeout would, then require that no rank outlives it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()
        self.assert_no_process_left()

    def assert_no_process_left(self, timeout: float = 15.0) -> None:
        left = set(self.pids)
        deadline = time.monotonic() + timeout
        while left := {p for p in left if live(p)} | self.launch_pids():
            if time.monotonic() > deadline:
                for pid in left:  # do not leave them to the next run either
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                pytest.fail(f"processes outlived their launcher: {sorted(left)} (ranks {sorted(self.rank_pids)})")
            time.sleep(0.05)
