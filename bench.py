"""
Time (and on CUDA, memory) of SharedLLM against context length, beside full attention over the
same tokens with the same weights; then the paper's efficiency knobs (M, beta, tree height, the
search) at one length, each measured in turn with the others, so that drift hits all alike.

  python bench.py                                    # the tiny preset, 4K..128K context tokens
  python bench.py --shape=smollm2-135m --n_lower=4   # a real model's shape, random weights
  python bench.py --init_from=out --out=bench.json   # a trained model's weights
"""
import json
import statistics
import sys
import time

import torch

import model as M
from configurator import config_of, package_path, parse_list, parse_overrides
from load_llama import PRESETS, auto_device, auto_dtype, load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = ""              # "" = random weights of --shape; or a train.py out_dir, a LLaMA folder
shape = "tiny"              # the random model's shape: a load_llama.PRESETS key
lengths = "4096,8192,16384,32768,65536,131072"   # context tokens X_C (each a multiple of C)
block_size = 256            # T: running-text tokens X_D, the question the search reads
full_max = 16384            # full attention up to this many context tokens (it is quadratic)
n_lower = 2                 # M
chunk_size = 1024           # C (the paper's; a train.py checkpoint keeps its own)
height = 3
beta = 8.0
policy = "right"            # the length sweep's search (the paper's Figure 3 is language modeling)
knob_length = 32768         # context tokens for the M / beta / height / policy tables
repeats = 5                 # timed repeats (median) after one warm-up
out = ""                    # write the results as JSON here
device = "auto"
dtype = "auto"              # "auto" = bfloat16 on CUDA, else float32
seed = 1337
# -----------------------------------------------------------------------------


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def peak_mb(dev, reset=False):
    # CUDA's allocator peak. None on a CPU: a process's resident peak (VmHWM) misreads it, as
    # memory freed by one run is reused by the next (SharedLLM read 0 MB after full attention).
    if not dev.startswith("cuda"):
        return float("nan")
    torch.cuda.reset_peak_memory_stats() if reset else None
    return torch.cuda.max_memory_allocated() / 2**20


@torch.no_grad()
def measure(fns, dev, reps):
    # each function once to warm up, then `reps` rounds calling each in turn -> per function
    # (median seconds, peak memory above what was held before it, MB)
    mem, times = [], [[] for _ in fns]
    for fn in fns:
        held = peak_mb(dev, reset=True)
        fn()
        sync(dev)
        mem.append(peak_mb(dev) - held)
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            sync(dev)
            ts.append(time.perf_counter() - t)
    return [(statistics.median(ts), mb) for ts, mb in zip(times, mem)]


def build(g, dev, dt, **shared):
    shared = dict(dict(n_lower=g["n_lower"], chunk_size=g["chunk_size"], height=g["height"],
                       beta=g["beta"], policy=g["policy"]), **shared)
    if g["init_from"]:
        for fixed in ("n_lower", "chunk_size"):   # what the weights were trained for
            shared.pop(fixed)
        return load_sharedllm(package_path(g["init_from"]), dev, g["dtype"], **shared)[0]
    torch.manual_seed(g["seed"])
    cfg = M.LlamaConfig(**PRESETS[g["shape"]])
    cfg.n_layers = max(cfg.n_layers, shared["n_lower"])   # the M table needs M layers
    return M.SharedLLM(M.Llama(cfg), M.SharedConfig(**shared)).to(device=dev, dtype=dt).eval()


def main(g):
    dev = auto_device(g["device"])
    dt = getattr(torch, auto_dtype(g["dtype"], True, dev))   # timed as a pretrained model runs
    m = build(g, dev, dt)
    C, T, c = m.scfg.chunk_size, g["block_size"], m.upper.cfg
    gen = torch.Generator().manual_seed(g["seed"])   # the same random tokens at every run
    inputs = lambda L: (torch.randint(0, c.vocab_size, (1, L // C, C), generator=gen).to(dev),
                        torch.randint(0, c.vocab_size, (1, T), generator=gen).to(dev))
    ql = torch.tensor([T])   # X_D is the question, for a query-aware search
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else \
        f"cpu, {torch.get_num_threads()} threads"
    print(f"{name}, {dt}; {g['init_from'] or g['shape']}: {c.n_layers} layers, dim {c.dim}, "
          f"heads {c.n_heads}/{c.n_kv_heads}; {m.scfg}; X_D = {T} tokens; median of "
          f"{g['repeats']}")

    # 1. SharedLLM (compress X_C, then the upper model over X_D) against full causal attention
    # over X_C + X_D as one sequence (logits for X_D's T positions only, as SharedLLM computes)
    print(f"\n{'context':>9} {'SharedLLM s':>12} {'full attn s':>12} {'speedup':>8} "
          f"{'Shared MB':>10} {'full MB':>9}")
    sweep = []
    for L in parse_list("lengths", g["lengths"]):
        ctx, idx = inputs(L)
        fns = [lambda: m(ctx, idx, question_len=ql)]
        if L <= g["full_max"]:
            seq = torch.cat([ctx.flatten(1), idx], dim=1)
            fns.append(lambda: m.upper(seq, last=T))
        rows = measure(fns, dev, g["repeats"])
        (s_t, s_mb), (f_t, f_mb) = rows[0], rows[1] if len(rows) > 1 else (None, None)
        sweep.append(dict(context_tokens=L, sharedllm_s=s_t, sharedllm_mb=s_mb, full_s=f_t,
                          full_mb=f_mb))
        full = f"{f_t:12.4f} {f_t / s_t:7.1f}x" if f_t else f"{'-':>12} {'-':>8}"
        print(f"{L:9,d} {s_t:12.4f} {full} {s_mb:10.1f} "
              f"{f'{f_mb:.1f}' if f_mb is not None else '-':>9}", flush=True)

    # 2. the knobs at one length: compress X_C with each value (the others as above)
    ctx, idx = inputs(g["knob_length"])
    knobs, base = {}, m.scfg
    print(f"\ncompress {g['knob_length']:,} context tokens, each knob's values in turn:")
    for knob, values in [("n_lower", (1, 2, 4, 8)), ("beta", (1, 2, 4, 8, 16, 32, 64)),
                         ("height", (1, 2, 3, 4)), ("policy", ("right", "vector", "lexical"))]:
        if knob == "n_lower" and g["init_from"]:
            continue   # fixed by the checkpoint's cross-attention layers
        values = [v for v in values if knob != "beta" or v <= C / (base.height + 1)]
        models = [build(g, dev, dt, n_lower=v) if knob == "n_lower" else m for v in values]
        configs = [M.SharedConfig(**{**base.__dict__, knob: v}) for v in values]

        def compress(mk, scfg):
            mk.scfg = scfg
            mk.compress(ctx, idx, ql)
        rows = measure([lambda mk=mk, s=s: compress(mk, s) for mk, s in zip(models, configs)], dev,
                       g["repeats"])
        m.scfg = base
        knobs[knob] = [dict(value=v, seconds=t, peak_mb=mb) for v, (t, mb) in zip(values, rows)]
        print(f"  {knob:<8}" + "  ".join(f"{v}: {t:.4f} s {mb:.0f} MB" for v, (t, mb)
                                          in zip(values, rows)))
    res = dict(device=name, dtype=str(dt), config=g, length_sweep=sweep, knobs=knobs)
    if g["out"]:
        json.dump(res, open(g["out"], "w"), indent=1)
    return res


if __name__ == "__main__":
    main(parse_overrides(sys.argv[1:], config_of(globals()), __file__))
