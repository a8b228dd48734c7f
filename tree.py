"""
The context tree of SharedLLM (paper Sec. 3.2, Algorithm 1), as plain Python on integer spans.

Each context chunk C_i (length C) is the root of a binary tree. Walking down from the root, a node
of length l is split into left/right at b = floor(l/2 - eps) (eps ~ N(0, sigma^2) in training, 0 at
evaluation). A policy picks the child to EXPAND; the other child is PRESERVED. At the last level
(height h) both children are preserved. For h = 3 and "always right" (language modeling):

    [0 ............................... 1024)              root: always expanded
    [0 ........ 512) preserved   [512 ........... 1024)    level 1
                     [512 .. 768) preserved  [768 .. 1024) level 2
                                  [768..896) [896..1024)   level 3: both preserved

Every preserved node keeps a few of its key/value states, evenly strided. Coarse nodes are
compressed more than fine ones: the node's compression ratio alpha = l / l' (tokens / KVs kept)
halves at each level down (alpha_w = 2 alpha_(w+1)), which with C=1024, h=3, beta=8 is 32 KVs from
each of 512 / 256 / 128 / 128 tokens: alpha = 16, 8, 4 (the paper's table prints the fractions
kept, 1/16, 1/8, 1/4).
Overall compression beta = C / (KVs kept per chunk). The split noise applies at every level, the
leaves' split too (Eq. 1: "any non-leaf node"; Algorithm 1's pseudocode halves the last node
exactly).

This file only decides WHICH spans are kept and HOW MANY KVs each keeps. The neural work (encoding
spans with the lower model, the query-aware similarity) lives in model.py: it passes `decide` in.
Run `python tree.py` for annotated examples.
"""
import math
import random
from dataclasses import dataclass


@dataclass
class Node:
    start: int   # span [start, end) inside the chunk
    end: int
    level: int   # 1 = children of the root, h = leaves
    kept: int    # number of KV states this node contributes

    def __len__(self):
        return self.end - self.start


