# SharedLLM: equivalences and invariants, each one a bug of the released code or of an earlier
# version of this one would have failed.
import copy
import math
import random

import pytest
import torch

import decode
import model as M
import tree
from conftest import manual_attention, rel_err
from load_llama import PRESETS

V = 258


def build(seed=0, wo_scale=0.0, **kw):   # -> an untrained SharedLLM, and a copy of its base LLaMA
    torch.manual_seed(seed)
    base = M.Llama(M.LlamaConfig(**{**PRESETS["micro"], "n_layers": 3})).eval()
    for m in base.modules():   # norms unlike their init, as a pretrained model's
        if isinstance(m, M.RMSNorm):
            torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    ref = copy.deepcopy(base)
    kw = dict(dict(n_lower=2, chunk_size=64, height=3, beta=4, policy="right", chunk_pos="plain"),
              **kw)
    s = M.SharedLLM(base, M.SharedConfig(**kw)).eval()
    if wo_scale:   # a trained-looking cross-attention: the context changes the output
        for blk in s.upper.layers[:s.scfg.n_lower]:
            torch.nn.init.normal_(blk.cross_attention.wo.weight, std=wo_scale)
    return s, ref


def data(B=2, n=3, T=20, C=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, n, C), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("policy", ["right", "vector", "lexical"])
def test_untrained_sharedllm_equals_base_llama(policy):
    s, ref = build(policy=policy)
    ctx, idx = data()
    ql = torch.tensor([5, 9])
    with torch.no_grad():
        assert torch.equal(s(ctx, idx, question_len=ql)[0], ref(idx)[0])   # a zero wo: exact
        for blk in s.upper.layers[:2]:   # the cross-attention starts as the layer's own attention
            assert torch.equal(blk.cross_attention.wq.weight, blk.attention.wq.weight)
            assert torch.equal(blk.cross_norm.weight, blk.attention_norm.weight)
        s2, _ = build(policy=policy, wo_scale=0.5)
        assert rel_err(ref(idx)[0], s2(ctx, idx, question_len=ql)[0]) > 1e-3


@pytest.mark.parametrize("n_layers", [1, 2, 3, 4])
def test_fast_step_3_equals_the_plain_one(n_layers):
    # lower_kv_kept (the top block's K/V at the kept tokens alone, the block below at those tokens
    # only) gives lower_kv's K/V (full blocks, then one gather), and the same gradients, at every M
    llama = M.Llama(M.LlamaConfig(**{**PRESETS["micro"], "n_layers": 4}))
    tokens = torch.randint(0, V, (3, 16))
    kept_at = torch.tensor([[3, 7, 11, 15], [0, 4, 8, 12], [1, 5, 9, 15]])
    outs, grads = [], []
    for fn in (M.lower_kv, M.lower_kv_kept):
        llama.zero_grad(set_to_none=True)
        out = fn(llama, tokens, n_layers, kept_at)
        g = torch.Generator().manual_seed(2)
        sum((t * torch.randn(t.shape, generator=g)).sum() for kv in out for t in kv).backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in llama.named_parameters() if p.grad is not None})
    for kv1, kv2 in zip(*outs):
        for t1, t2 in zip(kv1, kv2):
            assert t1.shape == t2.shape == (3, 2, 4, 8) and rel_err(t1, t2) < 1e-6
    assert len(outs[1]) == n_layers and grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-5, n


