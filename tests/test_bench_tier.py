"""benchmarks/bench_tier.py's parsing and table on recorded output (quick tier; nothing is run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from conftest import longest_files_first

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tier.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_tier", _PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tier"] = mod
    spec.loader.exec_module(mod)
    return mod


B = _bench()

LOG = """\
============================= slowest durations ==============================
600.50s call     tests/test_conformance.py::test_conformance_patched_passes_and_stock_fails
100.00s setup    tests/test_conformance.py::test_conformance_patched_passes_and_stock_fails
558.13s call     tests/test_pins.py::test_pin_matrix_is_what_the_runs_compute
345.75s setup    tests/test_mini_validate.py::test_three_numbers_side_by_side_and_the_gates
153.79s setup    tests/test_image.py::test_aarch64_image_checks_inside
40.00s call     tests/test_doctor_differential.py::test_x[a-b]
2.00s call     tests/test_manifest.py::test_y
not a duration line 3.0s call
"""
DU = "1796333026 cache=27195 tmp=13557 pip=\n1796333089 cache=27000 tmp=14534 pip=\nnoise\n1796333090 cache= tmp=\n"


def test_durations_are_summed_per_test_and_mapped_to_parts() -> None:
    d = B.durations_from_text(LOG)
    assert d["tests/test_conformance.py::test_conformance_patched_passes_and_stock_fails"] == pytest.approx(700.5)
    assert len(d) == 6  # the malformed line is not a test
    table = B.by_part(d)
    assert table["conformance (default pin, both builds)"] == (1, pytest.approx(700.5))
    assert table["doctor's environments"] == (1, 40.0)
    assert table[B.OTHER] == (1, 2.0)
    assert B.part_of("tests/test_minimal.py::t") == "miniatures"  # prefix rule, in one place
    assert B.part_of("tests/test_cache.py::t") == B.OTHER


def test_du_peaks_skip_empty_fields() -> None:
    p = B.du_peaks(DU.splitlines())
    assert (p.samples, p.cache_mb, p.tmp_mb) == (3, 27195.0, 14534.0)
    assert B.du_peaks([]).cache_mb is None


def test_goals_are_judged_only_on_whole_data() -> None:
    table = B.by_part(B.durations_from_text(LOG))
    whole = B.render(table, "cold full tier", B.du_peaks(DU.splitlines()))
    assert "| full tier from an empty cache on 2 cores | 2700 s | 1800 s | yes |" in whole
    assert "| cold cache | 20480 MB | 27195 MB | NO |" in whole
    assert B.partial_durations(LOG) is None
    cut = LOG.replace("slowest durations", "slowest 10 durations")
    assert B.partial_durations(cut) == 10
    shown = B.render(table, "cold full tier", None, B.partial_durations(cut))
    assert "PARTIAL" in shown and "| full tier from an empty cache on 2 cores | 2700 s | — | — |" in shown
    slow = B.by_part({"tests/test_x.py::t": 3000.0})
    assert "| 3000 s | NO |" in B.render(slow, "cold full tier")


def test_junit_and_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_pins" name="test_a" time="12.5"/>'
        '<testcase classname="tests.test_image.TestX" name="test_b" time="3"/></testsuite></testsuites>'
    )
    assert B.durations_from_junit(xml) == {"tests/test_pins.py::test_a": 12.5, "tests/test_image.py::TestX::test_b": 3}
    assert B.main(["--ingest", str(xml), "--label", "warm"]) == 0
    assert "| pins' evidence (every pin's builds) | 1 | 12 |" in capsys.readouterr().out
    empty = tmp_path / "empty.log"
    empty.write_text("nothing\n")
    assert B.main(["--ingest", str(empty)]) == 2
    assert B.main(["--ingest", str(tmp_path / "missing.log")]) == 2
    assert B.main([]) == 2


def test_the_tier_goal_is_judged_on_wall_time_under_xdist(tmp_path: Path) -> None:
    """Two xdist workers: the tests' durations add up to 1800 s, the session took 1500 s of wall time; the goal is
    the wall time (the sum only where the log has none)."""
    end = "===== 7 passed, 1 xfailed in 1500.25s (0:25:00) =====\n"
    log = "created: 2/2 workers\n2 workers [7 items]\n" + LOG + end
    assert B.wall_from_text(log) == 1500.25 and B.workers_from_text(log) == 2
    assert B.wall_from_text(LOG) is None and B.workers_from_text(LOG) == 1
    table = B.by_part(B.durations_from_text(log))
    shown = B.render(table, "cold full tier", None, None, B.wall_from_text(log), 2)
    assert "30.0 min of tests, 25.0 min wall on 2 worker(s)" in shown
    assert "| full tier from an empty cache on 2 cores | 2700 s | 1500 s | yes |" in shown
    over = B.render(table, "cold full tier", None, None, 2701.0, 2)
    assert "| 2701 s | NO |" in over  # the wall time is judged, not the (here smaller) sum
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite time="99.5"><testcase classname="tests.test_a" name="t" time="1"/>'
                   "</testsuite></testsuites>")  # fmt: skip
    assert B.wall_from_junit(xml) == 99.5


def test_the_tier_starts_the_longest_files_first_and_keeps_each_files_order() -> None:
    """--save-order's figures (from a run's durations) order whole files, longest first; unmeasured files follow in
    collection order, and no file's tests are split or reordered."""
    durations = {"tests/test_a.py::t1": 1.0, "tests/test_b.py::t1": 30.0, "tests/test_b.py::t2": 5.0}
    durations |= {"tests/test_c.py::t1": 20.0}
    seconds = B.file_seconds(durations)
    assert list(seconds) == ["tests/test_b.py", "tests/test_c.py", "tests/test_a.py"]
    assert seconds["tests/test_b.py"] == 35
    ids = ["tests/test_a.py::t1", "tests/test_d.py::t1", "tests/test_b.py::t1", "tests/test_b.py::t2"]
    ids += ["tests/test_e.py::t1", "tests/test_c.py::t1", "tests/test_d.py::t2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    ordered = [i.nodeid for i in longest_files_first(items, seconds)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/test_b.py::t1",
        "tests/test_b.py::t2",
        "tests/test_c.py::t1",
        "tests/test_a.py::t1",
        "tests/test_d.py::t1",
        "tests/test_d.py::t2",
        "tests/test_e.py::t1",
    ]
    assert [i.nodeid for i in longest_files_first(items, {})] == [  # type: ignore[arg-type]
        "tests/test_a.py::t1",
        "tests/test_d.py::t1",
        "tests/test_d.py::t2",
        "tests/test_b.py::t1",
        "tests/test_b.py::t2",
        "tests/test_e.py::t1",
        "tests/test_c.py::t1",
    ]


