# Shared helpers for the tests. Run everything with: python -m pytest
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# present in this workplace, optional elsewhere
SHARED_TOKENIZERS = os.path.join(ROOT, "..", "shared", "data", "tokenizers")


def rel_err(a, b):
    # max|a - b| / max|a|: the parity measure used throughout
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def make_hf_checkpoint(path, gqa=True, sharded=False, dtype=torch.float32, seed=0, vocab=320,
                       tie=False, **extra):
    """A random tiny LLaMA saved by transformers in HF layout; returns the transformers model (the
    reference).
    extra: more LlamaConfig keys (rope_scaling, bos_token_id, ...)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2 if gqa else 4, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0,
        # a large init: with 0.02 a wrong RoPE differs by only ~6e-3
        tie_word_embeddings=tie, initializer_range=0.3, **extra)
    transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(
        path, max_shard_size="100KB" if sharded else "10GB")
    # reload the way users run it: from_pretrained keeps RoPE's inv_freq in fp32 (a .to(bf16) model
    # rounds it)
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


def tiny_tiktoken_file(path):
    # a Llama-3-format tokenizer.model (tiktoken: "base64 token rank" per line, rank = id): 256
    # bytes and a few merges
    import base64
    merges = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b" a", b"an", b"and", b" and",
              b"er", b"12", b"123"]
    with open(path, "wb") as f:
        for rank, tok in enumerate([bytes([b]) for b in range(256)] + merges):
            f.write(base64.b64encode(tok) + b" %d\n" % rank)
    return 256 + len(merges)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(autouse=True)
def _no_peak_measurement(monkeypatch):
    # train.py measures the CPU's matmul peak for its MFU line, about a second a run: the tests of
    # other things give it a fixed one (test_mfu_is_against_the_peak_measured_once_at_start_up
    # measures for real)
    import train
    monkeypatch.setattr(train, "peak_flops", lambda dev_type, dt, **kw: 1e12)
