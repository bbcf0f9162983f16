"""Benchmark: where the full tier's time goes, per part, against issue 37's goals.

    python benchmarks/bench_tier.py --ingest RUN.log [--du DU.log]     # a finished run's pytest output
    python benchmarks/bench_tier.py --ingest report.xml                 # or its --junitxml file
    python benchmarks/bench_tier.py --run cold|warm [--cache DIR]       # run the full tier here and time it
    python benchmarks/bench_tier.py --timeline TIMELINE.jsonl            # what each worker ran when

`--ingest` reads pytest's `--durations=0` lines (`12.34s call     tests/test_x.py::test_y`) or a `--junitxml` file
and sums each test's setup, call and teardown into the part `part_of` maps it to (one place: PARTS). `--du` reads a
sampler's lines `EPOCH cache=MB tmp=MB ...` and prints the peaks. `--run cold` runs `scripts/test` with a fresh
VLLM_DFLASH_CACHE (`--run warm` reuses `--cache`), `--durations=0 --junitxml`, sampling the cache's and the
temporary directory's size every 30 s, then prints the same table. Running it cold takes the full tier's time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# (part, nodeid prefix): the first prefix that matches a test's nodeid names its part.
PARTS: tuple[tuple[str, str], ...] = (
    ("conformance (default pin, both builds)", "tests/test_conformance.py"),
    ("pins' evidence (every pin's builds)", "tests/test_pins.py"),
    ("miniatures", "tests/test_mini"),
    ("images", "tests/test_image.py"),
    ("doctor's environments", "tests/test_doctor"),
    ("hybrid target (CPU GDN kernels)", "tests/test_hybrid_target.py"),
    ("CPU twin containers and the router", "tests/test_cpu_image.py"),
)
OTHER = "everything else"

# Issue 37's goals: (what, limit, unit).
GOALS: tuple[tuple[str, float, str], ...] = (
    ("full tier from an empty cache on 2 cores", 45 * 60, "s"),
    ("conformance warm (default pin)", 120, "s"),
    ("quick tier", 5 * 60, "s"),
    ("cold cache", 20 * 1024, "MB"),
    ("peak temporary space", 3 * 1024, "MB"),
)

_DURATION = re.compile(r"^(?P<s>\d+(?:\.\d+)?)s\s+(?P<when>setup|call|teardown)\s+(?P<node>\S+)\s*$")
_DU = re.compile(r"^(?P<t>\d+)\s+(?P<fields>(?:\w+=\S*\s*)+)$")


_HEADER = re.compile(r"=+ slowest (?:(?P<n>\d+) )?durations =+")


# pytest's last line, e.g. "==== 1040 passed, 1 xfailed in 7236.98s (2:00:36) ====": the session's wall time. Under
# pytest-xdist (scripts/test runs one process per core) the tests' durations add up to more than that.
_WALL = re.compile(r"^=+ .*\bin (?P<s>\d+(?:\.\d+)?)s\b.*=+$")
_WORKERS = re.compile(r"^(?:created: )?(?P<n>\d+)/?\d* workers\b")


def wall_from_text(text: str) -> float | None:
    """The session's wall-clock seconds from pytest's summary line (the last one, if several)."""
    found = [float(m["s"]) for line in text.splitlines() if (m := _WALL.match(line.strip()))]
    return found[-1] if found else None


def wall_from_junit(path: Path) -> float | None:
    """The session's wall-clock seconds: the `time` of the junit file's test suite."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else next(suite.iter("testsuite"), suite)
    t = suite.get("time")
    return float(t) if t else None


def workers_from_text(text: str) -> int:
    """How many pytest-xdist workers ran the tests (1 without xdist)."""
    found = [int(m["n"]) for line in text.splitlines() if (m := _WORKERS.match(line.strip()))]
    return found[-1] if found else 1


def partial_durations(text: str) -> int | None:
    """N when the log holds only pytest's N slowest durations (`--durations=N`, N > 0): its sums are not totals."""
    m = _HEADER.search(text)
    return int(m["n"]) if m and m["n"] else None


