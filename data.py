"""
Data for train.py, eval.py and sample.py, with no download.

- Long documents for language modeling: by default the Python standard library's own .py files (present on
  every machine with Python; many are 20K-100K tokens, and code is what the paper's CodeParrot column measures),
  or every .txt file under `data_dir`. Tokenized once and cached as one memory-mapped token file plus document
  offsets (nanoGPT's prepare.py style); split into train/val by document.
- Passkey retrieval (the Landmark / LongLoRA format): a 5-digit random key at a given depth inside the context,
  filler around it, the question at the end of X_D; only the answer tokens are scored.

A sample is (context (n, C), idx (T,), targets (T,), query_len): X_C precedes X_D in the same document;
query_len is how many leading tokens of X_D are the query (the passkey question; 0 for language modeling).
"""
import bisect
import glob
import hashlib
import json
import os
import sysconfig

import numpy as np
import torch

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "   # then the key, tokenized as in the needle (passkey_question)


def corpus_files(data_dir=""):
    if data_dir:   # a folder (every .txt below it) or a glob pattern
        if not glob.has_magic(data_dir) and not os.path.isdir(data_dir):
            raise FileNotFoundError(f"data_dir={data_dir!r}: " + ("a file; give a folder of .txt files or a glob like "
                                    "dir/*.txt" if os.path.exists(data_dir) else "no such folder"))
        pattern = data_dir if glob.has_magic(data_dir) else os.path.join(data_dir, "**", "*.txt")
        files = sorted(glob.glob(pattern, recursive=True))
        if not files:
            raise FileNotFoundError(f"data_dir={data_dir!r} holds no .txt files" if pattern != data_dir else
                                    f"data_dir={data_dir!r} matches no file")
        return files
    return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))


def prepare(tok, data_dir="", cache_dir="data_cache", val_every=10):
    # -> {"train": (tokens, offsets), "val": (...)}; offsets[i]:offsets[i+1] is document i
    files = corpus_files(data_dir)
    sig = json.dumps([tok.spec, [(f, os.path.getsize(f)) for f in files]], sort_keys=True)
    key = hashlib.sha1(sig.encode()).hexdigest()[:12]
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    out = {}
    for split in ("train", "val"):
        path = os.path.join(cache_dir, f"{key}_{split}")
        if not os.path.exists(path + ".offsets.npy"):
            docs = [tok.encode(open(f, encoding="utf-8", errors="replace").read())   # BOS as the tokenizer has it
                    for i, f in enumerate(files) if (i % val_every == val_every - 1) == (split == "val")]
            if not docs:
                raise ValueError(f"{data_dir or 'the standard library'}: {len(files)} documents leave the {split} split "
                                 f"empty (every {val_every}th document is held out for validation)")
            offsets = np.cumsum([0] + [len(d) for d in docs])
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"      # per process: two runs preparing at once never share a file
            arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=(max(1, int(offsets[-1])),))
            arr[: offsets[-1]] = np.concatenate(docs) if docs else []
            arr.flush()
            os.replace(tmp, path + ".bin")
            with open(tmp, "wb") as f:
                np.save(f, offsets)
            os.replace(tmp, path + ".offsets.npy")   # renamed last: its presence means the cache is complete
            print(f"prepared {split}: {len(docs)} documents, {offsets[-1]:,} tokens -> {path}.bin")
        offsets = np.load(path + ".offsets.npy")
        out[split] = (np.memmap(path + ".bin", dtype=dtype, mode="r"), offsets)
    return out


def lm_sample(split, rng, n_chunks, chunk_size, T):
    # a window of n*C + T + 1 tokens from one document: X_C, then X_D (idx) and its next tokens (targets)
    tokens, offsets = split
    need = n_chunks * chunk_size + T + 1
    lens = np.diff(offsets)
    ok = np.nonzero(lens >= need)[0]
    if len(ok) == 0:
        raise ValueError(f"no document has {need} tokens (n_chunks={n_chunks} x chunk_size={chunk_size} + T={T} + 1); "
                         f"the longest has {lens.max()}")
    d = ok[rng.randrange(len(ok))]
    s = int(offsets[d]) + rng.randrange(int(lens[d]) - need + 1)
    w = torch.from_numpy(tokens[s:s + need].astype(np.int64))
    ctx = w[: n_chunks * chunk_size].view(n_chunks, chunk_size)
    return ctx, w[n_chunks * chunk_size:-1], w[n_chunks * chunk_size + 1:], 0   # no query: the tree goes right


