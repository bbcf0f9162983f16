"""Benchmark: the whole miniature run, `vllm-dflash validate --profile mini-cpu`, warm and cold, on this machine.

    python benchmarks/bench_mini_validate.py            # warm: the cache as it is (run it once before to warm it)
    python benchmarks/bench_mini_validate.py --cold     # cold: a fresh, empty cache (downloads, side environments,
                                                        # both CPU builds, the training, the reference loop)

Prints the wall time of the whole command, its phases (from the report's timings: the validated server, the stock
server, the reference loop), the three acceptance lengths and the load average (on a shared 2-core machine,
contention moves the figures a lot). Writes dist/bench-mini-validate-<warm|cold>.json. Never fails on time; exits
with the command's status.
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

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="run with a fresh, empty VLLM_DFLASH_CACHE")
    args = ap.parse_args()
    kind = "cold" if args.cold else "warm"
    with tempfile.TemporaryDirectory(prefix=f"bench-mini-{kind}.") as td:
        env = dict(os.environ)
        if args.cold:
            env["VLLM_DFLASH_CACHE"] = str(Path(td) / "cache")
        report = Path(td) / "report.json"
        cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "validate", "--profile", "mini-cpu"]
        cmd += ["--report", str(report), "--quiet"]
        print("+ " + " ".join(cmd), flush=True)
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env, check=False).returncode
        wall = time.perf_counter() - t0
        data = json.loads(report.read_text()) if report.is_file() else {}
    timings = data.get("timings") or {}
    comp = (data.get("comparisons") or {}).get("stock") or {}
    result = {
        "kind": kind,
        "exit_code": rc,
        "wall_s": round(wall, 1),
        "load_average_start": round(load0, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
        "phases_s": {k: round(v, 1) for k, v in timings.items() if isinstance(v, int | float)},
        "al": {
            "stock": (comp.get("acceptance") or {}).get("mean_acceptance_length"),
            "ours": (data.get("acceptance") or {}).get("mean_acceptance_length"),
            "reference": (data.get("reference") or {}).get("acceptance_length"),
        },
    }
    print(json.dumps(result, indent=2))
    print(f"whole mini run ({kind} cache): {wall:.0f} s; exit {rc}")
    out = REPO / "dist" / f"bench-mini-validate-{kind}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
