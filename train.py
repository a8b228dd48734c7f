"""
Train SharedLLM, nanoGPT style. The default trains a tiny SharedLLM from scratch on a CPU in minutes, with no
download, on passkey retrieval mixed with language modeling on the Python standard library's own source:

  python train.py                                    # the default run (see README for its numbers)
  python train.py --help                             # every setting, with its comment
  python train.py --n_chunks=1 --max_iters=200       # any setting: --name=value
  python train.py config/llama2_7b_lm.py --init_from=/path/to/Llama-2-7b-hf   # a recipe file, then flags on top
  torchrun --nproc_per_node=2 train.py               # several GPUs (or CPU processes over gloo)

Read top to bottom: the settings, main() (setup, model, data, the training loop), then the pieces it calls.
"""
import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import torch

import data
import model as M
from configurator import auto_device, check_ranges, config_of, package_path, package_paths, parse_overrides, peak_flops
from checkpoint import (base_digest, read_checkpoint, restore_training, rng_states, save_checkpoint,
                        sharedllm_from_checkpoint)
from load_llama import load_llama, load_tokenizer, tokenizer_from_spec
from tokenizer import ByteTokenizer, GPT2Tokenizer

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
out_dir = "out"
init_from = "scratch"       # "scratch" | "resume" (from out_dir) | a LLaMA folder in HF layout | a .gguf file
eval_interval = 500         # evaluate and checkpoint every this many iterations
log_interval = 100
eval_only = False
# data
task = "mixed"              # "lm" | "passkey" | "mixed" (passkey + language modeling, like the paper's SFT mix)
data_dir = ""               # a folder of .txt files, a glob like dir/*_gut.txt, "stdlib" (the standard library's
                            # .py, also ""), "pydoc", or several joined by commas, drawn evenly (data.py); one file
                            # is one document, held out for validation: eval.py reads it, training cannot
tokenizer = "byte"          # "byte" | "gpt2" | a tokenizer.model / tokenizer.json path (a LLaMA folder brings its own)
n_chunks = 8                # n: context chunks per training sample at the end (X_C = n x C tokens)
block_size = 64             # T: running-text tokens (X_D); passkey samples pad after the answer (not scored)
# model: preset for scratch, SharedLLM settings always (model.SharedConfig says which are the paper's)
preset = "tiny"             # model.PRESETS key, for init_from=scratch
n_lower = 3                 # M: lower-model layers = cross-attention layers
chunk_size = 128            # C
height = 3                  # tree height h
beta = 8                    # compression: C / KVs kept per chunk
policy = "continuation"     # the search, every recipe's (beyond the paper: toward what follows the question's last
                            # words in X_C; no question goes right). Ablations: "query" (the paper's vector), "right"
                            # "continuation" (lexical: toward what follows the question's last words in X_C)
noise = 0.0                 # training split noise gamma: sigma = l / gamma, so larger = less noise; 0 = off (paper: 5, 10)
chunk_ids = "random"        # chunk-level position ids: "random" (every recipe's: random ids in training, plain at
                            # inference) | "plain" (the paper's, in training too) | "off" (its ablation)
train = "all"               # what trains: "all" | "cross" (cross-attention only: released code, LM) |
                            # "cross+top" (plus the top N-M layers: the paper's LM text) | "upper" (the whole upper model: SFT);
                            # the last two compress with a frozen copy of the bottom M layers (SharedConfig.lower="copy")
# optimizer
batch_size = 16
max_iters = 2600
learning_rate = 3e-3
min_lr = 3e-4               # the cosine schedule's floor
warmup_iters = 50
# system
device = "auto"             # "auto" = cuda, else cpu ("mps" only when named)
dtype = "auto"              # "auto" = bfloat16 autocast on CUDA where supported, else float32 (never float16 by default);
                            # what trains is always held in float32 (master weights and AdamW state)
compile = False
seed = 1337
# --- the recipe's knobs: a first reading can skip them (config/tiny.py writes the default run out) ---
eval_iters = 8              # batches per eval setting
final_eval_iters = 0        # ... and at the end (its first eval_iters passkey batches are those of every eval); 0 =
                            # eval_iters: 128 haystacks, a rate near 95% known to +-2 points (one standard error),
                            # and 128 text windows, about a tenth of the run (32: 512 of each, +-1 point)
eval_chunks = "4,16"        # chunk counts evaluated every eval_interval
final_eval_chunks = "4,16,64,256"   # ... and at the end (32K-token contexts: 64x the training length); "" = eval_chunks
pad_passkeys = True         # pad passkey batches to block_size after the answer (not scored); False: as long as their
                            # question and key (a real model's upper pass over T = 256 costs 10x the key's ~16 tokens)
