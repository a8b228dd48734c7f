"""
Pictures of SharedLLM at work, as PNG files, drawn from what a run really produced (matplotlib,
optional: pip install -r requirements-plots.txt; without it each script prints the text form).
Each function takes plain numbers, never a model, and returns the path it wrote, or None.

  architecture(...)     sample.py --plot=arch.png: a context tree with its kept KVs, the two models
  attention(...)        sample.py --attention=attn.png: where the answer's first token looks
  passkey_heatmap(...)  eval.py --task=passkey: exact match over context length x key depth
  curves(...)           python plots.py out: training curves from the run's out/log.jsonl
"""
import json
import os
import sys

import tree

INSTALL = "pip install -r requirements-plots.txt"
# root, level 1, 2, 3, ...
LEVEL_COLORS = ["#9e9e9e", "#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974"]


def drawing(draw):
    # draw(plt, *args) -> a figure, written to `path` (matplotlib, drawing to files: no screen); or,
    # without matplotlib, a line saying how to get the picture -> the path written, or None
    def drawn(path, *args):
        try:
            import matplotlib
        except ImportError:
            return print(f"(no picture: matplotlib is not installed; {INSTALL})")
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = draw(plt, *args)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        print(f"picture: {path}")
        return path
    return drawn


@drawing
def architecture(plt, nodes, chunk, n_chunks, C, keep, n_lower, n_layers, kvs_per_chunk, keys):
    # nodes: the preserved tree.Nodes of chunk `chunk` (of n_chunks); keys: (start, end) of each
    # mention of the passkey inside that chunk (the needle names it twice)
    from matplotlib.patches import FancyArrowPatch, Rectangle
    fig, ax = plt.subplots(figsize=(13.7, 6.5))
    ax.set_xlim(-0.7, 13), ax.set_ylim(0, 6.5), ax.axis("off")   # x < 0: the levels' names
    height = max(nd.level for nd in nodes)
    for i in range(min(n_chunks, 16)):   # X_C: the chunks, the drawn one highlighted
        c = i if n_chunks <= 16 or i < 15 else n_chunks - 1
        ax.add_patch(Rectangle((0.3 + i * 0.42, 5.9), 0.38, 0.3,
                               fc="#f2c14e" if c == chunk else "#e8e8e8", ec="k", lw=0.5))
    ax.text(0.3, 6.3, f"X_C: {n_chunks} chunks of C = {C} tokens" +
            (" (first 15 and the last shown)" if n_chunks > 16 else ""), fontsize=10)
    x0, w = 0.3, 6.4   # the context tree: a row per level, preserved nodes filled, kept KVs ticks
    ax.text(x0, 5.45, f"chunk {chunk}: its context tree (height {height}); filled = preserved, "
            "dashed = expanded, ticks = kept KVs", fontsize=10)
    ax.add_patch(Rectangle((x0, 4.9), w, 0.3, fc="none", ec=LEVEL_COLORS[0], lw=1.2))
    selected = tree.path(nodes, C)   # the node being split at each level: drawn dashed
    for nd in sorted(nodes, key=lambda nd: (nd.level, nd.start)):
        y = 4.9 - 0.75 * nd.level
        a, b = x0 + w * nd.start / C, x0 + w * nd.end / C
        ax.add_patch(Rectangle((a, y), b - a, 0.3, fc=LEVEL_COLORS[nd.level % len(LEVEL_COLORS)],
                               ec="k", lw=0.5, alpha=0.85))
        for p in tree.kept_positions(len(nd), nd.n_kept, keep):
            xp = x0 + w * (nd.start + p + 0.5) / C
            ax.plot([xp, xp], [y + 0.3, y + 0.42], color="k", lw=0.8)
        # narrow leaves: short
        label = f"{len(nd)} tokens: {nd.n_kept} KVs" if b - a > 1.3 else f"{len(nd)}: {nd.n_kept}"
        ax.text((a + b) / 2, y - 0.05, label, fontsize=7, ha="center", va="top")
        if nd.level < height:
            lo, hi = selected[nd.level]
            ax.add_patch(Rectangle((x0 + w * lo / C, y), w * (hi - lo) / C, 0.3, fc="none", ec="k",
                                   ls="--", lw=0.8))
    # left of the rows, so that no name sits beside the K/V box on the right
    for level in range(height + 1):
        ax.text(x0 - 0.12, 5.05 - 0.75 * level, f"level {level}" if level else "root", fontsize=8,
                ha="right", va="center")
    for start, end in keys:
        a, b = x0 + w * start / C, x0 + w * end / C
        ax.add_patch(Rectangle((a, 4.9 - 0.75 * height - 0.15), max(b - a, 0.03),
                               0.75 * height + 0.45, fc="red", alpha=0.25))
        ax.text(a, 4.9 - 0.75 * height - 0.4, "the key", color="red", fontsize=9)
    # the lower model under the tree, the compressed KVs, the upper model's layers
    ax.add_patch(Rectangle((0.3, 0.5), 6.4, 0.8, fc="#dbe9f6", ec="k"))
    ax.text(3.5, 0.9, f"LOWER model: the bottom M = {n_lower} layers of the same LLaMA;\n"
            "each preserved node is encoded on its own and keeps K/V at its ticks", ha="center",
            va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((3.5, 4.9 - 0.75 * height - 0.5), (3.5, 1.3), arrowstyle="-|>",
                                 mutation_scale=12))
    ax.add_patch(Rectangle((7.3, 2.6), 1.6, 1.2, fc="#fde2c8", ec="k"))
    ax.text(8.1, 3.2, f"compressed\nK/V: {kvs_per_chunk}\nper chunk x {n_chunks}\nper layer",
            ha="center", va="center", fontsize=8)
    ax.add_patch(FancyArrowPatch((6.7, 0.9), (7.6, 2.6), arrowstyle="-|>", mutation_scale=12))
    top, step = 6.0, min(0.5, 5.6 / n_layers)
    for i in range(n_layers):
        y = top - (n_layers - i) * step
        cross = i < n_lower
        ax.add_patch(Rectangle((10.0, y), 2.2, step * 0.8, fc="#cfe8cf" if cross else "#eeeeee",
                               ec="k", lw=0.5))
        ax.text(11.1, y + step * 0.4, f"layer {i + 1}" + (": self + cross-attn" if cross else ""),
                ha="center", va="center", fontsize=7)
        if cross:
            ax.add_patch(FancyArrowPatch((8.9, 3.2), (10.0, y + step * 0.4), arrowstyle="-|>",
                                         mutation_scale=8, color="#2e7d32", lw=0.8))
    ax.text(11.1, top + 0.15, "UPPER model over X_D", ha="center", fontsize=10)
    ax.text(11.1, top - n_layers * step - 0.35, "keys of chunk i at position i,\n"
            "queries of X_D at n", ha="center", va="top", fontsize=8)
    return fig


