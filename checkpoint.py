"""
train.py's checkpoints: read safely (tensors and plain values only: `read_checkpoint`), turned back
into the SharedLLM they hold, full or light (`sharedllm_from_checkpoint`), and a SharedLLM with its
tokenizer from either a checkpoint or a LLaMA folder / .gguf file (`load_sharedllm`, what sample.py,
eval.py and bench.py start from).
A light checkpoint holds only what trained, plus the path and sha256 of the base checkpoint that
holds the rest.
`base_model` gives the unchanged base LLaMA of either, for baselines (full attention).
train.py writes them (`save_checkpoint`, with every process's random streams: `rng_states`) and
goes on from one exactly where it stopped (`restore_training`).
train.py's model at start-up, new, pretrained or resumed (`sharedllm_to_train`), and what of it
trains (`set_trainable`).
"""
import hashlib
import os
import pickle
import random
import re
import zipfile
from dataclasses import asdict

import torch

from load_llama import (PRESETS, load_llama, load_tokenizer, preset as preset_config,
                        safetensors_files, tokenizer_from_spec)
from model import Llama, LlamaConfig, SharedConfig, SharedLLM
from tokenizer import ByteTokenizer, GPT2Tokenizer


def read_checkpoint(path):
    # A train.py checkpoint holds tensors and plain values only (numbers, strings, lists, tuples,
    # dicts), so it loads with weights_only=True: a ckpt.pt from someone else cannot run code here.
    # Anything else is refused unread.
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a readable train.py checkpoint (not a file written by "
                         "torch.save)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = re.search(r"WeightsUnpickler error:\s*(.+?)(?= Please use|\n|$)", str(e))
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain values, "
                         "and unpickling them could run arbitrary code "
                         f"({why.group(1) if why else 'weights_only=True rejects it'})") from None
    except Exception as e:
        raise ValueError(f"{path}: not a readable train.py checkpoint "
                         f"({e.__class__.__name__}: {e})") from None


