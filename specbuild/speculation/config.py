"""SpeculationConfig: one speculation setting, with the same names everywhere.

The names are the CLI flags (`--speculation`, `--gamma`, `--gamma-min`, `--gamma-max`,
`--tree`), the HTTP body fields and the Triton inputs. A bundle records its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specbuild.errors import RequestError

from specbuild.speculation.proposers import registry

# the registry's drafters, plus none, auto and eagle3 (the TensorRT-LLM LLM-API path); a drafter
# registered later (registry.register) is accepted too: see known_methods
METHODS = ("none", *registry.names(), "auto", "eagle3")


def known_methods() -> tuple[str, ...]:
    return ("none", *registry.names(), "auto", "eagle3")
GAMMA_LIMIT = 16


@dataclass(frozen=True)
class SpeculationConfig:
    """How a request speculates.

    method   none | ngram (prompt lookup) | draft (draft model) | medusa (heads + tree) |
             recycle (token recycling: a tree from the target's earlier top-k, no model) |
             eagle (EAGLE-3 head on the target's features, dynamic tree) |
             suffix (suffix decoding: a tree of the most frequent continuations of the text's longest
             match in the request and in earlier requests, no model) |
             hybrid (one tree merging suffix's and recycling's candidates) | auto
    gamma    starting draft length; with gamma_min == gamma_max it is fixed
    gamma_min, gamma_max   bounds for the per-sequence controller (0 allows plain decoding)
    tree     Medusa / recycling token tree: a preset name or inline paths (tuple of rank tuples), never a
             file (the CLI reads a --tree file into paths: tree.tree_argument); None: the bundle's
    ngram_min, ngram_max   n-gram sizes that prompt lookup matches (longest first)
    typical  Medusa typical acceptance: LOSSY (output no longer the target's distribution)
    """

    method: str = "none"
    gamma: int = 4
    gamma_min: int = 0
    gamma_max: int = 8
    tree: str | tuple[tuple[int, ...], ...] | None = None
    ngram_min: int = 1
    ngram_max: int = 3
    typical: bool = False

    def __post_init__(self) -> None:
        if self.method not in known_methods():
            raise RequestError(f"speculation method {self.method!r} is not one of {', '.join(known_methods())}")
        for name in ("gamma", "gamma_min", "gamma_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= GAMMA_LIMIT:
                raise RequestError(f"{name}={v!r} is out of range [0, {GAMMA_LIMIT}]")
        if not self.gamma_min <= self.gamma_max:
            raise RequestError(f"gamma_min={self.gamma_min} is greater than gamma_max={self.gamma_max}")
        if not self.gamma_min <= self.gamma <= self.gamma_max:
            raise RequestError(f"gamma={self.gamma} is outside [gamma_min={self.gamma_min}, "
                               f"gamma_max={self.gamma_max}]")
        if not 1 <= self.ngram_min <= self.ngram_max <= 8:
            raise RequestError(f"ngram sizes [{self.ngram_min}, {self.ngram_max}] must satisfy "
                               "1 <= ngram_min <= ngram_max <= 8")
        if isinstance(self.tree, (list, tuple)):  # inline paths: hashable tuples (JSON gives lists)
            try:
                object.__setattr__(self, "tree", tuple(tuple(int(r) for r in p) for p in self.tree))
            except (TypeError, ValueError):
                raise RequestError(f"tree={self.tree!r:.80} must be a preset name or a list of lists of ranks") from None
        elif self.tree is not None and not isinstance(self.tree, str):
            raise RequestError(f"tree={self.tree!r:.80} must be a preset name or a list of lists of ranks")
        if self.typical and self.method != "medusa":
            raise RequestError("typical acceptance (lossy) applies only to method 'medusa'")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def dynamic(self) -> bool:
        return self.gamma_min != self.gamma_max

    @classmethod
    def for_request(cls, spec: "SpeculationConfig | dict | None", default: "SpeculationConfig") -> "SpeculationConfig":
        """A request's setting: the default when absent, a dict's fields over the default."""
        if spec is None:
            return default
        return cls.make(default, **spec) if isinstance(spec, dict) else spec

    @classmethod
    def make(cls, base: "SpeculationConfig | None" = None, **fields: Any) -> "SpeculationConfig":
        """Overlay the given (non-None) fields on `base`.

        A `gamma` given without bounds fixes the depth (gamma_min = gamma_max = gamma), which
        is what `--gamma 4` means on the command line; give bounds to keep it dynamic.
        """
        base = base or cls()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise RequestError(f"unknown speculation field(s) {sorted(unknown)}; known: {sorted(known)}")
        fields = {k: v for k, v in fields.items() if v is not None}
        if "gamma" in fields and "gamma_min" not in fields and "gamma_max" not in fields:
            fields["gamma_min"] = fields["gamma_max"] = fields["gamma"]
        elif "gamma" not in fields and ("gamma_min" in fields or "gamma_max" in fields):
            lo = fields.get("gamma_min", base.gamma_min)
            hi = fields.get("gamma_max", base.gamma_max)
            fields["gamma"] = min(max(base.gamma, lo), hi)
        return dataclasses.replace(base, **fields)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
