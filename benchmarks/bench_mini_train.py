"""Benchmark: train the DFlash miniature from scratch and measure the reference loop's acceptance length.

    python benchmarks/bench_mini_train.py [--prompts N] [--skip-determinism] [--models DIR] [--no-literal]

1. gets the cached models (`ensure_mini_models`: trains target + drafter in the dflash reference env on a cache
   miss); the phase times are the ones mini.json recorded when they were trained (the machine's load average is
   printed too: on a shared 2-core machine, contention moves the figures a lot);
2. unless --skip-determinism, trains a second time into a temp dir and compares every written file byte for byte;
3. runs the reference's own dflash_generate loop (vllm_dflash.mini.refloop) on the held-apart prompts with the
   reference semantics and each emulated vLLM 0.20.1 semantics, and prints pooled (vLLM-style) and per-prompt AL.
   The emulated full attention sees the whole context (the drafter gets a full cache for every layer; the
   reference's own cache would keep only the last W - 1 tokens of a sliding layer; tests/test_mini.py checks it).
`--models DIR` skips training and measures an existing model directory; `--no-literal` skips the second,
authors'-benchmark-style run of each prompt (half the time). Writes dist/bench-mini.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dflash.envs import reference_python
from vllm_dflash.manifest import load_manifest
from vllm_dflash.mini import host

REPO = Path(__file__).resolve().parents[1]


def _train(ref: Path, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    job = json.dumps({"out": str(out)})
    subprocess.run([str(ref), "-m", "vllm_dflash.mini.train", job], env=env, check=True)
    return time.perf_counter() - t0


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "mini.json"
    }


def _table(result: dict[str, Any]) -> list[str]:
    modes = result["modes"]
    base = modes["reference"]["pooled"]["acceptance_length"]
    pairs = result.get("pairs_vs_reference", {})
    lines = [
        f"{'semantics':15s} {'pooled AL':>9s} {'vs ref':>7s} {'drafts':>6s} {'accepted':>8s}  "
        f"{'per-prompt AL q1/median/q3 (min-max)':38s} {'pairs lower/equal/higher':>24s} {'literal':>7s} lossless"
    ]
    for name, e in modes.items():
        p, s = e["pooled"], e["per_prompt_al"]
        pair = pairs.get(name)
        pair_s = f"{pair['lower']}/{pair['equal']}/{pair['higher']}" if pair else "-"
        lit = e.get("literal", {}).get("mean_of_request_means")
        lines.append(
            f"{name:15s} {p['acceptance_length']:9.3f} {100 * (p['acceptance_length'] / base - 1):+6.1f}% "
            f"{p['num_drafts']:6d} {p['num_accepted_tokens']:8d}  "
            f"{s['q1']:5.2f}/{s['median']:5.2f}/{s['q3']:5.2f} ({s['min']:.2f}-{s['max']:.2f}){'':12s} "
            f"{pair_s:>24s} {lit if lit is None else round(lit, 3)!s:>7s} {e['lossless']}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=None, help="first N held-apart prompts (default: all)")
    ap.add_argument("--skip-determinism", action="store_true", help="train once only")
    ap.add_argument("--models", type=Path, default=None, help="measure this model directory; no training")
    ap.add_argument("--no-literal", action="store_true", help="skip the authors'-benchmark-style second run")
    args = ap.parse_args()
    ref = reference_python(load_manifest(REPO))
    report: dict[str, Any] = {"load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-mini-") as tmp:
        models = args.models
        if models is None:
            t0 = time.perf_counter()
            models = host.ensure_mini_models(ref)
            report["models"] = str(models)
            report["ensure_wall_s"] = time.perf_counter() - t0  # ~0 on a cache hit
            report["load_average_after_train"] = os.getloadavg()
            if not args.skip_determinism:
                report["train2_wall_s"] = _train(ref, Path(tmp) / "b")
                a, b = _digests(models), _digests(Path(tmp) / "b")
                report["deterministic"] = a == b
                report["differing_files"] = sorted(k for k in a if a.get(k) != b.get(k))
        meta = host.model_config(models)
        report["figures"] = {k: v for k, v in meta["figures"].items() if not k.endswith("_log")}
        report["parameters"] = meta["parameters"]
        report["checkpoint_bytes"] = {k: v["bytes"] for k, v in meta["files"].items()}
        t0 = time.perf_counter()
        result = host.run_refloop(
            ref, models, Path(tmp) / "refloop.json", prompts=args.prompts, literal=not args.no_literal
        )
        report["refloop_wall_s"] = time.perf_counter() - t0
    report["refloop"] = {
        k: v if k != "modes" else {m: {kk: vv for kk, vv in e.items() if kk != "rows"} for m, e in v.items()}
        for k, v in result.items()
    }
    f = report["figures"]
    print()
    print(
        f"training: target {f['target_s']} s, drafter data {f['drafter_data_s']} s, drafter {f['drafter_s']} s, "
        f"prompt selection {f.get('prompt_selection_s')} s "
        f"(load average now {report['load_average_start'][0]:.1f})"
    )
    if "deterministic" in report:
        print(
            f"determinism: a second training ({report['train2_wall_s']:.0f} s wall) gives identical files: "
            f"{report['deterministic']} {report['differing_files'] or ''}"
        )
    print(f"parameters: {report['parameters']}; checkpoints (fp32): {report['checkpoint_bytes']}")
    print(f"{result['prompts']} prompts, max_tokens {result['max_tokens']}, k = {result['num_speculative_tokens']}")
    print("\n".join(_table(result)))
    out = REPO / "dist" / "bench-mini.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
