# SharedLLM: equivalences and invariants that the released code's bugs would have failed.
import copy
import math
import random

import pytest
import torch

import decode
import model as M
import tree
from conftest import rel_err
from load_llama import preset

V = 258


def build(seed=0, wo_scale=0.0, **kw):
    torch.manual_seed(seed)
    base = M.Llama(preset("micro", n_layers=3)).eval()
    ref = copy.deepcopy(base)
    cfg = dict(n_lower=2, chunk_size=64, height=3, beta=4, policy="right", sigma=0.2,
               chunk_pos="plain")
    s = M.SharedLLM.from_llama(base, **{**cfg, **kw}).eval()
    if wo_scale:   # a trained-looking cross-attention, so the context actually changes the output
        for blk in s.upper.layers:
            if blk.cross_attention is not None:
                torch.nn.init.normal_(blk.cross_attention.wo.weight, std=wo_scale)
    return s, ref


def data(B=2, n=3, T=20, C=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, n, C), generator=g), torch.randint(0, V, (B, T), generator=g)


@pytest.mark.parametrize("lower", ["shared", "copy"])
@pytest.mark.parametrize("policy", ["right", "vector", "lexical"])
def test_untrained_sharedllm_equals_base_llama(lower, policy):
    s, ref = build(lower_weights=lower, policy=policy)
    ctx, idx = data()
    with torch.no_grad():
        a, _ = s(ctx, idx)
        b, _ = ref(idx)
    # zero output projection: exactly the base model
    assert torch.equal(a, b)
    s2, _ = build(lower_weights=lower, policy=policy, wo_scale=0.5)
    with torch.no_grad():
        # ...and the context does matter once it is not zero
        assert rel_err(b, s2(ctx, idx)[0]) > 1e-3


@pytest.mark.parametrize("n_layers", [1, 2, 3, 4])
def test_lower_kv_kept_equals_lower_kv(n_layers):
    # what runs (lower_kv_kept: the top block's K/V at the kept tokens alone, the block below it at
    # those tokens only) gives the plain statement's K/V (lower_kv: full blocks, then one gather)
    # and the same gradients, at every M
    torch.manual_seed(0)
    llama = M.Llama(preset("micro", n_layers=4))
    tokens = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    # each row its own positions
    kept_at = torch.tensor([[3, 7, 11, 15], [0, 4, 8, 12], [1, 5, 9, 15]])
    outs, grads = [], []
    for fn in (M.lower_kv, M.lower_kv_kept):
        llama.zero_grad(set_to_none=True)
        out = fn(llama, tokens, n_layers, kept_at)
        g = torch.Generator().manual_seed(2)
        sum((t * torch.randn(t.shape, generator=g)).sum() for kv in out for t in kv).backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in llama.named_parameters() if p.grad is not None})
    assert len(outs[0]) == len(outs[1]) == n_layers
    for kv1, kv2 in zip(*outs):
        for t1, t2 in zip(kv1, kv2):
            assert t1.shape == t2.shape == (3, 2, 4, 8) and rel_err(t1, t2) < 1e-6
    assert grads[0].keys() == grads[1].keys() and "tok_embeddings.weight" in grads[0]
    for n in grads[0]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-5, n


def test_lower_kv_equals_base_llama_kv_at_kept_positions():
    s, ref = build(chunk_pos="plain")
    ctx, idx = data(B=2, n=3)
    mem = s.compress(ctx, idx)
    S = sum(nd.n_kept for nd in mem.nodes[0])
    for b in range(2):
        for c in range(3):
            off = 0
            for nd in mem.nodes[b * 3 + c]:
                captured = {}
                hooks = [ref.layers[j].attention.wk.register_forward_hook(
                             lambda m, i, o, j=j: captured.__setitem__(("k", j), o))
                         for j in range(2)]
                hooks += [ref.layers[j].attention.wv.register_forward_hook(
                              lambda m, i, o, j=j: captured.__setitem__(("v", j), o))
                          for j in range(2)]
                with torch.no_grad():
                    # the base LLaMA on this node's tokens, positions 0..
                    ref(ctx[b, c, nd.start:nd.end][None])
                for h in hooks:
                    h.remove()
                keep = torch.tensor(tree.kept_positions(len(nd), nd.n_kept, "last"))
                for j in range(2):
                    # (1, Hkv, L, hd)
                    k = captured["k", j].view(1, len(nd), 2, 8).transpose(1, 2)
                    # node-local positions
                    k = M.apply_rope(k, *M.rope_cos_sin(torch.arange(len(nd)), 8, 10000.0))
                    # then chunk id c
                    k = M.apply_rope(k, *M.rope_cos_sin(torch.full((len(nd),), c), 8, 10000.0))
                    v = captured["v", j].view(1, len(nd), 2, 8).transpose(1, 2)
                    K, Vv = mem.kv[j]
                    sl = slice(c * S + off, c * S + off + nd.n_kept)
                    assert rel_err(k[0][:, keep], K[b][:, sl]) < 1e-5
                    assert rel_err(v[0][:, keep], Vv[b][:, sl]) < 1e-5
                off += nd.n_kept


