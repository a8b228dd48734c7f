"""
Loading, without `transformers`: a LLaMA-family checkpoint straight into model.py's Llama
(`load_llama`) and its tokenizer (`load_tokenizer`), or a named shape (`preset`). train.py's own
checkpoints are checkpoint.py's.

Two formats:
- a Hugging Face-layout folder (Llama-2-7b-hf, TinyLlama, SmolLM2): config.json; model.safetensors
  or an index + shards; the tokenizer as tokenizer.model (sentencepiece) or tokenizer.json
  (byte-level BPE, run by tiktoken). HF layout stores wq/wk rows permuted for split-half RoPE, the
  form model.py uses, so nothing is permuted;
- a llama-architecture .gguf file (llama.cpp, Ollama), through the optional `gguf` package: config
  and tokenizer from its metadata, tensors dequantized, and llama.cpp's interleaved q/k rows put
  back in split-half order.
Everything is checked: a missing or unexpected tensor, a wrong shape, a metadata key or a broken
file is an error that names it as the checkpoint itself spells it.

  # smoke test: greedy decode
  python load_llama.py /path/to/Llama-2-7b-hf --prompt "The capital of France is"
  # dequantize once into an HF folder that loads faster
  python load_llama.py model.gguf --save_hf out_folder
"""
import argparse
import json
import os
import time

import torch
from safetensors import safe_open

import decode
import tokenizer as T
from model import Llama, LlamaConfig

# HF tensor name -> model.py name ("{}" is the layer number); HF_IGNORED: known and skipped
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
# old conversions saved RoPE's buffer; we compute it
HF_IGNORED = ["model.layers.{}.self_attn.rotary_emb.inv_freq"]


def names(table, cfg):
    # {their name: our name} for every tensor of this config; a tied head has no tensor of its own
    out = {}
    for theirs, ours in table.items():
        for i in (range(cfg.n_layers) if "{}" in theirs else [None]):
            out[theirs.format(i)] = ours.format(i)
    return {t: o for t, o in out.items() if not (cfg.tie_embeddings and o == "output.weight")}


def config_json(ckpt_dir):
    path = os.path.join(ckpt_dir, "config.json")
    try:
        return json.load(open(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def config_from_hf(ckpt_dir):
    path = os.path.join(ckpt_dir, "config.json")
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint folder not found: {ckpt_dir}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {ckpt_dir} (expected a Hugging Face-layout "
                                "LLaMA folder)")
    c = config_json(ckpt_dir)
    if c.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: model_type is {c['model_type']!r}, expected 'llama'")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "intermediate_size"):
        if key not in c:
            raise ValueError(f"{path}: missing key {key!r}")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act is {c['hidden_act']!r}, expected 'silu'")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError(f"{path}: attention_bias / mlp_bias is true; LLaMA has no biases")
    # transformers 5 nests rope_theta and the scaling here; older configs: on top
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                        else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if kind != "llama3" or any(not isinstance(scaling.get(k), (int, float)) for k in keys):
            raise ValueError(f"{path}: RoPE scaling {scaling} is not supported (plain RoPE, or "
                             f"'llama3' with {keys})")
        scaling = {k: scaling[k] for k in keys}
    return LlamaConfig(
        dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=c["num_attention_heads"],
        n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        vocab_size=c["vocab_size"], hidden_dim=c["intermediate_size"],
        norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=c.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        max_seq_len=c.get("max_position_embeddings", 4096), head_dim=c.get("head_dim") or 0,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), rope_scaling=scaling)


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
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in "
                                f"{ckpt_dir} (.bin/.pth checkpoints are not supported: convert "
                                "them to safetensors)")
    return [single]


