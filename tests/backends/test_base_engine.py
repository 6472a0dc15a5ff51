"""Both backends are subclasses of one BaseEngine (engine/base.py): the request queue, the
background loop, the text helpers and the load figures are written once. No backend copies
another's methods onto itself or fakes the torch engine's scheduler."""

from __future__ import annotations

import inspect

from specbuild.backends.tensorrt_llm import TrtllmEngine
from specbuild.engine.base import BaseEngine
from specbuild.engine.engine import Engine
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams

SHARED = ("encode", "render_chat", "submit", "stats", "has_work", "run_until_done", "generate", "start", "_loop",
          "stop", "_init_loop")


def test_both_backends_subclass_one_base():
    assert issubclass(Engine, BaseEngine) and issubclass(TrtllmEngine, BaseEngine)
    for cls in (Engine, TrtllmEngine):
        for name in SHARED:  # the base's own code, not a copy or an override
            assert getattr(cls, name) is getattr(BaseEngine, name), (cls.__name__, name)


def test_no_method_is_borrowed_from_another_class():
    for name, value in vars(TrtllmEngine).items():
        if inspect.isfunction(value):
            assert value.__qualname__.startswith("TrtllmEngine."), (name, value.__qualname__)
    assert "self.scheduler" not in inspect.getsource(TrtllmEngine)  # no fake scheduler


def test_queue_is_the_base_class_own(tiny_bundle):
    engine = Engine(tiny_bundle)
    # the torch scheduler plans over the engine's own queue: one pair of collections
    assert engine.scheduler.waiting is engine.waiting and engine.scheduler.running is engine.running
    handle = engine.submit(Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3)))
    assert list(engine.waiting) == [handle.seq] and engine.stats()["queue_depth"] == 1
    engine.step()
    assert engine.running == [handle.seq] and engine.stats()["running"] == 1
    engine.run_until_done()
    assert handle.result()["finish_reason"] == "length" and engine.stats()["running"] == 0
    engine.close()
