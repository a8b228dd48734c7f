# LLaMA: parity with transformers (HF folders and SmolLM2's GGUF file), RoPE's invariants, attention
# against a written-out softmax, KV-cached decoding, and what the loaders refuse.
import glob
import json
import os
import shutil
import sysconfig

import pytest
import torch

import decode
import model as M
from conftest import GGUF, make_hf_checkpoint, manual_attention, real, rel_err
from load_llama import PRESETS, load_llama, load_tokenizer, read_checkpoint

MICRO = M.LlamaConfig(**PRESETS["micro"])


@pytest.mark.parametrize("gqa,sharded,dtype", [(False, False, torch.float32),
                                               (True, True, torch.float32),
                                               (True, False, torch.bfloat16)])
def test_parity_with_transformers(tmp_path, gqa, sharded, dtype):
    hf = make_hf_checkpoint(tmp_path, gqa=gqa, sharded=sharded, dtype=dtype)
    ours = load_llama(str(tmp_path), dtype=dtype)
    idx = torch.randint(0, 320, (2, 37))
    with torch.no_grad():
        ref, logits = hf(idx).logits, ours(idx)[0]
    assert rel_err(ref, logits) <= (1e-5 if dtype == torch.float32 else 1e-3)   # bf16 ulp: 7.8e-3
    assert torch.equal(ref.argmax(-1), logits.argmax(-1))
    with torch.no_grad():   # logits of the last positions only: the same numbers
        assert torch.equal(ours(idx, last=7)[0], logits[:, -7:])


def test_tied_embeddings_stay_one_tensor(tmp_path):
    hf = make_hf_checkpoint(tmp_path, tie=True)
    ours = load_llama(str(tmp_path))
    assert ours.output.weight is ours.tok_embeddings.weight
    idx = torch.randint(0, 320, (2, 29))
    with torch.no_grad():
        assert rel_err(hf(idx).logits, ours(idx)[0]) <= 1e-5
    s = M.SharedLLM(ours, M.SharedConfig(n_lower=1, chunk_size=16, height=2, beta=4)).train()
    opt = torch.optim.AdamW(s.parameters(), lr=1e-2)
    s(torch.randint(0, 320, (2, 2, 16)), idx, idx)[1].backward()
    opt.step()
    assert s.upper.output.weight is s.upper.tok_embeddings.weight   # still one after a step


def damage(d, case):   # one way a user's HF folder (here: sharded) breaks -> what must be named
    from safetensors.torch import load_file, save_file
    index = json.load(open(d / "model.safetensors.index.json"))["weight_map"]
    k_proj = "model.layers.1.self_attn.k_proj.weight"
    shard = d / index[k_proj]
    if case == "no config":
        os.remove(d / "config.json")
        return ["config.json"]
    if case in ("config not JSON", "config key gone"):
        text = (d / "config.json").read_text()
        (d / "config.json").write_text(text[:40] if case == "config not JSON" else
                                       text.replace('"intermediate_size"', '"renamed"'))
        return ["config.json"] + ["intermediate_size"] * (case == "config key gone")
    if case in ("shard gone", "shard cut short"):
        data = shard.read_bytes()
        os.remove(shard) if case == "shard gone" else shard.write_bytes(data[:len(data) // 2])
        return [shard.name]
    sd = load_file(shard)
    if case == "tensor gone":
        sd.pop(k_proj)
    elif case == "tensor misshapen":
        sd[k_proj] = sd[k_proj][:, :-1].contiguous()
    else:   # a tensor of another model
        sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, shard, metadata={"format": "pt"})
    return {"tensor gone": [k_proj], "unknown tensor": ["q_norm"],
            "tensor misshapen": [shard.name, k_proj, "(32, 63)", "(32, 64)"]}[case]


def test_loaders_name_the_file_and_the_tensor_as_the_checkpoint_does(tmp_path):
    # every damaged checkpoint is refused with the file, and the tensor by its name in that file
    make_hf_checkpoint(tmp_path / "good", sharded=True)
    for case in ("no config", "config not JSON", "config key gone", "shard gone",
                 "shard cut short", "tensor gone", "tensor misshapen", "unknown tensor"):
        d = tmp_path / case.replace(" ", "_")
        shutil.copytree(tmp_path / "good", d)
        named = damage(d, case)
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            load_llama(str(d))
        assert all(n in str(e.value) for n in named), (case, str(e.value))
    with pytest.raises(FileNotFoundError):
        load_llama(str(tmp_path / "nowhere"))
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "ckpt.pt")   # pickles a class
    with pytest.raises(ValueError):   # weights_only refuses it
        read_checkpoint(str(tmp_path / "ckpt.pt"))


