# The house: scripts on one floor, layers that only point down, recipe files that parse, checkpoints
# that cannot run code when loaded.
import ast
import glob
import os

import pytest
import torch

import eval as E
import sample as S
import train
from configurator import config_of, parse_overrides
from conftest import ROOT
from checkpoint import load_sharedllm, read_checkpoint

SCRIPTS = {"train", "sample", "eval", "bench", "seeds"}
# what each module may import from this project: scripts -> loader -> model -> tree; data,
# configurator and plots serve the scripts only
ALLOWED = {
    "tree": set(),
    "model": {"tree"},
    "decode": set(),     # KV-cache decoding of any model.Llama
    "tokenizer": set(),
    "load_llama": {"model", "tokenizer", "decode"},   # decode: its smoke test
    "checkpoint": {"load_llama", "model", "tokenizer"},
    "configurator": set(),
    "data": set(),
    "plots": {"tree"},   # pictures from plain numbers: it knows no model
}


def local_imports(name):
    ours = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    tree = ast.parse(open(os.path.join(ROOT, name + ".py")).read())
    found = set()
    for node in ast.walk(tree):   # every import, also inside functions
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found & ours


def test_no_script_imports_another_and_layers_point_down():
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert SCRIPTS | set(ALLOWED) == modules, "a new top-level module: give it its place in ALLOWED"
    for s in SCRIPTS:
        assert not local_imports(s) & SCRIPTS, (f"{s}.py imports the script(s) "
                                                f"{local_imports(s) & SCRIPTS}")
    for m, allowed in ALLOWED.items():
        assert local_imports(m) <= allowed, (f"{m}.py imports {local_imports(m) - allowed}, "
                                             f"allowed {allowed}")


def test_every_line_of_python_is_at_most_100_characters():
    # the house rule, in every script, module, recipe and test: a reader never scrolls sideways
    files = [p for d in ("", "config", "tests") for p in glob.glob(os.path.join(ROOT, d, "*.py"))]
    long = [f"{os.path.relpath(p, ROOT)}:{i}" for p in files
            for i, line in enumerate(open(p, encoding="utf-8").read().splitlines(), 1)
            if len(line) > 100]
    assert len(files) > 30 and not long, long


def test_recipe_files_parse_and_tiny_is_the_default():
    files = sorted(glob.glob(os.path.join(ROOT, "config", "*.py")))
    assert len(files) >= 2
    for f in files:   # every name and type fits train.py's config block
        parse_overrides([f], dict(train.config), train.__file__)
    tiny = parse_overrides([os.path.join(ROOT, "config", "tiny.py")], dict(train.config),
                           train.__file__)
    assert tiny == train.config, "config/tiny.py must describe the default run exactly"


def test_the_cpu_retrieval_recipe_keeps_every_token_of_a_leaf():
    # SmolLM2's lower model is frozen there: a key's digit whose own KV is dropped was the only kind
    # misread (docs/real_model.md), so the recipe's sizes keep every token of a leaf
    import tree
    cfg = parse_overrides([os.path.join(ROOT, "config", "smollm2_retrieval_cpu.py")],
                          dict(train.config), train.__file__)
    leaves = [nd for nd in tree.search(1, cfg["chunk_size"], cfg["height"], cfg["beta"])[0]
              if nd.level == cfg["height"]]
    assert cfg["train"] == "cross" and all(nd.n_kept == len(nd) for nd in leaves)


