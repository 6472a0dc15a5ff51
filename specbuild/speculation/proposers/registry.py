"""The drafters an engine can serve: one line each (method name -> the module that builds it).

Each module defines `build(ctx: base.DrafterContext) -> Proposer | None` (None: the bundle
lacks what it needs, e.g. a draft role; raise base.Unavailable(reason) to refuse a
configuration with a reason a request is told). The order is `auto`'s preference among
equally rated drafters and the order of `Engine.methods`.
"""

from __future__ import annotations

import importlib

from specbuild.speculation.proposers.base import DrafterContext, Unavailable

_PKG = "specbuild.speculation.proposers."

DRAFTERS: dict[str, str] = {
    # suffix first: its matches include prompt lookup's (the request's own text) plus earlier requests'
    "suffix": _PKG + "suffix",
    "ngram": _PKG + "ngram",
    "recycle": _PKG + "recycling",
    "draft": _PKG + "draft_model",
    "medusa": _PKG + "medusa",
    "eagle": _PKG + "eagle",
    "hybrid": _PKG + "hybrid",  # after the drafters it merges
}


def register(name: str, module: str) -> None:
    """Add (or replace) a drafter: `module` defines build(ctx)."""
    if not name.isidentifier() or name in ("none", "auto"):
        raise ValueError(f"drafter name {name!r} must be an identifier other than none and auto")
    DRAFTERS[name] = module


def unregister(name: str) -> None:
    DRAFTERS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(DRAFTERS)


def build_all(ctx: DrafterContext, given: dict | None = None) -> tuple[dict, dict[str, str]]:
    """(name -> proposer, name -> why it is unavailable). `given` drafters (MineDraft's remote
    drafter) take their names' places and are not built."""
    given = dict(given or {})
    built, unavailable = ctx.built, {}
    for name, module in DRAFTERS.items():
        if name in given:
            built[name] = given.pop(name)
            continue
        try:
            prop = importlib.import_module(module).build(ctx)
        except Unavailable as why:
            unavailable[name] = str(why)
            continue
        if prop is not None:
            built[name] = prop
    built.update(given)
    return built, unavailable
