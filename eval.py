"""
Measure a SharedLLM the way the paper does, with the protocol printed next to every number.

  python eval.py --task=ppl         # perplexity with vs without the compressed context, at several
                                    # chunk counts
  python eval.py --task=passkey     # exact match over context lengths x key depths, with an ASCII
                                    # heatmap
  python eval.py --task=ruler       # RULER's five needle tasks (Hsieh et al., 2024): generated
                                    # answers, RULER's score
  python eval.py --task=search      # where each search (ours, the paper's, right, an oracle) leaves
                                    # the asked values
  python eval.py --task=ablations   # the paper's Table 5 rows, as inference-time changes to one
                                    # checkpoint
  python eval.py --task=passkey --policy=right --out=right.json
                                    # any ablation flag, any task; JSON out

ppl (the paper's last-K protocol, SharedLLM/CEPE eval_lm): a window is n chunks of C tokens (X_C)
and then T tokens (X_D), all from one document; only the last K tokens of X_D are scored; windows
advance by K. Every chunk count scores the very same tokens (the windows are placed for the largest
count), with and without the context; perplexity = exp(mean over windows of the window's mean
loss).
passkey: the key's tokens must all be the argmax given the correct prefix, which is exactly greedy
decoding producing the key.
ruler: RULER's NIAH tasks (data.ruler_sample: its needles, haystacks, question and answer prefix);
the model decodes greedily after the answer prefix, as many tokens as the asked values take written
out (RULER: 128), and the score is RULER's string_match_all, the share of the asked values that the
answer holds.
"""
import json
import math
import random
import sys
import time
import types

import numpy as np
import torch

import data
import tree
import plots
from configurator import (auto_device, check_ranges, config_of, kvs_per_chunk, out_file,
                          package_path, package_paths, parse_overrides)
from checkpoint import base_model, load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = "out"           # a train.py out_dir (or its ckpt.pt), or a LLaMA-2 folder in HF layout
task = "ppl"                # "ppl" | "passkey" | "ruler" | "search" | "ablations"
ruler_tasks = ",".join(data.RULER_TASKS)   # --task=ruler / search: which of RULER's NIAH tasks
                                           # (data.py)
chunks = ""                 # chunk counts, e.g. "4,16,64,256"; "" = 1x, 4x, 16x, 64x the training
                            # n_chunks (ppl: those the longest validation document holds)
block_size = 0              # T: X_D tokens; 0 = as trained
score_last = 0              # K: scored tokens at the end of X_D; 0 = the paper's 256, or T // 2
                            # for a shorter X_D
max_windows = 64            # ppl windows, spread evenly over the validation documents
full = False                # also score the unchanged base model with full attention over X_C + X_D
                            # (the ceiling of a pretrained model; passkey: only within its window)
window = -1                 # W: also score the unchanged base model over the last W tokens only
                            # (what a user does with a document longer than the model's window: cut
                            # it); -1 = its trained window; 0 = no such row
full_budget_s = 300.0       # ppl: skip full attention at lengths predicted to take longer than
                            # this (it is quadratic)
data_dir = ""               # its validation split is read: a folder of .txt, a glob, a file,
                            # stdlib, pydoc, or several joined by commas (data.py); "" = the
                            # checkpoint's own data_dir
depths = "0,0.25,0.5,0.75,1"    # passkey depths: 0 = key at the start of the context, 1 = at its
                                # end
depth_band = -1.0           # each key's depth is uniform within d +- band/2; -1 = the grid's
                            # spacing; 0 = exactly d
samples = 32                # passkey / ruler samples per (chunk count, depth) cell
batch_size = 8
# ablations: inference-time SharedLLM settings (0 / "" = as trained); noise and M need their own
# training run
height = 0                  # tree height h
beta = 0.0                  # compression C / KVs kept per chunk
policy = ""                 # "lexical" (every recipe's) | "vector" (the paper's vector) | "right"
                            # (retrieval off)
chunk_pos = ""              # "plain" | "off" ("random" is read like plain: at inference they are
                            # the same)
keep = ""                   # "last" | "first" token of each stride window
compare = ""                # ablations: more rows from other checkpoints,
                            # "label=out_dir;label=out_dir" (noise off, M)
n_lower = 0                 # M (LLaMA-2 folder only)
chunk_size = 0              # C (LLaMA-2 folder only)
out = ""                    # write the results as JSON here
device = "auto"
dtype = "auto"
seed = 1337
# -----------------------------------------------------------------------------


def ppl_windows(split, n_max, C, T, K, max_windows):
    # -> (document start, p) pairs: X_D = tokens [p+K-T, p+K), its last K positions [p, p+K) are
    # scored, and the tokens they predict are [p+1, p+K+1) (window_tokens); X_C is the n*C tokens
    # before X_D; every window fits n_max chunks inside its own document.
    tokens, offsets = split[:2]
    cand = []
    for d in range(len(offsets) - 1):
        a, b = int(offsets[d]), int(offsets[d + 1])
        # the first scored token with room for n_max chunks before X_D
        first = a + n_max * C + T - K
        # p + K targets need one more token: p + K <= b - 1
        cand += [(a, p) for p in range(first, b - K, K)]
    if not cand:
        raise ValueError(f"no validation document has {n_max * C + T + 1} tokens "
                         f"({n_max} chunks x {C} + T={T} + 1); "
                         f"the longest has {int(np.diff(offsets).max()):,}: ask for fewer --chunks")
    pick = np.linspace(0, len(cand) - 1, min(max_windows, len(cand))).round().astype(int)
    return [cand[i] for i in pick]