def load_llama(path, device="cpu", dtype=torch.float32):
    # an HF-layout folder or a .gguf file -> model.Llama in eval mode
    if path.endswith(".gguf"):
        return load_gguf(path, device, dtype)
    cfg = config_from_hf(path)
    # a tokenizer beside the weights must fit them
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(os.path.join(path, name)):
            n = load_tokenizer(path).vocab_size
            if n > cfg.vocab_size:
                raise ValueError(f"{os.path.join(path, name)} has {n} ids but config.json says "
                                 f"vocab_size={cfg.vocab_size}")
            break
    ours = names(WEIGHT_MAP, cfg)
    ignored = {t.format(i) for t in HF_IGNORED for i in range(cfg.n_layers)}
    if cfg.tie_embeddings:
        # some tied checkpoints store the head anyway; HF ties it to the embedding
        ignored.add("lm_head.weight")
    sd = {}
    for f in safetensors_files(path):   # one tensor at a time: never two full copies in memory
        try:
            st = safe_open(f, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        with st:
            for name in st.keys():
                if name in ignored:
                    continue
                if name not in ours:
                    raise ValueError(f"{f}: unexpected tensor {name!r} (not part of a "
                                     f"{cfg.n_layers}-layer LLaMA)")
                try:
                    sd[name] = st.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{f}: cannot read tensor {name!r} ({e})") from None
    return build(cfg, sd, ours, path, device, dtype)


def build(cfg, sd, ours, source, device, dtype):
    # their tensors {their name: tensor} -> model.Llama, every name and shape checked against cfg
    # no memory for the random init: every parameter is replaced by a loaded tensor
    with torch.device("meta"):
        model = Llama(cfg)
    expected = model.state_dict()
    missing = [t for t in ours if t not in sd]
    if missing:
        raise ValueError(f"{source}: {len(missing)} tensors missing, e.g. {missing[:3]}")
    state = {}
    for theirs, t in sd.items():
        want = tuple(expected[ours[theirs]].shape)
        if tuple(t.shape) != want:
            raise ValueError(f"{source}: tensor {theirs!r} has shape {tuple(t.shape)}, expected "
                             f"{want} from the config")
        if not t.is_floating_point():
            raise ValueError(f"{source}: tensor {theirs!r} has dtype {t.dtype}, expected a float "
                             "type")
        state[ours[theirs]] = t.to(device=device, dtype=dtype)
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:   # assign=True made two Parameters of one tensor: make them one again
        model.output.weight = model.tok_embeddings.weight
    return model.eval()

# -----------------------------------------------------------------------------
# GGUF files (llama.cpp, Ollama): metadata keys and tensor names are llama.cpp's

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
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
              "Q5_K", "Q6_K")


def read_gguf(path):
    # -> (the gguf reader, its metadata as {key: python value})
    try:
        import gguf
    except ImportError:
        raise ImportError(f"{path}: reading a .gguf file needs the optional package gguf "
                          "(pip install gguf)") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file "
                         f"({e.__class__.__name__}: {e})") from None
    return r, {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def config_from_gguf(meta, path):
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}, expected 'llama'")

    def get(key, default=None):
        if f"llama.{key}" not in meta and default is None:
            raise ValueError(f"{path}: missing metadata key 'llama.{key}'")
        return meta.get(f"llama.{key}", default)
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ValueError(f"{path}: llama.rope.scaling.type is "
                         f"{meta['llama.rope.scaling.type']!r}; plain RoPE only")
    n_heads = get("attention.head_count")
    return LlamaConfig(dim=get("embedding_length"), n_layers=get("block_count"), n_heads=n_heads,
                       n_kv_heads=get("attention.head_count_kv", n_heads),
                       hidden_dim=get("feed_forward_length"),
                       vocab_size=get("vocab_size",
                                      len(meta.get("tokenizer.ggml.tokens", [])) or None),
                       norm_eps=get("attention.layer_norm_rms_epsilon"),
                       rope_theta=get("rope.freq_base", 10000.0),
                       max_seq_len=get("context_length", 4096),
                       head_dim=get("attention.key_length", 0),
                       tie_embeddings=False)