def base_digest(path):
    # sha256 of a base checkpoint's content (a .gguf file; an HF folder's config.json and weight
    # files): what a light train.py checkpoint records, so that it is never combined with other
    # weights than those it was trained on
    files = ([path] if path.endswith(".gguf")
             else [os.path.join(path, "config.json")] + safetensors_files(path))
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def sharedllm_from_checkpoint(ck, ckpt_file, dtype=torch.float32):
    # The SharedLLM of a train.py checkpoint, its tensors in the dtypes they were saved in. A full
    # checkpoint holds every tensor: the model is built on the meta device (no random init, no
    # memory) and takes them as they are. A light one (it has "base") holds only what trained: the
    # rest comes from the base checkpoint it names, in `dtype`, and only if that base is byte for
    # byte the one it was trained on.
    args, state, base = ck["model_args"], ck["model"], ck.get("base")
    # "inject" is gone: the bottom M layers cross-attend (the paper's, and what every recipe
    # trained)
    inject = args["shared"].pop("inject", "bottom")
    if inject != "bottom":
        raise ValueError(f"{ckpt_file}: trained with cross-attention in the {inject} layers "
                         f"(inject={inject!r}), which this version no longer has; only the bottom "
                         "M layers")
    retired(args["shared"], ckpt_file)
    scfg = SharedConfig(**args["shared"])
    if base:
        if not os.path.exists(base["path"]):
            raise FileNotFoundError(f"{ckpt_file}: a light checkpoint (only the trained weights); "
                                    f"its base model {base['path']} is not there")
        if base_digest(base["path"]) != base["sha256"]:
            raise ValueError(f"{ckpt_file}: a light checkpoint trained on {base['path']} with "
                             f"sha256 {base['sha256'][:16]}...; those files have changed since, "
                             "and these trained weights belong to the old ones (retrain, or "
                             "restore the base)")
        model = SharedLLM(load_llama(base["path"], "cpu", dtype), scfg)
    else:
        with torch.device("meta"):
            model = SharedLLM(Llama(LlamaConfig(**args["llama"])), scfg)
    try:
        # assign: the saved tensors themselves (an fp32 master weight stays fp32 over a bf16 base)
        model.load_state_dict(state, strict=not base, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{ckpt_file}: its weights do not fit its own model_args ({e})") from None
    unknown = set(state) - set(model.state_dict())
    if unknown:
        raise ValueError(f"{ckpt_file}: tensors {sorted(unknown)[:3]} are not part of its model")
    if model.upper.cfg.tie_embeddings:
        # assign made the head a Parameter of its own: one tensor again
        model.upper.output.weight = model.upper.tok_embeddings.weight
    return model


# Settings that left with issue 48 (every recipe now runs one search and one chunk-id form); they
# last existed at commit 84a7b60. A checkpoint that used one names it here rather than failing on an
# unknown setting.
RETIRED = {"policy": ("attention", "query_mean"), "chunk_pos": ("clamp",)}
# Settings renamed by issue 58 (one meaning per word), and the paper's search's old value
RENAMED = {"chunk_ids": "chunk_pos", "lower": "lower_weights"}


def retired(shared, ckpt_file):
    # shared: a checkpoint's SharedConfig settings, edited in place: the retired ones that change
    # nothing are dropped
    for old, new in RENAMED.items():
        if old in shared:
            shared[new] = shared.pop(old)
    if shared.get("policy") == "query":
        shared["policy"] = "vector"
    for name, gone in RETIRED.items():
        if shared.get(name) in gone:
            raise ValueError(f"{ckpt_file}: trained with {name}={shared[name]!r}, which this "
                             "version no longer has (it last existed at commit 84a7b60); read it "
                             "with today's method, e.g. eval.py --policy=lexical "
                             "--chunk_pos=plain, or check out that commit")
    # the search before issue 56; neither it nor today's has weights
    if shared.get("policy") == "continuation":
        print(f"note: {ckpt_file} was trained with the 'continuation' search, which the 'lexical' "
              "search replaced: it is read with 'lexical'")
        shared["policy"] = "lexical"
    if shared.pop("logn_scale", False):
        print(f"note: {ckpt_file} was evaluated with log-n query scaling, which this version no "
              "longer has: it is read without it")
    shared.pop("max_chunk_dist", None)
    if isinstance(shared.get("chunk_pos"), bool):   # before the forms had names: True / False
        shared["chunk_pos"] = "plain" if shared["chunk_pos"] else "off"
    # before issue 49: noise = gamma, sigma = l / gamma; now sigma = 1 / gamma
    if "noise" in shared:
        gamma = shared.pop("noise")
        shared["sigma"] = 1 / gamma if gamma else 0.0


def load_sharedllm(path, device="cpu", dtype=torch.float32, **shared):
    # A SharedLLM and its tokenizer from a train.py checkpoint (a ckpt.pt file or the out_dir
    # holding one), or from a LLaMA folder or .gguf file (untrained cross-attention: exactly the
    # base model until trained). shared: SharedConfig overrides at inference (height, beta, policy,
    # ...). Returns (model in eval mode, tokenizer, train config).
    ckpt_file = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if os.path.isfile(ckpt_file) and not path.endswith(".gguf"):
        ck = read_checkpoint(ckpt_file)
        try:
            args, train_cfg, spec = ck["model_args"], ck["config"], ck["tokenizer"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{ckpt_file}: not a train.py checkpoint (no {e})") from None
        # what the weights were trained for
        for name, what in (("n_lower", "M"), ("chunk_size", "C")):
            if name in shared and shared[name] != args["shared"][name]:
                raise ValueError(f"{name} ({what}) = {shared[name]}: {ckpt_file} was trained "
                                 f"with {what} = {args['shared'][name]}; {what} is fixed by the "
                                 "checkpoint")
        # read it another way
        args["shared"].update({k: v for k, v in shared.items() if k in RETIRED})
        # first: a light one's missing base is named as such
        model = sharedllm_from_checkpoint(ck, ckpt_file, dtype)
        model.base_checkpoint = ck.get("base")   # (path, sha256) of a light checkpoint's base
        tok = tokenizer_from_spec(spec)
        # inference-time settings only: no new weights
        model.scfg = SharedConfig(**{**args["shared"], **shared})
    elif path.endswith(".gguf") or os.path.isfile(os.path.join(path, "config.json")):
        tok, train_cfg = load_tokenizer(path), {}
        model = SharedLLM(load_llama(path, "cpu", dtype), SharedConfig(**shared))
        model.base_checkpoint = None
    elif not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file or folder")
    else:
        raise FileNotFoundError(f"{path}: neither a train.py checkpoint (ckpt.pt) nor a LLaMA "
                                "folder (config.json) or .gguf file")
    if tok.vocab_size > model.upper.cfg.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tok.vocab_size} ids but the model's "
                         f"vocab_size is {model.upper.cfg.vocab_size}; the checkpoint and "
                         "tokenizer do not belong together")
    return model.to(device=device, dtype=dtype).eval(), tok, train_cfg