class Payload:
    # unpickling this calls open(marker, "w"): a stand-in for any code a crafted checkpoint could
    # run
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_needs_unpickling_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"model": {}, "config": Payload(str(marker)), "model_args": {},
                "tokenizer": {"kind": "byte"}}, evil / "ckpt.pt")
    with pytest.raises(ValueError,
                       match="refused: it holds objects other than tensors and plain values"):
        read_checkpoint(str(evil / "ckpt.pt"))
    with pytest.raises(ValueError, match=f"{evil / 'ckpt.pt'}: refused"):
        load_sharedllm(str(evil))
    monkeypatch.chdir(tmp_path)
    for script in (S, E):   # as the scripts report it
        cfg = config_of(vars(script))
        cfg.update(init_from=str(evil), device="cpu")
        with pytest.raises(SystemExit, match="refused"):
            script.main(cfg)
    monkeypatch.setattr(train, "init_from", "resume")
    monkeypatch.setattr(train, "out_dir", str(evil))
    monkeypatch.setattr(train, "device", "cpu")
    with pytest.raises(SystemExit, match=f"init_from=resume: {evil / 'ckpt.pt'}: refused"):
        train.main()
    assert not marker.exists()
    torch.load(evil / "ckpt.pt", weights_only=False)   # the same file really would have run it
    assert marker.exists()


def test_a_damaged_checkpoint_is_named(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError,
                       match=f"{tmp_path / 'ckpt.pt'}: not a readable train.py checkpoint"):
        load_sharedllm(str(tmp_path))
    torch.save({"model": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="not a train.py checkpoint"):
        load_sharedllm(str(tmp_path))


def test_package_paths_and_corpus_globs(tmp_path):
    import json

    import data
    from configurator import package_path
    assert (package_path("pkg:json/decoder.py") == json.decoder.__file__
            and package_path("a/b.txt") == "a/b.txt")
    with pytest.raises(SystemExit,
                       match="pkg:no_such_pkg/x.gguf: no installed Python package 'no_such_pkg'"):
        package_path("pkg:no_such_pkg/x.gguf")
    for name in ("a_gut.txt", "a_gut_f.txt", "b_gut.txt"):
        (tmp_path / name).write_text("x")
    assert ([os.path.basename(f) for f in data.corpus_files(str(tmp_path / "*_gut.txt"))]
            == ["a_gut.txt", "b_gut.txt"])
    assert len(data.corpus_files(str(tmp_path))) == 3
    with pytest.raises(FileNotFoundError, match="matches no file"):
        data.corpus_files(str(tmp_path / "*.md"))


def test_the_readme_example_and_sharedconfig_defaults_are_the_default_recipe():
    # one source of truth: what SharedLLM.from_llama(llama, n_lower=..., chunk_size=...) builds, as
    # the README shows it (and as sample.py / eval.py / bench.py build a LLaMA folder), has the
    # settings `python train.py` trains with
    from dataclasses import asdict
    import model as M
    line = next(l for l in open(os.path.join(ROOT, "README.md")) if "SharedLLM.from_llama(" in l)
    call = ast.parse(line[line.index("SharedLLM.from_llama("):line.rindex(")") + 1]).body[0].value
    given = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    # sizes only: the model's, not the method's
    assert set(given) == {"n_lower", "chunk_size"}
    example, recipe = asdict(M.SharedConfig(**given)), train.shared_config()
    assert ({k: v for k, v in example.items() if k not in given}
            == {k: v for k, v in recipe.items() if k not in given})


def test_every_recipe_runs_the_one_method():
    # every config/*.py, train.py's defaults, SharedConfig's defaults and eval.py / sample.py
    # reading a LLaMA folder: one search and one chunk-id form (a recipe changes sizes, never the
    # mechanism)
    import model as M
    one = {k: getattr(M.SharedConfig(), k) for k in ("policy", "chunk_pos")}
    assert one == {"policy": "lexical", "chunk_pos": "random"}
    for f in sorted(glob.glob(os.path.join(ROOT, "config", "*.py"))):
        cfg = parse_overrides([f], dict(train.config), train.__file__)
        assert {k: cfg[k] for k in one} == one, f
    assert {k: train.config[k] for k in one} == one
    # the retired searches are gone
    with pytest.raises(ValueError, match="SharedConfig.policy = 'attention'"):
        M.SharedConfig(policy="attention")
    with pytest.raises(ValueError, match="SharedConfig.chunk_pos = 'clamp'"):
        M.SharedConfig(chunk_pos="clamp")
