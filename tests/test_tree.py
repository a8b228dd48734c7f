# The context tree: spans, per-level KV counts, beta, split noise, per-chunk selections, the path.
import random

import pytest

import tree


def test_paper_example_and_exact_counts():
    nodes = tree.search(1, 1024, 3, 8)[0]
    assert [(n.start, n.end, n.level, n.n_kept) for n in nodes] == [
        (0, 512, 1, 32), (512, 768, 2, 32), (768, 896, 3, 32), (896, 1024, 3, 32)]
    assert [len(n) / n.n_kept for n in nodes] == [16, 8, 4, 4]   # alpha: 1/16, 1/8, 1/4 kept
    assert [(n.start, n.end, n.n_kept) for n in tree.search(1, 100, 3, 8)[0]] == [
        (0, 50, 3), (50, 75, 3), (75, 87, 3), (87, 100, 3)]
    assert tree.node_budget(1024, 2, 8) == [0, 42, 43]            # 42 + 43 + 43 = 1024 / 8
    for C, h in [(1024, 3), (128, 3), (1024, 4)]:   # Table 10: beta 1, 2 keep 1 in beta everywhere
        for beta in (1, 2):
            assert [len(n) / n.n_kept for n in tree.search(1, C, h, beta)[0]] == [beta] * (h + 1)
    # a fractional beta: 80 KVs of 256, 16 in each of 5 nodes, so 16-token leaves keep every token
    assert [(len(n), n.n_kept) for n in tree.search(1, 256, 4, 3.2)[0]] == [
        (128, 16), (64, 16), (32, 16), (16, 16), (16, 16)]


@pytest.mark.parametrize("C,h,beta", [(1024, 3, 8), (1024, 2, 8), (1024, 4, 8), (1024, 3, 1),
                                      (1024, 1, 8), (128, 3, 8), (100, 3, 8), (77, 2, 4),
                                      (64, 3, 16), (1000, 4, 3), (256, 4, 3.2)])
def test_spans_partition_the_chunk_and_keep_the_budget(C, h, beta):
    rng = random.Random(0)
    for sigma in (0.0, 0.2):
        for _ in range(5):
            select = lambda lefts, rights: [rng.random() < 0.5 for _ in lefts]
            trees = tree.search(4, C, h, beta, select, sigma=sigma, rng=rng)
            for nodes in trees:
                assert nodes[0].start == 0 and nodes[-1].end == C
                assert all(a.end == b.start for a, b in zip(nodes, nodes[1:]))
                assert sorted(n.level for n in nodes) == list(range(1, h)) + [h, h]
                assert all(1 <= n.n_kept <= len(n) for n in nodes)
            kept = [sorted((n.level, n.n_kept) for n in nodes) for nodes in trees]
            assert all(k == kept[0] for k in kept)   # every chunk keeps the same counts
    halves = tree.search(1, C, h, beta)[0]
    total, target = sum(n.n_kept for n in halves), max(h + 1, round(C / beta))
    if beta > 2 and target / (h + 1) <= min(len(n) for n in halves):   # level-wise: C / beta
        assert total == target and max(n.n_kept for n in halves) - min(
            n.n_kept for n in halves) <= 1


def test_split_noise_scales_with_the_node_and_is_shared_per_level():
    # Eq. 1: b = floor(l/2 - eps), eps ~ N(0, (sigma l)^2), l the length of the node being split;
    # one draw per level shared by all chunks (Algorithm 1's randn(1))
    class Fixed:   # a standard normal draw of 0.5, always
        def gauss(self, mu, sigma):
            return mu + 0.5 * sigma
    right, left = tree.search(2, 1024, 3, 8, lambda lefts, rights: [True, False], sigma=0.2,
                              rng=Fixed())
    # level 1: l = 1024, eps = 102.4, b = 409; level 2: [409, 1024) (l = 615, b = 246) and
    # [0, 409) (l = 409, b = 163); level 3: [655, 1024) (b = 147) and [0, 163) (b = 65)
    assert [(n.start, n.end) for n in right] == [(0, 409), (409, 655), (655, 802), (802, 1024)]
    assert [(n.start, n.end) for n in left] == [(0, 65), (65, 163), (163, 409), (409, 1024)]
    rng = random.Random(3)
    trees = tree.search(5, 1024, 3, 8, sigma=0.2, rng=rng)
    assert len({tuple((n.start, n.end) for n in nodes) for nodes in trees}) == 1
    for _ in range(100):   # huge noise: every node still holds its KVs (the clamp)
        assert all(len(n) >= n.n_kept for nodes in tree.search(2, 64, 3, 8, sigma=2.0, rng=rng)
                   for n in nodes)


def test_each_chunk_selects_with_its_own_pair_and_the_path_reads_it_back():
    needles = [700, 100, 1000, 300, 600]

    def select(lefts, rights):   # toward each chunk's own needle
        assert all(lf[1] == rt[0] for lf, rt in zip(lefts, rights))   # siblings
        return [not (lf[0] <= t < lf[1]) for t, lf in zip(needles, lefts)]
    for t, nodes in zip(needles, tree.search(5, 1024, 3, 8, select)):
        spans = tree.path(nodes, 1024)
        assert len(spans) == 3 and all(a <= t < b for a, b in spans) and spans[-1][1] - spans[-1][
            0] == 256
        assert [(n.start, n.end) for n in nodes if n.level == 3] == [
            (spans[-1][0], spans[-1][0] + 128), (spans[-1][0] + 128, spans[-1][1])]


def test_kept_positions():
    assert tree.kept_positions(512, 32, "first")[:3] == [0, 16, 32]   # the released code's
    assert tree.kept_positions(512, 32, "last")[:3] == [15, 31, 47]   # ours: a window's last
    for L, k in [(100, 7), (13, 13), (5, 1), (1000, 33)]:
        for where in ("first", "last"):
            idx = tree.kept_positions(L, k, where)
            assert len(set(idx)) == k and 0 <= min(idx) and max(idx) < L
    assert tree.kept_positions(5, 1, "last") == [4]
