"""
Train SharedLLM, nanoGPT style. The default trains a tiny SharedLLM from scratch on a CPU in
minutes, with no download, on passkey retrieval mixed with language modeling on the Python
standard library's own source:

  python train.py                                  # the default run (README: its numbers)
  python train.py --help                           # every setting, with its comment
  python train.py --n_chunks=1 --max_iters=200     # any setting: --name=value
  python train.py config/llama2_7b_lm.py --init_from=/path/to/Llama-2-7b-hf   # a recipe, then flags
  torchrun --nproc_per_node=2 train.py             # several GPUs (or CPU processes over gloo)

Read top to bottom: the settings, the model, the data, the evaluation, then the training loop.
The lines that make it SharedLLM rather than a plain LLaMA are marked "SharedLLM:".
"""
import json
import math
import os
import random
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch

import data
from configurator import (config_of, package_path, parse_list, parse_overrides,
                          parse_schedule, scheduled)
from load_llama import (PRESETS, auto_device, auto_dtype, load_llama, load_tokenizer,
                        read_checkpoint, sharedllm_from_checkpoint)
from model import Llama, LlamaConfig, SharedConfig, SharedLLM

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value (or by a config/*.py file).
# "paper:" a value the paper fixes (its Sec. 4 and Table 6); "ours:" a choice beyond it, and why.
out_dir = "out"
init_from = "scratch"   # "scratch" | "resume" (from out_dir) | a LLaMA folder (HF layout) | a .gguf
eval_interval = 500     # evaluate and checkpoint every this many iterations
log_interval = 100
eval_iters = 8          # batches per eval setting (128 haystacks at batch 16: +-2 points at 95%)
eval_chunks = "4,16"    # chunk counts evaluated every eval_interval
final_eval_chunks = "4,16,64,256"   # ... and at the end (32K-token contexts); "" = eval_chunks
# data
task = "mixed"          # "lm" | "passkey" | "mixed": questions + language modeling (ours: questions
                        # with their answer in X_C, in place of the paper's SFT data)
questions = "passkey"   # the question batches: "passkey" | "mix" (facts too, data.fact_sample)
data_dir = ""           # .txt folder, glob, "stdlib" (= ""), "pydoc", or several joined by commas
tokenizer = "byte"      # "byte" | a tokenizer file, for scratch (a LLaMA folder brings its own)
n_chunks = 8            # n: context chunks per training sample at the end (X_C = n x C tokens)
block_size = 64         # T: running-text tokens (X_D); a size, for a CPU in minutes
# model: the preset for scratch; SharedLLM's settings always (model.SharedConfig)
preset = "tiny"         # load_llama.PRESETS key, for init_from=scratch
n_lower = 3             # M: lower-model layers = cross-attention layers (paper: 4 LM, 16 SFT)
chunk_size = 128        # C (paper: 1024 LM, 512 SFT)
height = 3              # tree height h (paper: 3)
beta = 8.0              # compression: C / KVs kept per chunk (paper: 8); need not be whole
sigma = 0.0             # split noise, a fraction of a node's length l (paper: l/5 LM, l/10 SFT);
                        # ours: 0, the paper's "w/o noise" ablation: the tiny model trains better
train = "all"           # what trains: "all" | "cross" (cross-attention) | "cross+top" (and the top
                        # N-M layers: the paper's LM recipe, Sec. 4.1); ours: "all" from scratch
policy = "lexical"      # step 1's search, ours in every recipe (model.lexical_targets); the
                        # paper's: "vector" (questions), "right" (language modeling)
chunk_pos = "random"    # step 4's chunk position ids: "random" in training (ours, every recipe's:
                        # every distance seen) | "plain" (the paper's) | "off"
keep = "last"           # "last" (ours) | "first" token of each stride window (model.SharedConfig)
max_chunk_id = 1024     # chunk_pos "random": the largest id drawn in training (4x the default's
                        # longest evaluation, 256 chunks)
# the recipe, ours: curricula, the batch mix, the moving average of the weights
chunk_schedule = "1:700,2:1200,4:2000"  # chunks: 1 until iter 700, 2 until 1200, ..., then n;
                                        # ours: retrieval is found on short contexts first
beta_schedule = "1:300,2:450,4:600"     # beta: 1 until iter 300, 2 until 450, ..., then beta;
                                        # ours: the key is found before it is compressed
lm_from = 1500          # "mixed": text batches join here (ours: earlier, they stall the passkey)
passkey_frac = 0.67     # "mixed": the share of question batches, each batch one kind (ours)
first_token_weight = 1.0   # question batches: the answer's first token counts this many times
                           # (ours: only it is found from the question; the rest follow it)
context_dropout = 0.25  # share of text batches without X_C (ours: the upper model also works
                        # alone, and the ratio with and without the context is a fair one)
ema_decay = 0.998       # evaluate and save a moving average of the weights (ours: a half-life of
                        # 346 steps); 0 = off
# optimizer: AdamW (paper: beta1 0.9), no weight decay, cosine lr; ours: gradients clipped at norm 1
batch_size = 16         # sizes (batch, steps): for a CPU in minutes
max_iters = 2600
learning_rate = 3e-3    # ours: a small model from scratch
min_lr = 3e-4           # the cosine schedule's floor (ours)
warmup_iters = 50       # ours: 2% of the run (paper: 1% LM, 0.1% SFT)
beta2 = 0.99            # ours: a short run (paper: 0.999)
gradient_accumulation_steps = 1
# system
device = "auto"         # "auto" = cuda, else cpu
dtype = "auto"          # "auto" = bfloat16 autocast for a pretrained model on CUDA, else float32
seed = 1337
compile = False         # torch.compile each upper block (the tree search stays eager)
activation_checkpointing = False   # recompute each upper block in backward: memory for time
# -----------------------------------------------------------------------------
config = config_of(globals())
parse_overrides(sys.argv[1:], config, __file__)   # recipe files, then --name=value flags
ckpt = None
if config["init_from"] == "resume":   # the run's own settings, then this command's on top
    ckpt = read_checkpoint(os.path.join(config["out_dir"], "ckpt.pt"))
    config = parse_overrides(sys.argv[1:], dict(ckpt["config"]), __file__, echo=False)
globals().update(config)
if train not in ("all", "cross", "cross+top"):
    raise SystemExit(f"--train={train}: expected all, cross or cross+top")

# setup: processes (torchrun: one per GPU, or CPU processes over gloo), device, random streams
ddp = int(os.environ.get("RANK", -1)) != -1
rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
master = rank == 0
dev = auto_device(device)
if ddp:
    torch.distributed.init_process_group("nccl" if dev == "cuda" else "gloo")
    if dev == "cuda":
        dev = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(dev)
dev_type = "cuda" if dev.startswith("cuda") else dev
base = None   # a pretrained model's path: checkpoints then hold only what trains, and this path
if ckpt or init_from != "scratch":
    base = ckpt.get("base") if ckpt else os.path.abspath(package_path(init_from))
dt = auto_dtype(dtype, base, dev)
autocast = nullcontext() if dt == "float32" else torch.autocast(dev_type, getattr(torch, dt))
torch.manual_seed(seed + rank)
rng = random.Random(seed + rank)   # the data stream
random.seed(seed + rank)           # the tree's split noise
if master:
    print(f"device {dev}, dtype {dt}, {world} process(es)")
    os.makedirs(out_dir, exist_ok=True)

# the model: SharedLLM's two models from one LLaMA, new, pretrained, or this run's to resume
shared = dict(n_lower=n_lower, chunk_size=chunk_size, height=height, beta=beta, policy=policy,
              sigma=sigma, chunk_pos=chunk_pos, max_chunk_id=max_chunk_id, keep=keep)
if init_from == "scratch":
    tok = load_tokenizer(tokenizer)
    vocab = max(PRESETS[preset]["vocab_size"], tok.vocab_size)
    raw = SharedLLM(Llama(LlamaConfig(**{**PRESETS[preset], "vocab_size": vocab})),
                    SharedConfig(**shared))
elif init_from == "resume":   # the checkpoint's model
    raw = sharedllm_from_checkpoint(ckpt, getattr(torch, dt))
    tok = load_tokenizer(ckpt["tokenizer"])
else:   # a LLaMA folder or .gguf: both models from this one checkpoint
    raw = SharedLLM(load_llama(base, "cpu", getattr(torch, dt)), SharedConfig(**shared))
    tok = load_tokenizer(base)
model_args = ckpt["model_args"] if ckpt else dict(llama=asdict(raw.upper.cfg), shared=shared)
raw.upper.checkpointing = activation_checkpointing
# what trains, in fp32 (an AdamW step on a bf16 weight below half its ulp is lost); the rest stays
for name, p in raw.named_parameters():
    top = name.startswith("upper.layers.") and int(name.split(".")[2]) >= raw.scfg.n_lower
    p.requires_grad_(train == "all" or ".cross_" in name or (train == "cross+top" and top))
    p.data = p.data.float() if p.requires_grad else p.data
if master:
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    print(f"model: {raw.upper.cfg}\nshared: {raw.scfg}\ntrainable {n_train:,} of "
          f"{sum(p.numel() for p in raw.parameters()):,} parameters (train={train!r})")
raw.to(dev)
params = [p for p in raw.parameters() if p.requires_grad]
if compile:   # each block (fused norms, rotations, MLP); the tree search stays eager: host Python
    for blk in raw.upper.layers:   # whose values torch.compile would recompile on at every batch
        blk.compile()
model = raw
if ddp:   # a batch without X_C (context_dropout) leaves cross-attention unused on a rank
    model = torch.nn.parallel.DistributedDataParallel(
        raw, device_ids=[int(os.environ["LOCAL_RANK"])] if dev_type == "cuda" else None,
        find_unused_parameters=context_dropout > 0 and task != "passkey")

# the data: the curricula (SharedLLM: context length and compression), the corpus (tokenized once
# into data_cache/; none for passkeys alone, which are generated), the lengths checked at the start
chunk_pairs = parse_schedule("chunk_schedule", chunk_schedule)
beta_pairs = parse_schedule("beta_schedule", beta_schedule, float)
for b, _ in beta_pairs:   # every beta of the schedule is one the model accepts
    SharedConfig(**{**shared, "beta": b})
eval_counts = parse_list("eval_chunks", eval_chunks)
final_counts = parse_list("final_eval_chunks", final_eval_chunks or eval_chunks)
texts = task != "passkey" or questions == "mix"
splits = data.prepare(tok, package_path(data_dir)) if texts else None
longest = {s: int(np.diff(splits[s][1]).max()) for s in splits} if splits else {}
most = max([n_chunks] + [n for n, _ in chunk_pairs]) * chunk_size + block_size + 1
if train == "cross" and context_dropout > 0 and task != "passkey":
    raise SystemExit("--context_dropout: with --train=cross a text batch without X_C trains "
                     "nothing (the frozen model already reads X_D alone); set it to 0")
if splits and most > longest["train"]:
    raise SystemExit(f"--n_chunks, --chunk_schedule: a training window needs {most:,} tokens; the "
                     f"longest training document has {longest['train']:,}")

# the optimizer, the moving average of what trains, and the state of a run to resume
optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=(0.9, beta2), weight_decay=0.0,
                              foreach=True)   # a few kernels for all tensors, also on a CPU
scaler = torch.amp.GradScaler("cuda", enabled=dt == "float16")   # float16: no underflow
ema = [p.detach().clone() for p in params] if ema_decay > 0 else None
# every name of each trained tensor (a tied head is the embedding: one tensor, two names)
names = [[n for n, q in raw.named_parameters(remove_duplicate=False) if q is p] for p in params]
iter_num = 0
if ckpt:   # the optimizer, this process's random streams, and the raw weights (after the average,
    # which the checkpoint's model holds, was copied above)
    optimizer.load_state_dict(ckpt["optimizer"])
    if "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    iter_num, streams = ckpt["iter_num"], ckpt["rngs"][rank]
    rng.setstate(streams["data"])
    random.setstate(streams["tree"])
    torch.set_rng_state(streams["torch"])
    if "cuda" in streams:
        torch.cuda.set_rng_state(streams["cuda"])
    if "raw" in ckpt:
        with torch.no_grad():
            for p, ns in zip(params, names):
                p.copy_(ckpt["raw"][ns[0]])
log_path = os.path.join(out_dir, "log.jsonl")   # a JSON line per log line and evaluation
if master:   # a fresh run starts it anew, a resumed one keeps its lines up to the checkpoint
    kept = open(log_path).readlines() if ckpt and os.path.isfile(log_path) else []
    with open(log_path, "w") as f:
        f.writelines(line for line in kept if json.loads(line)["iter"] <= iter_num)


def get_lr(it):   # linear warmup, then cosine down to min_lr at max_iters
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def evaluate(counts):
    # Passkey accuracy and language-modeling loss at each chunk count, with the context and with
    # the upper model alone, on fixed samples (their own seeds: evals compare, and never touch the
    # training streams); text once it has started (lm_from)
    raw.eval()   # at the target compression, the config's beta
    out, lm_batches = {}, []
    lm_counts = [n for n in counts if n * chunk_size + block_size + 1 <= longest.get("val", 0)]
    if lm_counts and (task == "lm" or (task == "mixed" and iter_num > lm_from)):
        # windows drawn once for the largest chunk count; a shorter context is the last n chunks
        # of the same window: every length scores the same X_D tokens
        lrng = random.Random(1000)
        lm_batches = [[t.to(dev) for t in data.get_batch(
            "lm", batch_size, lrng, tok, splits, max(lm_counts), chunk_size, block_size, "val")]
            for _ in range(eval_iters)]
    for n in counts:
        erng = random.Random(1000 + n)
        if task in ("passkey", "mixed"):
            hits, found = [0, 0], Counter()   # where the search left the key
            for _ in range(eval_iters):
                ctx, idx, tgt, ql = data.get_batch("passkey", batch_size, erng, tok, splits, n,
                                                   chunk_size, None)
                ctx, idx, tgt = ctx.to(dev), idx.to(dev), tgt.to(dev)   # (ql: on the host)
                with autocast:   # with the context (SharedLLM), then the upper model alone
                    memory = raw.compress(ctx, idx, ql)
                    both = raw.upper(idx, memory=memory)[0], raw.upper(idx)[0]
                for j, logits in enumerate(both):
                    hits[j] += data.exact_match(logits, tgt).sum().item()
                for i, (row, t) in enumerate(zip(ctx.flatten(1).tolist(), tgt)):
                    key = data.key_mentions(row, t[t != -100].tolist())
                    found.update(data.placement(memory.nodes[i * n:(i + 1) * n], [key], chunk_size))
            scale = eval_iters * batch_size
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
    return out


def swap_average():   # the moving average of the weights in place of the trained ones, or back
    for p, e in zip(params, ema or []):
        p.data, e.data = e.data, p.data


def check_finite():   # the weights a non-finite loss corrupted are never saved
    if nonfinite.item():
        raise SystemExit(f"a loss was not finite before iteration {iter_num}; lower "
                         "--learning_rate or use --dtype=float32")


def log(**record):   # out_dir/log.jsonl (plots.py draws it)
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")


# the training loop. A non-finite loss, and the losses, are read at log lines only (a read per
# step stalls a GPU)
nonfinite, loss_sum, loss_n = torch.zeros((), dtype=torch.bool, device=dev), {}, {}
start = last_line = time.time()
start_iter = iter_num   # a resumed run does not evaluate its checkpoint again
raw.train()
while True:
    last = iter_num >= max_iters
    if (iter_num % eval_interval == 0 or last) and iter_num > start_iter:
        # save first (a failing evaluation never costs the weights), then evaluate the average
        mine = dict(data=rng.getstate(), tree=random.getstate(), torch=torch.get_rng_state(),
                    **(dict(cuda=torch.cuda.get_rng_state()) if dev_type == "cuda" else {}))
        rngs = [mine] * world
        if ddp:   # every process's streams, so that each goes on exactly; and a non-finite loss
            torch.distributed.all_gather_object(rngs, mine)   # on any process (its gradient
            bad = nonfinite.to(torch.int32)                    # reached every process's weights)
            torch.distributed.all_reduce(bad, torch.distributed.ReduceOp.MAX)
            nonfinite |= bad.bool()
        if master:
            check_finite()
            state = raw.state_dict()
            if base:   # light: what trains; the base model holds the rest
                state = {k: v for k, v in state.items() if any(k in ns for ns in names)}
            ck = dict(model=state, optimizer=optimizer.state_dict(), model_args=model_args,
                      iter_num=iter_num, config=config, tokenizer=tok.spec, rngs=rngs, base=base)
            if ema is not None:   # "model" is the average (eval.py, sample.py), "raw" resumes
                avg = {n: e for e, ns in zip(ema, names) for n in ns}
                ck.update(model={**state, **avg}, raw={n: state[n] for n in avg})
            if scaler.is_enabled():
                ck["scaler"] = scaler.state_dict()
            torch.save(ck, os.path.join(out_dir, "ckpt.pt.tmp"))   # whole, then renamed: a crash
            os.replace(os.path.join(out_dir, "ckpt.pt.tmp"), os.path.join(out_dir, "ckpt.pt"))
            swap_average()
            res = evaluate(final_counts if last else eval_counts)
            swap_average()
            print(f"eval iter {iter_num}: " + ", ".join(f"{k} {v:.4f}" for k, v in res.items()),
                  flush=True)
            log(iter=iter_num, eval=res)
            last_line = time.time()   # eval time is not training time
    if last:
        break
    lr = get_lr(iter_num)
    for g in optimizer.param_groups:
        g["lr"] = lr
    # SharedLLM: this step's context length (chunks) and compression (beta), from the curricula
    n = scheduled(chunk_pairs, iter_num, n_chunks)
    step_beta = scheduled(beta_pairs, iter_num, beta)   # (no weight depends on beta)
    for micro in range(gradient_accumulation_steps):
        # SharedLLM: a batch is X_C (n chunks), X_D with its targets, the question's length (on
        # the host, where the search reads it); a batch is passkeys or text
        kind = "lm" if task == "lm" else questions
        if task == "mixed" and iter_num >= lm_from and rng.random() >= passkey_frac:
            kind = "lm"
        ctx, idx, tgt, ql = data.get_batch(kind, batch_size, rng, tok, splits, n, chunk_size,
                                           block_size)
        ctx, idx, tgt = ctx.to(dev), idx.to(dev), tgt.to(dev)
        if kind == "lm" and context_dropout > 0 and rng.random() < context_dropout:
            ctx = None
        if ddp:   # average the gradients across processes at the last micro-step only
            model.require_backward_grad_sync = micro == gradient_accumulation_steps - 1
        with autocast:
            logits, loss = model(ctx, idx, tgt, ql, step_beta)   # SharedLLM: compress, read X_D
            if kind != "lm" and first_token_weight != 1:   # (the first scored token of each row)
                w = (tgt != -100).float()
                w[torch.arange(len(w)), w.argmax(1)] = first_token_weight
                ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(),
                                                       ignore_index=-100, reduction="none")
                loss = (ce * w.flatten()).sum() / w.sum()
        nonfinite |= ~torch.isfinite(loss.detach())
        loss_sum[kind] = loss_sum.get(kind, 0.0) + loss.detach()
        loss_n[kind] = loss_n.get(kind, 0) + 1
        scaler.scale(loss / gradient_accumulation_steps).backward()
    scaler.unscale_(optimizer)   # clip the true gradients (a no-op without float16)
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:   # the moving average moves toward the new weights
        with torch.no_grad():
            torch._foreach_lerp_(ema, params, 1 - ema_decay)
    iter_num += 1
    # the next batch (iteration lm_from) is the first that can be text: the average starts again,
    # as passkey-only weights in it read text worse; 0: never
    if ema is not None and task == "mixed" and iter_num == lm_from:
        with torch.no_grad():
            torch._foreach_copy_(ema, params)
    if iter_num % log_interval == 0 and master:
        check_finite()
        now = time.time()
        ms = 1000 * (now - last_line) / log_interval
        losses = {k: (loss_sum[k] / loss_n[k]).item() for k in sorted(loss_sum, reverse=True)}
        loss_sum, loss_n = {}, {}
        toks = gradient_accumulation_steps * batch_size * world * (n * chunk_size + idx.shape[1])
        print(f"iter {iter_num}: loss " + " ".join(   # passkey first, whichever came first
            f"{v:.4f}" + (f" ({k})" if len(losses) > 1 else "") for k, v in losses.items())
            + f", lr {lr:.2e}, {ms:.0f} ms/iter, {1000 * toks / ms:,.0f} tok/s, chunks {n}, "
            f"{(now - start) / 60:.1f} min", flush=True)
        log(iter=iter_num, loss=losses, lr=lr, ms_per_iter=ms, chunks=n, beta=step_beta,
            minutes=(now - start) / 60)
        last_line = now
if ddp:
    torch.distributed.barrier()   # every process waits for the last evaluation, then all end
    torch.distributed.destroy_process_group()
