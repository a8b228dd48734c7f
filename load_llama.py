"""
Loading, without `transformers`: a Hugging Face-layout LLaMA-2 checkpoint folder straight into model.py's Llama
(`load_llama`), a train.py checkpoint safely (`read_checkpoint`), and either of them as a SharedLLM with its
tokenizer (`load_sharedllm`, what sample.py, eval.py and bench.py start from).

A checkpoint folder (e.g. Llama-2-7b-hf) holds:
  config.json                                  shapes (every era of it: rope_theta may be missing or nested)
  model.safetensors, or model.safetensors.index.json + model-0000k-of-0000n.safetensors shards
  tokenizer.model                              sentencepiece (optional here; its vocab must match config.json)
HF layout means wq/wk rows are permuted for split-half RoPE; model.py uses that form, so nothing is permuted.
Everything is checked: a missing or unexpected tensor, a wrong shape or a broken file is an error naming it.

  python load_llama.py /path/to/Llama-2-7b-hf --prompt "The capital of France is"   # smoke test: greedy decode
"""
import argparse
import json
import os
import re
import time
import zipfile

import pickle

import torch
from safetensors import safe_open

import model as M
from model import Llama, LlamaConfig
from tokenizer import Tokenizer, tokenizer_from_spec

# HF tensor name -> model.py name; None = known and ignored ("{}" is the layer number)
WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,   # old conversions saved RoPE's buffer; we compute it
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def config_from_hf(ckpt_dir):
    path = os.path.join(ckpt_dir, "config.json")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint folder not found: {ckpt_dir}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {ckpt_dir} (expected a Hugging Face-layout LLaMA folder)")
    try:
        c = json.load(open(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if c.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: model_type is {c['model_type']!r}, expected 'llama'")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in c:
            raise ValueError(f"{path}: missing key {key!r}")
    if c.get("tie_word_embeddings"):
        raise ValueError(f"{path}: tie_word_embeddings is true; LLaMA-2 has an untied output head")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act is {c['hidden_act']!r}, expected 'silu'")
    rope = c.get("rope_parameters") or {}   # transformers 5 nests rope_theta here; older configs have it on top
    scaling = c.get("rope_scaling") or ({"rope_type": rope["rope_type"]} if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise ValueError(f"{path}: RoPE scaling {scaling} is not supported (plain LLaMA-2 RoPE only)")
    return LlamaConfig(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"], vocab_size=c["vocab_size"],
        hidden_dim=c["intermediate_size"], norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=c.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        max_seq_len=c.get("max_position_embeddings", 4096), head_dim=c.get("head_dim") or 0)


def safetensors_files(ckpt_dir):
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            weight_map = json.load(open(index))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: expected JSON with a 'weight_map' ({e!r})") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.isfile(os.path.join(ckpt_dir, f)):
                raise FileNotFoundError(f"shard {f} listed in {index} is missing")
        return [os.path.join(ckpt_dir, f) for f in files]
    single = os.path.join(ckpt_dir, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {ckpt_dir}"
                                " (.bin/.pth checkpoints are not supported: convert them to safetensors)")
    return [single]


def our_name(hf_name):
    template = re.sub(r"\.(\d+)\.", ".{}.", hf_name, count=1)
    if template not in WEIGHT_MAP:
        return False   # unknown
    layer = re.findall(r"\.(\d+)\.", hf_name)
    target = WEIGHT_MAP[template]
    return target if target is None or not layer else target.format(layer[0])


def load_llama(ckpt_dir, device="cpu", dtype=torch.float32):
    cfg = config_from_hf(ckpt_dir)
    tok_path = os.path.join(ckpt_dir, "tokenizer.model")
    n_pieces = Tokenizer(tok_path).vocab_size if os.path.isfile(tok_path) else cfg.vocab_size
    if n_pieces != cfg.vocab_size:
        raise ValueError(f"{tok_path} has {n_pieces} pieces but config.json says vocab_size={cfg.vocab_size}")
    with torch.device("meta"):   # no memory for the random init: every parameter is replaced by a loaded tensor
        model = Llama(cfg)
    expected = dict(model.state_dict())
    sd = {}
    for path in safetensors_files(ckpt_dir):   # one tensor at a time: never two full copies in memory
        try:
            f = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        with f:
            for name in f.keys():
                ours = our_name(name)
                if ours is None:
                    continue
                if ours is False or ours not in expected:
                    raise ValueError(f"{path}: unexpected tensor {name!r} (not part of a {cfg.n_layers}-layer LLaMA)")
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None
                if tuple(t.shape) != tuple(expected[ours].shape):
                    raise ValueError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(expected[ours].shape)} from config.json")
                if not t.is_floating_point():
                    raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float type")
                sd[ours] = t.to(device=device, dtype=dtype)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise ValueError(f"{ckpt_dir}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()

# -----------------------------------------------------------------------------
# train.py checkpoints, and a SharedLLM from either kind of path


def read_checkpoint(path):
    # A train.py checkpoint holds tensors and plain values only (numbers, strings, lists, tuples, dicts), so it loads
    # with weights_only=True: a ckpt.pt from someone else cannot run code here. Anything else is refused unread.
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a readable train.py checkpoint (not a file written by torch.save)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = re.search(r"WeightsUnpickler error:\s*(.+?)(?= Please use|\n|$)", str(e))
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain values, and unpickling them "
                         f"could run arbitrary code ({why.group(1) if why else 'weights_only=True rejects it'})") from None
    except Exception as e:
        raise ValueError(f"{path}: not a readable train.py checkpoint ({e.__class__.__name__}: {e})") from None


def load_sharedllm(path, device="cpu", dtype=torch.float32, **shared):
    # A SharedLLM and its tokenizer from either a train.py checkpoint (a ckpt.pt file or the out_dir holding one) or a
    # LLaMA-2 folder (untrained cross-attention: exactly the base model until trained). shared: SharedConfig
    # overrides at inference (height, beta, policy, ...). Returns (model in eval mode, tokenizer, train config).
    ckpt_file = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if os.path.isfile(ckpt_file):
        ck = read_checkpoint(ckpt_file)
        try:
            args, state, train_cfg, spec = ck["model_args"], ck["model"], ck["config"], ck["tokenizer"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{ckpt_file}: not a train.py checkpoint (no {e})") from None
        if "n_lower" in shared and shared["n_lower"] != args["shared"]["n_lower"]:
            raise ValueError(f"n_lower (M) = {shared['n_lower']}: {ckpt_file} was trained with M = "
                             f"{args['shared']['n_lower']} cross-attention layers; M is fixed by the checkpoint")
        tok = tokenizer_from_spec(spec)
        model = M.SharedLLM(Llama(LlamaConfig(**args["llama"])), M.SharedConfig(**args["shared"]))
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"{ckpt_file}: its weights do not fit its own model_args ({e})") from None
        model.scfg = M.SharedConfig(**{**args["shared"], **shared})   # inference-time settings only: no new weights
    elif os.path.isfile(os.path.join(path, "config.json")):
        tok_path = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(tok_path):
            raise FileNotFoundError(f"{path}: no tokenizer.model (needed to encode the context)")
        tok, train_cfg = Tokenizer(tok_path), {}
        model = M.SharedLLM(load_llama(path, "cpu", dtype), M.SharedConfig(**shared))
    else:
        raise FileNotFoundError(f"{path}: neither a train.py checkpoint (ckpt.pt) nor a LLaMA-2 folder (config.json)")
    if tok.vocab_size > model.upper.cfg.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{model.upper.cfg.vocab_size}; the checkpoint and tokenizer do not belong together")
    return model.to(device=device, dtype=dtype).eval(), tok, train_cfg


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Load a HF-layout LLaMA-2 folder and greedy-decode a few tokens.")
    ap.add_argument("ckpt_dir")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max_new_tokens", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bfloat16 on CUDA, else float32)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    tok_path = os.path.join(args.ckpt_dir, "tokenizer.model")
    if not os.path.isfile(tok_path):
        raise SystemExit(f"no tokenizer.model in {args.ckpt_dir}: it is needed to encode the prompt")
    tok = Tokenizer(tok_path)
    t0 = time.time()
    model = load_llama(args.ckpt_dir, args.device, dtype)
    c = model.cfg
    print(f"loaded {args.ckpt_dir} in {time.time() - t0:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params, dim={c.dim} layers={c.n_layers} heads={c.n_heads}/{c.n_kv_heads} on {args.device} in {dtype}")
    idx = torch.tensor([tok.encode(args.prompt)], device=args.device)
    out = model.generate(idx, args.max_new_tokens, eos_id=tok.eos_id)
    print(repr(args.prompt), "->", repr(tok.decode(out[0, idx.shape[1]:].tolist())))