def encode_each_node_alone(ref, ctx, nodes, n_lower, keep):
    # Steps 3 and 4 the obvious way: each preserved node a sequence of its own (at 0..) through
    # the base LLaMA's bottom M blocks; each block's KV cache then holds the K (rotated) and V the
    # paper keeps, read at the node's kept positions, and the keys of chunk c rotated by c
    B, n, C = ctx.shape
    kv = [([], []) for _ in range(n_lower)]
    for r, row_nodes in enumerate(nodes):
        for nd in row_nodes:
            x = ref.tok_embeddings(ctx[r // n, r % n, nd.start:nd.end][None])
            caches = [decode.KVCache(1, 2, len(nd), 8, "cpu", x.dtype) for _ in range(n_lower)]
            for block, cache in zip(ref.layers[:n_lower], caches):
                x = block(x, ref.rope(torch.arange(len(nd))), cache)
            at = tree.kept_positions(len(nd), nd.n_kept, keep)
            chunk_id = ref.rope(torch.full((nd.n_kept,), r % n))
            for j, cache in enumerate(caches):
                kv[j][0].append(M.apply_rope(cache.k[:, :, at], *chunk_id))   # (1, Hkv, kept, hd)
                kv[j][1].append(cache.v[:, :, at])
    per_row = lambda ts: torch.cat(ts, 2).view(2, B, -1, 8).transpose(0, 1)   # (B, Hkv, n*S, hd)
    return [(per_row(ks), per_row(vs)) for ks, vs in kv]


@pytest.mark.parametrize("kw", [dict(policy="vector", sigma=0.2), dict(policy="lexical"),
                                dict(policy="right", n_lower=3, sigma=0.2),
                                dict(policy="vector", n_lower=1, beta=2, keep="first")])
def test_compressed_kv_and_gradients_equal_encoding_each_node_alone(kw, monkeypatch):
    # the batched encoding (a level's nodes padded together, in calls of ENCODE_TOKENS, the last
    # block at the kept tokens only) in training, with noisy splits and a row without a question
    s, ref = build(**kw)
    s.train()
    ctx, idx = data(B=2, n=3)
    monkeypatch.setattr(M, "ENCODE_TOKENS", 64)   # a few nodes per call
    random.seed(7)
    mem = s.compress(ctx, idx, torch.tensor([5, 0]))
    want = encode_each_node_alone(ref, ctx, mem.nodes, s.scfg.n_lower, s.scfg.keep)
    g = torch.Generator().manual_seed(3)
    weights = [[torch.randn(t.shape, generator=g) for t in kv] for kv in want]
    loss = lambda kvs: sum((t * w).sum() for kv, ws in zip(kvs, weights) for t, w in zip(kv, ws))
    loss(mem.kv).backward()
    loss(want).backward()
    for (K1, V1), (K2, V2) in zip(mem.kv, want):
        assert rel_err(K1, K2) < 1e-5 and rel_err(V1, V2) < 1e-5
    for name, p in ref.named_parameters():
        if p.grad is not None:
            assert rel_err(p.grad, s.upper.get_parameter(name).grad) < 1e-5, name
    assert (mem.nodes[0][0].end != 32) == ("sigma" in kw)   # noisy splits were drawn
    halves = [(0, 32), (32, 48), (48, 56), (56, 64)]   # ... in training only
    assert [(nd.start, nd.end) for nd in s.eval().compress(ctx, idx).nodes[0]] == halves


def test_each_upper_layer_reads_its_lower_layer_after_attention_before_the_mlp():
    # the upper model written out (Eq. 3): layer i < M adds cross-attention over lower layer i's
    # compressed K/V, its queries at chunk id n (Eq. 2), after self-attention, before the MLP
    s, _ = build(wo_scale=0.5)
    ctx, idx = data(n=3)
    with torch.no_grad():
        mem, up = s.compress(ctx, idx), s.upper
        x, rope = up.tok_embeddings(idx), up.rope(torch.arange(idx.shape[1]))
        for i, blk in enumerate(up.layers):
            x = x + blk.attention(blk.attention_norm(x), rope)
            if i < s.scfg.n_lower:   # its queries rotated to chunk id n, its K/V lower layer i's
                ca = blk.cross_attention
                q = M.split_heads(ca.wq(blk.cross_norm(x)), ca.n_heads, ca.head_dim)
                y = manual_attention(M.apply_rope(q, *mem.q_rope), *mem.kv[i], False)
                x = x + ca.wo(M.merge_heads(y))
            x = x + blk.feed_forward(blk.ffn_norm(x))
        assert rel_err(up.output(up.norm(x)), up(idx, memory=mem)[0]) < 1e-6
    for got, want in zip(mem.q_rope, up.rope(torch.full((2,), 3))):
        assert torch.equal(got[:, 0, 0], want)


def test_chunk_ids_make_order_visible_and_are_random_only_in_training():
    ctx, idx = data(n=4)
    for chunk_pos, changes in [("plain", True), ("random", True), ("off", False)]:
        s, _ = build(wo_scale=0.5, chunk_pos=chunk_pos)
        with torch.no_grad():   # chunks in another order: another output, unless ids are off
            err = rel_err(s(ctx, idx)[0], s(ctx[:, [2, 0, 3, 1]], idx)[0])
        assert (err > 1e-3) if changes else (err < 1e-5), (chunk_pos, err)
    plain, _ = build(wo_scale=0.5)
    rand, _ = build(wo_scale=0.5, chunk_pos="random", max_chunk_id=40)
    with torch.no_grad():   # at inference: ids 0..n-1, the queries at n
        assert torch.equal(plain(ctx, idx)[0], rand(ctx, idx)[0])
    ids = M.chunk_positions(rand.scfg, 4000, 4, "cpu", training=True)
    k, q = ids[:, :4], ids[:, 4]
    assert (k[:, 1:] > k[:, :-1]).all() and torch.equal(q, k[:, -1] + 1)   # order kept
    assert k.min() == 0 and q.max() == 40 and (q == 4).float().mean() > 0.1
    dist = (q[:, None] - k)[:, 0]   # spans log-uniform in 4..40: near is common, far is seen
    assert (dist <= 8).float().mean() > 0.4 and (dist >= 20).float().mean() > 0.1


@pytest.mark.parametrize("policy", ["right", "vector", "lexical"])
def test_cached_decoding_and_batches_equal_full_forwards(policy):
    s, _ = build(wo_scale=0.5, policy=policy)
    ctx, idx = data(B=3, T=16)
    ql = torch.tensor([6, 9, 9])
    with torch.no_grad():
        mem = s.compress(ctx, idx[:, :9], ql)
        full = s.upper(idx, memory=mem)[0]
        caches = decode.new_caches(s.upper, 3, 16)
        steps = [s.upper(idx[:, :9], caches=caches, memory=mem)[0]]
        steps += [s.upper(idx[:, t:t + 1], start_pos=t, caches=caches, memory=mem)[0]
                  for t in range(9, 16)]
        assert rel_err(full, torch.cat(steps, 1)) < 1e-5
        for b in range(3):   # each batch item as if alone
            alone = s(ctx[b:b + 1], idx[b:b + 1, :9], question_len=ql[b:b + 1])[0]
            assert rel_err(alone, s(ctx, idx[:, :9], question_len=ql)[0][b:b + 1]) < 1e-5


def test_language_modeling_has_no_question():
    # no question (None, or 0 for a row): every tree goes right, the paper's LM policy; a question
    # taken from X_D would let the trees see the tokens being predicted
    s, _ = build(policy="vector")
    ctx, idx = data()
    with torch.no_grad():
        right = s.compress(ctx, idx).nodes
        mixed = s.compress(ctx, idx, torch.tensor([0, 16])).nodes
        steered = s.compress(ctx, idx, torch.tensor([16, 16])).nodes
    assert all(tree.path(nds, 64) == [(0, 64), (32, 64), (48, 64)] for nds in right)
    assert mixed[:3] == right[:3] and mixed[3:] == steered[3:] and steered != right


def test_vector_policy_is_the_papers_cosine_per_chunk():
    # the batched vectors choose as the obvious ones do, child by child: the question's hidden
    # vector (the first block and the final norm, at its last token) against each child's, cosine
    s, _ = build(policy="vector")
    ctx, idx = data(B=2, n=3)
    ql = torch.tensor([9, 20])
    h = lambda span: s.upper.norm(s.upper.layers[0](s.upper.tok_embeddings(span[None]),
                                                    s.upper.rope(torch.arange(len(span)))))[0, -1]
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, 0)
    rights = 0
    with torch.no_grad():
        for r, nds in enumerate(s.compress(ctx, idx, ql).nodes):
            b, row, (lo, hi) = r // 3, ctx[r // 3, r % 3], (0, 64)
            q = h(idx[b, :ql[b]])
            for level, (a, z) in enumerate(tree.path(nds, 64)[1:]):
                mid = lo + (hi - lo) // 2
                right = bool(cos(q, h(row[mid:hi])) > cos(q, h(row[lo:mid])))
                assert (a == mid) == right, (r, level)
                (lo, hi), rights = (mid, hi) if right else (lo, mid), rights + right
    assert 0 < rights < 12   # both ways taken: the test tells them apart


def test_gradients_reach_exactly_the_trainable_parameters():
    s, _ = build(wo_scale=0.5)
    ctx, idx = data()
    s.train()(ctx, idx, targets=idx)[1].backward()   # from scratch: everything trains
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in s.parameters())
    s, _ = build(wo_scale=0.5)
    for n, p in s.named_parameters():   # train="cross": only the cross-attention
        p.requires_grad_(".cross_" in n)
    s.train()(ctx, idx, targets=idx)[1].backward()
    for n, p in s.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (".cross_" in n), n


