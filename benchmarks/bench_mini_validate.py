"""Benchmark: whole miniature runs, `vllm-dflash validate --profile <mini profile>`, warm and cold, on this machine.

    python benchmarks/bench_mini_validate.py                       # mini-cpu, the cache as it is (warm)
    python benchmarks/bench_mini_validate.py --cold                # a fresh, empty cache (downloads, side
                                                                   # environments, both CPU builds, the training,
                                                                   # the reference loop)
    python benchmarks/bench_mini_validate.py --profile mini-cpu-serving --profile mini-cpu-serving-tp2 --swap
    python benchmarks/bench_mini_validate.py --pin 0.23.0         # another pin's builds (stock / ours / reference)

Per profile: the wall time of the whole command, its phases (from the report's timings: the validated server, the
stock server, the no-speculation run, the reference loop), the acceptance lengths (stock / ours / reference loop),
the lossless counts, prefix-cache hits, output tokens/s of ours against no speculation, and the load average (on a
shared 2-core machine, contention moves the figures a lot). `--swap` runs each profile a second time with the stock
wheel as the validated one (it must exit 1). Writes dist/bench-mini-validate-<warm|cold>.json. Never fails on time;
exits 0 when every run exited as expected (ours 0, swapped 1), else 1.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _run(profile: str, env: dict[str, str], td: Path, tag: str, *extra: str) -> tuple[dict[str, Any], str]:
    report = td / f"{tag}.json"
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "validate", "--profile", profile]
    cmd += ["--report", str(report), "--quiet", *extra]
    print("+ " + " ".join(cmd), flush=True)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr[-3000:])
    data = json.loads(report.read_text()) if report.is_file() else {}
    timings = data.get("timings") or {}
    comp = (data.get("comparisons") or {}).get("stock") or {}
    base = data.get("baseline") or {}
    n = (data.get("prompts") or {}).get("count")
    result = {
        "profile": profile,
        "run": tag,
        "exit_code": res.returncode,
        "wall_s": round(wall, 1),
        "load_average_start": round(load0, 2),
        "load_average_end": round(os.getloadavg()[0], 2),
        "phases_s": {k: round(v, 1) for k, v in timings.items() if isinstance(v, int | float)},
        "requests": n,
        "al": {
            "stock": (comp.get("acceptance") or {}).get("mean_acceptance_length"),
            "ours": (data.get("acceptance") or {}).get("mean_acceptance_length"),
            "reference": (data.get("reference") or {}).get("acceptance_length"),
        },
        "lossless": {
            "stock": (comp.get("lossless_vs_reference") or {}).get("matches"),
            "ours": (data.get("lossless_vs_reference") or {}).get("matches"),
            "mismatches": (data.get("lossless_vs_reference") or {}).get("mismatches"),
        },
        "prefix_cache_hits": {
            "stock": (comp.get("counters") or {}).get("prefix_cache_hits"),
            "ours": ((data.get("counters") or {}).get("delta") or {}).get("prefix_cache_hits"),
        },
        "tokens_per_s": {
            "stock": (comp.get("throughput") or {}).get("tokens_per_s"),
            "ours": (data.get("throughput") or {}).get("tokens_per_s"),
            "no_speculation": base.get("tokens_per_s"),
            "ours_vs_no_speculation": base.get("speedup"),
        },
        "gates": {g["gate"]: g["passed"] for g in data.get("gates") or []},
        "verdict": data.get("verdict"),
    }
    # A run with the stock wheel as the validated one has no stock comparison (its report says "comparisons": null).
    return result, str(((comp.get("server") or {}).get("artifact") or {}).get("name") or "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cold", action="store_true", help="run with a fresh, empty VLLM_DFLASH_CACHE")
    ap.add_argument("--profile", action="append", default=None, help="a cpu-builds profile (repeatable)")
    ap.add_argument("--swap", action="store_true", help="also validate the stock wheel (must exit 1)")
    ap.add_argument("--pin", default=None, help="serve this pin's CPU builds (default: the default pin)")
    args = ap.parse_args()
    pin = ("--pin", args.pin) if args.pin else ()
    kind = "cold" if args.cold else "warm"
    profiles = args.profile or ["mini-cpu"]
    results: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory(prefix=f"bench-mini-{kind}.") as tmp:
        td = Path(tmp)
        env = dict(os.environ)
        if args.cold:
            env["VLLM_DFLASH_CACHE"] = str(td / "cache")
        cache = Path(env.get("VLLM_DFLASH_CACHE") or Path.home() / ".cache" / "vllm-dflash")
        for profile in profiles:
            res, stock_name = _run(profile, env, td, profile, *pin)
            results.append(res)
            ok = ok and res["exit_code"] == 0
            print(f"{profile}: {res['wall_s']:.0f} s, exit {res['exit_code']}, AL {res['al']}", flush=True)
            if args.swap and stock_name:
                built = cache / "builds" / "wheels"  # where pipeline.build.cached_build puts every CPU build
                wheel = next(built.glob(f"*/{stock_name}"), None)
                if wheel is None:
                    print(f"no stock wheel {stock_name} under {built}", file=sys.stderr)
                    ok = False
                    continue
                swapped, _ = _run(profile, env, td, f"{profile}-stock-wheel", "--wheel", str(wheel), *pin)
                results.append(swapped)
                ok = ok and swapped["exit_code"] == 1
                print(f"{profile} with the stock wheel: {swapped['wall_s']:.0f} s, exit {swapped['exit_code']}")
    print(json.dumps(results, indent=2))
    for r in results:
        print(f"{r['profile']} ({r['run']}, {kind} cache): {r['wall_s']:.0f} s; exit {r['exit_code']}")
    out = REPO / "dist" / f"bench-mini-validate-{kind}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
