"""The torch backend: specbuild's own `Engine` (engine/engine.py) named as a backend."""

from __future__ import annotations

from specbuild.backends.guarantees import guarantees
from specbuild.engine.engine import Engine


class TorchEngine(Engine):
    """The torch `Engine`, unchanged, named as a backend and able to describe its guarantees."""

    backend_name = "torch"

    def describe_guarantees(self) -> dict:
        return guarantees("torch", methods=self.methods)
