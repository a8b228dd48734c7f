"""
Load a Hugging Face-layout LLaMA-2 checkpoint folder straight into model.py's Llama, without `transformers`,
and the tokenizers this project uses.

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

import torch
from safetensors import safe_open

from model import Llama, LlamaConfig

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
# tokenizers: one interface (encode(text, bos, eos) -> ids, decode(ids) -> text, bos_id, eos_id, vocab_size, spec)


class Tokenizer:
    # sentencepiece, as LLaMA-2's tokenizer.model. sentencepiece never adds BOS itself; LLaMA-2 wants BOS (id 1).
    def __init__(self, path):
        import sentencepiece as spm
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise ValueError(f"{path}: not a sentencepiece model ({e})") from None
        self.bos_id, self.eos_id, self.vocab_size = self.sp.bos_id(), self.sp.eos_id(), self.sp.vocab_size()
        self.spec = {"kind": "sentencepiece", "path": os.path.abspath(path)}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids):
        return self.sp.decode(list(ids))


class GPT2Tokenizer:
    # GPT-2 BPE through tiktoken; <|endoftext|> (50256) serves as both BOS and EOS.
    def __init__(self):
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise RuntimeError("tiktoken could not load the GPT-2 BPE files (offline?). Set TIKTOKEN_CACHE_DIR to a "
                               f"folder holding them; see README ({e.__class__.__name__}: {e})") from None
        self.bos_id = self.eos_id = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab
        self.spec = {"kind": "gpt2"}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + self.enc.encode_ordinary(text) + [self.eos_id] * eos

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i < self.vocab_size])


class ByteTokenizer:
    # UTF-8 bytes 0..255, then BOS 256 and EOS 257. Needs no file: the tiny configs use it.
    bos_id, eos_id, vocab_size = 256, 257, 258
    spec = {"kind": "byte"}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenizer_from_spec(spec):
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "sentencepiece":
        return Tokenizer(spec["path"])
    raise ValueError(f"unknown tokenizer spec {spec!r}; expected kind 'byte', 'gpt2' or 'sentencepiece'")


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
