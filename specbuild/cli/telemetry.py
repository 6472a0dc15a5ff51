"""`specbuild telemetry DB` (the report) and `specbuild telemetry policy set|list|learn DB`.

DB is a SQLite file or a postgresql:// DSN; `serve`, `generate` and `bench` write it with
`--telemetry DB`.
"""

from __future__ import annotations

import json
import time

import click

from specbuild.cli.main import user_errors
from specbuild.cli.options import content_type_option, shared, telemetry_option

__all__ = ["telemetry", "open_telemetry", "telemetry_option", "content_type_option"]  # the options: options.py


class ReportGroup(click.Group):
    """`telemetry DB ...` means `telemetry report DB ...`; `telemetry policy ...` stays a subgroup."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["report", *args]
        return super().parse_args(ctx, args)


def open_telemetry(engine, target: str | None, source: str, run_id: str | None = None):
    """attach() for a command line: None without --telemetry; errors as one line (exit 2)."""
    if not target:
        return None
    from specbuild.telemetry import attach

    return attach(engine, target, source=source, run_id=run_id)


@click.group(cls=ReportGroup)
def telemetry() -> None:
    """Report on recorded speculation telemetry; manage gamma policies."""


def model_option(default: str | None, help: str):
    """--model: which model's telemetry (a filter, or '*' in a policy key)."""
    return click.option("--model", default=default, show_default=default is not None, help=help)


def policy_bounds(fn):
    """--gamma-min/--gamma-max of a policy: the depths its sequences' controller may choose."""
    fn = shared("--gamma-max", default=8, show_default=True, help="Most draft tokens the policy allows.")(fn)
    return shared("--gamma-min", default=0, show_default=True, help="Fewest draft tokens (0 allows plain).")(fn)


@telemetry.command("report")
@click.argument("db")
@shared("--json", help="Print the report as JSON.")
@shared("--plot")
@model_option(None, "Only this model id.")
@click.option("--source", default=None, help="Only rows from generate, serve, bench or triton.")
@click.option("--run-id", default=None, help="Only this bench run.")
@click.option("--since-hours", type=float, default=None, help="Only steps of the last H hours.")
@click.option("--session", default=None, help="Session to draw gamma for [default: the longest].")
@user_errors
def report_cmd(db, as_json, plot, model, source, run_id, since_hours, session) -> None:
    """Acceptance and tokens per pass by method, content type, prompt length, position and hour."""
    from specbuild.telemetry.report import as_json as dump, format_report, report
    from specbuild.telemetry.store import Store

    store = Store(db)
    try:
        rep = report(store, model=model, source=source, run_id=run_id,
                     since=None if since_hours is None else time.time() - since_hours * 3600)
        if plot:
            from specbuild.telemetry.plot import plot_report, session_steps

            plot_report(rep, session_steps(store, session), plot)
    finally:
        store.close()
    click.echo(dump(rep) if as_json else format_report(rep))
    if plot and not as_json:
        click.echo(f"plot: {plot}")


@telemetry.group("policy")
def policy() -> None:
    """Gamma policies per model, content type and method."""


def policy_json(p) -> dict:
    import dataclasses

    return dataclasses.asdict(p)


@policy.command("list")
@click.argument("db")
@shared("--json")
@user_errors
def policy_list(db, as_json) -> None:
    """The stored policies."""
    from specbuild.telemetry.store import Store

    store = Store(db)
    try:
        rows = store.policies()
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps([policy_json(p) for p in rows], indent=2))
        return
    click.echo(f"{'model':<20} {'content type':<14} {'method':<8} min max default threshold prior  source")
    for p in rows:
        click.echo(f"{p.model_id:<20} {p.content_type:<14} {p.method:<8} {p.gamma_min:>3} {p.gamma_max:>3} "
                   f"{p.gamma_default:>7} {p.alpha_threshold:>9.3f} {p.prior_alpha:>5.3f}  {p.source}"
                   + (f" ({p.n_steps} steps)" if p.n_steps else ""))


