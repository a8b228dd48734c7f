"""
The tokenizers this project uses, behind one interface: encode(text, bos=None, eos=False) -> ids
(bos None = the checkpoint's own convention, `add_bos`), decode(ids) -> text, bos_id, eos_id,
vocab_size, and `spec`, a small dict of plain values that train.py stores in its checkpoints and
load_llama.tokenizer_from_spec turns back into it.

- ByteTokenizer: UTF-8 bytes, no file at all (the tiny from-scratch runs);
- GPT2Tokenizer: GPT-2 BPE through tiktoken. tiktoken downloads its BPE files once and caches them;
  offline, point TIKTOKEN_CACHE_DIR at a folder that holds them (cache file names are tiktoken's
  own);
- Tokenizer: a sentencepiece model, as LLaMA-2's tokenizer.model;
- BPETokenizer: the byte-level BPE of an HF tokenizer.json or a GGUF file (SmolLM2, Llama-3),
  through tiktoken;
- TiktokenTokenizer: Llama-3's own tokenizer.model, which is a tiktoken file (base64 token, rank =
  id, per line).
"""
import json
import os


class Tokenizer:
    # sentencepiece, as LLaMA-2's tokenizer.model. sentencepiece never adds BOS itself; LLaMA-2
    # wants BOS (id 1).
    def __init__(self, path):
        import sentencepiece as spm
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise ValueError(f"{path}: not a sentencepiece model ({e})") from None
        self.bos_id, self.eos_id, self.vocab_size = (self.sp.bos_id(), self.sp.eos_id(),
                                                     self.sp.vocab_size())
        self.add_bos = True
        self.spec = {"kind": "sentencepiece", "path": os.path.abspath(path)}

    def encode(self, text, bos=None, eos=False):
        return ([self.bos_id] * (self.add_bos if bos is None else bos) + self.sp.encode(text)
                + [self.eos_id] * eos)

    def decode(self, ids):
        return self.sp.decode(list(ids))


class GPT2Tokenizer:
    # GPT-2 BPE through tiktoken; <|endoftext|> (50256) serves as both BOS and EOS.
    def __init__(self):
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise RuntimeError("tiktoken could not load the GPT-2 BPE files (offline?). Set "
                               "TIKTOKEN_CACHE_DIR to a folder holding them; see tokenizer.py "
                               f"({e.__class__.__name__}: {e})") from None
        self.bos_id = self.eos_id = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab
        self.add_bos = True
        self.spec = {"kind": "gpt2"}

    def encode(self, text, bos=None, eos=False):
        return ([self.bos_id] * (self.add_bos if bos is None else bos)
                + self.enc.encode_ordinary(text) + [self.eos_id] * eos)

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i < self.vocab_size])


class ByteTokenizer:
    # UTF-8 bytes 0..255, then BOS 256 and EOS 257. Needs no file: the tiny configs use it.
    bos_id, eos_id, vocab_size, add_bos = 256, 257, 258, True
    spec = {"kind": "byte"}

    def encode(self, text, bos=None, eos=False):
        return ([self.bos_id] * (self.add_bos if bos is None else bos)
                + list(text.encode("utf-8")) + [self.eos_id] * eos)

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def bytes_to_unicode():
    # GPT-2's reversible map from the 256 byte values to printable characters: byte-level BPE
    # vocabularies (HF tokenizer.json, GGUF "gpt2") write every token in it. Printable Latin-1 bytes
    # stand for themselves.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


