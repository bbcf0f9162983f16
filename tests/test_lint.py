"""The project's code, its tests and benchmarks included, stays ruff- and mypy-clean (strict); a lint failure fails the
test command (mypy over the tests finds what only a heavy test would run: an accessor called that no longer exists)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def module_set_key(root: Path = REPO) -> str:
    """A short hash of the Python files mypy checks under `root` (their paths, not their contents)."""
    import hashlib

    files = (p for d in ("vllm_dflash", "tests", "benchmarks") for p in (root / d).rglob("*.py"))
    return hashlib.sha256("\n".join(sorted(str(p.relative_to(root)) for p in files)).encode()).hexdigest()[:12]


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
        # One cache per set of modules: an entry whose file is unchanged can still name a module another checkout
        # has and this one has not (mypy then stops with an INTERNAL ERROR, "Cannot find component"), so checkouts
        # of different module sets never share one.
        from vllm_dflash.fetch import cache_dir

        args = [*args, "--cache-dir", str(cache_dir() / "mypy" / module_set_key())]
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_mypy_cache_is_one_per_module_set(tmp_path: Path) -> None:
    """A module added or removed moves the key; an edit inside a file does not."""
    (tmp_path / "vllm_dflash" / "doctor").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    ours = tmp_path / "vllm_dflash" / "doctor" / "ours.py"
    ours.write_text("x = 1\n")
    (tmp_path / "tests" / "test_x.py").write_text("")
    key = module_set_key(tmp_path)
    ours.write_text("x = 2\n")
    assert module_set_key(tmp_path) == key
    ours.unlink()
    assert module_set_key(tmp_path) != key
    assert module_set_key() != key  # this checkout's own set
