"""The structured-output task set: Spec-Bench questions, each asked with its category's
instruction and JSON schema (specbuild/data/structured/schemas.json) as response_format
json_schema, and the check that an answer parses and validates against its schema.

    tasks = load_tasks("eval", per_category=2)   # [{question_id, category, messages, response_format, schema}]
    ok, why = validates(text, task["schema"])
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from specbuild.bench.specbench import load_questions, load_split, select_questions

SCHEMAS = ("data", "structured", "schemas.json")


def load_schemas() -> dict[str, dict]:
    return json.loads(resources.files("specbuild").joinpath(*SCHEMAS).read_text(encoding="utf-8"))["categories"]


def load_tasks(which: str = "eval", per_category: int | None = None) -> list[dict[str, Any]]:
    """One task per selected question (first turn only): the user message is the category's
    instruction followed by the question."""
    schemas = load_schemas()
    out = []
    for q in select_questions(load_questions(), load_split(), which, per_category):
        spec = schemas.get(q["category"], schemas["default"])
        out.append({
            "question_id": q["question_id"], "category": q["category"],
            "messages": [{"role": "user", "content": f"{spec['instruction']}\n\n{q['turns'][0]}"}],
            "schema": spec["schema"],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": q["category"], "schema": spec["schema"], "strict": True}},
        })
    return out


def validates(text: str, schema: dict) -> tuple[bool, str]:
    """(ok, reason): `text` is JSON and matches `schema` (the subset the task schemas use:
    object/array/string/number/integer/boolean, enum, required, additionalProperties false,
    maxLength, maxItems). Written out here so the check does not trust the grammar engine."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return False, f"not JSON: {e}"
    return _check(value, schema, "$")


def _check(v: Any, s: dict, where: str) -> tuple[bool, str]:
    t = s.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if t in types and not isinstance(v, types[t]):
        return False, f"{where}: expected {t}, got {type(v).__name__}"
    if t in ("number", "integer") and (isinstance(v, bool) or not isinstance(v, (int, float))
                                       or (t == "integer" and not float(v).is_integer())):
        return False, f"{where}: expected {t}, got {v!r}"
    if "enum" in s and v not in s["enum"]:
        return False, f"{where}: {v!r} not in {s['enum']}"
    if t == "string" and "maxLength" in s and len(v) > s["maxLength"]:
        return False, f"{where}: {len(v)} characters > maxLength {s['maxLength']}"
    if t == "array":
        if "maxItems" in s and len(v) > s["maxItems"]:
            return False, f"{where}: {len(v)} items > maxItems {s['maxItems']}"
        for i, item in enumerate(v):
            ok, why = _check(item, s.get("items", {}), f"{where}[{i}]")
            if not ok:
                return ok, why
    if t == "object":
        props = s.get("properties", {})
        missing = [k for k in s.get("required", []) if k not in v]
        if missing:
            return False, f"{where}: missing {missing}"
        if s.get("additionalProperties") is False and set(v) - set(props):
            return False, f"{where}: unexpected {sorted(set(v) - set(props))}"
        for k, item in v.items():
            if k in props:
                ok, why = _check(item, props[k], f"{where}.{k}")
                if not ok:
                    return ok, why
    return True, ""