def passkey_ids(tok):
    # token ids of the filler, computed once per tokenizer
    if not hasattr(tok, "_passkey"):
        tok._passkey = dict(filler=tok.encode(FILLER, bos=False))
    return tok._passkey


def passkey_question(tok, key):
    # -> (question ids, answer ids) of X_D. The question and the key are tokenized as ONE text that ends as the needle's
    # first sentence does, "The pass key is 12345.", so the answer's tokens are exactly the needle's: a tokenizer may
    # fold the space into the key (GPT-2: ' 735', '12') or make a token of it ('▁', '7', ...): it does the same in
    # both. The question is every token before the first one that shows a digit; the answer runs to the key's end.
    # Both "shows a digit" and "shows the whole key" only turn true as tokens are added: found by bisection, a few
    # decodes per sample rather than one per prefix (this runs for every training sample).
    ids = tok.encode(f"{QUESTION}{key}.", bos=False)
    prefixes = range(len(ids) + 1)                                             # QUESTION holds no digit
    q = bisect.bisect_left(prefixes, True, key=lambda i: any(c.isdigit() for c in tok.decode(ids[:i]))) - 1
    end = bisect.bisect_left(prefixes, True, key=lambda i: str(key) in tok.decode(ids[:i]))
    return ids[:q], ids[q:end]


def passkey_sample(tok, rng, n_chunks, chunk_size, T=None, depth=None, key=None):
    # X_C: filler with the needle at `depth` (0 = start, 1 = end of the context); X_D: the question + the key.
    # Only the key's tokens are scored. The needle always lies wholly inside X_C.
    p = passkey_ids(tok)
    key = rng.randint(10000, 99999) if key is None else key
    depth = rng.random() if depth is None else depth
    needle = tok.encode(NEEDLE.format(key=key), bos=False)
    L = n_chunks * chunk_size
    if L < len(needle) + 1:
        raise ValueError(f"context of {L} tokens is too short for the passkey needle ({len(needle) + 1} tokens)")
    head = tok.encode("")                                     # BOS, where the tokenizer adds one
    hay = head + p["filler"] * (L // len(p["filler"]) + 1)
    at = len(head) + round(depth * (L - len(needle) - len(head)))
    ctx = (hay[:at] + needle + hay[at:])[:L]
    question, answer = passkey_question(tok, key)
    xd = question + answer
    T = T or len(xd) - 1
    if T < len(xd) - 1:
        raise ValueError(f"block_size T={T} is too short for the passkey question and answer ({len(xd) - 1} tokens)")
    xd = xd + (p["filler"] * (T // len(p["filler"]) + 2))[: T + 1 - len(xd)]   # pad after the answer: not scored
    idx, targets = torch.tensor(xd[:-1]), torch.tensor(xd[1:])
    targets[: len(question) - 1] = -100                                          # score only the answer tokens
    targets[len(question) - 1 + len(answer):] = -100
    return torch.tensor(ctx).view(n_chunks, chunk_size), idx, targets, len(question)


def collate(samples, tok):
    # samples -> context (B, n, C), idx (B, T), targets (B, T), query_len (B,). Passkey samples made without a T are as
    # long as their question and key, and a key can take more tokens in one sample than in another (GPT-2 BPE: 2 or 3):
    # the shorter ones go on with filler after their answer, exactly as a longer T would have made them (not scored).
    T = max(len(s[1]) for s in samples)
    filler = passkey_ids(tok)["filler"] * (T // len(passkey_ids(tok)["filler"]) + 1)
    out = []
    for ctx, idx, tgt, ql in samples:
        pad = T - len(idx)
        if pad:
            idx = torch.cat([idx, torch.tensor([int(tgt[-1])] + filler[:pad - 1])])   # the answer's last token, filler
            tgt = torch.cat([tgt, torch.full((pad,), -100)])
        out.append((ctx, idx, tgt, ql))
    ctx, idx, tgt, ql = zip(*out)
    return torch.stack(ctx), torch.stack(idx), torch.stack(tgt), torch.tensor(ql)


def get_batch(kind, B, rng, tok, splits, n_chunks, chunk_size, T, split="train"):
    # kind: "lm" | "passkey" -> context (B, n, C), idx (B, T), targets (B, T), query_len (B,)
    # (T None: passkey samples as long as their question and key, padded to the longest of the batch)
    samples = [passkey_sample(tok, rng, n_chunks, chunk_size, T) if kind == "passkey"
               else lm_sample(splits[split], rng, n_chunks, chunk_size, T) for _ in range(B)]
    return collate(samples, tok)
