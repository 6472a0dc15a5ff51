"""`auto`'s batch-wide switch (speculation/goodput.py): it runs the arm whose steps gave more
tokens per second at this batch size, falls back to plain decoding within a few steps when
speculating does not pay, probes rarely, and comes back when speculating pays again. The unit
tests feed it step times; the engine tests replace the steps' wall time by a cost of their rows
(deterministic), so what is tested is the wiring, not this machine's clock."""

from __future__ import annotations

import pytest

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request
from specbuild.sampling.params import SamplingParams
from specbuild.speculation import goodput as G
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.speculator import Speculator
from tiny import draft_pair_bundle


def drive(switch: G.GoodputSwitch, steps: int, batch: int, plain=(1, 1.0), spec=(2, 3.0), pure=True) -> list[str]:
    """Run `steps` steps; each arm's step gives (tokens, seconds). Returns the arms run."""
    arms = []
    for _ in range(steps):
        arm = switch.choose(batch, pure)
        tokens, seconds = plain if arm == "plain" else spec
        switch.observe(tokens, seconds, pure)
        arms.append(arm)
    return arms


def test_a_speculation_that_does_not_pay_is_off_within_a_few_steps_and_probed_rarely():
    sw = G.GoodputSwitch()
    arms = drive(sw, 2000, 1, plain=(1, 1.0), spec=(2, 3.0))  # spec: 0.67 tokens/s against 1
    first_plain = arms.index("plain")
    assert first_plain <= G.MIN_STEPS + G.PROBE_FIRST + 1
    # after it settled, the spec steps are the probes alone, and they thin out
    assert sw.describe()["1"]["arm"] == "plain"
    tail = arms[1000:]
    assert 0 < tail.count("spec") <= len(tail) * G.PROBE_STEPS / (G.PROBE_MAX / 2)
    # the goodput over a whole run where speculating gives 0.67x (a drafted step 1.5x as long
    # for one token, as a wide rejected tree costs): within 3% of all-plain (the probes' price)
    sw = G.GoodputSwitch()
    arms = drive(sw, 2000, 1, plain=(1, 1.0), spec=(1, 1.5))
    tokens = len(arms)
    seconds = sum(1.0 if a == "plain" else 1.5 for a in arms)
    assert tokens / seconds >= 0.97


def test_a_speculation_that_pays_stays_on_and_plain_is_only_probed():
    sw = G.GoodputSwitch()
    arms = drive(sw, 1000, 1, plain=(1, 1.0), spec=(3, 1.5))
    assert sw.describe()["1"]["arm"] == "spec"
    assert arms[500:].count("plain") <= 500 * G.PROBE_STEPS / (G.PROBE_MAX / 4)


def test_speculation_comes_back_when_it_starts_paying():
    sw = G.GoodputSwitch()
    drive(sw, 3000, 1, plain=(1, 1.0), spec=(1, 2.0))
    assert sw.describe()["1"]["arm"] == "plain"
    arms = drive(sw, 3 * G.PROBE_MAX, 1, plain=(1, 1.0), spec=(4, 1.2))
    assert sw.describe()["1"]["arm"] == "spec"
    assert arms[-G.PROBE_FIRST:].count("spec") >= G.PROBE_FIRST - G.PROBE_STEPS


def test_a_winner_that_falls_below_the_other_arm_is_challenged_at_once():
    """After a probe that speculation won, the next scheduled probe is PROBE_MAX steps away; when
    speculation's own window then falls below what plain gave at that probe, plain is probed
    again within a window's steps, not at the schedule."""
    sw = G.GoodputSwitch()
    drive(sw, 1000, 8, plain=(8, 2.0), spec=(16, 2.0))  # speculation pays 2x: it wins, probes thin out
    b = sw.buckets["5-8"]
    assert b.arm == "spec" and b.interval == G.PROBE_MAX
    while not (b.probing == 0 and b.until_probe == G.PROBE_MAX):  # just after a probe of plain ended
        drive(sw, 1, 8, plain=(8, 2.0), spec=(16, 2.0))
    arms = drive(sw, 3 * G.WINDOW, 8, plain=(8, 2.0), spec=(8, 3.0))  # now speculation gives 2.7 against 4
    assert sw.describe()["5-8"]["arm"] == "plain" and sw.describe()["5-8"]["challenges"] >= 1
    assert arms.index("plain") <= G.WINDOW + 1  # the challenge's probe: one window of the winner's steps
    assert arms[G.WINDOW + G.PROBE_STEPS + 1:].count("spec") <= G.PROBE_STEPS  # then one scheduled probe
    # a winner that holds is not challenged: constant arms give scheduled probes only
    sw = G.GoodputSwitch()
    drive(sw, 1000, 8, plain=(8, 2.0), spec=(16, 2.0))
    assert sw.describe()["5-8"]["challenges"] == 0


