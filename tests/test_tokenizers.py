# The three tokenizers behind one interface. Files come from ../shared/data/tokenizers when it
# exists.
import os

import pytest

from conftest import SHARED_TOKENIZERS
from load_llama import tokenizer_from_spec
from tokenizer import ByteTokenizer, GPT2Tokenizer, Tokenizer

SPM = os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")
TIKTOKEN_DIR = os.path.join(SHARED_TOKENIZERS, "tiktoken")


@pytest.mark.skipif(not os.path.isfile(SPM), reason="shared tokenizer files not present")
def test_sentencepiece_llama_format():
    tok = Tokenizer(SPM)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    # BOS added by us, not by sentencepiece
    assert tok.encode("Hello world") == [1, 22557, 1526]
    assert tok.encode("Hello world", bos=False, eos=True) == [22557, 1526, 2]
    text = "Passkey 12345:\n\tindented  text, émoji 🙂"
    assert tok.decode(tok.encode(text)) == text
    assert tokenizer_from_spec(tok.spec).encode("Hello world") == [1, 22557, 1526]


@pytest.mark.skipif(not os.path.isdir(TIKTOKEN_DIR), reason="shared tokenizer files not present")
def test_gpt2_bpe(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", TIKTOKEN_DIR)
    tok = GPT2Tokenizer()
    assert tok.vocab_size == 50257 and tok.bos_id == tok.eos_id == 50256
    assert tok.encode("hello world", bos=False) == [31373, 995]
    assert tok.encode("hello world", eos=True) == [50256, 31373, 995, 50256]
    assert tok.decode(tok.encode("hello world")) == "<|endoftext|>hello world"


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("pass key 7é")
    assert ids[0] == 256 and max(ids) == 256 and len(ids) == 1 + len("pass key 7é".encode())
    assert tok.decode(ids + [257]) == "pass key 7é"
    assert tokenizer_from_spec({"kind": "byte"}).vocab_size == 258


def test_bad_tokenizer_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer model not found: .*missing.model"):
        Tokenizer(str(tmp_path / "missing.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ValueError, match="bad.model: not a sentencepiece model"):
        Tokenizer(str(bad))
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        tokenizer_from_spec({"kind": "wordpiece"})
