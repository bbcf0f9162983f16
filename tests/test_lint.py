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
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