def test_speculation_must_beat_plain_by_the_margin_to_take_over():
    """A speculation within SPEC_MARGIN of plain decoding (its probes' few steps could not tell
    the two apart) leaves plain running; plain takes back over on any lead."""
    sw = G.GoodputSwitch()
    slight = 1.0 + G.SPEC_MARGIN / 2
    arms = drive(sw, 1000, 8, plain=(8, 2.0), spec=(8 * slight, 2.0))
    assert sw.describe()["5-8"]["arm"] == "plain" and sw.describe()["5-8"]["switches"] == 0
    assert arms[500:].count("spec") <= 500 * G.PROBE_STEPS / (G.PROBE_MAX / 2)  # probes only
    clear = 1.0 + 2 * G.SPEC_MARGIN
    drive(sw, 2 * G.PROBE_MAX, 8, plain=(8, 2.0), spec=(8 * clear, 2.0))
    assert sw.describe()["5-8"]["arm"] == "spec"
    drive(sw, 2 * G.PROBE_MAX, 8, plain=(8, 2.0), spec=(8 / slight, 2.0))  # now plain leads, slightly
    assert sw.describe()["5-8"]["arm"] == "plain"


def test_steps_that_are_not_pure_teach_nothing():
    """A step that prefilled a prompt (or ran a neighbour's fixed method) costs what the arms do
    not differ in: it is not counted."""
    sw = G.GoodputSwitch()
    arms = drive(sw, 50, 1, plain=(1, 1.0), spec=(1, 100.0), pure=False)
    d = sw.describe()["1"]
    assert d["plain_steps"] == 0 and d["spec_steps"] == 0
    assert set(arms) == {"plain"}  # they run the winning arm (the start: plain); no probe is spent on them
    # and a probe under way waits for pure steps: its steps are all counted
    drive(sw, G.MIN_STEPS + G.PROBE_FIRST - 1, 1)  # the next pure step starts a probe
    assert sw.choose(1) == "spec"
    sw.observe(1, 1.0)
    assert drive(sw, 5, 1, pure=False) == ["plain"] * 5
    assert drive(sw, G.PROBE_STEPS - 1, 1, spec=(5, 1.0)) == ["spec"] * (G.PROBE_STEPS - 1)
    assert sw.describe()["1"]["spec_steps"] == G.PROBE_STEPS


def test_each_batch_size_decides_for_itself_and_a_new_one_starts_from_its_neighbour():
    sw = G.GoodputSwitch()
    drive(sw, 400, 1, plain=(1, 1.0), spec=(3, 1.2))  # batch 1: speculation pays
    drive(sw, 400, 8, plain=(8, 2.0), spec=(12, 6.0))  # batch 8: it does not
    d = sw.describe()
    assert d["1"]["arm"] == "spec" and d["5-8"]["arm"] == "plain"
    assert sw.choose(16) == "plain"  # 9-16 starts on plain, and its nearest neighbour (5-8) chose plain
    assert drive(sw, 1 + G.PROBE_FIRST, 16).count("spec") == 0  # so speculation waits for the usual probe
    assert drive(sw, G.MIN_STEPS + 1, 2, plain=(2, 1.0), spec=(5, 1.2))[-1] == "spec"  # 1 chose spec: probed at once