@policy.command("set")
@click.argument("db")
@shared("--content-type", default="*", show_default=True, help="Content type ('*': every type).")
@model_option("*", "Model id ('*': every model).")
@click.option("--method", default="*", show_default=True, help="Drafter ('*': every method).")
@policy_bounds
@click.option("--gamma-default", type=int, default=4, show_default=True, help="First draft length of a sequence.")
@click.option("--alpha-threshold", type=float, default=0.3, show_default=True,
              help="Acceptance below which speculation is switched off (after --collapse-steps steps).")
@click.option("--prior-alpha", type=float, default=0.6, show_default=True, help="Acceptance the controller starts from.")
@click.option("--collapse-steps", type=int, default=10, show_default=True)
@click.option("--delete", is_flag=True, help="Remove the policy of (model, content type, method) instead.")
@user_errors
def policy_set(db, content_type, model, method, gamma_min, gamma_max, gamma_default, alpha_threshold, prior_alpha,
               collapse_steps, delete) -> None:
    """Create, replace or delete one policy."""
    from specbuild.speculation.config import METHODS
    from specbuild.speculation.policy import ANY, GammaPolicy, check_content_type
    from specbuild.telemetry.store import Store

    if content_type != ANY:
        check_content_type(content_type)
    if method != ANY and method not in METHODS:
        raise ValueError(f"method {method!r} is not one of *, {', '.join(METHODS)}")
    if not model or len(model) > 64:
        raise ValueError(f"model id {model[:70]!r} must have 1 to 64 characters")
    store = Store(db)
    try:
        if delete:
            n = store.delete_policy(model, content_type, method)
            click.echo(f"deleted {n} policy for {model}/{content_type}/{method}")
            return
        p = GammaPolicy(model_id=model, content_type=content_type, method=method, gamma_min=gamma_min,
                        gamma_max=gamma_max, gamma_default=gamma_default, alpha_threshold=alpha_threshold,
                        prior_alpha=prior_alpha, collapse_steps=collapse_steps, source="set")
        store.set_policy(p)
    finally:
        store.close()
    click.echo(f"policy {model}/{content_type}/{method}: gamma {gamma_min}..{gamma_max} from {gamma_default}, "
               f"alpha_threshold {alpha_threshold}, prior_alpha {prior_alpha}")


@policy.command("learn")
@click.argument("db")
@model_option(None, "Only this model id [default: every model in the store].")
@policy_bounds
@click.option("--min-steps", type=int, default=32, show_default=True,
              help="Fewest speculating steps a (model, content type, method) needs to be fitted.")
@click.option("--dry-run", is_flag=True, help="Print the fitted policies without storing them.")
@shared("--json")
@user_errors
def policy_learn(db, model, gamma_min, gamma_max, min_steps, dry_run, as_json) -> None:
    """Fit gamma_default, alpha_threshold and prior_alpha per content type from recorded steps."""
    from specbuild.telemetry.learn import learn
    from specbuild.telemetry.store import Store

    if not 0 <= gamma_min <= gamma_max <= 16:
        raise ValueError(f"need 0 <= gamma_min ({gamma_min}) <= gamma_max ({gamma_max}) <= 16")
    store = Store(db)
    try:
        fitted, skipped = learn(store, model=model, gamma_min=gamma_min, gamma_max=gamma_max, min_steps=min_steps)
        if not dry_run:
            for p in fitted:
                store.set_policy(p)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"policies": [policy_json(p) for p in fitted], "skipped": skipped,
                               "stored": not dry_run}, indent=2))
        return
    for p in fitted:
        click.echo(f"{p.model_id}/{p.content_type}/{p.method}: gamma_default {p.gamma_default}, alpha_threshold "
                   f"{p.alpha_threshold}, prior_alpha {p.prior_alpha} ({p.n_steps} steps)")
    for line in skipped:
        click.echo(f"skipped {line}")
    if not fitted:
        click.echo("no policy fitted")
    elif not dry_run:
        click.echo(f"stored {len(fitted)} policies")
