"""Token trees: the shape (breadth-first nodes, parents, depths), the ancestor mask, greedy tree verification, and
SpecInfer's multi-candidate rejection sampling keeping the target's distribution (chi-square over two tokens)."""
from __future__ import annotations

import pytest
import torch

from rooflm.spec_decode.tree import DEFAULT_TREE, TreeShape, attention_mask, tree_tokens, verify_tree
from unit.stat_checks import chi2_ok

CHOICES = [[1, 0], [0], [1], [0, 1], [0, 0]]  # any order in: breadth-first out


def test_a_tree_is_numbered_breadth_first_with_its_parents():
    shape = TreeShape.from_choices(CHOICES)
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert shape.parents == (0, 0, 1, 1, 2) and shape.depths == (1, 1, 2, 2, 2)
    assert shape.top_k() == 2 and shape.depth == 2
    assert tree_tokens(shape, [[7, 9], [3, 5]]) == [7, 9, 3, 5, 3]
    assert shape.within_depth(1).paths == ((0,), (1,))
    default = TreeShape.from_choices(DEFAULT_TREE)
    assert default.num_nodes == len(DEFAULT_TREE) and default.depth == 4


def test_the_mask_lets_a_node_see_itself_and_its_ancestors_only():
    mask = attention_mask(TreeShape.from_choices(CHOICES).parents)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5]}.items():
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("bad, match", [([], "non-empty"), ([[0], [-1]], "ranks >= 0"), ([[0, 1]], "no parent path"),
                                        ([[0], ["a"]], "invalid")])
def test_bad_trees_are_refused(bad, match):
    with pytest.raises(ValueError, match=f"speculative_config.tree=.*{match}|speculative_config.tree: .*{match}"):
        TreeShape.from_choices(bad)


def test_greedy_verification_follows_the_argmax_down_the_tree():
    shape = TreeShape.from_choices(CHOICES)
    tokens = tree_tokens(shape, [[7, 9], [3, 5]])  # nodes: 1=7, 2=9, 3=(7,3), 4=(7,5), 5=(9,3)
    logits = torch.zeros(6, 10)
    logits[0, 9] = logits[2, 3] = logits[5, 8] = 1.0  # root -> 9 (node 2) -> 3 (node 5) -> 8 (extra)
    assert verify_tree(logits, tokens, shape.parents, greedy=True) == ([2, 5], [9, 3, 8])
    logits[0, 9], logits[0, 4] = 0.0, 1.0  # no child of the root is the argmax
    assert verify_tree(logits, tokens, shape.parents, greedy=True) == ([], [4])


def test_tree_sampling_follows_the_target_distribution():
    """Two output tokens at temperature 1 against p(t1) p(t2 | t1): the tree holds two candidates for t1 and two
    for t2 under each; when only one token comes out, t2 is drawn as the next plain step would."""
    v = 6
    g = torch.Generator().manual_seed(0)
    p0 = torch.softmax(2 * torch.randn(v, generator=g), 0)
    p1 = torch.softmax(2 * torch.randn(v, v, generator=g), 1)  # p(t2 | t1)
    p2 = torch.softmax(torch.randn(v, v, v, generator=g), 2)
    shape = TreeShape.from_choices(CHOICES)
    cand = [[int(p0.argmax()), int(p0.argmin())], [1, 4]]  # the likeliest and the least likely first token
    tokens = tree_tokens(shape, cand)
    rows = [p0]
    for path in shape.paths:
        toks = [cand[d][r] for d, r in enumerate(path)]
        rows.append(p1[toks[0]] if len(toks) == 1 else p2[toks[0], toks[1]])
    probs = torch.stack(rows)
    n = 6000
    counts = torch.zeros(v * v)
    accepted = 0
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        path, out = verify_tree(probs, tokens, shape.parents, greedy=False, generator=gen)
        accepted += len(path)
        if len(out) == 1:
            out.append(int(torch.multinomial(p1[out[0]], 1, generator=gen)))
        counts[out[0] * v + out[1]] += 1
    joint = (p0[:, None] * p1).flatten()
    assert chi2_ok(counts, joint)
    assert 0 < accepted < 2 * n  # candidates both accepted and rejected
