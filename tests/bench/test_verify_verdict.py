"""`specbuild verify`'s verdict: a failing p-value fails (exit 1); a setting with too few
acceptances to judge is inconclusive (exit 3, named, with what to run instead); else pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specbuild.bench.verify_dist import EXIT_FAIL, EXIT_INCONCLUSIVE, EXIT_PASS, VerifyResult, verdict
from specbuild.compiler.compile import CompileOptions, compile_bundle
from tiny import make_tiny_hf


def result(method="draft", accepted=100, drafted=600, p=0.5, temp=0.7):
    return VerifyResult("1, 2, 3, 4, 5, 1, 2,", temp, 3, method, 600, 1.0, 4, p, drafted, accepted, 9)


def test_verdict_separates_failure_from_too_few_acceptances():
    ok = [result("ngram", 598), result("draft", 150)]
    assert verdict(ok, [0.8, 0.9], 0.01).status == "pass"
    assert verdict(ok, [0.8, 0.9], 0.01).exit_code == EXIT_PASS
    few = [result("ngram", 598), result("draft", 0, temp=0.7)]
    v = verdict(few, [0.84, 0.9], 0.01, bundle="bundles/x")
    assert v.status == "inconclusive" and v.exit_code == EXIT_INCONCLUSIVE and v.statuses == ("pass", "inconclusive")
    assert len(v.advice) == 1 and "draft at T=0.7" in v.advice[0] and "0 of 600" in v.advice[0]
    assert "specbuild verify bundles/x --speculation draft --temperatures 0.7 --chat" in v.advice[0]
    # a failing p-value fails the check even when another setting is inconclusive
    v = verdict(few, [0.001, 0.9], 0.01)
    assert v.status == "fail" and v.exit_code == EXIT_FAIL and v.statuses == ("fail", "inconclusive")
    # failing with few acceptances is still a failure (the distribution differs)
    assert verdict([result("draft", 3)], [1e-6], 0.01).statuses == ("fail",)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("verdict")
    target = make_tiny_hf(str(root / "target"), scale=4.0, seed=3)
    return compile_bundle(target, str(root / "bundle"), CompileOptions(dtype="float64"))


def verify(bundle, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "specbuild", "verify", bundle, "--speculation", "recycle",
                           "--samples", "60", "--temperatures", "1.0", "--tokens", "3", "--top-k", "2",
                           "--prompt", "a b c a b c a b c a b", "--json", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_exit_codes(bundle):
    good = verify(bundle, "--min-accepted", "1")
    report = json.loads(good.stdout)
    assert good.returncode == 0 and report["verdict"] == "pass", good.stdout + good.stderr
    assert report["results"][0]["accepted"] >= 1
    # the same run asked for more acceptances than it could have made: inconclusive, exit 3
    few = verify(bundle, "--min-accepted", "100000")
    report = json.loads(few.stdout)
    assert few.returncode == 3 and report["verdict"] == "inconclusive", few.stdout + few.stderr
    assert report["results"][0]["status"] == "inconclusive" and "--speculation recycle" in report["advice"][0]
