"""Every script's settings, nanoGPT's way: the module-level names between "# config:" and a dashed
line, overridden by recipe files (plain Python assignments, config/) and then --name=value flags:
python train.py config/smollm2_cpu.py --max_iters=100; python train.py --help lists them."""
import ast
import contextlib
import os
import sys


def config_of(namespace):   # a script's settings: its module-level ints, floats, bools, strings
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str))}


def parse_overrides(argv, config, script, echo=True):   # -> config, overridden in order
    for arg in argv:
        if arg in ("-h", "--help"):   # print the script's config block, and stop
            block = "# config:" + open(script).read().split("# config:")[1]
            sys.exit(print(block[:block.index("# " + "-" * 77)]))
        if arg.endswith(".py") and not arg.startswith("--"):   # a recipe file
            names = {}
            exec(compile(open(arg).read(), arg, "exec"), {}, names)
            pairs = [kv for kv in names.items() if not kv[0].startswith("_")]
        elif arg.startswith("--") and "=" in arg:
            pairs = [tuple(arg[2:].split("=", 1))]
        else:
            raise SystemExit(f"{arg}: expected --name=value or a recipe file (see --help)")
        for key, value in pairs:
            if key not in config:
                raise SystemExit(f"{arg}: no setting {key!r} (see --help)")
            config[key] = typed(value, config[key], arg)
            if echo:
                print(f"{arg}: {key} = {config[key]!r}")
    return config


def typed(value, default, where):   # value as a value of the default's type, or a one-line error
    if isinstance(value, str) and not isinstance(default, str):
        with contextlib.suppress(ValueError, SyntaxError):   # (then refused below)
            value = ast.literal_eval(value.capitalize() if isinstance(default, bool) else value)
    value = float(value) if isinstance(default, float) and type(value) is int else value
    if type(value) is not type(default):
        raise SystemExit(f"{where}: expected {type(default).__name__}, like {default!r}")
    return value


def parse_list(name, spec, kind=int):   # "4,16" -> [4, 16]
    try:
        return [kind(x) for x in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--{name}={spec}: expected a list like 4,16,64") from None


def parse_schedule(name, spec, kind=int):
    # "1:700,2:1200" -> [(1, 700), (2, 1200)]: the value 1 until iteration 700, then 2 until 1200
    try:
        return [(kind(v), int(u)) for v, u in (p.split(":") for p in spec.split(",") if p)]
    except ValueError:
        raise SystemExit(f"--{name}={spec}: expected value:until pairs like 2:1000") from None


def scheduled(pairs, it, final):   # the value of the first pair whose until_iter is ahead
    return next((v for v, until in pairs if it < until), final)


def package_path(path):
    # "pkg:NAME/rest" -> the file or pattern `rest` inside the installed Python package NAME, found
    # without importing it: a model or text a registry package ships (config/smollm2_*.py); each
    # of several joined by commas (data_dir)
    if "," in path:
        return ",".join(map(package_path, path.split(",")))
    if not path.startswith("pkg:"):
        return path
    import importlib.util
    name, _, rest = path[4:].partition("/")
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"{path}: no installed Python package {name!r} (README: pip install)")
    return os.path.join(spec.submodule_search_locations[0], rest)

