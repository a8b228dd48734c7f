"""LLaMA in one file, and SharedLLM on top of it (Han et al., "Stacked from One", ICLR 2026; this
follows arXiv 2410.19318, then "Two Are Better than One"). One LLaMA gives two models: the LOWER
(its bottom M layers) compresses the past context X_C, chunk by chunk, each chunk a context tree
(tree.py) whose preserved nodes keep a few key/values, coarse for big nodes, fine for small ones;
the UPPER (the whole LLaMA) reads the running text X_D and, in its bottom M layers, cross-attends
to them. SharedLLM.compress runs the method as four steps (our numbering of Sec. 3.2-3.3)."""
from collections import Counter, namedtuple
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import tree

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None
ENCODE_TOKENS = 4096   # tokens a step 3 call encodes: memory bounded; others no faster (e0f5437)

# ---------------------------------------------- LLaMA -------------------------------------------
@dataclass
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32        # < n_heads: grouped-query attention (LLaMA-2 70B: 8)
    vocab_size: int = 32000
    hidden_dim: int = 11008     # SwiGLU FFN width
    norm_eps: float = 1e-5      # LLaMA-2's config.json says 1e-5 (HF's class default is 1e-6)
    rope_theta: float = 10000.0
    max_seq_len: int = 4096     # the base model's window (informational: RoPE takes any position)
    head_dim: int = 0           # 0: dim // n_heads
    tie_embeddings: bool = False   # the output head IS the embedding (SmolLM2)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.dim // self.n_heads
        assert self.n_heads % self.n_kv_heads == 0 and self.head_dim % 2 == 0, self


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, cast back, then scale: HF's order, so bf16 results agree too
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


# RoPE with explicit position ids (SharedLLM adds one id per chunk, Step 4). A rotated pair is
# the two halves (x_i, x_{i+hd/2}), as HF checkpoints store wq/wk (Meta's: interleaved pairs).
def rope_cos_sin(pos, head_dim, theta):   # pos: integers (...) -> cos, sin: (..., head_dim), fp32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device).float() / head_dim))
    angles = pos.float()[..., None] * inv_freq            # (..., head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)          # (..., head_dim), one angle per pair
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    # x: (B, H, T, hd); cos, sin: broadcastable to x. Rotating by p then by q is rotating by p + q.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention(q, k, v, causal, mask=None):
    # softmax(q k^T / sqrt(hd)) v (tests write it out). q: (B, Hq, Tq, hd); k, v: (B, Hkv, Tk, hd),
    # Hkv dividing Hq (grouped-query). causal, Tq < Tk: the queries are the LAST Tq positions. mask:
    # (B, 1, Tq, Tk), True where a query may read a key. flash-attn where it runs (installed, CUDA,
    # half precision, no mask; it takes (B, T, H, hd), aligns causal masks bottom-right), else SDPA.
    if flash_attn_func and q.is_cuda and q.dtype != torch.float32 and mask is None:
        y = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal)
        return y.transpose(1, 2)
    Tq, Tk = q.shape[2], k.shape[2]
    if causal and Tq != Tk:  # bottom-right aligned: query i sits at key position i + Tk - Tq
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


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

    def kv(self, x, cos, sin):   # x: (B, T, dim) -> K (rotated), V: (B, Hkv, T, hd) each
        k, v = (split_heads(w(x), self.n_kv_heads, self.head_dim) for w in (self.wk, self.wv))
        return apply_rope(k, cos, sin), v

    def forward(self, x, rope, cache=None):   # x: (B, T, dim); rope: (cos, sin); decode.KVCache
        q = apply_rope(split_heads(self.wq(x), self.n_heads, self.head_dim), *rope)   # B,Hq,T,hd
        k, v = self.kv(x, *rope)
        if cache is not None:   # decoding: the queries are the LAST T positions of the cache
            k, v = cache.update(k, v)
        return self.wo(merge_heads(attention(q, k, v, causal=True)))