def window_tokens(tokens, p, n, C, T, K):
    # one window as a row of n*C + T + 1 tokens: X_C = [p+K-T-n*C, p+K-T), X_D = [p+K-T, p+K), and
    # one more token, so that the last K targets are tokens [p+1, p+K+1)
    return torch.from_numpy(tokens[p + K - T - n * C: p + K + 1].astype(np.int64))


@torch.no_grad()
def score_ppl(model, split, windows, n, C, T, K, context, batch_size, dev, window=0):
    # -> (perplexity, scored tokens): mean over windows of the mean NLL of the last K tokens of X_D.
    # context: "compressed" (SharedLLM), "none" (the upper model on X_D alone), "full" (model.upper,
    # the base LLaMA, with plain causal attention over X_C + X_D as one sequence: the ceiling while
    # that fits the base model's window) or "window" (model.upper the same way over the last
    # `window` tokens only: the text cut to the model's window)
    losses, scored = [], 0
    for i in range(0, len(windows), batch_size):
        w = torch.stack([window_tokens(split[0], p, n, C, T, K)
                         for _, p in windows[i:i + batch_size]]).to(dev)
        # (B, K): the scored tokens [p+1, p+K+1)
        tgt = w[:, -K:]
        # (B, n*C + T) or its last min(W, n*C + T)
        if context in ("full", "window"):
            logits, _ = model.upper(w[:, :-1] if context == "full" else w[:, -1 - window:-1],
                                    last=K)
        else:
            ctx = w[:, : n * C].view(len(w), n, C) if context == "compressed" and n > 0 else None
            logits, _ = model(ctx, w[:, n * C:-1])                     # X_D: (B, T)
        nll = torch.nn.functional.cross_entropy(logits[:, -K:].transpose(1, 2), tgt,
                                                reduction="none")
        losses += nll.mean(1).tolist()                                 # (B,) one mean per window
        scored += nll.numel()
    return math.exp(sum(losses) / len(losses)), scored


def gflops(cfg, tokens, logits, lower_tokens=0, m=0, kv=0):
    # Forward FLOPs of one window (an estimate, in GFLOP): 2 x weights x tokens through the blocks,
    # causal attention (QK^T and AV over half the square: 2 x tokens^2 x dim per layer) and the
    # logits of `logits` positions. SharedLLM adds its lower model (m blocks over lower_tokens: a
    # context tree's nodes hold C tokens in all, so n*C) and m cross-attentions (their query and
    # output projections, QK^T and AV over kv keys).
    # per block
    weights = (2 * cfg.dim * cfg.head_dim * (cfg.n_heads + cfg.n_kv_heads)
               + 3 * cfg.dim * cfg.hidden_dim)
    f = ((2 * weights + 2 * cfg.dim * tokens) * cfg.n_layers * tokens
         + 2 * cfg.dim * cfg.vocab_size * logits)
    f += 2 * weights * m * lower_tokens + 4 * m * cfg.dim * (cfg.dim + kv) * tokens
    return f / 1e9


def timed_ppl(model, split, windows, n, C, T, K, context, g, dev, window=0):
    # score_ppl, and the seconds it took per window
    t0 = time.time()
    ppl, scored = score_ppl(model, split, windows, n, C, T, K, context, g["batch_size"], dev,
                            window)
    return ppl, scored, (time.time() - t0) / len(windows)