passkey_frac = 0.67         # share of passkey batches in "mixed" (each batch is one kind: the passkey's 5 scored
                            # tokens are not drowned by a language-modeling sample's T scored tokens)
lm_from = 1500              # in "mixed", language-modeling batches join at this iteration (passkey alone first:
                            # mixed in from the start, text keeps the passkey on its plateau)
context_dropout = 0.25      # share of language-modeling batches trained without X_C, so the upper model also works
                            # alone (a fair "without context" baseline; a pretrained LLaMA has that for free)
chunk_schedule = "1:700,2:1200,4:2000"   # curriculum: 1 chunk until iter 700, 2 until 1200, 4 until 2000, then
                            # n_chunks ("" = off)
beta_schedule = "1:300,2:450,4:600"   # compression curriculum: beta 1 until iter 300, 2 until 450, 4 until 600, then beta
keep = "last"               # "last" | "first" token of each stride window
max_chunk_id = 1024         # "random": ids drawn up to this in training = the longest context in distribution (chunks)
activation_checkpointing = False
light_ckpt = True           # from a pretrained folder: checkpoints hold only what trains, plus the base's path and
                            # sha256 (a 7B run saves megabytes, not 13.5 GB); from scratch they always hold everything
gradient_accumulation_steps = 1
stop_iter = 0               # stop (checkpointed) at this iteration without changing the schedule; 0 = run to max_iters
ema_decay = 0.998           # evaluate and save an exponential moving average of the trained weights (half-life ~350
                            # iterations at 0.998); 0 = off. The raw weights ride along for resume. In "mixed" it
                            # starts again at lm_from: passkey-only weights in it cost the text (docs/experiments.md)
weight_decay = 0.0
beta1, beta2 = 0.9, 0.99
grad_clip = 1.0
# -----------------------------------------------------------------------------


config = config_of(globals())
if __name__ == "__main__":
    parse_overrides(sys.argv[1:], config, __file__)   # config files (config/*.py), then --name=value flags
    globals().update(config)


