"""Statistical tests of speculative sampling, end to end on a tiny synthetic model.

The "model" is a fixed random trigram table over a small vocabulary (logits depend on the
two previous tokens); the drafter is a perturbed copy. Rows are independent requests
that generate their first 3 tokens by speculative decoding (draft k tokens from the
drafter's warped distribution, verify each row with `verify_chain_sampled`, the function
the engine runs per sequence through `Speculator.verify`, repeat; trees likewise with
`verify_tree_sampled`). Two
chi-square tests per setting, against laws enumerated exactly from the tables:

(a) losslessness: the joint of the first 3 tokens equals the target's (plain decoding with
    the same warping);
(b) the law of the first verification step: (accepted drafts a, tokens the step emitted e,
    x1, x2, x3), stratified by the row's k. It pins the acceptance probabilities
    min(target, draft), the residual max(0, target - draft) and the bonus token (e = a + 1).

Holm's correction runs across all settings at family alpha 0.01. Each broken variant
fails at the same sample size with p < 1e-6. Dropping the bonus token does not change
(a) (the next step samples that position from the target anyway: it only costs speed),
so it is caught by (b), where a step that emits a tokens after a accepted drafts is an
impossible outcome.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from specbuild.sampling.params import SamplingParams, sample_from, warp_probs
from specbuild.sampling.acceptance import verify_chain_sampled, verify_tree_sampled

from stats_util import holm, pooled_chisquare, stratified_chisquare

VOCAB = 8
ROWS = 12_000  # per-row verification (the engine's function) costs ~50 us a call; broken variants still give p ~ 0
ALPHA = 0.01
PROMPT = (3, 5)  # the two context tokens before generation


@dataclass(frozen=True)
class Model:
    target_logits: torch.Tensor  # [vocab, vocab, vocab, vocab]: logits after (prev2, prev1)
    draft_logits: torch.Tensor  # same shape, perturbed copy


def make_model(seed: int = 1234, scale: float = 1.6, noise: float = 1.0) -> Model:
    gen = torch.Generator().manual_seed(seed)
    target = scale * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen, dtype=torch.float64)
    draft = target + noise * torch.randn(VOCAB, VOCAB, VOCAB, generator=gen, dtype=torch.float64)
    return Model(target.float(), draft.float())


MODEL = make_model()


@dataclass(frozen=True)
class Setting:
    name: str
    target: SamplingParams
    draft: SamplingParams | None = None  # None: the drafter samples with the target's params
    deterministic: bool = False  # drafter proposes its argmax, draft_probs=None (n-gram style)
    gammas: tuple[int, ...] = (1, 2, 3)

    @property
    def draft_params(self) -> SamplingParams:
        return self.draft or self.target


def sp(temperature, top_k=0, top_p=1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


# ------------------------------------------------------------------- exact laws


def exact_tokens(model: Model, params: SamplingParams) -> torch.Tensor:
    """[vocab]*3 float64: joint of the first 3 tokens under plain decoding."""
    table = warp_probs(model.target_logits, params).double()  # [v, v, v]
    c0, c1 = PROMPT
    return table[c0, c1][:, None, None] * table[c1][:, :, None] * table


def _step_tables(model: Model, setting: Setting):
    target = warp_probs(model.target_logits, setting.target).double()
    if setting.deterministic:
        draft = torch.nn.functional.one_hot(model.draft_logits.argmax(-1), VOCAB).double()
    else:
        draft = warp_probs(model.draft_logits, setting.draft_params).double()
    return target, torch.minimum(target, draft), (target - draft).clamp(min=0.0)


def exact_step_law(model: Model, setting: Setting, k: int) -> torch.Tensor:
    """[min(k, 3) + 1, 3, v, v, v] law of (a, e - 1, x1, x2, x3) for rows drafting k tokens.

    Position i < a: the accepted draft, mass min(target, draft); i == a: recovered
    (max(0, target - draft)) if a < k else bonus (target); i > a: later steps (target).
    """
    target, accept, residual = _step_tables(model, setting)
    c0, c1 = PROMPT
    a_max = min(k, 3)
    law = torch.zeros(a_max + 1, 3, VOCAB, VOCAB, VOCAB, dtype=torch.float64)
    for a in range(a_max + 1):
        pos = [accept if i < a else (residual if a < k else target) if i == a else target for i in range(3)]
        law[a, min(a + 1, 3) - 1] = pos[0][c0, c1][:, None, None] * pos[1][c1][:, :, None] * pos[2]
    return law


# ------------------------------------------------------------------- the verifiers


def engine_chain(draft_ids, draft_probs, target_probs, uniforms, lengths):
    """The engine's chain verifier, one row (request) at a time, as Speculator.verify calls
    it: row b's first lengths[b] drafts, lengths[b] + 1 target rows and uniforms."""
    accepted, next_token = [], []
    for b, k in enumerate(lengths.tolist()):
        res = verify_chain_sampled(draft_ids[b, :k], None if draft_probs is None else draft_probs[b, :k],
                                   target_probs[b, :k + 1], uniforms[b, :k + 1])
        accepted.append(res.accepted)
        next_token.append(res.next_token)
    return torch.tensor(accepted, dtype=torch.int64), torch.tensor(next_token, dtype=torch.int64)


