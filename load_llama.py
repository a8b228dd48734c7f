"""
Loading, without `transformers`: a LLaMA checkpoint straight into model.py's Llama (`load_llama`),
its tokenizer (`load_tokenizer`), a named shape (`PRESETS`), and a SharedLLM trained by train.py
(`load_sharedllm`).

Two formats:
- a Hugging Face-layout folder (Llama-2-7b-hf, TinyLlama, SmolLM2): config.json; model.safetensors
  or an index + shards; the tokenizer as tokenizer.model (sentencepiece) or tokenizer.json
  (byte-level BPE). HF layout stores wq/wk rows permuted for split-half RoPE, the form model.py
  uses, so nothing is permuted;
- a llama-architecture .gguf file (llama.cpp; SmolLM2 ships as one), through the optional `gguf`
  package: config and tokenizer from its metadata, tensors dequantized, and llama.cpp's
  interleaved q/k rows put back in split-half order.

  python load_llama.py /path/to/Llama-2-7b-hf --prompt="The capital of France is"   # smoke test
"""
import functools
import os
import pickle
import sys

import torch
from safetensors import safe_open

import tokenizer as T
from model import Llama, LlamaConfig, SharedConfig, SharedLLM

# HF tensor name -> model.py name ("{}" is the layer number)
WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def names(table, cfg):
    # {their name: our name} for every tensor of this config; a tied head has no tensor of its own
    out = {}
    for theirs, ours in table.items():
        for i in (range(cfg.n_layers) if "{}" in theirs else [None]):
            out[theirs.format(i)] = ours.format(i)
    return {t: o for t, o in out.items() if not (cfg.tie_embeddings and o == "output.weight")}


def config_from_hf(ckpt_dir):
    path = os.path.join(ckpt_dir, "config.json")
    c = T.read_json(path)
    if c.get("model_type") != "llama" or c.get("rope_scaling"):
        raise ValueError(f"{path}: model_type {c.get('model_type')!r}, rope_scaling "
                         f"{c.get('rope_scaling')}; expected 'llama' with plain RoPE")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size", "intermediate_size") if k not in c]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    rope = c.get("rope_parameters") or {}   # transformers 5 nests rope_theta here
    return LlamaConfig(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        vocab_size=c["vocab_size"], hidden_dim=c["intermediate_size"],
        norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=c.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        max_seq_len=c.get("max_position_embeddings", 4096), head_dim=c.get("head_dim") or 0,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def safetensors_files(ckpt_dir):   # model.safetensors, or the shards its index lists
    index = os.path.join(ckpt_dir, "model.safetensors.index.json")
    files = [os.path.join(ckpt_dir, "model.safetensors")]
    if os.path.isfile(index):
        shards = sorted(set(T.read_json(index).get("weight_map", {}).values()))
        files = [os.path.join(ckpt_dir, f) for f in shards]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f}: missing" + (f" (listed in {index})"
                                                       if os.path.isfile(index) else ""))
    return files


def load_llama(path, device="cpu", dtype=torch.float32):
    # an HF-layout folder or a .gguf file -> model.Llama in eval mode
    if path.endswith(".gguf"):
        return load_gguf(path, device, dtype)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path}: no config.json there (expected an HF-layout LLaMA "
                                "folder or a .gguf file)")
    cfg, sd, where = config_from_hf(path), {}, {}
    for f in safetensors_files(path):   # one tensor at a time: never two full copies in memory
        try:   # (safetensors' errors name no file: a truncated shard of 11 must be told apart)
            with safe_open(f, framework="pt", device="cpu") as st:
                for name in st.keys():
                    if not name.endswith("rotary_emb.inv_freq"):   # (old conversions kept RoPE's)
                        sd[name], where[name] = st.get_tensor(name), f
        except Exception as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
    if cfg.tie_embeddings:   # some tied checkpoints store the head anyway; it IS the embedding
        sd.pop("lm_head.weight", None)
    return build(cfg, sd, names(WEIGHT_MAP, cfg), where, path, device, dtype)


