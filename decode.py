"""
Decoding with a KV cache, for a model.Llama alone or for SharedLLM's upper model reading a
compressed context (memory: what SharedLLM.compress returns, computed once before decoding).

  tokens = decode.generate(llama, idx, 20)                         # greedy
  for tok in decode.stream(model.upper, idx, 20, memory=memory, temperature=0.8, top_p=0.9): ...
"""
import torch


class KVCache:
    # one layer's self-attention keys/values, preallocated for max_len positions and filled in
    # order: (B, Hkv, max_len, hd). model.SelfAttention.forward calls update().
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


def new_caches(llama, batch, max_len):
    # one KVCache per layer of a model.Llama
    p, c = llama.output.weight, llama.cfg
    return [KVCache(batch, c.n_kv_heads, max_len, c.head_dim, p.device, p.dtype)
            for _ in llama.layers]


@torch.no_grad()
def stream(llama, idx, max_new_tokens, temperature=0.0, top_k=None, top_p=None, memory=None,
           eos_id=None):
    # prefill idx (B, T), then yield one (B, 1) token at a time, decoding with the KV cache
    B, T = idx.shape
    caches = new_caches(llama, B, T + max_new_tokens)
    logits, _ = llama(idx, caches=caches, memory=memory)                      # prefill
    for pos in range(T, T + max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p)
        yield nxt
        if (eos_id is not None and (nxt == eos_id).all()) or pos == T + max_new_tokens - 1:
            break
        logits, _ = llama(nxt, start_pos=pos, caches=caches, memory=memory)   # one at a time


def generate(llama, idx, max_new_tokens, **sampling):
    # idx (B, T) -> (B, T + max_new_tokens) (fewer if every row reached eos_id)
    return torch.cat([idx, *stream(llama, idx, max_new_tokens, **sampling)], dim=1)


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
