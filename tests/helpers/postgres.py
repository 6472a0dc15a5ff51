"""A throwaway PostgreSQL server for tests, from Debian's packages (initdb + pg_ctl): its data
directory and unix socket in a temp dir, no TCP port, run as an unprivileged user (root: the
`postgres` account, via runuser; PostgreSQL refuses to run as root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile


def pg_bin() -> str | None:
    """The directory holding initdb and pg_ctl, or None."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(found))
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.isfile(os.path.join(d, "initdb")) and os.path.isfile(os.path.join(d, "pg_ctl")):
            return d
    return None


def unavailable_reason() -> str | None:
    if pg_bin() is None:
        return "PostgreSQL server binaries (initdb, pg_ctl) are not installed (scripts/setup.sh installs them)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install 'psycopg[binary]')"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no unprivileged 'postgres' user to run the server"
    return None


class TempPostgres:
    def __init__(self) -> None:
        self.bin = pg_bin()
        self.dir = tempfile.mkdtemp(prefix="specbuild-pg-")
        self.data = os.path.join(self.dir, "data")
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
        self.port = 5432

    def _run(self, *args: str) -> None:
        subprocess.run(self.prefix + list(args), check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       timeout=120, cwd=self.dir)

    def start(self) -> str:
        self._run(os.path.join(self.bin, "initdb"), "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync")
        opts = f"-k {self.dir} -c listen_addresses='' -p {self.port} -c fsync=off"
        self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-o", opts, "-l",
                  os.path.join(self.dir, "log"), "-w", "-t", "60", "start")
        return self.dsn

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.dir}&port={self.port}"

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bin, "pg_ctl"), "-D", self.data, "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
