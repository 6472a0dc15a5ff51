"""Token trees for tree speculation (Medusa-style choice paths).

A tree is a set of *paths*: each path lists, per depth, the top-k rank of the guess
taken at that depth (`[0, 1]` = the best first guess, then the second-best guess after
it). The root (the last accepted token) is implicit. Node order, the ancestor mask and
TensorRT-LLM's packed int32 mask follow the GPT attention plugin's rules
(TensorRT-LLM v0.19, `spec_decoding_*` inputs) exactly:

- row 0 is the root; nodes 1..n are the paths sorted by (len, 4-bit packed prefix,
  first level most significant): breadth-first, lexicographic within a depth;
- mask[i][j] is True iff node j is node i or one of its ancestors (root included);
- bit j of a packed row is bit j % 32 of word j // 32, stored as int32.

Everything is derived once per `TreeSpec` (cached on the frozen instance). Past KV
tokens are not part of the tree mask; `tree_attention_mask` adds them (all visible).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from specbuild.errors import SpecbuildError

MAX_DEPTH = 16  # 4-bit prefix packing into 64 bits
MAX_RANK = 16  # ranks must fit 4 bits
PRESET_FILE = "data/trees/medusa_trees.json"
_CHAIN_NAME = re.compile(r"^chain_(\d+)$")


class TreeError(SpecbuildError, ValueError):
    """A token tree (paths, preset name or tree file) that is not valid."""


def _prefix_key(path: tuple[int, ...]) -> tuple[int, int]:
    """Sort key of §3: (depth, ranks packed 4 bits each, first level most significant)."""
    packed = 0
    for rank in path:
        packed = (packed << 4) | rank
    return len(path), packed


def _validate(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Check the §3 limits and return the paths as tuples (input order)."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise TreeError(f"tree paths must be a list of lists of ranks, got {type(paths).__name__}")
    if len(paths) == 0:
        raise TreeError("tree has no paths: need at least 1 path (e.g. [[0]])")
    out: list[tuple[int, ...]] = []
    for path in paths:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
            raise TreeError(f"tree path {path!r} is not a list of ranks")
        if len(path) == 0:
            raise TreeError("tree path [] is empty: every path needs at least 1 rank")
        if len(path) > MAX_DEPTH:
            raise TreeError(f"tree path {list(path)} has depth {len(path)} > {MAX_DEPTH}")
        for rank in path:
            if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
                raise TreeError(f"tree path {list(path)} has non-integer rank {rank!r}")
            if not 0 <= rank < MAX_RANK:
                raise TreeError(f"tree path {list(path)} has rank {rank} outside [0, {MAX_RANK})")
        out.append(tuple(int(r) for r in path))
    seen: set[tuple[int, ...]] = set()
    for path in out:
        if path in seen:
            raise TreeError(f"tree path {list(path)} appears more than once")
        seen.add(path)
    for path in out:
        for cut in range(1, len(path)):
            if path[:cut] not in seen:
                raise TreeError(
                    f"tree path {list(path)} lacks its prefix {list(path[:cut])}: "
                    "paths must be prefix-closed"
                )
    return tuple(out)


def pack_mask(mask: np.ndarray) -> np.ndarray:  # [rows, ceil(cols / 32)] int32
    """Pack a boolean mask [rows, cols] into TensorRT-LLM's int32 words (bit j of a row
    is bit j % 32 of word j // 32, least significant first; bit 31 reads negative)."""
    mask = np.asarray(mask, dtype=bool)
    assert mask.ndim == 2
    rows, cols = mask.shape
    words = (cols + 31) // 32
    padded = np.zeros((rows, words * 32), dtype=np.uint64)
    padded[:, :cols] = mask
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))  # [32]
    packed = (padded.reshape(rows, words, 32) * weights).sum(axis=-1, dtype=np.uint64)
    return packed.astype(np.uint32).view(np.int32)


