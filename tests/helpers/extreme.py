"""Extreme sampling parameters through a real engine (hypothesis): each draw either is
refused with a RequestError (a 4xx) or gives the exact answer it must give: the greedy
answer when it reduces to greedy (temperature below the floor, top_k 1, a top_p below the
top token's probability), else the seeded answer, the same on a second run.

    check_extreme(engine, ["none", "ngram"], prompt)  # inside a test
"""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings, strategies as st

from specbuild.engine.sequence import Request
from specbuild.errors import RequestError
from specbuild.sampling.params import TEMPERATURE_FLOOR, SamplingParams
from specbuild.speculation.config import SpeculationConfig

TEMPERATURES = [0.0, 1e-45, 1e-38, 1e-30, 1e-7, TEMPERATURE_FLOOR * 0.999, TEMPERATURE_FLOOR, 1e-4, 0.7, 100.0,
                100.0001, 1e38, float("inf"), float("nan"), -1e-45]
TOP_PS = [1.0, 0.5, 1e-10, 1e-38, 1e-45, 5e-324, 0.0, float("nan")]
TOP_KS = [0, 1, 2, -1]
MAX_TOKENS = 10


def run(engine, method: str, prompt: list[int], **sampling) -> list[int]:
    request = Request(prompt_ids=list(prompt), speculation=SpeculationConfig.make(None, method=method),
                      sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling))
    result = engine.generate([request])[0]
    assert "error" not in result, result.get("error")
    return result["token_ids"]


def reduces_to_greedy(temperature: float, top_p: float, top_k: int) -> bool:
    # top_p 1e-10 is below any top token's probability here (vocab 320: the top one has >= 1/320)
    return temperature < TEMPERATURE_FLOOR or top_k == 1 or top_p <= 1e-10


def check_extreme(engine, methods: list[str], prompt: list[int], examples: int = 12) -> None:
    greedy = run(engine, "none", prompt)
    seen = {"refused": 0, "greedy": 0, "seeded": 0}

    last = methods[-1]

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    # the triggers, on the last (tree) method: logits / 1e-38 overflowed to NaN, a
    # top_p below float32's smallest number dropped every token; then a refusal and a seeded draw
    @example(method=last, temperature=1e-38, top_p=1.0, top_k=0, seed=1)
    @example(method=last, temperature=0.7, top_p=1e-45, top_k=0, seed=2)
    @example(method=last, temperature=0.7, top_p=1.0, top_k=1, seed=3)
    @example(method=last, temperature=1e38, top_p=1.0, top_k=0, seed=4)
    @example(method=last, temperature=100.0, top_p=1.0, top_k=0, seed=5)
    @given(method=st.sampled_from(methods), temperature=st.sampled_from(TEMPERATURES), top_p=st.sampled_from(TOP_PS),
           top_k=st.sampled_from(TOP_KS), seed=st.integers(0, 2 ** 32))
    def prop(method, temperature, top_p, top_k, seed):
        try:
            SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        except RequestError as e:  # refused at submission: a 4xx naming the value
            assert any(name in str(e) for name in ("temperature", "top_p", "top_k")), e
            seen["refused"] += 1
            return
        # token recycling's table is shared and learns from every request: the second run starts
        # from the same table (proposers/recycling.py: seeded tokens depend on what it holds)
        recycle = engine.speculator.proposers.get("recycle")
        table = recycle.snapshot() if recycle is not None else None
        ids = run(engine, method, prompt, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        assert len(ids) == MAX_TOKENS and all(0 <= t < engine.target_config.vocab_size for t in ids)
        if reduces_to_greedy(temperature, top_p, top_k):
            assert ids == greedy, (method, temperature, top_p, top_k)
            seen["greedy"] += 1
        else:
            if recycle is not None:
                recycle.restore(table)
            assert ids == run(engine, method, prompt, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
            seen["seeded"] += 1

    prop()
    assert engine.cache.used_blocks == 0
    assert seen["refused"] and seen["greedy"] and seen["seeded"], seen
    return seen
