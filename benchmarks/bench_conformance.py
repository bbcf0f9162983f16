"""Benchmark: a whole WARM `vllm-dflash conformance` run (both builds, every case) against the 5-minute goal.

    python benchmarks/bench_conformance.py [--skip-warmup] [--device cpu] [--old-vs-new] [conformance args...]
    python benchmarks/bench_conformance.py --cold [conformance args...]
    python benchmarks/bench_conformance.py --executors [--cases CASE ...]

Default: runs the command once to warm every cache (reference env, tiny cases, patched wheel, vLLM envs) unless
--skip-warmup, then times a second run and prints the wall time, the ratio to the goal (<= 1.0 meets it) and where the
time went (vLLM init / generate and oracle seconds per build and case, from the run's traces and metrics), with the
cases that existed before the serving-condition cases, the serving cases and the eviction cases (evict-*, with their
full-kv control) summed separately. --old-vs-new also times a warm run of the old cases alone, so the old and the new
total stand side by side; --evict-cost a warm run of every case but the eviction ones: what those cost a run.

--cold: one run with a fresh, empty VLLM_DFLASH_CACHE (and pip cache): the downloads, the reference and vLLM side
environments, both CPU builds and the tiny models are all made inside the timed run; then a second, warm run in the
same cache. Prints both wall times.

--executors: the CPU executor choice, measured. Runs the patched build on the given cases (default: mixed, batched)
with the in-process worker (`uni`, UniProcExecutor; `uni-1t`, the same with one OpenMP thread) and with vLLM's engine
and worker processes (`mp`, OMP threads bound), and prints vLLM init and generate seconds per case side by side.

--bf16-drift: the reference drafter run in bf16 against itself in fp32 on the bf16 case (runnable on any CPU).

--bf16-vllm N: vLLM's own bf16 run on this CPU (it needs avx512_bf16), the measurement behind cases.CPU_BF16_TOLERANCE:
the bf16 case with N seeds, both builds, through the conformance run; prints per seed how far vLLM's bf16 drafter
logits are from the fp32 oracle of the same semantics (the patched build vs the oracle, stock vs the stock-semantics
oracle: two measurements of the same rounding), the most any entry gained on the top one (what can flip a top-2 gap),
how far the negative controls are, the generated tokens' largest fp32 deficit, and the tolerance's margins.

Never fails on time; exits with the run's status.
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

GOAL_S = 300.0
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_dflash.conformance import cases as C  # noqa: E402
from vllm_dflash.conformance.vllm_side import EXECUTORS  # noqa: E402

OLD_CASES = tuple(c.name for c in C.CASES if not c.is_serving)
EVICT_CASES = tuple(c.name for c in C.CASES if c.evict)


def _run(extra: list[str], report: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "conformance", "--report", str(report), *extra]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, check=False, env=env).returncode
    return rc, time.perf_counter() - t0


def _costs(work: Path | None) -> dict[tuple[str, str], dict[str, float]]:
    """(build, case) -> vLLM init / generate and oracle seconds, from one run's traces and metrics."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for trace in sorted(work.glob("*/*.jsonl")) if work else []:
        lines = trace.read_text().strip().splitlines()
        summary = json.loads(lines[-1]).get("summary", {}) if lines else {}
        row = {"init": float(summary.get("init_s", 0.0)), "generate": float(summary.get("generate_s", 0.0))}
        metrics = trace.with_name(trace.stem + ".metrics.json")
        if metrics.is_file():
            row["oracle"] = float(json.loads(metrics.read_text()).get("elapsed_s", 0.0))
        row["executor"] = summary.get("executor", "-")
        out[(trace.parent.name, trace.stem)] = row
    return out


def _work_dir(report: Path) -> Path | None:
    try:
        work = json.loads(report.read_text()).get("work_dir")
    except (OSError, json.JSONDecodeError):
        return None
    return Path(work) if work else None


def _breakdown(report: Path) -> list[str]:
    costs = _costs(_work_dir(report))
    lines = []
    sums = {"old": 0.0, "serving": 0.0, "evict": 0.0}
    for (build, case), row in costs.items():
        total = row["init"] + row["generate"] + row.get("oracle", 0.0)
        sums["old" if case in OLD_CASES else "evict" if case in EVICT_CASES else "serving"] += total
        lines.append(
            f"  {build:8s} {case:16s} vLLM init {row['init']:6.1f} s, generate {row['generate']:6.1f} s, "
            f"oracle {row.get('oracle', 0.0):6.1f} s ({row['executor']})"
        )
    lines.append(
        f"  per-case seconds summed: old cases {sums['old']:.1f} s, serving cases {sums['serving']:.1f} s, "
        f"eviction cases (all builds) {sums['evict']:.1f} s "
        "(the rest of the wall time: process start-up, imports, environment checks)"
    )
    return lines


