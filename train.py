"""
Train SharedLLM, nanoGPT style. The default trains a tiny SharedLLM from scratch on a CPU in
minutes, with no download, on passkey retrieval mixed with language modeling on the Python
standard library's own source:

  python train.py                                  # the default run (see README for its numbers)
  python train.py --help                           # every setting, with its comment
  python train.py --n_chunks=1 --max_iters=200     # any setting: --name=value
  python train.py config/llama2_7b_lm.py --init_from=/path/to/Llama-2-7b-hf   # a recipe, then flags
  torchrun --nproc_per_node=2 train.py             # several GPUs (or CPU processes over gloo)

Read top to bottom: the settings, then main(): setup, model, data and the training loop, with the
lines that make it SharedLLM rather than a plain LLaMA marked "SharedLLM:".
"""
import json
import math
import os
import random
import sys
import time
from contextlib import contextmanager, nullcontext

import torch

import data
from model import SharedConfig
from checkpoint import (restore_training, rng_states, save_checkpoint, set_trainable,
                        sharedllm_to_train)
from configurator import (auto_device, check_ranges, config_of, counted, memory_estimate,
                          package_path, package_paths, parse_counts, parse_overrides,
                          parse_schedule, peak_flops, scheduled, step_flops)

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value (or by a config/*.py file).
# "paper:" a value the paper fixes (its Sec. 4 and Table 6); "ours:" a choice beyond it, and why.
out_dir = "out"
init_from = "scratch"   # "scratch" | "resume" (from out_dir) | a LLaMA folder (HF layout) | a .gguf
eval_interval = 500     # evaluate and checkpoint every this many iterations
log_interval = 100
eval_iters = 8          # batches per eval setting
eval_chunks = "4,16"    # chunk counts evaluated every eval_interval
final_eval_chunks = "4,16,64,256"   # ... and at the end (32K-token contexts); "" = eval_chunks
# data
task = "mixed"          # "lm" | "passkey" | "mixed": passkeys + language modeling (ours: questions
                        # with their answer in X_C, in place of the paper's SFT data)
data_dir = ""           # .txt folder, glob, "stdlib" (= ""), "pydoc", or several joined by commas
tokenizer = "byte"      # "byte" | "gpt2" | a tokenizer file (a LLaMA folder brings its own)
n_chunks = 8            # n: context chunks per training sample at the end (X_C = n x C tokens)
block_size = 64         # T: running-text tokens (X_D); a size, for a CPU in minutes
# model: the preset for scratch; SharedLLM's settings always (model.SharedConfig)
preset = "tiny"         # load_llama.PRESETS key, for init_from=scratch
n_lower = 3             # M: lower-model layers = cross-attention layers (paper: 4 LM, 16 SFT)
chunk_size = 128        # C (paper: 1024 LM, 512 SFT)
height = 3              # tree height h (paper: 3)
beta = 8.0              # compression: C / KVs kept per chunk (paper: 8); need not be whole
sigma = 0.0             # split noise, a fraction of a node's length l (paper: l/5 LM, l/10 SFT);
                        # ours: 0, the paper's "w/o noise" ablation, as the tiny model trains
train = "all"           # what trains: "all" | "cross" | "cross+top" | "upper" (set_trainable);
                        # ours: "all" from scratch (the paper trains cross-attention, + top for LM)
policy = "lexical"      # step 1's search, ours in every recipe (model.lexical_policy); ablations:
                        # "vector" (the paper's), "right"
chunk_pos = "random"    # step 4's chunk position ids: "random" in training (ours, every recipe's:
                        # every distance seen) | "plain" (the paper's) | "off"
# the recipe, ours: curricula, the batch mix, the moving average of the weights
chunk_schedule = "1:700,2:1200,4:2000"  # chunks: 1 until iter 700, 2 until 1200, ..., then n;
                                        # ours: retrieval is found on short contexts first
beta_schedule = "1:300,2:450,4:600"     # beta: 1 until iter 300, 2 until 450, ..., then beta;
                                        # ours: the key is found before it is compressed
lm_from = 1500          # "mixed": text batches join here (ours: earlier, they stall the passkey)
passkey_frac = 0.67     # "mixed": the share of passkey batches, each batch one kind (ours)
pad_passkeys = True     # pad passkey batches to block_size, as text (ours; False: question+answer)
needles = "passkey"     # "passkey" | "mix": the passkey or, 2 in 3 samples, a fact of another
                        # template asked in other words (ours, for the retrieval recipes: data.py)
context_dropout = 0.25  # share of text batches without X_C (ours: the upper model also works
                        # alone, and the ratio with and without the context is a fair one)
ema_decay = 0.998       # evaluate and save a moving average of the weights; 0 = off (ours)
# optimizer: AdamW (paper: beta1 0.9), no weight decay, cosine lr; ours: gradients clipped at norm 1
batch_size = 16         # sizes (batch, steps): for a CPU in minutes
max_iters = 2600
learning_rate = 3e-3    # ours: a small model from scratch
min_lr = 3e-4           # the cosine schedule's floor (ours)
warmup_iters = 50       # ours: 2% of the run (paper: 1% LM, 0.1% SFT)
beta2 = 0.99            # ours: a short run (paper: 0.999)
# system
device = "auto"         # "auto" = cuda, else cpu ("mps" only when named)
dtype = "auto"          # "auto" = bfloat16 autocast on CUDA where supported, else float32
seed = 1337
# --- a first reading can skip the rest: control and scale-up ---
final_eval_iters = 0    # eval_iters for the last eval; 0 = eval_iters (128 haystacks: +-2 points)
keep = "last"           # "last" (ours) | "first" token of each stride window (model.SharedConfig)
max_chunk_id = 1024     # chunk_pos "random" (ours): the largest id drawn in training (4x the
                        # default's longest evaluation, 256 chunks)
gradient_accumulation_steps = 1
activation_checkpointing = False
compile = False         # torch.compile each upper block (the default run: 4.4 minutes, not 5.2, on
                        # a 2-core CPU; its floats differ: docs/efficiency.md)
light_ckpt = True       # from a pretrained model: checkpoints hold what trains + the base's sha256
eval_only = False       # evaluate (init_from=resume) and stop
stop_iter = 0           # stop (checkpointed) here, the schedule unchanged; 0 = run to max_iters
profile_iter = 0        # count this iteration's kernel launches and host syncs, and its batch's
                        # compress alone (torch.profiler; docs/efficiency.md); 0 = off
# -----------------------------------------------------------------------------


config = config_of(globals())
if __name__ == "__main__":
    parse_overrides(sys.argv[1:], config, __file__)   # config files, then --name=value flags
    globals().update(config)


def main():
    # setup: processes, device, settings, random streams
    ddp, rank, world, dev, dt = setup_processes()
    master, dev_type = rank == 0, "cuda" if dev.startswith("cuda") else dev
    check_settings(dev, dev_type, dt)
    autocast = nullcontext() if dt == "float32" else torch.autocast(dev_type, getattr(torch, dt))
    torch.manual_seed(seed + rank)
    rng = random.Random(seed + rank)   # the data stream
    random.seed(seed + rank)           # the tree's split noise
    if master:
        print(f"device {dev}, dtype {dt}{' (autocast)' if dt != 'float32' else ''}, "
              f"{world} process(es)")
        os.makedirs(out_dir, exist_ok=True)
    # the model: SharedLLM's two models from one LLaMA (new, pretrained, or this run's to resume)
    tok, raw, ckpt, base, model_args = sharedllm_to_train(
        package_path(init_from), shared_config(), getattr(torch, dt), out_dir, preset, tokenizer,
        light_ckpt, activation_checkpointing)
    model, params = place_model(raw, ddp, dev, dev_type, dt, master, base)
    # data and schedules, every length checked against the data now, not at iteration 2,500
    chunk_pairs, beta_pairs, eval_counts, splits, lm_eval_counts = load_data(tok, ddp, master)
    # the optimizer, its state when resuming, the moving average of what trains, the run's log
    optimizer, scaler, iter_num, ema, names = make_optimizer(raw, params, ckpt, rng, rank,
                                                             dev_type, dt)
    log_path = start_log(ckpt, iter_num, master)
    # a non-finite loss stops the run, read back only at log lines and checkpoints (a host sync
    # per step stalls a GPU); the weights it corrupted are never saved
    nonfinite, checked_at = torch.zeros((), dtype=torch.bool, device=dev), iter_num
    loss_sum, loss_n = {}, {}   # per batch kind, summed on the device between log lines
    peak = peak_flops(dev_type, getattr(torch, dt)) if master else 1.0   # the step line's MFU
    start = last_line = time.time()

    # the loop
    raw.train()
    start_iter = iter_num   # a resumed run does not re-evaluate its checkpoint
    while True:
        last = iter_num >= max_iters or 0 < stop_iter <= iter_num
        # (the same on every rank)
        due = (iter_num % eval_interval == 0 or last) and (iter_num > start_iter or eval_only)
        if due and not eval_only:
            rngs = rng_states(rng, ddp, world, dev_type)   # every rank's (a collective)
        if due and master:
            check_finite(nonfinite, checked_at, iter_num)
            if not eval_only:   # first: an evaluation that fails never costs the trained weights
                save_checkpoint(os.path.join(out_dir, "ckpt.pt"), raw, optimizer, scaler, ema,
                                names, base, model_args=model_args, iter_num=iter_num,
                                config=config, tokenizer=tok.spec, rngs=rngs)
            counts = eval_counts["final_eval_chunks" if last else "eval_chunks"]
            iters = (final_eval_iters or eval_iters) if last else eval_iters
            evaluate_and_log(raw, params, ema, tok, splits, counts, lm_eval_counts, iters,
                             iter_num, dev, autocast, log_path)
            last_line = time.time()   # eval time is not training time
        if last or eval_only:
            break
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr
        # SharedLLM: this step's context length (chunks) and compression (beta), from the curricula
        n = scheduled(chunk_pairs, iter_num, n_chunks)
        raw.scfg.beta = scheduled(beta_pairs, iter_num, beta)   # beta: no weight depends on it
        profiling = 0 < profile_iter == iter_num and master
        with counted(f"iteration {iter_num} ({n} chunks)") if profiling else nullcontext():
            for micro in range(gradient_accumulation_steps):
                # SharedLLM: a batch is X_C (n chunks), X_D with its targets, the question's length
                kind, (ctx, idx, tgt, ql) = next_batch(rng, iter_num, tok, splits, n, dev)
                last_micro = micro == gradient_accumulation_steps - 1
                sync = model.no_sync() if ddp and not last_micro else nullcontext()
                with sync, autocast:
                    _, loss = model(ctx, idx, tgt, ql)   # SharedLLM: compress X_C, then read X_D
                nonfinite |= ~torch.isfinite(loss.detach())   # on the device: read at a log line
                loss_sum[kind] = loss_sum.get(kind, 0.0) + loss.detach()
                loss_n[kind] = loss_n.get(kind, 0) + 1
                scaler.scale(loss / gradient_accumulation_steps).backward()
            update_weights(optimizer, scaler, params, ema)
        if profiling and ctx is not None:
            count_compress(raw, ctx, idx, ql, autocast, iter_num, kind, n)
        iter_num += 1
        # the next batch (iteration lm_from) is the first that can be text: the average starts
        # again, as passkey-only weights in it read text worse (docs/experiments.md); 0: never
        if ema is not None and task == "mixed" and iter_num == lm_from:
            with torch.no_grad():
                for e, p in zip(ema, params):
                    e.copy_(p)
        if iter_num % log_interval == 0 and master:
            checked_at = check_finite(nonfinite, checked_at, iter_num)
            losses = {k: (loss_sum[k] / loss_n[k]).item() for k in loss_sum}   # since the last line
            loss_sum, loss_n = {}, {}
            last_line = log_step(log_path, iter_num, losses, lr, raw, n, idx.shape[1], world, peak,
                                 start, last_line)
    if ddp:
        torch.distributed.barrier()   # all wait for rank 0's last eval and checkpoint
        torch.distributed.destroy_process_group()

# -----------------------------------------------------------------------------
# the pieces main() calls


def place_model(raw, ddp, dev, dev_type, dt, master, base):
    # what trains (fp32 master weights; the rest as loaded), on the device -> the module the step
    # calls (DDP-wrapped or raw itself), the trained parameters
    set_trainable(raw, train)
    if master:
        n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
        n_frozen = sum(p.numel() for p in raw.parameters() if not p.requires_grad)
        print(f"model: {raw.upper.cfg}\nshared: {raw.scfg}\ntrainable {n_train:,} / frozen "
              f"{n_frozen:,} parameters (train={train!r})")
        if init_from not in ("scratch", "resume") or base:   # pretrained: before the device has it
            memory_estimate(raw, dt, dev, batch_size, block_size, n_chunks, ema_decay,
                            activation_checkpointing)
    raw.to(dev)
    params = [p for p in raw.parameters() if p.requires_grad]
    if compile:   # each block (fused norms, rotations, MLP); the tree search stays eager: host
        # Python whose values torch.compile would guard on, recompiling at every batch
        for blk in raw.upper.layers:
            blk.compile()
    model = raw
    if ddp:   # a batch without X_C (context_dropout) leaves cross-attention unused on a rank
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[int(os.environ["LOCAL_RANK"])] if dev_type == "cuda" else None,
            find_unused_parameters=context_dropout > 0 and task != "passkey")
    return model, params


def load_data(tok, ddp, master):
    # the schedules, the corpus, and every length checked against them -> chunk and beta
    # schedules, eval chunk counts, the corpus splits, the counts text can be evaluated at
    chunk_pairs = parse_schedule("chunk_schedule", chunk_schedule)
    beta_pairs = parse_schedule("beta_schedule", beta_schedule,   # each beta a SharedConfig too
                                lambda v: SharedConfig(**{**shared_config(), "beta": v}), float)
    eval_counts = {name: parse_counts(name, spec) for name, spec in (
        ("eval_chunks", eval_chunks), ("final_eval_chunks", final_eval_chunks or eval_chunks))}
    splits = load_corpus(tok, ddp, master)
    train_counts = sorted({n for n, _ in chunk_pairs} | {n_chunks})
    lm_eval_counts = data.check_lengths(
        tok, splits, train_counts, sorted(set(sum(eval_counts.values(), []))), task, chunk_size,
        block_size, pad_passkeys, data_dir, master, needles)
    if chunk_pos == "random" and max(train_counts) > max_chunk_id:
        raise SystemExit(f"--max_chunk_id={max_chunk_id}: random chunk ids for "
                         f"{max(train_counts)} chunks need at least {max(train_counts)}")
    return chunk_pairs, beta_pairs, eval_counts, splits, lm_eval_counts


def make_optimizer(raw, params, ckpt, rng, rank, dev_type, dt):
    # AdamW (a loss scaler for float16 only: small gradients must not underflow), its state when
    # resuming, and the moving average of what trains (fp32; None when off) -> optimizer, scaler,
    # the iteration to start at, the average, each trained parameter's names
    optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, beta2), weight_decay=0.0,
                                  foreach=True)   # a few kernels for all tensors, also on a CPU
    scaler = torch.amp.GradScaler("cuda", enabled=dt == "float16")
    iter_num = 0
    if ckpt is not None:
        iter_num = restore_training(ckpt, optimizer, scaler, rng, rank, dev_type, seed)
    if rank == 0 and iter_num >= max_iters:
        print(f"nothing to train: {out_dir}/ckpt.pt is at iteration {iter_num} and --max_iters is "
              f"{max_iters}")
    ema = [p.detach().clone() for p in params] if ema_decay > 0 else None
    names = [[n for n, q in raw.named_parameters(remove_duplicate=False) if q is p] for p in params]
    if ckpt is not None and "raw" in ckpt:   # the model was built from the average: raw ones train
        with torch.no_grad():
            for p, ns in zip(params, names):
                p.copy_(ckpt["raw"][ns[0]])
    return optimizer, scaler, iter_num, ema, names


def update_weights(optimizer, scaler, params, ema):
    # one optimizer step on the true gradients (unscaled: a no-op without float16), clipped at
    # norm 1.0 (a constant: no recipe changes it); the moving average moves toward the new weights
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:   # one call for every tensor (a GPU: a few kernels, not one per tensor)
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1 - ema_decay)


def evaluate_and_log(raw, params, ema, tok, splits, counts, lm_eval_counts, iters, iter_num, dev,
                     autocast, log_path):
    # evaluate the moving average of the weights; a failure says where the weights are saved
    try:
        with averaged(params, ema):
            res = evaluate(raw, tok, splits, counts, lm_eval_counts, iters, iter_num, dev, autocast)
    except Exception:
        print(f"evaluation at iteration {iter_num} failed; the weights are saved in "
              f"{os.path.join(out_dir, 'ckpt.pt')} (evaluate them again: "
              "--init_from=resume --eval_only=True)", flush=True)
        raise
    print(f"eval iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()),
          flush=True)
    log(log_path, iter=iter_num, eval=res)



def setup_processes():
    # -> ddp, rank, world size, device, dtype name; under torchrun each process is a rank (a GPU
    # or a CPU process)
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    dev, dt = auto_device(device, dtype)
    if ddp:
        torch.distributed.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
        if dev.startswith("cuda"):
            dev = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(dev)
    return ddp, rank, world, dev, dt


def load_corpus(tok, ddp, master):
    # the text corpus, tokenized once into data_cache/ (None for passkeys alone: generated)
    if ddp and not master:
        torch.distributed.barrier()   # rank 0 tokenizes first, then the rest read its cache
    try:
        splits = data.prepare(tok, package_paths(data_dir)) if task != "passkey" else None
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--data_dir={data_dir}: {e}") from None
    if ddp and master:
        torch.distributed.barrier()
    return splits


def start_log(ckpt, iter_num, master):
    # out_dir/log.jsonl (plots.py draws it): a fresh run starts it anew, a resumed one keeps the
    # lines up to its checkpoint
    log_path = os.path.join(out_dir, "log.jsonl")
    if master:
        kept = open(log_path).readlines() if ckpt is not None and os.path.isfile(log_path) else []
        with open(log_path, "w") as f:
            f.writelines(line for line in kept
                         if line.endswith("\n") and json.loads(line)["iter"] <= iter_num)
    return log_path


def check_settings(dev, dev_type, dt):
    # every setting that can be checked before anything is built
    inf = float("inf")
    check_ranges(globals(), dict(
        passkey_frac=(0, 1), context_dropout=(0, 1), eval_iters=(1, inf), final_eval_iters=(0, inf),
        batch_size=(1, inf), gradient_accumulation_steps=(1, inf), max_iters=(1, inf),
        eval_interval=(1, inf), log_interval=(1, inf), warmup_iters=(0, inf), sigma=(0, inf),
        n_chunks=(1, inf), block_size=(1, inf), stop_iter=(0, inf), profile_iter=(0, inf)))
    if task not in ("lm", "passkey", "mixed"):
        raise SystemExit(f"--task={task}: expected lm, passkey or mixed")
    if needles not in ("passkey", "mix"):
        raise SystemExit(f"--needles={needles}: expected passkey or mix")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise SystemExit(f"--out_dir={out_dir}: a file, not a folder")
    if dt == "float16" and dev_type != "cuda":
        raise SystemExit(f"--dtype=float16 on {dev}: float16 autocast is for CUDA GPUs without "
                         "bfloat16 (it trains with a gradient scaler there); use --dtype=float32 "
                         "or --dtype=bfloat16")
    if not 0 <= ema_decay < 1:
        raise SystemExit(f"--ema_decay={ema_decay}: expected 0 (off) or a decay in (0, 1), "
                         "like 0.998")
    if train == "cross" and context_dropout > 0 and task != "passkey":
        raise SystemExit(f"--context_dropout={context_dropout} with --train=cross: a batch without "
                         "X_C reaches no trainable parameter (only cross-attention trains, and the "
                         "frozen upper model already works alone); use --context_dropout=0")


def shared_config():   # this run's model.SharedConfig settings
    return dict(n_lower=n_lower, chunk_size=chunk_size, height=height, beta=beta, policy=policy,
                keep=keep, sigma=sigma, chunk_pos=chunk_pos, max_chunk_id=max_chunk_id,
                lower_weights="shared" if train in ("all", "cross") else "copy")


def next_batch(rng, iter_num, tok, splits, n, dev):
    # one training batch of one kind -> kind, (context (B, n, C) or None, idx (B, T), targets
    # (B, T), question lengths: they stay on the host, where the search policies read them)
    kind = task
    if task == "mixed":
        kind = "passkey" if iter_num < lm_from or rng.random() < passkey_frac else "lm"
    if kind == "passkey" and needles == "mix":
        kind = "needles"
    T = block_size if kind == "lm" or pad_passkeys else None   # padded after the answer
    ctx, idx, tgt, ql = data.get_batch(kind, batch_size, rng, tok, splits, n, chunk_size, T)
    ctx, idx, tgt = ctx.to(dev), idx.to(dev), tgt.to(dev)
    if kind == "lm" and context_dropout > 0 and rng.random() < context_dropout:
        ctx = None
    return kind, (ctx, idx, tgt, ql)


def count_compress(raw, ctx, idx, ql, autocast, iter_num, kind, n):
    # --profile_iter: the batch's compress alone, once more; the random streams (chunk ids, split
    # noise) are put back, so the run trains on as it would have without the count
    state = random.getstate()
    label = f"iteration {iter_num}'s compress ({kind}, {n} chunks)"
    with torch.random.fork_rng(), counted(label), autocast:
        raw.compress(ctx, idx, ql)
    random.setstate(state)


def get_lr(it):   # linear warmup, then cosine down to min_lr at max_iters
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@contextmanager
def averaged(params, ema):   # the trained weights replaced by their moving average, then back
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


@torch.no_grad()
def evaluate(raw, tok, splits, counts, lm_eval_counts, iters, iter_num, dev, autocast):
    # Passkey accuracy and language-modeling loss at each chunk count, with the context and with
    # the upper model alone. Fixed validation samples (their own seeds): evals compare, and never
    # touch the training streams. In "mixed", text is measured once it has started (at lm_from).
    raw.eval()
    trained_beta, raw.scfg.beta = raw.scfg.beta, beta   # always at the target compression
    out, lm_counts, lm_batches = {}, [n for n in counts if n in lm_eval_counts], []
    if lm_counts and (task == "lm" or (task == "mixed" and iter_num > lm_from)):
        # windows drawn once for the largest chunk count; a shorter context is the last n chunks
        # of the same window: every length scores the same X_D tokens, the ratios compare context
        # alone (as many as haystacks: on 128 the ratio moved by up to 0.014; docs/experiments.md)
        lrng = random.Random(1000)
        lm_batches = [[t.to(dev) for t in data.get_batch(
            "lm", batch_size, lrng, tok, splits, max(lm_counts), chunk_size, block_size, "val")]
            for _ in range(iters)]
    for n in counts:
        erng = random.Random(1000 + n)
        if task in ("passkey", "mixed"):
            hits, found = [0, 0], dict(leaf=0, between=0, coarse=0)
            for _ in range(iters):
                ctx, idx, tgt, ql = [t.to(dev) for t in data.get_batch(
                    "passkey", batch_size, erng, tok, splits, n, chunk_size, None)]
                with autocast:   # with the context (SharedLLM), then the upper model alone
                    memory = raw.compress(ctx, idx, ql)
                    both = raw.upper(idx, memory=memory)[0], raw.upper(idx)[0]
                for j, logits in enumerate(both):
                    hits[j] += ((logits.argmax(-1) == tgt) | (tgt == -100)).all(-1).sum().item()
                for where in data.key_placements(memory.nodes, ctx, tgt):   # the search's verdict
                    found[where] += 1
            scale = iters * batch_size
            out[f"passkey@{n}"], out[f"passkey_noctx@{n}"] = (h / scale for h in hits)
            out[f"leaf@{n}"], out[f"coarse@{n}"] = (found[k] / scale for k in ("leaf", "coarse"))
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
        raise SystemExit(f"a loss was not finite between iterations {since} and {iter_num}; lower "
                         "--learning_rate or use --dtype=float32 (nothing was saved after it)")
    return iter_num


def log_step(log_path, iter_num, losses, lr, raw, n, T, world, peak, start, last_line):
    # the step line: losses per batch kind, speed, model FLOPs utilisation -> its time
    now, steps = time.time(), gradient_accumulation_steps * batch_size
    dt_ = (now - last_line) / log_interval   # seconds per iteration, evaluations excluded
    toks = steps * world * (n * chunk_size + T)
    mfu = step_flops(raw, n, T) * steps / dt_ / peak
    ordered = sorted(losses.items(), key=lambda kv: ("passkey", "needles", "lm").index(kv[0]))
    print(f"iter {iter_num}: loss " + " ".join(   # passkey first, whichever batch came first
        f"{v:.4f}" + (f" ({k})" if len(losses) > 1 else "") for k, v in ordered)
        + f", lr {lr:.2e}, {dt_ * 1000:.0f} ms/iter, {toks / dt_:,.0f} tok/s, mfu "
        f"{100 * mfu:.1f}% (of {peak / 1e12:.2f} TFLOP/s), chunks {n}, "
        f"{(now - start) / 60:.1f} min", flush=True)
    log(log_path, iter=iter_num, loss=losses, lr=lr, ms_per_iter=1000 * dt_, tok_per_s=toks / dt_,
        mfu=mfu, peak_flops=peak, chunks=n, beta=raw.scfg.beta, minutes=(now - start) / 60)
    return now


def log(log_path, **record):   # out_dir/log.jsonl: a JSON line per step line and per evaluation
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
