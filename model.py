"""
LLaMA-2 in one file, and SharedLLM built on top of it.

SharedLLM ("Two Are Better than One", ICLR 2025) makes two models out of one LLaMA checkpoint:
- the LOWER model (the bottom M layers) encodes the past context X_C, cut into chunks of C tokens.
  Each chunk is a context tree (tree.py); each preserved node is encoded as its own sequence and
  keeps a few of its per-layer key/value states (coarse for big nodes, fine for small ones);
- the UPPER model (the whole LLaMA) reads the running text X_D and, in its bottom M layers,
  cross-attends to those compressed key/values. Keys of chunk i sit at chunk position i and every
  query at position n (n chunks), on top of the keys' own node-local rotation (paper Eq. 2).
Beyond the paper, two choices, the same in every recipe: the search follows what comes after the
question's last words in X_C (continuation_policy), and training draws random chunk ids
(chunk_positions) so that reading far more chunks than training saw stays in distribution.

Notable features:
- hand-written RoPE that takes explicit position ids (whole chunks can sit at one position);
- one `attention` function, the only place that knows flash-attn / SDPA / the manual softmax;
- a KV cache for decoding; cross-attention keys/values are computed once per context;
- runs on CPU (fp32) and CUDA (bf16) with no device-specific code in the modules.
References: the paper (Sec. 3, Eq. 1-3, Algorithm 1); Meta's LLaMA-2 and HF's modeling_llama.py.
"""
import copy
import math
from contextlib import nullcontext
from collections import namedtuple
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import tree

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None
# force "flash" | "sdpa" | "manual" (tests, teaching); None picks the fastest that applies
ATTN_BACKEND = None
# "batched" | "reference" (each preserved node on its own): SharedLLM.encode_nodes
ENCODE_PATH = "batched"
# the batched path encodes preserved nodes in calls of about this many tokens
ENCODE_TOKENS = 4096

# -----------------------------------------------------------------------------
# config


@dataclass
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32        # < n_heads means grouped-query attention (LLaMA-2 70B: 8)
    vocab_size: int = 32000
    hidden_dim: int = 11008     # SwiGLU FFN width
    norm_eps: float = 1e-5      # LLaMA-2's config.json says 1e-5 (HF's class default is 1e-6)
    rope_theta: float = 10000.0
    # the context window the base model was trained for (informational: RoPE takes any position)
    max_seq_len: int = 4096
    head_dim: int = 0           # 0 means dim // n_heads
    # the output head IS the embedding matrix (SmolLM2, Llama-3.2 1B/3B); LLaMA-2: untied
    tie_embeddings: bool = False
    # Llama-3.1/3.2's "llama3" frequency scaling: {"factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None = plain RoPE
    rope_scaling: dict = None

    def __post_init__(self):
        self.head_dim = self.head_dim or self.dim // self.n_heads
        assert self.n_heads % self.n_kv_heads == 0, \
            f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
        assert self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE"


# Named presets, chosen by exact key (never guessed from a folder name).
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

# -----------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x * rsqrt(mean(x^2) + eps) in fp32 (one fused op), cast back, then scale: the same
        # order as HF, so bf16 results agree too
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


# RoPE. Pairs can be formed two ways: Meta's original checkpoints rotate interleaved pairs
# (x0,x1),(x2,x3)... (the complex-number form); Hugging Face checkpoints store wq/wk with their rows
# permuted so that the pairs are the two halves (x_i, x_{i+d/2}) ("rotate_half"). Both give the
# same attention scores. We load HF safetensors, so this file uses the split-half form and the
# weights load untouched. To use Meta's layout instead, un-permute HF weights per head:
#   w.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(n_heads * head_dim, dim)
# (n_kv_heads for wk)
def rope_cos_sin(pos, head_dim, theta, scaling=None):
    # pos: integer tensor of any shape (...); returns cos, sin of shape (..., head_dim), in fp32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim))
    if scaling:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = pos.float()[..., None] * inv_freq            # (..., head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)          # (..., head_dim), one angle per pair
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq, s):
    # Llama-3.1's long-context RoPE: frequencies whose wavelength is short next to the original
    # window stay, long ones are slowed down by `factor`, and those in between are blended
    # linearly in (window / wavelength).
    window, factor = s["original_max_position_embeddings"], s["factor"]
    lo, hi = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    # 0: long wavelength (> window / lo), 1: short
    blend = ((window / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def apply_rope(x, cos, sin):
    # x: (B, H, T, hd); cos/sin: (T, hd) or broadcastable to x. Rotating by p then by q = by p+q.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


_announced = set()


def attention(q, k, v, causal, backend=None, mask=None):
    # q: (B, Hq, Tq, hd); k, v: (B, Hkv, Tk, hd), Hq a multiple of Hkv (grouped-query attention).
    # causal with Tq < Tk means the queries are the LAST Tq positions (decoding with a cache).
    # mask: (B, 1, Tq, Tk) bool, True where a query may read a key (lower_kv); not with causal.
    backend = backend or ATTN_BACKEND
    if backend is None:
        half = q.dtype in (torch.float16, torch.bfloat16)
        backend = "flash" if flash_attn_func is not None and q.is_cuda and half else "sdpa"
    if mask is not None:   # flash-attn takes no mask of this kind
        assert not causal, "attention: a mask or causal, not both"
        backend = "manual" if backend == "manual" else "sdpa"
    if backend not in _announced:
        _announced.add(backend)
        missing = backend == "sdpa" and flash_attn_func is None
        why = " (flash-attn not installed)" if missing else ""
        print(f"attention backend: {backend}{why}")
    Tq, Tk = q.shape[2], k.shape[2]
    if backend == "flash":  # wants (B, T, H, hd), aligns causal masks bottom-right, does GQA
        y = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return y.transpose(1, 2)
    if causal and Tq != Tk:  # bottom-right aligned: query i sits at key position i + Tk - Tq
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              is_causal=causal and mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
    assert backend == "manual", f"unknown attention backend {backend!r}"
    # the readable reference: softmax(q k^T / sqrt(d)) v, in fp32
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # (B, Hq, Tk, hd)
    att = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, Hq, Tq, Tk)
    if causal and mask is None:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    return (att.softmax(dim=-1) @ v.float()).to(q.dtype)


class KVCache:
    # one layer's self-attention keys/values, preallocated for max_len positions and filled in
    # order: (B, Hkv, max_len, hd). Decoding keeps one per layer; so does encode_nodes_reference.
    def __init__(self, batch, n_kv_heads, max_len, head_dim, device, dtype):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = 0   # positions written so far

    def update(self, k, v):
        # k, v: (B, Hkv, T, hd), the next T positions -> all K, V so far: (B, Hkv, length, hd)
        start, end = self.length, self.length + k.shape[2]
        assert end <= self.k.shape[2], \
            f"KV cache holds {self.k.shape[2]} positions, asked to write up to {end}"
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


def split_heads(x, n_heads, head_dim):   # (B, T, n_heads * hd) -> (B, n_heads, T, hd)
    return x.view(x.shape[0], x.shape[1], n_heads, head_dim).transpose(1, 2)


def merge_heads(y):                      # (B, H, T, hd) -> (B, T, H * hd)
    return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)


class SelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def query(self, x, rope):
        # x: (B, T, dim); rope: (cos, sin) of its positions -> Q (rotated): (B, Hq, T, hd)
        return apply_rope(split_heads(self.wq(x), self.n_heads, self.head_dim), *rope)

    def kv(self, x, cos, sin):
        # x: (B, T, dim) -> K (rotated), V: (B, Hkv, T, hd) each
        k = split_heads(self.wk(x), self.n_kv_heads, self.head_dim)
        v = split_heads(self.wv(x), self.n_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, rope, cache=None):
        # x: (B, T, dim); rope: (cos, sin) of its positions; cache: this layer's KVCache (decoding)
        q = self.query(x, rope)
        k, v = self.kv(x, *rope)
        if cache is not None:   # the queries are the LAST T positions of what the cache holds
            k, v = cache.update(k, v)
        return self.wo(merge_heads(attention(q, k, v, causal=True)))


# What an upper layer's cross-attention reads (paper Eq. 3): the compressed K (rotated) and V of
# its lower layer, (B, Hkv, n*S, hd) each (S KVs per chunk); the rotation of the X_D queries to
# their chunk position (cos, sin), or None.
Cross = namedtuple("Cross", "k v q_rope")


class CrossAttention(nn.Module):
    # Upper layer -> compressed context (paper Eq. 3). Its own query and output projections and NO
    # key/value projections: K/V are the lower model's own self-attention K (already rotated) and V
    # at the kept positions.
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def queries(self, x, q_rope):
        # x: (B, T, dim) -> (B, Hq, T, hd), rotated to chunk position n (q_rope) unless chunk ids
        # are off
        q = split_heads(self.wq(x), self.n_heads, self.head_dim)
        return q if q_rope is None else apply_rope(q, *q_rope)

    def forward(self, x, cross):
        # x: (B, T, dim); cross: a Cross -> (B, T, dim). The context precedes X_D: no mask.
        y = attention(self.queries(x, cross.q_rope), cross.k, cross.v, causal=False)
        return self.wo(merge_heads(y))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)   # gate
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)   # down
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)   # up

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = SelfAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.cross_norm = self.cross_attention = None   # attached by SharedLLM to the bottom M

    def forward(self, x, rope, cache=None, cross=None):
        # residual order: self-attention, then cross-attention (the bottom M layers), then the MLP
        x = x + self.attention(self.attention_norm(x), rope, cache)
        if cross is not None:
            x = x + self.cross_attention(self.cross_norm(x), cross)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:   # one tensor in two places: it trains, saves and loads as one
            self.output.weight = self.tok_embeddings.weight
        self.checkpointing = False   # activation checkpointing while training (train.py sets it)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def rope(self, pos):
        return rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def forward(self, idx, targets=None, start_pos=0, caches=None, memory=None, last=0):
        # idx: (B, T) token ids at positions start_pos..start_pos+T-1 (X_D starts at position 0).
        # memory: a compressed context from SharedLLM.compress, or None for the plain LLaMA.
        # last: logits for the last `last` positions only (0 = all), to score a long window's end
        T = idx.shape[1]
        assert caches is None or caches[0].length == start_pos, \
            "decode positions in order: start_pos = cache length"
        rope = self.rope(torch.arange(start_pos, start_pos + T, device=idx.device))
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            cross = None
            if memory is not None and layer.cross_attention is not None:   # reads lower layer i
                cross = Cross(*memory.kv[i], memory.q_rope)
            cache = None if caches is None else caches[i]
            if self.checkpointing and self.training:   # recompute in backward: memory for time
                x = torch.utils.checkpoint.checkpoint(layer, x, rope, cache, cross,
                                                      use_reentrant=False)
            else:
                x = layer(x, rope, cache, cross)
        logits = self.output(self.norm(x[:, -last:] if last else x)).float()
        loss = None
        if targets is not None:   # targets: (B, T), -100 marks positions that are not scored
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=-100)
        return logits, loss

    def new_caches(self, batch, max_len):
        p, c = self.output.weight, self.cfg
        return [KVCache(batch, c.n_kv_heads, max_len, c.head_dim, p.device, p.dtype)
                for _ in self.layers]

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, temperature=0.0, top_k=None, top_p=None, memory=None,
               eos_id=None):
        # prefill idx (B, T), then yield one (B, 1) token at a time, decoding with the KV cache
        B, T = idx.shape
        caches = self.new_caches(B, T + max_new_tokens)
        logits, _ = self(idx, caches=caches, memory=memory)                      # prefill
        for pos in range(T, T + max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p)
            yield nxt
            if (eos_id is not None and (nxt == eos_id).all()) or pos == T + max_new_tokens - 1:
                break
            logits, _ = self(nxt, start_pos=pos, caches=caches, memory=memory)   # one at a time

    def generate(self, idx, max_new_tokens, **sampling):
        return torch.cat([idx, *self.stream(idx, max_new_tokens, **sampling)], dim=1)