def run_ppl(model, splits, ns, C, T, K, g, dev, base=None):
    # Per chunk count, four rows over the very same scored tokens, each with its cost per window:
    # none (the upper model on X_D alone), SharedLLM (X_D and the compressed X_C), window (base, the
    # unchanged base model, over the last W tokens only: what a user does without SharedLLM) and
    # full (base over X_C + X_D, when --full). W = g["window"].
    windows = ppl_windows(splits["val"], max(ns), C, T, K, g["max_windows"])
    cfg, W, M = model.upper.cfg, g["window"], model.scfg.n_lower
    print(f"ppl protocol: {len(windows)} windows from the validation documents (placed for "
          f"{max(ns)} chunks, so every row scores the same tokens); X_D = T = {T} tokens, the last "
          f"K = {K} scored per window. Rows: 'none' = the upper model on X_D alone, 'SharedLLM' = "
          f"X_D with the compressed X_C" + (
          f", 'window' = {base.label} over the last W = {W:,} tokens" if W else "") + (
          f", 'full' = it over X_C + X_D (its window: {cfg.max_seq_len:,} tokens)"
          if g["full"] else ""))
    print(f"{'chunks':>6} {'context tok':>11}  {'row':<9} {'ppl':>9} {'vs none':>7} "
          f"{'s/window':>8} {'GFLOP/window':>12}")
    res, none, last_full = [], None, None
    for n in ns:
        rows = {}   # name -> (perplexity, seconds per window, GFLOP per window, note)
        shared, scored, s = timed_ppl(model, splits["val"], windows, n, C, T, K, "compressed",
                                      g, dev)
        rows["SharedLLM"] = (shared, s, gflops(cfg, T, T, n * C, M,
                                               n * kvs_per_chunk(C, model.scfg.beta)), "")
        # without the context the upper model sees the same X_D: one number for every row
        if none is None:
            ppl, _, s = timed_ppl(model, splits["val"], windows, n, C, T, K, "none", g, dev)
            none = (ppl, s, gflops(cfg, T, T), "")   # logits at every position of X_D
        rows["none"] = none
        if W:
            ppl, _, s = timed_ppl(base, splits["val"], windows, n, C, T, K, "window", g, dev, W)
            rows["window"] = (ppl, s, gflops(cfg, min(W, n * C + T), K),
                              "the whole context fits" if W >= n * C + T else "")
        if g["full"]:
            rows["full"], last_full = full_row(base, splits, windows, n, C, T, K, g, dev, rows,
                                               last_full)
        closed = None
        if "full" in rows and rows["full"][0] and rows["full"][0] < none[0]:
            closed = ((math.log(none[0]) - math.log(shared))
                      / (math.log(none[0]) - math.log(rows["full"][0])))
            rows["SharedLLM"] = rows["SharedLLM"][:3] + (
                f"closes {100 * closed:.0f}% of the gap to full attention",)
        for name in ("none", "SharedLLM", "window", "full"):
            if name in rows:
                ppl, s, gf, note = rows[name]
                print(f"{n:6d} {n * C:11,d}  {name:<9} "
                      + (f"{ppl:9.4f} {ppl / none[0]:7.3f}" if ppl else f"{'-':>9} {'-':>7}")
                      + f" {s:8.2f} {gf:12,.1f}  {note}", flush=True)
        full = rows.get("full", (None,) * 4)
        res.append(dict(n_chunks=n, context_tokens=n * C, with_context=shared,
                        without_context=none[0], ratio=shared / none[0], full_attention=full[0],
                        gap_closed=closed, note=full[3] or None,
                        window_attention=rows.get("window", (None,))[0], window_tokens=W or None,
                        cost={k: dict(s_per_window=v[1], gflop_per_window=v[2])
                              for k, v in rows.items() if v[0]},
                        windows=len(windows), scored_tokens=scored, x_d_tokens=T,
                        scored_per_window=K))
    return res


def full_row(base, splits, windows, n, C, T, K, g, dev, rows, last_full):
    # the full-attention row, -> ((ppl or None, s/window, GFLOP/window, note), (n, s/window) of the
    # last one run).
    # The window row already is full attention when the whole context fits in it; attention is
    # quadratic, so a row is skipped when the last one run predicts more than --full_budget_s.
    L, W = n * C + T, g["window"]
    flops = gflops(base.upper.cfg, L, K)
    if W >= L:   # (its time is the window row's: it predicts the next full row's)
        return rows["window"][:3] + ("= window: the whole context fits",), (n, rows["window"][1])
    guess = last_full[1] * len(windows) * (L / (last_full[0] * C + T)) ** 2 if last_full else 0
    if guess > g["full_budget_s"]:
        return (None, 0.0, flops,
                f"skipped: ~{guess:.0f} s > --full_budget_s={g['full_budget_s']:g}"), last_full
    ppl, _, s = timed_ppl(base, splits["val"], windows, n, C, T, K, "full", g, dev)
    note = "beyond the base model's window" if L > base.upper.cfg.max_seq_len else ""
    return (ppl, s, flops, note), (n, s)


@torch.no_grad()
def passkey_accuracy(model, tok, n, C, depth, band, samples, batch_size, seed, dev, full=False,
                     window=0, none=False):
    # exact match over `samples` haystacks, each key at a depth drawn uniformly from
    # [depth - band/2, depth + band/2] (within 0..1): a single fixed position would test one
    # alignment of the key with the stride windows only. A fixed seed per cell, so every setting
    # sees the same keys and positions. full: the base model reads the haystack and the question as
    # one sequence
    # instead; window: only their last `window` tokens, and a haystack whose window holds no whole
    # copy of the key (it lies before them, or they cut it) is a miss without a forward; none: the
    # upper model reads the question alone. -> (accuracy, forwards, where SharedLLM's search left
    # the keys: the share of haystacks whose key a leaf holds whole, "leaf", or only the coarsest
    # node, "coarse": data.key_placement)
    rng = random.Random(f"{seed}-{n}-{depth}")
    lo, hi = max(0.0, depth - band / 2), min(1.0, depth + band / 2)
    hits, ran, found = 0, 0, dict(leaf=0, between=0, coarse=0)
    for i in range(0, samples, batch_size):
        b = [data.passkey_sample(tok, rng, n, C, depth=rng.uniform(lo, hi))
             for _ in range(min(batch_size, samples - i))]
        ctx, idx, tgt, ql = (t.to(dev) for t in data.collate(b, tok))
        if full or window:
            seq = torch.cat([ctx.flatten(1), idx], 1)                  # (B, n*C + T)
            seq = seq[:, -window:] if window else seq                  # ... or its last W tokens
            keep = [bool(data.key_mentions(row[:-idx.shape[1]].tolist(), t[t != -100].tolist()))
                    for row, t in zip(seq, tgt)]
            seq, idx, tgt = seq[keep], idx[keep], tgt[keep]
            if not len(seq):
                continue
            logits, _ = model.upper(seq, last=idx.shape[1])
        elif none:
            logits, _ = model(None, idx)
        else:   # SharedLLM, and where its search left each key
            memory = model.compress(ctx, idx, ql)
            logits, _ = model.upper(idx, memory=memory)
            for where in data.key_placements(memory.nodes, ctx, tgt):
                found[where] += 1
        scored = tgt != -100
        hits += ((logits.argmax(-1) == tgt) | ~scored).all(-1).sum().item()
        ran += len(tgt)
    return hits / samples, ran, {k: v / samples for k, v in found.items()}


