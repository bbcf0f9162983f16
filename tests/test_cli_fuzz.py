"""Issue 42's fuzz tier for the doctor: drafter configs and Hugging Face cache layouts through the CLI, every ending
judged by tests/cli_fuzz.py (an exit code of docs/troubleshooting.md's table, one `error:` line at most, no
traceback, no wait past the bound). Reports and wheels are fuzzed through `publish` in tests/test_gate.py, beside the
fixtures that make a passing report.

The issue's classes are regression examples here, run through a real `python -m vllm_dflash` as a shell user would,
and the judge is shown to fail: a trace, an undocumented code and a hang (the FIFO guard taken away) are each caught.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_fuzz import BOUND_S, DOCUMENTED, Ending, run_in_process, run_subprocess
from doctor_configs import drafter_configs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
FUZZ = settings(
    max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
Q36 = json.loads((REPO / "vllm_dflash/doctor/checkpoints/z-lab--Qwen3.6-27B-DFlash.json").read_text())["config"]
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=6),
    st.lists(st.integers(-3, 70), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)  # fmt: skip


# The same strategies through a real `python -m vllm_dflash doctor` per example (about a second each).
FUZZ_PROCESS = settings(FUZZ, max_examples=12)


def doctor(*args: str | Path) -> Ending:
    return run_in_process("--root", REPO, "doctor", *args)


def doctor_process(*args: str | Path) -> Ending:
    return run_subprocess("--root", REPO, "doctor", *args)


JUNK_FIELDS = [*sorted(Q36), "swa_window_size", "auto_map", "quantization_config", "dflash_config", "weight_map"]


@FUZZ
@given(cfg=drafter_configs(), junk=st.dictionaries(st.sampled_from(JUNK_FIELDS), JUNK, max_size=2))
def test_fuzzed_drafter_configs_end_in_the_table(
    tmp_path: Path, cfg: dict[str, Any], junk: dict[str, Any], doctor_servers: None
) -> None:
    """The differential strategy's configs (every attention field's spellings), with up to two fields made junk."""
    _fuzz_config(tmp_path, cfg, junk, doctor)


@FUZZ_PROCESS
@given(cfg=drafter_configs(), junk=st.dictionaries(st.sampled_from(JUNK_FIELDS), JUNK, max_size=2))
def test_fuzzed_drafter_configs_through_a_process_end_in_the_table(
    tmp_path: Path, cfg: dict[str, Any], junk: dict[str, Any], doctor_servers: None
) -> None:
    _fuzz_config(tmp_path, cfg, junk, doctor_process)


def _fuzz_config(tmp_path: Path, cfg: dict[str, Any], junk: dict[str, Any], run: Callable[..., Ending]) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps({**cfg, **junk}))
        run(tmp).check()


# An HF cache: refs/main (a hash, junk, too long, absent), a snapshot whose config.json is a file, a symlink into
# blobs/, dangling or a FIFO, and weights that are junk, a lying safetensors header, a FIFO or an index of any shape.
REFS = st.one_of(st.sampled_from([None, "abc123\n", "abc123", "", "../../etc\n", "zzz\n"]), st.binary(max_size=80))
CONFIG_KIND = st.sampled_from(["file", "blob-link", "dangling", "fifo", "directory", "absent"])
WEIGHTS = st.sampled_from(["none", "junk", "huge-header", "short", "fifo", "index-int", "index-list", "index-ok",
                           "index-junk"])  # fmt: skip


def _weights(snap: Path, kind: str) -> None:
    st_file = snap / "model.safetensors"
    index = snap / "model.safetensors.index.json"
    if kind == "junk":
        st_file.write_bytes(os.urandom(40))
    elif kind == "huge-header":
        st_file.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    elif kind == "short":
        st_file.write_bytes(b"\x05\x00")
    elif kind == "fifo":
        os.mkfifo(st_file)
    elif kind.startswith("index"):
        body: Any = {"index-int": 7, "index-list": ["a"], "index-ok": {"fc.weight": "model.safetensors"}}.get(kind)
        index.write_text(json.dumps({"weight_map": body}) if body is not None else "{not json")


@FUZZ
@given(refs=REFS, config=CONFIG_KIND, weights=WEIGHTS, snapshots=st.integers(0, 2), second_ref=st.booleans())
def test_fuzzed_hf_caches_end_in_the_table(
    tmp_path: Path, refs: Any, config: str, weights: str, snapshots: int, second_ref: bool, doctor_servers: None
) -> None:
    _fuzz_cache(tmp_path, refs, config, weights, snapshots, second_ref, doctor)


@FUZZ_PROCESS
@given(refs=REFS, config=CONFIG_KIND, weights=WEIGHTS, snapshots=st.integers(0, 2), second_ref=st.booleans())
def test_fuzzed_hf_caches_through_a_process_end_in_the_table(
    tmp_path: Path, refs: Any, config: str, weights: str, snapshots: int, second_ref: bool, doctor_servers: None
) -> None:
    _fuzz_cache(tmp_path, refs, config, weights, snapshots, second_ref, doctor_process)


def _fuzz_cache(
    tmp_path: Path, refs: Any, config: str, weights: str, snapshots: int, second_ref: bool, run: Callable[..., Ending]
) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        repo = Path(tmp) / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
        (repo / "blobs").mkdir(parents=True)
        for i in range(snapshots):
            snap = repo / "snapshots" / ("abc123" if i == 0 else f"def{i}")
            snap.mkdir(parents=True)
            cfg = snap / "config.json"
            if config == "file":
                cfg.write_text(json.dumps(Q36))
            elif config == "blob-link":
                (repo / "blobs" / "b1").write_text(json.dumps(Q36))
                cfg.symlink_to(Path("..") / ".." / "blobs" / "b1")
            elif config == "dangling":
                cfg.symlink_to(Path("..") / ".." / "blobs" / "gone")
            elif config == "fifo":
                os.mkfifo(cfg)
            elif config == "directory":
                cfg.mkdir()
            _weights(snap, weights)
        if refs is not None:
            (repo / "refs").mkdir()
            (repo / "refs" / "main").write_bytes(refs if isinstance(refs, bytes) else refs.encode())
            if second_ref:
                (repo / "refs" / "pr").mkdir()
        run(repo).check()


# --- issue 42's classes as regression examples, through a real interpreter ------------------------------------


def _q36_dir(at: Path, **over: Any) -> Path:
    at.mkdir(parents=True)
    (at / "config.json").write_text(json.dumps({**Q36, **over}))
    return at


def _case(name: str, tmp: Path) -> list[str | Path]:
    if name == "refs-not-utf8":
        repo = tmp / "models--z-lab--x"
        _q36_dir(repo / "snapshots" / "abc123")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_bytes(b"\xff\xfe\x00abc")
        return ["doctor", repo]
    if name == "refs-huge":
        repo = tmp / "models--z-lab--x"
        _q36_dir(repo / "snapshots" / "abc123")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_bytes(b"a" * 3_000_000)
        return ["doctor", repo]
    if name == "fifo-weights":
        d = _q36_dir(tmp / "d")
        os.mkfifo(d / "model.safetensors")
        return ["doctor", d]
    if name == "weight-map-int":
        d = _q36_dir(tmp / "d")
        (d / "model.safetensors.index.json").write_text('{"weight_map": 5}')
        return ["doctor", d]
    assert name == "swa-string"
    # the table entry's first completion (its config alone has no target_layer_ids: the runner's default taps then
    # misfit the fc, exit 22, whatever swa_window_size says)
    from vllm_dflash.doctor import table

    entry = table.load_entry(REPO / "vllm_dflash/doctor/checkpoints/z-lab--Qwen3.6-27B-DFlash.json")
    d = tmp / "d"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**table.completions(entry)[0][1].config, "swa_window_size": "2048"}))
    return ["doctor", d]


# Refused before any column runs (the quick tier), and one the columns read (a heavy test: warm servers).
CLASSES = {"refs-not-utf8": 18, "refs-huge": 18, "fifo-weights": 18, "weight-map-int": 18}
READ_CLASSES = {"swa-string": 23}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_issue_42s_doctor_classes_through_a_shell(tmp_path: Path, name: str) -> None:
    ending = run_subprocess("--root", REPO, *_case(name, tmp_path), cwd=tmp_path)
    ending.check()
    assert ending.code == CLASSES[name], (ending.code, ending.err[-800:])


@pytest.mark.parametrize("name", sorted(READ_CLASSES))
def test_issue_42s_read_classes_through_a_shell(tmp_path: Path, name: str, doctor_servers: None) -> None:
    ending = run_subprocess("--root", REPO, *_case(name, tmp_path), cwd=tmp_path)
    ending.check()
    assert ending.code == READ_CLASSES[name], (ending.code, ending.err[-800:])


# --- the judge fails when it should -------------------------------------------------------------------------------


def test_the_judge_catches_a_trace_an_undocumented_code_and_extra_error_lines() -> None:
    assert DOCUMENTED >= {0, 1, 2, 18, 20, 21, 22, 23, 24, 130} and 19 not in DOCUMENTED
    assert Ending(("x",), None, "", "", trace="Traceback ...").problems()
    assert Ending(("x",), 19, "", "error: a\n").problems() == ["exit 19 is not in docs/troubleshooting.md's table"]
    assert Ending(("x",), 18, "", "error: a\nerror: b\n").problems() == ["2 error lines"]
    assert Ending(("x",), 18, "", "Traceback (most recent call last):\nerror: a\n").problems() == [
        "printed a traceback"
    ]
    assert Ending(("x",), 18, "", "error: a\n").problems() == []


def test_the_bound_catches_the_fifo_hang_once_its_guard_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation that reopens the one hang: weights opened without the regular-file check. The in-process bound
    ends the wait and the judge reports it; with the guard, the same input ends in one line at once."""
    from vllm_dflash import paths

    args = _case("fifo-weights", tmp_path)
    assert doctor(*args[1:]).problems() == []

    def unguarded(path: Path, what: str, error: Any = None, hint: str = "") -> int:
        return os.open(path, os.O_RDONLY)  # blocks: no writer will ever come

    monkeypatch.setattr(paths, "open_regular", unguarded)
    hung = run_in_process("--root", REPO, "doctor", *args[1:], bound_s=2)
    assert hung.code is None and "still running after 2 s" in hung.trace, hung
    assert BOUND_S > 2


