"""Token trees: TensorRT-LLM's node order and packed mask (reference §3 test vectors),
validation errors, presets and tree files."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch

from specbuild.speculation.tree import MAX_DEPTH, TreeError, TreeSpec, expected_accepted, list_presets, load_tree, pack_mask, parse_medusa_choices, sparse_tree, tree_attention_mask

DOC_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
MC_SIM_SHA256 = "aec0cf5914091403f1f77e2c4697ab6c2209442c598e16e41092c08392775f4f"


def _words(value: int, words: int) -> list[int]:
    """Split a non-negative int into int32 words, least significant first."""
    out = []
    for _ in range(words):
        word = value & 0xFFFFFFFF
        out.append(word - (1 << 32) if word >= 1 << 31 else word)
        value >>= 32
    return out


@pytest.mark.parametrize("k", range(1, 41))
def test_linear_chain_rows(k):
    rows = k + 1
    words = (rows + 31) // 32
    expected = np.array([_words((1 << (i + 1)) - 1, words) for i in range(rows)], dtype=np.int32)
    causal = np.tril(np.ones((rows, rows), dtype=bool))
    packed = pack_mask(causal)
    assert packed.dtype == np.int32 and packed.shape == (rows, words)
    np.testing.assert_array_equal(packed, expected)
    if k <= MAX_DEPTH:
        chain = TreeSpec.chain(k)
        np.testing.assert_array_equal(chain.packed_mask, expected)
        assert chain.depths == tuple(range(rows))
        assert chain.root_to_leaf == (tuple(range(rows)),)
        assert load_tree(f"chain_{k}") == chain


def test_chain_beyond_depth_limit_is_rejected():
    with pytest.raises(ValueError, match="17"):
        TreeSpec.chain(MAX_DEPTH + 1)
    with pytest.raises(ValueError):
        TreeSpec.chain(0)


def test_documentation_tree():
    tree = TreeSpec.from_paths(DOC_TREE)
    assert tree.packed_mask.ravel().tolist() == [1, 3, 5, 11, 19, 37, 69, 139, 275, 651]
    assert list(tree.depths) == [0, 1, 1, 2, 2, 2, 2, 3, 3, 4]
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 2, 3, 4, 7)
    assert tree.ranks == (-1, 0, 1, 0, 1, 0, 1, 0, 0, 0)
    assert tree.children[0] == (1, 2) and tree.children[1] == (3, 4) and tree.children[9] == ()
    assert tree.leaves == (5, 6, 8, 9)
    assert (0, 1, 3, 7, 9) in tree.root_to_leaf and len(tree.root_to_leaf) == 4
    assert tree.retrieve_indices.shape == (4, 5)
    assert tree.num_drafts == 9 and tree.num_nodes == 10 and tree.max_depth == 4
    # The tensors agree with the numpy arrays.
    assert torch.equal(tree.packed_mask_tensor(), torch.from_numpy(tree.packed_mask.copy()))
    assert tree.position_offsets_tensor().tolist() == list(tree.depths)


def test_mc_sim_7b_63_packed_mask_is_byte_exact():
    tree = load_tree("mc_sim_7b_63")
    packed = tree.packed_mask
    assert packed.shape == (64, 2) and packed.dtype == np.int32
    assert packed[:6].tolist() == [[1, 0], [3, 0], [5, 0], [9, 0], [17, 0], [33, 0]]
    assert tree.paths[62] == (0, 0, 0, 1)
    assert packed[63].tolist() == [2051, -2147483520]
    digest = hashlib.sha256(packed.astype("<i4").tobytes()).hexdigest()
    assert digest == MC_SIM_SHA256


def test_order_is_independent_of_input_order():
    shuffled = list(DOC_TREE)
    random.Random(0).shuffle(shuffled)
    assert TreeSpec.from_paths(shuffled) == TreeSpec.from_paths(DOC_TREE)
    assert hash(TreeSpec.from_paths(shuffled)) == hash(TreeSpec.from_paths(DOC_TREE))


def _brute_force_mask(paths):
    nodes = [()] + [tuple(p) for p in paths]
    n = len(nodes)
    return np.array(
        [[nodes[i][: len(nodes[j])] == nodes[j] for j in range(n)] for i in range(n)], dtype=bool
    )


@pytest.mark.parametrize("name", ["mc_sim_7b_63", "vicuna_7b_stage2", "mc_sim_7b_top25"])
def test_ancestor_mask_matches_prefix_relation(name):
    tree = load_tree(name)
    np.testing.assert_array_equal(tree.ancestor_mask, _brute_force_mask(tree.paths))
    # Breadth-first, lexicographic within a depth.
    assert list(tree.paths) == sorted(tree.paths, key=lambda p: (len(p), p))
    for node, path in enumerate(tree.paths, start=1):
        assert tree.index[path] == node and tree.depths[node] == len(path)


def test_mask_word_count_at_multiples_of_32():
    # n + 1 = 32 and 64 rows: exactly 1 and 2 words, not one short and not one extra.
    for drafts, words in [(31, 1), (32, 2), (63, 2), (64, 3)]:
        paths = [[r] for r in range(min(drafts, 16))]
        paths += [[a, b] for a in range(16) for b in range(16)][: drafts - len(paths)]
        tree = TreeSpec.from_paths(paths)
        assert tree.num_nodes == drafts + 1
        assert tree.mask_words == words and tree.packed_mask.shape == (drafts + 1, words)


def test_arrays_are_read_only():
    tree = TreeSpec.chain(3)
    with pytest.raises(ValueError):
        tree.packed_mask[0, 0] = 7
    with pytest.raises(ValueError):
        tree.ancestor_mask[0, 1] = True


@pytest.mark.parametrize(
    "paths, needle",
    [
        ([], "no paths"),
        ([[0], []], r"\[\] is empty"),
        ([[0], [1, 0]], r"\[1, 0\] lacks its prefix \[1\]"),
        ([[0], [0], [1]], r"\[0\] appears more than once"),
        ([[16]], r"rank 16 outside \[0, 16\)"),
        ([[-1]], r"rank -1"),
        ([[0] * d for d in range(1, 18)], r"depth 17 > 16"),
        ([[0.5]], "non-integer"),
        ("[[0]]", "list of lists"),
    ],
)
def test_validation_errors_name_the_path_and_limit(paths, needle):
    with pytest.raises(ValueError, match=needle):
        TreeSpec.from_paths(paths)


def test_validation_error_is_a_specbuild_error():
    from specbuild.errors import SpecbuildError

    with pytest.raises(SpecbuildError):
        TreeSpec.from_paths([[1, 1]])
    assert issubclass(TreeError, ValueError)


def test_presets_load_and_are_valid():
    names = list_presets()
    assert {"mc_sim_7b_63", "vicuna_7b_stage1", "vicuna_7b_stage2"} <= set(names)
    reference = {
        "mc_sim_7b_63": 63, "vicuna_7b_stage1": 63, "vicuna_7b_stage2": 63,
        "mc_sim_7b_top10": 10, "mc_sim_7b_top25": 25,
    }
    for name in names:
        tree = load_tree(name)
        assert tree.name == name and tree.num_drafts == reference[name]
        assert tree.max_depth <= 4


def test_load_from_json_file(tmp_path):
    listed = tmp_path / "mine.json"
    listed.write_text(json.dumps(DOC_TREE))
    tree = load_tree(str(listed), allow_files=True)
    assert tree == TreeSpec.from_paths(DOC_TREE) and tree.name == "mine"
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"name": "doc", "paths": DOC_TREE}))
    assert load_tree(wrapped, allow_files=True).name == "doc"
    # to_json round-trips through a file.
    again = tmp_path / "again.json"
    again.write_text(load_tree("mc_sim_7b_63").to_json())
    assert load_tree(again, allow_files=True) == load_tree("mc_sim_7b_63")
    # without allow_files (what a request's tree gets) no file is opened, existing or not
    for path in (str(listed), wrapped, "/etc/passwd"):
        with pytest.raises(TreeError, match="never a file"):
            load_tree(path)


def test_request_tree_and_cli_tree_argument(tmp_path):
    from specbuild.speculation.tree import MAX_INLINE_NODES, request_tree, tree_argument

    assert request_tree("mc_sim_7b_63") == load_tree("mc_sim_7b_63")
    assert request_tree([[0], [1], [0, 0]]) == TreeSpec.from_paths([[0], [1], [0, 0]])
    listed = tmp_path / "mine.json"
    listed.write_text(json.dumps(DOC_TREE))
    with pytest.raises(TreeError, match="never a file"):
        request_tree(str(listed))
    with pytest.raises(TreeError, match=f"at most {MAX_INLINE_NODES}"):
        request_tree([[0]] * (MAX_INLINE_NODES + 1))
    # the CLI reads its own file into inline paths; names stay names
    assert tree_argument(str(listed)) == TreeSpec.from_paths(DOC_TREE).paths
    assert tree_argument("chain_3") == "chain_3" and tree_argument(None) is None


@pytest.mark.parametrize(
    "content, needle",
    [
        ("not json", "not valid JSON"),
        ('{"trees": []}', "lacks the 'paths' key"),
        ('"__import__(\'os\')"', "list of paths"),
        ("[[0], [2, 0]]", r"\[2, 0\] lacks its prefix"),
    ],
)
def test_bad_tree_files_name_the_file(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=needle) as info:
        load_tree(str(bad), allow_files=True)
    assert str(bad) in str(info.value)


def test_unknown_tree_name():
    with pytest.raises(ValueError, match="no_such_tree.*mc_sim_7b_63"):
        load_tree("no_such_tree")


def test_medusa_choices_string_round_trip():
    tree = TreeSpec.from_paths([[0], [0, 0], [1], [0, 1]])
    assert tree.medusa_choices_string() == "{0}, {1}, {0, 0}, {0, 1}"
    assert parse_medusa_choices(tree.medusa_choices_string()) == tree
    assert parse_medusa_choices("[[0], [0, 0]]") == TreeSpec.chain(2)
    with pytest.raises(ValueError):
        parse_medusa_choices("__import__('os')")


def test_tree_attention_mask():
    tree = TreeSpec.from_paths(DOC_TREE)
    mask = tree_attention_mask(tree.ancestor_mask_tensor(), past_len=5)
    assert mask.shape == (10, 15) and mask.dtype == torch.bool
    assert mask[:, :5].all()
    assert torch.equal(mask[:, 5:], tree.ancestor_mask_tensor())
    assert tree_attention_mask(tree.ancestor_mask_tensor(), 0).shape == (10, 10)
    with pytest.raises(ValueError, match="past_len"):
        tree_attention_mask(tree.ancestor_mask_tensor(), -1)
    with pytest.raises(ValueError, match="square"):
        tree_attention_mask(torch.ones(2, 3, dtype=torch.bool), 1)


def test_sparse_tree_is_the_best_prefix_closed_tree_of_its_size():
    import itertools

    rng = random.Random(5)
    for trial in range(20):
        heads, ranks = rng.randint(1, 3), rng.randint(1, 3)
        acc = [sorted((rng.random() / ranks for _ in range(ranks)), reverse=True) for _ in range(heads)]
        every = [p for d in range(1, heads + 1) for p in itertools.product(range(ranks), repeat=d)]
        for n in range(1, min(len(every), 6) + 1):
            tree = sparse_tree(acc, n)
            assert tree.num_drafts == n and tree.name == f"sparse_{n}"
            best = max(expected_accepted(TreeSpec.from_paths(c), acc) for c in itertools.combinations(every, n)
                       if all(p[:-1] in c or len(p) == 1 for p in c))  # prefix-closed subsets only
            assert expected_accepted(tree, acc) == pytest.approx(best), (acc, n)


def test_sparse_tree_shapes_and_errors():
    # a sure first guess at every depth and useless others: a chain
    assert sparse_tree([[0.9, 0.01], [0.9, 0.01], [0.9, 0.01]], 3) == TreeSpec.chain(3)
    # a weak second head: width at depth 1 first
    wide = sparse_tree([[0.4, 0.3, 0.2], [0.1, 0.05, 0.01]], 3)
    assert sorted(wide.paths) == [(0,), (1,), (2,)]
    assert expected_accepted(wide, [[0.4, 0.3, 0.2], [0.1, 0.05, 0.01]]) == pytest.approx(0.9)
    with pytest.raises(TreeError, match=r"num_drafts 7 must be an integer in \[1, 6\]"):
        sparse_tree([[0.5, 0.2], [0.5, 0.2]], 7)
    with pytest.raises(TreeError, match="at least one head"):
        sparse_tree([], 1)