@drawing
def attention(plt, weights, kvs_per_chunk, key_chunk=None, key_nodes=(), title=""):
    # weights: per cross-attention layer, a (heads, n*S) list of lists: the answer's first token
    # over every compressed KV; key_chunk: the chunk of the key's first mention (shaded); key_nodes:
    # (label, KV indices) of every node that holds a mention of the key (the needle names it twice),
    # each marked in its own colour and listed with its weight per head
    import numpy as np
    fig, axes = plt.subplots(len(weights), 1, figsize=(13, 1.2 + 1.5 * len(weights)),
                             squeeze=False, layout="constrained")
    colors = ["cyan", "#7CFC00", "#ff9f1c", "#ff4fd8"]
    for j, (ax, w) in enumerate(zip(axes[:, 0], weights)):
        w = np.asarray(w)
        ax.imshow(w, aspect="auto", cmap="magma", interpolation="nearest", vmin=0,
                  vmax=max(w.max(), 1e-9))
        for c in range(1, w.shape[1] // kvs_per_chunk):
            ax.axvline(c * kvs_per_chunk - 0.5, color="white", lw=0.3, alpha=0.5)
        if key_chunk is not None:
            ax.axvspan(key_chunk * kvs_per_chunk - 0.5, (key_chunk + 1) * kvs_per_chunk - 0.5,
                       color="cyan", alpha=0.25)
            mass = w[:, key_chunk * kvs_per_chunk:(key_chunk + 1) * kvs_per_chunk].sum(1)
            ax.set_title(f"cross-attention layer {j + 1}: weight on the key's chunk per head " +
                         ", ".join(f"{m:.2f}" for m in mass), fontsize=9, loc="left",
                         pad=3 + 10 * len(key_nodes))
        for k, (label, kvs) in enumerate(key_nodes):
            color = colors[k % len(colors)]
            ax.plot(kvs, [-0.7] * len(kvs), ls="none", marker="v", color=color, mec="k", mew=0.3,
                    ms=5, clip_on=False,
                    label=f"{label}; per head " + ", ".join(f"{m:.2f}" for m in w[:, kvs].sum(1)))
        # between the panel and its title (a line each): the triangles' key, with this
        # layer's weights
        if key_nodes:
            ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), fontsize=7, frameon=False,
                      handletextpad=0.3, borderaxespad=0.2, labelspacing=0.2)
        ax.set_ylim(w.shape[0] - 0.5, -0.5)
        ax.set_yticks(range(w.shape[0]), [f"head {h}" for h in range(w.shape[0])], fontsize=7)
    axes[-1, 0].set_xlabel(f"compressed KVs, chunk by chunk in text order ({kvs_per_chunk} per "
                           "chunk); shaded: the chunk of the key's first mention; triangles: the "
                           "KVs of every node that holds a mention of the key")
    fig.suptitle(title, fontsize=10)
    return fig


