# Every bad checkpoint gets an error that names the problem and the file or key.
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SHARED_TOKENIZERS, make_hf_checkpoint
from load_llama import load_llama


@pytest.fixture
def ckpt(tmp_path):
    make_hf_checkpoint(tmp_path)
    return str(tmp_path)


@pytest.fixture
def sharded(tmp_path):
    make_hf_checkpoint(tmp_path, sharded=True)
    return str(tmp_path)


def edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    c = json.load(open(p))
    for k, v in changes.items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    json.dump(c, open(p, "w"))


def edit_tensors(path, fn):
    p = os.path.join(path, "model.safetensors")
    sd = load_file(p)
    fn(sd)
    save_file(sd, p, metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found: .*nope"):
        load_llama(str(tmp_path / "nope"))


def test_missing_config(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_llama(ckpt)


def test_broken_config(ckpt):
    open(os.path.join(ckpt, "config.json"), "w").write("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_llama(ckpt)
    from load_llama import load_tokenizer
    # the tokenizer reads it first
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_tokenizer(ckpt)


def test_load_llama_cli_names_what_it_was_given(tmp_path):
    import subprocess
    import sys
    from conftest import ROOT
    (tmp_path / "out").mkdir()
    torch.save({"a": 1}, tmp_path / "out" / "ckpt.pt")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "load_llama.py"), str(tmp_path / "out"),
                        "--device=cpu"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (r.returncode == 2
            and "out: a train.py checkpoint; sample.py and eval.py read it" in r.stderr), r.stderr


def test_config_missing_key_and_wrong_type(ckpt):
    edit_config(ckpt, intermediate_size=None)
    with pytest.raises(ValueError, match="missing key 'intermediate_size'"):
        load_llama(ckpt)
    edit_config(ckpt, intermediate_size=172, model_type="gpt2")
    with pytest.raises(ValueError, match="model_type is 'gpt2', expected 'llama'"):
        load_llama(ckpt)


def test_config_eras(ckpt):
    # LLaMA-2-era: top-level rope_theta or none at all (10000), no head_dim; transformers 5:
    # rope_parameters
    for changes, theta in [(dict(rope_parameters=None, rope_theta=None), 10000.0),
                           (dict(rope_parameters=None, rope_theta=500.0), 500.0),
                           (dict(rope_parameters={"rope_theta": 250.0, "rope_type": "default"},
                                 rope_theta=None), 250.0)]:
        edit_config(ckpt, head_dim=None, **changes)
        m = load_llama(ckpt)
        assert m.cfg.rope_theta == theta and m.cfg.head_dim == 16 and m.cfg.n_kv_heads == 2
    edit_config(ckpt, rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE scaling .* is not supported"):
        load_llama(ckpt)


def test_no_weights(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(FileNotFoundError,
                       match="no model.safetensors or model.safetensors.index.json"):
        load_llama(ckpt)


def test_missing_shard(sharded):
    os.remove(os.path.join(sharded, "model-00002-of-00006.safetensors"))
    with pytest.raises(FileNotFoundError,
                       match="shard model-00002-of-00006.safetensors listed in .*index.json "
                             "is missing"):
        load_llama(sharded)


def test_truncated_file(ckpt):
    p = os.path.join(ckpt, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_llama(ckpt)


def test_corrupt_header(ckpt):
    p = os.path.join(ckpt, "model.safetensors")
    data = bytearray(open(p, "rb").read())
    data[8:20] = b"garbage!!!!!"
    open(p, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_llama(ckpt)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError,
                       match=r"1 tensors missing, e.g. \['model.layers.1.mlp.up_proj.weight'\]"):
        load_llama(ckpt)


def test_unexpected_tensor(ckpt):
    edit_tensors(ckpt, lambda sd: sd.__setitem__("model.layers.5.self_attn.q_proj.weight",
                                                 torch.zeros(64, 64)))
    with pytest.raises(ValueError,
                       match="unexpected tensor 'model.layers.5.self_attn.q_proj.weight'"):
        load_llama(ckpt)
    edit_tensors(ckpt, lambda sd: (sd.pop("model.layers.5.self_attn.q_proj.weight"),
                                   sd.__setitem__("model.extra.bias", torch.zeros(3))))
    with pytest.raises(ValueError, match="unexpected tensor 'model.extra.bias'"):
        load_llama(ckpt)


def test_inv_freq_is_ignored(ckpt):
    edit_tensors(ckpt, lambda sd: sd.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq",
                                                 torch.ones(8)))
    load_llama(ckpt)


def test_wrong_shape(ckpt):
    edit_tensors(ckpt, lambda sd: sd.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                                 torch.zeros(64, 64)))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' has shape "
                                         r"\(64, 64\), expected \(32, 64\)"):
        load_llama(ckpt)


def test_vocab_disagrees_with_tokenizer(ckpt):
    src = os.path.join(SHARED_TOKENIZERS, "llama-format", "tokenizer.model")
    if not os.path.isfile(src):
        pytest.skip("shared tokenizer files not present")
    shutil.copy(src, os.path.join(ckpt, "tokenizer.model"))
    with pytest.raises(ValueError,
                       match="tokenizer.model has 32000 ids but config.json says vocab_size=320"):
        load_llama(ckpt)


def test_loads_on_meta_then_real_device_and_dtype(ckpt):
    m = load_llama(ckpt, dtype=torch.bfloat16)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in m.parameters())
