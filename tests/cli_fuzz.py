"""TEST-ONLY: run the CLI on a fuzzed input and judge how it ended (issue 42's fuzz tier).

An ending is acceptable when the command returned an exit code of docs/troubleshooting.md's table, printed at most one
`error:` line and no traceback, and returned within its bound. The table is read from the document users read, so
an exit code the code invents without documenting fails here.
"""

from __future__ import annotations

import contextlib
import io
import re
import signal
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 30  # no input of these surfaces needs longer; a wait past it is a hang


def documented_codes() -> frozenset[int]:
    """The exit column of troubleshooting.md's table ("| 20, 21, 22 | ..." rows included)."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    codes: set[int] = set()
    for row in re.findall(r"^\| ([0-9][0-9, ]*) \|", text, flags=re.M):
        codes.update(int(c) for c in row.split(","))
    return frozenset(codes)


DOCUMENTED = documented_codes()


class Hang(Exception):
    """The command ran past BOUND_S."""


@dataclass(frozen=True)
class Ending:
    argv: tuple[str, ...]
    code: int | None  # None: it raised (`trace` holds it) or hung
    out: str
    err: str
    trace: str = ""

    def problems(self) -> list[str]:
        found = []
        if self.trace:
            found.append(f"ended in a traceback:\n{self.trace}")
        elif self.code not in DOCUMENTED:
            found.append(f"exit {self.code} is not in docs/troubleshooting.md's table")
        if "Traceback (most recent call last)" in self.err + self.out:
            found.append("printed a traceback")
        errors = [line for line in self.err.splitlines() if line.startswith("error:")]
        if len(errors) > 1:
            found.append(f"{len(errors)} error lines")
        return found

    def check(self) -> None:
        problems = self.problems()
        assert not problems, f"{' '.join(self.argv)}: {'; '.join(problems)}\nstderr: {self.err[-1500:]}"


@contextlib.contextmanager
def _bounded(seconds: int) -> Iterator[None]:
    def hang(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_in_process(*argv: str | Path, bound_s: int = BOUND_S) -> Ending:
    """`vllm-dflash ARGV` through the CLI's own main(), in this process (a fuzz example costs milliseconds, not an
    interpreter start): what escapes main() is what a user would see as a traceback."""
    from vllm_dflash.cli import main

    args = tuple(str(a) for a in argv)
    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    trace = ""
    try:
        with _bounded(bound_s), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        trace = traceback.format_exc()
    return Ending(args, code, out.getvalue(), err.getvalue(), trace)


def run_subprocess(
    *argv: str | Path, bound_s: int = BOUND_S, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Ending:
    """The same through a real `python -m vllm_dflash` (the regression examples: what a shell user runs)."""
    args = tuple(str(a) for a in argv)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "vllm_dflash", *args],
            capture_output=True,
            text=True,
            timeout=bound_s,
            check=False,
            cwd=cwd,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        return Ending(args, None, "", str(exc.stderr or ""), f"hung: still running after {bound_s} s")
    return Ending(args, done.returncode, done.stdout, done.stderr)


def first_error(ending: Ending) -> str:
    lines = [line for line in ending.err.splitlines() if line.startswith("error:")]
    return lines[0] if lines else ""
