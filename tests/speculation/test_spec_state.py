"""Per-sequence speculation state is one typed record (SpecState); one acceptance estimator
(GammaController.alpha, per method, windowed) serves both the depth and `auto`'s choice of
drafter; a sequence's remaining room is one property (Sequence.remaining)."""

from __future__ import annotations

import dataclasses
import types

import torch

from specbuild.engine.engine import Engine, EngineConfig
from specbuild.engine.sequence import Request, Sequence
from specbuild.sampling.params import SamplingParams
from specbuild.speculation.config import SpeculationConfig
from specbuild.speculation.gamma import CostModel, GammaController
from specbuild.speculation.proposers.base import DrafterBase, Needs
from specbuild.speculation.proposers.eagle import EagleState
from specbuild.speculation.proposers.remote import RemoteState
from specbuild.speculation.speculator import PassResult, Speculator
from specbuild.speculation.state import SpecState


def fake_seq(method: str = "auto"):
    return types.SimpleNamespace(spec_state=SpecState(), spec=SpeculationConfig.make(None, method=method, gamma=4))


def test_state_is_typed_not_string_keys():
    names = {f.name for f in dataclasses.fields(SpecState)}
    assert {"method", "gamma"} <= names
    assert "extra" not in vars(Sequence) and not hasattr(Speculator, "method_alpha")
    # each drafter's per-sequence state is its own, typed, keyed by seq_id: none of it is shared
    assert not names & {"draft_len", "medusa_hidden", "remote_sent", "remote_keep", "remote_failed", "eagle"}
    assert {f.name for f in dataclasses.fields(RemoteState)} == {"sent", "keep", "failed", "drafted"}
    assert {f.name for f in dataclasses.fields(EagleState)} >= {"kb", "vb", "n", "pending"}  # its K/V buffers


def test_one_estimator_per_method_with_a_window():
    ctl = GammaController({"draft": CostModel({1: 1.0, 9: 1.2}), "ngram": CostModel({1: 1.0, 9: 1.2})}, window=5)
    seq = fake_seq()
    assert ctl.alpha(seq, "draft") == ctl.alpha(seq, "ngram") == 0.6  # the prior
    for _ in range(5):
        ctl.record(seq, "draft", 4, 4)
        ctl.record(seq, "ngram", 4, 0)
    assert ctl.alpha(seq, "draft") == (20 + 1.2) / 22 and ctl.alpha(seq, "ngram") == 1.2 / 22
    for _ in range(5):  # the window forgets the good steps
        ctl.record(seq, "draft", 4, 1)
    assert ctl.alpha(seq, "draft") == (5 + 1.2) / 22
    ctl.record(seq, "draft", 0, 0)  # a step without drafts tells nothing
    assert ctl.alpha(seq, "draft") == (5 + 1.2) / 22


def test_auto_chooses_by_the_controllers_estimate():
    costs = {"draft": CostModel({1: 1.0, 2: 1.02, 5: 1.1}, 0.01), "ngram": CostModel({1: 1.0, 2: 1.02, 5: 1.1})}
    proposers = {"ngram": DrafterBase(), "draft": DrafterBase()}
    speculator = Speculator(None, None, proposers, max_draft_len=4, max_seq_len=64, costs=costs)
    seq = fake_seq()
    for _ in range(10):
        speculator.controller.record(seq, "draft", 4, 4)
        speculator.controller.record(seq, "ngram", 4, 0)
    assert speculator.choose_method(seq) == "draft"
    for _ in range(20):
        speculator.controller.record(seq, "draft", 4, 0)
        speculator.controller.record(seq, "ngram", 4, 4)
    assert speculator.choose_method(seq) == "ngram"
    for _ in range(20):
        speculator.controller.record(seq, "ngram", 4, 0)
    assert not seq.spec_state.auto_plain
    assert speculator.choose_method(seq) is None  # neither pays: plain decoding
    # final: an estimate changes only when its drafter drafts, so auto stops weighing them
    assert seq.spec_state.auto_plain
    for _ in range(20):  # (even were one to change, the sequence stays plain)
        speculator.controller.record(seq, "ngram", 4, 4)
    assert speculator.choose_method(seq) is None


def test_auto_leaves_out_a_drafter_another_of_its_drafters_covers():
    """suffix's matches include prompt lookup's (covers): beside it, auto drafts with suffix
    alone and ngram learns nothing from auto's sequences; without it, ngram is auto's."""
    costs = {"ngram": CostModel({1: 1.0, 2: 1.2, 5: 1.6}), "suffix": CostModel({1: 1.0, 2: 1.2, 5: 1.6})}

    class Covering(DrafterBase):
        covers = ("ngram",)

    both = Speculator(None, None, {"suffix": Covering(), "ngram": DrafterBase()}, max_draft_len=4,
                      max_seq_len=64, costs=costs)
    assert both.auto_methods == ("suffix",) and "ngram" not in both.auto_uses
    seq = fake_seq()
    for _ in range(10):  # ngram would win the weighing: it is not weighed
        both.controller.record(seq, "ngram", 4, 4)
        both.controller.record(seq, "suffix", 4, 2)
    assert both.choose_method(seq) == "suffix"
    alone = Speculator(None, None, {"ngram": DrafterBase()}, max_draft_len=4, max_seq_len=64,
                       costs={"ngram": costs["ngram"]})
    assert alone.auto_methods == ("ngram",)