@pytest.fixture(scope="module")
def spec_bundle(tmp_path_factory) -> str:
    return draft_pair_bundle(tmp_path_factory.mktemp("goodput"))


REPEAT = [5, 6, 7, 8, 9, 10, 11] * 6  # prompt lookup finds its continuation


def auto_run(engine, prompts, max_tokens=60):
    spec = SpeculationConfig.make(None, method="auto")
    return engine.generate([Request(prompt_ids=p, speculation=spec,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                            for p in prompts])


@pytest.mark.parametrize("row_cost,winner", [(0.0, "spec"), (50.0, "plain")])
def test_auto_in_the_engine_follows_what_its_steps_cost(spec_bundle, monkeypatch, row_cost, winner):
    """Steps timed as 1 + row_cost per row beyond one per sequence: free rows make speculation
    win (more tokens a step), dear rows make plain decoding win; either way the output is plain
    decoding's, and the drafts auto did verify were accepted in part."""
    def on_step(self, kind, batch, tokens, rows, seconds):
        if self.goodput.current is not None:
            self.goodput.observe(tokens, 1.0 + row_cost * max(0, rows - batch), self._auto_pure and kind != "prefill")

    monkeypatch.setattr(Speculator, "on_step", on_step)
    engine = Engine(spec_bundle, EngineConfig(max_batch_size=4))
    # auto's drafters are chosen by start-up costs (the draft model joins where it is cheap): fixed
    # here, so that only the switch is under test
    engine.speculator._auto_methods = tuple(m for m in ("suffix", "ngram") if m in engine.speculator.proposers)
    prompts = [REPEAT, REPEAT[3:] + REPEAT[:3]]  # two at once: a lone sequence is the fit's alone (below)
    plain = engine.generate([Request(prompt_ids=p, speculation=SpeculationConfig.make(None, method="none"),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
                             for p in prompts])
    auto = auto_run(engine, prompts, max_tokens=200)
    assert [r["token_ids"] for r in auto] == [r["token_ids"] for r in plain]
    s = auto[0]["stats"]
    assert s["drafted"] > 0 and s["accepted"] > 0, s  # it speculated (in probes at least)
    d = engine.speculator.goodput.describe()["2"]
    assert d["arm"] == winner, d
    assert d["plain_steps"] > 0 and d["spec_steps"] > 0  # both arms were measured
    if winner == "plain":
        assert d["plain_ran"] > 3 * d["spec_ran"], d
    else:
        assert d["spec_ran"] > 3 * d["plain_ran"], d


def test_a_lone_sequence_is_left_to_the_batch_fit(spec_bundle, monkeypatch):
    """At one decoding sequence the switch does not run: the batch's fit already cuts its draft,
    step by step, to what pays on the learned costs and the drafter's odds for that step, where
    the switch's 3-step probes of bimodal acceptance ran plain decoding on 16% of a served run's
    steps (fixed suffix 1.28x plain, `auto` 1.20x). Steps timed with dear rows, which would turn
    the switch to plain, leave a lone `auto` request drafting; its output is plain decoding's."""
    def on_step(self, kind, batch, tokens, rows, seconds):
        if self.goodput.current is not None:
            self.goodput.observe(tokens, 1.0 + 50.0 * max(0, rows - batch), self._auto_pure and kind != "prefill")

    monkeypatch.setattr(Speculator, "on_step", on_step)
    engine = Engine(spec_bundle, EngineConfig(max_batch_size=4))
    engine.speculator._auto_methods = tuple(m for m in ("suffix", "ngram") if m in engine.speculator.proposers)
    engine.speculator.step_line = lambda batch, lo, hi: (1.0, 0.0)  # the fit keeps what a drafter offers
    plain = engine.generate([Request(prompt_ids=REPEAT, speculation=SpeculationConfig.make(None, method="none"),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))])
    auto = auto_run(engine, [REPEAT], max_tokens=120)
    assert auto[0]["token_ids"] == plain[0]["token_ids"]
    s = auto[0]["stats"]
    assert s["drafted"] > 0 and s["accepted"] > 0, s
    assert "1" not in engine.speculator.goodput.describe()