def base_model(model, train_cfg, device="cpu", dtype=torch.float32):
    # The unchanged base LLaMA of what load_sharedllm returned, for a baseline like full attention,
    # with a label that says what it is. -> (Llama, label). Only cross-attention trained (or
    # nothing: a LLaMA folder): the upper model IS the base. Else a light checkpoint's base is
    # loaded again, as it was (load_sharedllm checked its sha256). A model trained from scratch, or
    # a full checkpoint whose upper layers trained, has no unchanged base: its own upper model,
    # labelled as such.
    trained = train_cfg.get("train", "cross")
    if train_cfg.get("init_from") == "scratch":
        return model.upper, ("this checkpoint's own upper model (trained from scratch: there is no "
                             "pretrained base)")
    if trained == "cross":
        return model.upper, ("the base model (only cross-attention trained)" if train_cfg
                             else "the base model")
    base = model.base_checkpoint
    if base:
        return (load_llama(base["path"], "cpu", dtype).to(device).eval(),
                f"the base model {base['path']}")
    return model.upper, (f"this checkpoint's own upper model (train={trained!r} trained it; the "
                         "checkpoint holds no unchanged base)")


# -----------------------------------------------------------------------------
# writing one, and going on from one exactly (train.py)

def save_checkpoint(path, raw, optimizer, scaler, ema, names, base, **meta):
    # path (out_dir/ckpt.pt), written in full and then renamed: a crash never leaves half a
    # checkpoint. ema: the moving average of what trains (or None) and names, every name of each of
    # its tensors; base: a light checkpoint's (path, sha256) of the base model, or None; meta:
    # model_args, iter_num, config, tokenizer, rngs (stored as given)
    state, extra = raw.state_dict(), {}
    if base:
        # light: what trains, and the base checkpoint (path and content hash) that holds the rest
        trained = {n for n, p in raw.named_parameters(remove_duplicate=False) if p.requires_grad}
        state = {k: v for k, v in state.items() if k in trained}
    if ema is not None:
        # "model" is the average (what eval.py and sample.py read); "raw" is for resume
        avg = {n: e for e, ns in zip(ema, names) for n in ns}
        extra["raw"] = {n: state[n] for n in avg}
        state = {**state, **avg}
    if scaler.is_enabled():
        extra["scaler"] = scaler.state_dict()
    ck = dict(model=state, optimizer=optimizer.state_dict(), **meta,
              **(dict(base=base) if base else {}), **extra)
    torch.save(ck, path + ".tmp")
    os.replace(path + ".tmp", path)


