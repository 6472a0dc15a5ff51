"""Speculation telemetry: the store (sessions, steps, gamma policies, events), its writer,
the report, the policy learner and the plots. Fed by the engine through engine/events.py;
the engine never imports this package.

    sink = attach(engine, "telemetry.db", source="serve")   # or a postgresql:// DSN
    ...
    sink.close()
"""

from __future__ import annotations


def attach(engine, target: str, source: str = "generate", run_id: str | None = None, policies: bool = True,
           **sink_options):
    """Record `engine`'s sessions into `target` and start its sequences from the stored gamma
    policies (of engine.model_id and '*'). Returns the TelemetrySink (close() it at the end).
    Raises TelemetryError for a store that cannot be opened; ValueError for a backend that
    does not report telemetry."""
    from specbuild.speculation.policy import PolicyTable
    from specbuild.telemetry.store import Store
    from specbuild.telemetry.writer import TelemetrySink

    if not hasattr(engine, "set_sink"):
        raise ValueError(f"the {type(engine).__name__} backend does not report speculation telemetry "
                         "(the torch backend does)")
    sink = TelemetrySink(target, engine.model_id, source=source, run_id=run_id, **sink_options)
    if policies:
        store = Store(target)  # the writer's connection is its thread's
        try:
            table = PolicyTable(store.policies(engine.model_id), engine.model_id)
        finally:
            store.close()
        engine.set_policies(table if len(table) else None)
    engine.set_sink(sink)
    return sink