def test_chunk_pos_make_order_visible():
    ctx, idx = data(n=4)
    perm = ctx[:, [2, 0, 3, 1]]
    for chunk_pos, should_change in [("plain", True), ("random", True), ("off", False)]:
        s, _ = build(wo_scale=0.5, chunk_pos=chunk_pos)
        with torch.no_grad():
            a, b = s(ctx, idx)[0], s(perm, idx)[0]
        err = rel_err(a, b)
        assert (err > 1e-3) if should_change else (err < 1e-5), (chunk_pos, err)


def test_random_chunk_pos_are_plain_at_inference_and_keep_order_in_training():
    ctx, idx = data(B=3, n=4)
    plain, _ = build(wo_scale=0.5, chunk_pos="plain")
    # no split noise in training
    rand, _ = build(wo_scale=0.5, chunk_pos="random", max_chunk_id=40, sigma=0.0)
    with torch.no_grad():
        # eval: ids 0..n-1, queries at n
        assert torch.equal(plain(ctx, idx)[0], rand(ctx, idx)[0])
    rand.train()
    k, q = M.chunk_positions(rand.scfg, 4000, 4, "cpu", training=True)
    # order kept; X_D right after the last chunk
    assert (k[:, 1:] > k[:, :-1]).all() and torch.equal(q, k[:, -1] + 1)
    assert k.min() == 0 and q.max() == 40                                  # every id 0..40 in use
    # query-key distances seen in training
    dist = q[:, None] - k
    # spans log-uniform in 4..40: each octave of distance about as often, so near is common and far
    # is seen
    assert (dist[:, 0] <= 8).float().mean() > 0.4 and (dist[:, 0] >= 20).float().mean() > 0.1
    # the shortest span: exactly the plain ids
    assert (q == 4).float().mean() > 0.1
    # the rotation really follows the drawn ids: keys of the same chunk content at another id differ
    torch.manual_seed(0)
    m1 = rand.compress(ctx, idx)
    torch.manual_seed(1)
    m2 = rand.compress(ctx, idx)
    assert not torch.equal(m1.q_rope[0], m2.q_rope[0]) and not torch.equal(m1.kv[0][0], m2.kv[0][0])
    # values carry no position
    assert torch.equal(m1.kv[0][1], m2.kv[0][1])
    with pytest.raises(ValueError, match="5 chunks need chunk ids up to 5; max_chunk_id is 4"):
        build(chunk_pos="random", max_chunk_id=4)[0].train().compress(data(n=5)[0], idx)


def decode_stepwise(s, idx, mem, prefill):
    # the logits of idx (B, T) as cached decoding computes them: prefill the first tokens, then one
    # token at a time
    caches = decode.new_caches(s.upper, idx.shape[0], idx.shape[1])
    steps = [s.upper(idx[:, :prefill], caches=caches, memory=mem)[0]]
    for t in range(prefill, idx.shape[1]):
        steps.append(s.upper(idx[:, t:t + 1], start_pos=t, caches=caches, memory=mem)[0])
    return torch.cat(steps, 1)