def passkey_xd(tok):
    # X_D of a haystack in tokens: the question and the key less its last token. A key can take a
    # token or two more in one sample than in another (GPT-2 BPE: 2 or 3), so where X_D must fit a
    # window, add XD_MARGIN.
    return sum(map(len, data.passkey_question(tok, 99999))) - 1


XD_MARGIN = 4


def band(g, ds):
    # the depth band of one cell: --depth_band, or by default the grid's spacing (so the cells tile
    # 0..1)
    if g["depth_band"] >= 0:
        return g["depth_band"]
    return 1.0 if len(ds) < 2 else min(b - a for a, b in zip(sorted(ds), sorted(ds)[1:]))


def heatmap(grid, ns, ds, C):
    # rows: depths; columns: context lengths; a shade and the accuracy in percent
    shades = " .:-=+*#%@"
    lines = ["depth \\ context " + "".join(f"{n * C:>9,d}" for n in ns)]
    for d in ds:
        cells = "".join(f" {shades[min(9, int(grid[n, d] * 10))] * 3}{100 * grid[n, d]:4.0f}%"
                        for n in ns)
        lines.append(f"{d:>16.2f}{cells}")
    lines.append(f"{'mean':>16}" + "".join(f"{100 * sum(grid[n, d] for d in ds) / len(ds):8.1f}%"
                                           for n in ns))
    return "\n".join(lines)


def run_passkey(model, tok, ns, C, g, dev, base=None):
    # the passkey grid of SharedLLM and, from the unchanged base model (base), its window row (the
    # last W tokens) and full attention (within its window), each with its cost per haystack
    ds, W, cfg = [float(x) for x in g["depths"].split(",")], g["window"], model.upper.cfg
    xd = passkey_xd(tok)
    question = xd + XD_MARGIN   # X_D at its longest
    grids, res, cost, found = {"none": {}, "SharedLLM": {}, "window": {}, "full": {}}, [], {}, {}
    for n in ns:
        rows = {"none": dict(model=model, none=True), "SharedLLM": dict(model=model)}
        if W:
            rows["window"] = dict(model=base, window=W)
        if g["full"] and n * C + question <= cfg.max_seq_len:
            rows["full"] = dict(model=base, full=True)
        for name, how in rows.items():
            # the window row already read every token: the same forward
            if name == "full" and W >= n * C + question:
                grids["full"].update({(n, d): grids["window"][n, d] for d in ds})
                cost[n, "full"] = cost[n, "window"]
                continue
            t0, ran = time.time(), 0
            for d in ds:
                grids[name][n, d], r, where = passkey_accuracy(
                    how["model"], tok, n, C, d, band(g, ds), g["samples"], g["batch_size"],
                    g["seed"], dev, how.get("full", False), how.get("window", 0),
                    how.get("none", False))
                ran += r
                if name == "SharedLLM":
                    found[n, d] = where
            # tokens through it
            L = {"none": xd, "SharedLLM": xd, "window": min(W, n * C + xd)}.get(name, n * C + xd)
            kv = n * kvs_per_chunk(C, model.scfg.beta) if name == "SharedLLM" else 0
            gf = gflops(cfg, L, xd, n * C if name == "SharedLLM" else 0,
                        model.scfg.n_lower if kv else 0, kv)
            cost[n, name] = dict(s_per_haystack=(time.time() - t0) / max(ran, 1),
                                 gflop_per_haystack=gf, forwards=ran)
        for d in ds:
            res.append(dict(n_chunks=n, context_tokens=n * C, depth=d, depth_band=band(g, ds),
                            samples=g["samples"],
                            accuracy=grids["SharedLLM"][n, d], without_context=grids["none"][n, d],
                            window_attention=grids["window"].get((n, d)),
                            window_tokens=W or None, full_attention=grids["full"].get((n, d)),
                            key_in_leaf=found[n, d]["leaf"],
                            key_in_coarse_only=found[n, d]["coarse"],
                            cost={k: v for (m, k), v in cost.items() if m == n}))
    print(f"passkey: {g['samples']} haystacks per cell, exact match of all 5 digits "
          f"(= greedy decoding); "
          f"key at depth d +- {band(g, ds) / 2:g} (uniform) of n chunks x C = {C} tokens")
    print(heatmap(grids["SharedLLM"], ns, ds, C))
    mean = lambda n, k: 100 * sum(found[n, d][k] for d in ds) / len(ds)
    print(f"the search ({model.scfg.policy!r}): a leaf holds a whole mention of the key / "
          "only the coarse node holds it: "
          + ", ".join(f"{n * C:,} tokens {mean(n, 'leaf'):.1f}% / {mean(n, 'coarse'):.1f}%"
                      for n in ns))
    print("none (the upper model on the question alone): " + ", ".join(
        f"{n * C:,} tokens {100 * sum(grids['none'][n, d] for d in ds) / len(ds):.1f}%"
        for n in ns))
    if W:
        print(f"window: {base.label} over the last W = {W:,} tokens of the same haystacks and "
              f"question (a key wholly before them is a miss without a forward):")
        print(heatmap(grids["window"], ns, ds, C))
        if not any(cost[n, "window"]["forwards"] for n in ns):
            print(f"  (no haystack holds a whole key in its last {W:,} tokens: "
                  f"the window row is 0% by construction)")
    if grids["full"]:
        inside = [n for n in ns if (n, ds[0]) in grids["full"]]
        print(f"full attention by {base.label} over the same haystacks "
              f"(within its window of {cfg.max_seq_len:,} tokens):")
        print(heatmap(grids["full"], inside, ds, C))
    print("cost per haystack run (seconds / estimated GFLOP): " + "; ".join(
        f"{n * C:,} tokens: " + ", ".join(f"{k} {v['s_per_haystack']:.2f} s / "
                                          f"{v['gflop_per_haystack']:,.1f}"
                                          for (m, k), v in cost.items() if m == n) for n in ns))
    plots.passkey_heatmap((g["out"] or "passkey.json").rsplit(".", 1)[0] + ".png",
                          grids["SharedLLM"], ns, ds, C)
    return res