def build(cfg, sd, ours, where, source, device, dtype):
    # their tensors {their name: tensor}, each read from where[name] -> model.Llama, made on the
    # meta device (no memory for a random init: every parameter is replaced by a loaded tensor).
    # A missing, unexpected or misshapen tensor is named as the checkpoint names it.
    with torch.device("meta"):
        model = Llama(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for bad, what in ((set(sd) - set(ours), f"not part of a {cfg.n_layers}-layer LLaMA"),
                      (set(ours) - set(sd), "missing")):
        if bad:
            raise ValueError(f"{source}: {len(bad)} tensors {what}, e.g. {sorted(bad)[:3]}")
    for k, t in sd.items():
        if tuple(t.shape) != shapes[ours[k]]:
            raise ValueError(f"{where[k]}: {k} has shape {tuple(t.shape)}, expected "
                             f"{shapes[ours[k]]} by its config")
    state = {ours[k]: t.to(device=device, dtype=dtype) for k, t in sd.items()}
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    return retie(model).eval()


def retie(llama):   # assign=True made the tied head a Parameter of its own: one again
    if llama.cfg.tie_embeddings:
        llama.output.weight = llama.tok_embeddings.weight
    return llama

# -----------------------------------------------------------------------------
# GGUF files (llama.cpp): metadata keys and tensor names are llama.cpp's


GGUF_MAP = {
    "token_embd.weight": "tok_embeddings.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attention_norm.weight",
    "blk.{}.attn_q.weight": "layers.{}.attention.wq.weight",
    "blk.{}.attn_k.weight": "layers.{}.attention.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attention.wv.weight",
    "blk.{}.attn_output.weight": "layers.{}.attention.wo.weight",
    "blk.{}.ffn_norm.weight": "layers.{}.ffn_norm.weight",
    "blk.{}.ffn_gate.weight": "layers.{}.feed_forward.w1.weight",
    "blk.{}.ffn_down.weight": "layers.{}.feed_forward.w2.weight",
    "blk.{}.ffn_up.weight": "layers.{}.feed_forward.w3.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


@functools.lru_cache(maxsize=1)   # (parsing takes seconds: the tokenizer and weights read it once)
def read_gguf(path):   # -> (the gguf reader, its metadata as {key: python value})
    import gguf   # optional: pip install gguf
    try:
        r = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:   # (what a truncated or foreign file raises)
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def load_gguf(path, device="cpu", dtype=torch.float32):
    import gguf
    r, meta = read_gguf(path)
    get = lambda key, default=None: meta.get(f"llama.{key}", default)
    if meta.get("general.architecture") != "llama" or get("rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: architecture {meta.get('general.architecture')!r}; expected "
                         "'llama' with plain RoPE")
    cfg = LlamaConfig(dim=get("embedding_length"), n_layers=get("block_count"),
                      n_heads=get("attention.head_count"),
                      n_kv_heads=get("attention.head_count_kv", get("attention.head_count")),
                      hidden_dim=get("feed_forward_length"),
                      vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
                      norm_eps=get("attention.layer_norm_rms_epsilon"),
                      rope_theta=get("rope.freq_base", 10000.0),
                      max_seq_len=get("context_length", 4096),
                      head_dim=get("attention.key_length", 0),
                      # llama.cpp writes no head for tied embeddings
                      tie_embeddings="output.weight" not in {t.name for t in r.tensors})
    sd = {}
    for t in r.tensors:
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])   # GGUF: fastest dim first
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            # llama.cpp's interleaved RoPE rows -> split halves, per head
            heads = cfg.n_heads if "attn_q" in t.name else cfg.n_kv_heads
            w = w.view(heads, cfg.head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        sd[t.name] = w
    return build(cfg, sd, names(GGUF_MAP, cfg), dict.fromkeys(sd, path), path, device, dtype)


def auto_device(device):   # "auto": CUDA where there is one, else the CPU
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def auto_dtype(dtype, pretrained, device):   # "auto": bfloat16 for a pretrained model on CUDA
    cuda = str(device).startswith("cuda")      # (what trains from scratch stays float32)
    return ("bfloat16" if pretrained and cuda else "float32") if dtype == "auto" else dtype


# Named model shapes (train.py --preset, bench.py --shape)
PRESETS = {
    "micro": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=64,
                  max_seq_len=512),
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=176,
                 max_seq_len=1024),
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                         hidden_dim=1536, rope_theta=100000.0, max_seq_len=8192,
                         tie_embeddings=True),
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                      hidden_dim=11008),
}


