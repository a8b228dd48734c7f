# seeds.py: the table of final evaluations over seeds, with worst / median / best, from each run's
# log.jsonl
import json
import os
import re
import sys

import pytest

from conftest import ROOT


def fake_run(out, seed, eval_record, iters=6500):
    os.makedirs(out / f"seed{seed}")
    with open(out / f"seed{seed}" / "log.jsonl", "w") as f:
        f.write(json.dumps({"iter": 100, "loss": {"passkey": 1.0}, "minutes": 0.5 * seed}) + "\n")
        # an earlier evaluation: not read
        f.write(json.dumps({"iter": 500, "eval": {"passkey@4": 0.1}}) + "\n")
        f.write(json.dumps({"iter": iters, "eval": eval_record}) + "\n")


def run_seeds(args, monkeypatch):
    sys.path.insert(0, ROOT)
    import seeds
    monkeypatch.setattr(sys, "argv", ["seeds.py"] + args)
    seeds.main()


def test_table_of_final_evaluations(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs"
    fake_run(out, 1, {"passkey@4": 0.90, "passkey_noctx@4": 0.0, "leaf@4": 0.5, "coarse@4": 0.1,
                      "ppl_ratio@4": 0.99, "passkey@16": 0.80})
    fake_run(out, 2, {"passkey@4": 0.96, "passkey_noctx@4": 0.0, "leaf@4": 0.9, "coarse@4": 0.0,
                      "ppl_ratio@4": 1.01, "passkey@16": 0.95})
    fake_run(out, 3, {"passkey@4": 0.93, "passkey_noctx@4": 0.0, "leaf@4": 0.7, "coarse@4": 0.0,
                      "ppl_ratio@4": 0.98, "passkey@16": 0.85})
    run_seeds(["--seeds=1-4", f"--out={out}", "--table_only=True"], monkeypatch)
    text = capsys.readouterr().out
    assert "3 of 4 seeds (1 thread(s) each); final evaluation at iteration 6500" in text
    # no-context and coarse columns left out; the search's leaf share beside the accuracy
    assert "| seed | passkey@4 | leaf@4 | ppl_ratio@4 | passkey@16 | wall (training) |" in text
    assert "| 2 | 96.0% | 90.0% | 1.0100 | 95.0% | (1.0 min) |" in text
    # lowest passkey and leaf, highest ratio
    assert "| worst | 90.0% | 50.0% | 1.0100 | 80.0% | |" in text
    assert "| median | 93.0% | 70.0% | 0.9900 | 85.0% | |" in text
    assert "| best | 96.0% | 90.0% | 0.9800 | 95.0% | |" in text
    assert "no final evaluation yet for seeds [4]" in text


def test_bad_input(tmp_path, monkeypatch):
    for args, msg in [(["--seeds=a-b"], "--seeds=a-b: expected a range like 1-10"),
                      (["--jobs=0"], "--jobs=0: expected a value in [1, 64]"),
                      (["--", "--seed=3"], "seeds.py sets train.py's --seed and --out_dir itself"),
                      ([f"--out={tmp_path}", "--table_only=True"],
                       f"--out={tmp_path}: no run there has a final")]:
        with pytest.raises(SystemExit, match=re.escape(msg)):
            run_seeds(args, monkeypatch)
