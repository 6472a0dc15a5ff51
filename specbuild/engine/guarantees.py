"""Which output guarantee holds for each speculation method on each backend: one table,
printed by `specbuild inspect`, returned by every engine's `describe_guarantees()`."""

from __future__ import annotations

from typing import Any

LOSSLESS = "lossless"
REFUSED = "refused"

# the torch rows of the methods that are no drafter; each drafter's row is its module's GUARANTEE
# (proposers/registry.guarantee_row), so a registered drafter is never missing from the table
_NONE_ROW = (LOSSLESS, LOSSLESS, "plain decoding")
_AUTO_ROW = (LOSSLESS, LOSSLESS, "as the method it picks per sequence")
# a drafter whose module declares no row: every torch method runs through specbuild's verifier
_GENERIC_ROW = (LOSSLESS, LOSSLESS, "specbuild verify: argmax match or tree argmax walk (greedy), rejection "
                                    "sampling (sampled)")


def torch_rows() -> dict[str, tuple[str, str, str]]:
    """none, every registered drafter (its GUARANTEE row, else the generic one), auto."""
    from specbuild.speculation.proposers import registry

    rows = {"none": _NONE_ROW}
    rows.update({name: registry.guarantee_row(name) or _GENERIC_ROW for name in registry.names()})
    rows["auto"] = _AUTO_ROW
    return rows


def guarantees(backend: str, *, mode: str = "none", gather_generation_logits: bool = False,
               methods: list[str] | None = None) -> dict[str, Any]:
    """Which output guarantee holds for each speculation method on a backend.

    Returns {"backend", "methods": {method: {"greedy", "sampled", "acceptance"}}, "notes"}.
    "lossless": the output is the target's (greedy: token for token; sampled: in
    distribution); "refused": such a request is rejected with an error saying why (a request
    that did not name the method is served without drafts instead, which is lossless).
    For tensorrt-llm, `mode` is the engines' (none | draft_tokens_external | medusa) and
    `gather_generation_logits` whether both engines were built with --gather_generation_logits.
    """
    if backend == "torch":
        rows = {m: r for m, r in torch_rows().items() if methods is None or m in methods}
        notes = ["every method runs through specbuild's own verifier (tested by chi-square against the "
                 "exact joint distribution: `specbuild verify`)",
                 "the draft length is chosen per sequence within [gamma_min, gamma_max]"]
    elif backend == "tensorrt-llm":
        rows = {"none": (LOSSLESS, LOSSLESS, "TensorRT-LLM's own sampler (seeded, but not the same random "
                                             "stream as the torch backend)")}
        if mode == "draft_tokens_external":
            sampled_draft = (LOSSLESS if gather_generation_logits else REFUSED)
            rows["ngram"] = (LOSSLESS, REFUSED, "TensorRT-LLM external draft tokens: accepted while equal to "
                                                "the target's argmax; prompt-lookup drafts carry no logits, "
                                                "so sampled requests are not speculated")
            rows["draft"] = (LOSSLESS, sampled_draft,
                             "TensorRT-LLM external draft tokens; sampled acceptance compares draft and target "
                             "logits, which needs both engines built with --gather_generation_logits"
                             + ("" if gather_generation_logits else " (these were not)"))
        elif mode == "medusa":
            rows["medusa"] = (LOSSLESS, REFUSED, "TensorRT-LLM's Medusa: greedy-only in its TensorRT path "
                                                 "(drafts accepted while equal to the target's argmax); "
                                                 "no typical acceptance")
            rows["none"] = (LOSSLESS, REFUSED, "served by the Medusa engine: every request uses the heads "
                                               "(TensorRT-LLM has no per-request off), greedy-only")
        if methods is not None:
            rows = {m: r for m, r in rows.items() if m in methods}
        notes = ["TensorRT-LLM owns the KV cache, the batching and the acceptance; specbuild streams the "
                 "tokens and counts acceptance per engine iteration",
                 "sampled acceptance needs generation logits (--gather_generation_logits on both engines: "
                 "specbuild compile --trtllm-gather-generation-logits)",
                 "the draft length is fixed at the request's gamma (no per-sequence controller); "
                 "method 'auto' is torch-only",
                 "lossless on this backend rests on TensorRT-LLM's acceptance kernels; specbuild checks "
                 "greedy equality with the torch backend (scripts/gpu_trtllm_e2e.sh)"]
    else:
        raise ValueError(f"backend {backend!r} is not one of torch, tensorrt-llm")
    return {"backend": backend,
            "methods": {m: {"greedy": g, "sampled": s, "acceptance": how} for m, (g, s, how) in rows.items()},
            "notes": notes}


def guarantee_lines(table: dict[str, Any]) -> list[str]:
    """The table as aligned text lines (inspect, README)."""
    lines = [f"guarantees on the {table['backend']} backend:"]
    for method, row in table["methods"].items():
        lines.append(f"  {method:7s} greedy {row['greedy']:9s} sampled {row['sampled']:9s} {row['acceptance']}")
    lines += [f"  note: {n}" for n in table["notes"]]
    return lines
