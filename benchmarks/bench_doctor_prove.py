"""Benchmark: `vllm-dflash doctor <checkpoint> --prove` per shipped checkpoint, against the 3-minute goal.

    python benchmarks/bench_doctor_prove.py                 # every determined shipped checkpoint 0.20.1 can run
    python benchmarks/bench_doctor_prove.py KEY [KEY ...]   # shipped checkpoints by file stem (doctor/checkpoints/)

Each run is the real command (two vLLM starts, one oracle process) on the entry read as the table reads it (its
first completion of what no public source gives). The suite proves two shapes (tests/test_doctor.py: the public
Qwen3.6-27B-DFlash shape and a drafter whose sliding layers come from max_window_layers) and the wrong-shape
negative control; the other shipped shapes (all-full Qwen3.5 drafters, the 122B drafters' 6 and 8 target layers of
48) are proven here. Prints per checkpoint the wall time, the exit code (20 = stock mis-serves it, as the table
says), the claims line and the ratio to the goal, and the load average (a shared 2-core machine moves the figures a
lot). Never fails on time; exits 1 when a run's exit code is not the one the doctor's offline verdict gives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 180.0
REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = REPO / "vllm_dflash" / "doctor" / "checkpoints"
DEFAULT = (
    "z-lab--Qwen3.5-27B-DFlash",
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-04",
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-06",
    "z-lab--gemma-4-31B-it-DFlash",
)


def _doctor(path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "doctor", str(path), *extra]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return res, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("keys", nargs="*", default=list(DEFAULT), help="checkpoint file stems under doctor/checkpoints/")
    args = ap.parse_args()
    ok = True
    for key in args.keys:
        path = CHECKPOINTS / f"{key}.json"
        with tempfile.TemporaryDirectory() as td:
            plain, _ = _doctor(path, "--json", str(Path(td) / "d.json"))
        load0 = os.getloadavg()[0]
        res, wall = _doctor(path, "--prove")
        line = next((x for x in res.stdout.splitlines() if "claims as predicted" in x), "")
        as_table = res.returncode == plain.returncode
        ok = ok and as_table
        print(res.stdout[-2500:])
        print(
            f"{key}: --prove {wall:.0f} s (goal {GOAL_S:.0f} s, ratio {wall / GOAL_S:.2f}), exit {res.returncode} "
            f"({'as' if as_table else 'NOT as'} the offline verdict's {plain.returncode}); load average "
            f"{load0:.1f} -> {os.getloadavg()[0]:.1f}; {line.strip() or 'no claims line'}",
            flush=True,
        )
        print(json.dumps({"checkpoint": key, "wall_s": round(wall, 1), "exit": res.returncode}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
