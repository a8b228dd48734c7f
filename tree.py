"""
The context tree of SharedLLM (paper Sec. 3.2, Algorithm 1), as plain Python on integer spans.

Each context chunk (C tokens) is the root of a binary tree. Walking down from the root, a node of
l tokens is split into a left and a right child at b = floor(l/2 - eps) (Eq. 1; in training eps ~
N(0, (sigma l)^2), 0 at evaluation). A policy pi SELECTS one child, which is split again at the
next level; the other child is PRESERVED. At the last level (h) both children are preserved. The
root is always selected. For h = 3 and a policy that always selects the right child (language
modeling):

    [0 ............................... 1024)              root: selected
    [0 ........ 512) preserved   [512 ........... 1024)    level 1
                     [512 .. 768) preserved  [768 .. 1024) level 2
                                  [768..896) [896..1024)   level 3: both preserved

Every preserved node KEEPS a few of its key/value states, evenly strided. Coarse nodes are
compressed more than fine ones: the ratio alpha = l / l' (tokens / KVs kept) halves at each level
down (alpha_w = 2 alpha_(w+1)). With C = 1024, h = 3, beta = 8 that is 32 KVs from each of 512 /
256 / 128 / 128 tokens: alpha = 16, 8, 4 (the paper's table prints the fractions kept, 1/16, 1/8,
1/4). The overall compression is beta = C / (KVs kept per chunk).

Words, one meaning each: a level is a depth below the root (1 .. h); selected = split further;
preserved = encoded by the lower model; kept = the KVs a preserved node contributes.
This file decides WHICH spans are preserved and HOW MANY KVs each keeps; the neural work lives in
model.py, which passes the policy in as `select`. Run `python tree.py` for annotated examples.
"""
import math
import random
from dataclasses import dataclass


@dataclass
class Node:
    start: int    # span [start, end) inside the chunk
    end: int
    level: int    # 1 = children of the root, h = leaves
    n_kept: int   # how many KVs this preserved node keeps

    def __len__(self):
        return self.end - self.start