# Named model shapes (train.py --preset, bench.py --shape), chosen by exact key, never guessed from
# a folder name.
PRESETS = {
    "micro": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=64,
                  max_seq_len=512),
    "tiny": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=176,
                 max_seq_len=1024),
    "small": dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=50304, hidden_dim=704,
                  max_seq_len=1024),
    # the real model's shape
    "smollm2-135m": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152,
                         hidden_dim=1536, rope_theta=100000.0, max_seq_len=8192,
                         tie_embeddings=True),
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                      hidden_dim=11008),
    "llama2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                       hidden_dim=13824),
    "llama2-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                       hidden_dim=28672),
}


def preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})

def llama_config(path):
    # the LlamaConfig of an HF folder or .gguf file, without reading its weights (bench.py --shape)
    return (config_from_gguf(read_gguf(path)[1], path) if path.endswith(".gguf")
            else config_from_hf(path))


def load_gguf(path, device="cpu", dtype=torch.float32):
    import gguf
    r, meta = read_gguf(path)
    cfg = config_from_gguf(meta, path)
    present = {t.name for t in r.tensors}
    # llama.cpp writes no head for tied embeddings
    cfg.tie_embeddings = "output.weight" not in present
    ours = names(GGUF_MAP, cfg)
    sd = {}
    for t in r.tensors:
        if t.name == "rope_freqs.weight":
            raise ValueError(f"{path}: tensor 'rope_freqs.weight' means scaled RoPE (Llama-3.1 "
                             "style); plain RoPE only")
        if t.name not in ours:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} (not part of a "
                             f"{cfg.n_layers}-layer LLaMA)")
        kind = t.tensor_type.name
        if kind not in GGUF_TYPES:
            raise ValueError(f"{path}: tensor {t.name!r} is stored as {kind}; supported: "
                             f"{', '.join(GGUF_TYPES)}")
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        # GGUF lists dims fastest-first
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            # interleaved RoPE rows -> split halves, per head
            heads = cfg.n_heads if "attn_q" in t.name else cfg.n_kv_heads
            w = w.view(heads, cfg.head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)
        sd[t.name] = w
    return build(cfg, sd, ours, path, device, dtype)


def save_hf(model, tok, out_dir):
    # model.Llama (+ a BPETokenizer) -> an HF-layout folder that load_llama and transformers both
    # read
    from safetensors.torch import save_file
    c = model.cfg
    os.makedirs(out_dir, exist_ok=True)
    theirs = {o: t for t, o in names(WEIGHT_MAP, c).items()}
    sd = {theirs[k]: v.contiguous() for k, v in model.state_dict().items() if k in theirs}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=c.dim,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
               num_key_value_heads=c.n_kv_heads, intermediate_size=c.hidden_dim,
               vocab_size=c.vocab_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
               head_dim=c.head_dim, max_position_embeddings=c.max_seq_len,
               tie_word_embeddings=c.tie_embeddings, hidden_act="silu", bos_token_id=tok.bos_id,
               eos_token_id=tok.eos_id, torch_dtype=str(next(model.parameters()).dtype)[6:],
               rope_scaling={"rope_type": "llama3", **c.rope_scaling} if c.rope_scaling else None)
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=1)
    json.dump(T.to_tokenizer_json(tok),
              open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8"),
              ensure_ascii=False)

# -----------------------------------------------------------------------------
# tokenizers from checkpoint files