@drawing
def passkey_heatmap(plt, grid, ns, ds, C):
    # grid[(n, d)]: exact match with n chunks and the key at depth d
    fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(ns), 1 + 0.5 * len(ds)))
    im = ax.imshow([[grid[n, d] for n in ns] for d in ds], vmin=0, vmax=1, cmap="viridis",
                   aspect="auto")
    for i, d in enumerate(ds):
        for j, n in enumerate(ns):
            ax.text(j, i, f"{100 * grid[n, d]:.0f}", ha="center", va="center",
                    color="w" if grid[n, d] < 0.6 else "k")
    ax.set_xticks(range(len(ns)), [f"{n * C:,}" for n in ns]), ax.set_yticks(range(len(ds)), ds)
    ax.set_xlabel("context tokens"), ax.set_ylabel("key depth"), fig.colorbar(
        im, label="exact match")
    return fig


@drawing
def curves(plt, steps, evals):
    # training loss per batch kind, passkey accuracy and the LM perplexity ratio per context length,
    # against iteration
    metrics = sorted({k for r in evals for k in r["eval"]})
    panels = [("training loss (mean per log interval)",
               {k: [(r["iter"], r["loss"][k]) for r in steps if k in r["loss"]]
                for k in sorted({k for r in steps for k in r["loss"]})}, True)]
    for prefix, label in (("passkey@", "passkey exact match"),
                          ("ppl_ratio@", "perplexity with / without X_C")):
        series = {k: [(r["iter"], r["eval"][k]) for r in evals if k in r["eval"]]
                  for k in metrics if k.startswith(prefix)}
        if series:
            panels.append((label, series, False))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (label, series, log) in zip(axes[0], panels):
        for name, pts in series.items():
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=name)
        ax.set_title(label, fontsize=10), ax.set_xlabel("iteration"), ax.legend(fontsize=7)
        if log:
            ax.set_yscale("log")
    return fig


if __name__ == "__main__":   # python plots.py OUT_DIR: OUT_DIR/curves.png from its log.jsonl
    records = [json.loads(line) for line in open(os.path.join(sys.argv[1], "log.jsonl"))]
    evals = [r for r in records if "eval" in r]
    for r in evals:   # the text form, always
        print(f"iter {r['iter']:6d}: " + ", ".join(f"{k} {v:.4f}" for k, v in r["eval"].items()))
    curves(os.path.join(sys.argv[1], "curves.png"), [r for r in records if "loss" in r], evals)
