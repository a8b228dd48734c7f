"""
Answer from a compressed long context, nanoGPT's sample.py for SharedLLM. The context is cut into
chunks of C tokens, each chunk's tree is built and compressed once by the lower model, the prompt is
prefilled, and the answer is decoded token by token with the KV cache, streamed as it comes.

  python sample.py                                       # after train.py: a fresh passkey haystack
  python sample.py --n_chunks=16 --show_tree=True        # longer, and what each tree kept
  python sample.py --plot=arch.png --attention=attn.png  # the method on this haystack; where the
                                                         # answer looks
  python sample.py --context=FILE:notes.txt --prompt="Q: ..." --max_new_tokens=64
  python sample.py --init_from=/path/to/llama --n_lower=4 --chunk_size=1024 --context=FILE:book.txt
"""
import random
import sys
import time

import torch

import data
import decode
import plots
import tree
from configurator import config_of, package_path, parse_overrides
from load_llama import auto_device, load_sharedllm

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value
init_from = "out"           # a train.py out_dir (or its ckpt.pt), or a LLaMA folder / .gguf file
context = ""                # the long context X_C: a string, or FILE:path; "" = a passkey haystack
prompt = ""                 # the running text X_D (the question); "" = the passkey question
n_chunks = 4                # the generated haystack's length in chunks (context="" only)
key = 0                     # its 5-digit key; 0 = random
depth = -1.0                # where the key sits, 0 = start .. 1 = end of the context; -1 = random
max_new_tokens = 0          # 0 = until the haystack's key is complete (else 64 tokens)
temperature = 0.0           # 0 = greedy
top_k = 0                   # 0 = off
top_p = 1.0                 # 1.0 = off
show_tree = False           # print, per chunk, the path the search took and what each preserved
                            # node kept (past 8 chunks: the first two, the key's and the last two)
plot = ""                   # draw the method on this context here (PNG): the chunks, the tree of
                            # the key's chunk (else the last) with its kept KVs, the two models
attention = ""              # draw here (PNG) the cross-attention weights with which the answer's
                            # first token reads every compressed KV; the text form is printed
# SharedLLM read another way at inference (0 / "" = as trained)
height = 0                  # tree height h
beta = 0.0                  # compression C / KVs kept per chunk
policy = ""                 # "lexical" (every recipe's) | "vector" (the paper's) | "right"
n_lower = 0                 # M, for a LLaMA folder (a checkpoint's is fixed by its weights)
chunk_size = 0              # C, likewise
device = "auto"
dtype = "auto"              # "auto" = bfloat16 for a pretrained model on CUDA, else float32
seed = 1337
# -----------------------------------------------------------------------------


def tree_path(nodes, C):   # "left -> right -> leaves [a, b)": the half selected at each level
    spans = tree.path(nodes, C)
    turns = ["right" if b[0] != a[0] else "left" for a, b in zip(spans, spans[1:])]
    return " -> ".join(turns + ["leaves [{}, {})".format(*spans[-1])])


