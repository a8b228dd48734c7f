# train.py's step and loop: one step is AdamW on the clipped gradient, then the moving average; a
# crash and a resume go on exactly; evaluating changes nothing in training; accumulation is a larger
# batch; the average restarts when text joins; a pretrained model trains only what it is told to.
import json
import os
import random

import pytest
import torch

import data
import model as M
from conftest import GGUF, MICRO, make_hf_checkpoint, real, rel_err, train
from load_llama import PRESETS, load_llama, load_sharedllm
from tokenizer import ByteTokenizer


def ckpt(d):
    return torch.load(os.path.join(d, "ckpt.pt"), weights_only=True)


def test_a_step_is_adamw_on_the_clipped_gradient_then_the_average(tmp_path):
    args = dict(max_iters=2, eval_interval=2, learning_rate=0.05, warmup_iters=2, beta2=0.95,
                ema_decay=0.9, seed=7)
    train(MICRO + ["--task=passkey"] + [f"--{k}={v}" for k, v in args.items()], tmp_path)
    # the same two steps, written out from train.py's settings
    torch.manual_seed(7)
    m = M.SharedLLM(M.Llama(M.LlamaConfig(**PRESETS["micro"])), M.SharedConfig(
        n_lower=2, chunk_size=32, beta=4)).train()
    params = list(m.parameters())
    ema, rng = [p.detach().clone() for p in params], random.Random(7)
    opt = torch.optim.AdamW(params, lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
    norms = []
    for it in range(2):
        ctx, idx, tgt, ql = data.get_batch("passkey", 2, rng, ByteTokenizer(), None, 2, 32, 48)
        m(ctx, idx, tgt, ql)[1].backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).item())
        opt.param_groups[0]["lr"] = 0.05 * (it + 1) / 2   # warmup
        opt.step()
        opt.zero_grad()
        for e, p in zip(ema, params):
            e.mul_(0.9).add_(p.detach(), alpha=0.1)
    assert max(norms) > 1   # the clipping acted
    saved = ckpt(tmp_path / "out")
    for (name, p), e in zip(m.named_parameters(), ema):
        assert rel_err(p, saved["raw"][name]) < 1e-5, name       # the trained weights
        assert rel_err(e, saved["model"][name]) < 1e-5, name     # their moving average


def run(tmp_path, name, docs, *extra, crash_at=None, monkeypatch=None):
    # a mixed run (text from iteration 2, half the text batches without X_C), optionally stopped
    # by a crash while drawing its crash_at-th training batch -> its folder
    out = tmp_path / name
    args = MICRO + ["--task=mixed", "--lm_from=2", "--context_dropout=0.5", f"--data_dir={docs}",
                    "--passkey_frac=0",
                    "--max_iters=6", "--eval_interval=3", "--ema_decay=0.9", f"--out_dir={out}",
                    "--n_chunks=3", "--chunk_schedule=2:3", "--beta_schedule=2:3", *extra]
    if crash_at:
        drawn, get_batch = [], data.get_batch
        def crashing(*a, **kw):
            drawn.append(a[-1] if len(a) > 8 else kw.get("split", "train"))
            if drawn.count("train") == crash_at:
                raise KeyboardInterrupt
            return get_batch(*a, **kw)
        monkeypatch.setattr(data, "get_batch", crashing)
        with pytest.raises(KeyboardInterrupt):
            train(args, tmp_path)
        monkeypatch.setattr(data, "get_batch", get_batch)
        args = [f"--out_dir={out}", "--init_from=resume"]   # the run's own settings, restored
    train(args, tmp_path)
    return out


def training_lines(out):   # the log's training records, without their timings
    lines = [json.loads(line) for line in open(out / "log.jsonl")]
    return [{k: v for k, v in r.items() if k not in ("ms_per_iter", "minutes")} for r in lines]


def test_a_crash_and_a_resume_go_on_exactly(tmp_path, docs, monkeypatch):
    whole = run(tmp_path, "whole", docs)
    resumed = run(tmp_path, "resumed", docs, crash_at=5, monkeypatch=monkeypatch)
    a, b = ckpt(whole), ckpt(resumed)
    for part in ("model", "raw"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert training_lines(whole) == training_lines(resumed)
    kinds = [set(r["loss"]) for r in training_lines(whole) if "loss" in r]
    assert {"lm"} in kinds and {"passkey"} in kinds   # both kinds of batch were drawn


def test_evaluating_changes_nothing_in_training(tmp_path, docs):
    rare, often = run(tmp_path, "rare", docs), run(tmp_path, "often", docs, "--eval_interval=1")
    a, b = ckpt(rare), ckpt(often)
    assert all(torch.equal(a["raw"][k], b["raw"][k]) for k in a["raw"])
    drop = lambda lines: [r for r in lines if "loss" in r]
    assert drop(training_lines(rare)) == drop(training_lines(often))
    assert [r["beta"] for r in drop(training_lines(rare))] == [2, 2, 2, 4, 4, 4]   # the schedule
    assert [list(r["loss"]) for r in drop(training_lines(rare))] == [["passkey"]] * 2 + [["lm"]] * 4


def test_accumulating_gradients_is_a_larger_batch(tmp_path, monkeypatch):
    common = MICRO + ["--task=passkey", "--chunk_pos=plain", "--max_iters=2", "--eval_interval=2",
                      "--ema_decay=0"]
    norms, clip = [], torch.nn.utils.clip_grad_norm_   # the gradient's norm at each step
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: norms.append(
        clip(*a, **k).item()))
    train(common + ["--out_dir=big"], tmp_path)
    train(common + ["--out_dir=acc", "--batch_size=1", "--gradient_accumulation_steps=2"], tmp_path)
    a, b = ckpt(tmp_path / "big")["model"], ckpt(tmp_path / "acc")["model"]
    assert all(rel_err(a[k], b[k]) < 1e-4 for k in a)
    assert abs(norms[0] / norms[2] - 1) < 1e-4 and abs(norms[1] / norms[3] - 1) < 1e-4