def load_tokenizer(path):
    # "byte", an HF folder (tokenizer.json or tokenizer.model), a .gguf file, or a tokenizer file;
    # its `spec` is what reads it back
    if path == "byte":
        return T.ByteTokenizer()
    if path.endswith(".gguf"):
        tok = T.from_gguf_metadata(read_gguf(path)[1], path)
    elif os.path.isdir(path):
        c = T.read_json(os.path.join(path, "config.json"))
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            tok = T.from_tokenizer_json(os.path.join(path, "tokenizer.json"),
                                        c.get("bos_token_id"), c.get("eos_token_id"))
        else:
            tok = T.SentencePieceTokenizer(os.path.join(path, "tokenizer.model"))
    elif path.endswith(".json"):
        tok = T.from_tokenizer_json(path)
    else:
        tok = T.SentencePieceTokenizer(path)
    tok.spec = os.path.abspath(path)
    return tok

# -----------------------------------------------------------------------------
# train.py's checkpoints


def read_checkpoint(path):
    # tensors and plain values only (weights_only=True): a ckpt.pt from someone else cannot run code
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: refused: it holds objects other than tensors and plain "
                         "values, and unpickling them could run code") from None
    except (RuntimeError, EOFError) as e:   # (torch's own message names no file)
        raise ValueError(f"{path}: not a readable checkpoint ({e})") from None


def sharedllm_from_checkpoint(ck, dtype=torch.float32):
    # A full checkpoint holds every tensor: the model is built on the meta device and takes them
    # as saved. A light one ("base": a pretrained model's path) holds what trained; the rest comes
    # from the base, in `dtype`.
    scfg = SharedConfig(**ck["model_args"]["shared"])
    if ck.get("base"):
        model = SharedLLM(load_llama(ck["base"], "cpu", dtype), scfg)
    else:
        with torch.device("meta"):
            model = SharedLLM(Llama(LlamaConfig(**ck["model_args"]["llama"])), scfg)
    # assign: the saved tensors themselves (an fp32 trained weight stays fp32 over a bf16 base)
    unknown = model.load_state_dict(ck["model"], strict=not ck.get("base"), assign=True)[1]
    if unknown:   # (a light checkpoint holds some of the model's tensors, and only those)
        raise ValueError(f"tensors {unknown[:3]} of the checkpoint are not the model's")
    retie(model.upper)
    return model


def load_sharedllm(path, device="cpu", dtype="auto", **shared):
    # A SharedLLM and its tokenizer from a train.py checkpoint (ckpt.pt, or the out_dir holding
    # it), or from a LLaMA folder or .gguf file (untrained: exactly the base model). shared:
    # SharedConfig settings to read it with (height, beta, policy, ...; not M and C, which the
    # weights were trained for). dtype "auto": bfloat16 for a pretrained model on CUDA, else
    # float32. -> (model in eval mode, tokenizer, train.py's settings or {})
    ckpt_file = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    folder = path.endswith(".gguf") or os.path.isfile(os.path.join(path, "config.json"))
    if not folder and not os.path.isfile(ckpt_file):
        raise FileNotFoundError(f"{path}: neither a train.py checkpoint (ckpt.pt) nor a LLaMA "
                                "folder (config.json) or .gguf file")
    ck = None if folder else read_checkpoint(ckpt_file)
    cfg = {**ck["config"], "base": ck.get("base")} if ck else {}   # (base: None from scratch)
    pretrained = cfg.get("base", path)   # (a folder: its path)
    dtype = getattr(torch, auto_dtype(dtype, pretrained, device))
    if ck:
        trained = ck["model_args"]["shared"]
        if any(shared.get(k, trained[k]) != trained[k] for k in ("n_lower", "chunk_size")):
            raise ValueError(f"{ckpt_file}: its weights were trained for M = {trained['n_lower']},"
                             f" C = {trained['chunk_size']}")
        model, tok = sharedllm_from_checkpoint(ck, dtype), load_tokenizer(ck["tokenizer"])
        model.scfg = SharedConfig(**{**trained, **shared})
    else:
        model = SharedLLM(load_llama(path, "cpu", dtype), SharedConfig(**shared))
        tok = load_tokenizer(path)
    return model.to(device=device, dtype=dtype).eval(), tok, cfg


if __name__ == "__main__":   # python load_llama.py PATH [--prompt=...]: load, greedy-decode
    import decode
    path, prompt = sys.argv[1], "The capital of France is"
    prompt = next((a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--prompt=")), prompt)
    dev = auto_device("auto")
    dtype = getattr(torch, auto_dtype("auto", True, dev))
    tok, model = load_tokenizer(path), load_llama(path, dev, dtype)
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{model.cfg}")
    idx = torch.tensor([tok.encode(prompt)], device=dev)
    out = decode.generate(model, idx, 20, eos_id=tok.eos_id)
    print(repr(prompt), "->", repr(tok.decode(out[0, idx.shape[1]:].tolist())))