def main():
    # setup: processes, device, settings, random streams
    ddp, rank, world, dev, dt = setup_processes()
    master, dev_type = rank == 0, "cuda" if dev.startswith("cuda") else dev
    check_settings(dev, dev_type, dt)
    autocast = nullcontext() if dt == "float32" else torch.autocast(dev_type, dtype=getattr(torch, dt))
    rng = seed_streams(rank)   # the data stream; the tree's split noise and torch have their own
    if master:
        print(f"device {dev}, dtype {dt}{' (autocast)' if dt != 'float32' else ''}, {world} process(es)")
        os.makedirs(out_dir, exist_ok=True)

    # the model: both SharedLLM models from one LLaMA (new, a pretrained checkpoint, or this run's own to resume)
    tok, raw, ckpt, base, model_args = build_model(dt)
    params = prepare_to_train(raw, dt, dev, master, base)
    model = wrap(raw, ddp, dev_type)   # what the training step calls: compiled (CUDA) and under DDP where asked

    # data and schedules, every length checked against the data now, not at iteration 2,500
    chunk_pairs, beta_pairs = parse_schedule("chunk_schedule", chunk_schedule), parse_schedule("beta_schedule", beta_schedule)
    eval_counts = {"eval_chunks": parse_counts("eval_chunks", eval_chunks),
                   "final_eval_chunks": parse_counts("final_eval_chunks", final_eval_chunks or eval_chunks)}
    splits = load_data(tok, ddp, master)
    lm_eval_counts = check_lengths(tok, splits, sorted({n for n, _ in chunk_pairs} | {n_chunks}),
                                   sorted(set(sum(eval_counts.values(), []))), master)

    # the optimizer, its state and the random streams when resuming, the moving average of the weights
    optimizer, scaler = make_optimizer(params, dt)
    iter_num = 0 if ckpt is None else restore_training(ckpt, optimizer, scaler, rng, rank, dev_type, seed)
    if master and iter_num >= max_iters:
        print(f"nothing to train: {out_dir}/ckpt.pt is at iteration {iter_num} and --max_iters is {max_iters}")
    ema, names = moving_average(raw, params, ckpt)
    log_path = start_log(ckpt, iter_num, master)
    # a non-finite loss stops the run, read back only at log lines and checkpoints (one host sync per micro-step
    # costs nothing on a CPU and stalls a GPU); the weights it corrupted are never saved
    nonfinite, checked_at = torch.zeros((), dtype=torch.bool, device=dev), iter_num
    loss_sum, loss_n = {}, {}   # per batch kind, summed on the device between log lines

    # the loop
    clock = Clock(dev_type, dt, world, master)
    raw.train()
    start_iter = iter_num   # a resumed run does not re-evaluate its checkpoint
    while True:
        last = iter_num >= max_iters or 0 < stop_iter <= iter_num
        due = (iter_num % eval_interval == 0 or last) and (iter_num > start_iter or eval_only)   # the same on every rank
        if due and not eval_only:
            rngs = rng_states(rng, ddp, world, dev_type)   # every rank's (a collective), before rank 0 saves
        if due and master:
            check_finite(nonfinite, checked_at, iter_num)
            if not eval_only:   # first: an evaluation that fails never costs the trained weights
                save_checkpoint(os.path.join(out_dir, "ckpt.pt"), raw, optimizer, scaler, ema, names, base,
                                model_args=model_args, iter_num=iter_num, config=config, tokenizer=tok.spec, rngs=rngs)
            which, iters = ("final_eval_chunks", final_eval_iters or eval_iters) if last else ("eval_chunks", eval_iters)
            with averaged(params, ema), said_if_it_fails(iter_num):
                res = evaluate(raw, tok, splits, eval_counts[which], lm_eval_counts, iters, iter_num, dev, autocast)
            print(f"eval iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()), flush=True)
            log(log_path, iter=iter_num, eval=res)
            clock.last = time.time()   # eval time is not training time
        if last or eval_only:
            break
        lr = set_lr(optimizer, iter_num)
        # SharedLLM: this step's context length (chunks) and compression (beta), from the curricula
        n = scheduled(chunk_pairs, iter_num, n_chunks)
        raw.scfg.beta = scheduled(beta_pairs, iter_num, beta)   # an inference-time setting: no new weights
        for micro in range(gradient_accumulation_steps):
            # SharedLLM: a batch is X_C (n chunks), X_D with its targets, and the question's length
            kind, (ctx, idx, tgt, ql) = next_batch(rng, iter_num, tok, splits, n, dev)
            sync = nullcontext() if not ddp or micro == gradient_accumulation_steps - 1 else model.no_sync()
            with sync, autocast:
                _, loss = model(ctx, idx, tgt, ql)   # SharedLLM: compress X_C, then read X_D
            nonfinite |= ~torch.isfinite(loss.detach())   # on the device: read at the next log line or checkpoint
            loss_sum[kind] = loss_sum.get(kind, 0.0) + loss.detach()
            loss_n[kind] = loss_n.get(kind, 0) + 1
            scaler.scale(loss / gradient_accumulation_steps).backward()
        optimizer_step(optimizer, scaler, params, ema)
        iter_num += 1
        # the next batch (iteration lm_from) is the first that can be text: the average starts again
        # here, as passkey-only weights in it read text worse (docs/experiments.md); lm_from 0: never
        if ema is not None and task == "mixed" and iter_num == lm_from:
            restart_average(ema, params)
        if iter_num % log_interval == 0 and master:
            checked_at = check_finite(nonfinite, checked_at, iter_num)
            losses = {k: (loss_sum[k] / loss_n[k]).item() for k in loss_sum}   # mean per batch kind since the last line
            loss_sum, loss_n = {}, {}
            log_step(log_path, clock, raw, iter_num, losses, lr, n, idx.shape[1])
    if ddp:
        torch.distributed.barrier()   # the others wait for rank 0's last eval and checkpoint: no rank tears down early
        torch.distributed.destroy_process_group()

# -----------------------------------------------------------------------------
# setup


def setup_processes():
    # -> ddp, rank, world size, device, dtype name. Under torchrun each process is a rank (a GPU, or a CPU process).
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    dev, dt = auto_device(device, dtype)
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
        if dev.startswith("cuda"):
            dev = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(dev)
    return ddp, rank, world, dev, dt


def check_settings(dev, dev_type, dt):
    # every setting that can be checked before anything is built
    inf = float("inf")
    check_ranges(globals(), dict(passkey_frac=(0, 1), context_dropout=(0, 1), eval_iters=(1, inf),
                                 final_eval_iters=(0, inf), batch_size=(1, inf), gradient_accumulation_steps=(1, inf),
                                 max_iters=(1, inf), eval_interval=(1, inf), log_interval=(1, inf), warmup_iters=(0, inf),
                                 noise=(0, inf), n_chunks=(1, inf), block_size=(1, inf), stop_iter=(0, inf)))
    if task not in ("lm", "passkey", "mixed"):
        raise SystemExit(f"--task={task}: expected lm, passkey or mixed")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SystemExit(f"--out_dir={out_dir}: a file, not a folder")
    if dt == "float16" and dev_type != "cuda":
        raise SystemExit(f"--dtype=float16 on {dev}: float16 autocast is for CUDA GPUs without bfloat16 (it trains with a "
                         "gradient scaler there); use --dtype=float32 or --dtype=bfloat16")
    if not 0 <= ema_decay < 1:
        raise SystemExit(f"--ema_decay={ema_decay}: expected 0 (off) or a decay in (0, 1), like 0.998")
    if train == "cross" and context_dropout > 0 and task != "passkey":
        raise SystemExit(f"--context_dropout={context_dropout} with --train=cross: a batch without X_C reaches no trainable "
                         "parameter (only cross-attention trains, and the frozen upper model already works alone); "
                         "use --context_dropout=0")


def seed_streams(rank):
    torch.manual_seed(seed + rank)
    rng = random.Random(seed + rank)   # the data stream
    random.seed(seed + rank)           # tree split noise
    return rng


def shared_config():
    # this run's model.SharedConfig settings, from the config block
    return dict(n_lower=n_lower, chunk_size=chunk_size, height=height, beta=beta, policy=policy, keep=keep, noise=noise,
                chunk_ids=chunk_ids, max_chunk_id=max_chunk_id, lower="shared" if train in ("all", "cross") else "copy")

# -----------------------------------------------------------------------------
# the model


def build_model(dt):
    # -> tokenizer, SharedLLM, the checkpoint resumed from (or None), the light checkpoint's base, the model's arguments
    scfg, ckpt, base = shared_config(), None, None
    if init_from == "scratch":
        tok, llama = new_llama()
        model_args = dict(llama=asdict(llama.cfg), shared=scfg)
    elif init_from == "resume":
        ckpt, raw = resume_model(dt)
        tok = tokenizer_from_spec(ckpt["tokenizer"])
        model_args, llama, base = ckpt["model_args"], raw.upper, ckpt.get("base")
    else:   # a LLaMA folder or .gguf file: both models come from this one checkpoint
        tok, llama, base = pretrained_llama(dt)
        model_args = dict(llama=asdict(llama.cfg), shared=scfg)
    if tok.vocab_size > llama.cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is {llama.cfg.vocab_size}")
    llama.checkpointing = activation_checkpointing
    if ckpt is None:
        try:
            raw = M.SharedLLM(llama, M.SharedConfig(**scfg))
        except ValueError as e:   # an impossible SharedLLM setting (policy, chunk_ids, M, C / height / beta, ...)
            raise SystemExit(f"train.py: {e}") from None
    return tok, raw, ckpt, base, model_args


def new_llama():
    # init_from=scratch: a tokenizer and a randomly initialised LLaMA of the preset's shape
    try:
        tok = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}.get(tokenizer, lambda: load_tokenizer(tokenizer))()
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        raise SystemExit(f"--tokenizer={tokenizer}: {e} (expected byte, gpt2 or a tokenizer file)") from None
    if preset not in M.PRESETS:
        raise SystemExit(f"--preset={preset}: expected one of {sorted(M.PRESETS)}")
    return tok, M.Llama(M.preset(preset, vocab_size=max(M.PRESETS[preset]["vocab_size"], tok.vocab_size)))