def sample_next(logits, temperature=0.0, top_k=None, top_p=None):
    # logits: (B, vocab) -> (B, 1) token ids; temperature 0 is greedy
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if top_p is not None:   # keep the smallest set of tokens whose probability reaches top_p
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(dim=-1) - sp > top_p
        probs = torch.zeros_like(probs).scatter(1, si, sp.masked_fill(drop, 0.0))
    return torch.multinomial(probs, num_samples=1)

# -----------------------------------------------------------------------------
# SharedLLM: the lower model compresses X_C into context trees, the upper model cross-attends


@dataclass
class SharedConfig:
    # The method's settings. Their defaults are train.py's recipe (a test keeps them equal), except
    # the sizes M and C, which are the paper's LLaMA-2 ones (docs/differences.md compares them).
    # M: lower-model layers = the upper's cross-attention layers (paper: 4 LM, 16 SFT)
    n_lower: int = 4
    # C: tokens per context chunk (paper: 1024 LM, 512 SFT)
    chunk_size: int = 1024
    # h: levels of the context tree below the root
    height: int = 3
    # the overall compression: C / (KVs kept per chunk)
    beta: int = 8
    # which child the search expands. "continuation" (ours, every recipe's): toward what follows
    # the question's last words in X_C (continuation_policy); no question, as in language
    # modeling, goes right, as in the paper. Ablations: "query" (the paper's vector: cosine with
    # the question) and "right" (always the most recent half, question or not).
    policy: str = "continuation"
    # the split noise in training (Eq. 1): sigma = l / noise (l: the node's length; the paper's
    # Table 5: l/5 LM, l/10 SFT), so LARGER means LESS noise; 0 = exact halves (its "w/o noise")
    noise: float = 0.0
    # chunk-level position ids (Eq. 2): "random" (ours, every recipe's: random ids in training,
    # the paper's plain ids at inference), "plain" (the paper's, in training too), "off" (its
    # ablation); chunk_positions says what each does
    chunk_ids: str = "random"
    # "shared": the lower model is the upper's own bottom M layers (one set of weights: the paper's
    # copy, while they stay frozen or train together); "copy": a frozen copy of them, so that
    # training the upper model (train.py --train=cross+top, upper) leaves the compressor as it was
    lower: str = "shared"
    # "random": in training, each sample's chunks sit at sorted random ids up to max_chunk_id
    max_chunk_id: int = 1024
    # which token of each stride window keeps its KV: "last", or "first" (the released code)
    keep: str = "last"

    def __post_init__(self):
        if isinstance(self.chunk_ids, bool):   # older checkpoints and code said True / False
            self.chunk_ids = "plain" if self.chunk_ids else "off"
        for name, allowed in [("policy", ("continuation", "query", "right")),
                              ("chunk_ids", ("random", "plain", "off")),
                              ("lower", ("shared", "copy")), ("keep", ("last", "first"))]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"SharedConfig.{name} = {getattr(self, name)!r}; "
                                 f"expected one of {allowed}")
        for name in ("n_lower", "chunk_size", "height", "beta", "max_chunk_id"):
            if getattr(self, name) < 1:
                raise ValueError(f"SharedConfig.{name} = {getattr(self, name)}; "
                                 "expected at least 1")
        if not self.noise >= 0:
            raise ValueError(f"SharedConfig.noise = {self.noise}; "
                             "expected 0 (off) or a positive value")
        try:   # an impossible shape fails here, once, not in the middle of a run
            tree.search(1, self.chunk_size, self.height, self.beta)
        except AssertionError as e:
            raise ValueError(f"SharedConfig: chunk_size {self.chunk_size}, height {self.height}, "
                             f"beta {self.beta}: {e}") from None
        if round(self.chunk_size / self.beta) < self.height + 1:   # else more than C / beta kept
            raise ValueError(f"SharedConfig.beta = {self.beta}: a tree of height {self.height} "
                             f"keeps at least one KV in each of its {self.height + 1} nodes, so a "
                             f"chunk of {self.chunk_size} tokens allows beta up to "
                             f"{self.chunk_size // (self.height + 1)}")


