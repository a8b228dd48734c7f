# The LLaMA path end to end on a tiny random HF checkpoint, as the README's "Your own LLaMA" section
# runs it: smoke test -> train (light checkpoints) -> resume -> sample -> eval, and a changed base
# refused.
import json
import os
import subprocess
import sys

import pytest
import torch

import eval as E
import sample as S
from configurator import config_of, parse_overrides
from conftest import ROOT
from test_train import tiny_llama_and_docs, train_in_process


def test_smoke_train_resume_sample_eval_with_light_checkpoints(tmp_path, capsys):
    ck, docs = tiny_llama_and_docs(tmp_path)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "load_llama.py"), str(ck),
                        "--prompt=the thing", "--max_new_tokens=4"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (r.returncode == 0 and "loaded" in r.stdout
            and "'the thing' ->" in r.stdout), r.stdout + r.stderr
    common = [f"--init_from={ck}", "--train=cross", "--task=lm", f"--data_dir={docs}",
              "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
              "--beta_schedule=", "--block_size=32", "--batch_size=2", "--max_iters=4",
              "--eval_interval=2", "--eval_iters=1", "--eval_chunks=2", "--final_eval_chunks=",
              "--final_eval_iters=0", "--context_dropout=0", "--sigma=0.2", "--warmup_iters=1",
              "--device=cpu", "--log_interval=1"]
    full, part = tmp_path / "full", tmp_path / "part"
    train_in_process(common + [f"--out_dir={full}"], tmp_path)
    train_in_process(common + [f"--out_dir={part}", "--stop_iter=2"], tmp_path)
    train_in_process(common + [f"--out_dir={part}", "--init_from=resume"], tmp_path)
    a, b = (torch.load(d / "ckpt.pt", weights_only=True) for d in (full, part))
    assert (a["iter_num"] == b["iter_num"] == 4 and a["base"]["path"] == str(ck)
            and len(a["base"]["sha256"]) == 64)
    # light: only what trains
    assert sorted(a["model"]) == ["upper.layers.0.cross_attention.wo.weight",
                                  "upper.layers.0.cross_attention.wq.weight",
                                  "upper.layers.0.cross_norm.weight"]
    # and the raw weights, for resume
    assert sorted(a["raw"]) == sorted(a["model"])
    for k in a["model"]:
        # resume is exact
        assert (torch.equal(a["model"][k], b["model"][k])
                and torch.equal(a["raw"][k], b["raw"][k])), k
    out = capsys.readouterr().out
    assert "memory estimate: weights" in out and "eval iter 4: lm_loss@2" in out

    text = (docs / "3.txt").read_text()
    cfg = parse_overrides([f"--init_from={part}", f"--context={text[:1500]}", "--prompt=w17 x3 w24",
                           "--max_new_tokens=5"], config_of(vars(S)), S.__file__)
    assert len(S.main(cfg)) == 5
    cfg = parse_overrides([f"--init_from={part}", "--task=ppl", "--max_windows=4"],
                          config_of(vars(E)), E.__file__)
    # data_dir, C and T come from the checkpoint; default lengths that fit
    res = E.main(cfg)
    out = capsys.readouterr().out
    assert ([r["n_chunks"] for r in res] == [2, 8, 32]
            and "chunk counts [128] left out: the longest validation document has" in out)
    # K = T // 2 when X_D is short of 512
    assert res[0]["scored_per_window"] == 16 and res[0]["x_d_tokens"] == 32
    with pytest.raises(SystemExit, match="the longest has"):
        E.main(parse_overrides([f"--init_from={part}", "--task=ppl", "--chunks=256"],
                               config_of(vars(E)), E.__file__))

    # the base changes under the checkpoint
    c = json.load(open(ck / "config.json"))
    json.dump({**c, "rms_norm_eps": 1e-6}, open(ck / "config.json", "w"))
    with pytest.raises(SystemExit, match="those files have changed since"):
        S.main(parse_overrides([f"--init_from={part}"], config_of(vars(S)), S.__file__))
    with pytest.raises(SystemExit, match="those files have changed since"):
        train_in_process(common + [f"--out_dir={part}", "--init_from=resume", "--max_iters=6"],
                         tmp_path)


def test_full_attention_is_the_unchanged_base_model(tmp_path, capsys):
    # --train=upper changes the upper model's weights; eval.py --full must still run the base
    # checkpoint as it was
    import types
    import data
    from load_llama import load_llama, load_tokenizer
    ck, docs = tiny_llama_and_docs(tmp_path)
    train_in_process([f"--init_from={ck}", "--train=upper", "--task=lm", f"--data_dir={docs}",
                      "--n_lower=1", "--chunk_size=32", "--n_chunks=2", "--chunk_schedule=",
                      "--beta_schedule=", "--block_size=32", "--batch_size=2", "--max_iters=3",
                      "--eval_interval=3", "--eval_iters=1", "--eval_chunks=2",
                      "--final_eval_chunks=", "--final_eval_iters=0", "--learning_rate=1e-2",
                      "--warmup_iters=1", "--device=cpu", f"--out_dir={tmp_path / 'out'}"],
                     tmp_path)
    res = E.main(parse_overrides([f"--init_from={tmp_path / 'out'}", "--task=ppl", "--chunks=2",
                                  "--full=True", "--max_windows=3", "--device=cpu"],
                                 config_of(vars(E)), E.__file__))
    out = capsys.readouterr().out
    assert (f"'window' = the base model {ck} over the last W" in out
            and "'full' = it over X_C + X_D" in out)
    splits = data.prepare(load_tokenizer(str(ck)), str(docs))
    windows = E.ppl_windows(splits["val"], 2, 32, 32, 16, 3)
    by_hand = {}
    for name, upper in [("base", load_llama(str(ck))),
                        ("trained", S.load_sharedllm(str(tmp_path / "out"))[0].upper)]:
        by_hand[name] = E.score_ppl(types.SimpleNamespace(upper=upper), splits["val"], windows,
                                    2, 32, 32, 16, "full", 8, "cpu")[0]
    assert (res[0]["full_attention"] == by_hand["base"]
            and abs(by_hand["trained"] / by_hand["base"] - 1) > 1e-3)
