"""
How much a recipe varies with the seed: train it on several seeds, a few runs at a time with one
thread each, and tabulate each run's final evaluation with the worst, median and best over the
seeds.

  python seeds.py                                  # the default recipe on seeds 1-10, two at a time
  python seeds.py --out=out-seeds-ws -- config/workshop.py
                                                   # a recipe: everything after -- goes to train.py
  python seeds.py --table_only=True                # tabulate the runs already in --out

Each run is `python train.py --seed=S --out_dir=OUT/seedS [train.py arguments]` with
OMP_NUM_THREADS=threads, its output in OUT/seedS.log. A run repeats exactly only with the same
thread count, so a table says which it used.
"""
import json
import os
import statistics
import subprocess
import sys
import time

from configurator import check_ranges, config_of, parse_overrides

# -----------------------------------------------------------------------------
# config: every name below can be overridden with --name=value (train.py's arguments go after --)
seeds = "1-10"              # "1-10" or "1,2,5"
jobs = 2                    # runs at a time (2 on a 2-core machine: one thread each)
threads = 1                 # OMP_NUM_THREADS of each run
out = "out-seeds"           # OUT: each run's out_dir is OUT/seedS, its printed output OUT/seedS.log
table_only = False          # only tabulate the runs already in OUT
# -----------------------------------------------------------------------------


def parse_seeds(spec):   # "1-10" -> [1..10]; "1,2,5" -> [1, 2, 5]
    try:
        if "-" in spec:
            lo, hi = (int(x) for x in spec.split("-"))
            picked = list(range(lo, hi + 1))
        else:
            picked = [int(x) for x in spec.split(",")]
        assert picked and all(s >= 0 for s in picked)
    except (ValueError, AssertionError):
        raise SystemExit(f"--seeds={spec}: expected a range like 1-10 "
                         "or a list like 1,2,5") from None
    return picked


def run_all(picked, train_args, cfg):
    # every seed's train.py, cfg["jobs"] at a time; -> {seed: wall seconds}
    os.makedirs(cfg["out"], exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg["threads"])}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    waiting, running, walls = list(picked), {}, {}
    while waiting or running:
        while waiting and len(running) < cfg["jobs"]:
            s = waiting.pop(0)
            args = [sys.executable, script, *train_args, f"--seed={s}",
                    f"--out_dir={os.path.join(cfg['out'], f'seed{s}')}"]
            log = open(os.path.join(cfg["out"], f"seed{s}.log"), "w")
            running[s] = (subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env),
                          log, time.time())
            print(f"seed {s}: started", flush=True)
        time.sleep(1)
        for s, (proc, log, t0) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                walls[s] = time.time() - t0
                del running[s]
                print(f"seed {s}: "
                      f"{'done' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}"
                      f" in {walls[s] / 60:.1f} min; its output: "
                      f"{os.path.join(cfg['out'], f'seed{s}.log')}", flush=True)
    return walls


def final_eval(out_dir):
    # the last evaluation record of a run's log.jsonl (with the minutes its training took), or None
    # if it has none yet
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        return None
    records = [json.loads(line) for line in open(path)]
    evals = [r for r in records if "eval" in r]
    if not evals:
        return None
    return {**evals[-1],
            "minutes": max([r["minutes"] for r in records if "minutes" in r], default=None)}


def table(picked, cfg, walls):
    # one row per seed: passkey, the search's leaf share (data.key_placement) and LM ratio at every
    # evaluated length; then worst / median / best per column
    rows = {s: final_eval(os.path.join(cfg["out"], f"seed{s}")) for s in picked}
    done = {s: r for s, r in rows.items() if r is not None}
    if not done:
        raise SystemExit(f"--out={cfg['out']}: no run there has a final evaluation yet")
    keys = [k for k in next(iter(done.values()))["eval"]
            if k.startswith(("passkey@", "leaf@", "ppl_ratio@"))]
    print(f"\n{len(done)} of {len(picked)} seeds ({cfg['threads']} thread(s) each); "
          f"final evaluation at iteration "
          f"{', '.join(sorted({str(r['iter']) for r in done.values()}))}")
    print("| seed | " + " | ".join(keys) + " | wall (training) |\n|---|" + "---|" * (len(keys) + 1))
    for s, r in done.items():
        wall = (f"{walls[s] / 60:.1f} min " if s in walls else "") + \
            (f"({r['minutes']:.1f} min)" if r["minutes"] is not None else "")
        print(f"| {s} | " + " | ".join(fmt(k, r["eval"].get(k)) for k in keys) + f" | {wall} |")
    for name, pick in (("worst", worst), ("median", lambda k, v: statistics.median(v)),
                       ("best", best)):
        print(f"| {name} | "
              + " | ".join(fmt(k, pick(k, [r["eval"][k] for r in done.values() if k in r["eval"]]))
                           for k in keys) + " | |")
    missing = [s for s in picked if s not in done]
    if missing:
        print(f"no final evaluation yet for seeds {missing}")


def fmt(key, v):
    return "-" if v is None else (f"{100 * v:.1f}%" if key.startswith(("passkey", "leaf"))
                                  else f"{v:.4f}")


def worst(key, values):   # the lowest passkey accuracy (and leaf share), the highest LM ratio
    return min(values) if key.startswith(("passkey", "leaf")) else max(values)


def best(key, values):
    return max(values) if key.startswith(("passkey", "leaf")) else min(values)


def main():
    mine, train_args = (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]) \
        if "--" in sys.argv else (sys.argv[1:], [])
    cfg = parse_overrides(mine, config_of(globals()), __file__)
    check_ranges(cfg, dict(jobs=(1, 64), threads=(1, 1024)))
    picked = parse_seeds(cfg["seeds"])
    if any(a.startswith(("--seed=", "--out_dir=")) for a in train_args):
        raise SystemExit("seeds.py sets train.py's --seed and --out_dir itself; "
                         "pass --seeds and --out to seeds.py")
    walls = {} if cfg["table_only"] else run_all(picked, train_args, cfg)
    table(picked, cfg, walls)


if __name__ == "__main__":
    main()
