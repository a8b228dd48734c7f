# The data: passkeys tokenized alike by every tokenizer, where a tree left the key, RULER's
# templates, text windows inside one document and sources drawn evenly, the ppl protocol's windows.
import importlib.util
import os
import random
import re

import numpy as np
import pytest
import torch

import data
import eval as E
import tokenizer as T
from conftest import GGUF, SHARED_TOKENIZERS
from load_llama import load_tokenizer
from tree import Node


class GPT2(T.Tokenizer):   # GPT-2's BPE folds the space into the key (" 735", "12"): a hard case
    def __init__(self):
        import tiktoken
        self.enc = tiktoken.get_encoding("gpt2")
        self.bos_id = self.eos_id = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab

    def ids(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(ids)


@pytest.fixture(scope="module", params=["byte", "gpt2", "sentencepiece", "smollm2"])
def tok(request):
    if request.param == "byte":
        return T.ByteTokenizer()
    files = {"gpt2": os.path.join(SHARED_TOKENIZERS, "tiktoken"), "smollm2": GGUF,
             "sentencepiece": os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")}
    if not os.path.exists(files[request.param]) or (request.param == "smollm2" and
                                                    not importlib.util.find_spec("gguf")):
        pytest.skip(f"no {request.param} tokenizer here")
    if request.param == "gpt2":
        os.environ["TIKTOKEN_CACHE_DIR"] = files["gpt2"]
        return GPT2()
    return load_tokenizer(files[request.param])


def occurs(part, whole):
    return any(whole[i:i + len(part)] == part for i in range(len(whole) - len(part) + 1))


def test_the_answer_is_tokenized_as_in_the_needle(tok):
    for key in (12345, 26744, 99991, 10000, 73512, 50007):
        question, answer = data.passkey_question(tok, key)
        needle = tok.encode(data.NEEDLE.format(key=key), bos=False)
        assert tok.decode(answer).strip() == str(key)   # the key's digits, nothing more
        assert occurs(question[-1:] + answer, needle)   # verbatim, after the same token
        assert not any(ch.isdigit() for ch in tok.decode(question))
    for seed in range(10):   # keys of 2 and 3 tokens in one batch still stack
        ctx, idx, tgt, ql = data.get_batch("passkey", 8, random.Random(seed), tok, None, 4, 64,
                                           None)
        for b in range(8):
            scored = (tgt[b] != -100).nonzero().flatten().tolist()
            assert scored == list(range(ql[b] - 1, scored[-1] + 1))   # from the question's end
            assert occurs(tgt[b, scored].tolist(), ctx[b].flatten().tolist())
            assert torch.equal(idx[b, scored[0] + 1:scored[-1] + 1], tgt[b, scored[:-1]])


def test_a_fact_is_asked_in_other_words_and_only_its_value_is_scored(tmp_path):
    # each fact sample: its facts inside a training text, one asked by its key in the template's
    # question, and the scored tokens are that value, which X_C holds once
    tok = T.ByteTokenizer()
    for name in "ab":   # (a source's last document is held out)
        (tmp_path / f"{name}.txt").write_text("".join(f"line {i} of a text.\n" for i in range(900)))
    split = data.prepare(tok, str(tmp_path), cache_dir=str(tmp_path / "c"), splits=("train",))
    rng = random.Random(0)
    for _ in range(20):
        ctx, idx, tgt, ql = data.fact_sample(tok, rng, split["train"], 4, 64)
        text, xd = tok.decode(ctx.flatten().tolist()), tok.decode(idx.tolist())
        value = tok.decode(tgt[tgt != -100].tolist())
        fact, question, _ = next(f for f in data.FACTS if f[1].split("{key}")[0] in xd)
        key = xd.split(question.split("{key}")[0], 1)[1].split(question.split("{key}")[1])[0]
        assert ctx.shape == (4, 64) and text.count(value) == 1 and (tgt[:ql - 1] == -100).all()
        assert fact.format(key=key, value=value) in text and not xd.startswith(fact[:12])


def test_passkey_sample_and_where_the_tree_left_the_key():
    tok = T.ByteTokenizer()
    for depth in (0.0, 0.3, 1.0):
        ctx, idx, tgt, ql = data.passkey_sample(tok, random.Random(0), 4, 128, depth=depth,
                                                key=12345)
        text = tok.decode(ctx.flatten().tolist())
        assert ctx.shape == (4, 128) and text.count("12345") == 2   # the needle wholly in X_C
        needle = len(data.NEEDLE.format(key=12345))
        assert text.index("The pass key is 12345") == round(depth * (512 - 1 - needle))
        assert tok.decode(idx[:ql].tolist()) == data.QUESTION
        assert tok.decode(tgt[tgt != -100].tolist()) == "12345"
        tgt = data.passkey_sample(tok, random.Random(0), 4, 128, 64, depth=depth, key=12345)[2]
        assert tok.decode(tgt[tgt != -100].tolist()) == "12345"   # padded as in training too
    # chunks of 64: level 1 [0, 32), level 2 [32, 48), leaves [48, 56) and [56, 64)
    nodes = [[Node(0, 32, 1, 4), Node(32, 48, 2, 4), Node(48, 56, 3, 4), Node(56, 64, 3, 4)]] * 2
    place = lambda mentions: data.key_placement(nodes, mentions, 64)
    assert place([(10, 15), (49, 54)]) == "leaf"          # one mention whole in a leaf
    assert place([(54, 59), (64 + 50, 64 + 55)]) == "leaf"
    assert place([(54, 59)]) == "between"                 # across two leaves
    assert place([(10, 15), (64 + 5, 64 + 10)]) == "coarse"   # every mention in level 1 alone
    assert place([(28, 33)]) == "between"


def test_ruler_templates_and_haystacks():
    # RULER's NIAH wording (scripts/data/synthetic/constants.py and niah.py at commit c3f5e3b),
    # singular when one value is asked; string_match_all; each needle once in its haystack
    assert data.ruler_wording(1)[1] == ("What is the special magic number for {query} mentioned "
                                        "in the provided text?")
    assert data.ruler_wording(4)[2] == (" The special magic numbers for {query} mentioned in the "
                                        "provided text are")
    assert data.ruler_score("1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert data.ruler_score("The number is 1234567", ["1234567", "7654321"]) == 0.5
    tok = T.ByteTokenizer()
    counts = {"niah_single_1": (1, 1), "niah_single_2": (1, 1), "niah_single_3": (1, 1),
              "niah_multikey_1": (4, 1), "niah_multikey_2": (1, 1), "niah_multikey_3": (1, 1),
              "niah_multivalue": (4, 4), "niah_multiquery": (4, 4)}   # needles, values asked
    assert set(counts) == set(data.RULER_TASKS)
    for task, (needles, asked) in counts.items():
        haystack, key_kind, kind = data.RULER_TASKS[task][:3]
        for depth in (0.0, 0.5, 1.0):
            ctx, idx, answers, spans, ql = data.ruler_sample(tok, random.Random(1), task, 8, 128,
                                                             depth)
            text, question = tok.decode(ctx.flatten().tolist()), tok.decode(idx.tolist())
            assert ctx.shape == (8, 128) and ql == len(idx) and len(answers) == len(spans) == asked
            for value, (s, e) in zip(answers, spans):
                assert text.count(value) == 1 and tok.decode(ctx.flatten()[s:e].tolist()) == value
                shape = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
                assert re.fullmatch(shape if kind == "uuids" else r"\d{7}", value)
            key = re.search(f"magic {kind[:-1]}s? for (.*?) mentioned", question).group(1)
            if data.RULER_TASKS[task][5] == 1:   # one key asked: in the haystack with its values
                assert text.count(key) == data.RULER_TASKS[task][4]
            if haystack == "needle":   # every line of the haystack a needle of another key
                lines = text.split("\n")[1:-1]   # (the intro's line, and a cut last one)
                assert len(lines) > 3 and all(re.fullmatch(
                    f"One of the special magic {kind} for (.+) is: (.+)\\.", s) for s in lines)
            else:
                assert text.count(f"One of the special magic {kind} for ") == needles
            if task == "niah_single_1":   # the passkey's filler; the needle at its depth
                at = text.index("One of the") - text.index("\n")
                assert abs(at / (8 * 128 - text.index("\n") - 60) - depth) < 0.1


def test_text_windows_stay_in_one_document_and_sources_are_drawn_evenly(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i in range(20):   # every position unique
        (a / f"{i:02d}.txt").write_text("".join(f"<{i:02d}{j:04d}>" for j in range(100)))
    for i in range(3):
        (b / f"{i}.txt").write_text("b" * 900)
    tok = T.ByteTokenizer()
    splits = data.prepare(tok, f"{a},{b}", str(tmp_path / "cache"))
    assert splits["train"][2].tolist() == [0] * 18 + [1] * 2 and splits["val"][2].tolist() == [0,
                                                                                             0, 1]
    rng, drawn = random.Random(0), []
    for _ in range(300):
        ctx, idx, tgt, ql = data.lm_sample(splits["train"], rng, 2, 64, 32)
        text = tok.decode(torch.cat([ctx.flatten(), idx, tgt[-1:]]).tolist())
        assert ql == 0 and torch.equal(idx[1:], tgt[:-1])   # X_D, then its next tokens
        drawn.append(text[0])
        if text[0] != "b":   # one document, in order
            assert any(text in (a / f).read_text() for f in os.listdir(a))
    assert 0.4 < drawn.count("b") / 300 < 0.6   # 2 of 20 training documents, half the samples
    with pytest.raises(ValueError):
        data.lm_sample(splits["train"], rng, 100, 100, 0)


def test_ppl_windows_stay_inside_documents():
    offsets = np.array([0, 500, 580, 2000])   # documents of 500, 80 and 1420 tokens
    split, C, T, K = (np.arange(2000), offsets), 16, 24, 8
    wins = E.ppl_windows(split, 4, C, T, K, max_windows=10_000)
    for a, p in wins:   # X_C of 4 chunks, X_D and the last target: in one document
        assert p + K - T - 4 * C >= a and p + K + 1 <= offsets[np.searchsorted(offsets, a, "right")]
    assert len(wins) == len(range(80, 492, 8)) + len(range(660, 1992, 8))
    assert len(E.ppl_windows(split, 4, C, T, K, max_windows=7)) == 7
    for _, p in wins[:5]:   # X_D's last K positions [p, p+K) predict [p+1, p+K+1)
        row = E.window_tokens(split[0], p, 4, C, T, K).numpy()
        assert (row[4 * C:4 * C + T] == np.arange(p + K - T, p + K)).all()
        assert (row[-K:] == np.arange(p + 1, p + K + 1)).all()