def resume_model(dt):
    # init_from=resume: out_dir/ckpt.pt and its SharedLLM; a setting given otherwise would be silently ignored: refused
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        raise SystemExit(f"init_from=resume: no checkpoint at {path}")
    try:
        ckpt = read_checkpoint(path)
        raw = sharedllm_from_checkpoint(ckpt, path, getattr(torch, dt))   # as saved; a light one's base in dt
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"init_from=resume: {e}") from None
    except (KeyError, TypeError) as e:
        raise SystemExit(f"init_from=resume: {path} is not a train.py checkpoint (no {e})") from None
    try:
        was = {**asdict(raw.scfg), **{k: ckpt["config"].get(k, config[k]) for k in ("preset", "tokenizer")}}
        now = {**asdict(M.SharedConfig(**shared_config())), "preset": preset, "tokenizer": tokenizer}
    except ValueError as e:
        raise SystemExit(f"train.py: {e}") from None
    differ = [k for k in now if was[k] != now[k]]
    if differ:
        raise SystemExit(f"init_from=resume: {path} was trained with " + ", ".join(
            f"{k}={was[k]!r}" for k in differ) + " but this run sets " + ", ".join(
            f"{k}={now[k]!r}" for k in differ) + "; resume with its settings (or its config file). To read a "
            "checkpoint with other inference settings, use eval.py (--chunk_ids, --policy, --beta, ...)")
    return ckpt, raw


