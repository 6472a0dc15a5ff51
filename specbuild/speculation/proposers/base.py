"""The contract every drafter implements, and the records that cross it.

A drafter (a `Proposer`) declares what it reads of the target's pass (`Needs`), drafts
(`propose` -> `Draft`), learns from each verified pass of the sequences that use it
(`observe` <- `Observation`), and keeps its own per-sequence state, which it trims in
`rollback` and frees in `release`. The speculator (speculation/speculator.py) is the only
caller; nothing of a drafter's state lives on the sequence.

A chain draft is `tokens` [k] (+ the probabilities each was sampled from, for rejection
sampling; None for deterministic drafters, which count as one-hot). A tree draft also
carries `parents` / `depths` / `tree_mask` (node 0 = the root = the sequence's last
token, not part of `tokens`; node i >= 1 is tokens[i - 1]).

Everything else the engine, the speculator and the benchmarks ask of a drafter is a defaulted
method of `DrafterBase` (what models it runs, what its drafting costs, whether it refuses a
request, its counters, its snapshot), so nothing is found by probing for attributes; a drafter
overrides what applies to it.

Adding a drafter: write its module with a `DrafterBase` subclass, a `build(ctx)` function, and
optionally its `Options` dataclass (its server-side settings: `--<name>-<field>` on the CLI,
`<name>_<field>` Triton parameters, EngineConfig.drafters[name]) and its `GUARANTEE` row
(engine/guarantees.py), then add one line to proposers/registry.py
(tests/speculation/test_registry.py does it with a toy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # annotations only: the command line reads drafters' Options without loading torch
    import torch


@dataclass
class Draft:
    tokens: list[int]  # [k] drafted token ids (tree: nodes 1..n in node order)
    probs: torch.Tensor | None = None  # [k, vocab] distribution each token was drawn from; None = one-hot
    parents: tuple[int, ...] | None = None  # tree only: [n + 1], root -1
    depths: list[int] | None = None  # tree only: [n] depth of nodes 1..n (>= 1)
    tree_mask: torch.Tensor | None = None  # tree only: [n + 1, n + 1] bool ancestor mask, root row 0
    method: str = ""
    sources: list[str] | None = None  # per drafted token / node: where it came from (None: `method`)
    scores: list[float] | None = None  # per node: the drafter's estimate that the target accepts it (None: none)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def head(self, n: int) -> "Draft":
        """The draft's first n nodes (a tree's parents come before their children, so they form
        a tree), with what the drafter said of each."""
        if not 0 < n <= len(self.tokens):
            raise ValueError(f"a draft's head of {n} nodes: the draft has {len(self.tokens)}")
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.parents is None else tuple(self.parents[:n + 1]),
                     None if self.depths is None else list(self.depths[:n]),
                     None if self.tree_mask is None else self.tree_mask[:n + 1, :n + 1],
                     self.method, None if self.sources is None else self.sources[:n],
                     None if self.scores is None else self.scores[:n])


@dataclass(frozen=True)
class Needs:
    """What a drafter reads of the target's pass, beyond the tokens themselves."""

    hidden: bool = False  # the final-normed hidden state of the row that chose the sequence's last token
    aux_layers: tuple[int, ...] = ()  # target layers whose inputs it reads at every row of the text (EAGLE-3)
    logits: bool = False  # every verified row's logits with that row's input token (token recycling)
    tree: bool = False  # it drafts token trees (Draft.parents), not chains
    parts: tuple[str, ...] = ()  # other drafters whose proposals it merges (they learn from its sequences too)


@dataclass
class Observation:
    """What one target pass settled for a sequence, handed to the drafters it uses.

    `length` tokens of the sequence's text have their K/V in the target's cache after the
    pass (the chunk plus the accepted drafts); the text's next token is not cached yet.
    """

    length: int
    start: int  # cache position of the pass's first row for this sequence
    method: str | None  # the drafter whose draft was verified (None: a plain pass)
    tokens: list[int] = field(default_factory=list)  # input token of each row of `logits`
    logits: torch.Tensor | None = None  # [1 + k, vocab] the target's raw rows (Needs.logits); None: none read
    hidden: torch.Tensor | None = None  # [H] the row that chose the new last token (Needs.hidden)
    features: torch.Tensor | None = None  # [m, F] rows start .. start + m - 1 of the kept text (Needs.aux_layers)
    sources: dict | None = None  # candidate_sources of the verified draft (proposers/base.candidate_sources)