def engine_tree(parents, node_tokens, target_probs, uniforms):
    """The engine's tree verifier row by row: (deepest accepted node [rows], next token [rows])."""
    last, next_token = [], []
    for b in range(node_tokens.shape[0]):
        res = verify_tree_sampled(parents, node_tokens[b], target_probs[b], uniforms[b])
        last.append(res.accepted_nodes[-1] if res.accepted_nodes else 0)
        next_token.append(res.next_token)
    return torch.tensor(last, dtype=torch.int64), torch.tensor(next_token, dtype=torch.int64)


# ------------------------------------------------------------------- broken verifiers


def chain_variant(draft_ids, draft_probs, target_probs, uniforms, lengths,
                  recover_from_target=False, drop_bonus=False):
    """Compact copy of the chain rule with switchable bugs; next_token -1 = no token."""
    rows = torch.arange(draft_ids.shape[0])
    k = draft_ids.shape[1]
    at_target = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).double()
    at_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).double()
    passed = (uniforms[:, :k].double() * at_draft < at_target) & (torch.arange(k) < lengths[:, None])
    accepted = passed.long().cumprod(-1).sum(-1)
    final = target_probs[rows, accepted].double()
    rejected = accepted < lengths
    if not recover_from_target:
        residual = (final - draft_probs[rows, accepted.clamp(max=k - 1)].double()).clamp(min=0.0)
        final = torch.where(rejected[:, None], residual, final)
    next_token = sample_from(final, uniforms[rows, lengths])
    if drop_bonus:
        next_token = torch.where(~rejected & (lengths > 0), -1, next_token)
    return accepted, next_token


# ------------------------------------------------------------------- simulation


@dataclass
class ChainRun:
    tokens: torch.Tensor  # [rows, 3]
    first_a: torch.Tensor  # [rows] drafts accepted in the first step
    first_e: torch.Tensor  # [rows] tokens the first step contributed to the first 3
    gammas: torch.Tensor  # [rows]
    drafted: int = 0
    accepted: int = 0
    recovered: int = 0
    bonus: int = 0