def pretrained_llama(dt):
    # init_from=a LLaMA folder or .gguf file: its tokenizer and model; with light_ckpt, the base that checkpoints name
    where = package_path(init_from)
    if not os.path.exists(where):
        raise SystemExit(f"--init_from={init_from}: no such file or folder (expected scratch, resume, a LLaMA folder "
                         "or a .gguf file)")
    if where.endswith(".pt") or os.path.isfile(os.path.join(where, "ckpt.pt")):
        raise SystemExit(f"--init_from={init_from}: a train.py checkpoint; to continue it, use --init_from=resume "
                         f"--out_dir={os.path.dirname(where) if where.endswith('.pt') else where}")
    try:
        tok = load_tokenizer(where)
        llama = load_llama(where, "cpu", getattr(torch, dt))   # bf16 on CUDA: what stays frozen stays bf16
        base = dict(path=os.path.abspath(where), sha256=base_digest(where)) if light_ckpt else None
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"init_from={init_from}: {e}") from None
    return tok, llama, base


def prepare_to_train(raw, dt, dev, master, base):
    # what trains (--train), held in fp32, printed; the model moved to the device -> the trained parameters
    set_trainable(raw, train)
    master_weights(raw)
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in raw.parameters() if not p.requires_grad)
    if master:
        print(f"model: {raw.upper.cfg}\nshared: {raw.scfg}\ntrainable {n_train:,} / frozen {n_frozen:,} parameters "
              f"(train={train!r})")
        if init_from not in ("scratch", "resume") or base:   # a pretrained model (a light checkpoint has a base)
            memory_estimate(raw, dt, dev)   # before anything is allocated on the device
    raw.to(dev)
    return [p for p in raw.parameters() if p.requires_grad]


def wrap(raw, ddp, dev_type):
    model = torch.compile(raw) if compile and dev_type != "cpu" else raw
    if ddp:   # a batch without X_C (context_dropout) leaves cross-attention unused on that rank: DDP must allow it
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[int(os.environ["LOCAL_RANK"])] if
                                                          dev_type == "cuda" else None,
                                                          find_unused_parameters=context_dropout > 0 and task != "passkey")
    return model


def set_trainable(m, which):
    Mn = m.scfg.n_lower
    rules = {
        "all": lambda n: True,
        "cross": lambda n: ".cross_" in n,
        "cross+top": lambda n: ".cross_" in n or (n.startswith("upper.layers.") and int(n.split(".")[2]) >= Mn)
                               or n.startswith(("upper.norm", "upper.output")),
        "upper": lambda n: n.startswith("upper."),
    }
    if which not in rules:
        raise SystemExit(f"--train={which}: expected one of {sorted(rules)}")
    for n, p in m.named_parameters():
        p.requires_grad_(rules[which](n))


def master_weights(m):
    # Mixed precision the standard way: what trains is held in fp32 (AdamW's step on a bf16 weight is lost whenever it
    # is below half a bf16 ulp: bf16(0.02 + 1e-5) == 0.02), frozen weights keep their dtype, autocast runs the math
    for p in m.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()

# -----------------------------------------------------------------------------
# data


def load_data(tok, ddp, master):
    # the language-modeling corpus, tokenized once into data_cache/ (None for passkeys alone: they are generated)
    if ddp and not master:
        torch.distributed.barrier()   # rank 0 tokenizes the corpus first; the others then read its cache
    try:
        splits = data.prepare(tok, package_paths(data_dir)) if task != "passkey" else None
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--data_dir={data_dir}: {e}") from None
    if ddp and master:
        torch.distributed.barrier()
    return splits


def next_batch(rng, iter_num, tok, splits, n, dev):
    # one training batch of one kind: -> kind, (context (B, n, C) or None, idx (B, T), targets (B, T), query lengths)
    kind = task
    if task == "mixed":
        kind = "passkey" if iter_num < lm_from or rng.random() < passkey_frac else "lm"   # one kind per batch
    T = block_size if kind == "lm" or pad_passkeys else None
    ctx, idx, tgt, ql = data.get_batch(kind, batch_size, rng, tok, splits, n, chunk_size, T)
    ctx, idx, tgt = ctx.to(dev), idx.to(dev), tgt.to(dev)   # query lengths stay on the host: the tree reads them
    if kind == "lm" and context_dropout > 0 and rng.random() < context_dropout:
        ctx = None
    return kind, (ctx, idx, tgt, ql)


def parse_schedule(name, spec):   # "v1:until1,v2:until2" -> [(v1, until1), (v2, until2)]
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in filter(None, spec.split(","))]
        assert all(len(p) == 2 for p in pairs), "each part is value:until_iter"
        assert all(v >= 1 for v, _ in pairs), "values are at least 1"
        if name == "beta_schedule":   # each scheduled beta must be a SharedConfig of its own
            [M.SharedConfig(**{**shared_config(), "beta": v}) for v, _ in pairs]
    except (ValueError, AssertionError) as e:
        raise SystemExit(f"--{name}={spec}: expected value:until_iter pairs like 2:1000,4:2000 ({e})") from None
    return pairs