def ruler_haystacks(tok, task, n, C, depth, band, samples, seed):
    # the haystacks of one (task, chunk count, depth) cell, each at a depth uniform in
    # depth +- band/2: (context (1, n, C), X_D (1, T), question_len (1,), the asked values, where
    # X_C names each). The passkey's are passkey_accuracy's (one value, named twice: its mentions),
    # RULER's data.ruler_sample's.
    rng = random.Random(f"{seed}-{n}-{depth}" if task == "passkey"
                        else f"{seed}-{task}-{n}-{depth}")
    lo, hi = max(0.0, depth - band / 2), min(1.0, depth + band / 2)
    for _ in range(samples):
        if task == "passkey":
            ctx, idx, tgt, ql = data.collate(
                [data.passkey_sample(tok, rng, n, C, depth=rng.uniform(lo, hi))], tok)
            yield (ctx, idx, ql, [tok.decode(tgt[tgt != -100].tolist())],
                   [data.batch_mentions(ctx, tgt)[0]])
        else:
            ctx, idx, answers, spans, ql = data.ruler_sample(tok, rng, task, n, C,
                                                             rng.uniform(lo, hi))
            yield ctx[None], idx[None], torch.tensor([ql]), answers, [[s] for s in spans]


def placement(nodes, mentions, C):
    # where a tree left each asked value (data.key_placement; mentions: per value, its runs in X_C)
    # -> shares
    found = dict(leaf=0.0, between=0.0, coarse=0.0)
    for m in mentions:
        found[data.key_placement(nodes, m, C)] += 1 / len(mentions)
    return found


@torch.no_grad()
def ruler_cell(model, upper, tok, task, n, C, depth, band, samples, seed, dev, row, W=0):
    # One cell of --task=ruler: the mean RULER score over its haystacks, and where SharedLLM's
    # search left the asked values (shares of leaf / between / coarse). upper decodes greedily after
    # the answer prefix; row: "SharedLLM" (with the compressed context), "none" (the question
    # alone), "window" (upper, the base model, over the last W tokens of context and question),
    # "full" (all)
    import decode
    score, found = 0.0, dict(leaf=0.0, between=0.0, coarse=0.0)
    for ctx, idx, ql, answers, mentions in ruler_haystacks(tok, task, n, C, depth, band, samples,
                                                           seed):
        ctx, idx = ctx.to(dev), idx.to(dev)
        new = len(tok.encode(" " + ", ".join(answers) + ".", bos=False))   # the values written out
        memory, seq = None, idx
        if row == "SharedLLM":
            memory = model.compress(ctx, idx, ql)
            for k, v in placement(memory.nodes, mentions, C).items():
                found[k] += v
        elif row != "none":
            seq = torch.cat([ctx.flatten(1), idx], 1)
            seq = seq[:, -W:] if row == "window" else seq
        out = decode.generate(upper, seq, new, memory=memory)
        score += data.ruler_score(tok.decode(out[0, -new:].tolist()), answers)
    return score / samples, {k: v / samples for k, v in found.items()}


