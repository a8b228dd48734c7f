"""
Measure a SharedLLM as the paper and the field do, the protocol printed beside each number.

  python eval.py --task=ppl         # perplexity with vs without the compressed context
  python eval.py --task=passkey     # exact match over context lengths x key depths: a heatmap
  python eval.py --task=ruler       # RULER's eight needle tasks (Hsieh et al., 2024)
  python eval.py --task=search      # where each search leaves the asked values, and an oracle
  python eval.py --task=passkey --policy=right --out=right.json   # any ablation flag, any task

Each task has rows beside SharedLLM: "none" (the upper model on X_D alone), "window" (the unchanged
base model over the last W tokens: what a user does with a text longer than the model's window,
cut it) and, with --full=True, "full" (the base model over all of X_C + X_D).
ppl (the paper's last-K protocol, SharedLLM/CEPE eval_lm): a window is n chunks of C tokens (X_C),
then T tokens (X_D), all from one document; only the last K tokens of X_D are scored; windows are
placed for the largest chunk count, so every row and length scores the very same tokens;
perplexity = exp(mean over windows of the window's mean loss).
passkey: the key's tokens must all be the argmax given the correct prefix: exactly greedy decoding.
ruler: greedy decoding after RULER's answer prefix, scored by RULER's string_match_all (the share
of the asked values the answer holds).
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
import decode
import plots
import tree
from configurator import config_of, package_path, parse_list, parse_overrides
from load_llama import auto_device, load_llama, load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = "out"           # a train.py out_dir (or its ckpt.pt), or a LLaMA folder / .gguf file
task = "ppl"                # "ppl" | "passkey" | "ruler" | "search"
ruler_tasks = ",".join(data.RULER_TASKS)   # --task=ruler / search: which of RULER's NIAH tasks
chunks = ""                 # chunk counts, e.g. "4,16,64"; "" = 1x, 4x, 16x, 64x the trained n
block_size = 0              # T: X_D tokens for ppl; 0 = as trained
score_last = 0              # K: scored tokens at the end of X_D; 0 = the paper's 256, or T // 2
max_windows = 64            # ppl windows, spread evenly over the validation documents
window = -1                 # W of the window row; -1 = the base model's window; 0 = no such row
full = False                # also the full row (quadratic; passkey, ruler: within the base window)
data_dir = ""               # ppl's validation text (data.py); "" = the checkpoint's own
depths = "0,0.25,0.5,0.75,1"    # key depths: 0 = at the start of the context, 1 = at its end;
                                # each key uniform within the grid's spacing around its depth
samples = 32                # haystacks per (chunk count, depth) cell
batch_size = 8
# SharedLLM read another way at inference (0 / "" = as trained): the paper's ablations
height = 0                  # tree height h
beta = 0.0                  # compression C / KVs kept per chunk
policy = ""                 # "lexical" (every recipe's) | "vector" (the paper's) | "right"
chunk_pos = ""              # "plain" | "off" ("random" is plain at inference)
keep = ""                   # "last" | "first" token of each stride window
n_lower = 0                 # M, for a LLaMA folder (a checkpoint's is fixed by its weights)
chunk_size = 0              # C, likewise
out = ""                    # write the results as JSON here (passkey: the heatmap beside it)
device = "auto"
dtype = "auto"              # "auto" = bfloat16 for a pretrained model on CUDA, else float32
seed = 1337
# -----------------------------------------------------------------------------


def ppl_windows(split, n_max, C, T, K, max_windows):
    # -> (document start, p) pairs: X_D = tokens [p+K-T, p+K), its last K positions [p, p+K)
    # scored against tokens [p+1, p+K+1); X_C is the n*C tokens before X_D; every window holds
    # n_max chunks inside its own document
    tokens, offsets = split[:2]
    cand = []
    for d in range(len(offsets) - 1):
        a, b = int(offsets[d]), int(offsets[d + 1])
        cand += [(a, p) for p in range(a + n_max * C + T - K, b - K, K)]
    if not cand:
        raise ValueError(f"no validation document has {n_max * C + T + 1:,} tokens ({n_max} "
                         f"chunks x {C} + T={T} + 1): ask for fewer --chunks")
    pick = np.linspace(0, len(cand) - 1, min(max_windows, len(cand))).round().astype(int)
    return [cand[i] for i in pick]


def window_tokens(tokens, p, n, C, T, K):   # X_C, X_D and one more token: n*C + T + 1 tokens
    return torch.from_numpy(tokens[p + K - T - n * C: p + K + 1].astype(np.int64))


@torch.no_grad()
def score_ppl(model, split, windows, n, C, T, K, row, g, dev, base=None):
    # -> perplexity: exp(mean over windows of the mean NLL of the last K tokens of X_D). row:
    # "SharedLLM" (compressed X_C), "none" (X_D alone), "window" (the base model over the last W
    # tokens of X_C + X_D as one sequence) or "full" (over all of them)
    losses = []
    for i in range(0, len(windows), g["batch_size"]):
        w = torch.stack([window_tokens(split[0], p, n, C, T, K)
                         for _, p in windows[i:i + g["batch_size"]]]).to(dev)
        if row in ("window", "full"):
            seq = w[:, :-1] if row == "full" else w[:, -1 - g["window"]:-1]
            logits, _ = base(seq, last=K)
        else:
            ctx = w[:, :n * C].view(len(w), n, C) if row == "SharedLLM" else None
            logits, _ = model(ctx, w[:, n * C:-1])                      # X_D: (B, T)
        nll = torch.nn.functional.cross_entropy(logits[:, -K:].transpose(1, 2), w[:, -K:],
                                                reduction="none")
        losses += nll.mean(1).tolist()
    return math.exp(sum(losses) / len(losses))


def run_ppl(model, base, splits, ns, C, T, K, g, dev):
    windows = ppl_windows(splits["val"], max(ns), C, T, K, g["max_windows"])
    rows = ["none", "SharedLLM"] + ["window"] * bool(g["window"]) + ["full"] * g["full"]
    print(f"ppl: {len(windows)} windows of the validation text, the last K = {K} of X_D = {T} "
          f"tokens scored, the same tokens in every row and length. Rows: none = X_D alone, "
          f"window = {base.label} over the last W = {g['window']:,} tokens, full = all of them")
    print(f"{'chunks':>6} {'context':>9}  {'row':<9} {'ppl':>9} {'vs none':>7}")
    res, same = [], {}   # rows that read the same tokens at every length, scored once
    for n in ns:
        r = {}
        for row in rows:   # none: X_D alone; window: its last W tokens, once X_C + X_D holds W
            fixed = row == "none" or (row == "window" and n * C + T >= g["window"])
            if fixed and row in same:
                r[row] = same[row]
            elif row == "full" and g["window"] >= n * C + T:   # the window holds everything
                r[row] = r["window"]
            else:
                r[row] = score_ppl(model, splits["val"], windows, n, C, T, K, row, g, dev,
                                   base.upper)
            if fixed:
                same[row] = r[row]
            none = r["none"]
            print(f"{n:6d} {n * C:9,d}  {row:<9} {r[row]:9.4f} {r[row] / none:7.3f}", flush=True)
        if "full" in r and r["full"] < none:
            closed = math.log(none / r["SharedLLM"]) / math.log(none / r["full"])
            print(f"{'':18}SharedLLM closes {100 * closed:.0f}% of the gap to full attention")
        res.append(dict(n_chunks=n, context_tokens=n * C, ppl=r, windows=len(windows), T=T, K=K))
    return res


def depth_cells(g):   # the grid's depths, each with the band its keys are drawn from
    ds = parse_list("depths", g["depths"], float)
    band = 1.0 if len(ds) < 2 else min(b - a for a, b in zip(sorted(ds), sorted(ds)[1:]))
    return [(d, max(0.0, d - band / 2), min(1.0, d + band / 2)) for d in ds]


def haystacks(tok, task, n, C, cell, g):
    # the haystacks of one (task, chunk count, depth) cell, each at a depth drawn uniformly from
    # the cell's band (one fixed position would test one alignment of the key with the stride
    # windows), from a fixed seed: every setting reads the same ones. -> per haystack: (context
    # (n, C), X_D (T,), targets (T,) for the passkey or None, question_len), the asked values,
    # where X_C names each: per value, [(start, end)] (the passkey's needle names it twice)
    d, lo, hi = cell
    rng = random.Random(f"{g['seed']}-{n}-{d}" if task == "passkey" else
                        f"{g['seed']}-{task}-{n}-{d}")
    for _ in range(g["samples"]):
        if task == "passkey":
            ctx, idx, tgt, ql = data.passkey_sample(tok, rng, n, C, depth=rng.uniform(lo, hi))
            answer = tgt[tgt != -100].tolist()
            yield ((ctx, idx, tgt, ql), [tok.decode(answer)],
                   [data.key_mentions(ctx.flatten().tolist(), answer)])
        else:
            ctx, idx, answers, spans, ql = data.ruler_sample(tok, rng, task, n, C,
                                                             rng.uniform(lo, hi))
            yield (ctx, idx, None, ql), answers, [[s] for s in spans]


@torch.no_grad()
def score_cell(model, base, tok, task, n, C, cell, g, dev, row):
    # One cell: the mean score over its haystacks, and where SharedLLM's search left the asked
    # values. The passkey (batch_size haystacks a forward): exact match of the key's tokens.
    # RULER (one a forward): greedy decoding of as many tokens as the values take written out,
    # scored by string_match_all. A window where no asked value starts is a miss, unread.
    score, found, hay = 0.0, dict(leaf=0.0, between=0.0, coarse=0.0), list(
        haystacks(tok, task, n, C, cell, g))
    step = g["batch_size"] if task == "passkey" else 1
    for i in range(0, len(hay), step):
        group = hay[i:i + step]
        if task == "passkey":
            ctx, idx, tgt, ql = data.collate([h[0] for h in group], tok)
            ctx, idx, tgt = ctx.to(dev), idx.to(dev), tgt.to(dev)   # (ql: on the host)
        else:
            (ctx, idx, tgt, ql), answers, _ = group[0]
            ctx, idx, ql = ctx[None].to(dev), idx[None].to(dev), torch.tensor([ql])
        seq, memory, upper, T = idx, None, model.upper, idx.shape[1]
        if row == "SharedLLM":
            memory = model.compress(ctx, idx, ql)
            for j, (_, _, mentions) in enumerate(group):
                for k, v in data.placement(memory.nodes[j * n:(j + 1) * n], mentions, C).items():
                    found[k] += v
        elif row in ("window", "full"):   # the base model over the last W tokens
            W = g["window"] if row == "window" else n * C + T
            seq, upper = torch.cat([ctx.flatten(1), idx], 1)[:, -W:], base.upper
            # a haystack whose asked values all start before the window is a miss, unread
            keep = [any(s >= n * C + T - W for m in h[2] for s, _ in m) for h in group]
            if not any(keep):
                continue
            if task == "passkey":
                seq, idx, tgt = seq[keep], idx[keep], tgt[keep]
        if tgt is not None:
            logits, _ = upper(seq, memory=memory, last=T)
            score += data.exact_match(logits, tgt).sum().item()
        else:
            new = len(tok.encode(" " + ", ".join(answers) + ".", bos=False))
            out = decode.generate(upper, seq, new, memory=memory)
            score += data.ruler_score(tok.decode(out[0, -new:].tolist()), answers)
    return score / g["samples"], {k: v / g["samples"] for k, v in found.items()}


def heatmap(grid, ns, cells, C):
    # rows: depths; columns: context lengths; a shade and the score in percent; then the mean
    shades = " .:-=+*#%@"
    lines = ["depth \\ context " + "".join(f"{n * C:>9,d}" for n in ns)]
    for d, _, _ in cells:
        lines.append(f"{d:>16.2f}" + "".join(
            f" {shades[min(9, int(grid[n, d] * 10))] * 3}{100 * grid[n, d]:4.0f}%" for n in ns))
    return "\n".join(lines + [f"{'mean':>16}" + "".join(f"{depth_mean(grid, n, cells):8.1f}%"
                                                        for n in ns)])


def depth_mean(grid, n, cells):   # a context length's mean over the key depths, in percent
    return 100 * sum(grid[n, d] for d, _, _ in cells) / len(cells)


def run_grid(model, base, tok, tasks, ns, C, g, dev):
    # --task=passkey / ruler: each task's grid over chunk counts x depths for SharedLLM, and its
    # none / window / full rows beside it
    cells, res = depth_cells(g), []
    W, window_of_base = g["window"], model.upper.cfg.max_seq_len
    print(f"{g['samples']} haystacks per cell; the key (the first asked value) at depth d +- "
          f"{(cells[0][2] - cells[0][1]) / 2:g} of n chunks x C = {C} tokens")
    rows = ["SharedLLM", "none"] + ["window"] * bool(W) + ["full"] * g["full"]
    runs = [(n, row) for n in ns for row in rows   # full: quadratic, within the base window only
            if row != "full" or n * C + 128 <= window_of_base]
    left, t0 = len(tasks) * len(runs) * len(cells), time.time()
    for task in tasks:
        grids, placed = {row: {} for row in rows}, {}
        for n, row in runs:
            for cell in cells:
                t = time.time()
                grids[row][n, cell[0]], where = score_cell(model, base, tok, task, n, C, cell, g,
                                                           dev, row)
                placed[n, cell[0]] = where if row == "SharedLLM" else placed[n, cell[0]]
                left -= 1   # a long cell runs for minutes: say where it is
                print(f"  {task} {row} {n * C:,} tokens, depth {cell[0]:g}: "
                      f"{100 * grids[row][n, cell[0]]:.1f}% in {time.time() - t:.0f} s; {left} "
                      f"cells left, {(time.time() - t0) / 60:.1f} min so far", flush=True)
        print(f"{task}, SharedLLM:\n{heatmap(grids['SharedLLM'], ns, cells, C)}")
        for row in rows[1:]:
            got = [n for n in ns if (n, cells[0][0]) in grids[row]]
            label = f" ({base.label}, the last {W:,} tokens)" if row == "window" else ""
            print(f"  {row}{label}: " + ", ".join(
                f"{n * C:,} tokens {depth_mean(grids[row], n, cells):.1f}%" for n in got))
        share = lambda n, k: depth_mean({nd: v[k] for nd, v in placed.items()}, n, cells)
        print(f"  where the search ({model.scfg.policy!r}) left it, leaf / coarse node alone: "
              + ", ".join(f"{n * C:,} tokens {share(n, 'leaf'):.1f} / {share(n, 'coarse'):.1f}%"
                          for n in ns))
        res += [dict(task=task, n_chunks=n, context_tokens=n * C, depth=d,
                     **{row: grids[row].get((n, d)) for row in rows},
                     **{f"in_{k}": v for k, v in placed[n, d].items()})
                for n in ns for d, _, _ in cells]
        if task == "passkey":
            plots.passkey_heatmap((g["out"] or "passkey.json").rsplit(".", 1)[0] + ".png",
                                  grids["SharedLLM"], ns, [d for d, _, _ in cells], C)
    return res


@torch.no_grad()
def run_search(model, tok, tasks, ns, C, g, dev):
    # --task=search: where each search leaves the asked values (no decoding): the checkpoint's,
    # the paper's vector, "right", and an oracle that walks to the first asked value's first token
    cells, trained, res = depth_cells(g), model.scfg, []
    print(f"search: {g['samples']} haystacks per cell at depths {[d for d, _, _ in cells]}; a "
          f"leaf holds the asked value whole / only the coarsest node holds it (C = {C}, height "
          f"{trained.height}, beta {trained.beta:g})")
    print(f"{'search':<10}" + "".join(f"{t + '@' + str(n):>24}" for t in tasks for n in ns))
    for name in dict.fromkeys([trained.policy, "vector", "right", "oracle"]):
        model.scfg = type(trained)(**{**trained.__dict__, "policy": trained.policy
                                      if name == "oracle" else name})
        line = ""
        for task in tasks:
            for n in ns:
                found = dict(leaf=0.0, between=0.0, coarse=0.0)
                for cell in cells:
                    for (ctx, idx, _, ql), _, mentions in haystacks(tok, task, n, C, cell, g):
                        if name == "oracle":   # toward the first value's first mention
                            a = mentions[0][0][0]
                            select = lambda lefts, rights: [r != a // C or rt[0] <= a % C
                                                            for r, rt in enumerate(rights)]
                        else:
                            select = model.search_policy(ctx.to(dev), idx[None].to(dev),
                                                         torch.tensor([ql]))
                        nodes = tree.search(n, C, trained.height, trained.beta, select)
                        for k, v in data.placement(nodes, mentions, C).items():
                            found[k] += v / (g["samples"] * len(cells))
                res.append(dict(search=name, task=task, n_chunks=n, context_tokens=n * C, **found))
                line += f"{100 * found['leaf']:15.1f} / {100 * found['coarse']:5.1f}%"
        print(f"{name:<10}{line}", flush=True)
    model.scfg = trained
    return res


def main(g):
    dev = auto_device(g["device"])
    shared = {k: g[k] for k in ("height", "beta", "policy", "keep", "chunk_pos", "n_lower",
                                "chunk_size") if g[k]}
    model, tok, trained_with = load_sharedllm(package_path(g["init_from"]), dev, g["dtype"],
                                              **shared)
    dt = model.upper.output.weight.dtype
    torch.manual_seed(g["seed"])
    C, n_train = model.scfg.chunk_size, trained_with.get("n_chunks", 4)
    ns = parse_list("chunks", g["chunks"]) if g["chunks"] else [n_train * f for f in (1, 4, 16, 64)]
    T = g["block_size"] or trained_with.get("block_size", 256)
    K = g["score_last"] or min(256, T // 2)
    g["window"] = model.upper.cfg.max_seq_len if g["window"] == -1 else g["window"]
    # the unchanged base model: the upper model itself, unless more than cross-attention trained
    base = types.SimpleNamespace(upper=model.upper, label="the base model")
    if "base" in trained_with and not trained_with["base"]:
        base.label = "its own upper model (trained from scratch: no pretrained base)"
    elif trained_with.get("train", "cross") != "cross":
        base.upper = load_llama(trained_with["base"], dev, dt)
    tasks = (["passkey"] if g["task"] == "passkey" else [])
    tasks += parse_list("ruler_tasks", g["ruler_tasks"], str) if g["task"] != "passkey" else []
    print(f"model {g['init_from']}: {model.upper.cfg.n_layers} layers, dim "
          f"{model.upper.cfg.dim}; {model.scfg}\ndevice {dev}, {dt}; chunk counts {ns}")
    t0 = time.time()
    if g["task"] == "ppl":
        text = package_path(g["data_dir"] or trained_with.get("data_dir", ""))
        res = run_ppl(model, base, data.prepare(tok, text, splits=("val",)), ns, C, T, K, g, dev)
    elif g["task"] in ("passkey", "ruler"):
        res = run_grid(model, base, tok, tasks, ns, C, g, dev)
    elif g["task"] == "search":
        res = run_search(model, tok, ["passkey"] + tasks, ns, C, g, dev)
    else:
        raise SystemExit(f"--task={g['task']}: expected ppl, passkey, ruler or search")
    print(f"{g['task']} eval took {time.time() - t0:.1f} s")
    if g["out"]:
        with open(g["out"], "w") as f:
            json.dump(dict(task=g["task"], config={**g, "shared": model.scfg.__dict__},
                           results=res), f, indent=1)
    return res


if __name__ == "__main__":
    main(parse_overrides(sys.argv[1:], config_of(globals()), __file__))
