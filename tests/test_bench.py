# bench.py: the --quick smoke run, its JSON shape, the full-attention budget, and the analytic
# numbers it reports.
import json
import os
import sys

import pytest
import torch

import bench
import model as M
from configurator import config_of, parse_overrides
from conftest import ROOT
from load_llama import PRESETS, preset
from test_train import run


def test_bench_quick_json_and_budget(tmp_path):
    out = run(["--quick=True", "--chunk_size=256", "--full_budget_s=1e-9",
               f"--out={tmp_path / 'b.json'}"], tmp_path,
              cmd=[sys.executable, os.path.join(ROOT, "bench.py")])
    assert "'lexical' search adds" in out and "skipped: ~" in out
    r = json.load(open(tmp_path / "b.json"))
    assert (r["device"].startswith("cpu")
            and sorted(r["retrieval_overhead_pct"]) == ["lexical", "vector"])
    assert isinstance(r["compress_pct_of_peak"], float) and r["compress_pct_of_peak"] > 0
    first, second = r["length_sweep"]
    assert first["context_tokens"] == 2048 and second["context_tokens"] == 4096
    assert (isinstance(first["full_attention_s"], float)
            and first["full_attention_peak_mb"] is not None)
    # over the budget: not run
    assert second["full_attention_s"] is None and second["full_attention_peak_mb"] is None
    assert "budget" in second["full_attention_note"]
    for row in r["length_sweep"]:
        assert row["sharedllm_s"] > 0 and row["sharedllm_peak_mb"] >= 0
    assert [k["value"] for k in r["knobs"]["policy"]] == ["right", "vector", "lexical"]


def test_compressed_kv_size_and_flops_match_the_model():
    m = M.SharedLLM.from_llama(M.Llama(preset("tiny")), n_lower=2, chunk_size=256, height=3,
                               beta=8).eval()
    with torch.no_grad():
        mem = m.compress(torch.randint(0, 258, (1, 3, 256)), torch.randint(0, 258, (1, 8)))
    kv_bytes = sum(t.numel() * t.element_size() for K, V in mem.kv for t in (K, V))
    assert kv_bytes == 2 * 2 * 3 * (256 // 8) * 2 * 16 * 4     # K,V x M x n x S x Hkv x hd x fp32
    # FLOPs: layer 0 in full (q, k, v, o, MLP, causal attention within each node), layer 1 only k
    # and v of kept tokens
    c = m.upper.cfg
    nodes = [128, 64, 32, 32]      # C=256, h=3: [0,128) [128,192) [192,224) [224,256)
    full = 2 * 64 * 64 * 2 + 2 * 64 * 32 * 2 + 2 * 3 * 64 * c.hidden_dim
    # 8 KVs kept per node
    want = 3 * sum(full * L + 2 * L * L * 64 + 2 * 64 * 32 * 2 * 8 for L in nodes)
    assert bench.compress_flops(m, 3) == want


def test_bench_shape_reads_only_a_config(tmp_path, capsys):
    # --shape: a real model's shape with random weights; a folder with only config.json (no weights)
    # is enough
    cfg = dict(model_type="llama", hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, intermediate_size=96, vocab_size=300, rms_norm_eps=1e-5,
               tie_word_embeddings=True)
    (tmp_path / "shape").mkdir()
    json.dump(cfg, open(tmp_path / "shape" / "config.json", "w"))
    cfg = config_of(vars(bench))
    parse_overrides(["--lengths=512", "--knob_length=512", "--chunk_size=256", "--repeats=1",
                     "--device=cpu", f"--shape={tmp_path / 'shape'}"], cfg, bench.__file__)
    res = bench.main(cfg)
    assert ("3 layers, dim 48, heads 6/2" in capsys.readouterr().out
            and res["retrieval_overhead_pct"]["lexical"] > -100)
    assert "smollm2-135m" in PRESETS and preset("smollm2-135m").n_kv_heads == 3
    for args, msg in [(["--shape=nowhere"], "--shape=nowhere: neither a model preset"),
                      ([f"--shape={tmp_path / 'shape'}", "--init_from=out"], "give one"),
                      (["--lengths=0"], "--lengths=0: expected positive integers"),
                      (["--lengths=abc"], "--lengths=abc: expected positive integers"),
                      (["--lengths=1000"],
                       "--lengths=1000 / --knob_length=32768: each must be a multiple of "
                       "chunk_size C = 1024"),
                      (["--repeats=0"], r"--repeats=0: expected a value in \[1, inf\]"),
                      (["--block_size=0"], r"--block_size=0: expected a value in \[1, inf\]"),
                      (["--beta=0"], "SharedConfig.beta = 0; expected at least 1"),
                      (["--dtype=fp32"],
                       "--dtype=fp32: expected auto, float32, bfloat16 or float16"),
                      ([f"--out={tmp_path}/nowhere/b.json"],
                       "the folder .*nowhere does not exist")]:
        cfg = config_of(vars(bench))
        parse_overrides(args, cfg, bench.__file__)
        with pytest.raises(SystemExit, match=msg):
            bench.main(cfg)


def test_full_attention_scores_the_same_positions_as_sharedllm(monkeypatch):
    # full attention reads X_C + X_D but, like SharedLLM, computes logits only for X_D's T
    # positions: its time and memory must not include (L + T) x vocab logits that SharedLLM never
    # computes
    m = M.SharedLLM.from_llama(M.Llama(preset("tiny")), n_lower=2, chunk_size=256, height=3,
                               beta=8).eval()
    ctx, idx = bench.random_inputs(m, torch.Generator().manual_seed(0), 512, 8, "cpu")
    with torch.no_grad():
        shared = m(ctx, idx)[0].shape                           # (1, T, vocab)
    shapes, forward = [], m.upper.forward
    monkeypatch.setattr(m.upper, "forward",
                        lambda *a, **k: shapes.append(forward(*a, **k)[0].shape) or (None, None))
    g = dict(block_size=8, repeats=1, full_budget_s=1e9, full_budget_mb=1e9)
    with torch.no_grad():
        f_t, f_mb, skip, last = bench.full_attention(g, m, ctx, idx, 512, None, "cpu")
    assert (skip == "" and last[0] == 512 and shapes
            and all(s == shared == (1, 8, m.upper.cfg.vocab_size) for s in shapes))