def interleaved_rope(x, cos, sin):   # Meta's form: pairs (x0,x1),(x2,x3),...; cos/sin (..., hd/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def test_rope_invariants():
    rope = lambda pos: M.rope_cos_sin(torch.tensor(pos), 16, 10000.0)
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    scores = lambda pq, pk: M.apply_rope(q, *rope(pq)) @ M.apply_rope(k, *rope(pk)).mT
    # scores depend only on position differences (any positions, repeated ones too) ...
    base = scores([0, 1, 2, 3, 4], [0, 0, 7, 7, 9])
    for shift in (1, 4000):
        torch.testing.assert_close(base, scores([p + shift for p in [0, 1, 2, 3, 4]],
                                                [p + shift for p in [0, 0, 7, 7, 9]]),
                                   rtol=1e-3, atol=1e-3)   # fp32 angles of 4000 rad
    assert (base - scores([0, 1, 2, 3, 4], [0, 0, 7, 8, 9])).abs().max() > 1e-2
    # ... and rotations compose: p then q is p + q (SharedLLM's chunk ids on node positions)
    p, s = [0, 3, 9, 500, 7], [2, 2, 5, 7, 0]
    torch.testing.assert_close(M.apply_rope(q, *rope([a + b for a, b in zip(p, s)])),
                               M.apply_rope(M.apply_rope(q, *rope(p)), *rope(s)))
    # split halves on HF's permuted rows are Meta's interleaved pairs on the original rows
    w, x = torch.randn(64, 64), torch.randn(11, 64)
    unpermute = w.view(4, 2, 8, 64).transpose(1, 2).reshape(64, 64)
    heads = lambda t: t.view(11, 4, 16).transpose(0, 1)
    cos, sin = rope(list(range(11)))
    hf, meta = M.apply_rope(heads(x @ w.T), cos, sin), interleaved_rope(
        heads(x @ unpermute.T), cos[:, :8], sin[:, :8])
    assert rel_err(hf @ hf.mT, meta @ meta.mT) < 1e-5
    wrong = interleaved_rope(heads(x @ w.T), cos[:, :8], sin[:, :8])
    assert rel_err(hf @ hf.mT, hf @ wrong.mT) > 1e-2


@pytest.mark.parametrize("hq,hkv,tq,tk,causal", [(4, 4, 9, 9, True), (4, 2, 7, 13, False),
                                                 (4, 2, 3, 10, True)])
def test_attention_is_the_softmax_written_out(hq, hkv, tq, tk, causal):
    q, k, v = torch.randn(2, hq, tq, 16), torch.randn(2, hkv, tk, 16), torch.randn(2, hkv, tk, 16)
    assert rel_err(manual_attention(q, k, v, causal), M.attention(q, k, v, causal)) < 1e-5
    # a mask (lower_kv_kept): each query reads exactly the keys up to its own position
    upto = torch.randint(0, tk, (2, tq))
    mask = upto[:, None, :, None] >= torch.arange(tk)
    y = M.attention(q, k, v, False, mask=mask)
    for b, j in [(0, 0), (1, tq - 1)]:
        e = upto[b, j] + 1
        alone = manual_attention(q[b:b + 1, :, j:j + 1], k[b:b + 1, :, :e], v[b:b + 1, :, :e],
                                 False)
        assert rel_err(alone, y[b:b + 1, :, j:j + 1]) < 1e-5