def load_tokenizer(path):
    # the tokenizer of a checkpoint: an HF folder (tokenizer.json or tokenizer.model), a .gguf file,
    # or the file itself
    if path.endswith(".gguf"):
        return T.from_gguf_metadata(read_gguf(path)[1], path)
    ids = {}
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            c = config_json(path)
            # Llama-3.1 Instruct lists several stop ids: the first ends generation here
            eos = c.get("eos_token_id")
            ids = dict(bos_id=c.get("bos_token_id"),
                       eos_id=eos[0] if isinstance(eos, list) and eos else eos)
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return T.from_tokenizer_json(os.path.join(path, "tokenizer.json"), **ids)
        path = os.path.join(path, "tokenizer.model")
    if path.endswith(".json"):
        return T.from_tokenizer_json(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no tokenizer there (tokenizer.json or tokenizer.model)")
    if T.is_tiktoken_file(path):   # Llama-3's tokenizer.model; LLaMA-2's is a sentencepiece model
        return T.TiktokenTokenizer(path, **{k: v for k, v in ids.items() if isinstance(v, int)})
    return T.Tokenizer(path)


def tokenizer_from_spec(spec):
    # the tokenizer a train.py checkpoint names
    kind = spec.get("kind")
    if kind == "byte":
        return T.ByteTokenizer()
    if kind == "gpt2":
        return T.GPT2Tokenizer()
    if kind in ("sentencepiece", "bpe", "tiktoken"):
        return load_tokenizer(spec["path"])
    raise ValueError(f"unknown tokenizer spec {spec!r}; expected kind 'byte', 'gpt2', "
                     "'sentencepiece', 'bpe' or 'tiktoken'")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Load a LLaMA-family checkpoint (HF folder or "
                                             ".gguf) and greedy-decode a few tokens; or convert "
                                             "a .gguf into an HF folder with --save_hf.")
    ap.add_argument("path")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max_new_tokens", type=int, default=20)
    ap.add_argument("--save_hf", default="",
                    help="write the checkpoint here as an HF-layout folder (safetensors)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on CUDA, else float32")
    args = ap.parse_args()
    if args.max_new_tokens < 0:
        ap.error(f"--max_new_tokens={args.max_new_tokens}: expected 0 or more")
    if not {"cpu": True, "cuda": torch.cuda.is_available(),
            "mps": torch.backends.mps.is_available()}.get(args.device.split(":")[0]):
        ap.error(f"--device={args.device}: expected cpu, or cuda / cuda:N / mps where this machine "
                 "has it")
    if not os.path.exists(args.path):
        ap.error(f"{args.path}: no such file or folder")
    if args.path.endswith(".pt") or os.path.isfile(os.path.join(args.path, "ckpt.pt")):
        ap.error(f"{args.path}: a train.py checkpoint; sample.py and eval.py read it "
                 f"(--init_from={args.path})")
    if (not args.path.endswith(".gguf")
            and not os.path.isfile(os.path.join(args.path, "config.json"))):
        ap.error(f"{args.path}: expected a Hugging Face-layout LLaMA folder (with config.json) "
                 "or a .gguf file")
    dtype = getattr(torch, args.dtype or (
        "bfloat16" if args.device.startswith("cuda") and not args.save_hf else "float32"))
    try:
        tok = load_tokenizer(args.path)
        t0 = time.time()
        model = load_llama(args.path, args.device, dtype)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise SystemExit(f"load_llama.py: {e}") from None
    c = model.cfg
    print(f"loaded {args.path} in {time.time() - t0:.1f}s: "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, dim={c.dim} "
          f"layers={c.n_layers} heads={c.n_heads}/{c.n_kv_heads}, tied head {c.tie_embeddings}, "
          f"on {args.device} in {dtype}")
    if args.save_hf:
        if not isinstance(tok, T.BPETokenizer):
            raise SystemExit("load_llama.py: --save_hf writes tokenizer.json, which needs a "
                             "byte-level BPE tokenizer")
        save_hf(model, tok, args.save_hf)
        print(f"wrote {args.save_hf}: model.safetensors, config.json, tokenizer.json")
    idx = torch.tensor([tok.encode(args.prompt)], device=args.device)
    out = decode.generate(model, idx, args.max_new_tokens, eos_id=tok.eos_id)
    print(repr(args.prompt), "->", repr(tok.decode(out[0, idx.shape[1]:].tolist())))
