"""Benchmark: the fast-path wheel step (warm) against a plain copy of the upstream wheel file, in the same run.

    python benchmarks/bench_wheel.py [--repeat N] [--base-wheel PATH|cpu]

The patched tree and the upstream wheel come from the cache (prepared/downloaded on the first run, not timed). The
patch queue is patches/series plus one extra one-line Python commit, so at least one file is really overlaid.
Prints both medians and their ratio; the goal is a wheel step of at most 5 s for the 244 MB CUDA wheel.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import load_manifest
from vllm_dflash.pipeline.model import PatchedTree
from vllm_dflash.pipeline.patches import apply_series
from vllm_dflash.pipeline.source import prepare_source
from vllm_dflash.pipeline.wheel import build_fast_wheel
from vllm_dflash.series import read_queue

GOAL_S = 5.0


def _git(cwd: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "bench",
        "GIT_AUTHOR_EMAIL": "b@l",
        "GIT_COMMITTER_NAME": "bench",
        "GIT_COMMITTER_EMAIL": "b@l",
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base-wheel", default=None, help="a wheel path or 'cpu' (default: the pinned CUDA wheel)")
    ap.add_argument("--root", type=Path, default=None)
    args = ap.parse_args()

    manifest = load_manifest(args.root)
    table = manifest.cpu_wheels if args.base_wheel == "cpu" else manifest.wheels
    if args.base_wheel not in (None, "cpu"):
        base_wheel = Path(args.base_wheel)
    elif platform.machine() in table:
        base_wheel = fetch(table[platform.machine()])
    else:
        print("no upstream wheel pinned for this machine", file=sys.stderr)
        return 1
    source = prepare_source(manifest, "sdist")
    with tempfile.TemporaryDirectory(prefix="bench-wheel.") as td:
        tmp = Path(td)
        # A private clone, so the benchmark's extra commit never lands in the cached tree.
        clone = tmp / "tree"
        _git(tmp, "clone", "-q", "--shared", str(source.path), str(clone))
        _git(clone, "checkout", "-q", "--detach", source.base)
        tree = type(source)(clone, source.kind, source.version, source.commit, source.base)
        patched = apply_series(tree, read_queue(manifest.series_path).patches, "bench")
        target = clone / "vllm/v1/spec_decode/dflash.py"
        target.write_text(target.read_text() + "# benchmark overlay\n")
        _git(clone, "commit", "-qam", "benchmark: one-line change")
        head = _git(clone, "rev-parse", "HEAD").strip()
        patched = PatchedTree(clone, patched.branch, patched.base, head, patched.commits, tree)

        size_mb = base_wheel.stat().st_size / 1e6
        print(f"base wheel {base_wheel.name} ({size_mb:.0f} MB); warming up ...", flush=True)
        build_fast_wheel(manifest, patched, base_wheel, tmp / "warm")
        shutil.copyfile(base_wheel, tmp / "warm-copy.whl")

        fast: list[float] = []
        copy: list[float] = []
        for i in range(args.repeat):
            out = tmp / f"out{i}"
            t0 = time.perf_counter()
            build_fast_wheel(manifest, patched, base_wheel, out)
            fast.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            shutil.copyfile(base_wheel, tmp / f"copy{i}.whl")
            copy.append(time.perf_counter() - t0)
            shutil.rmtree(out)
            (tmp / f"copy{i}.whl").unlink()

    f, c = statistics.median(fast), statistics.median(copy)
    print(f"fast-path wheel step (median of {args.repeat}): {f:.2f} s   runs: {', '.join(f'{x:.2f}' for x in fast)}")
    print(f"plain copy of the upstream wheel (median):    {c:.2f} s   runs: {', '.join(f'{x:.2f}' for x in copy)}")
    print(f"ratio wheel step / plain copy: {f / c:.1f}x")
    print(f"goal <= {GOAL_S:.0f} s: {'met' if f <= GOAL_S else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
