"""The README's test command (scripts/test) on a machine that lacks the container tools: it installs them as root
with apt-get, and anywhere else stops loudly, or leaves out exactly the container tests when the user opts out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("podman", "buildah", "debootstrap", "runc")


@pytest.fixture
def bare_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has what the script needs (python, bash, coreutils) but no container tool, and whose
    `id -u` says: not root (so nothing is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env", "dirname", "cat", "rm", "uname", "git", "sh"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True, check=False)
        if found.stdout.strip():
            os.symlink(found.stdout.strip(), bin_dir / tool)
    # A wrapper, not a link: a venv's python knows it is one only when started from the venv's own bin/.
    for name, body in (("python", f'exec {sys.executable} "$@"'), ("id", "echo 1000")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DFLASH_SKIP_CONTAINER_TESTS"}
    env["PATH"] = str(bin_dir)
    return env


def _script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["bash", str(REPO / "scripts" / "test"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)


def test_full_tier_stops_loudly_without_the_tools(bare_path: dict[str, str]) -> None:
    r = _script(bare_path, "full", "--", "--collect-only", "-q")
    assert r.returncode == 1
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the full tier needs podman buildah debootstrap runc") and "containers" in line
    assert "VLLM_DFLASH_SKIP_CONTAINER_TESTS=1" in line


def test_opting_out_leaves_out_exactly_the_container_tests(bare_path: dict[str, str]) -> None:
    env = {**bare_path, "VLLM_DFLASH_SKIP_CONTAINER_TESTS": "1"}
    r = _script(env, "full", "--", "--collect-only", "-q")
    assert r.returncode == 0, r.stderr
    assert "container tests (marker 'containers') are SKIPPED" in r.stderr
    assert "test_fast_image_builds_and_checks_inside" not in r.stdout
    assert "test_build_survives_a_kill_at_every_step" in r.stdout  # everything else still runs
    everything = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "containers"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "test_fast_image_builds_and_checks_inside" in everything.stdout  # the marker does select them


def test_unknown_tier_and_quick_tier(bare_path: dict[str, str]) -> None:
    bad = _script(bare_path, "nightly")
    assert bad.returncode == 2 and "unknown tier 'nightly'" in bad.stderr
    quick = _script(bare_path, "quick", "--", "--collect-only", "-q")
    assert quick.returncode == 0 and "heavy" in quick.stdout + quick.stderr
    assert "test_build_survives_a_kill_at_every_step" not in quick.stdout