def node_budget(chunk_size, height, beta):
    """KVs kept by one preserved node at each level 1..h (index 0 unused)."""
    assert height >= 1, f"tree height must be >= 1, got {height}"
    assert beta >= 1, f"beta must be >= 1, got {beta}"
    # lengths[w]: the preserved (left) node at level w when the right child is always selected
    # and splits are exact (l // 2), [0] the root; at h the shorter leaf. search()'s clamp keeps
    # every node of any other split long enough for its KVs
    lengths, l = [chunk_size], chunk_size
    for _ in range(height):
        lengths.append(l // 2)
        l = l - l // 2
    assert lengths[height] >= 1, (
        f"chunk_size {chunk_size} is too short for a tree of height {height}")
    n_nodes = height + 1                               # one per level 1..h-1, two at level h
    total = max(n_nodes, round(chunk_size / beta))     # KVs kept per chunk
    if beta > 2 and total / n_nodes <= lengths[height]:
        # The paper's level-wise scheme (alpha_w = 2 alpha_(w+1)): every node keeps the same
        # count, so the fraction kept doubles with each level down, exactly so when nodes halve.
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
    # (appendix, Table 10's caption: "For beta in {1,2} ... we set the compression ratio
    # same as the beta for every level").
    return [0] + [max(1, round(lengths[w] / beta)) for w in range(1, height + 1)]


def min_length(budget, height):
    """need[w]: the shortest a node of level w may be: it holds its own KVs if preserved, and if
    selected it splits into two children of level w + 1, each at least need[w + 1] long."""
    need = [0] * (height + 1)
    need[height] = budget[height]
    for w in range(height - 1, 0, -1):
        need[w] = max(budget[w], 2 * need[w + 1])
    return need


def kept_positions(length, k, where="last"):
    """The k positions whose KVs a node of `length` tokens keeps: one per stride window
    [j*l/k, (j+1)*l/k). 'last' keeps each window's last token (ours): the lower model is causal,
    so from its second layer up that token has seen the whole window. 'first' keeps the first
    (what the released code does: the tail of each node is never seen)."""
    assert 1 <= k <= length, f"cannot keep {k} KVs from a node of {length} tokens"
    if where == "last":
        return [(j + 1) * length // k - 1 for j in range(k)]
    assert where == "first", f"keep must be 'last' or 'first', got {where!r}"
    return [j * length // k for j in range(k)]


def search(n_trees, chunk_size, height, beta, select=None, sigma=0.0, rng=None):
    """Split-and-search (Algorithm 1) over n_trees trees at once, one per chunk -> per tree, its
    preserved Nodes in text order. select(lefts, rights): the policy pi at one level, given each
    tree's children as (start, end) -> per tree True if the right child is selected; None: right
    (the paper's language modeling). sigma: the split noise's spread as a fraction of the length l
    of the node being split: 0.2 is Table 6's l/5 (LM), 0.1 its l/10 (SFT), 0 exact halves.
    Algorithm 1 writes half_length / gamma, so its gamma is Table 6's divisor halved. One normal
    draw per level is shared by all chunks (its randn(1)); the last split is noisy too (Eq. 1:
    "any non-leaf node"; Algorithm 1 halves it exactly)."""
    budget = node_budget(chunk_size, height, beta)
    need = min_length(budget, height)
    rng = rng or random
    selected = [(0, chunk_size)] * n_trees             # the node being split, per tree: the root
    preserved = [[] for _ in range(n_trees)]
    for level in range(1, height + 1):
        z = rng.gauss(0.0, 1.0) if sigma > 0 else 0.0  # this level's draw, shared by all trees
        lefts, rights = [], []
        for s, e in selected:
            lo, hi = need[level], (e - s) - need[level]
            assert lo <= hi, f"node [{s},{e}) too short to split at level {level} (needs 2x{lo})"
            eps = z * sigma * (e - s)                  # eps ~ N(0, (sigma l)^2), Eq. 1
            # b clamped to [lo, hi] (ours): both children can hold their KVs and split again
            # (at beta 1 the clamp leaves no room: no noise)
            b = min(max(math.floor((e - s) / 2 - eps), lo), hi)
            lefts.append((s, s + b))
            rights.append((s + b, e))
        if level == height:                            # leaves: both children are preserved
            for i in range(n_trees):
                preserved[i] += [Node(*lefts[i], level, budget[level]),
                                 Node(*rights[i], level, budget[level])]
            break
        right = [True] * n_trees if select is None else list(select(lefts, rights))
        assert len(right) == n_trees, f"select returned {len(right)} choices for {n_trees} trees"
        for i in range(n_trees):
            selected[i], other = (rights[i], lefts[i]) if right[i] else (lefts[i], rights[i])
            preserved[i].append(Node(*other, level, budget[level]))
    for nodes in preserved:   # text order (tests/test_tree.py: they tile the chunk)
        nodes.sort(key=lambda nd: nd.start)
    return preserved


def path(nodes, chunk_size):
    """The spans the search selected, from the root down, read back from one chunk's preserved
    nodes: at each level the preserved node is the sibling of the selected one."""
    lo, hi, spans = 0, chunk_size, [(0, chunk_size)]
    for nd in sorted(nodes, key=lambda nd: (nd.level, nd.start))[:-2]:   # all but the leaves
        lo, hi = (nd.end, hi) if nd.start == lo else (lo, nd.start)
        spans.append((lo, hi))
    return spans


def describe(nodes, chunk_size, keep="last"):
    """An annotated text picture of one chunk's preserved nodes."""
    total = sum(nd.n_kept for nd in nodes)
    lines = []
    for nd in sorted(nodes, key=lambda nd: (nd.level, nd.start)):
        at = kept_positions(len(nd), nd.n_kept, keep)
        shown = ", ".join(str(nd.start + i) for i in at[:3]) + (", ..." if len(at) > 3 else "")
        lines.append(f"  {'  ' * (nd.level - 1)}level {nd.level}: "
                     f"[{nd.start:5d}, {nd.end:5d})  {len(nd):5d} tokens"
                     f" -> {nd.n_kept:4d} KVs (ratio 1/{len(nd) / nd.n_kept:.3g})  keeps {shown}")
    lines.append(f"  {len(nodes)} preserved nodes, {total} KVs for {chunk_size} tokens: "
                 f"beta = {chunk_size / total:g}")
    return "\n".join(lines)


if __name__ == "__main__":
    C, h, beta = 1024, 3, 8
    print(f"chunk_size C={C}, height h={h}, beta={beta}, the right child always selected "
          "(language modeling):")
    nodes = search(1, C, h, beta)[0]
    print(describe(nodes, C))
    assert [(nd.start, nd.end, nd.n_kept) for nd in nodes] == [
        (0, 512, 32), (512, 768, 32), (768, 896, 32), (896, 1024, 32)]

    needle = 300   # a policy that selects the child holding token 300 (what a question asks for)
    select = lambda lefts, rights: [not (lf[0] <= needle < lf[1]) for lf in lefts]
    print(f"\na policy that selects the child holding token {needle}:")
    print(describe(search(1, C, h, beta, select)[0], C))

    print("\ntraining-time split noise, sigma = 0.2 (the paper's l/5), seed 0:")
    print(describe(search(1, C, h, beta, sigma=0.2, rng=random.Random(0))[0], C))
    print("  Every node of a level keeps the same count, so a noisy split moves the ratios too:\n"
          "  here level 2 (549 tokens) ends up coarser than level 1 (319). Coarse-to-fine holds\n"
          "  on average over the draws, not on every one; the evaluation splits exactly.")

    print("\nbeta 2: no level-wise scheme fits (the leaves would keep every token), "
          "so every level keeps 1 in 2:")
    nodes = search(1, C, h, 2)[0]
    print(describe(nodes, C))
    assert [len(nd) / nd.n_kept for nd in nodes] == [2, 2, 2, 2]
