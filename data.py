"""
Data for train.py, eval.py and sample.py, with no download.

- Long documents for language modeling: by default the Python standard library's own .py files
  (present on every machine with Python; many are 20K-100K tokens, and code is what the paper's
  CodeParrot column measures), or every .txt file under `data_dir`; several sources joined by
  commas make a mix of domains, sampled evenly. Tokenized once and cached as one memory-mapped
  token file plus document offsets (nanoGPT's prepare.py style); split into train/val by document.
- Passkey retrieval (the Landmark / LongLoRA format): a 5-digit random key at a given depth inside
  the context, filler around it, the question at the end of X_D; only the answer tokens are scored.

A sample is (context (n, C), idx (T,), targets (T,), question_len): X_C precedes X_D in the same
document; question_len is how many leading tokens of X_D are the query (the passkey question; 0 for
language modeling).
"""
import bisect
import glob
import hashlib
import json
import os
import random
import sysconfig

import numpy as np
import torch

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "   # then the key, tokenized as in the needle
                                                      # (passkey_question)


def corpus_files(data_dir=""):
    # one source -> its files: a folder (every .txt below it), a glob pattern, one file, "stdlib"
    # (or "": the standard library's .py) or "pydoc" (Python's reference documentation, which every
    # Python ships as pydoc_data/topics.py). The two names win over a folder called so: write
    # ./stdlib for that.
    if data_dir in ("", "stdlib"):
        return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if data_dir == "pydoc":
        return [os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")]
    if os.path.isfile(data_dir):
        return [data_dir]
    if not glob.has_magic(data_dir) and not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data_dir={data_dir!r}: no such file or folder")
    pattern = data_dir if glob.has_magic(data_dir) else os.path.join(data_dir, "**", "*.txt")
    files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise FileNotFoundError(f"data_dir={data_dir!r} holds no .txt files" if pattern != data_dir
                                else f"data_dir={data_dir!r} matches no file")
    return files


def source_texts(source, files):
    # the documents of one source, as text. pydoc's ~80 topics (460K characters) become 4 documents
    # of at least 100K characters each (topics in alphabetical order, the rest joining the last),
    # long enough for long contexts.
    if source != "pydoc":
        return [open(f, encoding="utf-8", errors="replace").read() for f in files]
    from pydoc_data.topics import topics
    docs = [""]
    for name in sorted(topics):
        if len(docs[-1]) >= 100_000:
            docs.append("")
        docs[-1] += topics[name] + "\n\n"
    return docs if len(docs) < 2 or len(docs[-1]) >= 100_000 else docs[:-2] + [docs[-2] + docs[-1]]


def held_out(i, count, val_every):
    # every val_every-th document of a source is validation, and a source with fewer documents holds
    # out its last
    return i % val_every == val_every - 1 or (count < val_every and i == count - 1)


def prepare(tok, data_dir="", cache_dir="data_cache", val_every=10, splits=("train", "val")):
    # -> {"train": (tokens, offsets[, source]), "val": (...)}; offsets[i]:offsets[i+1] is
    # document i; with several comma-separated sources, source[i] is the source document i came
    # from (lm_sample draws sources evenly)
    sources = data_dir.split(",") if data_dir else [""]
    if len(sources) > 1 and "" in sources:   # "a,b," would quietly add the standard library
        raise ValueError(f"data_dir={data_dir!r}: an empty source between commas (the standard "
                         "library is 'stdlib')")
    files = [corpus_files(src) for src in sources]
    # the cache's name: the tokenizer and the files; but for the default (whose name never changed),
    # also the sources' names, which decide how files become documents (pydoc makes 4 of its one
    # file, a path to that file 1), and the format's version, 2 since the names joined, so no cache
    # written before (pydoc and its path shared one) is read
    default = sources in ([""], ["stdlib"])
    sig = json.dumps([tok.spec, [(f, os.path.getsize(f)) for fs in files for f in fs]]
                     + ([] if default else [sources, 2]), sort_keys=True)
    key = hashlib.sha1(sig.encode()).hexdigest()[:12]
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    out = {}
    for split in splits:
        path = os.path.join(cache_dir, f"{key}_{split}")
        if not os.path.exists(path + ".offsets.npy"):
            write_split(tok, sources, files, split, path, cache_dir, dtype, val_every, data_dir)
        offsets = np.load(path + ".offsets.npy")
        out[split] = (np.memmap(path + ".bin", dtype=dtype, mode="r"), offsets)
        if len(sources) > 1:
            out[split] += (np.load(path + ".source.npy"),)
    return out


def write_split(tok, sources, files, split, path, cache_dir, dtype, val_every, data_dir):
    # tokenize one split's documents (BOS as the tokenizer has it) into path.bin, .offsets.npy (and
    # .source.npy)
    docs, source = [], []
    for s, (src, fs) in enumerate(zip(sources, files)):
        texts = source_texts(src, fs)
        picked = [tok.encode(t) for i, t in enumerate(texts)
                  if held_out(i, len(texts), val_every) == (split == "val")]
        docs, source = docs + picked, source + [s] * len(picked)
        if not picked and len(sources) > 1:
            raise ValueError(f"{src}: its {len(texts)} document(s) leave the {split} split "
                             "without it")
    if not docs:
        raise ValueError(f"{data_dir or 'the standard library'}: {sum(map(len, files))} "
                         f"document(s) leave the {split} split empty (each source holds out every "
                         f"{val_every}th document for validation, a source of fewer than "
                         f"{val_every} documents its last: a lone document is for eval.py, not "
                         "training)")
    offsets = np.cumsum([0] + [len(d) for d in docs])
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"   # per process: two runs preparing at once never share a file
    arr = np.memmap(tmp, dtype=dtype, mode="w+", shape=(max(1, int(offsets[-1])),))
    arr[: offsets[-1]] = np.concatenate(docs)
    arr.flush()
    os.replace(tmp, path + ".bin")
    if len(sources) > 1:
        with open(tmp, "wb") as f:
            np.save(f, np.array(source))
        os.replace(tmp, path + ".source.npy")
    with open(tmp, "wb") as f:
        np.save(f, offsets)
    # renamed last: its presence means the cache is complete
    os.replace(tmp, path + ".offsets.npy")
    print(f"prepared {split}: {len(docs)} documents, {offsets[-1]:,} tokens -> {path}.bin")


def lm_sample(split, rng, n_chunks, chunk_size, T):
    # a window of n*C + T + 1 tokens from one document: X_C, then X_D (idx) and its next tokens
    # (targets)
    tokens, offsets = split[:2]
    need = n_chunks * chunk_size + T + 1
    lens = np.diff(offsets)
    ok = np.nonzero(lens >= need)[0]
    if len(ok) == 0:
        raise ValueError(f"no document has {need} tokens (n_chunks={n_chunks} x "
                         f"chunk_size={chunk_size} + T={T} + 1); the longest has {lens.max()}")
    if len(split) > 2:   # several sources: a source first, evenly, then one of its documents
        sources = sorted(set(split[2][ok].tolist()))
        ok = ok[split[2][ok] == sources[rng.randrange(len(sources))]]
    d = ok[rng.randrange(len(ok))]
    s = int(offsets[d]) + rng.randrange(int(lens[d]) - need + 1)
    w = torch.from_numpy(tokens[s:s + need].astype(np.int64))
    ctx = w[: n_chunks * chunk_size].view(n_chunks, chunk_size)
    # no question: the tree goes right
    return ctx, w[n_chunks * chunk_size:-1], w[n_chunks * chunk_size + 1:], 0


def passkey_ids(tok):
    # token ids of the filler, computed once per tokenizer
    if not hasattr(tok, "_passkey"):
        tok._passkey = dict(filler=tok.encode(FILLER, bos=False))
    return tok._passkey


def passkey_question(tok, key):
    # -> (question ids, answer ids) of X_D. The question and the key are tokenized as ONE text that
    # ends as the needle's first sentence does, "The pass key is 12345.", so the answer's tokens are
    # exactly the needle's: a tokenizer may fold the space into the key (GPT-2: ' 735', '12') or
    # make a token of it ('▁', '7', ...): it does the same in both. The question is every token
    # before the first one that shows a digit; the answer runs to the key's end. Both "shows a
    # digit" and "shows the whole key" only turn true as tokens are added: found by bisection, a few
    # decodes per sample rather than one per prefix (this runs for every training sample).
    ids = tok.encode(f"{QUESTION}{key}.", bos=False)
    prefixes = range(len(ids) + 1)   # QUESTION holds no digit
    q = bisect.bisect_left(prefixes, True,
                           key=lambda i: any(c.isdigit() for c in tok.decode(ids[:i]))) - 1
    end = bisect.bisect_left(prefixes, True, key=lambda i: str(key) in tok.decode(ids[:i]))
    return ids[:q], ids[q:end]


def passkey_sample(tok, rng, n_chunks, chunk_size, T=None, depth=None, key=None):
    # X_C: filler with the needle at `depth` (0 = start, 1 = end of the context); X_D: the question
    # + the key. Only the key's tokens are scored. The needle always lies wholly inside X_C.
    p = passkey_ids(tok)
    key = rng.randint(10000, 99999) if key is None else key
    depth = rng.random() if depth is None else depth
    needle = tok.encode(NEEDLE.format(key=key), bos=False)
    L = n_chunks * chunk_size
    if L < len(needle) + 1:
        raise ValueError(f"context of {L} tokens is too short for the passkey needle "
                         f"({len(needle) + 1} tokens)")
    head = tok.encode("")                                     # BOS, where the tokenizer adds one
    hay = head + p["filler"] * (L // len(p["filler"]) + 1)
    at = len(head) + round(depth * (L - len(needle) - len(head)))
    ctx = (hay[:at] + needle + hay[at:])[:L]
    question, answer = passkey_question(tok, key)
    xd = question + answer
    T = T or len(xd) - 1
    if T < len(xd) - 1:
        raise ValueError(f"block_size T={T} is too short for the passkey question and answer "
                         f"({len(xd) - 1} tokens)")
    # pad after the answer: not scored
    xd = xd + (p["filler"] * (T // len(p["filler"]) + 2))[: T + 1 - len(xd)]
    idx, targets = torch.tensor(xd[:-1]), torch.tensor(xd[1:])
    targets[: len(question) - 1] = -100   # score only the answer tokens
    targets[len(question) - 1 + len(answer):] = -100
    return torch.tensor(ctx).view(n_chunks, chunk_size), idx, targets, len(question)


def key_mentions(ctx, answer):
    # where a haystack names its key: [start, end) of every run of the answer's token ids in ctx, a
    # flat list of the context's tokens (the needle names the key twice; the answer's tokens are
    # exactly the needle's: passkey_question)
    k = len(answer)
    return [(i, i + k) for i in range(len(ctx) - k + 1) if ctx[i:i + k] == answer]


def batch_mentions(ctx, tgt):
    # key_mentions for every haystack of a batch: ctx (B, n, C), tgt (B, T) -> per haystack,
    # [(start, end)]
    return [key_mentions(row, t[t != -100].tolist())
            for row, t in zip(ctx.flatten(1).tolist(), tgt)]


def key_placements(nodes, ctx, tgt):
    # key_placement for every haystack of a batch; nodes: the batch's Memory.nodes (B*n lists)
    n, C = ctx.shape[1:]
    return [key_placement(nodes[i * n:(i + 1) * n], m, C)
            for i, m in enumerate(batch_mentions(ctx, tgt))]


def key_placement(nodes, mentions, C):
    # Where the context tree left the key of one haystack: "leaf" if one node of the finest level
    # holds a whole mention (its finest KVs), "coarse" if every token of every mention sits in a
    # level-1 node (the coarsest kept, where the search did not go), else "between". nodes: the
    # preserved tree.Nodes of each of the haystack's chunks; mentions: [start, end) in the flattened
    # context (key_mentions).
    if not mentions:
        raise ValueError("the haystack holds no mention of its key")
    height = max(nd.level for chunk in nodes for nd in chunk)
    holder = lambda p: next(nd for nd in nodes[p // C]   # (chunk is p // C)
                            if nd.start <= p % C < nd.end)
    if any(holder(a) is holder(b - 1) and (a // C == (b - 1) // C) and holder(a).level == height
           for a, b in mentions):
        return "leaf"
    return ("coarse" if all(holder(p).level == 1 for a, b in mentions for p in range(a, b))
            else "between")


def collate(samples, tok):
    # samples -> context (B, n, C), idx (B, T), targets (B, T), question_len (B,). Passkey samples
    # made without a T are as long as their question and key, and a key can take more tokens in one
    # sample than in another (GPT-2 BPE: 2 or 3): the shorter ones go on with filler after their
    # answer, exactly as a longer T would have made them (not scored).
    T = max(len(s[1]) for s in samples)
    filler = passkey_ids(tok)["filler"] * (T // len(passkey_ids(tok)["filler"]) + 1)
    out = []
    for ctx, idx, tgt, ql in samples:
        pad = T - len(idx)
        if pad:
            # the answer's last token, filler
            idx = torch.cat([idx, torch.tensor([int(tgt[-1])] + filler[:pad - 1])])
            tgt = torch.cat([tgt, torch.full((pad,), -100)])
        out.append((ctx, idx, tgt, ql))
    ctx, idx, tgt, ql = zip(*out)
    return torch.stack(ctx), torch.stack(idx), torch.stack(tgt), torch.tensor(ql)


def get_batch(kind, B, rng, tok, splits, n_chunks, chunk_size, T, split="train"):
    # kind: "lm" | "passkey" | "needles" (the passkey or another needle: needle_sample) ->
    # context (B, n, C), idx (B, T), targets (B, T), question_len (B,)
    # (T None: passkey samples as long as their question and key, padded to the longest of the
    # batch)
    def sample():
        if kind == "lm":
            return lm_sample(splits[split], rng, n_chunks, chunk_size, T)
        if kind == "needles" and rng.random() >= PASSKEY_SHARE:
            return needle_sample(tok, rng, n_chunks, chunk_size, T)
        return passkey_sample(tok, rng, n_chunks, chunk_size, T)
    return collate([sample() for _ in range(B)], tok)


def check_needle_lengths(tok, train_counts, eval_counts, chunk_size, block_size, pad_passkeys,
                         needles):
    # check_lengths' part for questions: the needles must fit X_C, the question and answer X_D
    # keys tokenize to different lengths (BPE): the longest of a fixed sample of 102 keys
    keys = [10000, 99999] + [random.Random(k).randint(10000, 99999) for k in range(100)]
    needle = max(len(tok.encode(NEEDLE.format(key=k), bos=False)) for k in keys) + 1
    shortest = min(train_counts + eval_counts)
    if shortest * chunk_size < needle:
        raise SystemExit(f"--chunk_size={chunk_size} with --n_chunks / --chunk_schedule / "
                         f"--eval_chunks: {shortest} chunk(s) hold {shortest * chunk_size} "
                         f"tokens; the passkey needle needs {needle}")
    xd = max(sum(map(len, passkey_question(tok, k))) for k in keys) - 1
    if pad_passkeys and block_size < xd:   # (else a passkey batch is as long as it needs)
        raise SystemExit(f"--block_size={block_size}: the passkey question and answer take "
                         f"up to {xd} tokens")
    if needles == "mix":   # up to 4 facts in X_C; a question, answer prefix and value in X_D
        facts, xd = needle_lengths(tok)
        least = min(train_counts)
        if least * chunk_size <= facts:
            raise SystemExit(f"--needles=mix with --chunk_size={chunk_size} and --n_chunks / "
                             f"--chunk_schedule: {least} chunk(s) hold {least * chunk_size} "
                             f"tokens; 4 needles take up to {facts}")
        if pad_passkeys and block_size < xd:
            raise SystemExit(f"--block_size={block_size} with --needles=mix: a needle's "
                             f"question, answer prefix and value take up to {xd} tokens")


def check_lengths(tok, splits, train_counts, eval_counts, task, chunk_size, block_size,
                  pad_passkeys, data_dir, verbose=True, needles="passkey"):
    # train.py's start-up check of every length the run will use against the data, not at iteration
    # 2,500 or after training, where a crash would cost the run (errors name its flags). Training
    # must fit; an evaluation length that no validation document can hold a language-modeling window
    # for is evaluated on passkeys only, and said so. train_counts, eval_counts: sorted chunk
    # counts. -> the chunk counts language modeling is evaluated at
    if task != "lm":
        check_needle_lengths(tok, train_counts, eval_counts, chunk_size, block_size, pad_passkeys,
                             needles)
    if task == "passkey":
        return []
    need = lambda n: n * chunk_size + block_size + 1
    longest = {split: int(max(splits[split][1][1:] - splits[split][1][:-1]))
               for split in ("train", "val")}
    where = data_dir or "the standard library"
    if need(max(train_counts)) > longest["train"]:
        raise SystemExit(f"--n_chunks / --chunk_schedule: {max(train_counts)} chunks x "
                         f"{chunk_size} + block_size {block_size} + 1 = "
                         f"{need(max(train_counts)):,} tokens, and the longest training document "
                         f"of {where} has {longest['train']:,}")
    fit = [n for n in eval_counts if need(n) <= longest["val"]]
    why = (f"a window needs n x {chunk_size} + {block_size} + 1 tokens and the longest validation "
           f"document of {where} has {longest['val']:,}")
    if task == "lm" and not fit:
        raise SystemExit(f"--eval_chunks / --final_eval_chunks: no chunk count can be evaluated: "
                         f"{why}")
    if fit != eval_counts and verbose:
        print(f"language modeling is not evaluated at {[n for n in eval_counts if n not in fit]} "
              f"chunks{' (passkeys are)' if task == 'mixed' else ''}: {why}")
    return fit


# ------------------------------------------------------------------------------------------------
# RULER's needle-in-a-haystack tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of
# Your Long-Context Language Models?"), written from its published templates and configuration
# (scripts/synthetic.yaml, scripts/data/synthetic/niah.py at commit c3f5e3b): a needle "One of the
# special magic numbers for {key} is: {value}." with a word key and a 7-digit value, in the
# passkey's filler ("noise", one copy a line) or in prose ("essay"). Ours: the essay is Python's
# reference documentation (pydoc, in every Python) in place of Paul Graham's essays, the keys are
# adjective-noun pairs from the lists below (RULER: wonderwords' lists), and the first asked
# needle sits at the cell's depth.
RULER_TASKS = {   # name: (haystack, keys with a needle, values per key, keys asked)
    "niah_single_1": ("noise", 1, 1, 1),
    "niah_single_2": ("essay", 1, 1, 1),
    "niah_multikey_1": ("essay", 4, 1, 1),
    "niah_multivalue": ("essay", 1, 4, 1),
    "niah_multiquery": ("essay", 4, 1, 4),
}
RULER_NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
               "There and back again.")
RULER_NEEDLE = "One of the special magic numbers for {key} is: {value}."
RULER_INTRO = ("Some special magic numbers are hidden within the following text. "
               "Make sure to memorize it. I will quiz you about the numbers afterwards.\n")
RULER_QUESTION = ("What are all the special magic numbers for {query} mentioned in the provided "
                  "text?")
RULER_ANSWER = " The special magic numbers for {query} mentioned in the provided text are"
ADJECTIVES = """amber brave calm dusty eager faint gaudy hollow icy jolly keen lively mellow
    nimble odd plain quiet rusty shy tidy upbeat vivid wary young zesty bitter clever damp
    elastic fuzzy gentle humble itchy jagged kind lean misty narrow oval proud rapid sandy tall
    ugly vast witty""".split()
NOUNS = """anchor basket candle drawer engine falcon garden harbor island jacket kettle ladder
    meadow needle orchard pencil quarry ribbon saddle tunnel umbrella valley wagon yard zipper
    beacon cabin dolphin feather glacier hammer lantern mirror nugget oyster parrot quilt rocket
    spoon tiger violin walnut""".split()


def ruler_wording(n_asked_values):
    # -> (intro, question, answer prefix), {query} to fill. RULER words them in the singular when
    # one value is asked ("A special magic number is hidden ...", "What is the special magic number
    # for ...", "... is"); the needles keep "numbers".
    texts = (RULER_INTRO, RULER_QUESTION, RULER_ANSWER)
    if n_asked_values > 1:
        return texts
    one = lambda s: (s.replace("Some", "A").replace("are all", "is").replace("are", "is")
                     .replace("numbers", "number"))
    return tuple(one(s) for s in texts)


def essay_sentences():
    # the essay haystack: Python's reference documentation as sentences (cached on the function)
    if not hasattr(essay_sentences, "cache"):
        import re
        from pydoc_data.topics import topics
        text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
        essay_sentences.cache = [s for s in re.split(r"(?<=[.!?]) ", text) if s]
    return essay_sentences.cache


def value_span(tok, needle_text, value):
    # -> the needle's tokens, and [start, end) of those that spell its value: from the first token
    # whose text reaches into the value to the first that completes it (BPE may glue a space on)
    ids = tok.encode(needle_text, bos=False)
    before = needle_text[:needle_text.index(value)]
    prefixes = range(len(ids) + 1)
    reaches = lambda i: len(tok.decode(ids[:i])) > len(before)
    start = bisect.bisect_left(prefixes, True, key=reaches) - 1
    end = bisect.bisect_left(prefixes, True, key=lambda i: before + value in tok.decode(ids[:i]))
    return ids, (start, end)


def fill_haystack(tok, first, room):
    # `room` tokens of haystack, as units (a separator and a sentence): the noise's lines (first
    # None), or the essay's sentences from sentence `first` on, each tokenized after its space.
    # -> the tokens, and the unit boundaries (where a needle may go in)
    essay = essay_sentences()
    if first is None:
        line = tok.encode("\n" + RULER_NOISE, bos=False)
        unit = lambda i: line
    else:
        unit = lambda i: tok.encode(" " + essay[(first + i) % len(essay)], bos=False)
    hay, cuts = [], [0]
    while len(hay) < room:
        hay += unit(len(cuts))
        cuts.append(len(hay))
    return hay[:room], [c for c in cuts if c <= room]


def ruler_sample(tok, rng, task, n_chunks, chunk_size, depth=None):
    # One haystack of a RULER task. X_C: the intro, then the haystack with the needles (the first
    # asked at `depth`, the others anywhere), n*C tokens; X_D: the question and the answer prefix.
    # -> context (n, C), idx (T,), the asked values (strings), their [start, end) in the flattened
    # context (the first asked first), question_len = T (all of X_D is the question)
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; expected one of {', '.join(RULER_TASKS)}")
    haystack, n_keys, n_values, n_asked = RULER_TASKS[task]
    depth = rng.random() if depth is None else depth
    keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], n_keys)
    values = {k: [str(rng.randint(10 ** 6, 10 ** 7 - 1)) for _ in range(n_values)] for k in keys}
    asked = rng.sample(keys, n_asked)
    sep = "\n" if haystack == "noise" else " "
    needles = []   # (tokens, the value's span in them, the value if asked else None)
    for k in sorted(keys, key=lambda k: k != asked[0]):          # the first asked first
        for v in values[k]:
            ids, span = value_span(tok, sep + RULER_NEEDLE.format(key=k, value=v), v)
            needles.append((ids, span, v if k in asked else None))
    query = asked[0] if n_asked == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    intro, question, answer = (t.format(query=query) for t in ruler_wording(n_asked * n_values))
    L = n_chunks * chunk_size
    head = tok.encode(intro.rstrip("\n"))   # BOS where the tokenizer has one; the haystack: sep
    room = L - len(head) - sum(len(ids) for ids, _, _ in needles)
    if room < 1:
        raise ValueError(f"{task}: a context of {L} tokens ({n_chunks} chunks x {chunk_size}) is "
                         f"too short for its intro and {len(needles)} needle(s): it needs more "
                         f"than {L - room} tokens (more chunks: eval.py --chunks)")
    first = rng.randrange(len(essay_sentences())) if haystack == "essay" else None
    hay, cuts = fill_haystack(tok, first, room)
    # each needle goes in at the unit boundary nearest its depth
    depths = [depth] + [rng.random() for _ in needles[1:]]
    at = [min(cuts, key=lambda c: abs(c - d * room)) for d in depths]
    ctx, spans, done = list(head), [], 0
    for i in sorted(range(len(needles)), key=lambda i: (at[i], i)):
        ctx, done = ctx + hay[done:at[i]], at[i]
        ids, (s, e), value = needles[i]
        if value is not None:
            spans.append((i, len(ctx) + s, len(ctx) + e))
        ctx += ids
    ctx += hay[done:]
    assert len(ctx) == L, (len(ctx), L)
    spans = [(s, e) for _, s, e in sorted(spans)]                # in needle order
    answers = [v for _, _, v in needles if v is not None]
    idx = tok.encode("\n" + question + answer, bos=False)
    ctx = torch.tensor(ctx).view(n_chunks, chunk_size)
    return ctx, torch.tensor(idx), answers, spans, len(idx)


def ruler_score(prediction, answers):
    # RULER's string_match_all: the share of the asked values that the answer holds (any case)
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


# ------------------------------------------------------------------------------------------------
# Training needles beyond the passkey (ours, for the retrieval recipes: --needles=mix). A reader
# trained on the passkey alone learns to copy what follows "The pass key is"; these teach it to
# copy the value after any question about any key: a fact hidden in the haystack, a question that
# names the fact's key in its own words, and an answer prefix; only the value's tokens are scored.
# RULER's wording is one template (with other keys: words of the essay, not RULER_TASKS' lists);
# the other four are ours, and put the key and value in other orders. Some haystacks hold up to
# three more facts of the same template with other keys: the reader must pick the asked one.
PASSKEY_SHARE = 1 / 3          # of needle batches' samples: the passkey itself
NEEDLE_TEMPLATES = [           # (fact, question, answer prefix)
    ("One of the special magic numbers for {key} is: {value}.",
     "What is the special magic number for {key} mentioned in the provided text?",
     "The special magic number for {key} mentioned in the provided text is"),
    ("The {key} is kept in locker number {value}.",
     "Which locker is the {key} kept in?", "The {key} is in locker number"),
    ("Remember that the secret code of the {key} is {value}.",
     "Tell me the {key}'s secret code.", "Its secret code is"),
    ("Room {value} is where you will find the {key}.",
     "In which room can I find the {key}?", "You will find the {key} in room"),
    ("We wrote the number {value} on the {key} yesterday.",
     "What did we write on the {key}?", "We wrote the number"),
]


def needle_words():
    # words that name a training key: the essay's lowercase words of 4-9 letters (cached)
    if not hasattr(needle_words, "cache"):
        words = {w for s in essay_sentences() for w in s.split() if w.isalpha() and w.islower()}
        needle_words.cache = sorted(w for w in words if 4 <= len(w) <= 9)
    return needle_words.cache


def needle_lengths(tok):
    # -> the most tokens 4 facts and one X_D of needle_sample take (keys: a fixed sample of 200)
    rng, words = random.Random(0), needle_words()
    keys = [f"{rng.choice(words)} {rng.choice(words)}" for _ in range(200)]
    most = lambda texts: max(len(tok.encode(t, bos=False)) for t in texts)
    fact = most(f"\n{f}".format(key=k, value=9999999) for f, _, _ in NEEDLE_TEMPLATES for k in keys)
    xd = most(f"\n{q} {a} 9999999".format(key=k) for _, q, a in NEEDLE_TEMPLATES for k in keys)
    return 4 * fact, xd - 1


def needle_sample(tok, rng, n_chunks, chunk_size, T=None):
    # One training haystack of a random template: X_C the filler or the essay with the asked fact at
    # a random depth (and up to 3 others); X_D the question, the answer prefix and the value,
    # tokenized as one text; only the value's tokens (from the space before it) are scored.
    # -> context (n, C), idx, targets, question_len (= the question and prefix: what the search
    # reads)
    fact, question, answer = rng.choice(NEEDLE_TEMPLATES)
    words = needle_words()
    keys, n_keys = [], rng.choice((1, 1, 2, 4))
    while len(keys) < n_keys:
        key = f"{rng.choice(words)} {rng.choice(words)}"
        keys += [key] if key not in keys else []
    digits = rng.randint(4, 7)                                   # RULER's values have 7
    values = [str(rng.randint(10 ** (digits - 1), 10 ** digits - 1)) for _ in keys]
    sep = "\n" if rng.random() < 0.5 else " "                   # the filler's lines or prose
    facts = [tok.encode(sep + fact.format(key=k, value=v), bos=False) for k, v in zip(keys, values)]
    L = n_chunks * chunk_size
    head = tok.encode("")                                        # BOS, where the tokenizer adds one
    room = L - len(head) - sum(map(len, facts))
    if room < 1:
        raise ValueError(f"a context of {L} tokens is too short for {len(facts)} needle(s) "
                         f"({L - room} tokens)")
    first = rng.randrange(len(essay_sentences()))                  # (drawn for the noise too)
    hay, cuts = fill_haystack(tok, None if sep == "\n" else first, room)
    at = sorted((rng.choice(cuts), i) for i in range(len(facts)))
    ctx, done = list(head), 0
    for cut, i in at:
        ctx, done = ctx + hay[done:cut] + facts[i], cut
    ctx += hay[done:]
    text = f"\n{question} {answer}".format(key=keys[0])
    ids, (start, end) = value_span(tok, f"{text} {values[0]}.", f" {values[0]}")
    xd = ids[:end]
    T = T or len(xd) - 1
    if T < len(xd) - 1:
        raise ValueError(f"block_size T={T} is too short for a needle's question and answer "
                         f"({len(xd) - 1} tokens)")
    filler = passkey_ids(tok)["filler"]
    xd = xd + (filler * (T // len(filler) + 2))[: T + 1 - len(xd)]            # not scored
    idx, targets = torch.tensor(xd[:-1]), torch.tensor(xd[1:])
    targets[: start - 1] = -100
    targets[end - 1:] = -100
    return torch.tensor(ctx).view(n_chunks, chunk_size), idx, targets, start
