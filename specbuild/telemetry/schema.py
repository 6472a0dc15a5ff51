"""The telemetry schema, as numbered migrations that run in order (schema_version records
the last one applied). Written once for SQLite and PostgreSQL: `{id}` becomes each one's
auto-increment key, DOUBLE PRECISION is REAL in SQLite. Times are Unix seconds (UTC).

Adapted from the design article's data model:
- speculation_sessions: one row per speculating sequence; the article's columns, plus the
  method, tree, content type (and whether the request named it or the classifier chose it),
  where it ran (source: generate / serve / bench / triton, run_id) and finish reason. The
  GPU pointers draft_kv_ptr / target_kv_ptr are left out: a paged cache has no one address.
- speculation_steps: one row per decode pass (method, tree and gamma beside the counts;
  fallback = the sequence asked to speculate but this pass ran plain).
- gamma_policy: per model, content type and method ('*' = any; not NULL, so that UNIQUE and
  upserts behave the same in both databases), with the learned prior_alpha and the number
  of recorded steps a learned row came from.
- speculation_events (migration 2): failure-mode signals with a JSON detail.
- speculation_steps.candidate_sources (migration 3): each candidate's drafter source, by position.
No foreign keys: the writer drops rows independently under load, so a step may outlive its
session row; reports join where they can.
"""

from __future__ import annotations

MIGRATIONS: list[list[str]] = [
    [  # 1: the article's three tables
        """CREATE TABLE speculation_sessions (
            session_id          TEXT PRIMARY KEY,
            request_id          TEXT,
            created_at          DOUBLE PRECISION NOT NULL,
            finished_at         DOUBLE PRECISION,
            model_id            TEXT NOT NULL,
            method              TEXT,
            tree                TEXT,
            content_type        TEXT,
            content_type_source TEXT,
            source              TEXT,
            run_id              TEXT,
            prompt_token_count  INTEGER NOT NULL,
            generated_tokens    INTEGER NOT NULL DEFAULT 0,
            current_gamma       INTEGER NOT NULL DEFAULT 0,
            rolling_accept_sum  INTEGER NOT NULL DEFAULT 0,
            rolling_accept_n    INTEGER NOT NULL DEFAULT 0,
            total_drafted       INTEGER NOT NULL DEFAULT 0,
            total_accepted      INTEGER NOT NULL DEFAULT 0,
            total_rejected      INTEGER NOT NULL DEFAULT 0,
            total_target_passes INTEGER NOT NULL DEFAULT 0,
            verify_passes       INTEGER NOT NULL DEFAULT 0,
            kv_valid_len        INTEGER NOT NULL DEFAULT 0,
            last_ttft_ms        DOUBLE PRECISION,
            last_tpot_ms        DOUBLE PRECISION,
            status              TEXT NOT NULL DEFAULT 'active',
            finish_reason       TEXT
        )""",
        """CREATE TABLE speculation_steps (
            step_id             {id},
            session_id          TEXT NOT NULL,
            step_num            INTEGER NOT NULL,
            method              TEXT,
            tree                TEXT,
            gamma_used          INTEGER NOT NULL,
            n_drafted           INTEGER NOT NULL,
            n_accepted          INTEGER NOT NULL,
            n_rejected          INTEGER NOT NULL,
            n_emitted           INTEGER NOT NULL,
            depth               INTEGER NOT NULL,
            fallback            INTEGER NOT NULL,
            draft_latency_ms    DOUBLE PRECISION NOT NULL,
            target_latency_ms   DOUBLE PRECISION NOT NULL,
            effective_tpot_ms   DOUBLE PRECISION NOT NULL,
            batch_size          INTEGER NOT NULL,
            recorded_at         DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE gamma_policy (
            policy_id           {id},
            model_id            TEXT NOT NULL,
            content_type        TEXT NOT NULL,
            method              TEXT NOT NULL,
            gamma_min           INTEGER NOT NULL DEFAULT 0,
            gamma_max           INTEGER NOT NULL DEFAULT 8,
            gamma_default       INTEGER NOT NULL DEFAULT 4,
            alpha_threshold     DOUBLE PRECISION NOT NULL DEFAULT 0.3,
            prior_alpha         DOUBLE PRECISION NOT NULL DEFAULT 0.6,
            collapse_steps      INTEGER NOT NULL DEFAULT 10,
            source              TEXT NOT NULL DEFAULT 'set',
            n_steps             INTEGER NOT NULL DEFAULT 0,
            updated_at          DOUBLE PRECISION NOT NULL,
            UNIQUE (model_id, content_type, method)
        )""",
    ],
    [  # 2: failure-mode events, and the indexes the report's joins and time filters use
        """CREATE TABLE speculation_events (
            event_id            {id},
            session_id          TEXT,
            kind                TEXT NOT NULL,
            step_num            INTEGER,
            detail              TEXT NOT NULL,
            recorded_at         DOUBLE PRECISION NOT NULL
        )""",
        "CREATE INDEX speculation_steps_session ON speculation_steps (session_id)",
        "CREATE INDEX speculation_sessions_created ON speculation_sessions (created_at)",
        "CREATE INDEX speculation_events_kind ON speculation_events (kind)",
    ],
    [  # 3: where each step's candidates came from (a JSON object; see STEP_SOURCES)
        "ALTER TABLE speculation_steps ADD COLUMN candidate_sources TEXT",
    ],
]

SCHEMA_VERSION = len(MIGRATIONS)

SESSION_COLUMNS = ("session_id", "request_id", "created_at", "finished_at", "model_id", "method", "tree",
                   "content_type", "content_type_source", "source", "run_id", "prompt_token_count",
                   "generated_tokens", "current_gamma", "rolling_accept_sum", "rolling_accept_n", "total_drafted",
                   "total_accepted", "total_rejected", "total_target_passes", "verify_passes", "kv_valid_len",
                   "last_ttft_ms", "last_tpot_ms", "status", "finish_reason")
STEP_COLUMNS = ("session_id", "step_num", "method", "tree", "gamma_used", "n_drafted", "n_accepted", "n_rejected",
                "n_emitted", "depth", "fallback", "draft_latency_ms", "target_latency_ms", "effective_tpot_ms",
                "batch_size", "recorded_at", "candidate_sources")
# candidate_sources: {source: [[offered, accepted] at position 1, 2, ...]} of a drafting step; a
# source is a drafter's name or its part (suffix:local / suffix:global / suffix:both: the
# request's own text, earlier requests, both; recycle:lookup / recycle:table). A tree offers
# its nodes at their depth, a chain its tokens; NULL for plain steps and older rows.
EVENT_COLUMNS = ("session_id", "kind", "step_num", "detail", "recorded_at")
POLICY_COLUMNS = ("model_id", "content_type", "method", "gamma_min", "gamma_max", "gamma_default", "alpha_threshold",
                  "prior_alpha", "collapse_steps", "source", "n_steps", "updated_at")


def statements(version: int, dialect: str) -> list[str]:
    """Migration `version` (1-based) for 'sqlite' or 'postgresql'."""
    key = "INTEGER PRIMARY KEY AUTOINCREMENT" if dialect == "sqlite" else "BIGSERIAL PRIMARY KEY"
    return [sql.replace("{id}", key) for sql in MIGRATIONS[version - 1]]
