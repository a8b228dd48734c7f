# sample.py and eval.py: the ppl protocol's counts, a uniform model's perplexity, the passkey grid,
# greedy sampling from a compressed context against full forwards, the scripts as subprocesses, and
# their errors on bad input.
import json
import os
import random
import types

import numpy as np
import pytest
import torch

import data
from tokenizer import ByteTokenizer
import eval as E
import sample as S
from conftest import ROOT
from tokenizer import ByteTokenizer
from checkpoint import load_sharedllm
from test_train import MICRO, run, train_in_process
from configurator import config_of, parse_overrides

SCRIPTS = {name: [os.sys.executable, os.path.join(ROOT, name)] for name in ("sample.py", "eval.py")}


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory):
    # a micro checkpoint from train.py, then its weights scaled up so greedy outputs vary and depend
    # on the context
    d = tmp_path_factory.mktemp("micro")
    # in this process (a subprocess would cost a torch import)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(d)
        train_in_process(MICRO + ["--max_iters=2", "--eval_interval=2", f"--out_dir={d}",
                                  "--policy=vector"], d)
    ck = torch.load(d / "ckpt.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    for k, v in ck["model"].items():
        if v.dim() == 2:
            ck["model"][k] = torch.randn(v.shape, generator=g) * 0.3
    torch.save(ck, d / "ckpt.pt")
    docs = d / "docs"
    docs.mkdir()
    for i in range(10):    # the 10th is the validation split
        (docs / f"{i}.txt").write_text("".join(f"line {j} of file {i}: x{j % 7} = y{j % 5}\n"
                                               for j in range(120)))
    return d


def test_ppl_windows_count_and_stay_inside_documents():
    offsets = np.array([0, 500, 580, 2000])                 # documents of 500, 80 and 1420 tokens
    split = (np.arange(2000), offsets)
    C, T, K = 16, 24, 8
    wins = E.ppl_windows(split, 4, C, T, K, max_windows=10_000)
    for a, p in wins:
        b = offsets[np.searchsorted(offsets, a, side="right")]
        # X_C of 4 chunks, X_D and the last target: one document
        assert p + K - T - 4 * C >= a and p + K + 1 <= b
    # doc 2 < 4*16+24+1
    assert len(wins) == len(range(0 + 64 + 16, 500 - 8, 8)) + len(range(580 + 80, 2000 - 8, 8))
    assert len(E.ppl_windows(split, 4, C, T, K, max_windows=7)) == 7
    # X_D = [p+K-T, p+K): its last K positions [p, p+K) predict the scored tokens [p+1, p+K+1)
    for _, p in wins[:5]:
        row = E.window_tokens(split[0], p, 4, C, T, K).numpy()
        assert ((row[4 * C:4 * C + T] == np.arange(p + K - T, p + K)).all()
                and (row[-K:] == np.arange(p + 1, p + K + 1)).all())
    with pytest.raises(ValueError, match="no validation document has 1625 tokens"):
        E.ppl_windows(split, 100, C, T, K, 10)


class Uniform(torch.nn.Module):
    # a model that gives every token the same logit: its perplexity is exactly the vocabulary size
    def forward(self, ctx, idx, targets=None, question_len=None, last=0):
        return torch.zeros(*idx[:, -last:].shape, 258), None

    @property
    def upper(self):   # full attention calls model.upper(window, last=K)
        return lambda idx, last: self(None, idx, last=last)


def test_uniform_model_perplexity_is_vocab_size_and_exactly_k_tokens_are_scored():
    split = (np.random.default_rng(0).integers(0, 258, 3000), np.array([0, 3000]))
    wins = E.ppl_windows(split, 2, 32, 40, 10, max_windows=13)
    for context in ("compressed", "none", "full"):
        ppl, scored = E.score_ppl(Uniform(), split, wins, 2, 32, 40, 10, context, 4, "cpu")
        assert abs(ppl - 258) < 1e-6 * 258 and scored == 13 * 10   # fp32 log-softmax


def test_full_attention_row_scores_the_same_tokens_with_the_whole_window(micro_ckpt):
    model, _, _ = load_sharedllm(str(micro_ckpt))
    split = (np.random.default_rng(1).integers(0, 258, 3000), np.array([0, 3000]))
    n, C, T, K = 2, 32, 48, 10
    wins = E.ppl_windows(split, n, C, T, K, max_windows=3)
    ppl, _ = E.score_ppl(model, split, wins, n, C, T, K, "full", 2, "cpu")
    nll = []
    for _, p in wins:   # by hand: the plain model over X_C + X_D, the last K targets
        w = torch.from_numpy(split[0][p + K - T - n * C: p + K + 1].astype(np.int64))[None]
        logits, _ = model.upper(w[:, :-1])
        nll.append(torch.nn.functional.cross_entropy(logits[0, -K:], w[0, -K:]).item())
    assert abs(np.log(ppl) - np.mean(nll)) < 1e-6


def test_window_row_is_the_base_model_on_the_last_w_tokens_and_scores_the_same_tokens(micro_ckpt):
    # what a user does without SharedLLM: cut the text to the model's window. The row scores the
    # very targets the other rows score, and equals a plain forward over only the last W tokens; a
    # window holding everything equals full.
    model, _, _ = load_sharedllm(str(micro_ckpt))
    split = (np.random.default_rng(2).integers(0, 258, 3000), np.array([0, 3000]))
    n, C, T, K, W = 2, 32, 48, 10, 40
    wins = E.ppl_windows(split, n, C, T, K, max_windows=3)
    ppl, scored = E.score_ppl(model, split, wins, n, C, T, K, "window", 2, "cpu", window=W)
    assert scored == E.score_ppl(model, split, wins, n, C, T, K, "compressed", 2, "cpu")[1] == 3 * K
    nll = []
    # by hand: the plain model over tokens [p+K-W, p+K), the targets [p+1, p+K+1)
    for _, p in wins:
        w = torch.from_numpy(split[0][p + K - W: p + K + 1].astype(np.int64))[None]
        # the same scored targets
        assert torch.equal(w[0, -K:], E.window_tokens(split[0], p, n, C, T, K)[-K:])
        logits, _ = model.upper(w[:, :-1])
        nll.append(torch.nn.functional.cross_entropy(logits[0, -K:], w[0, -K:]).item())
    assert abs(np.log(ppl) - np.mean(nll)) < 1e-6
    full, _ = E.score_ppl(model, split, wins, n, C, T, K, "full", 2, "cpu")
    assert E.score_ppl(model, split, wins, n, C, T, K, "window", 2, "cpu",
                       window=n * C + T)[0] == full
    assert abs(ppl / full - 1) > 1e-3   # and a shorter window is something else


def test_eval_prints_every_row_with_its_cost_and_refuses_a_window_shorter_than_k(
        micro_ckpt, tmp_path, monkeypatch, capsys):
    common = [f"--init_from={micro_ckpt}", f"--data_dir={micro_ckpt / 'docs'}", "--chunks=1,2",
              "--max_windows=2", "--block_size=32", "--device=cpu"]
    res = E.main(parse_overrides(common + ["--task=ppl", "--window=70", "--full=True"],
                                 config_of(vars(E)), E.__file__))
    out = capsys.readouterr().out
    for row in ("none", "SharedLLM", "window", "full"):
        assert all(row in r["cost"] and r["cost"][row]["gflop_per_window"] > 0 for r in res), row
        assert f"  {row} " in out
    # 32 + 32 <= 70
    assert res[0]["window_tokens"] == 70 and res[0]["full_attention"] == res[0]["window_attention"]
    assert res[1]["full_attention"] != res[1]["window_attention"]   # 64 + 32 > 70
    # none: the upper model over X_D, logits at all T = 32
    cfg = load_sharedllm(str(micro_ckpt))[0].upper.cfg
    assert all(r["cost"]["none"]["gflop_per_window"] == E.gflops(cfg, 32, 32) for r in res)
    assert "--window=8: expected -1" in error_of(E, common + ["--task=ppl", "--window=8"], tmp_path,
                                                 monkeypatch)
    # passkey: the window must hold the question and the key (X_D: 42 bytes, + 4 for a key that
    # tokenizes longer)
    least = E.passkey_xd(ByteTokenizer()) + E.XD_MARGIN
    assert E.passkey_xd(ByteTokenizer()) == len(
        data.passkey_sample(ByteTokenizer(), random.Random(0), 1, 64)[1]) == 42
    assert f"or at least {least} (the passkey question and key)" in error_of(
        E, common + ["--task=passkey", f"--window={least - 1}"], tmp_path, monkeypatch)
    # no whole key: it says so
    E.main(parse_overrides(common + ["--task=passkey", f"--window={least}", "--samples=2",
                                     "--depths=0,1", "--chunks=2,4"],
                           config_of(vars(E)), E.__file__))
    assert "the window row is 0% by construction" in capsys.readouterr().out


def test_passkey_window_row_reads_only_keys_inside_its_window():
    # a model that copies the needle reads every key its input holds: the window row finds exactly
    # the keys that fall in the last W tokens, and runs no forward for the others
    from test_passkey import Copier
    tok = ByteTokenizer()
    # as the base model: what precedes the last `last` tokens is its context
    copier = Copier(tok.vocab_size)
    base = types.SimpleNamespace(upper=lambda seq, last: copier(
        seq[:, None, :-last], seq[:, -last:], question_len=torch.ones(len(seq), dtype=torch.long)))
    n, C, W = 8, 64, 300
    # the key at the start of 512 tokens: outside; at the end: inside
    for depth, want in ((0.0, 0.0), (1.0, 1.0)):
        acc, ran, _ = E.passkey_accuracy(base, tok, n, C, depth, 0.0, 4, 2, 0, "cpu", window=W)
        assert (acc, ran) == (want, 4 * int(want))
    # at the boundary: a window that starts on the needle's second mention of the key holds a whole
    # copy and runs a forward (the copier, which needs "The pass key is" before it, then misses);
    # one token later it holds none (the first mention lies before it, the second is cut) and the
    # haystack is a miss without a forward. Every key here is 5 bytes = 5 tokens, so both mentions
    # sit at the same offsets in every haystack of a batch
    ctx, idx, _, _ = data.passkey_sample(tok, random.Random(0), n, C, depth=1.0, key=12345)
    # + BOS: its token position in X_C
    second = tok.decode(ctx.flatten().tolist()).rindex("12345") + 1
    for start, forwards in ((second, 4), (second + 1, 0)):
        acc, ran, _ = E.passkey_accuracy(base, tok, n, C, 1.0, 0.0, 4, 2, 0, "cpu",
                                         window=n * C + len(idx) - start)
        assert (acc, ran) == (0.0, forwards), start


def test_ppl_scores_the_last_k_tokens_of_each_window(monkeypatch):
    # a model that is sure of token t at every position: the loss is zero exactly where the target
    # is t
    split = (np.zeros(3000, dtype=np.int64), np.array([0, 3000]))
    tokens = split[0]
    wins = E.ppl_windows(split, 1, 32, 40, 10, max_windows=5)
    for _, p in wins:
        tokens[p - 20:p] = 7   # targets before the scored block: not scored, whatever they are

    class Sure(torch.nn.Module):
        def forward(self, ctx, idx, targets=None, question_len=None):
            return torch.nn.functional.one_hot(torch.zeros_like(idx), 258).float() * 100, None
    ppl, _ = E.score_ppl(Sure(), split, wins, 1, 32, 40, 10, "compressed", 2, "cpu")
    assert abs(ppl - 1.0) < 1e-6
    # one scored target wrong: the loss is 100 there, 1/10 of one window of 5
    tokens[wins[0][1] + 3] = 7
    ppl, _ = E.score_ppl(Sure(), split, wins, 1, 32, 40, 10, "compressed", 2, "cpu")
    assert abs(np.log(ppl) - 100 / 10 / 5) < 1e-4


def test_passkey_key_at_the_asked_depth_only_inside_the_context():
    tok, rng = ByteTokenizer(), random.Random(0)
    needle = len("The pass key is 54321. Remember it. 54321 is the pass key. ")
    for n, depth in [(1, 0.0), (2, 0.5), (4, 0.9), (8, 1.0)]:
        ctx, idx, tgt, ql = data.passkey_sample(tok, rng, n, 128, depth=depth, key=54321)
        flat = ctx.flatten().tolist()
        at = next(p for p in range(len(flat)) if tok.decode(flat[p:p + 15]) == "The pass key is")
        assert at == 1 + round(depth * (n * 128 - needle - 1))      # 1: after BOS
        assert at + needle <= n * 128                                  # wholly inside X_C
        assert "54321" not in tok.decode(idx[:ql].tolist())


def test_sample_greedy_equals_full_forward_greedy(micro_ckpt, capsys):
    cfg = config_of(vars(S))
    text = "".join(f"record {i}: value {i * 37 % 101}. " for i in range(12))
    cfg.update(init_from=str(micro_ckpt), context=text, prompt="value of record 3?",
               max_new_tokens=12, device="cpu", show_tree=True)
    got = S.main(cfg)
    printed = capsys.readouterr().out
    model, tok, _ = load_sharedllm(str(micro_ckpt))
    ids = tok.encode(text)
    C = model.scfg.chunk_size
    ids = ids[len(ids) % C:]
    ctx = torch.tensor(ids).view(1, -1, C)
    prompt = tok.encode(cfg["prompt"], bos=False)
    idx, ql = torch.tensor([prompt]), torch.tensor([len(prompt)])
    with torch.no_grad():
        # the query stays the prompt: the same trees as sample.py's single compression
        for _ in range(12):
            nxt = model(ctx, idx, question_len=ql)[0][:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
        other = model(torch.roll(ctx, 40, dims=2), idx[:, :len(prompt)],
                      question_len=ql)[0][:, -1].argmax(-1)
    assert got == idx[0, len(prompt):].tolist()
    # a varied answer that depends on the context
    assert len(set(got)) > 2 and other.item() != got[0]
    assert f"-> {ctx.shape[1] * C // 8} compressed KVs per layer" in printed and "path " in printed
    assert "tokens/s" in printed and "peak memory" in printed


def test_sample_and_eval_subprocesses(micro_ckpt, tmp_path, monkeypatch, capsys):
    # each script once as the user runs it (a subprocess), the other eval.py tasks in this process
    # (a subprocess each would cost a torch import)
    out = run([f"--init_from={micro_ckpt}", "--n_chunks=3", "--device=cpu"], tmp_path,
              cmd=SCRIPTS["sample.py"])
    assert "passkey haystack" in out and "expected " in out
    common = [f"--init_from={micro_ckpt}", f"--data_dir={micro_ckpt / 'docs'}", "--device=cpu",
              "--batch_size=4"]
    out = run(common + ["--task=passkey", "--chunks=2,4", "--depths=0,1", "--samples=3",
                        f"--out={tmp_path / 'pk.json'}"], tmp_path, cmd=SCRIPTS["eval.py"])
    # its window holds keys
    assert "depth \\ context" in out and "window: " in out and "by construction" not in out
    res = json.load(open(tmp_path / "pk.json"))
    assert ([(r["n_chunks"], r["depth"]) for r in res["results"]]
            == [(2, 0.0), (2, 1.0), (4, 0.0), (4, 1.0)])
    assert all(r["accuracy"] in (0, 1 / 3, 2 / 3, 1) for r in res["results"])
    monkeypatch.chdir(tmp_path)
    run_eval = lambda args: E.main(parse_overrides(args, config_of(vars(E)), E.__file__))
    run_eval(common + ["--task=ppl", "--chunks=1,2", "--max_windows=6",
                       f"--out={tmp_path / 'ppl.json'}"])
    res = json.load(open(tmp_path / "ppl.json"))
    assert (res["task"] == "ppl" and res["config"]["K"] == 24
            and [r["n_chunks"] for r in res["results"]] == [1, 2])
    for r in res["results"]:
        assert r["scored_tokens"] == 6 * 24 and r["context_tokens"] == 32 * r["n_chunks"]
        assert isinstance(r["with_context"], float) and isinstance(r["without_context"], float)
    capsys.readouterr()
    run_eval(common + ["--task=ablations", "--chunks=2", "--depths=0.5", "--samples=2",
                       "--max_windows=2", f"--compare=again={micro_ckpt}"])
    out = capsys.readouterr().out
    for row in ("height 2", "beta 16", "retrieval off", "chunk ids off", "the paper's search",
                "first of window", "again"):
        assert row in out


def error_of(script, args, tmp_path, monkeypatch):
    # run sample.py / eval.py in this process (a subprocess each would cost a torch import) -> its
    # SystemExit text
    monkeypatch.chdir(tmp_path)
    cfg = config_of(vars(script))
    with pytest.raises(SystemExit) as e:
        parse_overrides(args, cfg, script.__file__)
        script.main(cfg)
    return str(e.value)


def test_bad_inputs_get_clear_errors(micro_ckpt, tmp_path, monkeypatch):
    # as the user sees it, once per script: a subprocess
    for script in ("sample.py", "eval.py"):
        out = run([f"--init_from={tmp_path}/nope"], tmp_path, ok=False, cmd=SCRIPTS[script])
        assert f"{tmp_path}/nope: no such file or folder" in out
    os.makedirs(tmp_path / "empty")
    assert ("neither a train.py checkpoint (ckpt.pt) nor a LLaMA folder (config.json) or .gguf file"
            in error_of(S, [f"--init_from={tmp_path / 'empty'}"], tmp_path, monkeypatch))
    assert "unknown setting 'temprature'" in error_of(S, ["--temprature=1"], tmp_path, monkeypatch)
    assert "unknown setting 'chunk'" in error_of(E, ["--chunk=4"], tmp_path, monkeypatch)
    ck = [f"--init_from={micro_ckpt}", "--device=cpu"]
    for args, msg in [(["--context=short", "--prompt=q"],
                       "the context has 6 tokens; at least one chunk of C = 32"),
                      (["--context=  ", "--prompt=q"], "--context is empty"),
                      (["--context=" + "x" * 100], "--prompt is empty"),
                      ([f"--context=FILE:{tmp_path}/missing.txt"], "no such file"),
                      (["--n_lower=3"], "M is fixed by the checkpoint")]:
        assert msg in error_of(S, ck + args, tmp_path, monkeypatch)
    for args, msg in [(["--task=ppx"],
                       "--task=ppx: expected ppl, passkey, ruler, search or ablations"),
                      (["--chunks=1000", f"--data_dir={micro_ckpt / 'docs'}"],
                       "no validation document has"),
                      (["--chunks=0"], "--chunks=0: expected positive integers"),
                      (["--chunk_pos=maybe"], "--chunk_pos=maybe: expected plain, random or off"),
                      (["--task=ablations", "--compare=nolabel"], "expected label=out_dir")]:
        assert msg in error_of(E, ck + args, tmp_path, monkeypatch)
    bad = torch.load(micro_ckpt / "ckpt.pt", weights_only=True)
    bad["tokenizer"] = {"kind": "gpt2"}                 # 50,257 ids for a 258-token model
    os.makedirs(tmp_path / "bad")
    torch.save(bad, tmp_path / "bad" / "ckpt.pt")
    out = error_of(S, [f"--init_from={tmp_path / 'bad'}"], tmp_path, monkeypatch)
    assert ("the checkpoint and tokenizer do not belong together" in out
            or "tiktoken could not load" in out)


def test_sample_refuses_a_context_larger_than_free_memory(micro_ckpt, monkeypatch):
    cfg = config_of(vars(S))
    cfg.update(init_from=str(micro_ckpt), n_chunks=64, device="cpu")
    monkeypatch.setattr(S, "free_memory_bytes", lambda dev: 10_000)
    with pytest.raises(SystemExit, match=r"compressing 2,048 context tokens \(64 chunks of 32\) "
                                         r"needs about .* GiB, and "
                                         r"0.0 GiB is free on cpu: use a shorter context"):
        S.main(cfg)


def test_sample_from_a_llama2_folder(tmp_path, capsys):
    import shutil
    from conftest import SHARED_TOKENIZERS, make_hf_checkpoint
    spm = os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")
    if not os.path.isfile(spm):
        pytest.skip("shared tokenizer files not present")
    hf = make_hf_checkpoint(tmp_path, vocab=32000)
    shutil.copy(spm, tmp_path / "tokenizer.model")
    model, tok, cfg = load_sharedllm(str(tmp_path), n_lower=1, chunk_size=16, height=2, beta=4)
    assert cfg == {} and model.scfg.n_lower == 1 and tok.vocab_size == 32000
    ctx, idx = torch.randint(0, 32000, (1, 3, 16)), torch.randint(0, 32000, (1, 9))
    with torch.no_grad():   # cross-attention untrained: exactly the base LLaMA
        assert torch.equal(model(ctx, idx)[0].argmax(-1), hf(idx).logits.argmax(-1))
    cfg = config_of(vars(S))
    cfg.update(init_from=str(tmp_path), context="a long document. " * 20, prompt="Summary:",
               max_new_tokens=4, n_lower=1, chunk_size=16, height=2, beta=4, device="cpu")
    assert len(S.main(cfg)) == 4 and "chunks of C = 16" in capsys.readouterr().out


def test_eval_reads_the_checkpoints_own_data(micro_ckpt, tmp_path, monkeypatch):
    # no --data_dir: the validation documents come from the folder the checkpoint was trained on
    ck = torch.load(micro_ckpt / "ckpt.pt", weights_only=True)
    ck["config"]["data_dir"] = str(micro_ckpt / "docs")
    (tmp_path / "own").mkdir()
    torch.save(ck, tmp_path / "own" / "ckpt.pt")
    seen, real = [], data.prepare
    monkeypatch.setattr(data, "prepare", lambda tok, d, **kw:
                        seen.append(d) or real(tok, d, str(tmp_path / "cache"), **kw))
    cfg = config_of(vars(E))
    cfg.update(init_from=str(tmp_path / "own"), task="ppl", chunks="1", max_windows=2, device="cpu")
    assert len(E.main(cfg)) == 1 and seen == [str(micro_ckpt / "docs")]


def test_show_tree_of_a_long_context_shows_a_few_chunks(micro_ckpt, capsys):
    cfg = config_of(vars(S))
    cfg.update(init_from=str(micro_ckpt), n_chunks=12, show_tree=True, device="cpu")
    S.main(cfg)
    out = capsys.readouterr().out
    chunks = [line for line in out.splitlines() if line.startswith("chunk ")]
    # each mention's chunk
    key = [int(line.split()[1]) for line in chunks if "<- the key at tokens" in line]
    assert 1 <= len(key) <= 2 and {int(line.split()[1]) for line in chunks} == {0, 1, 10, 11, *key}
    assert "not shown" in out


def test_a_checkpoint_with_a_retired_setting_is_named_and_read_with_todays(micro_ckpt, tmp_path,
                                                                           monkeypatch, capsys):
    # settings that left with the one method (checkpoint.RETIRED): the error names the setting and
    # the way to read it
    ck = torch.load(micro_ckpt / "ckpt.pt", weights_only=True)
    base = ["--task=passkey", "--chunks=3", "--samples=2", "--depths=0", "--device=cpu"]
    for setting, value, fix in [("policy", "attention", "--policy=lexical"),
                                ("policy", "query_mean", "--policy=vector"),
                                ("chunk_pos", "clamp", "--chunk_pos=plain")]:
        old = {**ck, "model_args": {**ck["model_args"],
                                    "shared": {**ck["model_args"]["shared"], setting: value,
                                               "max_chunk_dist": 4}}}
        os.makedirs(tmp_path / value)
        torch.save(old, tmp_path / value / "ckpt.pt")
        msg = error_of(E, [f"--init_from={tmp_path / value}"] + base, tmp_path, monkeypatch)
        assert (f"trained with {setting}={value!r}, which this version no longer has" in msg
                and "84a7b60" in msg)
        cfg = config_of(vars(E))
        parse_overrides([f"--init_from={tmp_path / value}", fix] + base, cfg, E.__file__)
        E.main(cfg)   # read with today's setting: it runs
        assert f"{fix[2:].replace('=', '=' + chr(39))}'" in capsys.readouterr().out
    old = {**ck, "model_args": {**ck["model_args"],
                                "shared": {**ck["model_args"]["shared"], "logn_scale": True}}}
    os.makedirs(tmp_path / "logn")
    torch.save(old, tmp_path / "logn" / "ckpt.pt")
    cfg = config_of(vars(E))
    parse_overrides([f"--init_from={tmp_path / 'logn'}"] + base, cfg, E.__file__)
    E.main(cfg)
    assert "read without it" in capsys.readouterr().out


def test_a_checkpoint_from_before_the_renames_loads_with_the_same_settings(micro_ckpt, tmp_path):
    # older checkpoints said noise = gamma (sigma = l / gamma; now sigma is the fraction itself),
    # chunk_ids True / False or a form, lower (now lower_weights) and policy "query" (now "vector"):
    # they load as today's settings
    from checkpoint import load_sharedllm
    ck = torch.load(micro_ckpt / "ckpt.pt", weights_only=True)
    renamed = ("sigma", "chunk_pos", "lower_weights", "policy")
    for i, (old, want) in enumerate([
            (dict(noise=5.0, chunk_ids=True, lower="shared", policy="query"),
             dict(sigma=0.2, chunk_pos="plain", lower_weights="shared", policy="vector")),
            (dict(noise=0.0, chunk_ids=False, lower="shared", policy="lexical"),
             dict(sigma=0.0, chunk_pos="off", lower_weights="shared", policy="lexical")),
            (dict(sigma=0.0, chunk_ids="random", lower="shared", policy="right"),
             dict(sigma=0.0, chunk_pos="random", lower_weights="shared", policy="right"))]):
        shared = {k: v for k, v in ck["model_args"]["shared"].items() if k not in renamed}
        d = tmp_path / str(i)
        os.makedirs(d)
        torch.save({**ck, "model_args": {**ck["model_args"], "shared": {**shared, **old}}},
                   d / "ckpt.pt")
        model = load_sharedllm(str(d))[0]
        assert {k: getattr(model.scfg, k) for k in want} == want


def test_full_attention_of_a_model_trained_from_scratch_says_what_it_is(micro_ckpt, capsys,
                                                                        tmp_path, monkeypatch):
    # no unchanged base exists: the column is labelled as this checkpoint's own (trained)
    # upper model
    monkeypatch.chdir(tmp_path)   # its heatmap, passkey.png, goes to the working folder
    cfg = parse_overrides([f"--init_from={micro_ckpt}", "--task=passkey", "--chunks=2",
                           "--full=True", "--samples=2", "--depths=0", "--device=cpu"],
                          config_of(vars(E)), E.__file__)
    res = E.main(cfg)
    assert ("full attention by this checkpoint's own upper model (trained from scratch: there is "
            "no pretrained base)" in capsys.readouterr().out and "full_attention" in res[0])


def test_bad_input_sweep_sample_and_eval(micro_ckpt, tmp_path, monkeypatch):
    # wrong but plausible inputs, each a one-line error naming the flag and what was expected (no
    # traceback, no silent fallback)
    ck = [f"--init_from={micro_ckpt}", "--device=cpu"]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin1") * 50)
    for args, msg in [(["--n_chunks=0"], "--n_chunks=0: expected a value in [1, inf]"),
                      (["--n_chunks=1"],
                       "--n_chunks=1: context of 32 tokens is too short for the passkey needle"),
                      (["--max_new_tokens=-1"],
                       "--max_new_tokens=-1: expected a value in [0, inf]"),
                      (["--temperature=-1"], "--temperature=-1.0: expected a value in [0, inf]"),
                      (["--temperature=nan"], "--temperature=nan: expected a value in [0, inf]"),
                      (["--top_p=2"], "--top_p=2.0: expected a value in (0, 1]"),
                      (["--top_k=-3"], "--top_k=-3: expected a value in [0, inf]"),
                      (["--depth=2"], "--depth=2.0: expected -1 (random) or a value in [0, 1]"),
                      (["--key=123"], "--key=123: expected 0 (random) or a 5-digit key"),
                      (["--beta=64"], "SharedConfig.beta = 64: a tree of height 3 keeps at least "
                                      "one KV in each of its 4 nodes, so a chunk of 32 tokens "
                                      "allows beta up to 8"),
                      (["--height=9"], "chunk_size 32 is too short for a tree of height 9"),
                      (["--chunk_size=7"], "chunk_size (C) = 7: " + str(micro_ckpt / "ckpt.pt") +
                                           " was trained with C = 32"),
                      (["--device=gpu"], "--device=gpu: expected auto, cpu, cuda, cuda:N or mps"),
                      (["--dtype=fp32"],
                       "--dtype=fp32: expected auto, float32, bfloat16 or float16"),
                      ([f"--context=FILE:{tmp_path / 'latin1.txt'}", "--prompt=q"],
                       "not UTF-8 text (byte 0xe9 at offset 3)")]:
        assert msg in error_of(S, ck + args, tmp_path, monkeypatch), args
    if not torch.cuda.is_available():
        assert "--device=cuda: CUDA is not available on this machine" in error_of(
            S, ["--device=cuda"], tmp_path, monkeypatch)
    pk = ck + ["--task=passkey", "--chunks=2", "--samples=2"]
    for args, msg in [(["--depths=abc"], "--depths=abc: expected depths in [0, 1] like 0,0.5,1"),
                      (["--depths=1.5"], "--depths=1.5: expected depths in [0, 1]"),
                      (["--samples=0"], "--samples=0: expected a value in [1, inf]"),
                      (["--batch_size=0"], "--batch_size=0: expected a value in [1, inf]"),
                      (["--max_windows=0"], "--max_windows=0: expected a value in [1, inf]"),
                      (["--block_size=-5"], "--block_size=-5: expected a value in [0, inf]"),
                      ([f"--out={tmp_path}/nowhere/x.json"],
                       f"--out={tmp_path}/nowhere/x.json: the folder"),
                      (["--task=ppl", f"--data_dir={tmp_path}/nowhere"],
                       "nowhere': no such file or folder"),
                      (["--task=ppl", f"--data_dir=stdlib,{tmp_path}/nowhere"],
                       "nowhere': no such file or folder"),
                      (["--task=ablations", "--compare=x=/nonexistent"],
                       "--compare=x=/nonexistent: /nonexistent: no such")]:
        assert msg in error_of(E, pk + args, tmp_path, monkeypatch), args


def test_a_light_checkpoint_whose_base_moved_is_named(tmp_path, monkeypatch):
    from test_train import tiny_llama_and_docs, train_in_process
    ck, docs = tiny_llama_and_docs(tmp_path)
    train_in_process([f"--init_from={ck}", "--train=cross", "--task=lm", f"--data_dir={docs}",
                      "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
                      "--beta_schedule=", "--block_size=32", "--batch_size=2", "--max_iters=1",
                      "--eval_iters=1", "--eval_chunks=2", "--final_eval_chunks=",
                      "--context_dropout=0", "--device=cpu", f"--out_dir={tmp_path / 'out'}"],
                     tmp_path)
    os.rename(ck, tmp_path / "moved")
    for script in (S, E):
        assert (f"a light checkpoint (only the trained weights); its base model {ck} is not there"
                in error_of(script, [f"--init_from={tmp_path / 'out'}", "--device=cpu"], tmp_path,
                            monkeypatch))


def test_a_checkpoint_from_before_inject_was_removed(micro_ckpt, tmp_path):
    # checkpoints that still name inject: "bottom" (what every recipe trained) loads as before;
    # "top" or "interleaved" (an option since removed) is refused, naming the file and the setting
    ck = torch.load(micro_ckpt / "ckpt.pt", weights_only=True)
    for where in ("bottom", "top"):
        ck["model_args"]["shared"]["inject"] = where
        torch.save(ck, tmp_path / f"{where}.pt")
    m, _, _ = load_sharedllm(str(tmp_path / "bottom.pt"))
    n_lower = ck["model_args"]["shared"]["n_lower"]
    assert ([i for i, b in enumerate(m.upper.layers) if b.cross_attention is not None]
            == list(range(n_lower)))
    with pytest.raises(ValueError, match=r"top.pt: trained with cross-attention in the top layers"):
        load_sharedllm(str(tmp_path / "top.pt"))


def test_ruler_templates_scoring_and_haystacks():
    # RULER's NIAH wording (scripts/data/synthetic/constants.py and niah.py at commit c3f5e3b): the
    # template, made singular when one value is asked, and its needle; its string_match_all; every
    # haystack holds each needle once (so each asked value once per needle: twice only where two
    # needles carry it, which never happens here)
    import random
    assert (data.RULER_NEEDLE.format(key="k", value="1")
            == "One of the special magic numbers for k is: 1.")
    many, one = data.ruler_wording(4), data.ruler_wording(1)
    assert many == ("Some special magic numbers are hidden within the following text. Make sure to "
                    "memorize it. I will quiz you about the numbers afterwards.\n",
                    "What are all the special magic numbers for {query} "
                    "mentioned in the provided text?",
                    " The special magic numbers for {query} mentioned in the provided text are")
    assert one == ("A special magic number is hidden within the following text. Make sure to "
                   "memorize it. I will quiz you about the number afterwards.\n",
                   "What is the special magic number for {query} mentioned in the provided text?",
                   " The special magic number for {query} mentioned in the provided text is")
    assert data.ruler_score("1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert data.ruler_score("The number is 1234567", ["1234567", "7654321"]) == 0.5
    assert data.ruler_score("none", ["1234567"]) == 0.0
    tok = ByteTokenizer()
    counts = {"niah_single_1": (1, 1), "niah_single_2": (1, 1), "niah_multikey_1": (4, 1),
              "niah_multivalue": (4, 4), "niah_multiquery": (4, 4)}   # needles, values asked
    for task, (needles, asked) in counts.items():
        for depth in (0.0, 0.5, 1.0):
            ctx, idx, answers, spans, ql = data.ruler_sample(
                tok, random.Random(1), task, 8, 128, depth)
            text, question = tok.decode(ctx.flatten().tolist()), tok.decode(idx.tolist())
            assert ctx.shape == (8, 128) and ql == len(idx) and len(answers) == len(spans) == asked
            assert text.count("One of the special magic numbers for ") == needles
            assert text.startswith(("A special", "Some special"))
            for value, (s, e) in zip(answers, spans):
                assert (len(value) == 7 and text.count(value) == 1
                        and tok.decode(ctx.flatten()[s:e].tolist()) == value)
            assert question.startswith("\nWhat ") and question.endswith((" is", " are"))
            keys = [k for k in (w.split(" is: ")[0] for w in text.split("numbers for ")[1:])]
            assert sum(k in question for k in set(keys)) == (4 if task == "niah_multiquery" else 1)
            if task == "niah_single_1":   # the filler's lines; the needle near its depth
                # (an essay's sentences can be long)
                assert "The grass is green. The sky is blue." in text
                # the needle's depth in the filler
                intro, at = text.index("\n"), text.index("One of the")
                assert abs((at - intro) / (8 * 128 - intro - 60) - depth) < 0.1
    with pytest.raises(ValueError, match=r"niah_multikey_1: a context of 256 tokens "
                                         r"\(2 chunks x 128\) is too short for its intro and 4 "
                                         r"needle\(s\): it needs more than"):
        data.ruler_sample(tok, random.Random(0), "niah_multikey_1", 2, 128)
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        data.ruler_sample(tok, random.Random(0), "niah_single_9", 8, 128)


def test_eval_ruler_runs_each_task_with_a_checkpoint(micro_ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_eval = lambda args: E.main(parse_overrides(args, config_of(vars(E)), E.__file__))
    common = [f"--init_from={micro_ckpt}", "--device=cpu", "--task=ruler", "--depths=0.5",
              "--samples=1"]
    run_eval(common + ["--chunks=16", f"--out={tmp_path / 'r.json'}"])
    out = capsys.readouterr().out
    res = json.load(open(tmp_path / "r.json"))["results"]
    assert [r["task"] for r in res] == list(data.RULER_TASKS)
    for r in res:
        assert 0 <= r["score"] <= 1 and r["window_attention"] is not None
        assert abs(r["value_in_leaf"] + r["value_in_between"] + r["value_in_coarse"] - 1) < 1e-9
    assert ("niah_multiquery: SharedLLM" in out
            and "left the asked values: leaf / between / coarse" in out)
    run_eval(common + ["--chunks=16", "--task=search", "--ruler_tasks=niah_single_1",
                       f"--out={tmp_path / 's.json'}"])
    # every search on the passkey and the asked task
    res = json.load(open(tmp_path / "s.json"))["results"]
    assert [(r["search"], r["task"]) for r in res] == [(s, t) for s in ("vector", "right", "oracle")
                                                        for t in ("passkey", "niah_single_1")]
    assert all(r["coarse"] == 0 for r in res if r["search"] == "oracle")   # it walks to the value
    msg = error_of(E, common + ["--chunks=2"], tmp_path, monkeypatch)
    assert ("a context of 64 tokens (2 chunks x 32) is too short" in msg
            and "it needs more than" in msg)
    msg = error_of(E, common + ["--chunks=16", "--ruler_tasks=niah_single_1,qa_1"], tmp_path,
                   monkeypatch)
    assert msg == ("eval.py: --ruler_tasks=niah_single_1,qa_1: unknown task 'qa_1'; "
                   "expected some of " + ",".join(data.RULER_TASKS))
