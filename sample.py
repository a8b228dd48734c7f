"""
Answer from a compressed long context, nanoGPT's sample.py for SharedLLM. The context is cut into
chunks of C tokens, each chunk's tree is built and compressed once by the lower model, the prompt is
prefilled, and the answer is decoded token by token with the KV cache, streamed as it comes.

  python sample.py                                       # after python train.py: a fresh passkey
                                                         # haystack
  python sample.py --n_chunks=16 --show_tree=True        # a longer haystack, and what each
                                                         # tree kept
  python sample.py --plot=arch.png --attention=attn.png  # pictures: the method on this haystack,
                                                         # where the answer looks
  python sample.py --context=FILE:notes.txt --prompt="Q: ..." --max_new_tokens=64
  python sample.py --init_from=/path/to/llama --n_lower=4 --chunk_size=1024 --context=FILE:book.txt
"""
import os
import random
import re
import resource
import sys
import time

import torch

import data
import decode
import model as M
import plots
import tree
from configurator import auto_device, check_ranges, config_of, package_path, parse_overrides
from checkpoint import load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = "out"           # a train.py out_dir (or its ckpt.pt), or a LLaMA-2 folder in HF layout
context = ""                # the long context X_C: a string, or FILE:path; "" = a passkey haystack
                            # (the default task)
prompt = ""                 # the running text X_D (the question); "" = the passkey question
n_chunks = 4                # the generated haystack's length in chunks (context="" only)
key = 0                     # its 5-digit key; 0 = random
depth = -1.0                # where the key sits, 0 = start .. 1 = end of the context; -1 = random
max_new_tokens = 0          # 0 = until the haystack's key is complete (else 64 tokens)
temperature = 0.0           # 0 = greedy
top_k = 0                   # 0 = off
top_p = 1.0                 # 1.0 = off
show_tree = False           # print, per chunk, the path the query took and what each preserved node
                            # kept (past 8 chunks: the first two, the key's and the last two)
plot = ""                   # write a picture of the method on this context here (PNG): the chunks,
                            # the context tree of the key's chunk (else the last) with its kept KVs,
                            # the lower and upper models
attention = ""              # write the cross-attention weights of the answer's first token over
                            # every compressed KV here (PNG), per layer and head, the key's chunk
                            # and node marked; the text form is printed
# SharedLLM settings at inference (0 / "" = as trained; for a LLaMA-2 folder,
# model.SharedConfig's defaults)
n_lower = 0                 # M (LLaMA-2 folder only: a checkpoint's M is fixed by its
                            # cross-attention layers)
chunk_size = 0              # C (LLaMA-2 folder only: a checkpoint's C is fixed by its training)
height = 0                  # tree height h
beta = 0.0                  # compression C / KVs per chunk
policy = ""                 # "lexical" (every recipe's) | "vector" (the paper's vector) | "right"
                            # (retrieval off)
device = "auto"             # "auto" = cuda, else cpu ("mps" only when named)
dtype = "auto"              # "auto" = bfloat16 on CUDA where supported, else float32
seed = 1337
# -----------------------------------------------------------------------------


def free_memory_bytes(dev):
    if dev.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(dev))[0]
    try:   # MemAvailable counts reclaimable page cache; free pages alone would understate it
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def compress_bytes(model, n, wbytes):
    # what compressing n chunks holds at its peak: one tree level's nodes (at most n*C tokens)
    # through the lower model (hidden states, q/k/v, the MLP's 3 hidden-wide tensors, a few
    # temporaries) plus the kept KVs
    c, s = model.upper.cfg, model.scfg
    per_token = wbytes * (8 * c.dim + 3 * c.hidden_dim + 2 * s.n_lower * c.n_kv_heads * c.head_dim)
    return n * s.chunk_size * per_token


def tree_path(nodes, C):
    # which half the search expanded at each level, read back from the preserved nodes (one per
    # level, two leaves)
    lo, hi, path = 0, C, []
    for nd in sorted(nodes, key=lambda nd: (nd.level, nd.start))[:-2]:
        went_right = nd.start == lo
        path.append("right" if went_right else "left")
        lo, hi = (nd.end, hi) if went_right else (lo, nd.start)
    return " -> ".join(path + [f"leaves [{lo}, {hi})"])