@dataclass(frozen=True)
class TreeSpec:
    """A validated token tree. `paths` are stored in node order (node i = paths[i - 1]);
    equality and hashing use the paths only, not the name."""

    paths: tuple[tuple[int, ...], ...]
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(_validate(self.paths), key=_prefix_key))
        object.__setattr__(self, "paths", ordered)

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], name: str | None = None) -> "TreeSpec":
        """Build from Medusa-style choice paths in any order; raises TreeError (ValueError)."""
        if isinstance(paths, (str, bytes)):
            raise TreeError(f"tree paths must be a list of lists of ranks, got {paths!r}")
        return cls(tuple(paths), name)

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        """A single chain of k drafts (each the top-1 guess): [[0], [0, 0], ...]."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DEPTH:
            raise TreeError(f"chain length {k!r} must be an integer in [1, {MAX_DEPTH}]")
        return cls(tuple((0,) * d for d in range(1, k + 1)), f"chain_{k}")

    # ---- sizes ------------------------------------------------------------------------
    @property
    def num_drafts(self) -> int:
        """n: draft nodes, root excluded (TensorRT-LLM's max_draft_len for this tree)."""
        return len(self.paths)

    @property
    def num_nodes(self) -> int:
        """n + 1: rows of every per-node array, root included."""
        return len(self.paths) + 1

    @cached_property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def mask_words(self) -> int:
        """ceil((n + 1) / 32): int32 words per packed mask row."""
        return (self.num_nodes + 31) // 32

    # ---- structure (tuples, index = node) ---------------------------------------------
    @cached_property
    def index(self) -> dict[tuple[int, ...], int]:
        """Path -> node index (root () -> 0)."""
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Parent node of each node; the root's is -1."""
        return (-1,) + tuple(self.index[p[:-1]] for p in self.paths)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (root 0): TensorRT-LLM's position offsets."""
        return (0,) + tuple(len(p) for p in self.paths)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Top-k rank of each node among the guesses at its depth; the root's is -1."""
        return (-1,) + tuple(p[-1] for p in self.paths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node in node order (so ascending rank)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for node in range(1, self.num_nodes):
            kids[self.parents[node]].append(node)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(1, self.num_nodes) if not self.children[i])

    @cached_property
    def root_to_leaf(self) -> tuple[tuple[int, ...], ...]:
        """Node indices from the root (0) to each leaf, leaves in node order."""
        out = []
        for leaf in self.leaves:
            chain = [leaf]
            while self.parents[chain[-1]] != -1:
                chain.append(self.parents[chain[-1]])
            out.append(tuple(reversed(chain)))
        return tuple(out)

    # ---- arrays (read-only numpy; fresh torch tensors) --------------------------------
    @cached_property
    def ancestor_mask(self) -> np.ndarray:  # [n + 1, n + 1] bool
        """mask[i, j] = node j is node i or an ancestor of node i."""
        mask = np.zeros((self.num_nodes, self.num_nodes), dtype=bool)
        for node in range(self.num_nodes):
            walk = node
            while walk != -1:
                mask[node, walk] = True
                walk = self.parents[walk]
        mask.setflags(write=False)
        return mask

    @cached_property
    def packed_mask(self) -> np.ndarray:  # [n + 1, ceil((n + 1) / 32)] int32
        """TensorRT-LLM's spec_decoding_packed_mask rows for this tree."""
        packed = pack_mask(self.ancestor_mask)
        packed.setflags(write=False)
        return packed

    @cached_property
    def retrieve_indices(self) -> np.ndarray:  # [num_leaves, max_depth + 1] int64
        """root_to_leaf padded with -1 to max_depth + 1 columns."""
        out = np.full((len(self.leaves), self.max_depth + 1), -1, dtype=np.int64)
        for row, path in enumerate(self.root_to_leaf):
            out[row, : len(path)] = path
        out.setflags(write=False)
        return out

    def ancestor_mask_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.ancestor_mask, dtype=torch.bool, device=device)

    def packed_mask_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.packed_mask, dtype=torch.int32, device=device)

    def position_offsets_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.int32, device=device)

    # ---- serialisation ----------------------------------------------------------------
    def to_json(self) -> str:
        """{"name": ..., "paths": [...]} in node order; `load_tree` reads it back."""
        body: dict = {"paths": [list(p) for p in self.paths]}
        if self.name is not None:
            body = {"name": self.name, **body}
        return json.dumps(body)

    def medusa_choices_string(self) -> str:
        """Triton parameter form: "{0}, {0, 0}, {1}, ..." (node order)."""
        return ", ".join("{" + ", ".join(str(r) for r in p) + "}" for p in self.paths)


