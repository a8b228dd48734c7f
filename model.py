"""
LLaMA in one file, and SharedLLM ("Two Are Better than One", ICLR 2025) built on top of it.

One LLaMA checkpoint gives two models. The LOWER model (the bottom M layers) compresses the past
context X_C, cut into chunks of C tokens: each chunk is a context tree (tree.py), and each preserved
node keeps a few of its per-layer key/value states, coarse for big nodes, fine for small ones. The
UPPER model (the whole LLaMA) reads the running text X_D and, in its bottom M layers, cross-attends
to them with chunk-level position ids. SharedLLM.compress runs the paper's steps: the tree's
split-and-search (2) with the search policy inside it (1), encoding (3), chunk position ids (4).
Beyond the paper, in every recipe: the search matches the question's words in the context
(lexical_policy), and training draws random chunk ids (chunk_positions).
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import tree

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None
ENCODE_TOKENS = 4096   # step 3 encodes the preserved nodes in calls of about this many tokens

# ------------------------------------------------------------------------------------------------
# LLaMA

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
        assert self.n_heads % self.n_kv_heads == 0, \
            f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
        assert self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, cast back, then scale: HF's order, so bf16 results agree too
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


# RoPE with explicit position ids (SharedLLM adds one id per chunk, Step 4). A rotated pair is
# the two halves (x_i, x_{i+hd/2}), as HF checkpoints store wq/wk (Meta's: interleaved pairs).
def rope_cos_sin(pos, head_dim, theta):
    # pos: integer tensor (...) -> cos, sin: (..., head_dim) each, fp32
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
    # softmax(q k^T / sqrt(hd)) v (tests/test_llama.py writes it out). q: (B, Hq, Tq, hd); k, v:
    # (B, Hkv, Tk, hd), Hkv dividing Hq (grouped-query). causal with Tq < Tk: the queries are the
    # LAST Tq positions. mask: (B, 1, Tq, Tk), True where a query may read a key (lower_kv_kept).
    # flash-attn where it runs (installed, CUDA, half precision, no mask), else PyTorch's SDPA.
    half = q.dtype in (torch.float16, torch.bfloat16)
    if flash_attn_func is not None and q.is_cuda and half and mask is None:
        # wants (B, T, H, hd), aligns causal masks bottom-right, does GQA
        y = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        return y.transpose(1, 2)
    Tq, Tk = q.shape[2], k.shape[2]
    if causal and Tq != Tk:  # bottom-right aligned: query i sits at key position i + Tk - Tq
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          is_causal=causal and mask is None,
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

    def query(self, x, rope):
        # x: (B, T, dim); rope: (cos, sin) of its positions -> Q (rotated): (B, Hq, T, hd)
        return apply_rope(split_heads(self.wq(x), self.n_heads, self.head_dim), *rope)

    def kv(self, x, cos, sin):
        # x: (B, T, dim) -> K (rotated), V: (B, Hkv, T, hd) each
        k = split_heads(self.wk(x), self.n_kv_heads, self.head_dim)
        v = split_heads(self.wv(x), self.n_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x, rope, cache=None):
        # x: (B, T, dim); rope: (cos, sin) of its positions; cache: decode.KVCache or None
        q = self.query(x, rope)
        k, v = self.kv(x, *rope)
        if cache is not None:   # decoding: the queries are the LAST T positions of the cache
            k, v = cache.update(k, v)
        return self.wo(merge_heads(attention(q, k, v, causal=True)))


class CrossAttention(nn.Module):
    # Upper layer -> compressed context (Eq. 3). A query and an output projection of its own, and
    # no key/value projections: K/V are the lower model's self-attention K (rotated) and V.
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, k, v, q_rope):
        # x: (B, T, dim); k, v: a lower layer's compressed context, (B, Hkv, all kept KVs, hd);
        # q_rope: the queries' rotation to their chunk id, or None. No mask: X_C precedes X_D.
        q = split_heads(self.wq(x), self.n_heads, self.head_dim)   # (B, Hq, T, hd)
        if q_rope is not None:
            q = apply_rope(q, *q_rope)
        return self.wo(merge_heads(attention(q, k, v, causal=False)))


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

    def forward(self, x, rope, cache=None, cross=None):
        # self-attention, then cross-attention (the bottom M layers of the upper model), then MLP
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
        # idx: (B, T) token ids at positions start_pos.. (X_D starts at 0); memory: a compressed
        # context (SharedLLM.compress) or None; last: logits for the last `last` positions only
        T = idx.shape[1]
        assert caches is None or caches[0].length == start_pos, \
            "decode positions in order: start_pos = cache length"
        rope = self.rope(torch.arange(start_pos, start_pos + T, device=idx.device))
        x = self.tok_embeddings(idx)
        for i, layer in enumerate(self.layers):
            cross = None
            if memory is not None and layer.cross_attention is not None:   # reads lower layer i
                cross = (*memory.kv[i], memory.q_rope)
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

# ------------------------------------------------------------------------------------------------
# SharedLLM

@dataclass
class SharedConfig:
    # The method's settings. Defaults: train.py's recipe, except M and C, the paper's LLaMA-2 sizes.
    n_lower: int = 4        # M: lower-model layers = upper cross-attention layers (paper: 4, 16)
    chunk_size: int = 1024  # C: tokens per context chunk (paper: 1024 LM, 512 SFT)
    height: int = 3         # h: levels of the context tree below the root
    beta: float = 8.0       # the overall compression: C / (KVs kept per chunk)
    policy: str = "lexical"   # pi, step 1: "lexical" (ours); "vector" (the paper's), "right"
    sigma: float = 0.0      # split noise in training, a fraction of l (Table 6: l/5 = 0.2; tree.py)
    chunk_pos: str = "random"   # Eq. 2: "random" (ours), "plain" (paper), "off"; chunk_positions
    max_chunk_id: int = 1024   # "random": the largest id drawn in training
    keep: str = "last"      # which token of each stride window is kept: "last" (ours) or "first"

    def __post_init__(self):   # a setting the model refuses, named in one line
        for name, allowed in [("policy", ("lexical", "vector", "right")), ("keep", ("last",
                              "first")), ("chunk_pos", ("random", "plain", "off"))]:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")
        if not (self.n_lower >= 1 and self.height >= 1 and self.sigma >= 0
                and self.chunk_size >> self.height >= 1
                and 1 <= self.beta <= self.chunk_size / (self.height + 1)):
            # (a tree of height h keeps at least one KV in each of its h + 1 nodes)
            raise ValueError(f"{self}: needs M >= 1, h >= 1, sigma >= 0, C >= 2^h and "
                             f"1 <= beta <= C / (h + 1)")


@dataclass
class Memory:
    # A compressed context: what the upper model's cross-attention reads.
    kv: list        # per lower layer: (K, V), each (B, Hkv, n * KVs kept per chunk, hd)
    q_rope: tuple   # the X_D queries' rotation (cos, sin), (B, 1, 1, hd) each; None: no chunk ids
    nodes: list = field(default_factory=list)   # per (batch item, chunk): its preserved tree.Nodes


class SharedLLM(nn.Module):
    def __init__(self, llama, scfg):
        super().__init__()
        cfg, m = llama.cfg, scfg.n_lower
        if m > cfg.n_layers:
            raise ValueError(f"n_lower (M) = {m}; the model has {cfg.n_layers} layers")
        # the lower model is the upper's own bottom M layers (the same weights): one checkpoint
        self.scfg, self.upper = scfg, llama
        p = llama.output.weight
        for blk in llama.layers[:m]:   # the bottom M layers cross-attend: layer i reads lower i
            blk.cross_norm = RMSNorm(cfg.dim, cfg.norm_eps).to(p.device, p.dtype)
            blk.cross_attention = CrossAttention(cfg).to(p.device, p.dtype)
            # Ours: the layer's own norm and query, and a zero output projection. An untrained
            # SharedLLM returns exactly its base LLaMA's output: training only adds to it.
            with torch.no_grad():
                blk.cross_norm.weight.copy_(blk.attention_norm.weight)
                blk.cross_attention.wq.weight.copy_(blk.attention.wq.weight)
                blk.cross_attention.wo.weight.zero_()

    @classmethod
    def from_llama(cls, llama, **shared_config):
        # both models from one checkpoint: SharedLLM.from_llama(load_llama(dir), n_lower=4, ...)
        return cls(llama, SharedConfig(**shared_config))

    def forward(self, context, idx, targets=None, question_len=None):
        # context: (B, n, C) or None; idx, targets: (B, T) -> logits (B, T, vocab), loss
        empty = context is None or context.shape[1] == 0
        memory = None if empty else self.compress(context, idx, question_len)
        return self.upper(idx, targets, memory=memory)

    def compress(self, context, idx=None, question_len=None):
        # Sec. 3.2-3.3, one step a line below; step 1 (the policy) runs inside step 2. context:
        # (B, n, C) tokens of X_C; idx: (B, T) the running text X_D; question_len: (B,) the
        # question's length at the start of X_D (None or 0: no question)
        B, n, C = context.shape
        if C != self.scfg.chunk_size:
            raise ValueError(f"context chunks have {C} tokens; this model's chunk_size C is "
                             f"{self.scfg.chunk_size}")
        rows = context.reshape(B * n, C)                  # one context tree per (batch item, chunk)
        if question_len is not None:   # on the host: the policies choose from it there
            question_len = torch.as_tensor(question_len).cpu()
        # 1. the query-aware policy pi, which tree.search calls at each level
        select = self.search_policy(rows, idx, question_len)
        # 2. split-and-search (Eq. 1, Algorithm 1): the preserved nodes, KVs kept by each
        sigma = self.scfg.sigma if self.training else 0.0
        nodes = tree.search(B * n, C, self.scfg.height, self.scfg.beta, select, sigma)
        # 3. each preserved node through the lower model: its kept K/V of every layer
        kv = self.encode_nodes(rows, nodes)
        # 4. chunk-level position ids (Eq. 2), for the upper model's CrossAttention
        return self.chunk_level_kv(kv, nodes, B, n)

    def search_policy(self, rows, idx, question_len):
        # Step 1 (Sec. 3.2) -> select(lefts, rights) for tree.search, or None: the right child
        # everywhere (the paper's language modeling, and any batch with no question)
        asked = question_len is not None and bool((question_len > 0).any())
        if self.scfg.policy == "right" or not asked:
            return None
        if self.scfg.policy == "lexical":   # ours, every recipe's
            return lexical_policy(rows, idx, question_len)
        return self.vector_policy(rows, idx, question_len)

    def vector_policy(self, rows, idx, question_len):
        # Step 1 as the paper states it (an ablation here): select the child whose hidden vector
        # (lower model) is closer in cosine to the question's (upper model); its h: hidden_vectors.
        # A tree of a sample with no question selects the right child.
        low, n = self.upper, rows.shape[0] // idx.shape[0]   # (lower: its bottom layers)
        no_question = (question_len == 0).repeat_interleave(n).tolist()
        with torch.no_grad():   # a discrete choice: no gradient flows through it
            ends = question_len.clamp(min=1).to(idx.device)         # the question: idx[b, :end]
            asked = hidden_vectors(self.upper, idx, ends).repeat_interleave(n, dim=0)  # (B*n, dim)

        def select(lefts, rights):   # each tree's two children, (start, end) each
            with torch.no_grad():
                spans = lefts + rights
                tokens = gather_spans(rows, [*range(len(lefts))] * 2, spans)        # (2R, L)
                lengths = to_device([e - s for s, e in spans], rows.device)
                h = hidden_vectors(low, tokens, lengths).view(2, len(lefts), -1)   # (2, R, dim)
            closer = (F.cosine_similarity(asked, h[1], dim=-1)
                      > F.cosine_similarity(asked, h[0], dim=-1))
            return [r or nq for r, nq in zip(closer.tolist(), no_question)]
        return select

    def encode_nodes(self, rows, nodes):
        # Step 3 (Sec. 3.2): each preserved node, as a sequence of its own, through the lower
        # model's M layers; each layer's K (rotated) and V kept at tree.kept_positions: lower_kv
        # says it, lower_kv_kept runs it. A level's nodes have one KV count and about one length
        # (padded to the longest): they go through together, about ENCODE_TOKENS tokens a call.
        # rows: (B*n, C); nodes: per row, its preserved Nodes -> per layer (K, V), each
        # (B*n*kv_per_chunk, Hkv, hd), row by row
        low, n_lower = self.upper, self.scfg.n_lower   # the lower model: its bottom M layers
        kept, encoded = [([], []) for _ in range(n_lower)], []   # per layer: each call's K, V
        for level in range(1, self.scfg.height + 1):
            at_level = [(r, nd) for r, nds in enumerate(nodes) for nd in nds if nd.level == level]
            per_call = max(1, ENCODE_TOKENS // max(len(nd) for _, nd in at_level))
            for i in range(0, len(at_level), per_call):
                group = at_level[i:i + per_call]                          # (row, Node) pairs
                tokens = gather_spans(rows, [r for r, _ in group],
                                      [(nd.start, nd.end) for _, nd in group])     # (R, L)
                kept_at = to_device([tree.kept_positions(len(nd), nd.n_kept, self.scfg.keep)
                                     for _, nd in group], rows.device)            # (R, n_kept)
                for j, kv in enumerate(lower_kv_kept(low, tokens, n_lower, kept_at)):
                    for out, t in zip(kept[j], kv):                    # (R, Hkv, n_kept, hd)
                        out.append(t.transpose(1, 2).flatten(0, 1))    # (R * n_kept, Hkv, hd)
                encoded += group
        order = to_device(text_order(nodes, encoded), rows.device)
        return [(torch.cat(ks)[order], torch.cat(vs)[order]) for ks, vs in kept]

    def chunk_level_kv(self, kv, nodes, B, n):
        # Step 4 (Eq. 2): each chunk's kept K/V side by side; the keys of chunk i rotated by its
        # chunk id i, every X_D query by one id n (chunk_positions), not by its place in X_D.
        # Ours, two things beyond Eq. 2. Training draws random ids (chunk_positions). And a key
        # arrives already rotated by its place p in its node (lower_kv); two rotations add, so
        # it sits at i + p, not at i: Eq. 2's "queries last" holds for the ids, not the angles.
        # kv: per layer (K, V), each (B*n*kv_per_chunk, Hkv, hd), row by row
        kv_per_chunk = sum(nd.n_kept for nd in nodes[0])     # the same for every chunk
        k_pos, q_pos = chunk_positions(self.scfg, B, n, kv[0][0].device, self.training)
        k_rope = q_rope = None
        if k_pos is not None:
            per_key = k_pos.repeat_interleave(kv_per_chunk, dim=1)          # (B, n*kv_per_chunk)
            k_rope = [t[:, None] for t in self.upper.rope(per_key)]         # (B, 1, ., hd)
            q_rope = tuple(t[:, None, None] for t in self.upper.rope(q_pos))   # (B, 1, 1, hd)
        out = []
        for K, V in kv:
            K, V = (t.view(B, -1, *t.shape[1:]).transpose(1, 2) for t in (K, V))   # (B, Hkv, ., hd)
            out.append((K if k_rope is None else apply_rope(K, *k_rope), V))
        return Memory(out, q_rope, nodes)


def text_order(nodes, encoded):
    # The KVs encode_nodes' calls return, in `encoded` order (row, Node pairs, level by level) ->
    # the index of each KV there, row by row and each row's nodes in text order, as memory.nodes
    # lists them. Cross-attention reads them in any order; sample.py's picture maps KVs to nodes.
    first, n_before = {}, 0
    for r, nd in encoded:
        first[r, nd.start], n_before = n_before, n_before + nd.n_kept
    return [first[r, nd.start] + t for r, nds in enumerate(nodes) for nd in nds
            for t in range(nd.n_kept)]


def chunk_positions(scfg, B, n, device, training):
    # Eq. 2's chunk-level position ids -> the keys' (B, n), the queries' (B,); Nones for "off".
    # "plain" (the paper): the keys of chunk i at i, the X_D queries at n. "random" (ours; plain
    # at inference): in training, n sorted distinct ids below a span log-uniform in n..max_chunk_id,
    # the queries one past the last: every scale of distance is seen (Ruoss et al., 2023).
    if scfg.chunk_pos == "off":
        return None, None
    if scfg.chunk_pos == "random" and training:
        if n > scfg.max_chunk_id:
            raise ValueError(f"{n} chunks need chunk ids up to {n}; "
                             f"max_chunk_id is {scfg.max_chunk_id}")
        u = torch.rand(B, 1, device=device)
        span = (n * ((scfg.max_chunk_id + 1) / n) ** u).long().clamp(n, scfg.max_chunk_id)  # (B,1)
        draw = torch.rand(B, scfg.max_chunk_id, device=device)   # ids at or past span: never drawn
        draw.masked_fill_(torch.arange(scfg.max_chunk_id, device=device)[None] >= span, 2.0)
        ids = draw.argsort(dim=1)[:, :n].sort(dim=1).values                        # (B, n)
        return ids, ids[:, -1] + 1
    ids = torch.arange(n + 1, device=device)
    return ids[:n].expand(B, n), ids[n].expand(B)


def lower_kv(llama, tokens, n_layers, kept_at):
    # Step 3 for R nodes (R, L), each a sequence of its own at positions 0..L-1, through the lower
    # model's bottom n_layers blocks (Block.forward) -> per layer, the K (rotated) and V its
    # self-attention reads, at kept_at (R, n_kept): (R, Hkv, n_kept, hd) each, one gather.
    # What runs is lower_kv_kept, the same with less work.
    rope = llama.rope(torch.arange(tokens.shape[1], device=tokens.device))
    x, out = llama.tok_embeddings(tokens), []                            # (R, L, dim)
    for i, block in enumerate(llama.layers[:n_layers]):
        k, v = block.attention.kv(block.attention_norm(x), *rope)        # (R, Hkv, L, hd) each
        out.append((at_kept_heads(k, kept_at), at_kept_heads(v, kept_at)))
        if i < n_layers - 1:   # nothing reads the top block's output
            x = block(x, rope)
    return out


def at_kept_heads(t, kept_at):   # (R, Hkv, L, hd) -> (R, Hkv, n_kept, hd): the kept positions
    return t.gather(2, kept_at[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def lower_kv_kept(llama, tokens, n_layers, kept_at):
    # lower_kv, with less work (ours, for speed: the default run takes a third less time; tested
    # equal). Only the kept K/V leave the top block, so it projects them at the kept tokens
    # alone, and the block below it runs its queries and its FFN at those tokens only.
    L = tokens.shape[1]
    rope = llama.rope(torch.arange(L, device=tokens.device))
    rope_kept = tuple(t[kept_at][:, None] for t in rope)                 # (R, 1, n_kept, hd)
    at_kept = lambda t: t.gather(1, kept_at[:, :, None].expand(-1, -1, t.shape[2]))  # (R,L,d)->kept
    x, out = llama.tok_embeddings(tokens), []
    for i, block in enumerate(llama.layers[:n_layers - 1]):   # every block but the top one
        att, h = block.attention, block.attention_norm(x)   # Block.forward, written out: its K, V
        k, v = att.kv(h, *rope)                                          # (R, Hkv, L, hd) each
        out.append((at_kept_heads(k, kept_at), at_kept_heads(v, kept_at)))
        if i < n_layers - 2:
            x = x + att.wo(merge_heads(attention(att.query(h, rope), k, v, causal=True)))
        else:   # the block below the top: its output is read at the kept tokens only
            q = att.query(at_kept(h), rope_kept)                         # (R, Hq, n_kept, hd)
            sees = kept_at[:, None, :, None] >= torch.arange(L, device=x.device)  # R,1,n_kept,L
            x = at_kept(x) + att.wo(merge_heads(attention(q, k, v, causal=False, mask=sees)))
        x = x + block.feed_forward(block.ffn_norm(x))
    top = llama.layers[n_layers - 1]   # (with M = 1, x is still every token's)
    out.append(top.attention.kv(top.attention_norm(x if n_layers > 1 else at_kept(x)), *rope_kept))
    return out


def hidden_vectors(llama, tokens, lengths):
    # The paper's h (Sec. 3.2): "a short forward pass through one self-attention layer", at the
    # last position; here the first block with its MLP (as released) and the final norm.
    # tokens: (R, L), right-padded; lengths: (R,) -> (R, dim)
    x = llama.tok_embeddings(tokens)
    x = llama.layers[0](x, llama.rope(torch.arange(tokens.shape[1], device=tokens.device)))
    return llama.norm(x[torch.arange(len(x), device=x.device), lengths - 1])


def to_device(values, device):
    # a host list sent without waiting for queued GPU work (as torch.tensor(.., device=) would)
    return torch.tensor(values).to(device, non_blocking=True)


def gather_spans(rows, row_ids, spans):
    # rows: (R0, C) tokens; spans[i] = (start, end) in rows[row_ids[i]] -> (R, L) tokens, padded
    # by repeating each span's last token (every reader is causal: padding changes nothing)
    dev, C = rows.device, rows.shape[1]
    lens = [e - s for s, e in spans]
    starts = to_device([r * C + s for r, (s, _) in zip(row_ids, spans)], dev)
    steps = torch.arange(max(lens), device=dev)[None]
    at = starts[:, None] + torch.minimum(steps, to_device(lens, dev)[:, None] - 1)
    return rows.reshape(-1)[at]


NGRAM_MAX = 8   # the longest run of tokens matched against the question


def lexical_policy(rows, idx, question_len):
    # Step 1. The paper selects the child more similar to the question (vector_policy, a cosine).
    # Ours, every recipe's: the similarity is lexical (the paper's Limitations name BM25), no
    # weights. Each context token scores the runs of up to NGRAM_MAX tokens ending at it that the
    # question holds, each log(N / its count in X_C): filler repeats, a needle's words do not; a
    # run that ends the question ("The pass key is") counts twice. The answer follows its cue:
    # position p's evidence is the score of the |Q|/4 tokens before it, and each tree selects
    # toward its chunk's first position of most evidence (none: right). rows: (B*n, C); idx: (B, T)
    (R, C), (B, T), dev = rows.shape, idx.shape, rows.device
    N, q_len = R // B * C, question_len.to(dev)
    seq = rows.reshape(B, N)                               # X_C in order, per sample
    at_q, at_seq = torch.arange(T, device=dev)[None], torch.arange(N, device=dev)[None]
    past_q = at_q >= q_len[:, None]                        # (B, T): X_D after the question
    sample = torch.arange(1, B + 1, device=dev)[:, None]   # a run's hash starts from its sample
    h_seq, h_q, score = sample.expand(B, N), sample.expand(B, T), torch.zeros(B, N, device=dev)
    for k in range(1, NGRAM_MAX + 1):   # the runs of k tokens ending at each position, hashed
        h_seq = h_seq.roll(1, 1) * 1000003 + seq + 1    # (int64 wraps around: still a hash)
        h_q = h_q.roll(1, 1) * 1000003 + idx + 1
        ctx_k = h_seq.masked_fill(at_seq < k - 1, -1)                        # (B, N): -1 no run
        q_k = h_q.masked_fill(past_q | (at_q < k - 1), -2)                    # (B, T)
        # each context run's count in X_C and whether the question holds it, by binary search in
        # the sorted runs: shapes known in advance, so a GPU never waits to learn a size
        in_ctx, in_q = ctx_k.flatten().sort().values, q_k.flatten().sort().values
        count = (torch.searchsorted(in_ctx, ctx_k, right=True)
                 - torch.searchsorted(in_ctx, ctx_k))                           # (B, N)
        asked = in_q[torch.searchsorted(in_q, ctx_k).clamp(max=in_q.numel() - 1)] == ctx_k
        rarity = torch.log(N / count.float())                                   # (B, N)
        ends_q = ctx_k == q_k.gather(1, (q_len[:, None] - 1).clamp(min=0))      # the question's end
        score += (asked.float() + ends_q.float()) * rarity
    W = (q_len // 4).clamp(min=1)[:, None]                                      # (B, 1)
    # the scores of [p - W, p), added in one order (a cumsum's rounding would break exact ties),
    # up to the largest W, read from the question lengths on the host: no wait for the device
    evidence = torch.zeros(B, N, device=dev)
    for j in range(1, max(1, int(question_len.max()) // 4) + 1):
        evidence += F.pad(score, (j, 0))[:, :N] * (j <= W)
    evidence = evidence.view(R, C)           # argmax: the first position of the most evidence
    # the one wait for the device in a compress: tree.search chooses on the host
    target = torch.where(evidence.amax(1) > 0, evidence.argmax(1), C - 1).tolist()

    def select(lefts, rights):   # each tree's two children, (start, end) each
        return [t >= rt[0] for t, rt in zip(target, rights)]
    return select