@dataclass
class Memory:
    # a compressed context: what the upper model's cross-attention reads
    # per lower layer j: (K, V), each (B, Hkv, n*S, hd); S = KVs kept per chunk
    kv: list
    # (cos, sin), (B, 1, 1, hd) each: every X_D query's rotation to its chunk position (n for plain
    # ids), or None: no chunk ids
    q_rope: tuple
    # per (batch item, chunk): the preserved tree.Nodes
    nodes: list = field(default_factory=list)


class SharedLLM(nn.Module):
    def __init__(self, llama, scfg):
        super().__init__()
        cfg, m = llama.cfg, scfg.n_lower
        if not 1 <= m <= cfg.n_layers:
            raise ValueError(f"n_lower (M) = {m}; the model has {cfg.n_layers} layers")
        self.scfg, self.upper = scfg, llama
        # None: the lower model is the upper's own bottom M layers
        self.lower = frozen_copy(llama, m) if scfg.lower == "copy" else None
        p = llama.output.weight
        for blk in llama.layers[:m]:   # the bottom M layers cross-attend: layer i reads lower i
            blk.cross_norm = RMSNorm(cfg.dim, cfg.norm_eps).to(p.device, p.dtype)
            blk.cross_attention = CrossAttention(cfg).to(p.device, p.dtype)
            # The layer's own query (its norm and wq) and a zero output projection: an untrained
            # SharedLLM returns exactly its base LLaMA's output, so training starts from the
            # pretrained model and only adds.
            with torch.no_grad():
                blk.cross_norm.weight.copy_(blk.attention_norm.weight)
                blk.cross_attention.wq.weight.copy_(blk.attention.wq.weight)
                blk.cross_attention.wo.weight.zero_()

    @classmethod
    def from_llama(cls, llama, **shared_config):
        # both models from one checkpoint: SharedLLM.from_llama(load_llama(dir), n_lower=4, ...)
        return cls(llama, SharedConfig(**shared_config))

    def lower_model(self):
        return self.lower if self.lower is not None else self.upper

    def lower_parameters(self):
        # what the compressor runs: the embedding, the bottom M blocks (not their cross-attention)
        low = self.lower_model()
        return [p for n, p in low.named_parameters() if n.startswith("tok_embeddings")
                or (n.startswith("layers.") and int(n.split(".")[1]) < self.scfg.n_lower
                    and ".cross_" not in n)]

    def forward(self, context, idx, targets=None, query_len=None):
        # context: (B, n, C) or None; idx, targets: (B, T) -> logits (B, T, vocab), loss
        empty = context is None or context.shape[1] == 0
        memory = None if empty else self.compress(context, idx, query_len)
        return self.upper(idx, targets, memory=memory)

    @torch.no_grad()
    def generate(self, context, idx, max_new_tokens, query_len=None, **sampling):
        memory = self.compress(context, idx, query_len)   # once: the tree and its KVs stay fixed
        return self.upper.generate(idx, max_new_tokens, memory=memory, **sampling)

    def compress(self, context, idx=None, query_len=None):
        # The paper's method in four steps. context: (B, n, C) token ids of X_C; idx: (B, T) the
        # running text X_D; query_len: (B,) how many leading tokens of X_D are the question. None
        # (or 0 for a row) means no question: language modeling, where the paper goes right. (All
        # of X_D as the question would let the tree depend on the tokens being predicted.) -> Memory
        B, n, C = context.shape
        if C != self.scfg.chunk_size:
            raise ValueError(f"context chunks have {C} tokens; this model's chunk_size C is "
                             f"{self.scfg.chunk_size}")
        rows = context.reshape(B * n, C)                  # one context tree per (batch item, chunk)
        if query_len is not None:                         # on the host: the tree reads it
            query_len = torch.as_tensor(query_len).cpu()
        frozen = not any(p.requires_grad for p in self.lower_parameters())
        # a frozen compressor builds no graph; a trained one keeps the caller's mode (eval: no_grad)
        with torch.no_grad() if frozen else nullcontext():
            # 1. the query-aware policy: how each tree picks the child to expand
            decide, first_kv = self.search_policy(rows, idx, query_len)
            # 2. split-and-search (Eq. 1, Algorithm 1): the preserved nodes and the KVs each keeps
            # (the level-wise compression: tree.node_budget)
            noise = self.scfg.noise if self.training else 0.0
            nodes = tree.search(B * n, C, self.scfg.height, self.scfg.beta, decide, noise)
            # 3. each preserved node through the lower model, K/V kept at tree.keep_index
            kv = self.encode_nodes(rows, nodes, first_kv)
            # 4. chunk-level position ids (Eq. 2); the upper model's CrossAttention reads the
            # result (Eq. 3)
            return self.chunk_level_kv(kv, nodes, B, n)

    def search_policy(self, rows, idx, query_len):
        # Step 1 (Sec. 3.2): how every tree chooses the child to expand -> decide(level, lefts,
        # rights) for tree.search, or None ("always right"); and the first layer's K/V of every
        # context token when the policy computed them (step 3 reuses them), else None.
        policy = self.scfg.policy
        if policy == "right" or query_len is None or not bool((query_len > 0).any()):
            return None, None
        if policy == "continuation":                                   # ours: every recipe's search
            return continuation_policy(rows, idx, query_len), None
        first_kv = first_layer_kv(self.lower_model(), rows.reshape(-1))  # (B*n*C, Hkv, hd) each
        return self.query_policy(rows, idx, query_len, first_kv), first_kv   # the paper's vector

    def expand_right_reference(self, question, left, right):
        # Step 1 for one tree at one level, the obvious way (query_policy is tested equal to it):
        # the question's vector (upper model) and each child's (lower model), expand the closer.
        # question, left, right: token spans (L,) each -> True: expand the right child
        q = retrieval_vector_reference(self.upper, question)
        low = self.lower_model()
        sim = lambda span: F.cosine_similarity(q, retrieval_vector_reference(low, span), 0)
        return bool(sim(right) > sim(left))

    def query_policy(self, rows, idx, query_len, first_kv):
        # The paper's query-aware search, fast: at each level, every tree compares the question
        # with ITS OWN two children and expands the more similar one (cosine of retrieval vectors;
        # expand_right_reference is the same for one tree, plainly, and tested equal). A row whose
        # sample has no question goes right.
        # rows: (B*n, C); idx: (B, T) X_D; query_len: (B,) on the host; first_kv: the first layer's
        # K (not rotated) and V of every context token, (B*n*C, Hkv, hd) each -> decide
        low, (R, C) = self.lower_model(), rows.shape
        n = R // idx.shape[0]
        no_query = (query_len == 0).repeat_interleave(n).tolist()
        with torch.no_grad():   # a discrete choice: no gradient flows through it
            # the question's last token (a row with no question: any index, it goes right anyway)
            last = (query_len - 1).clamp(min=0).to(idx.device)
            q = retrieval_vector(self.upper, idx, last[:, None])[:, 0]            # (B, dim)
            q = q.repeat_interleave(n, dim=0)                                    # (B*n, dim)
            # RoPE is relative: a span inside a row scores as on its own when the row's keys are
            # rotated once at their row positions, so one rotation serves every span compared:
            # (R*C, Hkv, hd) -> (R, Hkv, C, hd), K rotated at 0..C-1
            rows_kv = sequence_kv(low, *(t.view(R, C, *t.shape[1:]) for t in first_kv))

        def decide(level, lefts, rights):   # per tree, its children's (start, end) -> expand right?
            ends = [[l_end - 1, r_end - 1] for (_, l_end), (_, r_end) in zip(lefts, rights)]
            starts = [[l_start, r_start] for (l_start, _), (r_start, _) in zip(lefts, rights)]
            with torch.no_grad():   # both children of every tree in one call
                h = retrieval_vector(low, rows, to_device(ends, rows.device),
                                     to_device(starts, rows.device), rows_kv)     # (B*n, 2, dim)
            cos = F.cosine_similarity
            closer = cos(q, h[:, 1], dim=-1) > cos(q, h[:, 0], dim=-1)
            return [r or nq for r, nq in zip(closer.tolist(), no_query)]
        return decide

    def encode_nodes_reference(self, rows, nodes):
        # Step 3 (Sec. 3.2), the obvious way: each preserved node is a sequence of its own
        # (positions 0..len-1) through the lower model's bottom M blocks, with no cross-attention.
        # Each block's KV cache then holds exactly the K (rotated) and V the paper keeps, read at
        # the node's kept positions. encode_nodes is tested equal to this, values and gradients.
        # rows: (B*n, C); nodes: per row, its preserved tree.Nodes
        # -> per lower layer (K, V), each (all kept KVs, Hkv, hd), in text order
        low, cfg = self.lower_model(), self.scfg
        kv = [([], []) for _ in range(cfg.n_lower)]
        for r, row_nodes in enumerate(nodes):
            for nd in row_nodes:
                tokens = rows[r:r + 1, nd.start:nd.end]                          # (1, len)
                x = low.tok_embeddings(tokens)
                rope = low.rope(torch.arange(len(nd), device=rows.device))
                # the dtype attention computes K/V in (bf16 under autocast)
                autocast = torch.is_autocast_enabled(x.device.type)
                dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
                caches = [KVCache(1, low.cfg.n_kv_heads, len(nd), low.cfg.head_dim, rows.device,
                                  dtype) for _ in range(cfg.n_lower)]
                for block, cache in zip(low.layers[:cfg.n_lower], caches):
                    x = block(x, rope, cache)
                kept_at = tree.keep_index(len(nd), nd.kept, cfg.keep)
                for j, cache in enumerate(caches):                               # (n_kept, Hkv, hd)
                    kv[j][0].append(cache.k[0, :, kept_at].transpose(0, 1))
                    kv[j][1].append(cache.v[0, :, kept_at].transpose(0, 1))
        return [(torch.cat(ks), torch.cat(vs)) for ks, vs in kv]

    def encode_nodes(self, rows, nodes, first_kv=None):
        # Step 3, batched: what encode_nodes_reference does one node at a time, for many nodes per
        # call. Where it departs from the reference, and why the result is the same:
        # - the nodes of one level (one length up to the split noise, one count kept) go through
        #   the lower model together, right-padded by repeating their last token: attention is
        #   causal, so no real position reads the padding; about ENCODE_TOKENS tokens per call;
        # - first_kv (from step 1): the first layer's K/V depend on the token alone before RoPE,
        #   so only K's rotation (to the node's own positions) is redone (sequence_kv);
        # - the last lower block projects only the kept tokens' K/V: nothing reads its output;
        # - the calls come out level by level; `order` puts the kept KVs back in text order.
        # Same inputs and output as encode_nodes_reference.
        if ENCODE_PATH == "reference":
            return self.encode_nodes_reference(rows, nodes)
        low, cfg = self.lower_model(), self.scfg
        calls = [([], []) for _ in range(cfg.n_lower)]   # per layer: each call's kept K and V
        offset_of, n_out = {}, 0   # (row, node start) -> its first kept KV's index in the calls
        for level in range(1, cfg.height + 1):
            at_level = [(r, nd) for r, nds in enumerate(nodes) for nd in nds if nd.level == level]
            per_call = max(1, ENCODE_TOKENS // max(len(nd) for _, nd in at_level))
            for sel in (at_level[i:i + per_call] for i in range(0, len(at_level), per_call)):
                spans = [(nd.start, nd.end) for _, nd in sel]
                tokens, at = gather_spans(rows, [r for r, _ in sel], spans)
                kept_at = to_device([tree.keep_index(len(nd), nd.kept, cfg.keep) for _, nd in sel],
                                    rows.device)
                kv0 = None if first_kv is None else sequence_kv(low, *(t[at] for t in first_kv))
                for j, kv in enumerate(lower_kv(low, tokens, cfg.n_lower, kept_at, kv0)):
                    for out, t in zip(calls[j], kv):                   # (R, Hkv, n_kept, hd)
                        out.append(t.transpose(1, 2).flatten(0, 1))
                # the calls come level by level: where each node's kept KVs start in them
                for i, (r, nd) in enumerate(sel):
                    offset_of[r, nd.start] = n_out + i * kept_at.shape[1]
                n_out += kept_at.numel()
        order = to_device([offset_of[r, nd.start] + t for r, nds in enumerate(nodes) for nd in nds
                           for t in range(nd.kept)], rows.device)    # text order -> index in calls
        return [(torch.cat(ks)[order], torch.cat(vs)[order]) for ks, vs in calls]

    def chunk_level_kv(self, kv, nodes, B, n):
        # Step 4 (Eq. 2): each chunk's kept K/V side by side, every key of chunk i rotated to chunk
        # position i on top of its node-local rotation, and every X_D query placed at position n.
        # RoPE then makes a query-key angle depend on n - i - p (p: the key's position inside its
        # node): one chunk step is one token of rotation, and the upper model sees chunk order.
        # kv: per lower layer (K, V), each (B*n*S, Hkv, hd) in text order
        # -> Memory with (B, Hkv, n*S, hd) each
        S = sum(nd.kept for nd in nodes[0])                  # KVs kept per chunk, the same for all
        k_pos, q_pos = chunk_positions(self.scfg, B, n, kv[0][0].device, self.training)
        k_rope = q_rope = None
        if k_pos is not None:
            k_rope = [t[:, None] for t in self.upper.rope(k_pos.repeat_interleave(S, dim=1))]
            q_rope = tuple(t[:, None, None] for t in self.upper.rope(q_pos))   # (B, 1, 1, hd)
        out = []
        for K, V in kv:
            K, V = (t.view(B, n * S, *t.shape[1:]).transpose(1, 2) for t in (K, V))  # B,Hkv,nS,hd
            out.append((K if k_rope is None else apply_rope(K, *k_rope), V))
        return Memory(out, q_rope, nodes)


def chunk_positions(scfg, B, n, device, training):
    # The chunk-level position ids of Eq. 2 -> the keys' (B, n) and the queries' (B,), or Nones.
    # "plain" (the paper): the keys of chunk i at i, every X_D query at n. "off": no ids (ablation).
    # "random" (ours; plain at inference): in training, n distinct ids drawn from 0..span-1 and
    #   sorted, the queries one past the last, with the span log-uniform in n..max_chunk_id. Dense
    #   ids and every scale of distance up to max_chunk_id are seen, each octave as often, so
    #   reading 64x more chunks than training saw meets no unseen distance (Ruoss et al., 2023:
    #   randomized positional encodings).
    if scfg.chunk_ids == "off":
        return None, None
    if scfg.chunk_ids == "random" and training:
        if n > scfg.max_chunk_id:
            raise ValueError(f"{n} chunks need chunk ids up to {n}; "
                             f"max_chunk_id is {scfg.max_chunk_id}")
        u = torch.rand(B, 1, device=device)
        span = (n * ((scfg.max_chunk_id + 1) / n) ** u).long().clamp(n, scfg.max_chunk_id)  # (B,1)
        draw = torch.rand(B, scfg.max_chunk_id, device=device)
        draw[torch.arange(scfg.max_chunk_id, device=device)[None] >= span] = 2.0   # never drawn
        ids = draw.argsort(dim=1)[:, :n].sort(dim=1).values                        # (B, n)
        return ids, ids[:, -1] + 1
    ids = torch.arange(n + 1, device=device)
    return ids[:n].expand(B, n), ids[n].expand(B)

# -----------------------------------------------------------------------------
# the lower model's pieces: LLaMA modules used as SharedLLM needs them


def lower_kv(llama, tokens, n_layers, kept_at, kv0=None):
    # The lower model on R nodes at once: the bottom n_layers blocks over tokens (R, L) at positions
    # 0..L-1 (causal, no cross-attention) -> per layer its self-attention K (rotated) and V at the
    # kept positions kept_at (R, n_kept): n_layers x (K, V), each (R, Hkv, n_kept, hd).
    # kv0: the first layer's K, V over tokens, if already computed.
    # Only the kept tokens' K/V leave the last block, so the block below it needs its output at
    # the kept tokens alone: there only they get a query, attention and the MLP (K/V at every
    # token, as the causal attention reads them all). The same numbers as running every block
    # on every token (encode_nodes_reference, tested equal).
    L = tokens.shape[1]
    cos, sin = llama.rope(torch.arange(L, device=tokens.device))
    cos_k, sin_k = cos[kept_at][:, None], sin[kept_at][:, None]          # (R, 1, n_kept, hd)
    x, out = llama.tok_embeddings(tokens), []
    at = kept_at[:, None, :, None]                                       # (R, 1, n_kept, 1)
    take = lambda t: t.gather(2, at.expand(-1, t.shape[1], -1, t.shape[3]))   # (R,Hkv,L,hd) -> kept
    rows = lambda t: t.gather(1, kept_at[:, :, None].expand(-1, -1, t.shape[2]))  # (R,L,d) -> kept
    for i, block in enumerate(llama.layers[:n_layers]):
        att, given = block.attention, (kv0 if i == 0 else None)
        if i == n_layers - 1:   # the last block's output is never used: only the kept tokens' K, V
            if given is not None:
                out.append((take(given[0]), take(given[1])))
            else:   # x is already at the kept tokens, unless this is the only block
                xk = rows(x) if n_layers == 1 else x                             # (R,n_kept,dim)
                out.append(att.kv(block.attention_norm(xk), cos_k, sin_k))
            break
        h = block.attention_norm(x)   # the block's forward, written out to keep its K and V
        k, v = att.kv(h, cos, sin) if given is None else given                   # (R, Hkv, L, hd)
        if i == n_layers - 2:   # the next block reads this one at the kept tokens: queries there
            q = att.query(rows(h), (cos_k, sin_k))                         # (R, Hq, n_kept, hd)
            sees = kept_at[:, None, :, None] >= torch.arange(L, device=x.device)   # R,1,n_kept,L
            x = rows(x) + att.wo(merge_heads(attention(q, k, v, causal=False, mask=sees)))
        else:
            x = x + att.wo(merge_heads(attention(att.query(h, (cos, sin)), k, v, causal=True)))
        x = x + block.feed_forward(block.ffn_norm(x))
        out.append((take(k), take(v)))
    return out


def first_layer_kv(llama, tokens):
    # The first layer's K (before RoPE) and V of every token of tokens (...): (..., Hkv, hd) each.
    # The first layer reads the embedding, so these depend on the token alone; only K's rotation
    # depends on where a sequence starts. The paper's search computes them once for all context
    # tokens; the encoding then reuses them (sequence_kv).
    att = llama.layers[0].attention
    x = llama.layers[0].attention_norm(llama.tok_embeddings(tokens))
    return [w(x).unflatten(-1, (att.n_kv_heads, att.head_dim)) for w in (att.wk, att.wv)]


def sequence_kv(llama, k, v):
    # the first layer's K (not rotated) and V of R sequences, (R, L, Hkv, hd) each, as attention
    # reads them when each sequence starts at position 0: (R, Hkv, L, hd) each, K rotated to 0..L-1
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    return apply_rope(k, *llama.rope(torch.arange(k.shape[2], device=k.device))), v


def retrieval_vector_reference(llama, span):
    # The vector the paper's search compares, the obvious way: the span (L,) read as a sequence of
    # its own by the first block, then the final norm, at its last position -> (dim,). (The paper
    # says "one self-attention layer"; the released code's vector also went through the MLP and
    # the norm, and so does this one.)
    pos = torch.arange(len(span), device=span.device)
    x = llama.layers[0](llama.tok_embeddings(span[None]), llama.rope(pos))
    return llama.norm(x)[0, -1]


def retrieval_vector(llama, tokens, ends, starts=None, kv=None):
    # retrieval_vector_reference for many spans at once (tested equal to it). tokens (R, L): token
    # rows; ends, starts (R, n_spans): spans [start, end] per row, both INCLUSIVE (a tree.Node's end
    # is exclusive; starts None = 0) -> (R, n_spans, dim). Only the span's last position is needed,
    # so only it gets a query, attention and the MLP. kv: the first layer's K (rotated at 0..L-1)
    # and V of the rows, if already computed.
    R, n_spans = ends.shape
    layer, att = llama.layers[0], llama.layers[0].attention
    if kv is None:
        kv = sequence_kv(llama, *first_layer_kv(llama, tokens))                 # (R, Hkv, L, hd)
    k, v = kv
    x = llama.tok_embeddings(tokens.gather(1, ends))                            # (R, n_spans, dim)
    cos, sin = llama.rope(ends)                                                 # (R, n_spans, hd)
    # grouped-query attention: query head h = kv_head * G + g, so the Hq query heads split as
    # (Hkv, G), and the G heads of a group (for every span) share that kv head's keys
    q = att.wq(layer.attention_norm(x)).view(R, n_spans, att.n_kv_heads, -1, att.head_dim)
    q = q.transpose(1, 2)                                   # (R, Hkv, n_spans, G, hd), G = Hq/Hkv
    q = apply_rope(q, cos[:, None, :, None], sin[:, None, :, None])
    # one query per span: a plain softmax over its own keys, in fp32
    scores = (q.float().flatten(2, 3) @ k.float().transpose(-2, -1))
    scores = scores.unflatten(2, q.shape[2:4])                           # (R, Hkv, n_spans, G, L)
    pos = torch.arange(k.shape[2], device=tokens.device)
    lo = 0 if starts is None else starts[..., None]
    outside = (pos > ends[..., None]) | (pos < lo)                               # (R, n_spans, L)
    scores = scores.masked_fill(outside[:, None, :, None], float("-inf")) / math.sqrt(att.head_dim)
    y = (scores.softmax(dim=-1).flatten(2, 3) @ v.float()).unflatten(2, q.shape[2:4])
    y = y.permute(0, 2, 1, 3, 4).reshape(R, n_spans, -1)                        # heads in order
    x = x + att.wo(y.to(x.dtype))
    return llama.norm(x + layer.feed_forward(layer.ffn_norm(x)))


def to_device(values, device):
    # a small index list made on the host, sent without waiting for the device: torch.tensor(values,
    # device="cuda") would first wait for all queued GPU work (a host sync per level and call)
    return torch.tensor(values).to(device, non_blocking=True)


def gather_spans(rows, row_ids, spans):
    # rows: (R0, C) token ids; spans[i] = (start, end) inside rows[row_ids[i]] -> (R, L) tokens,
    # right-padded by repeating each span's last token (harmless: every consumer is causal and reads
    # only real positions), and the (R, L) positions of those tokens in rows.flatten() (to gather
    # anything kept per context token alike).
    dev, C = rows.device, rows.shape[1]
    lens = [e - s for s, e in spans]
    starts = to_device([r * C + s for r, (s, _) in zip(row_ids, spans)], dev)
    steps = torch.arange(max(lens), device=dev)[None]
    at = starts[:, None] + torch.minimum(steps, to_device(lens, dev)[:, None] - 1)
    return rows.reshape(-1)[at], at


def frozen_copy(llama, m):
    # lower="copy": the lower model as its own frozen copy of the embedding, the bottom m blocks and
    # the final norm (retrieval_vector reads it): training the upper model leaves it as it was
    lower = copy.deepcopy(llama)
    lower.layers, lower.output = lower.layers[:m], None
    return lower.requires_grad_(False)

# -----------------------------------------------------------------------------
# The search beyond the paper, every recipe's (SharedConfig.policy = "continuation")


MATCH_MAX = 8   # a match counts at most 8 tokens: longer ones are as rare (16 bytes of
                # "The pass key is " already match 8; SmolLM2 tokenizes it as 5)


def continuation_policy(rows, idx, query_len):
    # Step 1 with another similarity (ours). The paper compares the question's first-layer vector
    # with each child's; on a pretrained model that vector reads mostly one token, and the search
    # is then no better than chance (docs/experiments.md). This one is lexical and has no weights:
    # where the question's last words stand in X_C, what follows them is what it asks for
    # ("... The pass key is" -> the key), as an induction head reads it. Position p of X_C scores
    # the length of the longest run of the question's last tokens that ends right before p
    # (across chunk borders; at most MATCH_MAX). Each tree expands the child holding the higher
    # best score; a tie (text with no match, or no question) goes right, as the paper's LM does.
    # rows: (R, C), R = B*n; idx: (B, T); query_len: (B,) on the host -> decide
    (R, C), B = rows.shape, idx.shape[0]
    n, q_len = R // B, query_len.to(idx.device)
    seq = rows.reshape(B, n * C)                               # each sample's X_C in order
    match = torch.zeros_like(seq)                              # (B, n*C) the score of every p
    still = torch.ones_like(seq, dtype=torch.bool)             # (B, n*C) the run is unbroken
    for j in range(1, MATCH_MAX + 1):                          # the question's j-th last token
        q_j = idx[torch.arange(B, device=idx.device), (q_len - j).clamp(min=0)]       # (B,)
        before = F.pad(seq, (j, 0), value=-1)[:, :n * C]       # (B, n*C) the token j before p
        still &= (before == q_j[:, None]) & (q_len[:, None] >= j)
        match += still
    match = match.view(R, C)                                   # no question: 0 everywhere
    pos = torch.arange(C, device=rows.device)                  # (C,) positions in a chunk

    def decide(level, lefts, rights):   # per tree, its children's (start, end) -> expand right?
        spans = to_device([[*lf, *rt] for lf, rt in zip(lefts, rights)], rows.device)  # (R, 4)
        def best(start, end):           # (R,) the best score inside [start, end) of each row
            inside = (pos >= start[:, None]) & (pos < end[:, None])                   # (R, C)
            return match.masked_fill(~inside, -1).amax(1)
        return (best(spans[:, 2], spans[:, 3]) >= best(spans[:, 0], spans[:, 1])).tolist()
    return decide