def _executors(cases: list[str]) -> int:
    from vllm_dflash.conformance.compare import ConformanceOptions, run_conformance
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.series import read_queues

    manifest = load_manifest(REPO)
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    rows: dict[str, dict[str, dict[str, float]]] = {}
    walls: dict[str, float] = {}
    ok = True
    for executor in EXECUTORS:
        print(f"+ conformance --build patched --cases {' '.join(cases)} (executor {executor})", flush=True)
        t0 = time.perf_counter()
        result = run_conformance(
            manifest,
            queues,
            ConformanceOptions(
                builds=("patched",),
                cases=tuple(cases),
                executor=executor,
                report=REPO / "dist" / f"bench-conformance-{executor}.json",
            ),
        )
        walls[executor] = time.perf_counter() - t0
        ok = ok and result.ok
        rows[executor] = {case: row for (_, case), row in _costs(result.work_dir).items()}
    print("\n" + f"{'case':16s}" + "".join(f" {e + ' init':>11s} {e + ' gen':>10s}" for e in EXECUTORS))
    for case in cases:
        cells = "".join(
            f" {rows[e].get(case, {}).get('init', 0):11.1f} {rows[e].get(case, {}).get('generate', 0):10.1f}"
            for e in EXECUTORS
        )
        print(f"{case:16s}{cells}")
    print("wall (patched build only, incl. oracle): " + ", ".join(f"{e} {walls[e]:.1f} s" for e in EXECUTORS))
    return 0 if ok else 1


def _bf16_drift() -> int:
    """The reference drafter in bf16 vs fp32 on the bf16 case: the measurement behind cases.CPU_BF16_TOLERANCE."""
    import tempfile

    from vllm_dflash.conformance import compare
    from vllm_dflash.envs import reference_python
    from vllm_dflash.manifest import load_manifest

    manifest = load_manifest(REPO)
    ref = reference_python(manifest)
    spec = C.get_cases(["bf16"])[0]
    case = compare.ensure_cases(manifest, ref, [spec])[spec.name]
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "drift.json"
        job = json.dumps({"bf16_drift": [[str(case), str(out)]]})
        cmd = [str(ref), "-m", "vllm_dflash.conformance.oracle", job]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        d = json.loads(out.read_text())
    tol = C.CPU_BF16_TOLERANCE
    print(
        f"reference drafter bf16 vs fp32 on {d['case']}: max |dlogit| {d['max_abs']:.3g}, argmax {d['agree']}/"
        f"{d['total']} ({d['decided_agree']}/{d['decided_total']} where the top-2 gap > 0.1), target greedy equal "
        f"on {d['greedy_equal']}/{d['prompts']} prompts"
    )
    print(
        f"tolerance: max |dlogit| {tol.max_abs_logit:g} = {tol.max_abs_logit / max(d['max_abs'], 1e-9):.1f}x the "
        f"measured drift; argmax compared where the gap > {tol.tie_margin:g}"
    )
    return 0


def _bf16_vllm(seeds: int) -> int:
    """vLLM bf16 vs the fp32 oracle over `seeds` variants of the bf16 case (see the module docstring)."""
    import dataclasses

    from vllm_dflash.conformance.compare import ConformanceOptions, run_conformance
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.series import read_queues

    base = C.get_cases(["bf16"])[0]
    if C.skip_reason(base, "cpu"):
        print(f"cannot measure here: {C.skip_reason(base, 'cpu')}")
        return 2
    manifest = load_manifest(REPO)
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    specs = tuple(dataclasses.replace(base, name=f"bf16-seed{base.seed + i}", seed=base.seed + i) for i in range(seeds))
    print(f"+ conformance on {', '.join(s.name for s in specs)} (both builds)", flush=True)
    result = run_conformance(
        manifest,
        queues,
        ConformanceOptions(extra_cases=specs, report=REPO / "dist" / "bench-conformance-bf16.json"),
    )
    assert result.work_dir is not None
    tol = C.CPU_BF16_TOLERANCE
    rows = []
    print(f"\n{'case':14s} {'build':7s} {'max|d|':>7s} {'flip':>6s} {'neg min':>7s} {'decided':>8s} {'deficit':>8s}")
    for spec in specs:
        for build, semantics in (("patched", None), ("stock", C.STOCK_MODEL)):
            path = result.work_dir / build / f"{spec.name}.metrics.json"
            if not path.is_file():
                print(f"{spec.name:14s} {build:7s} (no metrics: see the run above)")
                continue
            m = json.loads(path.read_text())
            same = m["variants"][semantics] if semantics else m["main"]
            negs = [v["max_abs"] for n, v in m["variants"].items() if n != C.STOCK_MODEL and build == "patched"]
            rows.append((build, same["max_abs"], same.get("max_flip", 0.0), min(negs, default=None)))
            print(
                f"{spec.name:14s} {build:7s} {same['max_abs']:7.3f} {same.get('max_flip', 0.0):6.3f} "
                f"{min(negs) if negs else float('nan'):7.3f} {m['main']['argmax_total']:4d}/{m['positions']:<3d} "
                f"{m.get('lossless_max_deficit', 0.0):8.3f}"
            )
    patched = [r for r in rows if r[0] == "patched"]
    drift, flip = max(r[1] for r in patched), max(r[2] for r in patched)
    neg = min(r[3] for r in patched if r[3] is not None)
    stock = [r[1] for r in rows if r[0] == "stock"]
    deficit = max(
        json.loads(p.read_text()).get("lossless_max_deficit", 0.0) for p in result.work_dir.glob("*/*.metrics.json")
    )
    print(
        f"\npatched vLLM bf16 vs the fp32 oracle, {len(patched)} seeds: max |dlogit| {drift:.3f}, largest flip "
        f"{flip:.3f}, negative controls >= {neg:.3f}; generated tokens' fp32 deficit <= {deficit:.3f} (both builds); "
        f"stock vs an oracle of its own semantics: max |dlogit| {min(stock, default=0):.3f}-{max(stock, default=0):.3f}"
    )
    print(
        f"tolerance: max |dlogit| {tol.max_abs_logit:g} = {tol.max_abs_logit / drift:.2f}x the drift; negative_min "
        f"{tol.negative_min:g} = {neg / tol.negative_min:.2f}x below the nearest control; argmax compared where "
        f"the gap > {tol.tie_margin:g}{' and > 2x the position own max |dlogit|' if tol.decide_by_drift else ''} "
        f"(largest flip {flip:.3f}), on >= {tol.min_argmax_positions} positions; lossless margin "
        f"{tol.lossless_margin:g} = {tol.lossless_margin / max(deficit, 1e-9):.2f}x the largest deficit"
    )
    return result.exit_code


