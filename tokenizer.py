"""
The tokenizers this project uses, behind one interface: encode(text, bos, eos) -> ids, decode(ids) -> text,
bos_id, eos_id, vocab_size, and `spec`, a small dict of plain values that train.py stores in its checkpoints and
`tokenizer_from_spec` turns back into the tokenizer.

- ByteTokenizer: UTF-8 bytes, no file at all (the tiny from-scratch runs);
- GPT2Tokenizer: GPT-2 BPE through tiktoken. tiktoken downloads its BPE files once and caches them; offline, point
  TIKTOKEN_CACHE_DIR at a folder that holds them (cache file names are tiktoken's own);
- Tokenizer: a sentencepiece model, as LLaMA-2's tokenizer.model.
"""
import os


class Tokenizer:
    # sentencepiece, as LLaMA-2's tokenizer.model. sentencepiece never adds BOS itself; LLaMA-2 wants BOS (id 1).
    def __init__(self, path):
        import sentencepiece as spm
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer model not found: {path}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise ValueError(f"{path}: not a sentencepiece model ({e})") from None
        self.bos_id, self.eos_id, self.vocab_size = self.sp.bos_id(), self.sp.eos_id(), self.sp.vocab_size()
        self.spec = {"kind": "sentencepiece", "path": os.path.abspath(path)}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids):
        return self.sp.decode(list(ids))


class GPT2Tokenizer:
    # GPT-2 BPE through tiktoken; <|endoftext|> (50256) serves as both BOS and EOS.
    def __init__(self):
        import tiktoken
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise RuntimeError("tiktoken could not load the GPT-2 BPE files (offline?). Set TIKTOKEN_CACHE_DIR to a "
                               f"folder holding them; see tokenizer.py ({e.__class__.__name__}: {e})") from None
        self.bos_id = self.eos_id = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab
        self.spec = {"kind": "gpt2"}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + self.enc.encode_ordinary(text) + [self.eos_id] * eos

    def decode(self, ids):
        return self.enc.decode([i for i in ids if i < self.vocab_size])


class ByteTokenizer:
    # UTF-8 bytes 0..255, then BOS 256 and EOS 257. Needs no file: the tiny configs use it.
    bos_id, eos_id, vocab_size = 256, 257, 258
    spec = {"kind": "byte"}

    def encode(self, text, bos=True, eos=False):
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenizer_from_spec(spec):
    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "sentencepiece":
        return Tokenizer(spec["path"])
    raise ValueError(f"unknown tokenizer spec {spec!r}; expected kind 'byte', 'gpt2' or 'sentencepiece'")