# pre-tokenizer patterns: text is cut into pieces by a regex first; BPE never merges across pieces
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# the same after a Digits(individual_digits) pre-tokenizer (SmolLM2): every digit is a piece of its
# own, and a piece also ends before a digit (hence the lookahead that lets trailing whitespace stop
# there)
DIGITS_PATTERN = (r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+"""
                  r"""|\s+(?![^\s\p{N}])|\s+""")


class BPETokenizer:
    # Byte-level BPE with the checkpoint's own vocabulary, merges and ids, run by tiktoken (no
    # `tokenizers` needed). tiktoken merges the adjacent pair whose merged token has the lowest
    # rank, which is exactly HF's "apply the earliest merge first" when the rank is the merge's
    # position: bytes get ranks 0..255, merge i gets 256 + i, and a table maps ranks back to the
    # checkpoint's ids. Special-token strings inside a text are encoded as plain text.
    def __init__(self, vocab, merges, pattern, specials, bos_id, eos_id, add_bos, source):
        import numpy as np
        import tiktoken
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        ranks, id_of_rank = {}, []
        # a byte the vocabulary lacks (SmolLM2: 21 control and non-UTF-8 bytes) is dropped from the
        # ids, as HF's BPE without unk does
        for b, c in bytes_to_unicode().items():
            ranks[bytes([b])] = b
            id_of_rank.append(vocab.get(c, -1))
        for i, (a, b) in enumerate(merges):
            if a + b not in vocab:
                raise ValueError(f"{source}: merge #{i} ({a!r}, {b!r}) makes {a + b!r}, which is "
                                 "not in the vocabulary")
            ranks[bytes(byte_of[ch] for ch in a + b)] = 256 + i
            id_of_rank.append(vocab[a + b])
        special_ranks = {s: len(id_of_rank) + j for j, s in enumerate(specials)}
        id_of_rank += list(specials.values())
        self.enc = tiktoken.Encoding(name=source, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=special_ranks)
        self.id_of_rank = np.array(id_of_rank)
        self.rank_of_id = {i: r for r, i in enumerate(id_of_rank)}
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        # for to_tokenizer_json
        self.vocab, self.merges, self.specials, self.pattern = vocab, merges, specials, pattern
        self.vocab_size = max(max(vocab.values()), *specials.values()) + 1
        self.spec = {"kind": "bpe", "path": os.path.abspath(source)}

    def encode(self, text, bos=None, eos=False):
        bos = self.add_bos if bos is None else bos
        ids = self.id_of_rank[self.enc.encode_ordinary(text)] if text else self.id_of_rank[:0]
        ids = ids[ids >= 0].tolist()
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids):
        return self.enc.decode_bytes([self.rank_of_id[i] for i in ids
                                      if i in self.rank_of_id]).decode("utf-8", "replace")


# HF tokenizer.json pre-tokenizers this reads, as tiktoken patterns (and back, for writing one)
GGUF_PRE = {"gpt2": GPT2_PATTERN,   # GGUF tokenizer.ggml.pre -> the same regexes
            "smollm": DIGITS_PATTERN}


def pattern_of(pre, source):
    kind = (pre or {}).get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", []) if kind == "Sequence" else []
    kinds = [p.get("type") for p in steps]
    if (kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and steps[1].get("use_regex", True)):
        return DIGITS_PATTERN
    if (kinds == ["Split", "ByteLevel"] and steps[0].get("behavior") == "Isolated"
            and not steps[1].get("use_regex", True)):
        # Llama-3: the regex itself, then bytes mapped without a second split
        return steps[0]["pattern"]["Regex"]
    raise ValueError(f"{source}: pre_tokenizer {json.dumps(pre)[:200]} is not supported "
                     "(byte-level BPE with the GPT-2 regex, individual digits, or a Split regex)")


def pretokenizer_json(pattern):
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    if pattern == GPT2_PATTERN:
        return byte_level
    if pattern == DIGITS_PATTERN:
        return {"type": "Sequence",
                "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    return {"type": "Sequence",
            "pretokenizers": [{"type": "Split", "pattern": {"Regex": pattern},
                               "behavior": "Isolated", "invert": False},
                              {**byte_level, "use_regex": False}]}


# Llama-3's pre-tokenizer regex and its 256 special tokens after the BPE ids (Meta's tokenizer.py;
# 3.1 renamed a few reserved ones, which changes no id)
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|reserved_special_token_2|>",
                   "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|reserved_special_token_4|>", "<|eot_id|>"] + \
                  [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]


def is_tiktoken_file(path):
    # a tiktoken BPE file is text, "base64 rank" per line; a sentencepiece model is a binary
    # protobuf
    with open(path, "rb") as f:
        first = f.readline(1000).split()
    return len(first) == 2 and first[1].isdigit() and all(
        c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=" for c in first[0])


class TiktokenTokenizer:
    # Llama-3's tokenizer.model: tiktoken's own format, so tiktoken runs it as it is; BOS
    # <|begin_of_text|> is added
    def __init__(self, path, bos_id=None, eos_id=None):
        import base64
        import tiktoken
        try:
            ranks = {base64.b64decode(tok): int(rank)
                     for tok, rank in (line.split() for line in open(path, "rb") if line.strip())}
        except (ValueError, OSError) as e:
            raise ValueError(f"{path}: not a tiktoken BPE file "
                             f"({e.__class__.__name__}: {e})") from None
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise ValueError(f"{path}: tiktoken ranks must be 0..{n - 1} with none missing")
        self.specials = {s: n + i for i, s in enumerate(LLAMA3_SPECIALS)}
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=LLAMA3_PATTERN,
                                     mergeable_ranks=ranks, special_tokens=self.specials)
        self.bos_id = self.specials["<|begin_of_text|>"] if bos_id is None else bos_id
        self.eos_id = self.specials["<|end_of_text|>"] if eos_id is None else eos_id
        self.vocab_size, self.add_bos = n + len(LLAMA3_SPECIALS), True
        self.spec = {"kind": "tiktoken", "path": os.path.abspath(path)}

    def encode(self, text, bos=None, eos=False):
        return ([self.bos_id] * (self.add_bos if bos is None else bos)
                + self.enc.encode_ordinary(text) + [self.eos_id] * eos)

    def decode(self, ids):
        return self.enc.decode_bytes([i for i in ids
                                      if i < self.vocab_size]).decode("utf-8", "replace")


def from_tokenizer_json(path, bos_id=None, eos_id=None):
    # an HF tokenizer.json of model type BPE (byte-level). BOS/EOS ids come from the caller
    # (config.json) when known; whether BOS is added comes from the post-processor, as HF does it.
    try:
        t = json.load(open(path, encoding="utf-8"))
        m = t["model"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a tokenizer.json ({e.__class__.__name__}: {e})") from None
    if m.get("type") != "BPE":
        raise ValueError(f"{path}: model.type is {m.get('type')!r}; only byte-level 'BPE' "
                         "tokenizers are supported")
    if t.get("normalizer"):
        raise ValueError(f"{path}: normalizer {t['normalizer'].get('type')!r} is not supported "
                         "(byte-level BPE has none)")
    merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
    specials = {a["content"]: a["id"] for a in t.get("added_tokens", [])}
    post = json.dumps(t.get("post_processor") or {})
    by_name = {v: k for k, v in specials.items()}
    add_bos = bos_id is not None and by_name.get(bos_id, "\0") in post
    return BPETokenizer(m["vocab"], merges, pattern_of(t.get("pre_tokenizer"), path), specials,
                        bos_id, eos_id, add_bos, path)


def to_tokenizer_json(tok):
    # the HF tokenizer.json of a BPETokenizer: what `tokenizers` and from_tokenizer_json read back
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for s, i in sorted(tok.specials.items(), key=lambda x: x[1])]
    post = None
    if tok.add_bos:
        bos = next(s for s, i in tok.specials.items() if i == tok.bos_id)
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": pretokenizer_json(tok.pattern),
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": tok.vocab, "merges": [list(m) for m in tok.merges]}}


def from_gguf_metadata(meta, path):
    # the tokenizer a GGUF file describes in its tokenizer.ggml.* metadata (llama.cpp's names)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') "
                         "is supported yet")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre"):
        if key not in meta:
            raise ValueError(f"{path}: missing metadata key {key!r}")
    pre = meta["tokenizer.ggml.pre"]
    if pre not in GGUF_PRE:
        raise ValueError(f"{path}: tokenizer.ggml.pre is {pre!r}; supported: {sorted(GGUF_PRE)}")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    # llama.cpp: 3 control, 4 user-defined
    special = {i for i, t in enumerate(types) if t in (3, 4)}
    vocab = {s: i for i, s in enumerate(tokens) if i not in special}
    return BPETokenizer(vocab, [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]],
                        GGUF_PRE[pre], {tokens[i]: i for i in sorted(special)},
                        meta.get("tokenizer.ggml.bos_token_id"),
                        meta.get("tokenizer.ggml.eos_token_id"),
                        bool(meta.get("tokenizer.ggml.add_bos_token")), path)