def _mutated_env(tmp_path: Path, patch: str) -> dict[str, str]:
    """An environment whose interpreter runs PATCH at start-up (a sitecustomize on PYTHONPATH): a mutation of the
    installed code that only a real process can carry."""
    site = tmp_path / "mutant-site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(patch)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_the_process_judge_catches_a_trace_and_the_fifo_hang(tmp_path: Path) -> None:
    """The subprocess runner fails when it should: a main() that raises prints a traceback, and weights opened
    without the regular-file check hang until the bound kills the process. The control: the same inputs through the
    unmutated code end in the table."""
    args = _case("fifo-weights", tmp_path)
    control = run_subprocess("--root", REPO, *args, cwd=tmp_path)
    assert control.problems() == [] and control.code == CLASSES["fifo-weights"], control

    raising = _mutated_env(tmp_path / "a", "import vllm_dflash.cli as c\n"
                           "def main(argv=None):\n    raise RuntimeError('mutant')\n"
                           "c.main = main\n")  # fmt: skip
    traced = run_subprocess("--root", REPO, *args, cwd=tmp_path, env=raising)
    assert "printed a traceback" in traced.problems(), traced

    opens_anything = "lambda path, what, error=None, hint='': os.open(path, os.O_RDONLY)"
    unguarded = _mutated_env(tmp_path / "b", f"import os, vllm_dflash.paths as p\np.open_regular = {opens_anything}\n")
    hung = run_subprocess("--root", REPO, *args, cwd=tmp_path, env=unguarded, bound_s=5)
    assert hung.code is None and "still running after 5 s" in hung.trace, hung