def candidate_sources(draft: Draft, accepted: int, accepted_nodes: tuple[int, ...] = ()) -> dict[str, list[list[int]]]:
    """{source: [[offered, accepted] at position 1, 2, ...]}: a chain offers token j at position
    j (the first `accepted` accepted); a tree node offers at its depth, accepted when on the
    accepted path (`accepted_nodes`, node indices 1..n)."""
    out: dict[str, list[list[int]]] = {}
    n = len(draft.tokens)
    names = draft.sources if draft.sources is not None and len(draft.sources) == n else [draft.method or "?"] * n
    on_path = set(accepted_nodes)
    for i in range(n):
        pos = draft.depths[i] if draft.depths is not None else i + 1
        ok = (i + 1) in on_path if draft.parents is not None else i < accepted
        rows = out.setdefault(names[i], [])
        while len(rows) < pos:
            rows.append([0, 0])
        rows[pos - 1][0] += 1
        rows[pos - 1][1] += int(ok)
    return out


class Unavailable(Exception):
    """A drafter's build(ctx) refuses this configuration; the message says why (engine.unavailable)."""


@dataclass(frozen=True)
class DrafterOptions:
    """Base of a drafter module's `Options`: a frozen dataclass of its server-side settings,
    checked in its own __post_init__ (ValueError naming the setting as `<name>_<field>`)."""

    def check_files(self) -> None:
        """Check the files these settings name where they are written down for a server to read
        later (tritonserver_repo.RepoConfig); ValueError when one is wrong. Default: none named."""


@dataclass(frozen=True)
class NoOptions(DrafterOptions):
    """The settings of a drafter that has none (a module without an `Options` dataclass)."""


def option_fields(options_cls) -> list:
    """The dataclass fields of a drafter's Options (its settings), in order."""
    return list(fields(options_cls))


@dataclass(frozen=True)
class EngineSettings:
    """The engine-wide settings a drafter may read (EngineConfig's fields of the same names)."""

    device: str = "cpu"
    block_size: int = 16
    prefix_cache: bool = True
    load_draft: bool = True  # False: the draft model runs elsewhere (MineDraft's draft rank)


@dataclass
class DrafterContext:
    """What a drafter's `build(ctx)` may read when the engine opens a bundle: the bundle, the
    target, the engine-wide settings a drafter may use, and its own `options` (its module's
    Options, from EngineConfig.drafters)."""

    bundle_dir: str
    meta: Any  # bundle.BundleMeta
    settings: EngineSettings
    target: Any  # model.decoder.Decoder
    cache: Any  # the target's PagedKVCache
    max_draft_len: int
    max_seq_len: int
    # role name -> (its Decoder with shared weights filled in and formats planned, vocab_map or None)
    load_model: Callable[[str], tuple[Any, torch.Tensor | None]]
    built: dict = field(default_factory=dict)  # the drafters built before this one, by name
    encode: Callable[[str], list[int]] | None = None  # the target's tokenizer, no special tokens (warm corpora)
    options: Any = NoOptions()  # this drafter's Options (registry.build_all sets it per drafter)

    @property
    def roles(self) -> dict:
        return self.meta.roles

    @property
    def vocab_size(self) -> int:
        return self.target.config.vocab_size


class Proposer(Protocol):
    """A drafter. `propose` must not change the target's cache; drafters with their own
    state keep it per sequence (keyed by seq.seq_id) and bring it in line in `rollback`."""

    name: str
    needs: Needs

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        """Draft up to gammas[i] tokens for seqs[i] (0 = none). None or empty = no draft."""
        ...

    def observe(self, seq, obs: Observation) -> None:
        """A pass of a sequence that uses this drafter was settled (called before `rollback`)."""
        ...

    def rollback(self, seq, length: int) -> None:
        """The target's cache for seq now holds `length` tokens: drop any drafter state past it."""
        ...

    def release(self, seq) -> None:
        """seq finished or aborted: free drafter state (e.g. its KV blocks)."""
        ...


