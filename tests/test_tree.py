# The context tree: spans, per-level KV counts, beta, split noise, and per-chunk selections.
import random

import pytest

import tree


def check_partition(nodes, C):
    assert nodes[0].start == 0 and nodes[-1].end == C
    assert all(a.end == b.start for a, b in zip(nodes, nodes[1:]))


def test_paper_example():
    nodes = tree.search(1, 1024, 3, 8)[0]
    assert [(n.start, n.end, n.level, n.n_kept) for n in nodes] == [
        (0, 512, 1, 32), (512, 768, 2, 32), (768, 896, 3, 32), (896, 1024, 3, 32)]
    # alpha doubles down the tree: 1/16, 1/8, 1/4
    assert [len(n) / n.n_kept for n in nodes] == [16, 8, 4, 4]
    assert 1024 / sum(n.n_kept for n in nodes) == 8


@pytest.mark.parametrize("C,h,beta", [(1024, 3, 8), (1024, 2, 8), (1024, 4, 8), (1024, 3, 1),
                                      (1024, 3, 16), (1024, 1, 8), (128, 3, 8), (100, 3, 8),
                                      (77, 2, 4), (64, 3, 64), (1000, 4, 3), (256, 4, 3.2)])
def test_spans_partition_and_budget(C, h, beta):
    rng = random.Random(0)
    for sigma in (0.0, 0.2, 0.1):
        for _ in range(5):
            select = lambda lefts, rights: [rng.random() < 0.5 for _ in lefts]
            trees = tree.search(4, C, h, beta, select, sigma=sigma, rng=rng)
            kept = [sorted((n.level, n.n_kept) for n in nodes) for nodes in trees]
            for nodes in trees:
                check_partition(nodes, C)
                # one per level, two leaves
                assert len(nodes) == h + 1
                assert sorted(n.level for n in nodes) == list(range(1, h)) + [h, h]
                assert all(1 <= n.n_kept <= len(n) for n in nodes)
            # every chunk keeps the same counts per level
            assert all(k == kept[0] for k in kept)
    halves = tree.search(1, C, h, beta)[0]                                   # eps = 0
    total, target = sum(n.n_kept for n in halves), max(h + 1, round(C / beta))
    if target / (h + 1) <= min(len(n) for n in halves if n.level == h):
        # level-wise: exactly C / beta KVs
        assert total == target
        assert max(n.n_kept for n in halves) - min(n.n_kept for n in halves) <= 1
    # beta too small: the same ratio everywhere
    else:
        assert all(n.n_kept == max(1, round(len(n) / beta)) for n in halves if n.level < h)


def test_exact_counts_for_lengths_that_do_not_divide():
    nodes = tree.search(1, 100, 3, 8)[0]
    assert [(n.start, n.end, n.n_kept) for n in nodes] == [(0, 50, 3), (50, 75, 3), (75, 87, 3),
                                                           (87, 100, 3)]
    # 42 + 43 + 43 = 128 = 1024 / 8
    assert tree.node_budget(1024, 2, 8) == [0, 42, 43]
    # beta 1 keeps everything
    assert tree.node_budget(1024, 3, 1) == [0, 512, 256, 128]


def test_a_fractional_beta_can_keep_every_token_of_a_leaf():
    # beta is a ratio, not a count: C 256, h 4, beta 3.2 keeps 80 KVs, 16 in each of 5 nodes, so
    # the 16-token leaves keep every token (config/smollm2_retrieval_cpu.py)
    nodes = tree.search(1, 256, 4, 3.2)[0]
    assert [(len(n), n.n_kept) for n in nodes] == [(128, 16), (64, 16), (32, 16), (16, 16),
                                                   (16, 16)]


@pytest.mark.parametrize("C,h", [(1024, 3), (128, 3), (1024, 2), (1024, 4), (512, 3)])
def test_beta_2_keeps_one_in_two_at_every_level(C, h):
    # Table 10's caption: "For beta in {1,2} ... we set the compression ratio same as the beta for
    # every level"
    nodes = tree.search(1, C, h, 2)[0]
    assert ([len(n) / n.n_kept for n in nodes] == [2.0] * (h + 1)
            and C / sum(n.n_kept for n in nodes) == 2)
    assert tree.node_budget(1024, 3, 2) == [0, 256, 128, 64]
    assert [len(n) / n.n_kept for n in tree.search(1, 1024, 3, 1)[0]] == [1.0] * 4