def run_ruler(model, tok, ns, C, g, dev, base=None):
    # each task's grid over chunk counts x depths for SharedLLM, and the none / window / full rows
    # beside it
    ds, W, cfg = [float(x) for x in g["depths"].split(",")], g["window"], model.upper.cfg
    tasks = g["ruler_tasks"].split(",")
    print(f"ruler: {g['samples']} haystacks per cell, RULER's string_match_all "
          f"(the share of the asked values the greedy answer holds); "
          f"the first asked needle at depth d +- {band(g, ds) / 2:g} of n chunks x C = {C}")
    res, placed = [], {}
    for task in tasks:
        grids = {"SharedLLM": {}, "none": {}, "window": {}, "full": {}}
        for n in ns:
            rows = {"SharedLLM": model.upper, "none": model.upper}
            if W:
                rows["window"] = base.upper
            if g["full"] and n * C + 128 <= cfg.max_seq_len:
                rows["full"] = base.upper
            for name, upper in rows.items():
                for d in ds:
                    grids[name][n, d], where = ruler_cell(model, upper, tok, task, n, C, d,
                                                          band(g, ds), g["samples"], g["seed"], dev,
                                                          name, W)
                    if name == "SharedLLM":
                        placed[task, n, d] = where
            res += [dict(task=task, n_chunks=n, context_tokens=n * C, depth=d, samples=g["samples"],
                         score=grids["SharedLLM"][n, d], without_context=grids["none"][n, d],
                         window_attention=grids["window"].get((n, d)), window_tokens=W or None,
                         full_attention=grids["full"].get((n, d)),
                         **{f"value_in_{k}": v for k, v in placed[task, n, d].items()}) for d in ds]
        print(f"{task}: SharedLLM")
        print(heatmap(grids["SharedLLM"], ns, ds, C))
        for name in ("none", "window", "full"):
            got = [n for n in ns if (n, ds[0]) in grids[name]]
            if got:
                print(f"  {name}"
                      + (f" (the base model over the last {W:,} tokens)"
                         if name == "window" else "")
                      + ": " + ", ".join(
                          f"{n * C:,} tokens "
                          f"{100 * sum(grids[name][n, d] for d in ds) / len(ds):.1f}%"
                          for n in got))
    print(f"where the search ({model.scfg.policy!r}) left the asked values: "
          f"leaf / between / coarse")
    for task in tasks:
        mean = lambda n, k: 100 * sum(placed[task, n, d][k] for d in ds) / len(ds)
        print(f"  {task:<16}" + "".join(f"  {n * C:>7,}: {mean(n, 'leaf'):5.1f} / "
                                        f"{mean(n, 'between'):5.1f} / "
                                        f"{mean(n, 'coarse'):5.1f}%" for n in ns))
    return res


@torch.no_grad()
def run_search(model, tok, ns, C, g, dev):
    # --task=search: where each search leaves the asked values, no decoding: the checkpoint's own,
    # the paper's vector ("vector"), "right", and an oracle that walks to the first asked value's
    # first token
    ds, trained = [float(x) for x in g["depths"].split(",")], model.scfg
    searches = list(dict.fromkeys([trained.policy, "vector", "right", "oracle"]))
    tasks, res = ["passkey"] + g["ruler_tasks"].split(","), []
    print(f"search: {g['samples']} haystacks per cell and depth {ds}; a leaf holds an asked value "
          f"whole / only the coarsest node holds it (C = {C}, height {trained.height}, "
          f"beta {trained.beta:g})")
    print(f"{'search':<10}" + "".join(f"{t + '@' + str(n):>24}" for t in tasks for n in ns))
    for name in searches:
        policy = trained.policy if name == "oracle" else name   # (the oracle reads no policy)
        cells, model.scfg = [], type(trained)(**{**trained.__dict__, "policy": policy})
        for task in tasks:
            for n in ns:
                per_depth = []   # shares per depth, averaged as the passkey task's search line does
                for d in ds:
                    found = dict(leaf=0.0, between=0.0, coarse=0.0)
                    for ctx, idx, ql, _, mentions in ruler_haystacks(tok, task, n, C, d,
                                                                     band(g, ds), g["samples"],
                                                                     g["seed"]):
                        rows = ctx.flatten(0, 1).to(dev)
                        # toward the first token of the first value's first mention
                        if name == "oracle":
                            a = mentions[0][0][0]
                            select = lambda lefts, rights: [r != a // C or rt[0] <= a % C
                                                            for r, rt in enumerate(rights)]
                        else:
                            select = model.search_policy(rows, idx.to(dev), ql)
                        nodes = tree.search(n, C, trained.height, trained.beta, select)
                        for k, v in placement(nodes, mentions, C).items():
                            found[k] += v
                    per_depth.append({k: v / g["samples"] for k, v in found.items()})
                cells.append(per_depth)
                res.append(dict(search=name, task=task, n_chunks=n, context_tokens=n * C,
                                **{k: sum(f[k] for f in per_depth) / len(ds) for k in found}))
        mean = lambda per_depth, k: 100 * sum(f[k] for f in per_depth) / len(ds)   # run_passkey's
        print(f"{name:<10}" + "".join(f"{mean(c, 'leaf'):15.1f} / {mean(c, 'coarse'):5.1f}%"
                                      for c in cells))
    model.scfg = trained
    return res


# Table 5 of the paper, as inference-time changes to one trained model (rows that need training say
# so)
ABLATIONS = [("SharedLLM (as trained)", {}),
             ("height 2", {"height": 2}), ("height 4", {"height": 4}),
             ("beta 1", {"beta": 1}), ("beta 4", {"beta": 4}), ("beta 16", {"beta": 16}),
             ("retrieval off (policy right)", {"policy": "right"}),
             ("chunk ids off", {"chunk_pos": "off"}),
             ("the paper's search (policy vector)", {"policy": "vector"}),
             ("first of window", {"keep": "first"})]


