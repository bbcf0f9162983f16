"""Benchmark: the doctor's differential on every generated config (the heavy test reads a seeded sample).

    python benchmarks/bench_doctor_differential.py [--examples N] [--no-cache]

The configs tests/doctor_configs.py generates (hypothesis, derandomized: the same every run), every distinct one
through every column -- this build, stock 0.20.1, upstream 0.33.0 and 0.34.0, the reference, each its own code in
its own environment (doctor/sides.py) -- and this build held against upstream 0.34.0 and the reference
(tests/doctor_differential.py). Prints the figures: configs, columns, compared pairs, disagreements per named
deviation, the unexplained ones, the doctor's exit codes, the input classes, the wall time, the load average. Answers
are cached by digest like the doctor's (--no-cache: every column computes every config again). Never fails on time;
exits 1 when a disagreement is unexplained.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    import doctor_differential as DD

    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns, server_idle
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.series import read_queues

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=300)
    ap.add_argument("--no-cache", action="store_true")
    args = ap.parse_args()
    pairs = DD.generated(args.examples)
    manifest = load_manifest(REPO)
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    started = time.monotonic()
    cols = columns(manifest, queues)
    print(f"columns ready in {time.monotonic() - started:.0f} s", flush=True)
    with Sides(cols, cache=not args.no_cache, idle=max(server_idle(), 600.0)) as sides:
        fig = DD.run(Doctor(sides), DD.distinct(pairs), len(pairs))
    print(fig.line())
    print("input classes: " + ", ".join(f"{k} {v}" for k, v in sorted(fig.classes.items())))
    for line in fig.unexplained:
        print(f"unexplained: {line}")
    print(f"wall {time.monotonic() - started:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 1 if fig.unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
