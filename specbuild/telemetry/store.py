"""The telemetry database: SQLite (a file path, WAL mode) or PostgreSQL (a postgresql:// DSN,
through psycopg 3), the same schema in both, migrated on open.

A Store is one connection: use one per thread (the writer opens its own). SQL is written
with `?` placeholders and translated for psycopg (`%s`, and `%` doubled); no statement holds a literal `?`.
"""

from __future__ import annotations

import os
import sqlite3
import time

from specbuild.errors import SpecbuildError
from specbuild.speculation.policy import ANY, GammaPolicy
from specbuild.telemetry.schema import POLICY_COLUMNS, SCHEMA_VERSION, statements


class TelemetryError(SpecbuildError):
    """The store cannot be opened, migrated or written."""


def is_dsn(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def describe(target: str) -> str:
    """The target without a password (for messages and logs)."""
    if is_dsn(target) and "@" in target:
        scheme, rest = target.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return target


class Store:
    def __init__(self, target: str, migrate: bool = True, timeout: float = 10.0) -> None:
        self.target = target
        if is_dsn(target):
            try:
                import psycopg
            except ImportError as e:  # pragma: no cover - psycopg is a dependency
                raise TelemetryError("a postgresql:// telemetry store needs psycopg 3 (pip install 'psycopg[binary]')") from e
            try:
                self.conn = psycopg.connect(target, connect_timeout=int(max(timeout, 1)))
            except psycopg.Error as e:
                raise TelemetryError(f"cannot connect to the telemetry store {describe(target)}: {e}") from e
            self.dialect = "postgresql"
            self.errors: tuple[type[BaseException], ...] = (psycopg.Error,)
        else:
            parent = os.path.dirname(os.path.abspath(target))
            if not os.path.isdir(parent):
                raise TelemetryError(f"telemetry store {target!r}: directory {parent!r} does not exist")
            try:
                self.conn = sqlite3.connect(target, timeout=timeout, check_same_thread=False, isolation_level=None)
                self.conn.execute("PRAGMA journal_mode=WAL")
                # WAL + NORMAL: a committed batch survives a crash of the process (not necessarily of the OS)
                self.conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as e:
                raise TelemetryError(f"cannot open the telemetry store {target!r}: {e}") from e
            self.dialect = "sqlite"
            self.errors = (sqlite3.Error,)
        if migrate:
            self.migrate()

    # ---- plumbing -----------------------------------------------------------------------------
    def _sql(self, sql: str) -> str:
        return sql.replace("%", "%%").replace("?", "%s") if self.dialect == "postgresql" else sql

    def begin(self) -> None:
        if self.dialect == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.conn.commit() if self.dialect == "postgresql" else self.conn.execute("COMMIT")

    def rollback(self) -> None:
        try:
            self.conn.rollback() if self.dialect == "postgresql" else self.conn.execute("ROLLBACK")
        except self.errors:
            pass

    def execute(self, sql: str, params=()) -> None:
        cur = self.conn.cursor()
        cur.execute(self._sql(sql), tuple(params))
        cur.close()

    def executemany(self, sql: str, rows) -> None:
        cur = self.conn.cursor()
        cur.executemany(self._sql(sql), [tuple(r) for r in rows])
        cur.close()

    def query(self, sql: str, params=()) -> list[tuple]:
        cur = self.conn.cursor()
        cur.execute(self._sql(sql), tuple(params))
        rows = cur.fetchall()
        cur.close()
        if self.dialect == "postgresql":
            self.conn.commit()  # end the implicit read transaction
        return [tuple(r) for r in rows]

    def close(self) -> None:
        try:
            self.conn.close()
        except self.errors:
            pass

    # ---- schema -------------------------------------------------------------------------------
    def version(self) -> int:
        rows = self.query("SELECT MAX(version) FROM schema_version") if self._has_version_table() else [(None,)]
        return int(rows[0][0] or 0)

    def _has_version_table(self) -> bool:
        if self.dialect == "sqlite":
            return bool(self.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"))
        return bool(self.query("SELECT 1 FROM information_schema.tables WHERE table_name = 'schema_version' "
                               "AND table_schema = current_schema()"))

    def migrate(self, upto: int = SCHEMA_VERSION) -> int:
        """Apply the migrations this database lacks (each in its own transaction; concurrent
        openers serialise on a lock). Returns the version afterwards."""
        try:
            self.begin()
            if self.dialect == "postgresql":
                self.execute("SELECT pg_advisory_xact_lock(5318008)")
            self.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, "
                         "applied_at DOUBLE PRECISION NOT NULL)")
            cur = self.conn.cursor()
            cur.execute("SELECT MAX(version) FROM schema_version")
            have = int(cur.fetchone()[0] or 0)
            cur.close()
            if have > SCHEMA_VERSION:
                raise TelemetryError(f"telemetry store {describe(self.target)} has schema version {have}, newer than "
                                     f"this specbuild supports ({SCHEMA_VERSION}); upgrade specbuild")
            for v in range(have + 1, upto + 1):
                for sql in statements(v, self.dialect):
                    self.execute(sql)
                self.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (v, time.time()))
            self.commit()
            return max(have, upto)
        except self.errors as e:
            self.rollback()
            raise TelemetryError(f"cannot migrate the telemetry store {describe(self.target)}: {e}") from e
        except BaseException:
            self.rollback()
            raise

    # ---- gamma policies -----------------------------------------------------------------------
    def policies(self, model_id: str | None = None) -> list[GammaPolicy]:
        """Stored policies (of `model_id` and of every model '*', when given)."""
        cols = ", ".join(POLICY_COLUMNS[:-1])
        if model_id is None:
            rows = self.query(f"SELECT {cols} FROM gamma_policy ORDER BY model_id, content_type, method")
        else:
            rows = self.query(f"SELECT {cols} FROM gamma_policy WHERE model_id IN (?, ?) "
                              "ORDER BY model_id, content_type, method", (model_id, ANY))
        return [GammaPolicy(**dict(zip(POLICY_COLUMNS[:-1], r))) for r in rows]

    def set_policy(self, p: GammaPolicy) -> None:
        """Insert or replace the policy of (model_id, content_type, method)."""
        cols = ", ".join(POLICY_COLUMNS)
        marks = ", ".join("?" for _ in POLICY_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in POLICY_COLUMNS[3:])
        values = [getattr(p, c) for c in POLICY_COLUMNS[:-1]] + [time.time()]
        try:
            self.begin()
            self.execute(f"INSERT INTO gamma_policy ({cols}) VALUES ({marks}) "
                         f"ON CONFLICT (model_id, content_type, method) DO UPDATE SET {updates}", values)
            self.commit()
        except self.errors as e:
            self.rollback()
            raise TelemetryError(f"cannot store the policy: {e}") from e

    def delete_policy(self, model_id: str, content_type: str, method: str) -> int:
        n = len(self.query("SELECT policy_id FROM gamma_policy WHERE model_id = ? AND content_type = ? AND method = ?",
                           (model_id, content_type, method)))
        self.begin()
        self.execute("DELETE FROM gamma_policy WHERE model_id = ? AND content_type = ? AND method = ?",
                     (model_id, content_type, method))
        self.commit()
        return n
