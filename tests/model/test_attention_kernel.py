"""The Triton paged-attention kernel against the float64 reference on random inputs:
ragged batches, GQA/MQA, causal, tree and arbitrary masks.

Triton picks interpreter or compiler when it is first imported, so the CPU cases run
in one subprocess with TRITON_INTERPRET=1 (this file run as a script prints one JSON
line of results); the `gpu` cases run in-process on CUDA where available.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specbuild.model.attention import paged_attention, paged_attention_reference
from specbuild.speculation.tree import TreeSpec, load_tree, tree_attention_mask

HAVE_TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON = "the `triton` package is not installed (pip install triton)"
DOC_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
# Max of |triton - reference| / (1 + |reference|): a few units in the last place of each dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def build_batch(seed, heads, kv_heads, head_dim, seqs, dtype, device="cpu", pool=None):
    """A ragged batch as the decoder feeds it. `seqs`: (past_len, new) per sequence,
    `new` an int (causal rows), a TreeSpec (tree rows: the root plus its drafts) or
    "random" (3 rows, random mask). Returns q, k_cache, v_cache, read_slots, mask, scale."""
    gen = torch.Generator().manual_seed(seed)
    blocks, row_counts = [], []
    for past, new in seqs:
        if isinstance(new, TreeSpec):
            block = tree_attention_mask(new.ancestor_mask_tensor(), past)
        elif new == "random":
            block = torch.rand(3, past + 3, generator=gen) < 0.4
            block[torch.arange(3), past + torch.arange(3)] = True  # each row sees itself
        else:
            block = tree_attention_mask(torch.ones(new, new, dtype=torch.bool).tril(), past)
        blocks.append(block)
        row_counts.append(block.shape[0])
    num_rows = sum(row_counts)
    num_cols = sum(b.shape[1] for b in blocks)
    pool = pool or num_cols + 17
    mask = torch.block_diag(*blocks)  # never across sequences
    read_slots = torch.randperm(pool, generator=gen)[:num_cols]  # scattered paged slots
    q = torch.randn(num_rows, heads, head_dim, generator=gen)
    k_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(pool, kv_heads, head_dim, generator=gen)
    move = dict(device=device, dtype=dtype)
    return (q.to(**move), k_cache.to(**move), v_cache.to(**move),
            read_slots.to(device), mask.to(device), head_dim ** -0.5)


def interpreter_cases():
    """Small cases (the interpreter runs each program in numpy)."""
    doc = TreeSpec.from_paths(DOC_TREE)
    return {
        "causal_mha_ragged": (4, 4, 16, [(5, 3), (0, 7), (20, 1)], torch.float32),
        "tree_gqa_mixed_trees": (4, 2, 32, [(9, doc), (3, TreeSpec.chain(3)),
                                            (0, load_tree("mc_sim_7b_top10"))], torch.float32),
        "tree_mqa_odd_dim": (6, 1, 24, [(40, load_tree("mc_sim_7b_top25"))], torch.float32),
        "random_mask_fp16": (2, 2, 16, [(6, "random"), (0, "random"), (11, "random")], torch.float16),
        "tree_bf16": (4, 2, 16, [(7, doc), (2, 2)], torch.bfloat16),
        "no_mask": (4, 2, 16, None, torch.float32),
        "fully_masked_row": (2, 1, 16, "empty_row", torch.float32),
    }


def run_case(name, spec, device="cpu", seed=0):
    """Max |triton - reference| / (1 + |reference|), and |triton - paged_attention| on
    rows that see nothing (SDPA gives 0 there; the reference NaN)."""
    from specbuild.model.attention_kernel import triton_paged_attention

    heads, kv_heads, head_dim, seqs, dtype = spec
    if seqs is None:
        q, k, v, slots, _, scale = build_batch(seed, heads, kv_heads, head_dim, [(9, 5)], dtype, device)
        mask = None
    elif seqs == "empty_row":
        q, k, v, slots, mask, scale = build_batch(seed, heads, kv_heads, head_dim, [(4, 3)], dtype, device)
        mask[1] = False
    else:
        q, k, v, slots, mask, scale = build_batch(seed, heads, kv_heads, head_dim, seqs, dtype, device)
    started = time.perf_counter()
    out = triton_paged_attention(q, k, v, slots, mask, scale)
    seconds = time.perf_counter() - started
    reference = paged_attention_reference(q, k, v, slots, mask, scale)
    rows = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    if mask is not None:
        rows = mask.any(dim=1)  # rows that see nothing: compare with SDPA's zeros instead
    expected = reference[rows].double()
    err = ((out[rows].double() - expected).abs() / (1 + expected.abs())).max().item()
    sdpa = paged_attention(q, k, v, slots, mask, scale)
    err_empty = (out[~rows].double() - sdpa[~rows].double()).abs().max().item() if (~rows).any() else 0.0
    return {"err": err, "err_empty": err_empty, "tol": TOLERANCE[dtype], "seconds": seconds,
            "rows": q.shape[0], "ref_scale": reference[rows].double().abs().max().item()}


@pytest.fixture(scope="module")
def interpreter_results():
    if not HAVE_TRITON:
        pytest.skip(NO_TRITON)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"interpreter subprocess: {time.perf_counter() - started:.1f} s")
    return results


@pytest.mark.parametrize("name", list(interpreter_cases()))
def test_interpreter_matches_reference(interpreter_results, name):
    result = interpreter_results[name]
    assert result["ref_scale"] > 0.05  # the reference is not trivially zero
    assert result["err"] <= result["tol"], result
    assert result["err_empty"] == 0.0, result


def test_column_ranges_skip_other_sequences():
    from specbuild.model.attention_kernel import _column_ranges

    mask = torch.block_diag(torch.ones(4, 10, dtype=torch.bool), torch.ones(4, 30, dtype=torch.bool))
    lo, hi = _column_ranges(mask, 8, 40, 4, mask.device)
    assert lo.tolist() == [0, 10] and hi.tolist() == [10, 40]
    lo, hi = _column_ranges(mask, 8, 40, 16, mask.device)  # one block spans both
    assert lo.tolist() == [0] and hi.tolist() == [40]
    empty = torch.zeros(3, 5, dtype=torch.bool)
    lo, hi = _column_ranges(empty, 3, 5, 16, empty.device)
    assert (hi - lo).tolist() == [0]


@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
def test_wrapper_errors():
    from specbuild.model.attention_kernel import _interpreting, triton_paged_attention

    q, k, v, slots, mask, scale = build_batch(0, 4, 2, 16, [(3, 2)], torch.float32)
    if not _interpreting():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            triton_paged_attention(q, k, v, slots, mask, scale)
    with pytest.raises(ValueError, match="kv_heads"):
        triton_paged_attention(q[:, :3], k, v, slots, mask, scale)
    with pytest.raises(ValueError, match="mask"):
        triton_paged_attention(q, k, v, slots, mask[:, :-1], scale)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TRITON, reason=NO_TRITON)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_matches_reference(dtype):
    trees = [load_tree("mc_sim_7b_63"), load_tree("vicuna_7b_stage2"), TreeSpec.chain(5)]
    cases = {
        **{name: spec[:4] + (dtype,) for name, spec in interpreter_cases().items()},
        "trees_gqa_long": (32, 8, 128, [(300, trees[0]), (17, trees[1]), (0, trees[2]),
                                         (1000, 1)], dtype),
        "prefill_mixed": (8, 2, 64, [(0, 200), (50, 33), (400, load_tree("mc_sim_7b_top25"))], dtype),
    }
    for seed, (name, spec) in enumerate(cases.items()):
        result = run_case(name, spec, device="cuda", seed=seed)
        assert result["err"] <= TOLERANCE[dtype], (name, result)
        assert result["err_empty"] <= TOLERANCE[dtype], (name, result)


if __name__ == "__main__":  # the interpreter subprocess
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    print(json.dumps({name: run_case(name, spec) for name, spec in interpreter_cases().items()}))