def run_ablations(model, tok, splits, ns, C, T, K, g, dev, trained_on):
    # columns for what the checkpoint was trained on: passkey accuracy, perplexity with the context,
    # or both
    pk, lm = trained_on in ("passkey", "mixed", ""), trained_on in ("lm", "mixed", "")
    rows = [(name, model, over) for name, over in ABLATIONS]
    for part in filter(None, g["compare"].split(";")):   # rows that need their own training run
        if "=" not in part:
            raise ValueError(f"--compare={g['compare']}: expected label=out_dir;label=out_dir")
        label, path = part.rsplit("=", 1)   # the label may hold "=", the path rarely does
        try:
            other, other_tok, _ = load_sharedllm(path, dev, model.upper.output.weight.dtype)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--compare={part}: {e}") from None
        if other.scfg.chunk_size != C or other_tok.spec != tok.spec:
            raise ValueError(f"--compare: {path} has chunk_size {other.scfg.chunk_size} and "
                             f"tokenizer {other_tok.spec}; expected {C} and {tok.spec}")
        rows.append((label, other, {}))
    ds = [float(x) for x in g["depths"].split(",")]
    print(f"ablations of a model trained on {trained_on or 'an unknown task'!r}, "
          f"at {ns} chunks of C = {C}:")
    if pk:
        print(f"  passkey: exact match, mean over depths {ds} (+-{band(g, ds) / 2:g}), "
              f"{g['samples']} haystacks each")
    if lm:
        windows = ppl_windows(splits["val"], max(ns), C, T, K, g["max_windows"])
        base, _ = score_ppl(model, splits["val"], windows, ns[0], C, T, K, "none",
                            g["batch_size"], dev)
        print(f"  ppl with the context, last-K protocol: {len(windows)} windows, "
              f"K = {K} of T = {T} (the same tokens without the context: {base:.4f})")
    if pk:
        print("  leaf@n / coarse@n: the share of haystacks where a leaf of the tree holds a whole "
              "mention of the key, and where only the coarsest node holds it")
    print(f"{'setting':<30}" + "".join(f"{'passkey@' + str(n):>12}{'leaf@' + str(n):>9}"
                                       f"{'coarse@' + str(n):>10}" for n in ns if pk)
          + "".join(f"{'ppl@' + str(n):>10}" for n in ns if lm))
    res = []
    for name, m, over in rows:
        trained = m.scfg
        try:
            # inference-time settings: no weight changes
            m.scfg = type(trained)(**{**trained.__dict__, **over})
        except ValueError as e:
            print(f"{name:<30} not possible: {e}")
            continue
        row = dict(setting=name, overrides=over, results=[])
        for n in ns:
            r = dict(n_chunks=n, context_tokens=n * C)
            if pk:
                cells = [passkey_accuracy(m, tok, n, C, d, band(g, ds), g["samples"],
                                          g["batch_size"], g["seed"], dev)
                         for d in ds]
                r["passkey"] = sum(c[0] for c in cells) / len(ds)
                r["key_in_leaf"] = sum(c[2]["leaf"] for c in cells) / len(ds)
                r["key_in_coarse_only"] = sum(c[2]["coarse"] for c in cells) / len(ds)
            if lm:
                r["with_context"], _ = score_ppl(m, splits["val"], windows, n, C, T, K,
                                                 "compressed", g["batch_size"], dev)
                r["without_context"] = base
            row["results"].append(r)
        m.scfg = trained
        print(f"{name:<30}" + "".join(f"{100 * r['passkey']:11.1f}%{100 * r['key_in_leaf']:8.1f}%"
                                      f"{100 * r['key_in_coarse_only']:9.1f}%"
                                      for r in row["results"] if pk)
              + "".join(f"{r['with_context']:10.4f}" for r in row["results"] if lm), flush=True)
        res.append(row)
    return res


def check_flags(g):
    # every flag that needs no model, checked before one is loaded: a bad one costs no wait
    inf = float("inf")
    check_ranges(g, dict(samples=(1, inf), batch_size=(1, inf), block_size=(0, inf),
                         max_windows=(1, inf), score_last=(0, inf), window=(-1, inf)))
    if g["depth_band"] != -1 and not 0 <= g["depth_band"] <= 1:
        raise SystemExit(f"eval.py: --depth_band={g['depth_band']}: expected -1 "
                         f"(the grid's spacing) or a value in [0, 1]")
    try:
        depths = [float(x) for x in g["depths"].split(",")]
        assert all(0 <= d <= 1 for d in depths)
    except (ValueError, AssertionError):
        raise SystemExit(f"eval.py: --depths={g['depths']}: expected depths in [0, 1] "
                         f"like 0,0.5,1") from None
    out_file(g["out"])
    if g["compare"] and g["task"] != "ablations":
        print(f"note: --compare is read by --task=ablations only; --task={g['task']} leaves it out")
    if g["task"] not in ("ppl", "passkey", "ruler", "search", "ablations"):
        raise SystemExit(f"eval.py: --task={g['task']}: "
                         f"expected ppl, passkey, ruler, search or ablations")
    unknown = [t for t in g["ruler_tasks"].split(",") if t not in data.RULER_TASKS]
    if g["task"] in ("ruler", "search") and unknown:
        raise SystemExit(f"eval.py: --ruler_tasks={g['ruler_tasks']}: unknown task {unknown[0]!r}; "
                         f"expected some of {','.join(data.RULER_TASKS)}")
    if g["chunk_pos"] not in ("", "plain", "random", "off"):
        raise SystemExit(f"eval.py: --chunk_pos={g['chunk_pos']}: expected plain, random or off")