class CrossAttention(nn.Module):
    # Upper layer -> compressed context (Eq. 3; Block.forward calls it, SharedLLM makes it): a query
    # and an output projection of its own, no K/V projections: K/V are a lower layer's K and V.
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def queries(self, x, q_rope):   # x: (B, T, dim) -> (B, Hq, T, hd), rotated to their chunk id
        return apply_rope(split_heads(self.wq(x), self.n_heads, self.head_dim), *q_rope)

    def forward(self, x, k, v, q_rope):   # k, v: (B, Hkv, kept KVs, hd); no mask: X_C precedes X_D
        return self.wo(merge_heads(attention(self.queries(x, q_rope), k, v, causal=False)))


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
        self.cross_norm = self.cross_attention = None   # SharedLLM adds them to the bottom M

    def forward(self, x, rope, cache=None, cross=None):   # attention, cross-attention (if M), MLP
        x = x + self.attention(self.attention_norm(x), rope, cache)
        if cross is not None:
            x = x + self.cross_attention(self.cross_norm(x), *cross)
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
        self.checkpointing = False   # activation checkpointing in training
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def rope(self, pos):
        return rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)

    def forward(self, idx, targets=None, start_pos=0, caches=None, memory=None, last=0):
        # idx, targets: (B, T) at positions start_pos.. (X_D starts at 0), targets -100 where not
        # scored (data.py); memory: compress's or None; last > 0: logits of the last `last` only
        T = idx.shape[1]
        assert caches is None or caches[0].length == start_pos, "decode in order: start_pos"
        rope = self.rope(torch.arange(start_pos, start_pos + T, device=idx.device))
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            reads = memory is not None and layer.cross_attention is not None   # lower layer i
            cross = (*memory.kv[i], memory.q_rope) if reads else None
            cache = None if caches is None else caches[i]
            if self.checkpointing and self.training:   # recompute in backward: memory for time
                x = torch.utils.checkpoint.checkpoint(layer, x, rope, cache, cross,
                                                      use_reentrant=False)
            else:
                x = layer(x, rope, cache, cross)
        logits = self.output(self.norm(x[:, -last:] if last else x)).float()
        if targets is None:   # (else the loss: a mean over the scored tokens; the paper's L sums)
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

# -------------------------------------------- SharedLLM -----------------------------------------
@dataclass
class SharedConfig:
    # The method's settings. Defaults: train.py's recipe, except M and C, the paper's LLaMA-2 sizes.
    n_lower: int = 4        # M: lower-model layers = upper cross-attention layers (paper: 4, 16)
    chunk_size: int = 1024  # C: tokens per context chunk (paper: 1024 LM, 512 SFT)
    height: int = 3         # h: levels of the context tree below the root
    beta: float = 8.0       # the overall compression: C / (KVs kept per chunk)
    policy: str = "lexical"   # pi: "lexical" (ours); the paper's "vector" (questions), "right" (LM)
    sigma: float = 0.0      # split noise in training, a fraction of l (Table 6: l/5 = 0.2; tree.py)
    chunk_pos: str = "random"   # Eq. 2: "random" (ours), "plain" (paper), "off"; chunk_positions
    max_chunk_id: int = 1024   # "random": the largest id drawn in training
    keep: str = "last"      # which token of each stride window is kept: "last" (ours) or "first"

    def __post_init__(self):   # a setting the model refuses, named in one line
        if not (self.policy in ("lexical", "vector", "right") and self.keep in ("last", "first")
                and self.chunk_pos in ("random", "plain", "off") and self.n_lower >= 1
                and self.sigma >= 0 and self.chunk_size >> self.height >= 1
                and 1 <= self.beta <= self.chunk_size / (self.height + 1)):   # a KV a node
            raise ValueError(f"{self}: expected policy lexical, vector, right; keep last, first; "
                             "chunk_pos random, plain, off; M, C / 2^h >= 1; 1 <= beta <= C/(h+1)")


