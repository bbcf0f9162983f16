"""Benchmark: what keeping the last matched prefix block (patch 0006, X-Fixes prefix-block) changes on the serving
miniature -- prefill tokens computed and acceptance length, with and without the fix, side by side.

    python benchmarks/bench_prefix_block.py                  # the default pin (0.20.1), profile mini-cpu-serving
    python benchmarks/bench_prefix_block.py --pin 0.25.1     # another pin's queue
    python benchmarks/bench_prefix_block.py --profile mini-cpu-serving --prompts 16

"With" is the pin's own build; "without" is the same queue without the patch that fixes prefix-block (and without
any later patch that then no longer applies), built like the pin's build into a scratch directory
(vllm_dflash/upstream/ablation.py). Both serve the profile through `vllm-dflash validate --wheel ...` (the same
trained miniature, prompts sent twice so the second round hits the prefix cache; the stock build and the reference
loop run beside each, as the profile says). Prefill tokens computed = prompt tokens the prefix cache was asked for
minus the tokens it found (`vllm:prefix_cache_queries` - `vllm:prefix_cache_hits`, read from /metrics before and
after the run). Writes dist/bench-prefix-block-<pin>.json. Never fails on time; exits 0 when both runs measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _validate(profile: str, pin: str, report: Path, extra: list[str]) -> tuple[dict[str, Any], float, int]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "validate", "--profile", profile, "--pin", pin]
    cmd += ["--no-baseline", "--report", str(report), "--quiet", *extra]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, check=False)
    wall = time.perf_counter() - t0
    data = json.loads(report.read_text()) if report.is_file() else {}
    return data, wall, res.returncode


def _row(name: str, counters: dict[str, Any], acceptance: dict[str, Any], lossless: dict[str, Any]) -> dict[str, Any]:
    queries = float(counters.get("prefix_cache_queries") or 0)
    hits = float(counters.get("prefix_cache_hits") or 0)
    matches = int(lossless.get("matches") or 0)
    return {
        "build": name,
        "acceptance_length": acceptance.get("mean_acceptance_length"),
        "drafts": counters.get("num_drafts"),
        "draft_tokens": counters.get("num_draft_tokens"),  # / drafts < k: drafts cut by the token budget
        "accepted": counters.get("num_accepted_tokens"),
        "prompt_tokens_looked_up": queries,
        "prefix_cache_hits": hits,
        "prefill_tokens_computed": queries - hits,
        "lossless": f"{matches}/{matches + len(lossless.get('mismatches') or [])}",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin", default=None, help="which pin's queue (default: the default pin)")
    ap.add_argument("--profile", default="mini-cpu-serving", help="a serving miniature profile with prefix caching")
    ap.add_argument("--prompts", type=int, default=None, help="--num-prompts for both runs (exploratory)")
    args = ap.parse_args()

    from vllm_dflash.conformance import cases as C
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.pipeline.build import scratch_build
    from vllm_dflash.series import read_queues
    from vllm_dflash.upstream.ablation import without
    from vllm_dflash.upstream.proof import patch_fixes

    manifest = load_manifest(REPO)
    view = manifest.for_pin(args.pin)
    pin = view.pin_name
    queues = read_queues(view.series_path, view.cpu_series_path)
    fix = next((p for p in queues.dflash if C.FIX_PREFIX_BLOCK in patch_fixes(p)), None)
    if fix is None:
        print(f"error: the vLLM {pin} queue has no patch that fixes {C.FIX_PREFIX_BLOCK}", file=sys.stderr)
        return 2
    extra = ["--num-prompts", str(args.prompts)] if args.prompts else []
    out: dict[str, Any] = {"pin": pin, "profile": args.profile, "patch": fix.name, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-block.") as td:
        tmp = Path(td)
        ablated, dropped = without(view, queues, fix)
        print(f"building vLLM {pin} without {fix.name}" + (f" (and {', '.join(dropped)})" if dropped else ""))
        wheel = scratch_build(view, ablated, "cpu", "dflash", tmp / "wheel")
        rows: list[dict[str, Any]] = []
        for name, wheel_args in (("with", []), ("without", ["--wheel", str(wheel)])):
            data, wall, rc = _validate(args.profile, pin, tmp / f"{name}.json", [*wheel_args, *extra])
            counters = (data.get("counters") or {}).get("delta") or {}
            row = _row(f"ours, {name} {fix.name[:4]}", counters, data.get("acceptance") or {},
                       data.get("lossless_vs_reference") or {})  # fmt: skip
            row.update(exit_code=rc, wall_s=round(wall, 1))
            rows.append(row)
            stock = (data.get("comparisons") or {}).get("stock") or {}
            if name == "with" and stock:
                rows.append(_row("stock", stock.get("counters") or {}, stock.get("acceptance") or {},
                                 stock.get("lossless_vs_reference") or {}))  # fmt: skip
            ref = data.get("reference") or {}
            if name == "with" and ref:
                rows.append({"build": "reference loop", "acceptance_length": ref.get("acceptance_length")})
        out["runs"] = rows
        out["dropped"] = list(dropped)
        out["load_average"] = round(os.getloadavg()[0], 2)
        shutil.rmtree(tmp / "wheel", ignore_errors=True)
    print(f"\nvLLM {pin}, {args.profile}: the patch {fix.name} kept or left out")
    head = ["build", "AL", "drafts", "accepted", "prompt tokens looked up", "prefix hits", "prefill computed"]
    head.append("lossless")
    print("| " + " | ".join(head) + " |\n| " + " | ".join("---" for _ in head) + " |")
    for r in out["runs"]:
        vals = [r.get(k) for k in ("acceptance_length", "drafts", "accepted", "prompt_tokens_looked_up",
                                   "prefix_cache_hits", "prefill_tokens_computed")]  # fmt: skip
        cells = ["-" if v is None else f"{v:.3f}" if isinstance(v, float) and v % 1 else f"{v:.0f}" for v in vals]
        print(f"| {r['build']} | " + " | ".join(cells) + f" | {r.get('lossless', '-')} |")
    dest = REPO / "dist" / f"bench-prefix-block-{pin}.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(out, indent=1))
    print(f"written: {dest}")
    measured = [r for r in out["runs"] if r["build"].startswith("ours")]
    return 0 if len(measured) == 2 and all(r["acceptance_length"] is not None for r in measured) else 1


if __name__ == "__main__":
    raise SystemExit(main())