def test_the_search_runs_as_its_plain_statement_says():
    # lexical_targets_batched (what runs) gives lexical_targets' targets (the plain statement),
    # on random tokens with the question's runs planted in other orders, repeated, across chunk
    # borders, a short vocabulary (many ties) and a row with no question; and each tree holds its
    # target in a leaf
    s, _ = build(policy="lexical")
    g = torch.Generator().manual_seed(0)
    for V, ql in ((258, [5, 16]), (6, [9, 0]), (40, [20, 1])):
        ctx = torch.randint(0, V, (2, 3, 64), generator=g)
        idx = torch.randint(0, V, (2, 20), generator=g)
        ctx[1, 2, 4:10], ctx[1, 1, 40:45], ctx[1, 1, 20:25] = idx[1, 10:16], idx[1, :5], idx[1, :5]
        ctx[0, 0, 50:53], ctx[0, 2, 60:64], ctx[0, 2, 0:3] = idx[0, 2:5], idx[0, 1:5], idx[0, 0:3]
        ql = torch.tensor(ql)
        want = [t for b in range(2) for t in M.lexical_targets(ctx[b].flatten().tolist(),
                                                               idx[b, :ql[b]].tolist(), 64)]
        assert M.lexical_targets_batched(ctx.view(6, 64), idx, ql, V) == want
        with torch.no_grad():
            nodes = s.compress(ctx, idx, ql).nodes
        assert all(next(nd for nd in nds if nd.start <= t < nd.end).level == 3
                   for nds, t in zip(nodes, want))


