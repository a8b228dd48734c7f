# train.py and data.py: config parsing, samples, overfitting, exact resume, the LLaMA-2 path,
# DDP over gloo.
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
import model as M
from configurator import parse_overrides, parse_schedule
from conftest import ROOT, SHARED_TOKENIZERS, make_hf_checkpoint, tiny_tiktoken_file
from load_llama import preset
from tokenizer import ByteTokenizer

MICRO = ["--preset=micro", "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
         "--block_size=48", "--batch_size=2", "--eval_iters=1", "--eval_chunks=2",
         "--final_eval_chunks=", "--final_eval_iters=0", "--log_interval=1", "--device=cpu"]


def run(args, cwd, ok=True, cmd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run((cmd or [sys.executable, os.path.join(ROOT, "train.py")]) + args, cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=240)
    # torchrun's report hides each rank's own error
    assert (r.returncode == 0) == ok, r.stdout[-2000:] + r.stderr[-6000:]
    return r.stdout + r.stderr


def test_config_errors(tmp_path, capsys):
    import train
    bad = tmp_path / "bad.py"
    bad.write_text("max_iters = 10\nlerning_rate = 1e-3\n")
    wrong = tmp_path / "wrong.py"
    wrong.write_text("max_iters = 1e3\n")
    for args, msg in [(["--lerning_rate=1"], "unknown setting 'lerning_rate'"),
                      (["--max_iters=ten"], "--max_iters=ten: expected an int"),
                      (["--max_iters=1.5"], "--max_iters=1.5: expected an int"),
                      (["max_iters"], "bad argument 'max_iters'"),
                      ([str(bad)], f"config file {bad}: unknown setting 'lerning_rate'"),
                      ([str(wrong)], f"config file {wrong}: expected an int"),
                      (["config/nope.py"], "config file config/nope.py: not found")]:
        with pytest.raises(SystemExit, match=re.escape(msg)):
            parse_overrides(args, dict(train.config), train.__file__)
    # beta is a ratio (C / KVs kept), so it and its schedule may be fractional; the iterations
    # may not
    assert parse_overrides(["--beta=3.2"], dict(train.config), train.__file__)["beta"] == 3.2
    assert parse_schedule("beta_schedule", "1.5:10,2:20", kind=float) == [(1.5, 10), (2.0, 20)]
    with pytest.raises(SystemExit,
                       match=re.escape("--beta_schedule=2:1.5: expected value:until_iter")):
        parse_schedule("beta_schedule", "2:1.5", kind=float)
    with pytest.raises(SystemExit):
        parse_overrides(["--help"], dict(train.config), train.__file__)
    out = capsys.readouterr().out
    # the config block only
    assert "learning_rate = 3e-3" in out and "beta_schedule" in out and "def main" not in out
    # errors that main() raises (in this process: a subprocess each would cost a torch import)
    for args, msg in [(["--train=lower", "--max_iters=1"], "--train=lower: expected one of"),
                      (["--beta_schedule=2"], "--beta_schedule=2: expected value:until_iter pairs"),
                      (["--train=cross", "--task=lm"], "use --context_dropout=0"),
                      (["--context_dropout=1.5"],
                       "--context_dropout=1.5: expected a value in [0, 1]"),
                      (["--final_eval_iters=-1"],
                       "--final_eval_iters=-1: expected a value in [0, inf]"),
                      (["--dtype=float16"],
                       "--dtype=float16 on cpu: float16 autocast is for CUDA GPUs"),
                      (["--final_eval_chunks=4,x"],
                       "--final_eval_chunks=4,x: expected chunk counts like 4,16,64"),
                      (["--eval_chunks=0"], "--eval_chunks=0: expected chunk counts like 4,16,64"),
                      (["--chunk_schedule=0:10"],
                       "--chunk_schedule=0:10: expected value:until_iter pairs"),
                      (["--block_size=20"],
                       "--block_size=20: the passkey question and answer take up to 42 tokens"),
                      (["--chunk_size=16", "--beta=4", "--n_chunks=2"],
                       "--chunk_size=16 with --n_chunks / --chunk_schedule / "
                       "--eval_chunks: 2 chunk(s) hold 32 tokens; the passkey needle "
                       "needs 60"),
                      (["--beta_schedule=64:10"],
                       "--beta_schedule=64:10: expected value:until_iter pairs"),
                      (["--batch_size=0"], "--batch_size=0: expected a value in [1, inf]"),
                      (["--gradient_accumulation_steps=0"],
                       "--gradient_accumulation_steps=0: expected a value in [1, inf]"),
                      (["--max_iters=0"], "--max_iters=0: expected a value in [1, inf]"),
                      (["--eval_interval=0"], "--eval_interval=0: expected a value in [1, inf]"),
                      (["--log_interval=0"], "--log_interval=0: expected a value in [1, inf]"),
                      (["--warmup_iters=-5"], "--warmup_iters=-5: expected a value in [0, inf]"),
                      (["--sigma=-1"], "--sigma=-1.0: expected a value in [0, inf]"),
                      (["--n_chunks=0"], "--n_chunks=0: expected a value in [1, inf]"),
                      (["--task=qa"], "--task=qa: expected lm, passkey or mixed"),
                      (["--needles=all"], "--needles=all: expected passkey or mix"),
                      (["--needles=mix", "--chunk_size=160"],
                       "--block_size=48 with --needles=mix: a needle's question, answer prefix and "
                       "value take up to 179 tokens"),
                      (["--needles=mix", "--pad_passkeys=False"],
                       "--needles=mix with --chunk_size=32 and --n_chunks / --chunk_schedule: 2 "
                       "chunk(s) hold 64 tokens; 4 needles take up to 280"),
                      (["--policy=attention"],
                       "SharedConfig.policy = 'attention'; expected one of ('lexical', "
                       "'vector', 'right')"),
                      (["--preset=huge"], "--preset=huge: expected one of"),
                      (["--tokenizer=nonexistent.model"],
                       "--tokenizer=nonexistent.model: nonexistent.model: no tokenizer"),
                      (["--init_from=/nonexistent"],
                       "--init_from=/nonexistent: no such file or folder"),
                      (["--chunk_pos=random", "--max_chunk_id=1"],
                       "--max_chunk_id=1: random chunk ids for 2 chunks need"),
                      (["--beta=0"], "SharedConfig.beta = 0; expected at least 1"),
                      (["--height=0"], "SharedConfig.height = 0; expected at least 1"),
                      (["--device=gpu"], "--device=gpu: expected auto, cpu, cuda, cuda:N or mps"),
                      (["--chunk_pos=maybe"],
                       "SharedConfig.chunk_pos = 'maybe'; expected one of ('random', 'plain', "
                       "'off')")]:
        cfg = parse_overrides(MICRO + args + [f"--out_dir={tmp_path / 'out'}"], dict(train.config),
                              train.__file__)
        with pytest.MonkeyPatch.context() as mp:
            for k, v in cfg.items():
                mp.setattr(train, k, v)
            with pytest.raises(SystemExit, match=re.escape(msg)):
                train.main()


def test_lm_sample_is_one_document_in_order(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    # 2400 bytes, every position unique
    (docs / "a.txt").write_text("".join(f"<{i:04d}>" for i in range(400)))
    (docs / "b.txt").write_text("b" * 3000)
    tok = ByteTokenizer()
    splits = data.prepare(tok, str(docs), str(tmp_path / "cache"), val_every=2)
    rng = random.Random(0)
    for _ in range(20):
        ctx, idx, tgt, _ = data.lm_sample(splits["train"], rng, 3, 64, 40)
        window = torch.cat([ctx.flatten(), idx, tgt[-1:]])
        text = tok.decode(window.tolist())
        # never across documents
        assert text in (docs / "a.txt").read_text() or text in (docs / "b.txt").read_text()
        # X_D then its next tokens
        assert torch.equal(idx[1:], tgt[:-1])
    with pytest.raises(ValueError, match="no document has 10001 tokens"):
        data.lm_sample(splits["train"], rng, 100, 100, 0)
    # one document: a source with fewer than 10 holds out its last, here its only one
    (docs / "b.txt").unlink()
    with pytest.raises(ValueError, match=re.escape("1 document(s) leave the train split empty")):
        data.prepare(tok, str(docs), str(tmp_path / "cache2"))


def test_several_sources_are_split_each_and_sampled_evenly(tmp_path):
    # two domains of very different sizes: each keeps validation documents of its own, and lm_sample
    # draws the domains evenly, not by their number of documents
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for i in range(20):
        (a / f"{i:02d}.txt").write_text("a" * 500)
    for i in range(3):
        (b / f"{i}.txt").write_text("b" * 500)
    tok = ByteTokenizer()
    splits = data.prepare(tok, f"{a},{b}", str(tmp_path / "cache"))
    assert (splits["train"][2].tolist() == [0] * 18 + [1] * 2
            and splits["val"][2].tolist() == [0, 0, 1])
    rng = random.Random(0)
    drawn = [tok.decode(data.lm_sample(splits["train"], rng, 2, 64, 32)[1][5:6].tolist())
             for _ in range(400)]
    # 2 of 20 training documents, half of the samples
    assert 0.42 < drawn.count("b") / 400 < 0.58
    # one source: its own cache
    assert data.prepare(tok, str(a), str(tmp_path / "cache"))["train"][1][-1] == 18 * 501
    # Python's reference documentation, as prose
    docs = data.source_texts("pydoc", data.corpus_files("pydoc"))
    # a short tail joins the last
    assert len(docs) >= 4 and all(len(d) >= 100_000 for d in docs) and "assert" in docs[0]
    # "a,b," must not add the standard library
    with pytest.raises(ValueError, match="an empty source between commas"):
        data.prepare(tok, f"{a},{b},", str(tmp_path / "cache"))
    # "pydoc" makes 4+ documents of its one file and holds out its last; the same file named by its
    # path is one document, held out whole: two caches, not one (the key once named only the files)
    topics = data.corpus_files("pydoc")[0]
    held = [int(data.prepare(tok, src, str(tmp_path / "cache"), splits=("val",))["val"][1][-1])
            for src in ("pydoc", topics)]
    assert held == [len(docs[-1].encode()) + 1, os.path.getsize(topics) + 1]        # bytes, and BOS
    # a cache named the old way (the files alone: what "pydoc" wrote before the change) is not read
    # for the path
    old = hashlib.sha1(json.dumps([tok.spec, [(topics, os.path.getsize(topics))]],
                                  sort_keys=True).encode()).hexdigest()
    (tmp_path / "old").mkdir()
    # a 7-token document it must not read
    np.save(tmp_path / "old" / f"{old[:12]}_val.offsets.npy", [0, 7])
    assert data.prepare(tok, topics, str(tmp_path / "old"),
                        splits=("val",))["val"][1].tolist() == [0, held[1]]


def test_passkey_sample():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for depth in (0.0, 0.3, 0.77, 1.0):
        ctx, idx, tgt, qlen = data.passkey_sample(tok, rng, 4, 128, depth=depth, key=12345)
        text = tok.decode(ctx.flatten().tolist())
        # needle wholly inside X_C
        assert ctx.shape == (4, 128) and text.count("12345") == 2
        at = text.index("The pass key is 12345")
        # BOS is not text
        assert at == round(depth * (512 - 1 - len("The pass key is 12345. Remember it. "
                                                  "12345 is the pass key. ")))
        # nothing in the question gives it away
        assert "12345" not in tok.decode(idx.tolist()[: qlen - 1])
        scored = (tgt != -100).nonzero().flatten().tolist()
        assert (tok.decode(tgt[scored].tolist()) == "12345"
                and scored == list(range(qlen - 1, qlen + 4)))
        assert tok.decode(idx[:qlen].tolist()) == data.QUESTION


def asked(xd):   # -> the needle template and key whose question and answer prefix X_D is
    for t in data.NEEDLE_TEMPLATES:
        pattern = re.escape(f"\n{t[1]} {t[2]}").replace(re.escape("{key}"), "(.+?)")
        m = re.fullmatch(pattern, xd)
        if m and len(set(m.groups())) == 1:
            return t, m.group(1)
    raise AssertionError(f"no template asks {xd!r}")


def test_needle_sample_asks_one_fact_in_other_words_and_scores_its_value():
    # --needles=mix: each haystack holds its asked fact once, the question names its key, not its
    # value, and only the value's tokens (from the space before it) are scored
    tok, rng, seen = ByteTokenizer(), random.Random(0), set()
    for _ in range(40):
        ctx, idx, tgt, qlen = data.needle_sample(tok, rng, 8, 128)
        text, xd = tok.decode(ctx.flatten().tolist()), tok.decode(idx[:qlen].tolist())
        value = tok.decode(tgt[tgt != -100].tolist())
        assert ctx.shape == (8, 128) and value.startswith(" ") and value[1:].isdigit()
        scored = (tgt != -100).nonzero().flatten().tolist()
        assert scored == list(range(qlen - 1, qlen - 1 + len(value)))
        template, key = asked(xd)
        assert value[1:] not in xd
        assert text.count(template[0].format(key=key, value=value[1:])) == 1   # the fact, once
        seen.add(data.NEEDLE_TEMPLATES.index(template))
    assert seen == set(range(len(data.NEEDLE_TEMPLATES)))
    batch = data.get_batch("needles", 12, random.Random(1), tok, None, 8, 128, None)
    assert batch[0].shape == (12, 8, 128) and batch[1].shape == batch[2].shape
    with pytest.raises(ValueError, match="block_size T=20 is too short for a needle's question"):
        data.needle_sample(tok, random.Random(0), 8, 128, T=20)
    with pytest.raises(ValueError, match="a context of 64 tokens is too short for"):
        data.needle_sample(tok, random.Random(0), 1, 64)


def test_fixed_batch_overfits():
    torch.manual_seed(0)
    # no split noise
    s = M.SharedLLM.from_llama(M.Llama(preset("micro")), n_lower=1, chunk_size=32, height=3,
                               beta=4).eval()
    batch = data.get_batch("passkey", 4, random.Random(0), ByteTokenizer(), None, 2, 32, None)
    opt = torch.optim.AdamW(s.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        _, loss = s(*batch[:3], question_len=batch[3])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # memorised: 5.5 -> 0.002 here
    assert losses[0] > 4.0 and losses[-1] < 0.01, (losses[0], losses[-1])


def test_resume_equals_uninterrupted_run(tmp_path, capsys):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    # the default task: passkey first, language-modeling batches mixed in from lm_from (after the
    # resume point)
    common = MICRO + ["--max_iters=6", "--eval_interval=3", "--warmup_iters=2", "--task=mixed",
                      "--lm_from=4"]
    train_in_process(common + [f"--out_dir={full}"], tmp_path)
    out = capsys.readouterr().out
    assert "tok/s" in out and "mfu" in out
    evals = [line for line in out.splitlines() if line.startswith("eval iter")]
    # LM not trained yet: not shown
    assert evals[0].startswith("eval iter 3: passkey@2") and "lm_loss" not in evals[0]
    assert evals[1].startswith("eval iter 6: passkey@2") and "ppl_ratio@2" in evals[1]
    train_in_process(common + [f"--out_dir={part}", "--stop_iter=3"], tmp_path)
    assert torch.load(os.path.join(part, "ckpt.pt"), weights_only=True)["iter_num"] == 3
    # a SharedLLM setting other than the checkpoint's is refused, not silently replaced by the
    # checkpoint's
    with pytest.raises(SystemExit, match=re.escape(
            "was trained with policy='lexical', chunk_pos='random' but this "
            "run sets policy='vector', chunk_pos='off'")):
        train_in_process(common + [f"--out_dir={part}", "--init_from=resume", "--chunk_pos=off",
                                   "--policy=vector"], tmp_path)
    train_in_process(common + [f"--out_dir={part}", "--init_from=resume"], tmp_path)
    a = torch.load(os.path.join(full, "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(part, "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 6
    # the moving average, and the raw weights that go on training
    assert sorted(a["raw"]) == sorted(a["model"])
    for k in a["model"]:
        assert (torch.equal(a["model"][k], b["model"][k])
                and torch.equal(a["raw"][k], b["raw"][k])), k
    assert not os.path.exists(os.path.join(full, "ckpt.pt.tmp"))


def test_a_step_line_lists_its_losses_in_one_order(tmp_path, capsys):
    # a log line averages every batch kind since the last one: passkey first, then text, whichever
    # came first
    train_in_process(MICRO + ["--task=mixed", "--lm_from=0", "--passkey_frac=0.5", "--max_iters=8",
                              "--log_interval=4", "--eval_interval=8", f"--out_dir={tmp_path}"],
                     tmp_path)
    lines = re.findall(r"^iter \d+: loss (.*?), lr", capsys.readouterr().out, re.M)
    assert len(lines) == 2 and all(re.fullmatch(r"[\d.]+ \(passkey\) [\d.]+ \(lm\)", x)
                                   for x in lines), lines


def test_checkpoint_holds_the_moving_average(tmp_path):
    # after one step, "model" = d * w0 + (1 - d) * w1 and "raw" = w1 (w0: the same run at learning
    # rate 0)
    common = MICRO + ["--max_iters=1", "--ema_decay=0.9"]
    train_in_process(common + ["--learning_rate=0", f"--out_dir={tmp_path / 'w0'}"], tmp_path)
    train_in_process(common + [f"--out_dir={tmp_path / 'w1'}"], tmp_path)
    w0 = torch.load(tmp_path / "w0" / "ckpt.pt", weights_only=True)["raw"]
    ck = torch.load(tmp_path / "w1" / "ckpt.pt", weights_only=True)
    moved = 0
    for k, w1 in ck["raw"].items():
        assert torch.allclose(ck["model"][k], 0.9 * w0[k] + 0.1 * w1, rtol=0, atol=1e-7), k
        moved += not torch.equal(w1, w0[k])
    assert moved > 10                                    # the step did change the weights
    # evaluating swaps the average in and the raw weights back exactly: evaluating every step
    # changes nothing
    common = MICRO + ["--max_iters=3", "--warmup_iters=1"]
    train_in_process(common + ["--eval_interval=1", f"--out_dir={tmp_path / 'every'}"], tmp_path)
    train_in_process(common + ["--eval_interval=100", f"--out_dir={tmp_path / 'end'}"], tmp_path)
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True) for d in ("every", "end"))
    assert all(torch.equal(a["raw"][k], b["raw"][k]) and torch.equal(a["model"][k], b["model"][k])
               for k in a["raw"])
    # off: no average, the checkpoint holds the raw weights of the very same run
    train_in_process(common + ["--eval_interval=100", "--ema_decay=0",
                               f"--out_dir={tmp_path / 'off'}"], tmp_path)
    off = torch.load(tmp_path / "off" / "ckpt.pt", weights_only=True)
    assert "raw" not in off and all(torch.equal(off["model"][k], b["raw"][k]) for k in b["raw"])
    with pytest.raises(SystemExit,
                       match=re.escape("--ema_decay=1.0: expected 0 (off) or a decay in (0, 1)")):
        train_in_process(MICRO + ["--ema_decay=1", f"--out_dir={tmp_path / 'bad'}"], tmp_path)


def test_the_average_restarts_when_text_joins(tmp_path):
    # in "mixed", at lm_from the average forgets the passkey-only weights. Text joins after step 1
    # (lm_from=1), so after step 2 "model" = d * w1 + (1 - d) * w2 (w1: the same run stopped after
    # step 1), not d^2 w0 + ...
    common = MICRO + ["--task=mixed", "--lm_from=1", "--max_iters=2", "--ema_decay=0.9"]
    train_in_process(common + ["--stop_iter=1", f"--out_dir={tmp_path / 'w1'}"], tmp_path)
    train_in_process(common + [f"--out_dir={tmp_path / 'w2'}"], tmp_path)
    w1 = torch.load(tmp_path / "w1" / "ckpt.pt", weights_only=True)["raw"]
    ck = torch.load(tmp_path / "w2" / "ckpt.pt", weights_only=True)
    # lerp_ rounds unlike this formula: up to 2 float32 ulps at 1.0 (1.2e-7 each)
    for k, w2 in ck["raw"].items():
        assert torch.allclose(ck["model"][k], 0.9 * w1[k] + 0.1 * w2, rtol=0, atol=2.4e-7), k
    # step 2 did change the weights
    assert sum(not torch.equal(w1[k], ck["raw"][k]) for k in w1) > 10
    # resumed from the checkpoint at lm_from (saved after the restart), the run ends exactly as the
    # straight one
    train_in_process(common + ["--init_from=resume", f"--out_dir={tmp_path / 'w1'}"], tmp_path)
    res = torch.load(tmp_path / "w1" / "ckpt.pt", weights_only=True)
    assert all(torch.equal(res[part][k], ck[part][k])
               for part in ("model", "raw") for k in ck["raw"])


def test_llama2_path_on_tiny_random_checkpoint(tmp_path):
    spm = os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")
    if not os.path.isfile(spm):
        pytest.skip("shared tokenizer files not present")
    ck = tmp_path / "llama"
    make_hf_checkpoint(ck, vocab=32000)
    shutil.copy(spm, ck / "tokenizer.model")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"{i}.txt").write_text(" ".join(f"word{j} of document {i}." for j in range(400)))
    out = run(["--init_from=" + str(ck), "--train=cross", "--task=lm", f"--data_dir={docs}",
               "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
               "--block_size=48", "--batch_size=2", "--max_iters=3", "--eval_interval=3",
               "--context_dropout=0",
               "--eval_iters=1", "--eval_chunks=2", "--final_eval_chunks=", "--final_eval_iters=0",
               "--device=cpu", f"--out_dir={tmp_path / 'out'}"], tmp_path)
    assert "memory estimate: weights" in out and "eval iter 3: lm_loss@2" in out
    # cross-attention only: (norm 64 + wq 64x64 + wo 64x64) x 1 layer
    assert "trainable 8,256 / frozen" in out


def test_ddp_over_gloo_two_processes_and_exact_resume(tmp_path):
    # language modeling with and without X_C: rank 0 tokenizes the corpus while rank 1 waits, and
    # batches that leave cross-attention unused on one rank do not stall the gradient all-reduce.
    # Resumed half-way, every rank goes on with its own random streams: the run equals the
    # uninterrupted one bit for bit, on both ranks.
    ddp = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py")]
    common = MICRO + ["--max_iters=6", "--eval_interval=3", "--task=mixed", "--lm_from=0",
                      "--passkey_frac=0", "--context_dropout=0.5"]
    full, part = tmp_path / "full", tmp_path / "part"
    out = run(common + [f"--out_dir={full}"], tmp_path, cmd=ddp)
    # corpus prepared once
    assert "2 process(es)" in out and "ppl_ratio@2" in out and out.count("prepared ") == 2
    run(common + [f"--out_dir={part}", "--stop_iter=3"], tmp_path, cmd=ddp)
    run(common + [f"--out_dir={part}", "--init_from=resume"], tmp_path, cmd=ddp)
    a, b = (torch.load(d / "ckpt.pt", weights_only=True) for d in (full, part))
    assert a["iter_num"] == b["iter_num"] == 6 and len(a["rngs"]) == len(b["rngs"]) == 2
    # two ranks, two data streams
    assert a["rngs"][0]["data"] != a["rngs"][1]["data"]
    for r in range(2):
        assert (a["rngs"][r]["data"] == b["rngs"][r]["data"]
                and a["rngs"][r]["tree"] == b["rngs"][r]["tree"])
        assert torch.equal(a["rngs"][r]["torch"], b["rngs"][r]["torch"])
    for k in a["model"]:
        assert (torch.equal(a["model"][k], b["model"][k])
                and torch.equal(a["raw"][k], b["raw"][k])), k


def test_context_dropout_one_never_trains_cross_attention(tmp_path, capsys):
    # every language-modeling batch without X_C: cross-attention gets no gradient, so its
    # zero-initialised output projection stays exactly zero, while the rest of the model trains
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"{i}.txt").write_text(" ".join(f"token{j % 17} line {j}" for j in range(300)))
    for drop in (1.0, 0.0):
        train_in_process(MICRO + ["--task=mixed", "--passkey_frac=0.0", "--lm_from=0",
                                  f"--context_dropout={drop}",
                                  f"--data_dir={docs}", "--max_iters=3", "--eval_interval=3",
                                  f"--out_dir={tmp_path / str(drop)}"], tmp_path)
        out = capsys.readouterr().out
        assert "lm_loss@2" in out and "passkey@2" in out
        ck = torch.load(tmp_path / str(drop) / "ckpt.pt", weights_only=True)["model"]
        wo = [ck[k].abs().max().item() for k in ck if "cross_attention.wo" in k]
        # with the context (drop 0) it does train
        assert wo and (max(wo) == 0) == (drop == 1.0), wo


def short_docs(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(10):
        # about 800 bytes each
        (docs / f"{i}.txt").write_text(" ".join(f"token{j % 17} line {j}" for j in range(60)))
    return docs


def test_every_length_is_checked_at_start_up_and_weights_are_never_lost(tmp_path, capsys):
    docs = short_docs(tmp_path)
    lm = MICRO + ["--task=lm", f"--data_dir={docs}", "--max_iters=2", "--eval_interval=2",
                  "--warmup_iters=1"]
    # an evaluation length that no validation document holds: measured on what fits, said at
    # start-up
    train_in_process(lm + ["--final_eval_chunks=2,64", f"--out_dir={tmp_path / 'a'}"], tmp_path)
    out = capsys.readouterr().out
    assert ("language modeling is not evaluated at [64] chunks: a window needs n x 32 + 48 + 1 "
            "tokens" in out)
    assert "ppl_ratio@2" in out and "@64" not in out and os.path.isfile(tmp_path / "a" / "ckpt.pt")
    # resuming it: settings the checkpoint fixes are refused, a run already done says so, and a
    # checkpoint is no LLaMA
    with pytest.raises(SystemExit,
                       match="was trained with preset='micro' but this run sets preset='tiny'"):
        train_in_process(lm + ["--init_from=resume", "--preset=tiny",
                               f"--out_dir={tmp_path / 'a'}"], tmp_path)
    train_in_process(lm + ["--init_from=resume", f"--out_dir={tmp_path / 'a'}"], tmp_path)
    assert (f"nothing to train: {tmp_path / 'a'}/ckpt.pt is at iteration 2 and --max_iters is 2"
            in capsys.readouterr().out)
    with pytest.raises(SystemExit,
                       match="a train.py checkpoint; to continue it, use --init_from=resume"):
        train_in_process(lm + [f"--init_from={tmp_path / 'a'}", f"--out_dir={tmp_path / 'b'}"],
                         tmp_path)
    with pytest.raises(SystemExit, match="--out_dir=.*docs/0.txt: a file, not a folder"):
        train_in_process(lm + [f"--out_dir={docs / '0.txt'}"], tmp_path)
    # a training length that does not fit: refused before anything is trained
    with pytest.raises(SystemExit, match=r"--n_chunks / --chunk_schedule: 64 chunks x 32 \+ "
                                         r"block_size 48 \+ 1 = 2,097 tokens, and the longest "
                                         r"training document of .*docs has"):
        train_in_process(lm + ["--n_chunks=64", f"--out_dir={tmp_path / 'b'}"], tmp_path)
    with pytest.raises(SystemExit,
                       match="--data_dir=.*nowhere: data_dir=.*nowhere': no such file or folder"):
        train_in_process(lm + [f"--data_dir={tmp_path / 'nowhere'}",
                               f"--out_dir={tmp_path / 'b'}"], tmp_path)
    # an evaluation that fails after training: the weights were saved before it
    real = data.get_batch
    def fails_on_validation(kind, *a, **kw):
        if kw.get("split", a[-1] if len(a) > 7 else "train") == "val":
            raise RuntimeError("evaluation broke")
        return real(kind, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "get_batch", fails_on_validation)
        with pytest.raises(RuntimeError, match="evaluation broke"):
            train_in_process(lm + [f"--out_dir={tmp_path / 'c'}"], tmp_path)
    assert "evaluation at iteration 2 failed; the weights are saved in" in capsys.readouterr().out
    assert torch.load(tmp_path / "c" / "ckpt.pt", weights_only=True)["iter_num"] == 2


def test_mfu_is_against_the_peak_measured_once_at_start_up(tmp_path, capsys):
    # the matmul peak is measured once, at start-up (its line identifies the machine), and every
    # step line's MFU is against it: never measured again mid-run
    import json
    import train
    from configurator import peak_flops
    calls = []
    def counted(*a, **kw):
        calls.append(a)
        return peak_flops(*a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "peak_flops", counted)
        train_in_process(MICRO + ["--max_iters=3", "--eval_interval=3", f"--out_dir={tmp_path}"],
                         tmp_path)
    out = capsys.readouterr().out
    mfu = [float(x) for x in re.findall(r"mfu ([\d.]+)%", out)]
    logged = [json.loads(line) for line in open(tmp_path / "log.jsonl") if '"mfu"' in line]
    assert (len(calls) == 1 and "measured matmul peak: " in out and len(mfu) == 3
            and max(mfu) <= 100.0)
    assert all(0 < r["mfu"] <= 1.0 and r["peak_flops"] > 1.0 for r in logged)
    assert len({r["peak_flops"] for r in logged}) == 1


def test_profile_iter_counts_that_step_and_its_compress(tmp_path, capsys):
    # --profile_iter=N prints iteration N's kernel launches and host syncs, then its batch's
    # compress alone; 0: nothing
    train_in_process(MICRO + ["--max_iters=2", "--eval_interval=2", "--task=passkey",
                              "--profile_iter=1", f"--out_dir={tmp_path}"], tmp_path)
    lines = re.findall(r"^iteration (1.*): ([\d,]+) kernel launches, (\d+) host syncs",
                       capsys.readouterr().out, re.M)
    assert [name for name, _, _ in lines] == ["1 (2 chunks)",
                                              "1's compress (passkey, 2 chunks)"], lines
    step, compress = (int(n.replace(",", "")) for _, n, _ in lines)
    assert step > compress > 100 and [s for _, _, s in lines] == ["3", "3"]
    train_in_process(MICRO + ["--max_iters=1", "--eval_interval=1", f"--out_dir={tmp_path / 'b'}"],
                     tmp_path)
    assert "kernel launches" not in capsys.readouterr().out


def test_compile_compiles_each_upper_block_and_not_the_tree_search(monkeypatch):
    # torch.compile of the whole SharedLLM traced the host tree search too, guarded on its values
    # and recompiled at every batch until its limit (4.4 minutes for 10 iterations of the
    # default); --compile=True compiles each upper block in place: the step still calls the
    # eager SharedLLM, and the checkpoint's names stay the same
    import train
    s = M.SharedLLM.from_llama(M.Llama(preset("micro")), n_lower=1, chunk_size=32)
    names = list(s.state_dict())
    monkeypatch.setattr(train, "compile", True)
    model, _ = train.place_model(s, False, "cpu", "cpu", "float32", False, None)
    assert model is s and list(s.state_dict()) == names
    assert all(blk._compiled_call_impl is not None for blk in s.upper.layers)
    assert s._compiled_call_impl is None


def train_in_process(args, tmp_path):
    # train.main() with these flags, in this process (a subprocess would cost a torch import)
    import train
    cfg = parse_overrides(args, dict(train.config), train.__file__)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in cfg.items():
            mp.setattr(train, k, v)
        mp.setattr(train, "config", cfg)   # what the checkpoint records
        train.main()


def tiny_llama_and_docs(tmp_path, **kw):
    # a random tiny HF checkpoint with a (Llama-3 format) tokenizer of 526 ids, and 10 text
    # documents
    ck, docs = tmp_path / "llama", tmp_path / "docs"
    ck.mkdir()
    n = tiny_tiktoken_file(ck / "tokenizer.model")
    make_hf_checkpoint(ck, vocab=n + 256, bos_token_id=n, eos_token_id=n + 1, **kw)
    docs.mkdir()
    for i in range(10):
        (docs / f"{i}.txt").write_text(" ".join(f"w{(j * 7 + i) % 300} x{j % 13}"
                                                for j in range(400)))
    return ck, docs


def test_bf16_base_keeps_small_cross_attention_updates(tmp_path, capsys):
    # A bf16 base model, 10 AdamW steps at lr 1e-5 on the cross-attention: in bf16 itself nearly
    # every step would round away (bf16(0.02 + 1e-5) == 0.02); held in fp32 (master weights), the
    # steps match an all-fp32 run's.
    ck, docs = tiny_llama_and_docs(tmp_path)
    common = [f"--init_from={ck}", "--train=cross", "--task=lm", f"--data_dir={docs}",
              "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
              "--beta_schedule=", "--block_size=32", "--batch_size=2", "--max_iters=10",
              "--eval_interval=10", "--eval_iters=1", "--eval_chunks=2", "--final_eval_chunks=",
              "--final_eval_iters=0", "--context_dropout=0",
              "--learning_rate=1e-5", "--min_lr=1e-5",
              # the raw steps
              "--warmup_iters=0", "--ema_decay=0", "--device=cpu", "--log_interval=5"]
    deltas = {}
    for dt in ("bfloat16", "float32"):
        train_in_process(common + [f"--dtype={dt}", f"--out_dir={tmp_path / dt}"], tmp_path)
        saved = torch.load(tmp_path / dt / "ckpt.pt", weights_only=True)
        wq = saved["model"]["upper.layers.0.cross_attention.wq.weight"]
        assert wq.dtype == torch.float32 and set(saved["model"]) == {
            f"upper.layers.0.cross_{k}.weight" for k in ("norm", "attention.wq", "attention.wo")}
        base = load_llama_weights(ck)["model.layers.0.self_attn.q_proj.weight"]
        # the step taken from where training started
        deltas[dt] = wq - base.to(getattr(torch, dt)).float()
    out = capsys.readouterr().out
    assert "(autocast)" in out and "memory estimate: weights" in out
    changed = (deltas["bfloat16"] != 0).float().mean().item()
    err = ((deltas["bfloat16"] - deltas["float32"]).norm() / deltas["float32"].norm()).item()
    print(f"bf16 base: {100 * changed:.1f}% of wq entries moved; step vs the fp32 run: "
          f"relative difference {err:.3f}")
    # bf16 compute moves the step by ~16% here; a lost step would read ~1
    assert changed > 0.99 and err < 0.3
    # the same steps on a bf16 weight itself
    w = (torch.randn(64, 64) * 0.02).bfloat16().requires_grad_()
    opt = torch.optim.AdamW([w], lr=1e-5)
    w0 = w.detach().clone()
    for _ in range(10):
        w.grad = torch.randn_like(w)
        opt.step()
    # most of them lost: what the fp32 copy prevents
    assert (w.detach() != w0).float().mean().item() < 0.5


def load_llama_weights(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.parametrize("recipe,shape,trainable", [
    ("llama2_7b_lm", "llama2-7b", 4 * (4096 + 2 * 4096 * 4096)),
    ("llama2_7b_sft", "llama2-7b", 16 * (4096 + 2 * 4096 * 4096)),
    ("smollm2_gpu", "smollm2-135m", 12 * (576 + 2 * 576 * 576))])
def test_gpu_recipes_memory_estimate_counts_what_is_allocated(recipe, shape, trainable, capsys):
    # the recipes' models built on the meta device (nothing allocated), as train.py builds them on a
    # GPU: the base in bf16, what trains in fp32; the estimate must count exactly those bytes and
    # fit one 80 GB GPU
    import train
    from checkpoint import set_trainable
    from configurator import memory_estimate
    cfg = parse_overrides([os.path.join(ROOT, "config", recipe + ".py")], dict(train.config),
                          train.__file__)
    with torch.device("meta"):
        llama = M.Llama(preset(shape)).to(torch.bfloat16)
        s = M.SharedLLM(llama, M.SharedConfig(n_lower=cfg["n_lower"], chunk_size=cfg["chunk_size"],
                                              beta=cfg["beta"]))
    set_trainable(s, cfg["train"])   # what trains, held in fp32
    memory_estimate(s, "bfloat16", "cuda", *(cfg[k] for k in ("batch_size", "block_size",
                                                              "n_chunks", "ema_decay",
                                                              "activation_checkpointing")))
    out = capsys.readouterr().out
    est = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) GiB", out)}
    n_all = sum(p.numel() for p in s.parameters())
    assert sum(p.numel() for p in s.parameters() if p.requires_grad) == trainable
    assert all(p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16)
               for p in s.parameters())
    assert est["weights"] == round(((n_all - trainable) * 2 + trainable * 4) / 2**30, 1)
    assert (est["grads"] == round(trainable * 4 / 2**30, 1)
            and est["adam"] == round(trainable * 8 / 2**30, 1))
    assert est["total"] < 80, out


def test_final_eval_reads_more_haystacks_and_more_text_windows(tmp_path):
    # the last evaluation draws final_eval_iters passkey batches per length and final_eval_iters
    # language-modeling batches: on 128 windows the ratio moved by up to 0.014 with the windows
    # drawn (docs/experiments.md)
    import train
    kinds = []
    def counting(kind, *a, **kw):
        # an evaluation's batch (training draws from "train")
        if a[-1] in ("val", None):
            kinds.append(kind)
        return get_batch(kind, *a, **kw)
    get_batch = data.get_batch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(data, "get_batch", counting)
        train_in_process(MICRO + ["--task=mixed", "--lm_from=0", "--max_iters=2",
                                  "--eval_interval=100", "--eval_iters=2", "--final_eval_iters=5",
                                  f"--out_dir={tmp_path}"], tmp_path)
    assert kinds.count("passkey") == 5 and kinds.count("lm") == 5


def test_the_smollm2_retrieval_recipe_trains_only_the_cross_attention(tmp_path, capsys,
                                                                       monkeypatch):
    # config/smollm2_retrieval_cpu.py on a random tiny checkpoint (its sizes scaled down): needle
    # batches, then text batches, the one search; the base model's every weight stays as it was,
    # the cross-attention moves
    from checkpoint import load_sharedllm
    from load_llama import load_llama
    import model
    ck, docs = tiny_llama_and_docs(tmp_path)
    # the search, counted in training steps and evaluations alike (it has no weights, no mode)
    searched = []
    policy = model.lexical_policy
    monkeypatch.setattr(model, "lexical_policy", lambda *a: searched.append(1) or policy(*a))
    train_in_process([os.path.join(ROOT, "config", "smollm2_retrieval_cpu.py"), f"--init_from={ck}",
                      f"--data_dir={docs}", "--n_lower=1", "--chunk_size=144", "--chunk_schedule=",
                      "--beta_schedule=1:1", "--block_size=32", "--batch_size=2", "--max_iters=6",
                      "--lm_from=3", "--passkey_frac=0.5", "--eval_interval=6", "--eval_iters=1",
                      "--eval_chunks=2", "--final_eval_chunks=", "--final_eval_iters=0",
                      "--log_interval=1", "--device=cpu", f"--out_dir={tmp_path / 'out'}"],
                     tmp_path)
    assert "policy='lexical'" in capsys.readouterr().out and searched           # the one search ran
    kinds = {k for line in open(tmp_path / "out" / "log.jsonl")
             for k in json.loads(line).get("loss", {})}
    assert kinds == {"needles", "lm"}                                # both kinds of batch trained
    trained, base = (load_sharedllm(str(tmp_path / "out"))[0].state_dict(),
                     load_llama(str(ck)).state_dict())
    cross = {k for k in trained if ".cross_" in k}
    # the base model, bit for bit
    assert all(torch.equal(trained["upper." + k], v) for k, v in base.items())
    # zero at the start, moved
    assert cross and all(trained[k].abs().sum() > 0 for k in cross if "wo" in k)