def test_split_noise_scales_with_the_length_of_the_node_being_split():
    # Eq. 1: b = floor(l/2 - eps), eps ~ N(0, sigma^2), sigma = 0.2 l with l the node's own length.
    # One draw per level is shared by all chunks (Algorithm 1), so after a noisy first split the two
    # chunks below split nodes of different lengths, each with its own sigma.
    class Fixed:   # a "random" source whose standard normal draw is always 0.5
        def gauss(self, mu, sigma):
            return mu + 0.5 * sigma
    # chunk 0 selects the right child, chunk 1 the left one
    go = lambda lefts, rights: [True, False]
    right, left = tree.search(2, 1024, 3, 8, go, sigma=0.2, rng=Fixed())
    # level 1, l = 1024: eps = 102.4, b = 409. Level 2: chunk 0 splits [409, 1024) (l = 615, eps =
    # 61.5, b = 246), chunk 1 splits [0, 409) (l = 409, eps = 40.9, b = 163). Level 3: [655, 1024)
    # (l = 369, b = 147), [0, 163) (b = 65).
    assert [(n.start, n.end) for n in right] == [(0, 409), (409, 655), (655, 802), (802, 1024)]
    assert [(n.start, n.end) for n in left] == [(0, 65), (65, 163), (163, 409), (409, 1024)]


def test_edge_cases_height_1_and_beta_1():
    assert ([(n.start, n.end, n.n_kept) for n in tree.search(1, 64, 1, 8)[0]]
            == [(0, 32, 4), (32, 64, 4)])
    nodes = tree.search(1, 64, 3, 1)[0]
    assert [n.n_kept for n in nodes] == [len(n) for n in nodes]


def test_kept_positions():
    # the released code's choice
    assert tree.kept_positions(512, 32, "first")[:3] == [0, 16, 32]
    assert (tree.kept_positions(512, 32, "last")[:3] == [15, 31, 47]
            and tree.kept_positions(512, 32, "last")[-1] == 511)
    for L, k in [(100, 7), (13, 13), (5, 1), (1000, 33)]:
        for where in ("first", "last"):
            idx = tree.kept_positions(L, k, where)
            assert len(idx) == k and len(set(idx)) == k and 0 <= min(idx) and max(idx) < L
    assert tree.kept_positions(5, 1, "last") == [4]
    with pytest.raises(AssertionError, match="cannot keep 6 KVs from a node of 5 tokens"):
        tree.kept_positions(5, 6)


def test_noise_is_shared_per_level_and_clamped():
    rng = random.Random(3)
    trees = tree.search(5, 1024, 3, 8, sigma=0.2, rng=rng)
    # same eps for all chunks
    assert len({tuple((n.start, n.end) for n in nodes) for nodes in trees}) == 1
    assert [(n.start, n.end) for n in trees[0]] != [(0, 512), (512, 768), (768, 896), (896, 1024)]
    for _ in range(200):   # huge noise: every node still holds its KVs (clamping)
        for nodes in tree.search(2, 64, 3, 8, sigma=2.0, rng=rng):
            assert all(len(n) >= n.n_kept for n in nodes)


def test_each_chunk_uses_its_own_pair():
    # select sees each chunk's own (left, right): select the child that contains chunk i's "needle"
    needles = [700, 100, 1000, 300, 600]
    def select(lefts, rights):
        assert len(lefts) == len(rights) == 5
        # siblings of the same node
        assert all(l[1] == r[0] for l, r in zip(lefts, rights))
        return [not (l[0] <= t < l[1]) for t, l in zip(needles, lefts)]
    for t, nodes in zip(needles, tree.search(5, 1024, 3, 8, select)):
        leaf = [n for n in nodes if n.level == 3]
        assert leaf[0].start <= t < leaf[1].end and leaf[1].end - leaf[0].start == 256
        check_partition(nodes, 1024)


def test_bad_shapes():
    with pytest.raises(AssertionError, match="too short for a tree of height 5"):
        tree.node_budget(16, 5, 2)
    with pytest.raises(AssertionError, match="beta must be >= 1"):
        tree.node_budget(64, 3, 0)