def node_budget(chunk_size, height, beta):
    """KVs kept by one preserved node at each level 1..h (index 0 unused)."""
    assert height >= 1, f"tree height must be >= 1, got {height}"
    assert beta >= 1, f"beta must be >= 1, got {beta}"
    # node lengths along the always-right path with exact halves (left child = floor(l/2)); the
    # split's clamp in search() keeps every other node long enough for its KVs
    lengths, l = [chunk_size], chunk_size
    for _ in range(height):
        lengths.append(l // 2)
        l = l - l // 2
    assert lengths[height] >= 1, (
        f"chunk_size {chunk_size} is too short for a tree of height {height}")
    n_nodes = height + 1                               # one per level 1..h-1, two at level h
    total = max(n_nodes, round(chunk_size / beta))     # KVs kept per chunk
    if beta > 2 and total / n_nodes <= lengths[height]:
        # The paper's level-wise scheme: every node keeps the same count,
        # so the fraction kept doubles with each level down (nodes halve).
        base = total // n_nodes
        budget = [0] + [base] * height
        spare = total - base * n_nodes
        # Any remainder goes to the finest levels first.
        for w in range(height, 0, -1):
            # Both leaves get one more, or neither.
            cost = 2 if w == height else 1
            if spare >= cost:
                budget[w], spare = budget[w] + 1, spare - cost
        return budget
    # beta 1 or 2 (or any beta whose leaves would need more KVs than they have tokens):
    # no level-wise scheme fits, and the paper then keeps the same ratio beta at every level
    # (appendix, Table 7's caption: "For beta in {1,2} ... we set the compression ratio
    # same as the beta for every level").
    return [0] + [max(1, round(lengths[w] / beta)) for w in range(1, height + 1)]


def min_length(budget, height):
    """Shortest node length each level must keep so that everything below it still fits."""
    need = [0] * (height + 1)
    need[height] = budget[height]
    for w in range(height - 1, 0, -1):
        need[w] = max(budget[w], 2 * need[w + 1])
    return need


def keep_index(length, k, where="last"):
    """k positions out of a node of `length` tokens: one per stride window [j*l/k, (j+1)*l/k).
    'last' keeps each window's last token: the lower model is causal, so from its second layer up
    that token has seen the whole window (the first layer's K/V are the token's own). 'first'
    keeps the first (what the released code does: the tail of each node is never seen)."""
    assert 1 <= k <= length, f"cannot keep {k} KVs from a node of {length} tokens"
    if where == "last":
        return [(j + 1) * length // k - 1 for j in range(k)]
    assert where == "first", f"keep must be 'last' or 'first', got {where!r}"
    return [j * length // k for j in range(k)]


def search(n_chunks, chunk_size, height, beta, decide=None, noise=0.0, rng=None):
    """Split-and-search over n_chunks trees at once.
    Returns, per chunk, its preserved nodes in text order.
    decide(level, lefts, rights) -> list of bool (True = expand the right child) for all chunks
    together; None means "always right" (language modeling).
    noise: sigma = l / noise, l the length of the node being split (0 = exact halves).
    One standard normal draw per level is shared by all chunks (Algorithm 1's randn(1)), scaled by
    each chunk's own l: after a noisy split the nodes being split differ in length from chunk to
    chunk."""
    budget = node_budget(chunk_size, height, beta)
    need = min_length(budget, height)
    rng = rng or random
    current = [(0, chunk_size)] * n_chunks             # the node being expanded, per chunk
    preserved = [[] for _ in range(n_chunks)]
    for level in range(1, height + 1):
        z = rng.gauss(0.0, 1.0) if noise > 0 else 0.0  # this level's draw, shared by all chunks
        lefts, rights = [], []
        for s, e in current:
            lo, hi = need[level], (e - s) - need[level]
            assert lo <= hi, f"node [{s},{e}) too short to split at level {level} (needs 2x{lo})"
            # eps ~ N(0, sigma^2) (Eq. 1), sigma = l / noise (the paper's Table 5: l/5, l/10).
            eps = z * (e - s) / noise if noise > 0 else 0.0
            # b clamped to [need, l - need]: both children can hold their KVs and split again
            # (at beta 1 or 2 the clamp leaves no room: no noise).
            b = min(max(math.floor((e - s) / 2 - eps), lo), hi)
            lefts.append((s, s + b))
            rights.append((s + b, e))
        if level == height:                            # leaves: both children are preserved
            for i in range(n_chunks):
                preserved[i] += [Node(*lefts[i], level, budget[level]),
                                 Node(*rights[i], level, budget[level])]
            break
        go_right = [True] * n_chunks if decide is None else list(decide(level, lefts, rights))
        assert len(go_right) == n_chunks, (
            f"decide returned {len(go_right)} choices for {n_chunks} chunks")
        for i in range(n_chunks):
            kept_span, current[i] = (lefts[i], rights[i]) if go_right[i] else (rights[i], lefts[i])
            preserved[i].append(Node(*kept_span, level, budget[level]))
    # Invariants: spans tile the chunk, no gap, no overlap.
    for nodes in preserved:
        nodes.sort(key=lambda nd: nd.start)
        assert nodes[0].start == 0 and nodes[-1].end == chunk_size
        assert all(a.end == b.start for a, b in zip(nodes, nodes[1:]))
        assert all(1 <= nd.kept <= len(nd) for nd in nodes)
    return preserved


def describe(nodes, chunk_size, keep="last"):
    """An annotated text picture of one chunk's preserved nodes."""
    kept = sum(nd.kept for nd in nodes)
    lines = []
    for nd in sorted(nodes, key=lambda nd: (nd.level, nd.start)):
        idx = keep_index(len(nd), nd.kept, keep)
        shown = ", ".join(str(nd.start + i) for i in idx[:3]) + (", ..." if len(idx) > 3 else "")
        lines.append(f"  {'  ' * (nd.level - 1)}level {nd.level}: "
                     f"[{nd.start:5d}, {nd.end:5d})  {len(nd):5d} tokens"
                     f" -> {nd.kept:4d} KVs (ratio 1/{len(nd) / nd.kept:g})  keeps {shown}")
    lines.append(f"  {len(nodes)} preserved nodes, {kept} KVs for {chunk_size} tokens: "
                 f"beta = {chunk_size / kept:g}")
    return "\n".join(lines)


if __name__ == "__main__":
    C, h, beta = 1024, 3, 8
    print(f"chunk_size C={C}, height h={h}, beta={beta}, policy 'right' (language modeling):")
    nodes = search(1, C, h, beta)[0]
    print(describe(nodes, C))
    assert [(nd.start, nd.end, nd.kept) for nd in nodes] == [
        (0, 512, 32), (512, 768, 32), (768, 896, 32), (896, 1024, 32)]

    needle = 300   # pretend the query is about the token at position 300: a policy that follows it
    decide = lambda level, lefts, rights: [not (l[0] <= needle < l[1]) for l in lefts]
    print(f"\npolicy 'query' steered toward token {needle} "
          "(the query resembles that part of the chunk):")
    print(describe(search(1, C, h, beta, decide)[0], C))

    print("\ntraining-time noise (sigma = l/5), one eps per level shared by all chunks, seed 0:")
    print(describe(search(1, C, h, beta, noise=5.0, rng=random.Random(0))[0], C))

    print("\nbeta 2: no level-wise scheme fits (the leaves would keep every token), "
          "so every level keeps 1 in 2:")
    nodes = search(1, C, h, 2)[0]
    print(describe(nodes, C))
    assert [len(nd) / nd.kept for nd in nodes] == [2, 2, 2, 2]

    print("\nother shapes (beta as measured):")
    for C2, h2, b2 in [(1024, 2, 8), (1024, 4, 8), (1024, 3, 1), (1024, 3, 16),
                       (128, 3, 2), (128, 3, 8), (100, 3, 8)]:
        nodes = search(1, C2, h2, b2)[0]
        print(f"  C={C2:5d} h={h2} beta={b2:2d}: spans {[(nd.start, nd.end) for nd in nodes]}"
              f" KVs {[nd.kept for nd in nodes]} -> beta {C2 / sum(nd.kept for nd in nodes):.3g}")
