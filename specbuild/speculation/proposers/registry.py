"""The drafters an engine can serve: one line each (method name -> the module that builds it).

Each module defines `build(ctx: base.DrafterContext) -> Proposer | None` (None: the bundle
lacks what it needs, e.g. a draft role; raise base.Unavailable(reason) to refuse a
configuration with a reason a request is told). The order is `auto`'s preference among
equally rated drafters and the order of `Engine.methods`.

A module may also export, and this registry collects:
  `Options`    a frozen dataclass of its server-side settings (base.DrafterOptions; field
               metadata "help", and "choices" / "path" / "metavar" for the command line).
               Setting `field` of drafter `name` is named `<name>_<field>` everywhere it is
               set: EngineConfig(<name>_<field>=...) or EngineConfig.drafters[name], the
               Triton model parameter `<name>_<field>`, the CLI's `--<name>-<field>`
               (cli/options.DrafterCommand), and `specbuild inspect` lists it.
  `GUARANTEE`  its row of the torch guarantees table (engine/guarantees.py): (greedy,
               sampled, how it is verified); without one the generic verifier's row.
  `ROLE`       the bundle role it needs (inspect lists the method for bundles that have it).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

from specbuild.speculation.proposers.base import DrafterContext, NoOptions, Unavailable, option_fields

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


def module(name: str):
    """The module of drafter `name` (imported on first use)."""
    if name not in DRAFTERS:
        raise KeyError(f"no drafter {name!r} is registered (registered: {', '.join(DRAFTERS)})")
    return importlib.import_module(DRAFTERS[name])


def options_class(name: str) -> type:
    """Drafter `name`'s Options dataclass (NoOptions when its module declares no settings)."""
    return getattr(module(name), "Options", NoOptions)


def guarantee_row(name: str) -> tuple[str, str, str] | None:
    """Drafter `name`'s row of the torch guarantees table, or None (the generic row)."""
    return getattr(module(name), "GUARANTEE", None)


def role(name: str) -> str | None:
    """The bundle role drafter `name` needs, or None (it needs none)."""
    return getattr(module(name), "ROLE", None)


def settings() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every registered drafter's settings: `<name>_<field>` -> (name, its Options field)."""
    out: dict[str, tuple[str, dataclasses.Field]] = {}
    for name in DRAFTERS:
        for f in option_fields(options_class(name)):
            out[f"{name}_{f.name}"] = (name, f)
    return out


def make_options(given: Mapping[str, Any] | None = None, flat: Mapping[str, Any] | None = None,
                 what: str = "EngineConfig") -> dict[str, Any]:
    """Drafter name -> its Options, from `given` (name -> an Options or a dict of its fields) and
    `flat` settings named `<name>_<field>`; only the drafters named in either (the others take
    their Options' defaults: options_for). The Options check their own values (ValueError)."""
    out: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {}
    if flat:
        table = settings()
        for key, value in flat.items():
            if key not in table:
                raise TypeError(f"{what} got an unexpected keyword argument {key!r}")
            name, f = table[key]
            per.setdefault(name, {})[f.name] = value
    for name in dict.fromkeys([*(given or {}), *per]):
        cls = options_class(name)
        base = (given or {}).get(name)
        if base is None or isinstance(base, Mapping):
            out[name] = cls(**{**dict(base or {}), **per.get(name, {})})
        elif isinstance(base, cls):
            out[name] = dataclasses.replace(base, **per[name]) if per.get(name) else base
        else:
            raise TypeError(f"{what}.drafters[{name!r}] must be {cls.__name__} or a dict of its fields, "
                            f"not {type(base).__name__}")
    return out


def options_for(options: Mapping[str, Any], name: str) -> Any:
    """Drafter `name`'s Options in `options` (make_options), else its defaults."""
    got = options.get(name)
    return got if got is not None else options_class(name)()


def flat_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """`<name>_<field>` -> value for the drafters in `options` (the inverse of make_options)."""
    return {f"{name}_{f.name}": getattr(opts, f.name) for name, opts in options.items()
            for f in option_fields(type(opts))}


def accepts_flat_settings(defaults: bool):
    """A class decorator for a frozen dataclass with a `drafters` field (EngineConfig, RepoConfig):
    it also takes each drafter setting flat, `<name>_<field>=value` beside its own fields, and
    reads it back the same way (config.suffix_store_tokens). defaults: a drafter not in
    `drafters` reads as its Options' defaults (else None: not given)."""
    def wrap(cls):
        init, own = cls.__init__, cls.__dataclass_fields__

        def __init__(self, *args, drafters: Mapping[str, Any] | None = None, **kwargs) -> None:
            flat = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
            if flat:
                table = settings()
                drafters = dict(drafters or {})
                for key, value in flat.items():
                    if key not in table:
                        raise TypeError(f"{cls.__name__} got an unexpected keyword argument {key!r}")
                    name, f = table[key]
                    got = drafters.get(name)
                    drafters[name] = {**dict(got or {}), f.name: value} if got is None or isinstance(got, Mapping) \
                        else dataclasses.replace(got, **{f.name: value})
            init(self, *args, drafters={} if drafters is None else drafters, **kwargs)

        def __getattr__(self, key: str) -> Any:
            if key.startswith("__") or key == "drafters":
                raise AttributeError(key)
            found = settings().get(key)
            if found is None:
                raise AttributeError(f"{cls.__name__!r} object has no attribute {key!r}")
            name, f = found
            got = self.drafters.get(name)
            if isinstance(got, Mapping):
                return got.get(f.name)
            if got is None:
                return getattr(options_class(name)(), f.name) if defaults else None
            return getattr(got, f.name)

        cls.__init__, cls.__getattr__ = __init__, __getattr__
        return cls
    return wrap


def describe_settings() -> dict[str, dict[str, Any]]:
    """`<name>_<field>` -> {"default", "help"} of every registered drafter's settings (inspect)."""
    out = {}
    for key, (_, f) in settings().items():
        default = f.default if f.default is not dataclasses.MISSING else None
        out[key] = {"default": default, "help": str(f.metadata.get("help", ""))}
    return out


def build_all(ctx: DrafterContext, given: dict | None = None,
              options: Mapping[str, Any] | None = None) -> tuple[dict, dict[str, str]]:
    """(name -> proposer, name -> why it is unavailable). `given` drafters (MineDraft's remote
    drafter) take their names' places and are not built; `options`: name -> its Options
    (EngineConfig.drafters; the others build with their defaults), handed over as ctx.options."""
    given = dict(given or {})
    built, unavailable = ctx.built, {}
    for name in DRAFTERS:
        if name in given:
            built[name] = given.pop(name)
            continue
        try:
            ctx.options = options_for(options or {}, name)
            prop = module(name).build(ctx)
        except Unavailable as why:
            unavailable[name] = str(why)
            continue
        if prop is not None:
            built[name] = prop
    built.update(given)
    return built, unavailable