def scheduled(pairs, it, final):   # the value of the first pair whose until_iter is still ahead, else final
    return next((v for v, until in pairs if it < until), final)


def parse_counts(name, spec):   # "4,16" -> [4, 16]
    try:
        counts = [int(x) for x in spec.split(",")]
        assert counts and all(n >= 1 for n in counts)
    except (ValueError, AssertionError):
        raise SystemExit(f"--{name}={spec}: expected chunk counts like 4,16,64 (positive integers)") from None
    return counts


def check_lengths(tok, splits, train_counts, eval_counts, master):
    # Every length the run will use, checked against the data at start-up, not at iteration 2,500 or after training,
    # where a crash would cost the run. Training must fit; an evaluation length that no validation document can hold
    # a language-modeling window for is evaluated on passkeys only, and said so. -> the chunk counts LM is evaluated at
    if task != "lm":   # keys tokenize to different lengths (BPE): the longest of a fixed sample of 102 keys
        keys = [10000, 99999] + [random.Random(k).randint(10000, 99999) for k in range(100)]
        needle = max(len(tok.encode(data.NEEDLE.format(key=k), bos=False)) for k in keys) + 1
        if min(train_counts + eval_counts) * chunk_size < needle:
            raise SystemExit(f"--chunk_size={chunk_size} with --n_chunks / --chunk_schedule / --eval_chunks: "
                             f"{min(train_counts + eval_counts)} chunk(s) hold {min(train_counts + eval_counts) * chunk_size}"
                             f" tokens; the passkey needle needs {needle}")
        xd = max(sum(map(len, data.passkey_question(tok, k))) for k in keys) - 1
        if pad_passkeys and block_size < xd:   # (else a passkey batch is as long as it needs)
            raise SystemExit(f"--block_size={block_size}: the passkey question and answer take up to {xd} tokens")
    if chunk_ids == "random" and max(train_counts) > max_chunk_id:
        raise SystemExit(f"--max_chunk_id={max_chunk_id}: random chunk ids for {max(train_counts)} chunks need at least "
                         f"{max(train_counts)}")
    if task == "passkey":
        return []
    need = lambda n: n * chunk_size + block_size + 1
    longest = {split: int(max(splits[split][1][1:] - splits[split][1][:-1])) for split in ("train", "val")}
    where = data_dir or "the standard library"
    if need(max(train_counts)) > longest["train"]:
        raise SystemExit(f"--n_chunks / --chunk_schedule: {max(train_counts)} chunks x {chunk_size} + block_size "
                         f"{block_size} + 1 = {need(max(train_counts)):,} tokens, and the longest training document of "
                         f"{where} has {longest['train']:,}")
    fit = [n for n in eval_counts if need(n) <= longest["val"]]
    why = (f"a window needs n x {chunk_size} + {block_size} + 1 tokens and the longest validation document of {where} "
           f"has {longest['val']:,}")
    if task == "lm" and not fit:
        raise SystemExit(f"--eval_chunks / --final_eval_chunks: no chunk count can be evaluated: {why}")
    if fit != eval_counts and master:
        print(f"language modeling is not evaluated at {[n for n in eval_counts if n not in fit]} chunks"
              f"{' (passkeys are)' if task == 'mixed' else ''}: {why}")
    return fit

# -----------------------------------------------------------------------------
# the training loop's pieces


def make_optimizer(params, dt):
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay)
    # float16 (CUDA only) has a narrow range: the loss is scaled up so that small gradients do not underflow to zero,
    # and steps whose gradients overflowed are skipped. Off (a pass-through) for float32 and bfloat16.
    scaler = torch.amp.GradScaler("cuda", enabled=dt == "float16")
    return optimizer, scaler


def set_lr(optimizer, it):
    lr = get_lr(it)
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def get_lr(it):   # linear warmup, then cosine down to min_lr at max_iters
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def optimizer_step(optimizer, scaler, params, ema):
    # clip, step, clear the gradients, move the moving average toward the new weights
    if grad_clip > 0:
        scaler.unscale_(optimizer)   # clip the true gradients (a no-op without float16)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - ema_decay)


def moving_average(raw, params, ckpt):
    # The moving average of what trains (fp32, like the master weights). At a high learning rate the raw weights hover
    # around a better point than any one of them; evaluations and checkpoints read the average. -> the average (None
    # when off) and every name of each trained tensor (a tied head has two), for the checkpoint's "model" and "raw"
    ema = [p.detach().clone() for p in params] if ema_decay > 0 else None
    names = [[n for n, q in raw.named_parameters(remove_duplicate=False) if q is p] for p in params]
    if ckpt is not None and "raw" in ckpt:   # the model was built from the average: the raw weights go on training
        with torch.no_grad():
            for p, ns in zip(params, names):
                p.copy_(ckpt["raw"][ns[0]])
    return ema, names


