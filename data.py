"""
Data for train.py, eval.py and sample.py, with no download.

- Long documents for language modeling: by default the Python standard library's own .py files
  (on every machine with Python; many are 20K-100K tokens, and code is what the paper's CodeParrot
  column measures), or every .txt file under `data_dir`; several sources joined by commas are
  sampled evenly. Tokenized once into a memory-mapped token file plus document offsets (nanoGPT's
  prepare.py), split into train/val by document.
- Passkey retrieval (the Landmark / LongLoRA format): a 5-digit random key at a given depth inside
  the context, filler around it, the question in X_D; only the answer tokens are scored.
  Facts of our own templates in training text, asked in other words (training only).
- RULER's eight needle-in-a-haystack tasks (eval.py --task=ruler), for evaluation only.

A sample is (context (n, C), idx (T,), targets (T,), question_len): X_C precedes X_D in the same
document; question_len is how many leading tokens of X_D are the question (0 for language
modeling).
"""
import bisect
import functools
import glob
import hashlib
import json
import os
import re
import sysconfig
import uuid

import numpy as np
import torch

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "   # then the key (passkey_question)


def corpus_files(data_dir=""):
    # one source -> its files: a folder (every .txt below it), a glob pattern, one file, "stdlib"
    # (or "": the standard library's .py) or "pydoc" (the reference docs every Python ships)
    if data_dir in ("", "stdlib"):
        return sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if data_dir == "pydoc":
        return [os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")]
    if os.path.isfile(data_dir):
        return [data_dir]
    pattern = os.path.join(data_dir, "**", "*.txt") if os.path.isdir(data_dir) else data_dir
    files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise FileNotFoundError(f"data_dir={data_dir}: no such folder, file or .txt files")
    return files


def source_texts(source, files):
    # the documents of one source, as text. pydoc's ~80 topics (460K characters) become 4 documents
    # of 100K characters or more (topics in alphabetical order), long enough for long contexts.
    if source != "pydoc":
        return [open(f, encoding="utf-8", errors="replace").read() for f in files]
    from pydoc_data.topics import topics
    docs = [""]
    for name in sorted(topics):
        if len(docs[-1]) >= 100_000:
            docs.append("")
        docs[-1] += topics[name] + "\n\n"
    return docs if len(docs) < 2 or len(docs[-1]) >= 100_000 else docs[:-2] + [docs[-2] + docs[-1]]


def prepare(tok, data_dir="", cache_dir="data_cache", val_every=10, splits=("train", "val")):
    # -> {"train": (tokens, offsets[, source]), "val": (...)}; offsets[i]:offsets[i+1] is
    # document i; with several comma-separated sources, source[i] is the source document i came
    # from (lm_sample draws sources evenly)
    sources = data_dir.split(",") if data_dir else [""]
    files = [corpus_files(src) for src in sources]
    # the cache's name: the tokenizer, the sources and their files
    sig = json.dumps([tok.spec, sources, [(f, os.path.getsize(f)) for fs in files for f in fs]])
    key = hashlib.sha1(sig.encode()).hexdigest()[:12]
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    out = {}
    for split in splits:
        path = os.path.join(cache_dir, f"{key}_{split}")
        if not os.path.exists(path + ".offsets.npy"):
            write_split(tok, sources, files, split, path, cache_dir, dtype, val_every)
        offsets = np.load(path + ".offsets.npy")
        out[split] = (np.memmap(path + ".bin", dtype=dtype, mode="r"), offsets)
        if len(sources) > 1:
            out[split] += (np.load(path + ".source.npy"),)
    return out


def write_split(tok, sources, files, split, path, cache_dir, dtype, val_every):
    # one split's documents, tokenized (BOS as the tokenizer has it): path.bin, .offsets/.source.npy
    docs, source = [], []
    for s, (src, fs) in enumerate(zip(sources, files)):
        texts = source_texts(src, fs)   # every val_every-th is validation (else a source's last)
        val = [i % val_every == val_every - 1 or i == len(texts) - 1 < val_every - 1
               for i in range(len(texts))]
        picked = [tok.encode(t) for t, v in zip(texts, val) if v == (split == "val")]
        docs, source = docs + picked, source + [s] * len(picked)
    if not docs:
        raise ValueError(f"{','.join(sources) or 'stdlib'}: no document for the {split} split "
                         f"(every {val_every}th document of a source is held out for validation)")
    offsets = np.cumsum([0] + [len(d) for d in docs])
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"   # per process: two runs preparing at once never share a file
    with open(tmp, "wb") as f:
        f.write(np.concatenate(docs).astype(dtype).tobytes())
    os.replace(tmp, path + ".bin")
    for ext, arr in [(".source.npy", source)] * (len(sources) > 1) + [(".offsets.npy", offsets)]:
        with open(tmp, "wb") as f:
            np.save(f, np.array(arr))
        os.replace(tmp, path + ext)   # the offsets last: their file means the cache is complete
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
    return ctx, w[n_chunks * chunk_size:-1], w[n_chunks * chunk_size + 1:], 0   # no question


def filler_ids(tok):   # the filler's tokens, once per tokenizer
    if not hasattr(tok, "filler"):
        tok.filler = tok.encode(FILLER, bos=False)
    return tok.filler


def passkey_question(tok, key):
    # -> (question ids, answer ids) of X_D. The question and the key are tokenized as ONE text that
    # ends as the needle's first sentence does, "The pass key is 12345.", so the answer's tokens are
    # exactly the needle's: a tokenizer may fold the space into the key (GPT-2: ' 735', '12') or
    # make a token of it ('▁', '7', ...): it does the same in both. The question is every token
    # before the key's first (value_span).
    ids, (start, end) = value_span(tok, f"{QUESTION}{key}.", str(key))
    return ids[:start], ids[start:end]


def passkey_sample(tok, rng, n_chunks, chunk_size, T=None, depth=None, key=None):
    # X_C: filler with the needle at `depth` (0 = start, 1 = end of the context); X_D: the question
    # + the key. Only the key's tokens are scored. The needle always lies wholly inside X_C.
    filler = filler_ids(tok)
    key = rng.randint(10000, 99999) if key is None else key
    depth = rng.random() if depth is None else depth
    needle = tok.encode(NEEDLE.format(key=key), bos=False)
    L = n_chunks * chunk_size
    if L < len(needle) + 1:
        raise ValueError(f"context of {L} tokens is too short for the passkey needle "
                         f"({len(needle) + 1} tokens)")
    head = tok.encode("")                                     # BOS, where the tokenizer adds one
    hay = head + filler * (L // len(filler) + 1)
    at = len(head) + round(depth * (L - len(needle) - len(head)))
    ctx = (hay[:at] + needle + hay[at:])[:L]
    question, answer = passkey_question(tok, key)
    xd = question + answer
    T = T or len(xd) - 1
    if T < len(xd) - 1:
        raise ValueError(f"block_size T={T} is too short for the passkey question and answer "
                         f"({len(xd) - 1} tokens)")
    # pad after the answer: not scored
    xd = xd + (filler * (T // len(filler) + 2))[: T + 1 - len(xd)]
    idx, targets = torch.tensor(xd[:-1]), torch.tensor(xd[1:])
    targets[: len(question) - 1] = -100   # score only the answer tokens
    targets[len(question) - 1 + len(answer):] = -100
    return torch.tensor(ctx).view(n_chunks, chunk_size), idx, targets, len(question)


# Facts asked in other words (ours, in place of the paper's SFT data; RULER's wording is for
# evaluation only): (the fact, its question, the answer's first words).
FACTS = [("The {key} is kept in locker number {value}.", "Which locker is the {key} kept in?",
          "The {key} is in locker number"),
         ("Remember that the secret code of the {key} is {value}.",
          "Tell me the {key}'s secret code.", "Its secret code is"),
         ("Room {value} is where you will find the {key}.", "In which room can I find the {key}?",
          "You will find the {key} in room"),
         ("We wrote {value} on the {key} yesterday.", "What did we write on the {key}?",
          "We wrote"),
         ("The {key} left its tag {value} by the door.", "Which tag did the {key} leave?",
          "The tag the {key} left is")]


def fact_sample(tok, rng, split, n_chunks, chunk_size):
    # A text of the split (lm_sample's X_C) with 1-4 facts of one template at random places, each
    # of its own key (two words of the essay); X_D: one asked, then its value (4-7 digits, or a
    # UUID), the only tokens scored.
    fact, question, answer = rng.choice(FACTS)
    words = [w for s in essay_sentences()[:400] for w in s.split() if w.isalpha() and len(w) > 3]
    keys = [f"{rng.choice(words)} {rng.choice(words)}" for _ in range(rng.randint(1, 4))]
    values = [ruler_draw(rng, "uuids") if rng.random() < 0.1 else   # (a UUID: ~37 tokens of X_D)
              str(rng.randint(10 ** 3, 10 ** rng.randint(4, 7) - 1)) for _ in keys]
    needles = [tok.encode(f"\n{fact.format(key=k, value=v)}\n", bos=False)
               for k, v in zip(keys, values)]
    ctx = lm_sample(split, rng, n_chunks, chunk_size, 0)[0].flatten().tolist()
    room = len(ctx) - sum(map(len, needles))
    if room < 0 or len(set(keys)) < len(keys):   # (a key drawn twice: asked, it has two answers)
        return fact_sample(tok, rng, split, n_chunks, chunk_size)
    for at, ids in sorted(zip((rng.randrange(room + 1) for _ in needles), needles), reverse=True):
        ctx[at:at] = ids
    ids, (start, end) = value_span(tok, f"\n{question} {answer} {values[0]}".format(
        key=keys[0]), values[0])
    idx, targets = torch.tensor(ids[:end - 1]), torch.tensor(ids[1:end])
    targets[:start - 1] = -100
    return torch.tensor(ctx[:n_chunks * chunk_size]).view(n_chunks, chunk_size), idx, targets, start


def key_mentions(ctx, answer):
    # where a haystack (a list of tokens) names its key: [start, end) of every run of the answer's
    # tokens, as passkey_question made them (the needle names the key twice)
    k = len(answer)
    return [(i, i + k) for i in range(len(ctx) - k + 1) if ctx[i:i + k] == answer]


def key_placement(nodes, mentions, C):
    # Where the tree left one haystack's key: "leaf" if a node of the finest level holds a whole
    # mention, "coarse" if every token of every mention is in a level-1 node (where the search did
    # not go), else "between". nodes: per chunk, its tree.Nodes; mentions: [start, end) in X_C.
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


def placement(nodes, values, C):
    # where a tree left each asked value -> shares of "leaf", "between", "coarse": nodes as in
    # key_placement; values, each value's mentions (a passkey: one value, named twice)
    found = dict(leaf=0.0, between=0.0, coarse=0.0)
    for mentions in values:
        found[key_placement(nodes, mentions, C)] += 1 / len(values)
    return found


def collate(samples, tok):
    # samples -> context (B, n, C), idx (B, T), targets (B, T), question_len (B,). Questions made
    # without a T are as long as their question and answer, which differ (GPT-2 BPE: a key of 2 or
    # 3 tokens): the shorter go on with filler after their answer, as a longer T makes them.
    T = max(len(s[1]) for s in samples)
    filler = filler_ids(tok) * (T // len(filler_ids(tok)) + 1)
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
    # kind: "lm" | "passkey" | "mix" (the passkey in 1 sample of 3, facts in 2) -> context (B,n,C),
    # idx (B, T), targets (B, T), question_len (B,) (T None, and in "mix": questions as long as
    # their question and answer, padded to the longest; the unscored pad only costs time)
    if kind == "lm":
        return collate([lm_sample(splits[split], rng, n_chunks, chunk_size, T) for _ in range(B)],
                       tok)
    return collate([fact_sample(tok, rng, splits[split], n_chunks, chunk_size)
                    if kind == "mix" and rng.random() > 1 / 3 else passkey_sample(
                        tok, rng, n_chunks, chunk_size, None if kind == "mix" else T)
                    for _ in range(B)], tok)


def exact_match(logits, targets):   # (B, T, vocab), (B, T) -> (B,): every scored token the argmax
    return ((logits.argmax(-1) == targets) | (targets == -100)).all(-1)


# ------------------------------------------------------------------------------------------------
# RULER's needle-in-a-haystack tasks (Hsieh et al., 2024), from its published templates and
# configuration (scripts/synthetic.yaml, scripts/data/synthetic/niah.py at commit c3f5e3b): a
# needle's key and value words, 7 digits or UUIDs, in the passkey's filler ("noise"), in prose
# ("essay") or among other needles ("needle"). Ours: the essay is Python's reference documentation
# (pydoc, in every Python), not Paul Graham's; word keys: adjective-noun pairs of the lists below.
RULER_TASKS = {   # name: (haystack, keys, values, keys with a needle, values per key, keys asked)
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
RULER_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
RULER_INTRO = ("Some special magic {kind} are hidden within the following text. "
               "Make sure to memorize it. I will quiz you about the {kind} afterwards.\n")
RULER_QUESTION = ("What are all the special magic {kind} for {query} mentioned in the provided "
                  "text?")
RULER_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
ADJECTIVES = """amber brave calm dusty eager faint gaudy hollow icy jolly keen lively mellow
    nimble odd plain quiet rusty shy tidy upbeat vivid wary young zesty bitter clever damp
    elastic fuzzy gentle humble itchy jagged kind lean misty narrow oval proud rapid sandy tall
    ugly vast witty""".split()
NOUNS = """anchor basket candle drawer engine falcon garden harbor island jacket kettle ladder
    meadow needle orchard pencil quarry ribbon saddle tunnel umbrella valley wagon yard zipper
    beacon cabin dolphin feather glacier hammer lantern mirror nugget oyster parrot quilt rocket
    spoon tiger violin walnut""".split()


def ruler_wording(n_asked_values, kind="numbers"):
    # -> (intro, question, answer prefix), {query} to fill. RULER words them in the singular when
    # one value is asked ("A special magic number is hidden ...", "What is the special magic number
    # for ...", "... is"); the needles keep the plural ("numbers", "uuids").
    texts = tuple(t.replace("{kind}", kind) for t in (RULER_INTRO, RULER_QUESTION, RULER_ANSWER))
    if n_asked_values > 1:
        return texts
    one = lambda s: (s.replace("Some", "A").replace("are all", "is").replace("are", "is")
                     .replace(kind, kind[:-1]))
    return tuple(one(s) for s in texts)


def ruler_draw(rng, kind):   # a key or value: a word pair, 7 digits, or a UUID (RULER's kinds)
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@functools.lru_cache
def essay_sentences():   # the essay haystack: Python's reference documentation as sentences
    from pydoc_data.topics import topics
    text = re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
    return [s for s in re.split(r"(?<=[.!?]) ", text) if s]


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


def ruler_sample(tok, rng, task, n_chunks, chunk_size, depth=None):
    # One haystack of a RULER task. X_C: the intro, then the haystack with the needles (the first
    # asked at `depth`, the others anywhere), n*C tokens; X_D: the question and the answer prefix.
    # -> context (n, C), idx (T,), the asked values (strings), their [start, end) in the flattened
    # context (the first asked first), question_len = T (all of X_D is the question)
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; expected one of {', '.join(RULER_TASKS)}")
    haystack, key_kind, kind, n_keys, n_values, n_asked = RULER_TASKS[task]
    depth = rng.random() if depth is None else depth
    keys = (rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], n_keys)
            if key_kind == "words" else [ruler_draw(rng, key_kind) for _ in range(n_keys)])
    values = {k: [ruler_draw(rng, kind) for _ in range(n_values)] for k in keys}
    asked = rng.sample(keys, n_asked)
    sep = " " if haystack == "essay" else "\n"
    needles = []   # (tokens, the value's span in them, the value if asked else None)
    for k in sorted(keys, key=lambda k: k != asked[0]):          # the first asked first
        for v in values[k]:
            ids, span = value_span(tok, sep + RULER_NEEDLE.format(kind=kind, key=k, value=v), v)
            needles.append((ids, span, v if k in asked else None))
    query = asked[0] if n_asked == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    intro, question, answer = (t.format(query=query)
                               for t in ruler_wording(n_asked * n_values, kind))
    L = n_chunks * chunk_size
    head = tok.encode(intro.rstrip("\n"))   # BOS where the tokenizer has one; the haystack: sep
    room = L - len(head) - sum(len(ids) for ids, _, _ in needles)
    if room < 1:
        raise ValueError(f"{task}: {n_chunks} chunks x {chunk_size} tokens cannot hold its intro "
                         f"and {len(needles)} needle(s), {L - room + 1} tokens: ask more --chunks")
    if haystack == "noise":   # RULER's noise: the passkey's filler, a line at a time
        line = tok.encode("\n" + FILLER.strip(), bos=False)
        unit = lambda i: line
    elif haystack == "essay":   # sentences from a random one on, each after its space
        essay, first = essay_sentences(), rng.randrange(len(essay_sentences()))
        unit = lambda i: tok.encode(" " + essay[(first + i) % len(essay)], bos=False)
    else:   # other needles, drawn here (a drawn key equal to a task's key: drawn again)
        other = lambda: next(k for k in iter(lambda: ruler_draw(rng, key_kind), None)
                             if k not in keys)
        unit = lambda i: tok.encode("\n" + RULER_NEEDLE.format(
            kind=kind, key=other(), value=ruler_draw(rng, kind)), bos=False)
    hay, cuts = [], [0]   # `room` tokens of haystack, unit by unit: a needle goes in at a cut
    while len(hay) < room:
        hay += unit(len(cuts))
        cuts.append(len(hay))
    hay, cuts = hay[:room], [c for c in cuts if c <= room]
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
