"""The one way this package runs an external command: echoed as `+ cmd`, failures turned into DflashError.

A failing command's last lines of output are part of the error (bounded), also when its output went straight to
the terminal: stderr is passed through line by line and its tail kept.
"""

from __future__ import annotations

import collections
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from vllm_dflash.errors import DISK_FULL_HINT, DflashError, StorageError

TAIL_LINES = 3  # lines of a failed command's output that go into the one-line error
TAIL_CHARS = 600  # and at most this much of them
KEEP_LINES = 64  # kept while it runs, so a Python traceback's frames can be dropped and its reason still be there
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TRACE_HEADS = ("Traceback (most recent call last):", "During handling of the above exception", "The above exception")
# A child that runs out of disk fails for the reason our own writes would: say so, whatever the caller's hint guessed.
DISK_FULL = ("No space left on device", "Disk quota exceeded")


def echo(args: Sequence[str | os.PathLike[str]], cwd: Path | None = None) -> None:
    where = f"(cd {shlex.quote(str(cwd))}) " if cwd else ""
    # One write per line: commands started from several threads at once must not share a line.
    print(f"+ {where}{shlex.join(str(a) for a in args)}\n", end="", file=sys.stderr, flush=True)


def _disk_full(line: str) -> bool:
    return any(marker in line for marker in DISK_FULL)


def _tee(stream: IO[str], keep: collections.deque[str], disk_full: list[str]) -> None:
    for line in stream:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.strip():
            keep.append(line.rstrip("\n"))
        if _disk_full(line):
            disk_full.append(line.strip())  # seen anywhere in the output, not only in the kept tail


def _reasons(lines: Sequence[str]) -> list[str]:
    """The lines that say why, without colour codes and without a Python traceback's frames: a child's trace becomes
    its exception line (`requests.exceptions.ConnectionError: ...`), never a trace inside our one-line error."""
    plain = [_ANSI.sub("", line).rstrip() for line in lines]
    if not any(line.startswith(_TRACE_HEADS) for line in plain):
        return [line for line in plain if line.strip()]
    said: list[str] = []  # the child's own words before any trace (the kept window may start inside one)
    for line in plain:
        if line.startswith(_TRACE_HEADS) or line[:1].isspace():
            break
        if line.strip():
            said.append(line)
    first = next(i for i, line in enumerate(plain) if line.startswith(_TRACE_HEADS))
    # frames are indented ("  File ...", "    code", "    ^^^"); the last unindented line is the exception that ended
    # it (earlier ones are the chain that led there)
    ends = [
        line for line in plain[first:] if line.strip() and not line[0].isspace() and not line.startswith(_TRACE_HEADS)
    ]
    return said + ends[-1:]


def tail_text(lines: Sequence[str]) -> str:
    text = "; ".join(line.strip() for line in _reasons(lines)[-TAIL_LINES:]) or "no output"
    return text if len(text) <= TAIL_CHARS else "…" + text[-TAIL_CHARS:]


def call(
    *args: str | os.PathLike[str],
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
    check: bool = True,
    input_text: str | None = None,
    error: type[DflashError] = DflashError,
    hint: str = "",
    quiet: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `args`, echoing it first. With `check`, a non-zero exit raises `error` with the tail of its output.

    `env` entries are added to the current environment rather than replacing it. Without `capture`, stdout goes to
    the terminal as it comes and stderr is passed through too, its last lines kept for the error message.
    """
    if not quiet:
        echo(args, cwd)
    full_env = None if env is None else {**os.environ, **env}
    argv = [str(a) for a in args]
    disk_full: list[str] = []
    try:
        if capture:
            result = subprocess.run(
                argv, cwd=cwd, env=full_env, text=True, input=input_text, capture_output=True, check=False
            )
            lines = ((result.stderr or "") + (result.stdout or "")).strip().splitlines()
            disk_full.extend(line.strip() for line in lines if _disk_full(line))
        else:
            keep: collections.deque[str] = collections.deque(maxlen=KEEP_LINES)
            with subprocess.Popen(
                argv,
                cwd=cwd,
                env=full_env,
                text=True,
                errors="replace",
                stdin=subprocess.PIPE if input_text is not None else None,
                stderr=subprocess.PIPE,
            ) as popen:
                reader = threading.Thread(target=_tee, args=(popen.stderr, keep, disk_full), daemon=True)
                reader.start()
                if input_text is not None and popen.stdin is not None:
                    popen.stdin.write(input_text)
                    popen.stdin.close()
                code = popen.wait()
                reader.join()
            result = subprocess.CompletedProcess(argv, code, None, None)
            lines = list(keep)
    except FileNotFoundError:
        raise error(f"`{argv[0]}` is not installed (or not on PATH)", hint or f"install {argv[0]}") from None
    except OSError as exc:
        raise error(f"cannot run `{argv[0]}`: {exc.strerror or exc}", hint) from None
    if check and result.returncode != 0:
        if disk_full:  # the line that says so, wherever it was in the output
            raise StorageError(f"`{shlex.join(argv)}` exited {result.returncode}: {disk_full[0]}", DISK_FULL_HINT)
        raise error(f"`{shlex.join(argv)}` exited {result.returncode}: {tail_text(lines)}", hint)
    return result