def _cold(extra: list[str], report: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-conformance-cold.", dir="/var/tmp") as td:
        env = {**os.environ, "VLLM_DFLASH_CACHE": str(Path(td) / "cache"), "PIP_CACHE_DIR": str(Path(td) / "pip")}
        rc_cold, cold = _run(extra, report, env)
        print(f"\ncold conformance run (empty cache): {cold:.1f} s (exit {rc_cold})", flush=True)
        rc_warm, warm = _run(extra, report, env)
    print(f"warm conformance run (same cache): {warm:.1f} s (exit {rc_warm})")
    print(f"cold/warm = {cold / warm:.1f}; warm/goal = {warm / GOAL_S:.2f} (goal <= {GOAL_S:.0f} s warm)")
    return rc_cold or rc_warm


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--skip-warmup", action="store_true", help="caches are known to be warm: time the first run")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cold", action="store_true", help="time a run from an empty cache, then a warm one")
    ap.add_argument("--old-vs-new", action="store_true", help="also time a warm run of the old cases alone")
    ap.add_argument("--evict-cost", action="store_true", help="also time a warm run without the eviction cases")
    ap.add_argument("--executors", action="store_true", help="compare the uni and mp CPU executors")
    ap.add_argument("--bf16-drift", action="store_true", help="measure the reference drafter's bf16 vs fp32 drift")
    ap.add_argument("--bf16-vllm", type=int, metavar="N", help="measure vLLM's own bf16 run on N seeds of the case")
    args, extra = ap.parse_known_args()
    if args.bf16_drift:
        return _bf16_drift()
    if args.bf16_vllm:
        return _bf16_vllm(args.bf16_vllm)
    if args.executors:
        cases = extra[extra.index("--cases") + 1 :] if "--cases" in extra else ["mixed", "batched"]
        return _executors(cases)
    extra = ["--device", args.device, *extra]
    report = REPO / "dist" / f"bench-conformance-{args.device}.json"
    if args.cold:
        return _cold(extra, report)
    if not args.skip_warmup:
        rc, cold = _run(extra, report)
        print(f"warm-up run: {cold:.1f} s (exit {rc})", flush=True)
    old = without = None
    if args.old_vs_new:
        _, old = _run([*extra, "--cases", *OLD_CASES], REPO / "dist" / f"bench-conformance-{args.device}-old.json")
    if args.evict_cost:
        rest = [c.name for c in C.CASES if not c.evict]
        _, without = _run([*extra, "--cases", *rest], REPO / "dist" / f"bench-conformance-{args.device}-no-evict.json")
    rc, warm = _run(extra, report)
    print(f"\nwarm conformance run: {warm:.1f} s (exit {rc})")
    if old is not None:
        print(f"old cases alone ({len(OLD_CASES)}): {old:.1f} s; all {len(C.CASES)} cases: {warm:.1f} s")
    if without is not None:
        print(
            f"without the {len(EVICT_CASES)} eviction cases: {without:.1f} s; with them: {warm:.1f} s "
            f"(+{warm - without:.1f} s, ratio {warm / without:.2f})"
        )
    verdict = "meets" if warm <= GOAL_S else "MISSES"
    print(f"goal: <= {GOAL_S:.0f} s on 2 cores; ratio warm/goal = {warm / GOAL_S:.2f} ({verdict} the goal)")
    for line in _breakdown(report):
        print(line)
    return rc


if __name__ == "__main__":
    sys.exit(main())
