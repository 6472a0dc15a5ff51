"""The repeated-work benchmark: requests over text the system has already seen.

Beside Spec-Bench (independent questions), this workload is the pattern suffix decoding
and prompt lookup target: multi-turn sessions in which the same document or code is
edited, summarised and asked about again (some documents return in a later session), and
runs of requests that share one template with different slot values (support answers, JSON
extraction, small code functions). The texts are package data written for specbuild
(specbuild/data/repeated/: sessions.json, templates.json); `questions()` expands them into
Spec-Bench style questions (question_id, category, turns), in a fixed order, so
`specbuild bench --workload repeated` runs them through the same interleaved loop, report
and table as Spec-Bench (each category is a column; a row's drafters keep what they learned
from its earlier questions, never another row's).
"""

from __future__ import annotations

import json
import os
import string
import tempfile
from importlib import resources
from typing import Any

CATEGORIES = ("doc_session", "code_session", "template_support", "template_extract", "template_code")


def data_path(name: str) -> str:
    return str(resources.files("specbuild").joinpath("data", "repeated", name))


def _load(name: str) -> dict[str, Any]:
    with open(data_path(name), encoding="utf-8") as f:
        return json.load(f)


def _fill(template: str, values: dict[str, str], where: str) -> str:
    names = {f for _, f, _, _ in string.Formatter().parse(template) if f}
    missing = names - set(values)
    if missing:
        raise ValueError(f"{where}: no value for slot(s) {sorted(missing)}")
    return template.format(**values)


def questions() -> list[dict]:
    """The workload as Spec-Bench questions: sessions first (ids 1..), then the templates'
    requests (ids 101..), each category in its data order."""
    sessions, templates = _load("sessions.json"), _load("templates.json")
    texts = {**sessions["documents"], **sessions["code"]}
    out: list[dict] = []
    for i, s in enumerate(sessions["sessions"], start=1):
        if s["text"] not in texts:
            raise ValueError(f"sessions.json session {i}: unknown text {s['text']!r}")
        turns = [_fill(t, {"doc": texts[s["text"]]}, f"sessions.json session {i}") for t in s["turns"]]
        out.append({"question_id": i, "category": s["category"], "turns": turns})
    qid = 101
    for t in templates["templates"]:
        for j, slots in enumerate(t["slots"]):
            out.append({"question_id": qid, "category": t["category"],
                        "turns": [_fill(t["text"], slots, f"templates.json {t['category']} slot row {j}")]})
            qid += 1
    bad = sorted({q["category"] for q in out} - set(CATEGORIES))
    if bad:
        raise ValueError(f"repeated workload: unknown categories {bad} (known: {', '.join(CATEGORIES)})")
    return out


def dataset_file(directory: str | None = None) -> str:
    """Write the workload as a Spec-Bench style jsonl (what `bench --dataset` reads); its path."""
    fd, path = tempfile.mkstemp(prefix="specbuild-repeated-", suffix=".jsonl", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for q in questions():
            f.write(json.dumps(q) + "\n")
    return path


def workload(name: str, dataset: str | None, split: str) -> tuple[str | None, str]:
    """(dataset path, split) for `bench --workload NAME`: spec-bench keeps the given ones;
    repeated is its own file, every question (split all: nothing of it is trained on)."""
    if name == "spec-bench":
        return dataset, split
    if name != "repeated":
        raise ValueError(f"workload {name!r} is not one of spec-bench, repeated")
    if dataset is not None:
        raise ValueError("--workload repeated brings its own questions; drop --dataset")
    return dataset_file(), "all"
