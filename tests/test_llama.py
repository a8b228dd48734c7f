# LLaMA-2 parity with transformers, RoPE, attention backends and KV-cached decoding.
import os

import pytest
import torch

import decode
import model as M
from conftest import make_hf_checkpoint, rel_err, tiny_tiktoken_file
from load_llama import load_llama, preset


def manual_attention(q, k, v, causal, mask=None):
    # the readable oracle of model.attention: softmax(q k^T / sqrt(d)) v in fp32, GQA by repeating
    # K/V; causal with Tq < Tk: the queries are the last Tq positions
    Tq, Tk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)   # (B, Hq, Tk, hd)
    att = (q.float() @ k.float().transpose(-2, -1)) / q.shape[-1] ** 0.5      # (B, Hq, Tq, Tk)
    if causal:
        mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    return (att.softmax(dim=-1) @ v.float()).to(q.dtype)


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity_with_transformers(tmp_path, gqa, sharded, dtype):
    hf = make_hf_checkpoint(tmp_path, gqa=gqa, sharded=sharded, dtype=dtype)
    files = os.listdir(tmp_path)
    assert ("model.safetensors.index.json" in files) == sharded
    ours = load_llama(str(tmp_path), dtype=dtype)
    assert not ours.training and ours.tok_embeddings.weight.dtype == dtype
    idx = torch.randint(0, 320, (2, 37))
    with torch.no_grad():
        ref = hf(idx).logits.float()
        logits, loss = ours(idx)
    assert logits.shape == (2, 37, 320) and loss is None
    err = rel_err(ref, logits)
    print(f"parity {'gqa' if gqa else 'mha'} {'sharded' if sharded else 'single'} {dtype}: "
          f"max|diff|/max|logit| = {err:.2e}")
    # bf16: well under one bf16 ulp (7.8e-3)
    assert err <= (1e-5 if dtype == torch.float32 else 1e-3)
    assert torch.equal(ref.argmax(-1), logits.argmax(-1))