def simulate_chain(setting: Setting, seed: int, rows: int = ROWS, model: Model = MODEL,
                   verifier=None, unwarped_ratio=False, target_temperature=None) -> ChainRun:
    """Speculative decoding of the first 3 tokens for `rows` independent requests."""
    gen = torch.Generator().manual_seed(seed)
    target_params = setting.target
    if target_temperature is not None:  # bug: verification warps at another temperature
        target_params = dataclasses.replace(target_params, temperature=target_temperature)
    gammas = torch.tensor(setting.gammas).repeat(rows // len(setting.gammas) + 1)[:rows]
    hist = torch.zeros(rows, 5, dtype=torch.int64)  # context (2) + generated (3)
    hist[:, 0], hist[:, 1] = PROMPT
    count = torch.zeros(rows, dtype=torch.int64)
    run = ChainRun(hist[:, 2:], torch.full((rows,), -1), torch.zeros(rows, dtype=torch.int64), gammas)
    while bool((count < 3).any()):
        live = torch.nonzero(count < 3).squeeze(-1)
        n, lengths = len(live), gammas[live]
        k = int(lengths.max())
        prev2 = hist[live, count[live]]
        prev1 = hist[live, count[live] + 1]
        drafts, draft_probs, ctx = [], [], [(prev2, prev1)]
        for _ in range(k):
            logits = model.draft_logits[prev2, prev1]  # [n, vocab]
            if setting.deterministic:
                token = logits.argmax(-1)
                probs = torch.nn.functional.one_hot(token, VOCAB).float()
            else:
                probs = warp_probs(logits, setting.draft_params)
                token = sample_from(probs, torch.rand(n, generator=gen))
                if unwarped_ratio:  # bug: ratio with the draft's unwarped softmax
                    probs = torch.softmax(logits, dim=-1)
            drafts.append(token)
            draft_probs.append(probs)
            prev2, prev1 = prev1, token
            ctx.append((prev2, prev1))
        draft_ids = torch.stack(drafts, 1) if k else torch.zeros(n, 0, dtype=torch.int64)
        dprobs = torch.stack(draft_probs, 1) if k else torch.zeros(n, 0, VOCAB)
        target_probs = torch.stack([warp_probs(model.target_logits[a, b], target_params) for a, b in ctx], 1)
        uniforms = torch.rand(n, k + 1, generator=gen)
        if verifier is None:
            accepted, next_token = engine_chain(draft_ids, None if setting.deterministic else dprobs,
                                                target_probs, uniforms, lengths)
        else:
            accepted, next_token = verifier(draft_ids, dprobs, target_probs, uniforms, lengths)
        has_next = next_token >= 0
        emitted = torch.cat([draft_ids, torch.zeros(n, 1, dtype=torch.int64)], 1)
        emitted[torch.arange(n), accepted] = next_token.clamp(min=0)
        emit_count = accepted + has_next.long()
        drafting = lengths > 0
        run.drafted += int(lengths.sum())
        run.accepted += int(accepted.sum())
        run.recovered += int((drafting & (accepted < lengths)).sum())
        run.bonus += int((drafting & (accepted == lengths) & has_next).sum())
        first = run.first_a[live] < 0
        run.first_a[live[first]] = accepted[first]
        run.first_e[live[first]] = torch.minimum(emit_count[first], 3 - count[live[first]])
        for j in range(k + 1):
            pos = count[live] + j
            keep = (j < emit_count) & (pos < 3)
            hist[live[keep], 2 + pos[keep]] = emitted[keep, j]
        count[live] = (count[live] + emit_count).clamp(max=3)
    return run


def token_counts(tokens: torch.Tensor) -> torch.Tensor:
    flat = (tokens[:, 0] * VOCAB + tokens[:, 1]) * VOCAB + tokens[:, 2]
    return torch.bincount(flat, minlength=VOCAB**3).double()


def chi_lossless(run: ChainRun, setting: Setting):
    return pooled_chisquare(token_counts(run.tokens).numpy(), exact_tokens(MODEL, setting.target).numpy())


def chi_step_law(run: ChainRun, setting: Setting, model: Model = MODEL):
    strata = []
    for k in sorted(set(setting.gammas)):
        rows = run.gammas == k
        law = exact_step_law(model, setting, k)
        a_cap = run.first_a[rows].clamp(max=law.shape[0] - 1)
        cells = (a_cap * 3 + (run.first_e[rows] - 1)) * VOCAB**3 + (
            (run.tokens[rows, 0] * VOCAB + run.tokens[rows, 1]) * VOCAB + run.tokens[rows, 2])
        strata.append((torch.bincount(cells, minlength=law.numel()).double().numpy(), law.flatten().numpy()))
    return stratified_chisquare(strata)


# ------------------------------------------------------------------- trees

# Root, two candidates at depth 1 (draft top-1, top-2), two after the first, one after the second.
TREE_PARENTS = (-1, 0, 0, 1, 1, 2)
TREE_RANKS = (0, 0, 1, 0, 1, 0)  # draft top-k rank of each node's token
TREE_PATHS = torch.tensor([[0, 0], [1, 0], [2, 0], [1, 3], [1, 4], [2, 5]])  # [n, depth]: path nodes
TREE_DEPTHS = torch.tensor([0, 1, 1, 2, 2, 2])


def tree_variant(parents, node_tokens, target_probs, uniforms, remove_rejected=True):
    """Compact copy of the tree rule; remove_rejected=False keeps rejected children in the
    residual (the bug). Returns (last accepted node [rows], next token [rows])."""
    children = [[c for c in range(len(parents)) if parents[c] == node] for node in range(len(parents))]
    rows = torch.arange(node_tokens.shape[0])
    node = torch.zeros_like(rows)
    residual = target_probs[:, 0].double().clone()
    for _ in range(3):
        chosen = torch.full_like(rows, -1)
        for slot in range(2):
            child = torch.tensor([c[slot] if slot < len(c) else -1 for c in children])[node]
            trying = (child >= 0) & (chosen < 0)
            safe = child.clamp(min=1)
            token = node_tokens[rows, safe]
            ok = trying & (uniforms[rows, safe - 1].double() * residual.sum(-1) < residual[rows, token])
            chosen = torch.where(ok, child, chosen)
            if remove_rejected:
                gone = trying & ~ok
                residual[rows[gone], token[gone]] = 0.0
        moved = chosen >= 0
        node = torch.where(moved, chosen, node)
        residual = torch.where(moved[:, None], target_probs[rows, node].double(), residual)
        if not bool(moved.any()):
            break
    return node, sample_from(residual, uniforms[:, -1])


@dataclass
class TreeRun:
    tokens: torch.Tensor  # [rows, 3]
    steps: int = 0
    accepted_by_depth: tuple = (0, 0)  # row-steps accepting >= 1 and 2 nodes
    proposed: int = 0


def simulate_tree(params: SamplingParams, seed: int, rows: int = ROWS, model: Model = MODEL,
                  verifier=None) -> TreeRun:
    """Medusa-style tree speculation: the candidates are the drafter's top-k tokens."""
    gen = torch.Generator().manual_seed(seed)
    hist = torch.zeros(rows, 5, dtype=torch.int64)
    hist[:, 0], hist[:, 1] = PROMPT
    count = torch.zeros(rows, dtype=torch.int64)
    run = TreeRun(hist[:, 2:])
    depth_hits = [0, 0]
    while bool((count < 3).any()):
        live = torch.nonzero(count < 3).squeeze(-1)
        n = len(live)
        prev2, prev1 = hist[live, count[live]], hist[live, count[live] + 1]
        top1 = model.draft_logits[prev2, prev1].topk(2, dim=-1).indices  # [n, 2]
        after_a = model.draft_logits[prev1, top1[:, 0]].topk(2, dim=-1).indices
        after_b = model.draft_logits[prev1, top1[:, 1]].topk(1, dim=-1).indices
        node_tokens = torch.stack([prev1, top1[:, 0], top1[:, 1], after_a[:, 0], after_a[:, 1], after_b[:, 0]], 1)
        ctx = [(prev2, prev1)] + [(prev1, node_tokens[:, c]) if TREE_PARENTS[c] == 0
                                  else (node_tokens[:, TREE_PARENTS[c]], node_tokens[:, c]) for c in range(1, 6)]
        target_probs = torch.stack([warp_probs(model.target_logits[a, b], params) for a, b in ctx], 1)
        uniforms = torch.rand(n, len(TREE_PARENTS), generator=gen)
        if verifier is None:
            last, next_token = engine_tree(TREE_PARENTS, node_tokens, target_probs, uniforms)
        else:
            last, next_token = verifier(TREE_PARENTS, node_tokens, target_probs, uniforms)
        depth = TREE_DEPTHS[last]
        run.steps += n
        run.proposed += n * (len(TREE_PARENTS) - 1)
        depth_hits[0] += int((depth >= 1).sum())
        depth_hits[1] += int((depth >= 2).sum())
        emitted = torch.cat([node_tokens.gather(1, TREE_PATHS[last]), torch.zeros(n, 1, dtype=torch.int64)], 1)
        emitted[torch.arange(n), depth] = next_token
        for j in range(3):
            pos = count[live] + j
            keep = (j <= depth) & (pos < 3)
            hist[live[keep], 2 + pos[keep]] = emitted[keep, j]
        count[live] = (count[live] + depth + 1).clamp(max=3)
    run.accepted_by_depth = tuple(depth_hits)
    return run


# ------------------------------------------------------------------- tests


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: thread start-up costs more than it saves on a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SETTINGS = (
    Setting("t1.0", sp(1.0)),
    Setting("t0.7-topk5", sp(0.7, top_k=5)),
    Setting("t1.0-topp0.8", sp(1.0, top_p=0.8)),
    Setting("t0.7-topk6-topp0.9", sp(0.7, top_k=6, top_p=0.9)),
    # not a bug: rejection sampling is exact for any draft distribution
    Setting("t0.7-topk5-draft-t1.3", sp(0.7, top_k=5), draft=sp(1.3)),
    Setting("t1.0-topp0.9-deterministic-draft", sp(1.0, top_p=0.9), deterministic=True),
)
BROKEN_SETTING = Setting("t0.7-topk5", sp(0.7, top_k=5))
TREE_SETTINGS = (sp(1.0), sp(0.7, top_k=5), sp(0.7, top_p=0.9))


def _assert_mix(accepted: int, recovered: int, bonus: int, label: str) -> None:
    emitted = accepted + recovered + bonus
    for name, count in (("accepted", accepted), ("recovered", recovered), ("bonus", bonus)):
        assert count >= 0.05 * emitted, f"{label}: {name} tokens are {count}/{emitted} < 5%"


def test_stats_util_against_scipy_and_under_the_null():
    import numpy as np
    from scipy import stats

    probs = np.array([0.4, 0.3, 0.2, 0.1])
    observed = np.array([380, 320, 195, 105])
    ours = pooled_chisquare(observed, probs)
    ref = stats.chisquare(observed, 1000 * probs)
    assert ours.dof == 3 and abs(ours.statistic - ref.statistic) < 1e-9 and abs(ours.pvalue - ref.pvalue) < 1e-12
    assert pooled_chisquare(np.array([999, 0, 0, 1]), np.array([0.5, 0.5, 0.0, 0.0])).pvalue == 0.0
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    # many rare cells: pooled bins all reach 5 expected, and the level holds under the null
    rng = np.random.default_rng(0)
    skewed = rng.dirichlet(np.full(300, 0.3))
    pvalues = [pooled_chisquare(rng.multinomial(2000, skewed), skewed).pvalue for _ in range(400)]
    assert 0.02 <= np.mean(np.array(pvalues) < 0.05) <= 0.09
    assert 0.06 <= np.mean(np.array(pvalues) < 0.10) <= 0.15


def test_exact_step_law_sums_to_target_joint():
    for setting in SETTINGS:
        for k in (1, 2, 3, 5):
            law = exact_step_law(MODEL, setting, k)
            torch.testing.assert_close(law.sum((0, 1)), exact_tokens(MODEL, setting.target), rtol=0, atol=1e-12)


def test_chain_sampling_matches_target_distribution():
    pvalues, report = [], []
    for index, setting in enumerate(SETTINGS):
        run = simulate_chain(setting, seed=1000 + index)
        assert run.drafted > 0 and run.accepted > 0
        _assert_mix(run.accepted, run.recovered, run.bonus, setting.name)
        for label, result in (("tokens", chi_lossless(run, setting)), ("step", chi_step_law(run, setting))):
            pvalues.append(result.pvalue)
            report.append(f"{setting.name}/{label}: chi2={result.statistic:.1f} dof={result.dof} p={result.pvalue:.4f}")
    adjusted = holm(pvalues)
    print("\n".join(f"{r} holm={a:.4f}" for r, a in zip(report, adjusted)))
    assert min(adjusted) >= ALPHA, "\n".join(report)


VARIANTS = {
    "unwarped_draft_ratio": dict(unwarped_ratio=True),
    "recovered_from_target": dict(verifier=lambda *a: chain_variant(*a, recover_from_target=True)),
    "bonus_dropped": dict(verifier=lambda *a: chain_variant(*a, drop_bonus=True)),
    "target_other_temperature": dict(target_temperature=1.0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_broken_chain_variant_is_detected(variant):
    run = simulate_chain(BROKEN_SETTING, seed=77, **VARIANTS[variant])
    assert run.drafted > 0 and run.accepted > 0
    lossless, step = chi_lossless(run, BROKEN_SETTING), chi_step_law(run, BROKEN_SETTING)
    print(f"{variant}: tokens chi2={lossless.statistic:.0f} dof={lossless.dof} p={lossless.pvalue:.3g}; "
          f"step chi2={step.statistic:.0f} dof={step.dof} p={step.pvalue:.3g} impossible={step.impossible}")
    if variant == "bonus_dropped":
        # Lossless but slower: the next step samples that position from the target itself.
        assert lossless.pvalue > ALPHA
        assert step.pvalue < 1e-6 and step.impossible > 0
    else:
        assert lossless.pvalue < 1e-6
        assert step.pvalue < 1e-6


def test_chain_variant_harness_is_faithful():
    """Without bugs the test's copy of the rule reproduces the library token for token."""
    real = simulate_chain(BROKEN_SETTING, seed=5, rows=3000)
    copy = simulate_chain(BROKEN_SETTING, seed=5, rows=3000, verifier=chain_variant)
    assert torch.equal(real.tokens, copy.tokens) and torch.equal(real.first_a, copy.first_a)


def test_tree_sampling_matches_target_distribution():
    pvalues, report = [], []
    for index, params in enumerate(TREE_SETTINGS):
        run = simulate_tree(params, seed=2000 + index)
        at_least_one, both = run.accepted_by_depth
        accepted = at_least_one + both  # accepted nodes
        bonus = both  # depth-2 nodes are leaves: accepting one means a bonus token
        _assert_mix(accepted, run.steps - bonus, bonus, f"tree {params}")
        assert run.proposed > 0
        result = pooled_chisquare(token_counts(run.tokens).numpy(), exact_tokens(MODEL, params).numpy())
        pvalues.append(result.pvalue)
        report.append(f"tree T={params.temperature} top_k={params.top_k} top_p={params.top_p}: "
                      f"chi2={result.statistic:.1f} dof={result.dof} p={result.pvalue:.4f}")
    adjusted = holm(pvalues)
    print("\n".join(f"{r} holm={a:.4f}" for r, a in zip(report, adjusted)))
    assert min(adjusted) >= ALPHA, "\n".join(report)


def test_tree_variant_harness_is_faithful_and_bug_is_detected():
    params = TREE_SETTINGS[0]
    real = simulate_tree(params, seed=9, rows=3000)
    copy = simulate_tree(params, seed=9, rows=3000, verifier=tree_variant)
    assert torch.equal(real.tokens, copy.tokens)
    broken = simulate_tree(params, seed=78, verifier=lambda *a: tree_variant(*a, remove_rejected=False))
    assert broken.accepted_by_depth[0] > 0
    result = pooled_chisquare(token_counts(broken.tokens).numpy(), exact_tokens(MODEL, params).numpy())
    print(f"tree, rejected child kept in residual: chi2={result.statistic:.0f} dof={result.dof} p={result.pvalue:.3g}")
    assert result.pvalue < 1e-6