def main(g):
    dev, dt = auto_device(g["device"], g["dtype"])
    check_flags(g)
    shared = {k: g[k] for k in ("height", "beta", "policy", "keep", "n_lower", "chunk_size",
                                "chunk_pos") if g[k]}
    torch.manual_seed(g["seed"])
    try:
        model, tok, train_cfg = load_sharedllm(package_path(g["init_from"]), dev,
                                               getattr(torch, dt), **shared)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"eval.py: --init_from={g['init_from']}: {e}") from None
    C = model.scfg.chunk_size
    n_train = train_cfg.get("n_chunks", 4)
    try:
        ns = ([int(x) for x in g["chunks"].split(",")] if g["chunks"]
              else [n_train * f for f in (1, 4, 16, 64)])
        assert all(n >= 1 for n in ns)
    except (ValueError, AssertionError):
        raise SystemExit(f"eval.py: --chunks={g['chunks']}: expected positive integers "
                         f"like 4,16,64") from None
    T = g["block_size"] or train_cfg.get("block_size", 0)
    K = g["score_last"] or min(256, T // 2)
    if g["task"] not in ("ruler", "search"):   # (their X_D is the question: no T, no K)
        if T <= 0:
            raise SystemExit("eval.py: set --block_size (X_D tokens): the model folder does not "
                             "say what it was trained with")
        if not 1 <= K <= T:
            raise SystemExit(f"eval.py: --score_last={K}: expected 1..T={T}")
    if g["window"] == -1:
        g["window"] = model.upper.cfg.max_seq_len
    # the scored tokens, or the question and key
    least = K if g["task"] == "ppl" else passkey_xd(tok) + XD_MARGIN
    if g["task"] != "ablations" and g["window"] and g["window"] < least:
        raise SystemExit(f"eval.py: --window={g['window']}: expected -1 (the base model's window, "
                         f"{model.upper.cfg.max_seq_len:,}), 0 (no window row) or at least "
                         + (f"K = {K} (the scored tokens)" if g["task"] == "ppl"
                            else f"{least} (the passkey question and key)"))
    print(f"model {g['init_from']}: {model.upper.cfg.n_layers} layers, "
          f"dim {model.upper.cfg.dim}; {model.scfg}")
    print(f"device {dev}, {dt}; chunk counts {ns} (trained on {n_train})")
    t0 = time.time()
    try:
        needs_text = g["task"] == "ppl" or (g["task"] == "ablations"
                                            and train_cfg.get("task") != "passkey")
        # only its validation split is read
        text = package_paths(g["data_dir"] or train_cfg.get("data_dir", ""))
        splits = data.prepare(tok, text, splits=("val",)) if needs_text else None
        # the default lengths: those the validation documents hold
        if needs_text and not g["chunks"]:
            longest = int(np.diff(splits["val"][1]).max())
            fit = [n for n in ns if n * C + T + 1 <= longest]
            if fit != ns:
                print(f"chunk counts {[n for n in ns if n not in fit]} left out: "
                      f"the longest validation document has {longest:,} tokens "
                      f"(a window needs n x {C} + T={T} + 1)")
            ns = fit or ns   # none fits: the error below names the longest document
        base = None
        # the unchanged base model's, whatever trained
        if g["task"] != "ablations" and (g["full"] or g["window"]):
            upper, label = base_model(model, train_cfg, dev, getattr(torch, dt))
            base = types.SimpleNamespace(upper=upper, label=label)
        if g["task"] == "ppl":
            res = run_ppl(model, splits, ns, C, T, K, g, dev, base)
        elif g["task"] == "passkey":
            res = run_passkey(model, tok, ns, C, g, dev, base=base)
        elif g["task"] == "ruler":
            res = run_ruler(model, tok, ns, C, g, dev, base=base)
        elif g["task"] == "search":
            res = run_search(model, tok, ns, C, g, dev)
        else:
            res = run_ablations(model, tok, splits, ns, C, T, K, g, dev, train_cfg.get("task", ""))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"eval.py: {e}") from None
    print(f"{g['task']} eval took {time.time() - t0:.1f} s")
    if g["out"]:
        with open(g["out"], "w") as f:
            json.dump(dict(task=g["task"], config={**g, "shared": model.scfg.__dict__, "T": T,
                                                   "K": K, "device": dev,
                                                   "base_model": base and base.label},
                           results=res), f, indent=1)
        print(f"wrote {g['out']}")
    return res


if __name__ == "__main__":
    config = config_of(globals())
    parse_overrides(sys.argv[1:], config, __file__)
    main(config)