def test_kv_cache_matches_full_forward_and_loss_ignores_minus_100():
    m = M.Llama(MICRO).eval()
    idx = torch.randint(0, 258, (2, 24))
    with torch.no_grad():
        full, _ = m(idx)
        caches = decode.new_caches(m, 2, 24)
        steps = [m(idx[:, :10], caches=caches)[0]]                    # prefill 10 tokens
        steps += [m(idx[:, t:t + 1], start_pos=t, caches=caches)[0] for t in range(10, 24)]
    assert rel_err(full, torch.cat(steps, 1)) < 1e-5
    out, ref = decode.generate(m, idx[:, :5], 12), idx[:, :5]   # greedy: cache vs full forwards
    with torch.no_grad():
        for _ in range(12):
            ref = torch.cat([ref, m(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    tgt = idx.clone()
    tgt[:, :5] = -100
    logits, loss = m(idx, tgt)
    ref = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, 258), tgt[:, 5:].flatten())
    assert abs(loss.item() - ref.item()) < 1e-6


def test_sampling_draws_from_the_top_k_and_the_nucleus_as_defined(monkeypatch):
    # top-p: the smallest set of the likeliest tokens whose probability reaches p (Holtzman et
    # al., 2020), renormalised; top-k: the k likeliest; both at the temperature's softmax
    drawn = []
    monkeypatch.setattr(torch, "multinomial", lambda p, num_samples: drawn.append(p) or
                        p.argmax(-1, keepdim=True))
    logits = torch.randn(4, 50) * 3
    for top_k, top_p, T in [(None, 0.9, 1.0), (None, 0.5, 0.7), (5, None, 1.3), (8, 0.6, 1.0)]:
        probs = (logits / T).softmax(-1)
        if top_k:
            probs = probs.masked_fill(probs < probs.topk(top_k).values[:, -1:], 0)
            probs = probs / probs.sum(-1, keepdim=True)
        want = torch.zeros_like(probs)
        for row, p in enumerate(probs):
            order = p.argsort(descending=True).tolist()
            n = next((i + 1 for i in range(len(order)) if p[order[:i + 1]].sum() >= top_p),
                     len(order)) if top_p else len(order)
            want[row, order[:n]] = p[order[:n]]
        decode.sample_next(logits, T, top_k, top_p)
        got = drawn.pop()
        assert torch.equal(got > 0, want > 0)
        assert torch.allclose(got / got.sum(-1, keepdim=True), want / want.sum(-1, keepdim=True))


def test_a_gguf_file_in_llama_cpps_layout_loads_as_its_hf_model(tmp_path):
    # written as llama.cpp's converter writes an HF LLaMA (its q/k rows permuted to interleaved
    # pairs, names and metadata its own): our loader gives the transformers model's logits
    gguf = pytest.importorskip("gguf")
    hf = make_hf_checkpoint(tmp_path)
    c, sd = hf.config, {k: v.numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for key, value in [("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 172),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("context_length", 256), ("vocab_size", 320)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    permute = lambda t, n: t.reshape(n, 2, t.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(t.shape)
    names = {"embed_tokens": "token_embd", "input_layernorm": "attn_norm", "q_proj": "attn_q",
             "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "up_proj": "ffn_up",
             "post_attention_layernorm": "ffn_norm", "gate_proj": "ffn_gate",
             "down_proj": "ffn_down", "model.norm": "output_norm", "lm_head": "output"}
    for k, t in sd.items():
        t = permute(t, 4) if "q_proj" in k else permute(t, 2) if "k_proj" in k else t
        name = next(v for part, v in names.items() if part in k)
        w.add_tensor(f"blk.{k.split('.')[2]}.{name}.weight" if ".layers." in k else
                     f"{name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    idx = torch.randint(0, 320, (2, 33))
    with torch.no_grad():
        assert rel_err(hf(idx).logits, load_llama(str(tmp_path / "m.gguf"))(idx)[0]) < 1e-5


@real
def test_smollm2_knows_paris():
    ours, tok = load_llama(GGUF), load_tokenizer(GGUF)
    prompt = tok.encode("The capital of France is")
    assert prompt == [504, 3575, 282, 4649, 314]   # no BOS: SmolLM2's convention
    out = decode.generate(ours, torch.tensor([prompt]), 2)
    assert tok.decode(out[0, len(prompt):].tolist()).startswith(" Paris")


@real
def test_smollm2_tokenizer_equals_hf_tokenizers(tmp_path):
    # the reference: HF's own BPE over the vocabulary and merges read from the GGUF file, with
    # SmolLM2's published pre-tokenizer (digits one by one, then GPT-2's byte-level regex)
    tokenizers = pytest.importorskip("tokenizers")
    from load_llama import read_gguf
    tok, meta = load_tokenizer(GGUF), read_gguf(GGUF)[1]
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    spec = {"version": "1.0", "normalizer": None, "post_processor": None, "decoder": byte_level,
            "added_tokens": [dict(id=i, content=t, special=True, single_word=False, lstrip=False,
                                  rstrip=False, normalized=False)
                             for i, t in enumerate(tokens) if types[i] == 3],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": True}, byte_level]},
            "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": meta["tokenizer.ggml.merges"]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    stdlib = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[::20]
    texts = [open(f, encoding="utf-8").read() for f in stdlib] + [
        "naïve café — 東京 🚀 tabs\t\t  2  12  a1b22c333 \n\n x\u00a0y ½ \r\n",
        "x = [1,  22,   333]\n    42\n\t\t7 a\u00a0 9\n" + "".join(f"{' ' * (i % 5)}{i},"
                                                            for i in range(300))]
    for t in texts:
        ids = tok.encode(t, bos=False)
        assert ids == hf.encode(t, add_special_tokens=False).ids and tok.decode(ids) == t
    assert sum(len(t) for t in texts) > 100_000