def test_the_average_restarts_when_text_joins(tmp_path, docs):
    for lm_from, restarted in ((2, True), (1, False)):
        train(MICRO + ["--task=mixed", f"--lm_from={lm_from}", f"--data_dir={docs}",
                       "--max_iters=2", "--eval_interval=2", "--ema_decay=0.9"], tmp_path)
        saved = ckpt(tmp_path / "out")
        assert all(torch.equal(saved["model"][k], v) for k, v in saved["raw"].items()) == restarted


def test_a_pretrained_model_trains_only_its_cross_attention(tmp_path, docs):
    # train="cross" from an HF folder: the checkpoint holds what trained and the base's path, and
    # reads back with the base unchanged
    make_hf_checkpoint(tmp_path / "hf", vocab=320)
    train(MICRO[1:] + [f"--init_from={tmp_path / 'hf'}", "--task=lm", f"--data_dir={docs}",
                       "--train=cross", "--max_iters=2", "--eval_interval=2", "--ema_decay=0",
                       "--block_size=16", "--context_dropout=0"], tmp_path)
    saved = ckpt(tmp_path / "out")
    assert saved["base"] == str(tmp_path / "hf") and all(".cross_" in k for k in saved["model"])
    model, _, _ = load_sharedllm(str(tmp_path / "out"))
    untrained, _, _ = load_sharedllm(str(tmp_path / "hf"), n_lower=2, chunk_size=32)
    changed = {k for k, v in untrained.state_dict().items()
               if not torch.equal(v, model.state_dict()[k])}
    assert changed == {f"upper.layers.{i}.{name}.weight" for i in range(2) for name in
                       ("cross_attention.wq", "cross_attention.wo", "cross_norm")}


def test_each_step_reads_its_curricula_and_drops_only_text_contexts(tmp_path, docs, monkeypatch):
    # what the model is handed at each training step: the chunk count and beta of the schedules,
    # passkeys alone before lm_from, and X_C dropped from some text batches, never from a passkey
    seen, forward = [], M.SharedLLM.forward
    def spy(self, context, idx, targets=None, question_len=None, beta=None):
        if self.training:
            seen.append((None if context is None else context.shape[1], beta,
                         bool((question_len > 0).any())))
        return forward(self, context, idx, targets, question_len, beta)
    monkeypatch.setattr(M.SharedLLM, "forward", spy)
    train(MICRO + ["--task=mixed", "--lm_from=4", "--passkey_frac=0.5", "--context_dropout=0.5",
                   f"--data_dir={docs}", "--max_iters=24", "--eval_interval=24", "--n_chunks=4",
                   "--chunk_schedule=2:4,3:8", "--beta_schedule=2:6"], tmp_path)
    assert len(seen) == 24 and [b for _, b, _ in seen] == [2] * 6 + [4] * 18
    want = [2] * 4 + [3] * 4 + [4] * 16
    assert all(n == w for (n, _, passkey), w in zip(seen, want) if passkey)
    assert all(n in (None, w) for (n, _, _), w in zip(seen, want))
    assert all(passkey for _, _, passkey in seen[:4])
    text = [n for n, _, passkey in seen if not passkey]
    assert 0 < text.count(None) < len(text) and len(text) < 20   # both kinds after lm_from


@real
def test_the_smollm2_recipe_steps_and_without_context_is_smollm2(tmp_path, docs):
    # config/smollm2_cpu.py for two steps (a question batch, then text) on the real model, small:
    # only the cross-attention changed, so with no context its output is SmolLM2's, exactly
    recipe = os.path.join(os.path.dirname(os.path.dirname(__file__)), "config", "smollm2_cpu.py")
    train([recipe, f"--data_dir={docs}", "--out_dir=out", "--max_iters=2", "--eval_interval=2",
           "--batch_size=2", "--n_chunks=1", "--chunk_schedule=", "--beta_schedule=", "--lm_from=1",
           "--passkey_frac=0", "--eval_iters=1", "--eval_chunks=1"], tmp_path)
    saved = ckpt(tmp_path / "out")
    assert saved["base"] == GGUF and all(".cross_" in k for k in saved["model"])
    model, tok, _ = load_sharedllm(str(tmp_path / "out"))
    base = load_llama(GGUF)
    idx = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        assert torch.equal(model(None, idx)[0], base(idx)[0])
        wo = model.upper.layers[0].cross_attention.wo.weight
        assert wo.abs().sum() > 0   # (it starts at zero: the steps trained it)