def show_trees(memory, n, C, keep, key_at):
    # per chunk: the path the search took and what each preserved node kept (a long context: the
    # ends and the key's chunks)
    shown = set(range(n)) if n <= 8 else {0, 1, n - 2, n - 1} | {a // C for a, _ in key_at}
    for c, nodes in enumerate(memory.nodes):
        if c not in shown:
            if c - 1 in shown:
                print(f"... chunks {c} to {min(x for x in shown if x > c) - 1} not shown")
            continue
        here = [f"[{a - c * C}, {b - c * C})" for a, b in key_at if a // C == c]
        at = f"   <- the key at tokens {' and '.join(here)} of this chunk" if here else ""
        print(f"chunk {c} [{c * C}, {(c + 1) * C}): path {tree_path(nodes, C)}{at}")
        print(tree.describe(nodes, C, keep))


def mention_nodes(nodes, C, S, key_at):
    # -> [(label, KV indices)]: every preserved node that holds (part of) a mention of the key, in
    # text order; chunk c's KVs are c*S .. c*S + S - 1, node by node as memory.nodes lists them
    out = []
    for c, chunk_nodes in enumerate(nodes):
        first = c * S
        for nd in chunk_nodes:
            held = [str(m + 1) for m, (a, b) in enumerate(key_at)
                    if a < c * C + nd.end and c * C + nd.start < b]
            if held:
                out.append((f"mention {' and '.join(held)} of the key: chunk {c}'s node "
                            f"[{nd.start}, {nd.end}) = KVs {first}-{first + nd.n_kept - 1}",
                            list(range(first, first + nd.n_kept))))
            first += nd.n_kept
    return out


@torch.no_grad()
def cross_attention_picture(model, memory, idx, path, key_at):
    # The weights with which the last prompt token (the one that predicts the answer's first
    # token) reads every compressed KV in each cross-attention layer: softmax(q k^T / sqrt(hd))
    # from the layer's own input, captured in a forward pass over the prompt. Printed, and drawn.
    inputs = {}
    hooks = [blk.cross_attention.register_forward_pre_hook(
        lambda m, args, i=i: inputs.__setitem__(i, args))
        for i, blk in enumerate(model.upper.layers) if blk.cross_attention is not None]
    model.upper(idx, memory=memory)
    for h in hooks:
        h.remove()
    S, C = sum(nd.n_kept for nd in memory.nodes[0]), model.scfg.chunk_size   # KVs per chunk
    key_chunk = key_at[0][0] // C if key_at else None
    weights = []
    for i, (x, k, v, q_rope) in sorted(inputs.items()):   # CrossAttention.forward's arguments
        ca = model.upper.layers[i].cross_attention
        q = ca.queries(x[:1, -1:], [t[:1] for t in q_rope])[0, :, 0]     # (Hq, hd)
        k = k[0].repeat_interleave(q.shape[0] // k.shape[1], dim=0)     # (Hq, n*S, hd)
        weights.append(((k.float() @ q.float()[:, :, None])[..., 0]
                        / q.shape[-1] ** 0.5).softmax(-1))              # (Hq, n*S)
    key_nodes = mention_nodes(memory.nodes, C, S, key_at)
    for j, w in enumerate(weights):
        top = w.max(0).values.topk(min(3, w.shape[1])).indices.tolist()
        on_key = "" if key_chunk is None else ", on the key's chunk per head " + " ".join(
            f"{m:.2f}" for m in w[:, key_chunk * S:(key_chunk + 1) * S].sum(1).tolist())
        print(f"cross-attention layer {j + 1}: the most-read KVs {top} "
              f"(chunk {', '.join(str(t // S) for t in top)}){on_key}")
        for label, kvs in key_nodes:
            print(f"  {label}: per head " + " ".join(f"{m:.2f}" for m in w[:, kvs].sum(1).tolist()))
    plots.attention(path, [w.tolist() for w in weights], S, key_chunk, key_nodes,
                    f"the answer's first token reading {weights[0].shape[1]:,} compressed KVs "
                    f"({len(weights)} cross-attention layers)")


def main(g):
    dev = auto_device(g["device"])
    shared = {k: g[k] for k in ("n_lower", "chunk_size", "height", "beta", "policy") if g[k]}
    model, tok, _ = load_sharedllm(package_path(g["init_from"]), dev, g["dtype"], **shared)
    torch.manual_seed(g["seed"])
    C, answer, key_at = model.scfg.chunk_size, None, []

    # the context X_C (n chunks of C tokens) and the prompt X_D
    if g["context"] == "":   # a passkey haystack; the question as training and eval.py ask it
        ctx, xd, tgt, qlen = data.passkey_sample(
            tok, random.Random(g["seed"]), g["n_chunks"], C, key=g["key"] or None,
            depth=None if g["depth"] < 0 else g["depth"])
        ids, prompt_ids, key_ids = ctx.flatten().tolist(), xd[:qlen].tolist(), tgt[tgt != -100]
        answer = tok.decode(key_ids.tolist()).strip()
        key_at = data.key_mentions(ids, key_ids.tolist())   # [start, end) of each mention
        print(f"context: a passkey haystack, key {answer} at depth "
              f"{key_at[0][0] / len(ids):.2f} of {len(ids):,} tokens")
    else:   # your own text and question
        text = g["context"]
        if text.startswith("FILE:"):
            text = open(package_path(text[5:]), encoding="utf-8").read()
        ids = tok.encode(text)
        if len(ids) < C or not g["prompt"]:
            raise SystemExit(f"--context: {len(ids)} tokens, --prompt: {g['prompt']!r}; the "
                             f"context needs a chunk of C = {C} tokens, the prompt a token")
        if len(ids) % C:   # only whole chunks are compressed: the oldest tokens are left out
            print(f"note: the first {len(ids) % C} context tokens do not fill a chunk of {C}")
    if g["prompt"]:
        prompt_ids = tok.encode(g["prompt"], bos=False)
    n = len(ids) // C
    ids = ids[len(ids) - n * C:]
    context_t = torch.tensor(ids, device=dev).view(1, n, C)   # (1, n, C)
    idx = torch.tensor([prompt_ids], device=dev)              # (1, T)

    # compress once: the prompt is the question the search reads
    t0 = time.perf_counter()
    with torch.no_grad():
        memory = model.compress(context_t, idx, torch.tensor([idx.shape[1]]))
    kvs = memory.kv[0][0].shape[2]
    print(f"context {n * C:,} tokens = {n} chunks of C = {C} -> {kvs:,} compressed KVs per layer "
          f"(beta {n * C / kvs:g}), M = {model.scfg.n_lower}, height {model.scfg.height}, policy "
          f"{model.scfg.policy!r}; compressed in {1000 * (time.perf_counter() - t0):.0f} ms")
    if g["plot"]:   # the key's chunk (else the last)
        c = key_at[0][0] // C if key_at else n - 1
        plots.architecture(g["plot"], memory.nodes[c], c, n, C, model.scfg.keep,
                           model.scfg.n_lower, model.upper.cfg.n_layers, kvs // n,
                           [(a - c * C, b - c * C) for a, b in key_at if a // C == c])
    if g["attention"]:
        cross_attention_picture(model, memory, idx, g["attention"], key_at)
    if g["show_tree"]:
        show_trees(memory, n, C, model.scfg.keep, key_at)

    # prefill the prompt, then decode with the KV cache, streaming the text (a character whose
    # bytes have not all arrived is held back)
    new = g["max_new_tokens"] or (4 * len(answer) if answer else 64)
    print(f"---\n{tok.decode(prompt_ids)}", end="")
    out, shown, t1 = [], "", None
    t0 = time.perf_counter()
    for nxt in decode.stream(model.upper, idx, new, memory=memory, temperature=g["temperature"],
                             top_k=g["top_k"] or None,
                             top_p=g["top_p"] if g["top_p"] < 1.0 else None, eos_id=tok.eos_id):
        t1 = t1 or time.perf_counter()   # the first token comes after the prefill
        out.append(nxt.item())
        text = tok.decode(out).rstrip("\ufffd")
        print(text[len(shown):], end="", flush=True)
        shown = text
        if answer and not g["max_new_tokens"] and len(text.strip()) >= len(answer):
            break   # as many characters as the key: it is complete
    print(tok.decode(out)[len(shown):] + "\n---")
    if answer:
        print(f"expected {answer}: {'correct' if shown.strip().startswith(answer) else 'wrong'}")
    rate = (len(out) - 1) / (time.perf_counter() - t1) if len(out) > 1 else float("nan")
    print(f"{len(out)} tokens; prefill {1000 * (t1 - t0):.0f} ms, decode {rate:.1f} tokens/s")
    return out


if __name__ == "__main__":
    main(parse_overrides(sys.argv[1:], config_of(globals()), __file__))