def sparse_tree(rank_acc: Sequence[Sequence[float]], num_drafts: int, name: str | None = None) -> TreeSpec:
    """The tree of `num_drafts` nodes with the most expected accepted drafts, given measured
    head accuracies (Medusa's sparse-tree construction): rank_acc[h][k] is how often head
    h's rank-k guess was the target's token on held-out answers; a node's value is the
    product of rank_acc along its path (heads taken as independent), and a tree's expected
    accepted drafts is the sum of its node values. A child is never worth more than its
    parent, so taking the best frontier node each time is optimal and prefix-closed."""
    import heapq

    heads = len(rank_acc)
    if heads < 1 or any(len(r) < 1 for r in rank_acc):
        raise TreeError("rank accuracies need at least one head with at least one rank")
    ranks = min(min(len(r) for r in rank_acc), MAX_RANK)
    limit = sum(ranks ** d for d in range(1, min(heads, MAX_DEPTH) + 1))
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int) or not 1 <= num_drafts <= limit:
        raise TreeError(f"num_drafts {num_drafts!r} must be an integer in [1, {limit}] for {heads} heads "
                        f"x {ranks} ranks")
    frontier = [(-float(rank_acc[0][k]), (k,)) for k in range(ranks)]
    heapq.heapify(frontier)
    paths = []
    while len(paths) < num_drafts:
        value, path = heapq.heappop(frontier)
        paths.append(path)
        if len(path) < min(heads, MAX_DEPTH):
            for k in range(ranks):
                heapq.heappush(frontier, (value * float(rank_acc[len(path)][k]), path + (k,)))
    return TreeSpec.from_paths(paths, name or f"sparse_{num_drafts}")


def expected_accepted(tree: TreeSpec, rank_acc: Sequence[Sequence[float]]) -> float:
    """Expected accepted drafts per pass of `tree` under the same independence model."""
    total = 0.0
    for path in tree.paths:
        p = 1.0
        for depth, rank in enumerate(path):
            p *= float(rank_acc[depth][rank]) if depth < len(rank_acc) and rank < len(rank_acc[depth]) else 0.0
        total += p
    return total


def parse_medusa_choices(text: str, name: str | None = None) -> TreeSpec:
    """Inverse of `medusa_choices_string` (also accepts the "[[0], [0, 0]]" form)."""
    stripped = text.strip()
    if not re.fullmatch(r"[\s\d,{}\[\]]*", stripped) or not stripped:
        raise TreeError(f"medusa choices {text!r} must look like '{{0}}, {{0, 0}}, {{1}}'")
    groups = re.findall(r"[{\[]([\d,\s]*)[}\]]", stripped.replace("[[", "[").replace("]]", "]"))
    paths = [[int(t) for t in g.split(",") if t.strip()] for g in groups]
    return TreeSpec.from_paths(paths, name)


def tree_attention_mask(
    tree_mask: torch.Tensor,  # [n, n] bool, ancestor mask of one sequence's tree tokens
    past_len: int,
) -> torch.Tensor:  # [n, past_len + n] bool
    """One sequence's attention mask: every past KV row visible, then the tree block."""
    if isinstance(past_len, bool) or not isinstance(past_len, int) or past_len < 0:
        raise ValueError(f"past_len {past_len!r} must be an integer >= 0")
    tree_mask = torch.as_tensor(tree_mask, dtype=torch.bool)
    if tree_mask.ndim != 2 or tree_mask.shape[0] != tree_mask.shape[1]:
        raise ValueError(f"tree_mask shape {tuple(tree_mask.shape)} must be square [n, n]")
    n = tree_mask.shape[0]
    past = torch.ones((n, past_len), dtype=torch.bool, device=tree_mask.device)
    return torch.cat([past, tree_mask], dim=1)


