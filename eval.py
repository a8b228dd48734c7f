"""
Measure a SharedLLM the way the paper does, with the protocol printed next to every number.

  python eval.py --task=ppl         # perplexity with vs without the compressed context, at several chunk counts
  python eval.py --task=passkey     # exact match over context lengths x key depths, with an ASCII heatmap
  python eval.py --task=ablations   # the paper's Table 5 rows, as inference-time changes to one checkpoint
  python eval.py --task=passkey --policy=right --out=right.json    # any ablation flag, any task; JSON out

ppl (the paper's last-K protocol, SharedLLM/CEPE eval_lm): a window is n chunks of C tokens (X_C) and then T tokens
(X_D), all from one document; only the last K tokens of X_D are scored; windows advance by K. Every chunk count
scores the very same tokens (the windows are placed for the largest count), with and without the context;
perplexity = exp(mean over windows of the window's mean loss).
passkey: the key's tokens must all be the argmax given the correct prefix, which is exactly greedy decoding
producing the key.
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
import plots
from configurator import auto_device, check_ranges, config_of, out_file, package_path, parse_overrides
from checkpoint import base_model, load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = "out"           # a train.py out_dir (or its ckpt.pt), or a LLaMA-2 folder in HF layout
task = "ppl"                # "ppl" | "passkey" | "ablations"
chunks = ""                 # chunk counts, e.g. "4,16,64,256"; "" = 1x, 4x, 16x, 64x the training n_chunks (ppl: those
                            # the longest validation document holds)
block_size = 0              # T: X_D tokens; 0 = as trained
score_last = 0              # K: scored tokens at the end of X_D; 0 = the paper's 256, or T // 2 for a shorter X_D
max_windows = 64            # ppl windows, spread evenly over the validation documents
full = False                # also score the unchanged base model with full attention over X_C + X_D (the ceiling of a
                            # pretrained model; passkey: only within its window)
full_budget_s = 300.0       # ppl: skip full attention at lengths predicted to take longer than this (it is quadratic)
data_dir = ""               # a folder of .txt (validation split); "" = the checkpoint's own data_dir (the stdlib's .py)
depths = "0,0.25,0.5,0.75,1"    # passkey depths: 0 = key at the start of the context, 1 = at its end
depth_band = -1.0           # each key's depth is uniform within d +- band/2; -1 = the grid's spacing; 0 = exactly d
samples = 32                # passkey samples per (chunk count, depth) cell
batch_size = 8
# ablations: inference-time SharedLLM settings (0 / "" = as trained); noise and M need their own training run
height = 0                  # tree height h
beta = 0                    # compression C / KVs kept per chunk
policy = ""                 # "right" (retrieval off) | "query"
chunk_ids = ""              # "plain" | "clamp" | "off" ("random" is read like plain: at inference they are the same)
max_chunk_dist = 0          # "clamp": the largest chunk distance; 0 = the checkpoint's own (else its n_chunks)
keep = ""                   # "last" | "first" token of each stride window
logn_scale = ""             # "on" | "off": log-n query scaling beyond the trained number of chunks; "" = as trained
compare = ""                # ablations: more rows from other checkpoints, "label=out_dir;label=out_dir" (noise off, M)
n_lower = 0                 # M (LLaMA-2 folder only)
chunk_size = 0              # C (LLaMA-2 folder only)
out = ""                    # write the results as JSON here
device = "auto"
dtype = "auto"
seed = 1337
# -----------------------------------------------------------------------------


def ppl_windows(split, n_max, C, T, K, max_windows):
    # -> (document start, p) pairs: X_D = tokens [p+K-T, p+K), its last K positions [p, p+K) are scored, and the tokens
    # they predict are [p+1, p+K+1) (window_tokens); X_C is the n*C tokens before X_D; every window fits n_max chunks
    # inside its own document.
    tokens, offsets = split
    cand = []
    for d in range(len(offsets) - 1):
        a, b = int(offsets[d]), int(offsets[d + 1])
        first = a + n_max * C + T - K          # the first scored token with room for n_max chunks before X_D
        cand += [(a, p) for p in range(first, b - K, K)]   # p + K targets need one more token: p + K <= b - 1
    if not cand:
        raise ValueError(f"no validation document has {n_max * C + T + 1} tokens ({n_max} chunks x {C} + T={T} + 1); "
                         f"the longest has {int(np.diff(offsets).max()):,}: ask for fewer --chunks")
    pick = np.linspace(0, len(cand) - 1, min(max_windows, len(cand))).round().astype(int)
    return [cand[i] for i in pick]


def window_tokens(tokens, p, n, C, T, K):
    # one window as a row of n*C + T + 1 tokens: X_C = [p+K-T-n*C, p+K-T), X_D = [p+K-T, p+K), and one more token, so
    # that the last K targets are tokens [p+1, p+K+1)
    return torch.from_numpy(tokens[p + K - T - n * C: p + K + 1].astype(np.int64))


@torch.no_grad()
def score_ppl(model, split, windows, n, C, T, K, context, batch_size, dev):
    # -> (perplexity, scored tokens): mean over windows of the mean NLL of the last K tokens of X_D.
    # context: "compressed" (SharedLLM), "none" (the upper model on X_D alone) or "full" (model.upper, the base LLaMA, with
    # plain causal attention over X_C + X_D as one sequence: the ceiling while that fits the base model's window)
    losses, scored = [], 0
    for i in range(0, len(windows), batch_size):
        w = torch.stack([window_tokens(split[0], p, n, C, T, K) for _, p in windows[i:i + batch_size]]).to(dev)
        tgt = w[:, -K:]                                                # (B, K): the scored tokens [p+1, p+K+1)
        if context == "full":
            logits, _ = model.upper(w[:, :-1], last=K)
        else:
            ctx = w[:, : n * C].view(len(w), n, C) if context == "compressed" and n > 0 else None
            logits, _ = model(ctx, w[:, n * C:-1])                     # X_D: (B, T)
        nll = torch.nn.functional.cross_entropy(logits[:, -K:].transpose(1, 2), tgt, reduction="none")
        losses += nll.mean(1).tolist()                                 # (B,) one mean per window
        scored += nll.numel()
    return math.exp(sum(losses) / len(losses)), scored


def run_ppl(model, splits, ns, C, T, K, g, dev, full_model=None):
    # full_model: what runs full attention, if asked for (.upper: the unchanged base model; .label: which that is)
    windows = ppl_windows(splits["val"], max(ns), C, T, K, g["max_windows"])
    window = model.upper.cfg.max_seq_len
    print(f"ppl protocol: {len(windows)} windows from the validation documents (placed for {max(ns)} chunks, so "
          f"every row scores the same tokens); X_D = T = {T} tokens, the last K = {K} scored per window" + (
          f"; 'full' = {full_model.label} with plain attention over X_C + X_D (its window: {window:,} tokens)"
          if full_model else ""))
    print(f"{'chunks':>7} {'context tok':>11} {'windows':>7} {'scored tok':>10} {'ppl with':>9} {'ppl without':>11} "
          f"{'ratio':>6} {'ppl full':>9} {'gap closed':>10}")
    res, base, last_full = [], None, None
    for n in ns:
        t0 = time.time()
        with_c, scored = score_ppl(model, splits["val"], windows, n, C, T, K, "compressed", g["batch_size"], dev)
        if base is None:   # without the context the upper model sees the same X_D: one number for every row
            base, _ = score_ppl(model, splits["val"], windows, n, C, T, K, "none", g["batch_size"], dev)
        full, note = None, ""
        if full_model:   # attention is quadratic: predict this row's time from the last one before running it
            guess = last_full[1] * ((n * C + T) / (last_full[0] * C + T)) ** 2 if last_full else 0
            if guess > g["full_budget_s"]:
                note = f"full attention skipped: ~{guess:.0f} s > --full_budget_s={g['full_budget_s']:g}"
            else:
                t1 = time.time()
                full, _ = score_ppl(full_model, splits["val"], windows, n, C, T, K, "full", g["batch_size"], dev)
                last_full = (n, time.time() - t1)
                note = "beyond the base window" if n * C + T > window else ""
        closed = (math.log(base) - math.log(with_c)) / (math.log(base) - math.log(full)) if full and full < base else None
        print(f"{n:7d} {n * C:11,d} {len(windows):7d} {scored:10,d} {with_c:9.4f} {base:11.4f} {with_c / base:6.3f} "
              f"{f'{full:9.4f}' if full else '-':>9} {f'{100 * closed:9.0f}%' if closed is not None else '-':>10}"
              f"   ({time.time() - t0:.1f} s) {note}", flush=True)
        res.append(dict(n_chunks=n, context_tokens=n * C, with_context=with_c, without_context=base,
                        ratio=with_c / base, full_attention=full, gap_closed=closed, note=note or None,
                        windows=len(windows), scored_tokens=scored, x_d_tokens=T, scored_per_window=K))
    return res


@torch.no_grad()
def passkey_accuracy(model, tok, n, C, depth, band, samples, batch_size, seed, dev, full=False):
    # exact match over `samples` haystacks, each key at a depth drawn uniformly from [depth - band/2, depth + band/2]
    # (within 0..1): a single fixed position would test one alignment of the key with the stride windows only.
    # A fixed seed per cell, so every setting sees the same keys and positions. full: the base model reads the
    # haystack and the question as one sequence instead.
    rng = random.Random(f"{seed}-{n}-{depth}")
    lo, hi = max(0.0, depth - band / 2), min(1.0, depth + band / 2)
    hits = 0
    for i in range(0, samples, batch_size):
        b = [data.passkey_sample(tok, rng, n, C, depth=rng.uniform(lo, hi)) for _ in range(min(batch_size, samples - i))]
        ctx, idx, tgt, ql = (t.to(dev) for t in data.collate(b, tok))
        if full:
            logits, _ = model.upper(torch.cat([ctx.flatten(1), idx], 1), last=idx.shape[1])
        else:
            logits, _ = model(ctx, idx, query_len=ql)
        scored = tgt != -100
        hits += ((logits.argmax(-1) == tgt) | ~scored).all(-1).sum().item()
    return hits / samples


def band(g, ds):
    # the depth band of one cell: --depth_band, or by default the grid's spacing (so the cells tile 0..1)
    if g["depth_band"] >= 0:
        return g["depth_band"]
    return 1.0 if len(ds) < 2 else min(b - a for a, b in zip(sorted(ds), sorted(ds)[1:]))


def heatmap(grid, ns, ds, C):
    # rows: depths; columns: context lengths; a shade and the accuracy in percent
    shades = " .:-=+*#%@"
    lines = ["depth \\ context " + "".join(f"{n * C:>9,d}" for n in ns)]
    for d in ds:
        cells = "".join(f" {shades[min(9, int(grid[n, d] * 10))] * 3}{100 * grid[n, d]:4.0f}%" for n in ns)
        lines.append(f"{d:>16.2f}{cells}")
    lines.append(f"{'mean':>16}" + "".join(f"{100 * sum(grid[n, d] for d in ds) / len(ds):8.1f}%" for n in ns))
    return "\n".join(lines)


def run_passkey(model, tok, ns, C, g, dev, quiet=False, full_model=None):
    ds = [float(x) for x in g["depths"].split(",")]
    window, question = model.upper.cfg.max_seq_len, sum(map(len, data.passkey_question(tok, 99999))) + 4
    grid, full, res = {}, {}, []
    for n in ns:
        for d in ds:
            grid[n, d] = passkey_accuracy(model, tok, n, C, d, band(g, ds), g["samples"], g["batch_size"], g["seed"], dev)
            r = dict(n_chunks=n, context_tokens=n * C, depth=d, depth_band=band(g, ds), accuracy=grid[n, d],
                     samples=g["samples"])
            if full_model and n * C + question <= window:
                r["full_attention"] = full[n, d] = passkey_accuracy(full_model, tok, n, C, d, band(g, ds), g["samples"],
                                                                    g["batch_size"], g["seed"], dev, full=True)
            res.append(r)
    if not quiet:
        print(f"passkey: {g['samples']} haystacks per cell, exact match of all 5 digits (= greedy decoding); "
              f"key at depth d +- {band(g, ds) / 2:g} (uniform) of n chunks x C = {C} tokens")
        print(heatmap(grid, ns, ds, C))
        if full:
            inside = [n for n in ns if (n, ds[0]) in full]
            print(f"full attention by {full_model.label} over the same haystacks (within its window of {window:,} tokens):")
            print(heatmap(full, inside, ds, C))
        plots.passkey_heatmap((g["out"] or "passkey.json").rsplit(".", 1)[0] + ".png", grid, ns, ds, C)
    return res


# Table 5 of the paper, as inference-time changes to one trained model (rows that need training say so)
ABLATIONS = [("SharedLLM (as trained)", {}), ("height 2", {"height": 2}), ("height 4", {"height": 4}),
             ("beta 1", {"beta": 1}), ("beta 4", {"beta": 4}), ("beta 16", {"beta": 16}),
             ("retrieval off (policy right)", {"policy": "right"}), ("chunk ids off", {"chunk_ids": "off"}),
             ("chunk ids plain (no clamp)", {"chunk_ids": "plain"}), ("first of window", {"keep": "first"})]


def run_ablations(model, tok, splits, ns, C, T, K, g, dev, trained_on):
    # columns for what the checkpoint was trained on: passkey accuracy, perplexity with the context, or both
    pk, lm = trained_on in ("passkey", "mixed", ""), trained_on in ("lm", "mixed", "")
    rows = [(name, model, over) for name, over in ABLATIONS]
    flip = not model.scfg.logn_scale   # log-n scaling the other way than the checkpoint has it
    rows.insert(-1, (f"log-n scaling {'on' if flip else 'off'}", model, {"logn_scale": flip}))
    for part in filter(None, g["compare"].split(";")):   # rows that need their own training run
        if "=" not in part:
            raise ValueError(f"--compare={g['compare']}: expected label=out_dir;label=out_dir")
        label, path = part.rsplit("=", 1)   # the label may hold "=", the path rarely does
        try:
            other, other_tok, _ = load_sharedllm(path, dev, model.upper.output.weight.dtype)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--compare={part}: {e}") from None
        if other.scfg.chunk_size != C or other_tok.spec != tok.spec:
            raise ValueError(f"--compare: {path} has chunk_size {other.scfg.chunk_size} and tokenizer {other_tok.spec}; "
                             f"expected {C} and {tok.spec}")
        rows.append((label, other, {}))
    ds = [float(x) for x in g["depths"].split(",")]
    print(f"ablations of a model trained on {trained_on or 'an unknown task'!r}, at {ns} chunks of C = {C}:")
    if pk:
        print(f"  passkey: exact match, mean over depths {ds} (+-{band(g, ds) / 2:g}), {g['samples']} haystacks each")
    if lm:
        windows = ppl_windows(splits["val"], max(ns), C, T, K, g["max_windows"])
        base, _ = score_ppl(model, splits["val"], windows, ns[0], C, T, K, "none", g["batch_size"], dev)
        print(f"  ppl with the context, last-K protocol: {len(windows)} windows, K = {K} of T = {T} "
              f"(the same tokens without the context: {base:.4f})")
    print(f"{'setting':<30}" + "".join(f"{'passkey@' + str(n):>12}" for n in ns if pk)
          + "".join(f"{'ppl@' + str(n):>10}" for n in ns if lm))
    res = []
    for name, m, over in rows:
        trained = m.scfg
        try:
            m.scfg = type(trained)(**{**trained.__dict__, **over})   # inference-time settings: no weight changes
        except ValueError as e:
            print(f"{name:<30} not possible: {e}")
            continue
        row = dict(setting=name, overrides=over, results=[])
        for n in ns:
            r = dict(n_chunks=n, context_tokens=n * C)
            if pk:
                r["passkey"] = sum(passkey_accuracy(m, tok, n, C, d, band(g, ds), g["samples"], g["batch_size"],
                                                    g["seed"], dev) for d in ds) / len(ds)
            if lm:
                r["with_context"], _ = score_ppl(m, splits["val"], windows, n, C, T, K, "compressed", g["batch_size"], dev)
                r["without_context"] = base
            row["results"].append(r)
        m.scfg = trained
        print(f"{name:<30}" + "".join(f"{100 * r['passkey']:11.1f}%" for r in row["results"] if pk)
              + "".join(f"{r['with_context']:10.4f}" for r in row["results"] if lm), flush=True)
        res.append(row)
    return res


def main(g):
    dev, dt = auto_device(g["device"], g["dtype"])
    inf = float("inf")
    check_ranges(g, dict(samples=(1, inf), batch_size=(1, inf), block_size=(0, inf), max_windows=(1, inf),
                         score_last=(0, inf)))
    if g["depth_band"] != -1 and not 0 <= g["depth_band"] <= 1:
        raise SystemExit(f"eval.py: --depth_band={g['depth_band']}: expected -1 (the grid's spacing) or a value in [0, 1]")
    try:
        depths = [float(x) for x in g["depths"].split(",")]
        assert all(0 <= d <= 1 for d in depths)
    except (ValueError, AssertionError):
        raise SystemExit(f"eval.py: --depths={g['depths']}: expected depths in [0, 1] like 0,0.5,1") from None
    out_file(g["out"])
    if g["compare"] and g["task"] != "ablations":
        print(f"note: --compare is read by --task=ablations only; --task={g['task']} leaves it out")
    if g["task"] not in ("ppl", "passkey", "ablations"):
        raise SystemExit(f"eval.py: --task={g['task']}: expected ppl, passkey or ablations")
    if g["chunk_ids"] not in ("", "plain", "clamp", "random", "off"):
        raise SystemExit(f"eval.py: --chunk_ids={g['chunk_ids']}: expected plain, clamp, random or off")
    if g["logn_scale"] not in ("", "on", "off"):
        raise SystemExit(f"eval.py: --logn_scale={g['logn_scale']}: expected on or off")
    shared = {k: g[k] for k in ("height", "beta", "policy", "keep", "n_lower", "chunk_size", "chunk_ids",
                                "max_chunk_dist") if g[k]}
    if g["logn_scale"]:
        shared["logn_scale"] = g["logn_scale"] == "on"
    torch.manual_seed(g["seed"])
    try:
        model, tok, train_cfg = load_sharedllm(package_path(g["init_from"]), dev, getattr(torch, dt), **shared)
        if g["chunk_ids"] == "clamp" and not g["max_chunk_dist"] and train_cfg.get("chunk_ids") != "clamp":
            # a checkpoint trained without clamping: clamp at the longest distance it saw
            model.scfg.max_chunk_dist = train_cfg.get("n_chunks", model.scfg.max_chunk_dist)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"eval.py: --init_from={g['init_from']}: {e}") from None
    C = model.scfg.chunk_size
    n_train = train_cfg.get("n_chunks", 4)
    try:
        ns = [int(x) for x in g["chunks"].split(",")] if g["chunks"] else [n_train * f for f in (1, 4, 16, 64)]
        assert all(n >= 1 for n in ns)
    except (ValueError, AssertionError):
        raise SystemExit(f"eval.py: --chunks={g['chunks']}: expected positive integers like 4,16,64") from None
    T = g["block_size"] or train_cfg.get("block_size", 0)
    if T <= 0:
        raise SystemExit("eval.py: set --block_size (X_D tokens): the model folder does not say what it was trained with")
    K = g["score_last"] or min(256, T // 2)
    if not 1 <= K <= T:
        raise SystemExit(f"eval.py: --score_last={K}: expected 1..T={T}")
    print(f"model {g['init_from']}: {model.upper.cfg.n_layers} layers, dim {model.upper.cfg.dim}; {model.scfg}")
    print(f"device {dev}, {dt}; chunk counts {ns} (trained on {n_train})")
    t0 = time.time()
    try:
        needs_text = g["task"] == "ppl" or (g["task"] == "ablations" and train_cfg.get("task") != "passkey")
        splits = data.prepare(tok, package_path(g["data_dir"] or train_cfg.get("data_dir", ""))) if needs_text else None
        if needs_text and not g["chunks"]:   # the default lengths: those the validation documents hold
            longest = int(np.diff(splits["val"][1]).max())
            fit = [n for n in ns if n * C + T + 1 <= longest]
            if fit != ns:
                print(f"chunk counts {[n for n in ns if n not in fit]} left out: the longest validation document has "
                      f"{longest:,} tokens (a window needs n x {C} + T={T} + 1)")
            ns = fit or ns   # none fits: the error below names the longest document
        full_model = None
        if g["full"]:   # full attention is the unchanged base model's, whatever trained
            upper, label = base_model(model, train_cfg, dev, getattr(torch, dt))
            full_model = types.SimpleNamespace(upper=upper, label=label)
        if g["task"] == "ppl":
            res = run_ppl(model, splits, ns, C, T, K, g, dev, full_model)
        elif g["task"] == "passkey":
            res = run_passkey(model, tok, ns, C, g, dev, full_model=full_model)
        else:
            res = run_ablations(model, tok, splits, ns, C, T, K, g, dev, train_cfg.get("task", ""))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"eval.py: {e}") from None
    print(f"{g['task']} eval took {time.time() - t0:.1f} s")
    if g["out"]:
        with open(g["out"], "w") as f:
            json.dump(dict(task=g["task"], config={**g, "shared": model.scfg.__dict__, "T": T, "K": K, "device": dev,
                                                   "full_attention_model": full_model and full_model.label},
                           results=res), f, indent=1)
        print(f"wrote {g['out']}")
    return res


if __name__ == "__main__":
    config = config_of(globals())
    parse_overrides(sys.argv[1:], config, __file__)
    main(config)