def test_save_order_writes_the_files_seconds(tmp_path: Path) -> None:
    out = tmp_path / "file_seconds.json"
    B.save_order(out, {"tests/test_a.py::t": 2.0, "tests/test_b.py::t": 3.0}, "cold full tier")
    doc = json.loads(out.read_text())
    assert doc == {"measured": "cold full tier", "seconds": {"tests/test_b.py": 3.0, "tests/test_a.py": 2.0}}


def test_the_timeline_shows_each_workers_files_busy_time_and_longest_setups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What tests/conftest.py writes under VLLM_DFLASH_TEST_TIMELINE, read back: the time between a worker's phases
    is its span less its phases, and the longest set-up comes first."""
    rows = [
        ("gw0", "tests/test_a.py::t1", "setup", 100.0, 160.0),
        ("gw0", "tests/test_a.py::t1", "call", 160.0, 170.0),
        ("gw0", "tests/test_b.py::t2", "call", 180.0, 190.0),  # 10 s after test_a's last phase
        ("gw1", "tests/test_c.py::t3", "setup", 100.0, 105.0),
        ("gw1", "tests/test_c.py::t3", "call", 105.0, 300.0),
    ]
    path = tmp_path / "timeline.jsonl"
    lines = [json.dumps(dict(zip(("worker", "test", "when", "start", "stop"), r, strict=True))) for r in rows]
    path.write_text("\n".join([*lines, "not json", '{"worker": "gw9"}']) + "\n")
    assert B.main(["--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| gw0 | 0 s | 90 s | 80 s | 10 s |" in out and "| gw1 | 0 s | 200 s | 200 s | 0 s |" in out
    assert "gw0: test_a.py 0-70, test_b.py 80-90" in out
    setups = [line for line in out.splitlines() if line.startswith("| tests/")]
    assert setups[0] == "| tests/test_a.py::t1 | gw0 | 0 s | 60 |", setups
    assert B.main(["--timeline", str(tmp_path / "absent.jsonl")]) == 2


def test_conftest_writes_the_timeline_a_run_is_read_from(tmp_path: Path) -> None:
    """A real two-worker pytest run with VLLM_DFLASH_TEST_TIMELINE: the controller writes every phase of every test,
    each named by the worker that ran it."""
    import os
    import subprocess

    path = tmp_path / "timeline.jsonl"
    files = ["tests/test_proc.py", "tests/test_cache.py"]
    env = {**os.environ, "VLLM_DFLASH_TEST_TIMELINE": str(path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider", *files],
        cwd=_PATH.parents[1],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    phases = B.read_timeline(path.read_text().splitlines())
    tests = {p.test for p in phases}
    assert {p.when for p in phases} == {"setup", "call", "teardown"} and len(phases) == 3 * len(tests)
    assert {p.worker for p in phases} <= {"gw0", "gw1"} and {p.test.split("::")[0] for p in phases} == set(files)
    assert all(p.stop >= p.start for p in phases)
