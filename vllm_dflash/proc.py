"""The one way this package runs an external command: echoed as `+ cmd`, failures turned into DflashError."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_dflash.errors import DflashError


def echo(args: Sequence[str | os.PathLike[str]], cwd: Path | None = None) -> None:
    where = f"(cd {shlex.quote(str(cwd))}) " if cwd else ""
    print(f"+ {where}{shlex.join(str(a) for a in args)}", file=sys.stderr, flush=True)


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

    `env` entries are added to the current environment rather than replacing it.
    """
    if not quiet:
        echo(args, cwd)
    full_env = None if env is None else {**os.environ, **env}
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=full_env,
        text=True,
        input=input_text,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        check=False,
    )
    if check and result.returncode != 0:
        tail = ((result.stderr or "") + (result.stdout or "")).strip().splitlines()[-3:]
        detail = ("; ".join(tail)) if tail else "no output"
        raise error(f"`{shlex.join(str(a) for a in args)}` exited {result.returncode}: {detail}", hint)
    return result