def part_of(nodeid: str) -> str:
    return next((part for part, prefix in PARTS if nodeid.startswith(prefix)), OTHER)


def durations_from_text(text: str) -> dict[str, float]:
    """nodeid -> seconds (setup + call + teardown) from pytest's --durations lines."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _DURATION.match(line.strip())
        if m:
            out[m["node"]] = out.get(m["node"], 0.0) + float(m["s"])
    return out


def durations_from_junit(path: Path) -> dict[str, float]:
    """nodeid -> seconds from a --junitxml file (its `time` covers setup, call and teardown)."""
    out: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")
        file = "/".join(module[: next((i for i, p in enumerate(module) if p.startswith("test_")), len(module)) + 1])
        cls = module[len(file.split("/")) :]
        node = "::".join([f"{file}.py", *cls, case.get("name") or ""])
        out[node] = out.get(node, 0.0) + float(case.get("time") or 0)
    return out


def by_part(durations: Mapping[str, float]) -> dict[str, tuple[int, float]]:
    """part -> (tests, seconds), in PARTS order, OTHER last."""
    table = {part: (0, 0.0) for part, _ in PARTS} | {OTHER: (0, 0.0)}
    for node, seconds in durations.items():
        n, s = table[part_of(node)]
        table[part_of(node)] = (n + 1, s + seconds)
    return table


@dataclass(frozen=True)
class Peaks:
    samples: int
    cache_mb: float | None
    tmp_mb: float | None


def du_peaks(lines: Iterable[str]) -> Peaks:
    """The peaks of a sampler's `EPOCH cache=MB tmp=MB ...` lines (an empty field is no sample)."""
    n = 0
    peak: dict[str, float | None] = {"cache": None, "tmp": None}
    for line in lines:
        m = _DU.match(line.strip())
        if not m:
            continue
        n += 1
        for field in m["fields"].split():
            key, _, value = field.partition("=")
            if key in peak and value:
                old = peak[key]
                peak[key] = float(value) if old is None else max(old, float(value))
    return Peaks(n, peak["cache"], peak["tmp"])


def render(
    table: Mapping[str, tuple[int, float]],
    label: str,
    peaks: Peaks | None = None,
    partial: int | None = None,
    wall: float | None = None,
    workers: int = 1,
) -> str:
    """The per-part table and the goals. The full tier's goal is judged on the session's wall time where the log has
    it (several xdist workers run tests at once, so their durations add up to more), else on the durations' sum."""
    total = sum(s for _, s in table.values())
    lines = [f"{label}: {sum(n for n, _ in table.values())} tests, {total / 60:.1f} min of tests", ""]
    if wall is not None:
        lines[0] += f", {wall / 60:.1f} min wall on {workers} worker(s)"
    if partial:
        lines[0] += f" (PARTIAL: the log holds only the {partial} slowest durations; rerun with --durations=0)"
    lines.append("| part | tests | seconds | share |\n| --- | ---: | ---: | ---: |")
    for part, (n, s) in table.items():
        lines.append(f"| {part} | {n} | {s:.0f} | {100 * s / total if total else 0:.0f} % |")
    lines.append(f"| total | {sum(n for n, _ in table.values())} | {total:.0f} | |")
    lines += ["", "| goal | limit | measured | met |", "| --- | ---: | ---: | --- |"]
    whole = partial is None
    tier = wall if wall is not None else total
    measured: dict[str, float | None] = {GOALS[0][0]: tier if "cold" in label and whole else None}
    measured[GOALS[1][0]] = table[PARTS[0][0]][1] if "warm" in label and whole else None
    if peaks is not None:
        measured[GOALS[3][0]], measured[GOALS[4][0]] = peaks.cache_mb, peaks.tmp_mb
    for what, limit, unit in GOALS:
        got = measured.get(what)
        shown = "—" if got is None else f"{got:.0f} {unit}"
        met = "—" if got is None else ("yes" if got <= limit else "NO")
        lines.append(f"| {what} | {limit:.0f} {unit} | {shown} | {met} |")
    if peaks is not None:
        lines.append(f"\n(du: {peaks.samples} samples; the conformance row is the whole file, all its builds)")
    return "\n".join(lines)