# a compressed context: kv, per lower layer (K, V), each (B, Hkv, n * KVs a chunk, hd); q_rope,
# X_D's rotation (cos, sin), each (B, 1, 1, hd); nodes, per (sample, chunk), its tree.Nodes
Memory = namedtuple("Memory", "kv q_rope nodes")


class SharedLLM(nn.Module):
    def __init__(self, llama, scfg):
        super().__init__()
        # the lower model is the upper's own bottom M layers (the same weights): one checkpoint
        self.scfg, self.upper, cfg, p = scfg, llama, llama.cfg, llama.output.weight
        assert scfg.n_lower <= cfg.n_layers, f"n_lower (M) {scfg.n_lower} of {cfg.n_layers} layers"
        for blk in llama.layers[:scfg.n_lower]:   # the bottom M layers cross-attend: i reads i
            blk.cross_norm = RMSNorm(cfg.dim, cfg.norm_eps).to(p.device, p.dtype)
            blk.cross_attention = CrossAttention(cfg).to(p.device, p.dtype)
            # Ours: the layer's own norm and query, and a zero output projection. An untrained
            # SharedLLM returns exactly its base LLaMA's output: training only adds to it.
            with torch.no_grad():
                blk.cross_norm.weight.copy_(blk.attention_norm.weight)
                blk.cross_attention.wq.weight.copy_(blk.attention.wq.weight)
                blk.cross_attention.wo.weight.zero_()

    def forward(self, context, idx, targets=None, question_len=None, beta=None):
        # context: (B, n, C) or None; idx, targets: (B, T) -> logits (B, T, vocab), loss
        memory = None if context is None else self.compress(context, idx, question_len, beta)
        return self.upper(idx, targets, memory=memory)

    def compress(self, context, idx=None, question_len=None, beta=None):
        # Sec. 3.2-3.3, a step a line. context: (B, n, C), X_C; idx: (B, T), X_D; question_len:
        # (B,), on the host, the question's length at X_D's start (0: none); beta: or the config's
        B, n, C = context.shape
        assert C == self.scfg.chunk_size, f"chunks of {C} tokens, not {self.scfg.chunk_size}"
        rows = context.reshape(B * n, C)                  # one context tree per (batch item, chunk)
        # 1. the query-aware policy pi, which tree.search calls at each level
        select = self.search_policy(rows, idx, question_len)
        # 2. split-and-search (Eq. 1, Algorithm 1): the preserved nodes, KVs kept by each
        sigma = self.scfg.sigma if self.training else 0.0
        nodes = tree.search(B * n, C, self.scfg.height, beta or self.scfg.beta, select, sigma)
        # 3. each preserved node through the lower model: its kept K/V of every layer
        kv = self.encode_nodes(rows, nodes)
        # 4. chunk-level position ids (Eq. 2), for the upper model's CrossAttention
        return self.chunk_level_kv(kv, nodes, B, n)

    def search_policy(self, rows, idx, question_len):
        # Step 1 (Sec. 3.2) -> select(lefts, rights) for tree.search, or None: the right child
        # everywhere (the paper's language modeling, and any batch with no question)
        if self.scfg.policy == "right" or question_len is None or not (question_len > 0).any():
            return None
        if self.scfg.policy == "vector":   # the paper's
            return self.vector_policy(rows, idx, question_len)
        target = lexical_targets_batched(rows, idx, question_len, self.upper.cfg.vocab_size)
        return lambda lefts, rights: [t >= rt[0] for t, rt in zip(target, rights)]   # ours

    def vector_policy(self, rows, idx, question_len):
        # Step 1 as the paper states it (an ablation here), with the released code's h: select the
        # child whose hidden vector is closer in cosine to the question's; no question: the right
        n, dev, h = rows.shape[0] // idx.shape[0], rows.device, self.hidden_vectors
        no_question = (question_len == 0).repeat_interleave(n).tolist()
        asked = h(idx, question_len.clamp(min=1).to(dev)).repeat_interleave(n, 0)   # (B*n, dim)

        def select(lefts, rights):   # each tree's two children, (start, end) each
            tokens = gather_spans(rows, [*range(len(lefts))] * 2, lefts + rights)      # (2R, L)
            left, right = h(tokens, to_device([e - s for s, e in lefts + rights], dev)).view(
                2, len(lefts), -1)                                                     # (R, dim)
            closer = F.cosine_similarity(asked, right, -1) > F.cosine_similarity(asked, left, -1)
            return [r or nq for r, nq in zip(closer.tolist(), no_question)]
        return select

    @torch.no_grad()   # (a discrete choice: no gradient flows through it)
    def hidden_vectors(self, tokens, lengths):
        # h (Sec. 3.2): "a short forward pass through one self-attention layer" at the last place;
        # as released: block 0 with its MLP, the final norm. tokens (R, L), lengths (R,) -> (R, dim)
        llama, pos = self.upper, torch.arange(tokens.shape[1], device=tokens.device)
        x = llama.layers[0](llama.tok_embeddings(tokens), llama.rope(pos))
        return llama.norm(x[torch.arange(len(x), device=x.device), lengths - 1])

    def encode_nodes(self, rows, nodes):
        # Step 3 (Sec. 3.2): each preserved node, a sequence of its own, through the lower model's
        # M layers, each layer's K (rotated) and V kept at tree.kept_positions (lower_kv says it,
        # lower_kv_kept runs it). A level's nodes go through together, ENCODE_TOKENS a call, padded
        # (lengths differ across trees); each keeps the level's count, so kept_at is rectangular.
        # -> per layer (K, V), each (R * KVs a chunk, Hkv, hd), row by row in text order
        (R, C), M = rows.shape, self.scfg.n_lower   # the lower model: the upper's bottom M layers
        kept, order_key = [([], []) for _ in range(M)], []   # each layer's K, V; a sort key
        for level in range(1, self.scfg.height + 1):
            at_level = [(r, nd) for r, nds in enumerate(nodes) for nd in nds if nd.level == level]
            per_call = max(1, ENCODE_TOKENS // max(len(nd) for _, nd in at_level))
            for i in range(0, len(at_level), per_call):
                group = at_level[i:i + per_call]                          # (row, Node) pairs
                tokens = gather_spans(rows, [r for r, _ in group],
                                      [(nd.start, nd.end) for _, nd in group])     # (R, L)
                kept_at = to_device([tree.kept_positions(len(nd), nd.n_kept, self.scfg.keep)
                                     for _, nd in group], rows.device)            # (R, n_kept)
                for j, kv in enumerate(lower_kv_kept(self.upper, tokens, M, kept_at)):
                    for out, t in zip(kept[j], kv):                    # (R, Hkv, n_kept, hd)
                        out.append(t.transpose(1, 2).flatten(0, 1))    # (R * n_kept, Hkv, hd)
                order_key += [r * C + nd.start + t for r, nd in group for t in range(nd.n_kept)]
        order = to_device(order_key, rows.device).argsort()   # row, node start, index: text order
        return [(torch.cat(ks)[order], torch.cat(vs)[order]) for ks, vs in kept]

    def chunk_level_kv(self, kv, nodes, B, n):
        # Step 4 (Eq. 2): each chunk's K/V side by side, its keys rotated by its chunk id i, every
        # X_D query by one id n (chunk_positions). Ours: random ids in training. Left open by the
        # paper: a key arrives rotated by its place p in its node (lower_kv): rotations add, so at
        # i + p: Eq. 2's "queries last" holds for the ids, not the angles. kv: encode_nodes', per
        # layer (K, V), each (B * n * S, Hkv, hd) -> Memory, its kv each (B, Hkv, n * S, hd)
        S = sum(nd.n_kept for nd in nodes[0])                # KVs kept per chunk (every chunk's)
        ids = chunk_positions(self.scfg, B, n, kv[0][0].device, self.training)   # (B, n + 1)
        kv = [[t.view(B, -1, *t.shape[1:]).transpose(1, 2) for t in KV] for KV in kv]   # B,Hkv,.,hd
        k_rope = [t[:, None] for t in self.upper.rope(ids[:, :n].repeat_interleave(S, dim=1))]
        q_rope = tuple(t[:, None, None] for t in self.upper.rope(ids[:, n]))   # (B, 1, 1, hd)
        return Memory([(apply_rope(K, *k_rope), V) for K, V in kv], q_rope, nodes)


def chunk_positions(scfg, B, n, device, training):
    # Eq. 2's chunk-level position ids, (B, n + 1): chunk i's keys at [:, i], the X_D queries at
    # [:, n]. "plain" (the paper): 0..n. "off": all 0, so no chunk is told from another. "random"
    # (ours; plain at inference): in training, n sorted distinct ids below a span n ((max + 1) /
    # n)^u, u uniform in [0, 1) (near, as at inference, is common; far is seen), the queries one
    # past the last: every distance trains (Ruoss et al., 2023). E.g. n = 3, span 5: ids 0 2 4, 5.
    if scfg.chunk_pos == "off":
        return torch.zeros(B, n + 1, dtype=torch.long, device=device)
    if scfg.chunk_pos == "plain" or not training:
        return torch.arange(n + 1, device=device).expand(B, n + 1)
    assert n <= scfg.max_chunk_id, f"{n} chunks need ids up to {n}: max_chunk_id"
    span = (n * ((scfg.max_chunk_id + 1) / n) ** torch.rand(B, 1, device=device)).long()
    draw = torch.rand(B, scfg.max_chunk_id, device=device)   # ids at or past span: never drawn
    draw.masked_fill_(torch.arange(scfg.max_chunk_id, device=device) >= span, 2.0)
    ids = draw.argsort(dim=1)[:, :n].sort(dim=1).values                            # (B, n)
    return torch.cat([ids, ids[:, -1:] + 1], dim=1)


def lower_kv(llama, tokens, n_layers, kept_at):
    # Step 3 for R nodes (R, L), each a sequence of its own at positions 0..L-1, through the lower
    # model's bottom n_layers blocks (Block.forward) -> per layer, the K (rotated) and V its
    # self-attention reads, at kept_at (R, n_kept): (R, Hkv, n_kept, hd) each, one gather.
    rope = llama.rope(torch.arange(tokens.shape[1], device=tokens.device))
    kept = lambda t: t.gather(2, kept_at[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
    x, out = llama.tok_embeddings(tokens), []                            # (R, L, dim)
    for i, block in enumerate(llama.layers[:n_layers]):
        k, v = block.attention.kv(block.attention_norm(x), *rope)        # (R, Hkv, L, hd) each
        out.append((kept(k), kept(v)))                                   # (R, Hkv, n_kept, hd)
        if i < n_layers - 1:   # nothing reads the top block's output
            x = block(x, rope)
    return out


def lower_kv_kept(llama, tokens, n_layers, kept_at):
    # lower_kv with less work (what runs; ours, for speed: the default run took 5 min 6 s, not
    # 7 min 49 s, at a385285; tested equal). Only the kept K/V leave the lower model; M = n_layers:
    #   blocks 0 .. M-3: Block.forward over every token, written out (their K, V are kept too);
    #   block M-2: its K, V over every token, its queries and FFN at the kept tokens only;
    #   block M-1: its K, V at the kept tokens only (nothing reads its output).
    L = tokens.shape[1]
    rope = llama.rope(torch.arange(L, device=tokens.device))
    rope_kept = tuple(t[kept_at][:, None] for t in rope)                 # (R, 1, n_kept, hd)
    at_kept = lambda t: t.gather(1, kept_at[:, :, None].expand(-1, -1, t.shape[2]))  # (R,L,d)->kept
    kept = lambda t: t.gather(2, kept_at[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
    x, out = llama.tok_embeddings(tokens), []
    for i, block in enumerate(llama.layers[:n_layers - 1]):   # every block but the top one
        att, h = block.attention, block.attention_norm(x)   # Block.forward, written out: its K, V
        k, v = att.kv(h, *rope)                                          # (R, Hkv, L, hd) each
        out.append((kept(k), kept(v)))                                   # (R, Hkv, n_kept, hd)
        if i < n_layers - 2:
            x = x + att.wo(merge_heads(attention(apply_rope(split_heads(
                att.wq(h), att.n_heads, att.head_dim), *rope), k, v, causal=True)))
        else:   # the block below the top: its output is read at the kept tokens only
            q = apply_rope(split_heads(att.wq(at_kept(h)), att.n_heads, att.head_dim),
                           *rope_kept)                                   # (R, Hq, n_kept, hd)
            sees = kept_at[:, None, :, None] >= torch.arange(L, device=x.device)  # R,1,n_kept,L
            x = at_kept(x) + att.wo(merge_heads(attention(q, k, v, causal=False, mask=sees)))
        x = x + block.feed_forward(block.ffn_norm(x))
    top = llama.layers[n_layers - 1]   # (with M = 1, x is still every token's)
    out.append(top.attention.kv(top.attention_norm(x if n_layers > 1 else at_kept(x)), *rope_kept))
    return out


def to_device(values, device):   # a host list, sent without waiting for queued GPU work
    return torch.tensor(values).to(device, non_blocking=True)


def gather_spans(rows, row_ids, spans):
    # rows: (R0, C) tokens; spans[i] = (start, end) in rows[row_ids[i]] -> (R, L) tokens, padded
    # by repeating each span's last token (every reader is causal: padding changes nothing)
    dev, C, lens = rows.device, rows.shape[1], [e - s for s, e in spans]
    starts = to_device([r * C + s for r, (s, _) in zip(row_ids, spans)], dev)[:, None]
    steps = torch.minimum(torch.arange(max(lens), device=dev), to_device(lens, dev)[:, None] - 1)
    return rows.reshape(-1)[starts + steps]


# Step 1, ours, in every recipe: each tree heads for where the context repeats the question, no
# weights read. lexical_targets states the rule, lexical_targets_batched runs it (tested equal).
NGRAM_MAX = 8   # the longest run of question tokens that votes (others: docs/results.md)


def lexical_targets(context, question, C):
    # context, question: lists of token ids -> per chunk of C tokens, the position its tree heads
    # for. Each run of k <= NGRAM_MAX tokens in the question Q has one vote, late = where its last
    # copy ends in Q over |Q| (a question ends with its cue, "The pass key is"), shared by its
    # `count` copies in the context; score[t] sums the votes of the runs ending at t, in units of
    # 2^-20: integer sums are exact in any order, so this and the batched version tie alike.
    score = [0] * len(context)
    for k in range(1, NGRAM_MAX + 1):
        runs = [tuple(context[t - k + 1:t + 1]) for t in range(k - 1, len(context))]
        count, late = Counter(runs), {tuple(question[i - k + 1:i + 1]): (i + 1) / len(question)
                                      for i in range(k - 1, len(question))}   # the last place wins
        for t, run in enumerate(runs, start=k - 1):
            score[t] += round(2 ** 20 * late.get(run, 0) / count[run])
    # The answer follows its cue: a position's evidence is the score of the W = |Q|/4 tokens before
    # it, across chunk borders; a tree heads for its chunk's first position with the most (none:
    # C - 1, right at every level). E.g. Q = 3 9 4 5, chunk 7 3 9 4 5 8 2 6: scores .25 1 2.25 4
    # at 3 9 4 5, W = 1: the 8 wins.
    W = max(1, len(question) // 4)
    evidence = [sum(score[max(0, p - W):p]) for p in range(len(context))]
    chunks = [evidence[c:c + C] for c in range(0, len(context), C)]
    return [e.index(max(e)) if max(e) > 0 else C - 1 for e in chunks]


def lexical_targets_batched(rows, idx, question_len, vocab_size):
    # lexical_targets for each sample at once (ours, for speed): rows (B*n, C) its chunks, idx
    # (B, T) its question first -> per row, its target. A run is one integer, J = 1 + where its last
    # copy ends in Q (0: Q lacks it), so counts and votes are a scatter and a gather. It is equal:
    # - a place in Q ends one run of each length k, so J names a run. The run of k tokens ending
    #   at t is (the run of k - 1 ending at t - 1, t's token): a pair of J's, as one integer, key =
    #   J_1 + (T + 1) J_k-1 (J is in 0..T), which a table made from Q maps to J_k;
    # - a place of Q enters the table only if Q holds its k - 1 prefix (key > T); J = 0 votes
    #   nothing (late.get(run, 0)); a J no context run has divides by a zero count (never gathered).
    # E.g. Q = 1 2 9 (T = 3): J_1 = 1 2 3; "1 2" is key 2 + 4 * 1 = 6, mapped to J_2 = 2. Context
    # 5 1 2 1 2: J_1 = 0 1 2 1 2; key 6 twice, so "1 2" votes 2/3 shared by 2. At the first 1, key
    # 1 + 4 * 0 = 1 is Q's first place's, kept out of the table: else "5 1" would vote as Q's run.
    (R, C), B, dev = rows.shape, idx.shape[0], rows.device
    T, q_len = int(question_len.max()), question_len.to(dev)[:, None]   # (T: on the host)
    ctx, q, at = rows.reshape(B, -1), idx[:, :T], torch.arange(T + 1, device=dev)
    N, place = ctx.shape[1], at[1:] * (at[:-1] < q_len)       # (B, T): 1 + place; 0 past |Q|
    last = torch.zeros(B, vocab_size, dtype=torch.long, device=dev).scatter_reduce_(
        1, q, place, "amax")                                   # (B, vocab): a token's J_1
    tok_q, tok_c = last.gather(1, q), last.gather(1, ctx)     # J_1 at each place: (B, T), (B, N)
    J_q, J_c, score = F.pad(tok_q, (1, 0)), F.pad(tok_c, (1, 0)), 0   # J[:, t + 1]: t's; T+1, N+1
    for k in range(1, NGRAM_MAX + 1):
        if k > 1:   # (the J of the k - 1 tokens before, this token's J) -> this run's J
            key_q, key_c = (torch.add(tok, J[:, :-1], alpha=T + 1)
                            for tok, J in ((tok_q, J_q), (tok_c, J_c)))
            table = torch.zeros(B, (T + 1) ** 2, dtype=torch.long, device=dev).scatter_reduce_(
                1, key_q, place * (key_q > T), "amax")                # (B, (T + 1)^2)
            torch.gather(table, 1, key_q, out=J_q[:, 1:])
            torch.gather(table, 1, key_c, out=J_c[:, 1:])
        # a run's vote, late = J / |Q|, shared by its occurrences in X_C: the positions with its J
        count = torch.zeros(B, T + 1, device=dev).scatter_add_(
            1, J_c[:, 1:], torch.ones(B, N, device=dev))          # (B, T + 1): per J
        vote = (2 ** 20 * at / q_len.double() / count).round().long().masked_fill(at == 0, 0)
        score = score + vote.gather(1, J_c[:, 1:])                      # (B, N)
    cum, W = F.pad(score.cumsum(1), (1, 0)), (q_len // 4).clamp(min=1)   # cum[:, p]: before p
    evidence = cum[:, :N] - cum.gather(1, (torch.arange(N, device=dev) - W).clamp(min=0))
    return torch.where(evidence.view(R, C).amax(1) > 0, evidence.view(R, C).argmax(1),
                       C - 1).tolist()