class DrafterBase:
    """Defaults for the Proposer protocol: reads nothing extra, learns nothing, holds nothing;
    and the rest of the contract, each method defaulted to "does not apply": it runs no model
    of its own, costs nothing to draft beyond what the speculator measures, takes no tree a
    request chooses, reports no counters, keeps no learned state worth a snapshot."""

    name = ""
    needs = Needs()
    # a request may name the token tree it drafts (`SpeculationConfig.tree`; Medusa, token
    # recycling): such a drafter overrides validate_tree
    request_tree = False
    # drafters whose candidates this one's include (suffix: prompt lookup's, its local index
    # being the request's own text): `auto` leaves out a drafter that one it uses covers
    covers: tuple[str, ...] = ()
    verify_cost: Callable[[int], float] | None = None  # width -> seconds, once costs are measured
    emit: Callable | None = None  # callable(seq, kind, detail): failure-mode events, or None

    def propose(self, seqs: list, gammas: list[int]) -> list[Draft | None]:
        raise NotImplementedError(f"drafter {type(self).__name__} does not define propose")

    def observe(self, seq, obs: Observation) -> None:
        pass

    def rollback(self, seq, length: int) -> None:
        pass

    def release(self, seq) -> None:
        pass

    def holds_continuation(self, seq) -> bool:
        """Whether this drafter holds seq's continuation for certain enough that `auto` should
        draft with it without weighing (suffix: an earlier answer to the same prompt end that
        the output still follows). Default: never."""
        return False

    # prefix caching, for drafters that read the target's features at every row (aux_layers):
    # a sequence may take from the cache only the leading tokens whose features the drafter
    # still holds, and is handed them when it does
    def stored_prefix(self, seq, limit: int) -> int:
        """Leading tokens of seq's text (at most `limit`) whose features this drafter keeps."""
        return 0

    def adopt(self, seq, start: int, end: int) -> None:
        """The target took positions start..end of seq from the prefix cache."""

    # ---- costs (speculation/calibration.py) ---------------------------------------------------
    def models(self) -> list[tuple[Any, Any]]:
        """The (Decoder, its cache) pairs this drafter runs a step of per drafted token (a draft
        model): calibration times them, `compile=True` compiles them. Default: none."""
        return []

    def cost_key(self) -> Any:
        """For a drafter whose drafting cost is measured by `level_cost` (a head: EAGLE,
        Medusa): what that cost depends on besides the machine (the cost cache's key).
        Default None: no such cost."""
        return None

    def level_cost(self) -> float:
        """Seconds one depth of a draft costs (asked only where cost_key is not None)."""
        return 0.0

    def set_verify_cost(self, verify: Callable[[int], float] | None) -> None:
        """The measured verify cost by width (seconds), once calibration has run: drafters that
        size their trees by it keep it in `verify_cost` (None: their fixed stand-in)."""
        self.verify_cost = verify

    # ---- requests -----------------------------------------------------------------------------
    def validate_tree(self, tree) -> Any:
        """A request's tree resolved and checked (request_tree drafters; raises RequestError)."""
        return None

    def check_request(self, spec, max_draft_len: int) -> None:
        """Refuse (RequestError) speculation settings this drafter cannot serve; called for the
        requests whose method may draft with it (its name, or auto). Default: a request_tree
        drafter checks the request's tree and its node count against the bundle's draft room."""
        if not self.request_tree:
            return
        tree = self.validate_tree(spec.tree)
        if tree.num_drafts > max_draft_len:
            from specbuild.errors import RequestError

            raise RequestError(f"tree {tree.name or spec.tree!r} has {tree.num_drafts} nodes; the bundle's "
                               f"max_draft_len is {max_draft_len} (recompile with --max-draft-len)")

    # ---- reporting and benchmarks ----------------------------------------------------------------
    def set_emit(self, emit: Callable | None) -> None:
        """Route this drafter's failure-mode events to emit(seq, kind, detail); None: off."""
        self.emit = emit

    def stats(self) -> dict:
        """The drafter's own counters, as its module names them. Default: none."""
        return {}

    def engine_stats(self) -> dict:
        """What the drafter adds to Engine.stats() (and so to /metrics and /health's load): flat
        keys that begin with its name (the suffix store's suffix_store_tokens). Default: none."""
        return {}

    def snapshot(self) -> Any:
        """A copy of what the drafter learned across requests (benchmarks restore it so every
        row and repeat starts alike); None: nothing."""
        return None

    def restore(self, snap: Any) -> None:
        """Put back a snapshot; None: a fresh start."""