def restart_average(ema, params):   # the average forgets what came before: it is the weights as they are now
    with torch.no_grad():
        for e, p in zip(ema, params):
            e.copy_(p)


@contextmanager
def averaged(params, ema):   # the trained weights replaced by their moving average, and back exactly
    if ema is None:
        yield
        return
    held = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, h in zip(params, held):
                p.copy_(h)


@contextmanager
def said_if_it_fails(iter_num):   # an evaluation that fails says where the weights it was evaluating are
    try:
        yield
    except Exception:
        print(f"evaluation at iteration {iter_num} failed; the weights are saved in {os.path.join(out_dir, 'ckpt.pt')} "
              "(evaluate them again: --init_from=resume --eval_only=True)", flush=True)
        raise


@torch.no_grad()
def evaluate(raw, tok, splits, counts, lm_eval_counts, iters, iter_num, dev, autocast):
    # Passkey accuracy and language-modeling loss at each chunk count, with the context and with the upper model alone.
    # Fixed validation samples (their own seeds), so evals are comparable and never touch the training streams. In
    # "mixed", language modeling is measured once it has started (before lm_from it would measure noise).
    raw.eval()
    trained_beta, raw.scfg.beta = raw.scfg.beta, beta   # always evaluate at the target compression
    out, lm_counts, lm_batches = {}, [n for n in counts if n in lm_eval_counts], []   # what validation documents hold
    if lm_counts and (task == "lm" or (task == "mixed" and iter_num > lm_from)):
        # windows drawn once for the largest chunk count; a shorter context is the most recent n chunks of the same
        # window, so every length scores the very same X_D tokens and the ratios compare context alone
        # (as many batches as haystacks: the ratio is paired, the same tokens with and without the context, yet on 128
        # windows it moved by up to 0.014 with the windows drawn, as much as the effect; docs/experiments.md)
        lrng = random.Random(1000)
        lm_batches = [[t.to(dev) for t in data.get_batch("lm", batch_size, lrng, tok, splits, max(lm_counts), chunk_size,
                                                          block_size, "val")] for _ in range(iters)]
    for n in counts:
        erng = random.Random(1000 + n)
        if task in ("passkey", "mixed"):
            hits, found = [0, 0], dict(leaf=0, between=0, coarse=0)
            for _ in range(iters):
                ctx, idx, tgt, ql = [t.to(dev) for t in data.get_batch("passkey", batch_size, erng, tok, splits, n,
                                                                       chunk_size, None)]
                with autocast:
                    memory = raw.compress(ctx, idx, ql)                 # with the context (SharedLLM), then
                    both = raw.upper(idx, memory=memory)[0], raw.upper(idx)[0]   # the upper model alone
                for j, logits in enumerate(both):
                    hits[j] += ((logits.argmax(-1) == tgt) | (tgt == -100)).all(-1).sum().item()
                for where in data.key_placements(memory.nodes, ctx, tgt):   # where the search left the key
                    found[where] += 1
            out[f"passkey@{n}"], out[f"passkey_noctx@{n}"] = (h / (iters * batch_size) for h in hits)
            out[f"leaf@{n}"], out[f"coarse@{n}"] = (found[k] / (iters * batch_size) for k in ("leaf", "coarse"))
        if lm_batches and n in lm_counts:
            losses = [0.0, 0.0]
            for batch in lm_batches:
                for j, ctx in enumerate((batch[0][:, -n:], None)):
                    with autocast:
                        losses[j] += raw(ctx, batch[1], batch[2])[1].item() / len(lm_batches)
            out[f"lm_loss@{n}"], out[f"lm_loss_noctx@{n}"] = losses
            out[f"ppl_ratio@{n}"] = math.exp(losses[0] - losses[1])
    raw.train()
    raw.scfg.beta = trained_beta
    return out


def check_finite(nonfinite, since, iter_num):
    if nonfinite.item():
        raise SystemExit(f"a loss was not finite between iterations {since} and {iter_num}; lower --learning_rate "
                         "or use --dtype=float32 (nothing was saved after it)")
    return iter_num


def start_log(ckpt, iter_num, master):
    # the run's own log, out_dir/log.jsonl: one JSON line per step log and per evaluation (plots.py draws it). A fresh
    # run starts it anew; a resumed one keeps the lines up to its checkpoint and goes on from there.
    log_path = os.path.join(out_dir, "log.jsonl")
    if master:
        kept = []
        if ckpt is not None and os.path.isfile(log_path):
            kept = [line for line in open(log_path) if line.endswith("\n") and json.loads(line)["iter"] <= iter_num]
        with open(log_path, "w") as f:
            f.writelines(kept)
    return log_path