def test_auto_weighs_a_drafter_by_how_often_it_finds_a_draft():
    """ngram with a fine acceptance when it matches, but it has found nothing for 10 steps:
    auto takes suffix, which finds drafts accepted a little less often."""
    costs = {"ngram": CostModel({1: 1.0, 2: 1.2, 5: 1.6}), "suffix": CostModel({1: 1.0, 2: 1.2, 5: 1.6})}
    speculator = Speculator(None, None, {"suffix": DrafterBase(), "ngram": DrafterBase()}, max_draft_len=4,
                            max_seq_len=64, costs=costs)
    seq = fake_seq()
    for _ in range(10):
        speculator.controller.record(seq, "ngram", 4, 3)
        speculator.controller.record(seq, "suffix", 4, 2)
        speculator.controller.found(seq, "suffix", True)
    assert speculator.choose_method(seq) == "ngram"  # both always find drafts: the better acceptance wins
    for _ in range(10):
        speculator.controller.found(seq, "ngram", False)
    assert speculator.controller.hit_rate(seq, "ngram") < 0.1
    assert speculator.choose_method(seq) == "suffix"


def test_a_settled_auto_sequence_skips_the_drafters_bookkeeping():
    observed = []
    rec = types.SimpleNamespace(needs=Needs(), observe=lambda seq, obs: observed.append(obs.length),
                                rollback=lambda seq, length: None)
    speculator = Speculator(None, None, {"suffix": rec}, max_draft_len=4, max_seq_len=64,
                            costs={"suffix": CostModel({1: 1.0, 5: 1.1})})
    seq = fake_seq()
    seq.seq_id, seq.params = 1, SamplingParams(temperature=0.0)
    rows = torch.zeros(1, 8)
    speculator.settle(seq, PassResult(0, [1, 2], None, rows, rows))
    seq.spec_state.auto_plain = True
    speculator.settle(seq, PassResult(2, [3, 4], None, rows, rows))
    assert observed == [2]


def test_auto_drafts_only_with_drafters_that_read_nothing_of_the_pass_and_draft_cheaply():
    """EAGLE's features and recycling's logits are paid on every step of every sequence that
    uses them, drafting or not; a drafter model costing a third of a step per token never pays
    on a CPU: auto leaves them out (a request still names them)."""
    def prop(needs):
        p = DrafterBase()
        p.needs = needs
        return p

    proposers = {"suffix": prop(Needs(tree=True)), "ngram": prop(Needs()), "recycle": prop(Needs(logits=True)),
                 "eagle": prop(Needs(aux_layers=(1, 2))), "draft": prop(Needs()),
                 "hybrid": prop(Needs(tree=True, parts=("suffix", "recycle")))}
    costs = {name: CostModel({1: 1.0, 5: 1.1}, 0.3 if name == "draft" else 0.0) for name in proposers}
    speculator = Speculator(None, None, proposers, max_draft_len=4, max_seq_len=64, costs=costs)
    assert speculator.auto_methods == ("suffix", "ngram")
    seq = fake_seq()
    assert speculator.uses(seq) == {"suffix", "ngram"}
    assert speculator.choose_method(seq) in ("suffix", "ngram")
    assert speculator.uses(fake_seq("hybrid")) == {"hybrid", "suffix", "recycle"}  # named: as before


def test_remaining_room_counts_max_tokens_and_context(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(max_batch_size=2))
    short = engine.submit(Request(prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=5, ignore_eos=True)))
    near = engine.submit(Request(prompt_ids=list(range(1, engine.max_seq_len - 2)),
                                 sampling=SamplingParams(max_tokens=50, ignore_eos=True)))
    assert short.seq.remaining == 5 and near.seq.remaining == 3  # the context limit binds
    engine.run_until_done()
    assert short.seq.remaining == 0 and near.seq.remaining == 0
    assert len(near.result()["token_ids"]) == 3 and near.result()["finish_reason"] == "length"


def test_auto_first_tries_a_drafter_at_the_depth_its_prior_pays_for():
    # a wide pass costs much more than a step (int4-like): the first try is short
    def seq(method):  # the dynamic depth, bounds 1..4
        return types.SimpleNamespace(spec_state=SpecState(), spec=SpeculationConfig.make(
            None, method=method, gamma=4, gamma_min=1, gamma_max=4))

    assert seq("auto").spec.dynamic
    steep = {"ngram": CostModel({1: 1.0, 2: 1.2, 3: 1.4, 5: 2.4})}
    ctl = GammaController(steep)
    assert ctl.next(seq("auto"), "ngram") == 2
    assert ctl.next(seq("ngram"), "ngram") == 4  # a named method starts from its gamma, as before
    flat = {"ngram": CostModel({1: 1.0, 2: 1.01, 3: 1.02, 5: 1.04})}
    assert GammaController(flat).next(seq("auto"), "ngram") == 4