def test_tied_embeddings_one_tensor_parity_and_checkpoint(tmp_path):
    # SmolLM2 / Llama-3.2 style: no lm_head tensor; the head is the embedding, one tensor also after
    # training steps
    hf = make_hf_checkpoint(tmp_path, tie=True)
    from safetensors import safe_open
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    ours = load_llama(str(tmp_path))
    assert ours.cfg.tie_embeddings and ours.output.weight is ours.tok_embeddings.weight
    idx = torch.randint(0, 320, (2, 29))
    with torch.no_grad():
        err = rel_err(hf(idx).logits, ours(idx)[0])
    assert err <= 1e-5, err
    s = M.SharedLLM.from_llama(ours, n_lower=1, chunk_size=16, height=2, beta=4).train()
    opt = torch.optim.AdamW(s.parameters(), lr=1e-2)
    for _ in range(2):
        _, loss = s(torch.randint(0, 320, (2, 2, 16)), idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
    # still one tensor after AdamW steps
    assert s.upper.output.weight is s.upper.tok_embeddings.weight
    torch.save(s.state_dict(), tmp_path / "sd.pt")
    s2 = M.SharedLLM.from_llama(M.Llama(ours.cfg), n_lower=1, chunk_size=16, height=2, beta=4)
    s2.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert s2.upper.output.weight is s2.upper.tok_embeddings.weight
    assert torch.equal(s2.upper.output.weight, s.upper.tok_embeddings.weight)


def test_logits_for_the_last_positions_only(tmp_path):
    m = M.Llama(preset("micro")).eval()
    idx = torch.randint(0, 258, (2, 40))
    with torch.no_grad():
        assert torch.equal(m(idx, last=7)[0], m(idx)[0][:, -7:])


def test_bf16_checkpoint_loads_as_fp32(tmp_path):
    hf = make_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    ours = load_llama(str(tmp_path), dtype=torch.float32)
    idx = torch.randint(0, 320, (1, 20))
    with torch.no_grad():
        ref = hf.float()(idx).logits
        assert rel_err(ref, ours(idx)[0]) <= 1e-5


def test_wrong_rope_would_be_caught(tmp_path):
    # the parity test can fail: interleaved-pair RoPE on HF weights is far outside its tolerance
    hf = make_hf_checkpoint(tmp_path)
    ours = load_llama(str(tmp_path))
    idx = torch.randint(0, 320, (1, 30))
    real_apply = M.apply_rope
    try:
        M.apply_rope = lambda x, cos, sin: interleaved_rope(x, cos[..., : x.shape[-1] // 2],
                                                            sin[..., : x.shape[-1] // 2])
        with torch.no_grad():
            assert rel_err(hf(idx).logits, ours(idx)[0]) > 1e-2
    finally:
        M.apply_rope = real_apply


def interleaved_rope(x, cos, sin):
    # Meta's form: pairs (x0,x1),(x2,x3),...; cos/sin: (..., hd/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def test_rope_depends_only_on_position_difference():
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    def scores(pq, pk):
        cq, sq = M.rope_cos_sin(torch.tensor(pq), 16, 10000.0)
        ck, sk = M.rope_cos_sin(torch.tensor(pk), 16, 10000.0)
        return M.apply_rope(q, cq, sq) @ M.apply_rope(k, ck, sk).transpose(-1, -2)
    # arbitrary, non-contiguous, repeated positions
    base = scores([0, 1, 2, 3, 4], [0, 0, 7, 7, 9])
    for shift in (1, 100, 4000):
        shifted = scores([p + shift for p in [0, 1, 2, 3, 4]], [p + shift for p in [0, 0, 7, 7, 9]])
        torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)
    # a different offset does change them
    assert (base - scores([0, 1, 2, 3, 4], [0, 0, 7, 8, 9])).abs().max() > 1e-2


def test_rope_rotations_compose():
    # rotating by p then by q equals rotating by p + q (SharedLLM puts chunk ids on top of
    # node-local positions)
    x = torch.randn(1, 2, 4, 16)
    p, q = torch.tensor([0, 3, 9, 500]), torch.tensor([2, 2, 5, 7])
    once = M.apply_rope(x, *M.rope_cos_sin(p + q, 16, 10000.0))
    twice = M.apply_rope(M.apply_rope(x, *M.rope_cos_sin(p, 16, 10000.0)),
                         *M.rope_cos_sin(q, 16, 10000.0))
    torch.testing.assert_close(once, twice, rtol=1e-5, atol=1e-5)


def test_split_half_on_hf_weights_equals_interleaved_on_meta_weights():
    n_heads, hd, dim, T = 4, 16, 64, 11
    wq, wk = torch.randn(n_heads * hd, dim), torch.randn(2 * hd, dim)   # HF layout, GQA: 2 kv heads
    unpermute = lambda w, n: w.view(n, 2, hd // 2, dim).transpose(1, 2).reshape(n * hd, dim)
    x = torch.randn(T, dim)
    pos = torch.arange(T)
    cos, sin = M.rope_cos_sin(pos, hd, 10000.0)
    heads = lambda t, n: t.view(T, n, hd).transpose(0, 1)   # (n, T, hd)
    q_hf = M.apply_rope(heads(x @ wq.T, 4), cos, sin)
    k_hf = M.apply_rope(heads(x @ wk.T, 2), cos, sin)
    q_meta = interleaved_rope(heads(x @ unpermute(wq, 4).T, 4), cos[:, : hd // 2],
                              sin[:, : hd // 2])
    k_meta = interleaved_rope(heads(x @ unpermute(wk, 2).T, 2), cos[:, : hd // 2],
                              sin[:, : hd // 2])
    s_hf = q_hf @ k_hf.repeat_interleave(2, 0).transpose(-1, -2)
    s_meta = q_meta @ k_meta.repeat_interleave(2, 0).transpose(-1, -2)
    assert rel_err(s_hf, s_meta) < 1e-5
    s_wrong = q_hf @ interleaved_rope(heads(x @ wk.T, 2), cos[:, : hd // 2],
                                      sin[:, : hd // 2]).repeat_interleave(2, 0).transpose(-1, -2)
    assert rel_err(s_hf, s_wrong) > 1e-2


@pytest.mark.parametrize("case", ["causal", "cross", "cross_gqa", "causal_gqa", "causal_cached"])
def test_attention_backends_agree(case):
    hq, hkv = (4, 2) if "gqa" in case else (4, 4)
    tq, tk = {"causal": (9, 9), "cross": (7, 13), "cross_gqa": (7, 13), "causal_gqa": (9, 9),
              "causal_cached": (3, 10)}[case]
    q, k, v = torch.randn(2, hq, tq, 16), torch.randn(2, hkv, tk, 16), torch.randn(2, hkv, tk, 16)
    causal = "causal" in case
    a = M.attention(q, k, v, causal, backend="sdpa")
    b = manual_attention(q, k, v, causal)
    assert rel_err(b, a) < 1e-5
    if case == "causal_cached":   # the last query sees every key; the first one misses the last two
        full = manual_attention(q[:, :, -1:], k, v, False)
        assert rel_err(full, b[:, :, -1:]) < 1e-5
        assert rel_err(manual_attention(q[:, :, :1], k[:, :, :8], v[:, :, :8], False),
                       b[:, :, :1]) < 1e-5


def test_a_masked_query_reads_exactly_its_allowed_keys():
    # attention(mask=) (lower_kv_kept: a kept token's query reads the keys up to its own position):
    # the same as the plain softmax over those keys alone (the oracle, and the oracle with the mask
    # too), GQA included
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    # each query's own position
    upto = torch.tensor([[1, 5, 9], [0, 4, 7]])
    mask = (upto[:, None, :, None] >= torch.arange(10))                         # (2, 1, 3, 10)
    for name, y in [("sdpa", M.attention(q, k, v, False, mask=mask)),
                    ("oracle", manual_attention(q, k, v, False, mask))]:
        for b in range(2):
            for j in range(3):
                e = upto[b, j] + 1
                alone = manual_attention(q[b:b + 1, :, j:j + 1], k[b:b + 1, :, :e],
                                         v[b:b + 1, :, :e], False)
                assert rel_err(alone, y[b:b + 1, :, j:j + 1]) < 1e-5, (name, b, j)


@pytest.mark.skipif(not torch.cuda.is_available() or M.flash_attn_func is None,
                    reason="needs CUDA and flash-attn")
def test_flash_matches_sdpa():
    for tq, tk, causal, hkv in [(64, 64, True, 4), (16, 96, False, 2), (1, 50, True, 2),
                                (5, 50, True, 4)]:
        q = torch.randn(2, 4, tq, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, hkv, tk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        a = M.attention(q, k, v, causal, backend="flash")
        b = M.attention(q, k, v, causal, backend="sdpa")
        assert rel_err(b, a) < 2e-2


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    m = M.Llama(preset("micro")).eval()
    idx = torch.randint(0, 258, (2, 24))
    with torch.no_grad():
        full, _ = m(idx)
        caches = decode.new_caches(m, 2, 24)
        step = [m(idx[:, :10], caches=caches)[0]]                 # prefill 10 tokens
        for t in range(10, 24):                                    # then one token at a time
            step.append(m(idx[:, t:t + 1], start_pos=t, caches=caches)[0])
        cached = torch.cat(step, dim=1)
    assert rel_err(full, cached) < 1e-5
    # and greedy generation with the cache equals greedy decoding by repeated full forwards
    out = decode.generate(m, idx[:, :5], 12)
    ref = idx[:, :5]
    with torch.no_grad():
        for _ in range(12):
            ref = torch.cat([ref, m(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_loss_matches_logits_and_ignores_minus_100():
    m = M.Llama(preset("micro"))
    idx, tgt = torch.randint(0, 258, (2, 8)), torch.randint(0, 258, (2, 8))
    tgt[:, :5] = -100
    logits, loss = m(idx, tgt)
    ref = torch.nn.functional.cross_entropy(logits[:, 5:].reshape(-1, 258), tgt[:, 5:].reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-6
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())


def test_presets_are_explicit():
    c = preset("llama2-7b")
    assert ((c.dim, c.n_layers, c.n_heads, c.head_dim, c.hidden_dim, c.vocab_size)
            == (4096, 32, 32, 128, 11008, 32000))
    assert preset("llama2-70b").n_kv_heads == 8
    with pytest.raises(ValueError, match="unknown model preset 'llama-7b'"):
        preset("llama-7b")
    with pytest.raises(AssertionError, match="n_kv_heads"):
        M.LlamaConfig(dim=64, n_heads=4, n_kv_heads=3)


def test_llama3_style_checkpoint_tiktoken_tokenizer_scaled_rope_tied(tmp_path):
    # Llama-3.2 in miniature: a tiktoken tokenizer.model, "llama3" RoPE scaling, tied embeddings
    import tokenizer as T
    from load_llama import load_tokenizer
    transformers = pytest.importorskip("transformers")
    n = tiny_tiktoken_file(tmp_path / "tokenizer.model")
    # head_dim 16, theta 1e4: kept, blended and slowed frequencies
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = make_hf_checkpoint(tmp_path, vocab=n + 256, tie=True, rope_scaling=scaling, bos_token_id=n,
                            eos_token_id=[n + 1, n + 9])
    tok = load_tokenizer(str(tmp_path))
    assert (isinstance(tok, T.TiktokenTokenizer)
            and (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 256))
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=TikTokenConverter(
        vocab_file=str(tmp_path / "tokenizer.model"),
        extra_special_tokens=T.LLAMA3_SPECIALS).converted())
    for text in ["the thing and the other", "  Thing 12345678 and\n\n\tthe end ",
                 "héllo wörld — 你好 🙂", "I'LL've"]:
        assert tok.encode(text, bos=False) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == "<|begin_of_text|>" + text
    assert ref.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"]) == [n, n + 9]
    ours = load_llama(str(tmp_path))
    assert (ours.cfg.rope_scaling["factor"] == 8.0
            and ours.output.weight is ours.tok_embeddings.weight)
    idx = torch.tensor([tok.encode("the thing and the other 123 " * 4)])
    # past the "original" window of 32 positions
    assert idx.shape[1] > 40
    with torch.no_grad():
        err = rel_err(hf(idx).logits, ours(idx)[0])
        # plain RoPE on the same weights is far off
        ours.cfg.rope_scaling = None
        err_plain = rel_err(hf(idx).logits, ours(idx)[0])
    assert err <= 1e-5 and err_plain > 1e-2, (err, err_plain)


def test_padded_vocabulary_and_other_rope_scalings(tmp_path):
    # a config with more ids than the tokenizer (padded for speed) loads; a tokenizer with more ids
    # than the model, or a RoPE scaling other than llama3, is refused naming the file
    import json
    n = tiny_tiktoken_file(tmp_path / "tokenizer.model")
    make_hf_checkpoint(tmp_path, vocab=n + 256 + 64)
    assert load_llama(str(tmp_path)).cfg.vocab_size == n + 256 + 64
    cfg = json.load(open(tmp_path / "config.json"))
    json.dump({**cfg, "vocab_size": n}, open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match=f"tokenizer.model has {n + 256} ids but config.json says "
                                         f"vocab_size={n}"):
        load_llama(str(tmp_path))
    json.dump({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
              open(tmp_path / "config.json", "w"))
    with pytest.raises(ValueError, match="config.json: RoPE scaling .*yarn.* is not supported"):
        load_llama(str(tmp_path))