def log(log_path, **record):
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Clock:
    # the step lines' speed: training time since the last line (evaluations excluded), the run's
    # minutes, and the device's peak FLOP/s for the model FLOPs utilisation
    def __init__(self, dev_type, dt, world, master):
        self.dev_type, self.dt, self.world = dev_type, dt, world
        self.peak = peak_flops(dev_type, getattr(torch, dt)) if master else 1.0
        self.start = self.last = time.time()

    def lap(self):   # seconds per iteration since the last line
        now = time.time()
        dt_, self.last = (now - self.last) / log_interval, now
        return dt_


def log_step(log_path, clock, raw, iter_num, losses, lr, n, T):
    # the step's line: losses per batch kind, speed, model FLOPs utilisation
    dt_ = clock.lap()
    toks = gradient_accumulation_steps * batch_size * clock.world * (n * chunk_size + T)
    flops = step_flops(raw, n, T) * gradient_accumulation_steps * batch_size
    if flops / dt_ > clock.peak:   # faster than the start-up "peak": measured while the machine was busy
        clock.peak = max(peak_flops(clock.dev_type, getattr(torch, clock.dt)), flops / dt_)
        clock.last = time.time()   # measuring is not training time
    minutes = (time.time() - clock.start) / 60
    print(f"iter {iter_num}: loss " + " ".join(f"{v:.4f}" + (f" ({k})" if len(losses) > 1 else "")
                                               for k, v in losses.items())
          + f", lr {lr:.2e}, {dt_ * 1000:.0f} ms/iter, {toks / dt_:,.0f} tok/s, "
          f"mfu {100 * flops / dt_ / clock.peak:.1f}% (of {clock.peak / 1e12:.2f} TFLOP/s), chunks {n}, "
          f"{minutes:.1f} min", flush=True)
    log(log_path, iter=iter_num, loss=losses, lr=lr, ms_per_iter=1000 * dt_, tok_per_s=toks / dt_,
        mfu=flops / dt_ / clock.peak, peak_flops=clock.peak, chunks=n, beta=raw.scfg.beta, minutes=minutes)


def step_flops(m, n, T):
    # FLOPs of one sample's forward+backward (an estimate): 2 x params x tokens forward, 2 more for the input
    # gradient, 2 more for the weight gradient where weights train; plus attention. Lower: M layers over n*C context
    # tokens (forward only when frozen); upper: all layers over T tokens (backward runs through frozen layers too).
    c = m.upper.cfg
    per_layer = 2 * c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 3 * c.dim * c.hidden_dim
    lower_mult = 6 if any(p.requires_grad for p in m.lower_parameters()) else 2
    lower = lower_mult * per_layer * m.scfg.n_lower * n * m.scfg.chunk_size
    S = n * m.scfg.chunk_size // m.scfg.beta
    upper_mult = 6 if any(p.requires_grad for n_, p in m.upper.named_parameters() if ".cross_" not in n_) else 4
    upper = upper_mult * (per_layer * c.n_layers + c.dim * c.vocab_size) * T + 6 * c.n_layers * c.dim * T * T \
        + 6 * m.scfg.n_lower * (2 * c.dim * c.dim + 2 * c.dim * S) * T
    return lower + upper


def memory_estimate(m, dt, dev):
    # what training will hold on the device, printed before anything is allocated there: the weights as they are
    # (frozen ones in their load dtype, trainable ones in fp32), fp32 gradients and AdamW's two fp32 moments for what
    # trains, activations of one micro-batch (autocast: bf16 on CUDA), and the compressed KVs
    c, s = m.upper.cfg, m.scfg
    abytes = 2 if dt != "float32" else 4
    n_tr = sum(p.numel() for p in m.parameters() if p.requires_grad)
    act = batch_size * block_size * c.dim * abytes * (c.n_layers * (2 if activation_checkpointing else 18)) \
        + batch_size * block_size * c.vocab_size * 4 * 2
    kv = batch_size * 2 * s.n_lower * n_chunks * (s.chunk_size // s.beta) * c.n_kv_heads * c.head_dim * abytes
    est = dict(weights=sum(p.numel() * p.element_size() for p in m.parameters()), grads=n_tr * 4, adam=n_tr * 8,
               ema=n_tr * 4 if ema_decay > 0 else 0,
               activations=act, compressed_kv=kv)
    print("memory estimate: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in est.items())
          + f"; total {sum(est.values()) / 2**30:.1f} GiB on {dev}")


if __name__ == "__main__":
    main()