def rng_states(rng, ddp, world, dev_type):
    # this process's three random streams; under DDP every rank's (a collective: all ranks call it
    # together)
    mine = dict(data=rng.getstate(), tree=random.getstate(), torch=torch.get_rng_state(),
                **(dict(cuda=torch.cuda.get_rng_state()) if dev_type == "cuda" else {}))
    if not ddp:
        return [mine]
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def restore_training(ckpt, optimizer, scaler, rng, rank, dev_type, seed):
    # the optimizer's and scaler's state, and this rank's three random streams, from the checkpoint
    # -> its iteration
    optimizer.load_state_dict(ckpt["optimizer"])
    iter_num = ckpt["iter_num"]
    if "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    # every rank goes on with its own random streams (data, split noise, torch); older checkpoints
    # hold rank 0's
    states = ckpt.get("rngs") or [dict(data=ckpt["rng"][0], tree=ckpt["tree_rng"],
                                       torch=ckpt["torch_rng"])]
    if rank < len(states):
        rng.setstate(states[rank]["data"])
        random.setstate(states[rank]["tree"])
        torch.set_rng_state(states[rank]["torch"])
        if "cuda" in states[rank] and dev_type == "cuda":
            torch.cuda.set_rng_state(states[rank]["cuda"])
    else:   # more processes than wrote the checkpoint: this one starts fresh streams of its own
        print(f"rank {rank}: the checkpoint holds the random streams of {len(states)} process(es); "
              f"this rank starts new ones (seed {seed} + rank + iteration)")
        fresh = seed + rank + 1_000_003 * iter_num
        rng.seed(fresh)
        random.seed(fresh)
        torch.manual_seed(fresh)
    return iter_num

# -----------------------------------------------------------------------------
# the SharedLLM that train.py trains, built at its start-up (a bad setting is an error that names
# train.py's flag)


def sharedllm_to_train(init_from, scfg, dtype, out_dir, preset, tokenizer, light_ckpt,
                       checkpointing):
    # init_from: "scratch" (a random LLaMA of the preset's shape, with `tokenizer`), "resume"
    # (out_dir/ckpt.pt, whose settings must be scfg's, preset and tokenizer) or a LLaMA folder /
    # .gguf file (loaded in dtype; light_ckpt: its path and sha256 are what checkpoints name). scfg:
    # the SharedConfig settings. -> tokenizer, SharedLLM, the checkpoint resumed (or None), the base
    # model a light checkpoint names (or None), the model's arguments
    ckpt = None
    if init_from == "resume":   # a setting given otherwise would be silently ignored: refused
        tok, raw, ckpt, base = sharedllm_to_resume(out_dir, scfg, dtype, preset, tokenizer)
        llama = raw.upper
    else:
        tok, llama, base = llama_to_train(init_from, dtype, preset, tokenizer, light_ckpt)
    if tok.vocab_size > llama.cfg.vocab_size:
        raise SystemExit(f"tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{llama.cfg.vocab_size}")
    llama.checkpointing = checkpointing   # activation checkpointing
    if ckpt is not None:
        return tok, raw, ckpt, base, ckpt["model_args"]
    model_args = dict(llama=asdict(llama.cfg), shared=scfg)
    try:
        raw = SharedLLM(llama, SharedConfig(**scfg))
    except ValueError as e:
        # an impossible SharedLLM setting (policy, chunk_pos, M, C / height / beta, ...)
        raise SystemExit(f"train.py: {e}") from None
    return tok, raw, ckpt, base, model_args


