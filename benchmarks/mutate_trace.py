"""Which test executes which lines of the files benchmarks/mutate.py mutates (its tracing half).

Loaded by a `sitecustomize` that mutate.py puts first on PYTHONPATH for one traced run of the candidate tests, so
every Python process of that run traces -- pytest itself and each subprocess a test starts (`python -m vllm_dflash
...`). Only frames of the files named in $MUTATE_TRACE_FILES are followed line by line. In pytest this module is also
a plugin (`-p mutate_trace`): it names the running test in $MUTATE_TRACE_TEST, which subprocesses inherit. Each
process writes {test: {file: [lines]}} to $MUTATE_TRACE_OUT/<pid>-<random>.json when it exits. Standard library only.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from types import CodeType, FrameType
from typing import Any

TEST_VAR = "MUTATE_TRACE_TEST"
COLLECT = "<import or collection>"  # lines run outside any test (module bodies): every test depends on them

_targets = {os.path.realpath(p) for p in os.environ.get("MUTATE_TRACE_FILES", "").split(os.pathsep) if p}
_out = os.environ.get("MUTATE_TRACE_OUT", "")
_current = os.environ.get(TEST_VAR, COLLECT)
_hits: dict[str, dict[str, set[int]]] = {}
_durations: dict[str, float] = {}
_known: dict[CodeType, str | None] = {}


def _file_of(code: CodeType) -> str | None:
    try:
        return _known[code]
    except KeyError:
        real = os.path.realpath(code.co_filename)
        _known[code] = found = real if real in _targets else None
        return found


def _tracer(frame: FrameType, event: str, arg: Any) -> Any:
    target = _file_of(frame.f_code)
    if target is None:
        return None
    lines = _hits.setdefault(_current, {}).setdefault(target, set())
    lines.add(frame.f_lineno)

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            lines.add(frame.f_lineno)
        return local

    return local


def _dump() -> None:
    if not _out:
        return
    data = {
        "hits": {t: {f: sorted(ls) for f, ls in files.items()} for t, files in _hits.items()},
        "durations": _durations,
    }
    # A name no other process takes: a run starts tens of thousands of processes and pids wrap (pid_max is often
    # 32768), so a file named by the pid alone was overwritten by a later process's, and its lines were lost.
    name = f"{os.getpid()}-{os.urandom(8).hex()}.json"
    try:
        with open(os.path.join(_out, name), "x") as fh:
            json.dump(data, fh)
    except OSError:
        pass


def start() -> None:
    if not _targets or not _out:
        return
    sys.settrace(_tracer)
    threading.settrace(_tracer)
    atexit.register(_dump)


# --- pytest hooks (active with `-p mutate_trace`) ---------------------------------------------------------------


def pytest_runtest_protocol(item: Any, nextitem: Any) -> None:
    global _current
    _current = item.nodeid
    os.environ[TEST_VAR] = item.nodeid


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    global _current
    _current = COLLECT
    os.environ.pop(TEST_VAR, None)


def pytest_runtest_logreport(report: Any) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + float(report.duration)
