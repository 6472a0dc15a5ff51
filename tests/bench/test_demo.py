"""scripts/demo.py (the quickstart's table): methods interleaved round by round, medians of
per-(round, prompt) ratios, the load average printed beside the table."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "scripts", "demo.py"))
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def test_schedule_interleaves_every_method_in_every_round_and_prompt():
    order = demo.schedule(["none", "ngram", "draft"], n_prompts=2, repeats=2)
    assert len(order) == 12 and len(set(order)) == 12
    for start in range(0, 12, 3):  # each (round, prompt) runs every method back to back
        block = order[start:start + 3]
        assert len({(r, p) for r, p, _ in block}) == 1 and {m for _, _, m in block} == {"none", "ngram", "draft"}
    assert [m for _, _, m in order[:6]] == ["none", "ngram", "draft", "ngram", "draft", "none"]  # rotated
    assert [r for r, _, _ in order] == [0] * 6 + [1] * 6  # rounds, not one method after another


def test_summarize_takes_the_median_of_same_round_ratios():
    runs = {}
    # plain gets slower every round (the machine's load rose); ngram is 1.5x plain in each round.
    for r, slow in enumerate((1.0, 2.0, 4.0)):
        for p in range(2):
            runs[(r, p, "none")] = {"tokens": 30, "seconds": 1.0 * slow, "token_ids": [p], "accepted": 1.0}
            runs[(r, p, "ngram")] = {"tokens": 30, "seconds": 1.0 * slow / 1.5, "token_ids": [p] if p else [9],
                                     "accepted": 1.6}
    base, ngram = demo.summarize(runs, ["none", "ngram"])
    assert ngram["speedup"] == pytest.approx(1.5) and ngram["speedup_min"] == pytest.approx(1.5)
    assert base["speedup"] == pytest.approx(1.0) and base["identical"] == "-"
    assert ngram["identical"] == "1/2"  # prompt 0's tokens differ
    assert base["tokens_per_s"] == pytest.approx(60 / 4.0)  # 2 prompts x 30 tokens over the median 2 s each
    assert ngram["mean_accepted"] == pytest.approx(1.6)


def test_demo_runs_on_the_default_model_and_prints_the_load(smollm2_bundle):
    # The real model, asked to copy text: prompt lookup's drafts are then accepted because the model
    # copies, on any CPU. (A random tiny model accepted ~1 draft in 12 tokens here and none on another
    # CPU, whose arithmetic took its greedy path elsewhere.)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), smollm2_bundle, "--prompts", "2",
                           "--repeats", "2", "--max-tokens", "16", "--threads", "1", "--methods", "ngram",
                           "--prompt", "Repeat exactly: the red fox, the red fox, the red fox.",
                           "--prompt", "Repeat exactly: one two three four five six. one two three four five six."],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0] in ("none", "ngram")}
    assert set(rows) == {"none", "ngram"}
    assert rows["ngram"][-1] == "2/2"  # greedy speculation equals plain decoding on both prompts
    assert float(rows["ngram"][-2]) > 1.0  # drafts were proposed and some accepted (mean accepted tokens)
    assert any(ln.startswith("load average (1, 5, 15 min) ") and " at end, on " in ln for ln in lines), proc.stdout
    assert any("methods interleaved (medians)" in ln for ln in lines)