def sharedllm_to_resume(out_dir, scfg, dtype, preset, tokenizer):
    # init_from=resume: the SharedLLM of out_dir/ckpt.pt, whose settings must be scfg's, preset and
    # tokenizer. -> tokenizer, SharedLLM, the checkpoint, the base model a light checkpoint names
    # (or None)
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        raise SystemExit(f"init_from=resume: no checkpoint at {path}")
    try:
        ckpt = read_checkpoint(path)
        raw = sharedllm_from_checkpoint(ckpt, path, dtype)   # as saved; a light one's base in dtype
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"init_from=resume: {e}") from None
    except (KeyError, TypeError) as e:
        raise SystemExit(f"init_from=resume: {path} is not a train.py checkpoint "
                         f"(no {e})") from None
    try:
        now = {**asdict(SharedConfig(**scfg)), "preset": preset, "tokenizer": tokenizer}
    except ValueError as e:
        raise SystemExit(f"train.py: {e}") from None
    was = {**asdict(raw.scfg),
           **{k: ckpt["config"].get(k, now[k]) for k in ("preset", "tokenizer")}}
    differ = [k for k in now if was[k] != now[k]]
    if differ:
        raise SystemExit(f"init_from=resume: {path} was trained with " + ", ".join(
            f"{k}={was[k]!r}" for k in differ) + " but this run sets " + ", ".join(
            f"{k}={now[k]!r}" for k in differ) + "; resume with its settings (or its config file). "
            "To read a checkpoint with other inference settings, use eval.py (--chunk_pos, "
            "--policy, --beta, ...)")
    return tokenizer_from_spec(ckpt["tokenizer"]), raw, ckpt, ckpt.get("base")


def llama_to_train(init_from, dtype, preset, tokenizer, light_ckpt):
    # init_from: "scratch" or a LLaMA folder / .gguf file. -> tokenizer, the new Llama, the base
    # model a light checkpoint names (or None)
    if init_from == "scratch":
        try:
            tok = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}.get(
                tokenizer, lambda: load_tokenizer(tokenizer))()
        except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
            raise SystemExit(f"--tokenizer={tokenizer}: {e} (expected byte, gpt2 or a tokenizer "
                             "file)") from None
        if preset not in PRESETS:
            raise SystemExit(f"--preset={preset}: expected one of {sorted(PRESETS)}")
        llama = Llama(preset_config(preset, vocab_size=max(PRESETS[preset]["vocab_size"],
                                                           tok.vocab_size)))
        return tok, llama, None
    # a LLaMA folder or .gguf file: both models come from this one checkpoint
    if not os.path.exists(init_from):
        raise SystemExit(f"--init_from={init_from}: no such file or folder (expected scratch, "
                         "resume, a LLaMA folder or a .gguf file)")
    if init_from.endswith(".pt") or os.path.isfile(os.path.join(init_from, "ckpt.pt")):
        raise SystemExit(
            f"--init_from={init_from}: a train.py checkpoint; to continue it, use "
            "--init_from=resume --out_dir="
            f"{os.path.dirname(init_from) if init_from.endswith('.pt') else init_from}")
    try:
        tok = load_tokenizer(init_from)
        llama = load_llama(init_from, "cpu", dtype)   # bf16 on CUDA: what stays frozen stays bf16
        base = (dict(path=os.path.abspath(init_from), sha256=base_digest(init_from)) if light_ckpt
                else None)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"init_from={init_from}: {e}") from None
    return tok, llama, base


def set_trainable(m, which):
    # what trains in SharedLLM m (train.py's --train), held in fp32 the standard way: AdamW's step
    # on a bf16 weight is lost whenever it is below half a bf16 ulp (bf16(0.02 + 1e-5) == 0.02).
    # Frozen weights keep their dtype.
    n_lower = m.scfg.n_lower
    rules = {
        "all": lambda n: True,
        "cross": lambda n: ".cross_" in n,
        "cross+top": lambda n: ".cross_" in n or (n.startswith("upper.layers.")
                                                  and int(n.split(".")[2]) >= n_lower)
                               or n.startswith(("upper.norm", "upper.output")),
        "upper": lambda n: n.startswith("upper."),
    }
    if which not in rules:
        raise SystemExit(f"--train={which}: expected one of {sorted(rules)}")
    for n, p in m.named_parameters():
        p.requires_grad_(rules[which](n))
    for p in m.parameters():   # master weights: what trains in fp32
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