@torch.no_grad()
def cross_attention_picture(model, memory, idx, path, key_chunk, mentions):
    # The weights with which the last prompt token (the one that predicts the answer's first token)
    # reads every compressed KV, in every cross-attention layer: softmax(q k^T / sqrt(hd)) from the
    # layer's own queries, captured in a forward pass over the prompt. Printed as text; drawn when
    # matplotlib is there. mentions: the context positions [start, end) of every mention of the key
    # (the needle names it twice); every node that holds one is marked, with the weight each head
    # puts on it.
    inputs, hooks = {}, []
    for i, blk in enumerate(model.upper.layers):
        if blk.cross_attention is not None:
            hooks.append(blk.cross_attention.register_forward_pre_hook(
                lambda m, a, i=i: inputs.__setitem__(i, a)))
    model.upper(idx, memory=memory)
    for h in hooks:
        h.remove()
    S = sum(nd.n_kept for nd in memory.nodes[0])                          # compressed KVs per chunk
    weights = []
    for i, (x, k, v, q_rope) in sorted(inputs.items()):   # CrossAttention.forward's arguments
        ca = model.upper.layers[i].cross_attention
        # the last query: (1, Hq, 1, hd)
        q = M.split_heads(ca.wq(x[:1, -1:]), ca.n_heads, ca.head_dim)
        # (Hq, hd)
        q = (q if q_rope is None else M.apply_rope(q, *[t[:1] for t in q_rope]))[0, :, 0]
        k = k[0].repeat_interleave(q.shape[0] // k.shape[1], dim=0)   # (Hq, n*S, hd)
        # (Hq, n*S)
        weights.append(((k.float() @ q.float()[:, :, None])[..., 0]
                        / q.shape[-1] ** 0.5).softmax(-1))
    key_nodes = mention_nodes(memory.nodes, model.scfg.chunk_size, S, mentions or [])
    for j, w in enumerate(weights):
        top = w.max(0).values.topk(min(3, w.shape[1])).indices.tolist()
        where = "" if key_chunk is None else ", on the key's chunk per head " + \
            " ".join(f"{m:.2f}" for m in w[:, key_chunk * S:(key_chunk + 1) * S].sum(1).tolist())
        print(f"cross-attention layer {j + 1}: the most-read KVs {top} "
              f"(chunk {', '.join(str(t // S) for t in top)}){where}")
        for label, kvs in key_nodes:
            print(f"  {label}: per head " + " ".join(f"{m:.2f}" for m in w[:, kvs].sum(1).tolist()))
    title = (f"the answer's first token reading {weights[0].shape[1]:,} compressed KVs "
             f"({len(weights)} cross-attention layers)")
    plots.attention(path, [w.tolist() for w in weights], S, key_chunk, key_nodes, title)
    return weights


def mention_nodes(nodes, C, S, mentions):
    # -> [(label, KV indices)]: every preserved node that holds (part of) a mention of the key, in
    # text order; the KVs of chunk c are c*S .. c*S + S - 1, node by node in the order memory.nodes
    # lists them
    out = []
    for c, chunk_nodes in enumerate(nodes):
        first = c * S
        for nd in chunk_nodes:
            held = [m + 1 for m, (a, b) in enumerate(mentions)
                    if a < c * C + nd.end and c * C + nd.start < b]
            if held:
                which = (f"mention {held[0]}" if len(held) == 1
                         else "mentions " + " and ".join(map(str, held)))
                kvs = f"KV {first}" if nd.n_kept == 1 else f"KVs {first}-{first + nd.n_kept - 1}"
                out.append((f"{which} of the key: chunk {c}'s node [{nd.start}, {nd.end}) = {kvs}",
                            list(range(first, first + nd.n_kept))))
            first += nd.n_kept
    return out


def check_settings(g):
    # the settings refused before the model is read (the context and prompt are checked as they
    # are read)
    inf = float("inf")
    check_ranges(g, dict(n_chunks=(1, inf), max_new_tokens=(0, inf), temperature=(0, inf),
                         top_k=(0, inf)))
    if not 0 < g["top_p"] <= 1:
        raise SystemExit(f"--top_p={g['top_p']}: expected a value in (0, 1]; 1 = off")
    if g["depth"] != -1 and not 0 <= g["depth"] <= 1:
        raise SystemExit(f"--depth={g['depth']}: expected -1 (random) or a value in [0, 1]")
    if g["key"] and not 10000 <= g["key"] <= 99999:
        raise SystemExit(f"--key={g['key']}: expected 0 (random) or a 5-digit key, 10000..99999")


def load_model(g, dev, dt):
    # -> (SharedLLM, tokenizer); the SharedLLM settings left at 0 / "" stay as trained
    shared = {k: g[k] for k in ("n_lower", "chunk_size", "height", "beta", "policy") if g[k]}
    try:
        model, tok, _ = load_sharedllm(package_path(g["init_from"]), dev, getattr(torch, dt),
                                       **shared)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise SystemExit(f"sample.py: --init_from={g['init_from']}: {e}") from None
    return model, tok


def passkey_haystack(g, tok, C):
    # -> (context ids, prompt ids, the key as text): n_chunks chunks of C tokens with the key
    # at --depth
    rng = random.Random(g["seed"])
    try:
        ctx, xd, _, qlen = data.passkey_sample(tok, rng, g["n_chunks"], C, key=g["key"] or None,
                                               depth=None if g["depth"] < 0 else g["depth"])
    except ValueError as e:
        raise SystemExit(f"sample.py: --n_chunks={g['n_chunks']}: {e}") from None
    ids = ctx.flatten().tolist()
    # the question as training and eval.py tokenize it (the key follows as in the needle), or your
    # own prompt
    prompt_ids = tok.encode(g["prompt"], bos=False) if g["prompt"] else xd[:qlen].tolist()
    text = tok.decode(ids)
    answer = re.search(r"The pass key is (\d+)", text).group(1)
    print(f"context: a passkey haystack, key {answer} at depth "
          f"{text.index('The pass key is') / len(text):.2f} of {len(ids):,} tokens")
    return ids, prompt_ids, answer


def own_context(g, tok):
    # -> (context ids, prompt ids) from --context (a string or FILE:path) and --prompt, which must
    # both be given
    text = g["context"]
    if text.startswith("FILE:"):
        path = package_path(text[5:])
        if not os.path.isfile(path):
            raise SystemExit(f"sample.py: --context={text}: no such file")
        try:
            text = open(path, encoding="utf-8").read()
        except UnicodeDecodeError as e:
            raise SystemExit(f"sample.py: --context={text}: not UTF-8 text "
                             f"(byte {e.object[e.start]:#04x} at offset {e.start}); "
                             "convert it first, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        raise SystemExit("sample.py: --context is empty; give a string or FILE:path")
    ids = tok.encode(text)
    if not g["prompt"]:
        raise SystemExit("sample.py: --prompt is empty; the running text X_D needs at least "
                         "one token")
    return ids, tok.encode(g["prompt"], bos=False)


def whole_chunks(ids, model, dev, dt):
    # -> (the newest n*C context ids, n): only whole chunks are compressed, and only if they fit in
    # free memory
    C = model.scfg.chunk_size
    n = len(ids) // C
    if n == 0:
        raise SystemExit(f"sample.py: the context has {len(ids)} tokens; at least one chunk of "
                         f"C = {C} tokens is needed (shorter text can go in --prompt)")
    # the oldest tokens do not fill a chunk: say so rather than pad with made-up text
    if len(ids) % C:
        print(f"note: the first {len(ids) % C} context tokens do not fill a chunk of {C} "
              "and are left out")
    ids = ids[len(ids) % C:]
    need, free = (compress_bytes(model, n, torch.finfo(getattr(torch, dt)).bits // 8),
                  free_memory_bytes(dev))
    if need > free:
        raise SystemExit(f"sample.py: compressing {len(ids):,} context tokens ({n} chunks of {C}) "
                         f"needs about {need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is free "
                         f"on {dev}: use a shorter context")
    return ids, n


def compress_context(model, context_t, idx, dev):
    # context_t (1, n, C), idx (1, T) -> the compressed memory, once for the whole answer; reports
    # what it kept
    s = model.scfg
    n, C = context_t.shape[1:]
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            memory = model.compress(context_t, idx, torch.tensor([idx.shape[1]], device=dev))
    except torch.OutOfMemoryError:
        raise SystemExit(f"sample.py: out of memory compressing {n * C:,} tokens on {dev}: "
                         "use a shorter context") from None
    t_compress = time.perf_counter() - t0
    kvs = memory.kv[0][0].shape[2]
    print(f"context {n * C:,} tokens = {n} chunks of C = {C} -> {kvs:,} compressed KVs per layer "
          f"(beta {n * C / kvs:g}), M = {s.n_lower} layers, height {s.height}, "
          f"policy {s.policy!r}; compressed in {t_compress * 1000:.0f} ms")
    return memory


def key_mentions(tok, answer, ids):
    # -> (the key's token ids, the context positions where they occur: the needle names the key
    # twice); both empty without a key. The ids are the answer's as the needle has them
    # (data.passkey_question), which a tokenizer that folds the space before the key into its first
    # token (GPT-2) makes different from the key encoded alone
    kid = data.passkey_question(tok, answer)[1] if answer else []
    return kid, [p for p, _ in data.key_mentions(ids, kid)] if kid else []


def pictures(g, model, memory, idx, n, kid, at_key):
    # --plot: the method on the key's chunk (else the last); --attention: where the answer's first
    # token reads
    s = model.scfg
    C = s.chunk_size
    key_chunk = at_key[0] // C if at_key else None
    if g["plot"]:
        c = n - 1 if key_chunk is None else key_chunk
        kvs = memory.kv[0][0].shape[2]
        inject = [i for i, blk in enumerate(model.upper.layers) if blk.cross_attention is not None]
        plots.architecture(g["plot"], memory.nodes[c], c, n, C, s.keep, s.n_lower,
                           model.upper.cfg.n_layers, inject, kvs // n,
                           [(p - c * C, min(p - c * C + len(kid), C))
                            for p in at_key if p // C == c])
    if g["attention"]:
        cross_attention_picture(model, memory, idx, g["attention"], key_chunk,
                                [(p, p + len(kid)) for p in at_key])


def show_trees(memory, n, C, keep, kid, at_key):
    # per chunk: the path the query took and what each preserved node kept (long contexts: the ends
    # and the key's)
    # long: a few
    shown = set(range(n)) if n <= 8 else {0, 1, n - 2, n - 1} | {p // C for p in at_key}
    for c, nodes in enumerate(memory.nodes):
        if c not in shown:
            if c - 1 in shown:
                print(f"... chunks {c} to {min(x for x in shown if x > c) - 1} not shown")
            continue
        here = [f"[{p - c * C}, {p - c * C + len(kid)})" for p in at_key
                if c * C <= p < (c + 1) * C]
        at = f"   <- the key at tokens {' and '.join(here)} of this chunk" if here else ""
        print(f"chunk {c} [{c * C}, {(c + 1) * C}): path {tree_path(nodes, C)}{at}")
        print(tree.describe(nodes, C, keep))


def stream_answer(g, model, tok, idx, memory, answer):
    # prefill the prompt idx (1, T) and decode with the KV cache, streaming the text
    # -> (new token ids, their text, prefill seconds, decode tokens/s)
    # a haystack's key: decoded until complete
    new = g["max_new_tokens"] or (4 * len(answer) if answer else 64)
    print(f"prompt: {g['prompt'] or data.QUESTION!r}\n---")
    sys.stdout.write(tok.decode(idx[0].tolist()))
    out, shown, t1 = [], "", None
    t0 = time.perf_counter()
    for nxt in decode.stream(model.upper, idx, new, memory=memory, temperature=g["temperature"],
                             top_k=g["top_k"] or None,
                             top_p=g["top_p"] if g["top_p"] < 1.0 else None, eos_id=tok.eos_id):
        t1 = t1 or time.perf_counter()   # the first token comes after the prefill
        out.append(nxt.item())
        # hold back a character whose bytes have not all arrived yet
        full = tok.decode(out).rstrip("\ufffd")
        sys.stdout.write(full[len(shown):])
        sys.stdout.flush()
        shown = full
        if answer and not g["max_new_tokens"] and len(full.strip()) >= len(answer):
            # as many characters as the key has: one token per digit or several digits per token,
            # it is complete
            break
    t_end = time.perf_counter()
    shown = tok.decode(out)
    print(shown[len(full):] + "\n---")
    rate = (len(out) - 1) / (t_end - t1) if len(out) > 1 else float("nan")
    return out, shown, t1 - t0, rate


def report(out, shown, answer, prefill_s, rate, dev, dt):
    # the answer checked against the haystack's key, the speed, and the peak memory of the whole run
    if answer:
        print(f"expected {answer}: {'correct' if shown.strip().startswith(answer) else 'wrong'}")
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.startswith("cuda") else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{len(out)} tokens; prefill {prefill_s * 1000:.0f} ms, decode {rate:.1f} tokens/s; "
          f"peak memory {peak:,.0f} MB "
          f"({'CUDA allocated' if dev.startswith('cuda') else 'process RSS'}); device {dev}, {dt}")


def main(cfg):
    g = cfg
    dev, dt = auto_device(g["device"], g["dtype"])
    check_settings(g)
    torch.manual_seed(g["seed"])
    model, tok = load_model(g, dev, dt)
    C = model.scfg.chunk_size

    # the context X_C (n chunks of C tokens) and the prompt X_D
    answer = None
    if g["context"] == "":
        ids, prompt_ids, answer = passkey_haystack(g, tok, C)
    else:
        ids, prompt_ids = own_context(g, tok)
    ids, n = whole_chunks(ids, model, dev, dt)
    context_t = torch.tensor(ids, device=dev).view(1, n, C)     # (1, n, C)
    idx = torch.tensor([prompt_ids], device=dev)                # (1, T)

    # compress once; then prefill and decode with the KV cache, streaming the text
    memory = compress_context(model, context_t, idx, dev)
    kid, at_key = key_mentions(tok, answer, ids)
    pictures(g, model, memory, idx, n, kid, at_key)
    if g["show_tree"]:
        show_trees(memory, n, C, model.scfg.keep, kid, at_key)
    out, shown, prefill_s, rate = stream_answer(g, model, tok, idx, memory, answer)
    report(out, shown, answer, prefill_s, rate, dev, dt)
    return out


if __name__ == "__main__":
    config = config_of(globals())
    parse_overrides(sys.argv[1:], config, __file__)
    main(config)
