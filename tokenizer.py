"""
The tokenizers, behind one interface: encode(text, bos=None, eos=False) -> ids (bos None: the
checkpoint's own convention, `add_bos`), decode(ids) -> text, bos_id, eos_id, vocab_size, and
`spec`, what load_llama.load_tokenizer reads back (train.py stores it in its checkpoints).

- ByteTokenizer: UTF-8 bytes, no file at all (the tiny from-scratch runs);
- SentencePieceTokenizer: a sentencepiece model, as LLaMA-2's tokenizer.model;
- BPETokenizer: the byte-level BPE of an HF tokenizer.json or a GGUF file (SmolLM2), run by
  tiktoken.
"""
import json


class Tokenizer:
    bos_id = eos_id = None
    add_bos = True

    def encode(self, text, bos=None, eos=False):
        return ([self.bos_id] * (self.add_bos if bos is None else bos) + self.ids(text)
                + [self.eos_id] * eos)


class ByteTokenizer(Tokenizer):
    # UTF-8 bytes 0..255, then BOS 256 and EOS 257
    bos_id, eos_id, vocab_size, spec = 256, 257, 258, "byte"

    def ids(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    # LLaMA-2's tokenizer.model. sentencepiece never adds BOS itself; LLaMA-2 wants BOS (id 1).
    def __init__(self, path):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.bos_id, self.eos_id, self.vocab_size = (self.sp.bos_id(), self.sp.eos_id(),
                                                     self.sp.vocab_size())

    def ids(self, text):
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(list(ids))


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


class BPETokenizer(Tokenizer):
    # Byte-level BPE with the checkpoint's own vocabulary, merges and ids, run by tiktoken (no
    # `tokenizers` needed). tiktoken merges the adjacent pair whose merged token has the lowest
    # rank, which is exactly HF's "apply the earliest merge first" when the rank is the merge's
    # position: bytes get ranks 0..255, merge i gets 256 + i, and a table maps ranks back to the
    # checkpoint's ids. Special-token strings inside a text are encoded as plain text.
    def __init__(self, vocab, merges, pattern, specials, bos_id, eos_id, add_bos, source):
        import numpy as np
        import tiktoken
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        # a byte the vocabulary lacks (SmolLM2: 21 control and non-UTF-8 bytes) is dropped from the
        # ids, as HF's BPE without unk does
        ranks = {bytes([b]): b for b in range(256)}
        id_of_rank = [vocab.get(c, -1) for c in bytes_to_unicode().values()]
        for i, (a, b) in enumerate(merges):
            ranks[bytes(byte_of[ch] for ch in a + b)] = 256 + i
            id_of_rank.append(vocab[a + b])
        special_ranks = {s: len(id_of_rank) + j for j, s in enumerate(specials)}
        id_of_rank += list(specials.values())
        self.enc = tiktoken.Encoding(name=source, pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=special_ranks)
        self.id_of_rank = np.array(id_of_rank)
        self.rank_of_id = {i: r for r, i in enumerate(id_of_rank)}
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.vocab_size = max(max(vocab.values()), *specials.values()) + 1

    def ids(self, text):
        ids = self.id_of_rank[self.enc.encode_ordinary(text)] if text else self.id_of_rank[:0]
        return ids[ids >= 0].tolist()

    def decode(self, ids):
        return self.enc.decode_bytes([self.rank_of_id[i] for i in ids
                                      if i in self.rank_of_id]).decode("utf-8", "replace")


def pattern_of(pre, source):   # an HF tokenizer.json pre-tokenizer as a tiktoken pattern
    kind = (pre or {}).get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", []) if kind == "Sequence" else []
    if ([p.get("type") for p in steps] == ["Digits", "ByteLevel"]
            and steps[0].get("individual_digits") and steps[1].get("use_regex", True)):
        return DIGITS_PATTERN
    raise ValueError(f"{source}: pre_tokenizer {json.dumps(pre)[:200]} is not supported "
                     "(byte-level BPE with the GPT-2 regex, or individual digits first)")


def read_json(path):   # a damaged file is named (json's own error says only where in the text)
    try:
        return json.load(open(path, encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def from_tokenizer_json(path, bos_id=None, eos_id=None):
    # an HF tokenizer.json of model type BPE (byte-level). BOS/EOS ids come from the caller
    # (config.json) when known; whether BOS is added comes from the post-processor, as HF does it.
    t = read_json(path)
    m = t["model"]
    if m.get("type") != "BPE" or t.get("normalizer"):
        raise ValueError(f"{path}: not a byte-level BPE tokenizer (model {m.get('type')!r}, "
                         f"normalizer {t.get('normalizer')})")
    merges = [tuple(x.split(" ")) if isinstance(x, str) else tuple(x) for x in m["merges"]]
    specials = {a["content"]: a["id"] for a in t.get("added_tokens", [])}
    by_id = {v: k for k, v in specials.items()}
    add_bos = bos_id is not None and by_id.get(bos_id, "\0") in json.dumps(t.get("post_processor"))
    return BPETokenizer(m["vocab"], merges, pattern_of(t.get("pre_tokenizer"), path), specials,
                        bos_id, eos_id, add_bos, path)


def from_gguf_metadata(meta, path):
    # the tokenizer a GGUF file describes in its tokenizer.ggml.* metadata (llama.cpp's names)
    patterns = {"gpt2": GPT2_PATTERN, "smollm": DIGITS_PATTERN}   # tokenizer.ggml.pre
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in patterns:
        raise ValueError(f"{path}: tokenizer {kind!r}, pre-tokenizer {pre!r}; only byte-level "
                         f"BPE ('gpt2') with {sorted(patterns)} is supported")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    special = {i for i, t in enumerate(types) if t in (3, 4)}   # llama.cpp: control, user-defined
    vocab = {s: i for i, s in enumerate(tokens) if i not in special}
    return BPETokenizer(vocab, [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]],
                        patterns[pre], {tokens[i]: i for i in sorted(special)},
                        meta.get("tokenizer.ggml.bos_token_id"),
                        meta.get("tokenizer.ggml.eos_token_id"),
                        bool(meta.get("tokenizer.ggml.add_bos_token")), path)