Q8, Q16 = list(range(1, 9)), list(range(1, 17))


@pytest.mark.parametrize("context,question,C,want", [
    # late: Q's last token (4) outweighs its first (1); with every vote alike they would tie
    ([5, 1, 6, 7, 4, 8, 9, 9], [1, 2, 3, 4], 8, [5]),
    # count: the 4, seen three times, shares its vote; the 3, seen once, keeps it whole
    ([4, 0, 4, 0, 4, 0, 3, 0], [1, 2, 3, 4], 8, [7]),
    # the cue window, W = |Q|/4 = 2: "7 6" (7/8 + 6/8) outweighs the lone 8 (1); W = 1 would head
    # after the 8, W = 4 (|Q|/2) one place earlier
    ([8, 0, 0, 7, 6, 0, 0, 0], Q8, 8, [5]),
    # the longest run: 8 of Q's tokens outweigh 7 later ones; NGRAM_MAX = 7 heads after the 7
    ([0, 0, *Q16[7:15], 0, 0, 0, *Q16[9:16], 0, 0], Q16, 22, [10]),
    # across chunk borders: chunk 0 ends with the cue, so chunk 1 heads for its first token;
    # a chunk with no evidence heads right (C - 1)
    ([0, 0, 1, 2, 0, 0, 0, 0, 5, 5, 5, 5], [1, 2], 4, [3, 0, 3]),
])
def test_the_search_finds_what_its_rule_says(context, question, C, want):
    assert M.lexical_targets(context, question, C) == want
    assert M.lexical_targets_batched(torch.tensor(context).view(-1, C), torch.tensor([question]),
                                     torch.tensor([len(question)]), 20) == want


def test_on_passkey_haystacks_the_search_heads_for_the_key():
    # the tree of the key's chunk heads for the key's first token, in every haystack
    import data
    from tokenizer import ByteTokenizer
    tok, rng = ByteTokenizer(), random.Random(0)
    ctx, idx, tgt, ql = data.collate([data.passkey_sample(tok, rng, 8, 128) for _ in range(48)],
                                     tok)
    targets = M.lexical_targets_batched(ctx.view(-1, 128), idx, ql, 258)
    for b in range(48):
        key = data.key_mentions(ctx[b].flatten().tolist(), tgt[b][tgt[b] != -100].tolist())
        assert any(targets[b * 8 + a // 128] == a % 128 for a, _ in key), b