def _dir_mb(path: Path) -> float:
    out = subprocess.run(["du", "-smx", str(path)], capture_output=True, text=True, check=False).stdout.split()
    return float(out[0]) if out else 0.0


def run_tier(mode: str, cache: Path, log: Path) -> tuple[dict[str, float], Peaks, float | None]:
    """scripts/test (the full tier) with --durations=0 and a junit file, sampling the cache and tmp every 30 s."""
    repo = Path(__file__).resolve().parents[1]
    if mode == "cold" and cache.exists():
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tier-"))
    junit = tmp / "junit.xml"
    env = {**os.environ, "VLLM_DFLASH_CACHE": str(cache), "TMPDIR": str(tmp)}
    samples: list[str] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(30):
            samples.append(f"{int(time.time())} cache={_dir_mb(cache):.0f} tmp={_dir_mb(tmp):.0f}")

    threading.Thread(target=sample, daemon=True).start()
    cmd = [str(repo / "scripts" / "test"), "--", "--durations=0", f"--junitxml={junit}"]
    print(f"+ VLLM_DFLASH_CACHE={cache} TMPDIR={tmp} {' '.join(cmd)}", flush=True)
    with log.open("w") as out:
        subprocess.run(cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    done.set()
    return durations_from_junit(junit), du_peaks(samples), wall_from_junit(junit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--ingest", type=Path, help="a finished run's pytest output (--durations=0) or --junitxml file")
    ap.add_argument("--du", type=Path, help="a sampler's log: lines `EPOCH cache=MB tmp=MB ...`")
    ap.add_argument(
        "--timeline", type=Path, help="a run's VLLM_DFLASH_TEST_TIMELINE file: each worker's files, busy time, set-ups"
    )
    ap.add_argument("--label", default=None, help="the run's label (contains cold or warm to judge those goals)")
    ap.add_argument("--run", choices=("cold", "warm"), help="run the full tier here (cold: a fresh cache)")
    ap.add_argument("--cache", type=Path, default=None, help="the cache for --run (default: a new temporary dir)")
    ap.add_argument(
        "--save-order",
        type=Path,
        default=None,
        help="also write each test file's seconds to this JSON file (tests/file_seconds.json: the tier starts the "
        "longest files first)",
    )
    args = ap.parse_args(argv)
    if args.timeline is not None and args.ingest is None and args.run is None:
        if not args.timeline.is_file():
            print(f"error: {args.timeline} is not a file -- pass a VLLM_DFLASH_TEST_TIMELINE file", file=sys.stderr)
            return 2
        print(render_timeline(read_timeline(args.timeline.read_text(errors="replace").splitlines())))
        return 0
    if (args.ingest is None) == (args.run is None):
        print("error: give --ingest FILE or --run cold|warm -- one of the two", file=sys.stderr)
        return 2
    peaks: Peaks | None = None
    partial: int | None = None
    wall: float | None = None
    workers = 1
    if args.ingest is not None:
        if not args.ingest.is_file():
            print(f"error: {args.ingest} is not a file -- pass a pytest log or junit xml", file=sys.stderr)
            return 2
        if args.ingest.suffix == ".xml":
            durations, wall = durations_from_junit(args.ingest), wall_from_junit(args.ingest)
        else:
            text = args.ingest.read_text(errors="replace")
            durations, partial = durations_from_text(text), partial_durations(text)
            wall, workers = wall_from_text(text), workers_from_text(text)
        if not durations:
            print(f"error: {args.ingest} holds no --durations=0 lines or test cases -- rerun pytest with them",
                  file=sys.stderr)  # fmt: skip
            return 2
        if args.du is not None:
            peaks = du_peaks(args.du.read_text(errors="replace").splitlines())
        label = args.label or args.ingest.name
    else:
        cache = args.cache or Path(tempfile.mkdtemp(prefix="bench-tier-cache-"))
        log = Path(tempfile.mkdtemp()) / "run.log"
        durations, peaks, wall = run_tier(args.run, cache, log)
        workers = workers_from_text(log.read_text(errors="replace"))
        label = args.label or f"{args.run} full tier"
    print(render(by_part(durations), label, peaks, partial, wall, workers))
    if args.timeline is not None and args.timeline.is_file():
        print("\n" + render_timeline(read_timeline(args.timeline.read_text(errors="replace").splitlines())))
    if args.save_order is not None:
        save_order(args.save_order, durations, label)
    return 0


@dataclass(frozen=True)
class Phase:
    worker: str
    test: str
    when: str  # setup | call | teardown
    start: float
    stop: float


def read_timeline(lines: Iterable[str]) -> list[Phase]:
    """tests/conftest.py's VLLM_DFLASH_TEST_TIMELINE lines (one JSON object per test phase); others are skipped."""
    out: list[Phase] = []
    for line in lines:
        try:
            d = json.loads(line)
            out.append(Phase(str(d["worker"]), str(d["test"]), str(d["when"]), float(d["start"]), float(d["stop"])))
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda p: p.start)


def render_timeline(phases: list[Phase], top: int = 12) -> str:
    """Per worker: when it started and ended, its files in the order it ran them, and the time between its phases
    (the worker's own bookkeeping, or nothing to run); then the longest set-ups, where a fixture built shared work
    or waited on a lock another worker held."""
    if not phases:
        return "timeline: no phases"
    t0 = min(p.start for p in phases)
    end = max(p.stop for p in phases)
    lines = [f"timeline: {len(phases)} phases, {(end - t0) / 60:.1f} min from the first to the last", ""]
    lines += ["| worker | first | last | busy | between phases |", "| --- | ---: | ---: | ---: | ---: |"]
    workers = sorted({p.worker for p in phases})
    for w in workers:
        mine = [p for p in phases if p.worker == w]
        busy = sum(p.stop - p.start for p in mine)
        span = max(p.stop for p in mine) - min(p.start for p in mine)
        lines.append(
            f"| {w} | {min(p.start for p in mine) - t0:.0f} s | {max(p.stop for p in mine) - t0:.0f} s "
            f"| {busy:.0f} s | {span - busy:.0f} s |"
        )
    for w in workers:
        files: dict[str, list[float]] = {}
        for p in phases:
            if p.worker == w:
                f = files.setdefault(p.test.split("::", 1)[0], [p.start, p.stop])
                f[1] = max(f[1], p.stop)
        order = ", ".join(f"{name.removeprefix('tests/')} {a - t0:.0f}-{b - t0:.0f}" for name, (a, b) in files.items())
        lines.append(f"\n{w}: {order}")
    setups = sorted((p for p in phases if p.when == "setup"), key=lambda p: p.start - p.stop)[:top]
    lines += ["", "| longest set-ups | worker | at | seconds |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {p.test} | {p.worker} | {p.start - t0:.0f} s | {p.stop - p.start:.0f} |" for p in setups]
    return "\n".join(lines)


def file_seconds(durations: Mapping[str, float]) -> dict[str, float]:
    """Test file -> its tests' seconds, longest first."""
    out: dict[str, float] = {}
    for node, seconds in durations.items():
        file = node.split("::", 1)[0]
        out[file] = out.get(file, 0.0) + seconds
    return {f: round(s, 1) for f, s in sorted(out.items(), key=lambda kv: (-kv[1], kv[0]))}


def save_order(path: Path, durations: Mapping[str, float], label: str) -> None:
    """What tests/conftest.py orders the files by (`--dist loadfile` hands whole files out in collection order: a long
    file collected late ends the run alone)."""
    from vllm_dflash.paths import write_text_atomic

    doc = {"measured": label, "seconds": file_seconds(durations)}
    write_text_atomic(path, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} ({len(doc['seconds'])} files)")


if __name__ == "__main__":
    sys.exit(main())
