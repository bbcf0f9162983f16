"""The project's code, its tests and benchmarks included, stays ruff- and mypy-clean (strict); a lint failure fails the
test command (mypy over the tests finds what only a heavy test would run: an accessor called that no longer exists)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "args",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_lint(args: list[str]) -> None:
    if args == ["mypy"]:
        # mypy's incremental cache outlives the checkout (a fresh clone's .mypy_cache is empty, and a cold mypy over
        # the package, its tests and benchmarks takes a minute): an entry is reused only when its file's hash matches.
        from vllm_dflash.fetch import cache_dir

        args = [*args, "--cache-dir", str(cache_dir() / "mypy")]
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