@pytest.mark.parametrize("policy", ["right", "vector"])
def test_cached_decoding_equals_full_forward(policy):
    s, _ = build(wo_scale=0.5, policy=policy)
    ctx, idx = data(B=2, T=16)
    qlen = torch.tensor([6, 9])
    with torch.no_grad():
        mem = s.compress(ctx, idx[:, :9], qlen)
        full, _ = s.upper(idx, memory=mem)
        assert rel_err(full, decode_stepwise(s, idx, mem, 9)) < 1e-5
    # compress once, prefill, decode
    with torch.no_grad():
        out = decode.generate(s.upper, idx[:, :9], 10, memory=s.compress(ctx, idx[:, :9], qlen))
    ref = idx[:, :9]
    with torch.no_grad():
        for _ in range(10):
            ref = torch.cat([ref, s.upper(ref, memory=mem)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_batch_items_are_independent():
    s, _ = build(wo_scale=0.5, policy="vector")
    ctx, idx = data(B=3, n=2)
    ql = torch.tensor([3, 7, 16])
    with torch.no_grad():
        batched = s(ctx, idx, question_len=ql)[0]
        for b in range(3):
            assert rel_err(batched[b:b + 1],
                           s(ctx[b:b + 1], idx[b:b + 1], question_len=ql[b:b + 1])[0]) < 1e-5


def test_language_modeling_has_no_query():
    # With no query (question_len None, or 0 for a row) the tree goes right, as the paper's LM
    # policy: a query taken from X_D itself would let the tree choice depend on the very tokens
    # being predicted.
    s, _ = build(wo_scale=0.5, policy="vector")
    ctx, idx = data(B=2, n=3)
    with torch.no_grad():
        a = s(ctx, idx)[0]
        b = s(ctx, idx, question_len=torch.tensor([0, 0]))[0]
        mixed = s.compress(ctx, idx, torch.tensor([0, 16]))
        s.scfg.policy = "right"
        ref = s(ctx, idx)[0]
        right = s.compress(ctx, idx)
        s.scfg.policy = "vector"
        steered = s.compress(ctx, idx, torch.tensor([16, 16]))
    assert torch.equal(a, ref) and torch.equal(b, ref)
    assert mixed.nodes[:3] == right.nodes[:3] and mixed.nodes[3:] == steered.nodes[3:]   # per row
    assert steered.nodes != right.nodes            # (the query does steer this model's trees)


def test_vector_policy_pairs_each_chunk_with_its_own_children(monkeypatch):
    # Make hidden vectors one-hot of the span's last token: the query (last token Q) is similar only
    # to a child ending in Q. Chunks 0 and 2 end their LEFT half in Q, chunk 1 its RIGHT half;
    # answers are known.
    s, _ = build(policy="vector", height=2)
    Q = 7
    ctx, idx = data(B=2, n=3)
    ctx[ctx == Q] = 8
    idx[:, -1] = Q
    for b in range(2):
        ctx[b, 0, 31], ctx[b, 1, 63], ctx[b, 2, 31] = Q, Q, Q
    monkeypatch.setattr(M, "hidden_vectors", lambda llama, tokens, lengths:
                        torch.nn.functional.one_hot(
                            tokens[torch.arange(len(tokens)), lengths - 1], V).float())
    mem = s.compress(ctx, idx, torch.full((2,), idx.shape[1]))
    for r, nds in enumerate(mem.nodes):
        preserved = [(nd.start, nd.end) for nd in nds if nd.level == 1][0]
        assert preserved == ((32, 64) if r % 3 in (0, 2) else (0, 32)), (r, preserved)


def test_gradients_reach_exactly_the_trainable_parameters():
    # from scratch: everything trains
    s, _ = build(wo_scale=0.5)
    s.train()
    ctx, idx = data()
    _, loss = s(ctx, idx, targets=idx)
    loss.backward()
    no_grad = [n for n, p in s.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []
    # the paper's LM recipe on a checkpoint: frozen copy as the lower model, only cross-attention
    # trains
    s, _ = build(wo_scale=0.5, lower_weights="copy")
    for n, p in s.named_parameters():
        p.requires_grad_(".cross_" in n)
    s.train()
    _, loss = s(ctx, idx, targets=idx)
    loss.backward()
    for n, p in s.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (".cross_" in n), n
    # 2 layers x (norm, wq, wo)
    assert len([p for p in s.parameters() if p.requires_grad]) == 2 * 3


@pytest.mark.parametrize("kw,n,B", [(dict(beta=1), 2, 1), (dict(height=1), 3, 2), ({}, 1, 1),
                                    ({}, 2, 4), (dict(keep="first"), 2, 2),
                                    (dict(n_lower=1), 2, 1)])
def test_edge_cases(kw, n, B):
    s, ref = build(wo_scale=0.5, **kw)
    ctx, idx = data(B=B, n=n)
    mem = s.compress(ctx, idx)
    beta, h = s.scfg.beta, s.scfg.height
    assert mem.kv[0][0].shape == (B, 2, n * 64 // beta, 8)
    assert all(len(nodes) == h + 1 for nodes in mem.nodes) and len(mem.nodes) == B * n
    logits, _ = s(ctx, idx)
    assert logits.shape == (B, 20, V) and torch.isfinite(logits).all()
    layers = [i for i, blk in enumerate(s.upper.layers) if blk.cross_attention is not None]
    assert layers == list(range(s.scfg.n_lower))   # the bottom M layers cross-attend (the paper)


def test_noise_only_in_training():
    s, _ = build(sigma=0.2)
    ctx, idx = data(n=2)
    halves = [(0, 32), (32, 48), (48, 56), (56, 64)]
    assert all([(nd.start, nd.end) for nd in nds] == halves for nds in s.compress(ctx, idx).nodes)
    s.train()
    import random
    random.seed(0)
    spans = [[(nd.start, nd.end) for nd in nds] for nds in s.compress(ctx, idx).nodes]
    assert spans[0] != halves and all(sp == spans[0] for sp in spans)
    assert s.compress(ctx, idx).kv[0][0].shape == (2, 2, 2 * 16, 8)


def test_bad_configs():
    with pytest.raises(ValueError, match="SharedConfig.policy = 'left'"):
        M.SharedConfig(policy="left")
    with pytest.raises(ValueError, match=r"n_lower \(M\) = 5; the model has 3 layers"):
        build(n_lower=5)
    s, _ = build()
    with pytest.raises(ValueError,
                       match="context chunks have 32 tokens; this model's chunk_size C is 64"):
        s(torch.zeros(1, 2, 32, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))


def test_compress_under_no_grad_keeps_no_graph():
    # trainable weights, but the caller says no_grad (evaluation): the compressed KVs must carry no
    # autograd graph, or a long context holds every layer's activations (a 16K-token eval once
    # needed 23 GB this way)
    s, _ = build()
    assert all(p.requires_grad for p in s.parameters())
    ctx, idx = data()
    with torch.no_grad():
        mem = s.compress(ctx, idx)
    assert all(not t.requires_grad and t.grad_fn is None for kv in mem.kv for t in kv)
    # and training still gets its graph
    assert s.compress(ctx, idx).kv[0][0].requires_grad


def test_hidden_vector_is_the_first_block_at_the_last_position():
    # the paper's search (policy="vector") compares hidden vectors h: a right-padded batch of
    # sequences must read as each sequence on its own through the first block and the final norm, at
    # its last position
    torch.manual_seed(0)
    # GQA: 4 query heads over 2 KV heads
    m = M.Llama(preset("tiny", n_layers=2)).eval()
    idx, lengths = torch.randint(0, 258, (6, 50)), torch.tensor([50, 1, 11, 34, 8, 26])
    first_layer = lambda x: m.norm(m.layers[0](m.tok_embeddings(x),
                                               m.rope(torch.arange(x.shape[1]))))
    with torch.no_grad():
        h = M.hidden_vectors(m, idx, lengths)
        for r in range(6):
            alone = first_layer(idx[r:r + 1, :lengths[r]])[0, -1]
            assert (h[r] - alone).abs().max() < 1e-5, r
        pad = idx.clone()
        # what follows the length is never read
        pad[2, 11:] = 0
        assert (M.hidden_vectors(m, pad, lengths)[2] - h[2]).abs().max() < 2e-6


@pytest.mark.parametrize("policy", ["right", "vector", "lexical"])
def test_compressed_kv_and_gradients_equal_encoding_each_node_alone(policy):
    # The batched encoding (nodes of a level padded together, the last lower block at the kept
    # tokens only): values and gradients must equal each node encoded on its own, whichever search
    # chose the nodes.
    s, ref = build(policy=policy)
    ctx, idx = data(B=2, n=3)
    # trainable lower model: graph kept
    mem = s.compress(ctx, idx, torch.full((2,), 5))
    S, g = sum(nd.n_kept for nd in mem.nodes[0]), torch.Generator().manual_seed(3)
    W = [[torch.randn(t.shape, generator=g) for t in kv] for kv in mem.kv]
    sum((t * w).sum() for kv, ws in zip(mem.kv, W) for t, w in zip(kv, ws)).backward()
    ref_loss = 0.0
    for b in range(2):
        for c in range(3):
            off = 0
            for nd in mem.nodes[b * 3 + c]:
                keep = torch.tensor([tree.kept_positions(len(nd), nd.n_kept, "last")])
                sl = slice(c * S + off, c * S + off + nd.n_kept)
                for j, (K, V) in enumerate(
                        M.lower_kv(ref, ctx[b, c, nd.start:nd.end][None], 2, keep)):
                    # chunk id c
                    K = M.apply_rope(K, *M.rope_cos_sin(torch.full((nd.n_kept,), c), 8, 10000.0))
                    assert rel_err(K[0], mem.kv[j][0][b][:, sl].detach()) < 1e-5
                    assert rel_err(V[0], mem.kv[j][1][b][:, sl].detach()) < 1e-5
                    ref_loss = (ref_loss + (K[0] * W[j][0][b][:, sl]).sum()
                                + (V[0] * W[j][1][b][:, sl]).sum())
                off += nd.n_kept
    ref_loss.backward()
    for name in ["tok_embeddings.weight", "layers.0.attention.wk.weight",
                 "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.weight",
                 "layers.1.attention.wk.weight"]:
        a, r = s.upper.get_parameter(name).grad, ref.get_parameter(name).grad
        assert r.abs().sum() > 0 and rel_err(a, r) < 1e-5, (name, rel_err(a, r))


@pytest.mark.parametrize("policy", ["right", "vector"])
def test_encoding_in_small_calls_changes_nothing(policy, monkeypatch):
    # compress encodes each level in calls of about ENCODE_TOKENS tokens (speed, memory): the split
    # is invisible
    s, _ = build(wo_scale=0.5, policy=policy)
    ctx, idx = data(B=2, n=5)
    with torch.no_grad():
        one = s.compress(ctx, idx, torch.full((2,), 5))
        # 1-2 nodes per call instead of all 10
        monkeypatch.setattr(M, "ENCODE_TOKENS", 40)
        many = s.compress(ctx, idx, torch.full((2,), 5))
    assert ([[(nd.start, nd.end) for nd in nds] for nds in one.nodes]
            == [[(nd.start, nd.end) for nd in nds] for nds in many.nodes])
    for (K1, V1), (K2, V2) in zip(one.kv, many.kv):
        assert rel_err(K1, K2) < 1e-6 and rel_err(V1, V2) < 1e-6


@pytest.mark.parametrize("policy,kw", [("vector", dict(sigma=0.2)), ("lexical", dict(sigma=0.2)),
                                       ("lexical", dict(n_lower=3, sigma=0.2)),
                                       ("right", dict(sigma=0.2)),
                                       ("vector", dict(n_lower=1, beta=1, keep="first"))])
def test_reference_encoding_equals_the_batched_one(policy, kw):
    # encode_nodes_reference (below) encodes each preserved node on its own through the lower
    # model's blocks and reads its K/V from their KV caches: encode_nodes (spans padded together,
    # only the kept tokens projected in the last block) must give the same Memory and the same
    # gradients. Training mode: noisy splits (the same draws for both), with one row that has no
    # question.
    ctx, idx = data(B=2, n=3)
    runs = {}
    for path in ("batched", "reference"):
        s, _ = build(policy=policy, wo_scale=0.5, **kw)
        if path == "reference":
            s.encode_nodes = lambda rows, nodes, s=s: encode_nodes_reference(s, rows, nodes)
        s.train()
        random.seed(7)                                                  # the split noise's draws
        mem = s.compress(ctx, idx, torch.tensor([5, 0]))
        logits, loss = s.upper(idx, idx, memory=mem)
        loss.backward()
        runs[path] = mem, logits, {n: p.grad for n, p in s.named_parameters()}
    (m1, l1, g1), (m2, l2, g2) = runs["batched"], runs["reference"]
    assert ([[(nd.start, nd.end) for nd in nds] for nds in m1.nodes]
            == [[(nd.start, nd.end) for nd in nds] for nds in m2.nodes])
    # noisy splits (exact halves: 32)
    assert (m1.nodes[0][0].end != 32) == ("sigma" in kw)
    for (K1, V1), (K2, V2) in zip(m1.kv, m2.kv):
        assert rel_err(K1, K2) < 1e-5 and rel_err(V1, V2) < 1e-5
    assert rel_err(l1, l2) < 1e-5
    for n in g1:
        assert g1[n] is not None and g1[n].abs().sum() > 0 and rel_err(g1[n], g2[n]) < 1e-5, (
            n, rel_err(g1[n], g2[n]))


def encode_nodes_reference(s, rows, nodes):
    # Step 3 the obvious way, the oracle of SharedLLM.encode_nodes: each preserved node a sequence
    # of its own (positions 0..len-1) through the lower model's bottom M blocks; each block's KV
    # cache then holds exactly the K (rotated) and V the paper keeps, read at the node's kept
    # positions -> per layer (K, V), each (all kept KVs, Hkv, hd), text order
    low, M_ = s.lower_model(), s.scfg.n_lower
    kv = [([], []) for _ in range(M_)]
    for r, row_nodes in enumerate(nodes):
        for nd in row_nodes:
            # (1, len, dim)
            x = low.tok_embeddings(rows[r:r + 1, nd.start:nd.end])
            caches = [decode.KVCache(1, low.cfg.n_kv_heads, len(nd), low.cfg.head_dim, rows.device,
                                     x.dtype)
                      for _ in range(M_)]
            for block, cache in zip(low.layers[:M_], caches):
                x = block(x, low.rope(torch.arange(len(nd))), cache)
            at = tree.kept_positions(len(nd), nd.n_kept, s.scfg.keep)
            # (n_kept, Hkv, hd)
            for j, cache in enumerate(caches):
                kv[j][0].append(cache.k[0, :, at].transpose(0, 1))
                kv[j][1].append(cache.v[0, :, at].transpose(0, 1))
    return [(torch.cat(ks), torch.cat(vs)) for ks, vs in kv]


def lexical_target(flat, q, C, chunk):
    # lexical_policy's definition, in plain Python for one chunk of one sample: each context
    # position t scores every run of k <= NGRAM_MAX tokens ending at it that the question holds,
    # log(N / the run's count in X_C), twice if the question ends with it; position p's evidence is
    # the scores of [p - W, p), W = len(q) // 4 (at least 1); the target is the chunk's first
    # position of most evidence, or its last position when no evidence
    from collections import Counter
    N, W = len(flat), max(1, len(q) // 4)
    runs = lambda seq, k: [tuple(seq[i - k + 1:i + 1]) for i in range(k - 1, len(seq))]
    count = {k: Counter(runs(flat, k)) for k in range(1, M.NGRAM_MAX + 1)}
    in_q = {k: set(runs(q, k)) for k in range(1, M.NGRAM_MAX + 1)}
    score = [0.0] * N
    for t in range(N):
        for k in range(1, min(M.NGRAM_MAX, t + 1) + 1):
            run = tuple(flat[t - k + 1:t + 1])
            rarity = math.log(N / count[k][run])
            score[t] += rarity * ((run in in_q[k]) + (len(q) >= k and run == tuple(q[-k:])))
    evidence = [sum(score[max(0, p - W):p]) for p in range(chunk * C, (chunk + 1) * C)]
    best = max(evidence)
    return evidence.index(best) if best > 1e-4 else C - 1


def test_lexical_policy_follows_its_plain_definition():
    # policy="lexical" (every recipe's search, beyond the paper): each tree walks toward
    # lexical_target, found here in plain Python one chunk at a time, on random tokens with the
    # question's runs planted in other orders; a row with no question goes right, as the policy
    # "right" does
    s, _ = build(policy="lexical", height=3, sigma=0.0)
    ctx, idx = data(B=2, n=3)
    ql = torch.tensor([5, 16])
    # sample 1: the question's last 6 tokens, in chunk 2
    ctx[1, 2, 4:10] = idx[1, 10:16]
    ctx[1, 1, 40:45] = idx[1, 0:5]                          # ... its first 5 in chunk 1, twice
    ctx[1, 1, 20:25] = idx[1, 0:5]
    # sample 0: its runs apart and out of order
    ctx[0, 0, 50:53], ctx[0, 0, 30:32] = idx[0, 2:5], idx[0, 0:2]
    # ... and across the border of chunks 1, 2
    ctx[0, 2, 60:64], ctx[0, 2, 0:3] = idx[0, 1:5], idx[0, 0:3]
    with torch.no_grad():
        nodes = s.compress(ctx, idx, ql).nodes
    targets = []
    for r, nds in enumerate(nodes):                         # each tree holds its target in a leaf
        b, c = r // 3, r % 3
        t = lexical_target(ctx[b].flatten().tolist(), idx[b, :ql[b]].tolist(), 64, c)
        targets.append(t)
        assert next(nd for nd in nds if nd.start <= t < nd.end).level == 3, (r, t, nds)
    assert targets[:3] != [63] * 3 and targets[3:] != [63] * 3   # the planted runs moved the trees
    assert targets[5] == 10                                 # right after the question's own ending
    with torch.no_grad():
        none = s.compress(ctx, idx, torch.tensor([0, 0])).nodes
        # one row without a question, one with
        mixed = s.compress(ctx, idx, torch.tensor([0, 16])).nodes
        s.scfg.policy = "right"
        right = s.compress(ctx, idx).nodes
    assert none == right and mixed[:3] == right[:3] and mixed[3:] == nodes[3:]