# ---- presets and files -------------------------------------------------------------------
def _preset_table() -> dict[str, list]:
    text = resources.files("specbuild").joinpath(PRESET_FILE).read_text(encoding="utf-8")
    return json.loads(text)["trees"]


def list_presets() -> list[str]:
    """Stored preset names (chain_<k>, k = 1..16, is generated on demand as well)."""
    return sorted(_preset_table())


def _load_file(path: Path) -> TreeSpec:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise TreeError(f"tree file {str(path)!r} cannot be read: {err.strerror or err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TreeError(f"tree file {str(path)!r} is not valid JSON: {err}") from err
    name = path.stem
    if isinstance(body, dict):
        if "paths" not in body:
            raise TreeError(f"tree file {str(path)!r}: object lacks the 'paths' key")
        name = body.get("name") if isinstance(body.get("name"), str) else name
        body = body["paths"]
    if not isinstance(body, list):
        raise TreeError(f"tree file {str(path)!r} must hold a list of paths or {{\"paths\": [...]}}")
    try:
        return TreeSpec.from_paths(body, name)
    except TreeError as err:
        raise TreeError(f"tree file {str(path)!r}: {err}") from err


def load_tree(name_or_file: str | Path | TreeSpec, *, allow_files: bool = False) -> TreeSpec:
    """A preset name (see `list_presets`), `chain_<k>`, or, with `allow_files=True` only, a
    JSON file holding a list of paths or {"paths": [...]} (JSON only; nothing is evaluated).

    Files are for trusted callers (the CLI's --tree, the bundle's own tree.json): a tree
    named by a request (HTTP, Triton) is a preset or inline paths, and opens no file."""
    if isinstance(name_or_file, TreeSpec):
        return name_or_file
    if isinstance(name_or_file, str):
        presets = _preset_table()
        if name_or_file in presets:
            return TreeSpec.from_paths(presets[name_or_file], name_or_file)
        chain = _CHAIN_NAME.match(name_or_file)
        if chain:
            return TreeSpec.chain(int(chain.group(1)))
    if not allow_files:
        raise TreeError(
            f"tree {str(name_or_file)[:80]!r} is not a preset ({', '.join(list_presets())}, "
            f"chain_1..chain_{MAX_DEPTH}); a request names a preset or gives its paths inline "
            "(a list of lists of ranks), never a file"
        )
    path = Path(name_or_file)
    if path.is_file():
        return _load_file(path)
    raise TreeError(
        f"tree {str(name_or_file)!r} is neither a preset ({', '.join(list_presets())}, "
        f"chain_1..chain_{MAX_DEPTH}) nor a readable JSON file"
    )


MAX_INLINE_NODES = 256  # an inline tree (request or CLI) has at most this many paths


def request_tree(value: "str | Sequence[Sequence[int]] | TreeSpec") -> TreeSpec:
    """The tree a request names: a preset or chain name, or inline paths (never a file)."""
    if isinstance(value, (TreeSpec, str)):
        return load_tree(value)
    if isinstance(value, Sequence) and not isinstance(value, bytes) and len(value) > MAX_INLINE_NODES:
        raise TreeError(f"tree has {len(value)} paths; an inline tree has at most {MAX_INLINE_NODES}")
    return TreeSpec.from_paths(value)


def tree_argument(value: str | None) -> "str | tuple[tuple[int, ...], ...] | None":
    """The CLI's --tree: a preset or chain name stays a name; a JSON file (allowed here only,
    the user's own command line) is read now and becomes inline paths for the request."""
    if value is None:
        return None
    if value in _preset_table() or _CHAIN_NAME.match(value):
        return value
    return load_tree(value, allow_files=True).paths
