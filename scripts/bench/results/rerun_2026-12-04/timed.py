"""Run a benchmark script (bench_packing.py or bench_host.py) as its ``__main__`` would, logging each timing as it
is measured and writing it to ``<--out>/timings.json`` at once (the scripts write their own JSON only at the end,
so a run cut by its timeout still leaves these figures).

    python timed.py ROOT/scripts/bench/bench_packing.py --shape qwen3-0.6b --out DIR
    STOP_AFTER=3 python timed.py ...    # bench_packing: stop after P1 tree, P1 plain and P4 padded are timed

The script's own ``sys.path.insert`` of its ROOT decides which ``asyncgrpo_cli`` it imports; this prints it.
Nothing is changed in what is timed: the wrappers call the script's functions unchanged and only record results.
"""
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

path, sys.argv = sys.argv[1], sys.argv[1:]
out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
spec = importlib.util.spec_from_file_location("bench_main", path)
m = importlib.util.module_from_spec(spec)
sys.modules["bench_main"] = m
spec.loader.exec_module(m)
import asyncgrpo_cli  # noqa: E402  (already imported by the script: this only names it)

bp = getattr(m, "bp", m)  # bench_host imports bench_packing as bp
rec = {"script": path, "asyncgrpo_cli": asyncgrpo_cli.__file__, "argv": sys.argv, "timings": [], "losses": []}
print(f"timed: {path} imports asyncgrpo_cli from {asyncgrpo_cli.__file__}", flush=True)
t0 = time.perf_counter()
PACKING_LABELS = ["P1_tree", "P1_plain", "P4_padded", "P2_tree", "P2_plain"]
stop_after = int(os.environ.get("STOP_AFTER", "0"))


class Stop(Exception):
    pass


def dump():
    rec["elapsed_s"] = round(time.perf_counter() - t0, 1)
    (out / "timings.json").write_text(json.dumps(rec, indent=1))


def wrap(name, f):
    def w(*a, **k):
        r = f(*a, **k)
        n = len(rec["timings"])
        label = PACKING_LABELS[n] if name == "time_fn" and n < len(PACKING_LABELS) else f"{name}_{n}"
        if name == "time_row":
            tokens = a[1].num_tokens  # the eager pass times each row first, the compiled pass again
            label = f"time_row_{'compiled' if f'time_row_eager_{tokens}' in [t['label'] for t in rec['timings']] else 'eager'}_{tokens}"
        rec["timings"].append({"label": label, "result": r, "at_s": round(time.perf_counter() - t0, 1)})
        print(f"timed: [{time.perf_counter() - t0:6.1f} s] {label}: {r}", flush=True)
        dump()
        if stop_after and len(rec["timings"]) >= stop_after:
            raise Stop
        return r
    return w


def samples_wrap(f):
    def w(*a, **k):
        samples = f(*a, **k)
        if "trained_tokens" not in rec:  # the first batch: P1's samples (bench_packing)
            rec["trained_tokens"] = sum(s.num_trained_tokens for s in samples)
            rec["sample_tokens"] = sum(s.num_tokens for s in samples)
        return samples
    return w


def step_wrap(f):
    def w(*a, **k):
        fn = f(*a, **k)

        seen = []

        def g():
            r = fn()
            if not seen:  # the first call of each step function: the loss the script checks before timing
                seen.append(1)
                rec["losses"].append(float(r))
            return r
        return g
    return w


for name in ("time_fn", "time_row"):
    if hasattr(m, name):
        setattr(m, name, wrap(name, getattr(m, name)))
if hasattr(m, "make_samples"):
    m.make_samples = samples_wrap(m.make_samples)
if hasattr(m, "packed_step"):
    m.packed_step = step_wrap(m.packed_step)
try:
    rc = m.main()
except Stop:
    rec["stopped_after"] = stop_after
    rc = 0
if hasattr(bp, "run_meta"):
    rec["meta"] = bp.run_meta(sys.argv[sys.argv.index("--shape") + 1] if "--shape" in sys.argv else "?")
dump()
print(f"timed: done in {time.perf_counter() - t0:.1f} s, rc {rc}", flush=True)
sys.exit(rc)
