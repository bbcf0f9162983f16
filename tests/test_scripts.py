"""The test command of the README and docs/testing.md (scripts/test) on a machine that lacks the container tools: it
installs them as root with apt-get, and anywhere else stops loudly, or leaves out exactly the container tests when the
user opts out."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("podman", "buildah", "debootstrap", "runc", "docker-registry")
FOREIGN = "x86_64" if platform.machine() in ("aarch64", "arm64") else "aarch64"
EMULATION_TEST = "test_aarch64_image_checks_inside"  # one test of marker `emulation`


@pytest.fixture
def bare_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH has what the script needs (python, bash, coreutils) but no container tool, and whose
    `id -u` says: not root (so nothing is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "env", "dirname", "cat", "rm", "uname", "git", "sh", "head", "grep", "touch"):
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


@pytest.mark.parametrize("bad", ["two", "0", "-1", "1.5"])
def test_workers_must_be_a_whole_number(bare_path: dict[str, str], bad: str) -> None:
    r = _script({**bare_path, "VLLM_DFLASH_TEST_WORKERS": bad}, "quick", "--", "--collect-only", "-q")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: VLLM_DFLASH_TEST_WORKERS must be a whole number >= 1, not '{bad}'"
    ), r.stderr


@pytest.mark.parametrize(("workers", "xdist"), [("1", ""), ("3", "-n 3 --dist loadfile --no-loadscope-reorder ")])
def test_workers_choose_xdist_or_one_process(bare_path: dict[str, str], workers: str, xdist: str) -> None:
    """One worker runs plain pytest; more run pytest-xdist, a test file to a worker (the default, 2, is this)."""
    r = _script({**bare_path, "VLLM_DFLASH_TEST_WORKERS": workers}, "quick", "--", "--collect-only", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"+ python -m pytest {xdist}-m not heavy --collect-only -q"


def test_pins_tier_and_the_full_tier_leave_each_other_out(tools_path: dict[str, str]) -> None:
    """`scripts/test pins` runs every case on the new pins; the full tier runs their evidence cases, never those."""
    pins = _script(tools_path, "pins", "--", "--collect-only", "-q")
    assert pins.returncode == 0, pins.stderr
    assert (
        "test_every_case_on_the_new_pins" in pins.stdout
        and "test_pin_matrix_is_what_the_runs_compute" not in pins.stdout
    )
    _handler(tools_path, "PF")
    full = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert full.returncode == 0, full.stderr
    assert (
        "test_pin_matrix_is_what_the_runs_compute" in full.stdout
        and "test_every_case_on_the_new_pins" not in full.stdout
    )


# ------------------------------------------------------------------------------------ the emulation handler
def _executable(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def tools_path(bare_path: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`bare_path` plus the container tools (never run: only collected tests follow) and an empty binfmt_misc folder
    (VLLM_DFLASH_BINFMT_DIR) in place of the kernel's, so a handler registered on this machine is hidden."""
    bin_dir = Path(bare_path["PATH"])
    for tool in TOOLS:
        _executable(bin_dir / tool, "exit 0")
    binfmt = tmp_path / "binfmt_misc"
    binfmt.mkdir()
    env = {k: v for k, v in bare_path.items() if k != "VLLM_DFLASH_SKIP_EMULATION_TESTS"}
    return {**env, "VLLM_DFLASH_BINFMT_DIR": str(binfmt)}


def _handler(env: dict[str, str], flags: str, state: str = "enabled") -> None:
    text = f"{state}\ninterpreter /usr/libexec/qemu-binfmt/{FOREIGN}-binfmt-P\nflags: {flags}\noffset 0\n"
    (Path(env["VLLM_DFLASH_BINFMT_DIR"]) / f"qemu-{FOREIGN}").write_text(text)


def test_full_tier_stops_loudly_without_emulation(tools_path: dict[str, str]) -> None:
    r = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert r.returncode == 1, r.stdout[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the full tier needs a qemu-{FOREIGN} binfmt_misc handler (flag F)")
    assert "(marker 'emulation')" in line and "VLLM_DFLASH_SKIP_EMULATION_TESTS=1" in line
    assert "apt-get install qemu-user-static binfmt-support" in line
    # A handler without flag F (it would not run inside a build's chroot) and a disabled one do not count either.
    for flags, state in (("P", "enabled"), ("PF", "disabled")):
        _handler(tools_path, flags, state)
        assert _script(tools_path, "full", "--", "--collect-only", "-q").returncode == 1
    # The same machine with a usable handler: the full tier goes on, the emulation tests included.
    _handler(tools_path, "PF")
    ok = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert ok.returncode == 0, ok.stderr
    assert EMULATION_TEST in ok.stdout and "test_fast_image_builds_and_checks_inside" in ok.stdout


def test_opting_out_of_emulation_leaves_out_exactly_those_tests(tools_path: dict[str, str]) -> None:
    env = {**tools_path, "VLLM_DFLASH_SKIP_EMULATION_TESTS": "1"}
    r = _script(env, "full", "--", "--collect-only", "-q")
    assert r.returncode == 0, r.stderr
    assert "(marker 'emulation') are SKIPPED" in r.stderr
    assert EMULATION_TEST not in r.stdout
    assert "test_fast_image_builds_and_checks_inside" in r.stdout  # the other container tests still run
    selected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "emulation"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert EMULATION_TEST in selected.stdout and "test_fast_image_builds_and_checks_inside" not in selected.stdout


def _as_root(env: dict[str, str], tmp_path: Path, registers: bool) -> Path:
    """`id -u` says 0; apt-get, mount and update-binfmts are stand-ins that log their arguments (the real ones run
    in the full tier itself), and apt-get's install registers the handler when `registers`."""
    bin_dir = Path(env["PATH"])
    log = tmp_path / "calls.log"
    binfmt = Path(env["VLLM_DFLASH_BINFMT_DIR"])
    handler = f"printf 'enabled\\nflags: PF\\n' > {binfmt}/qemu-{FOREIGN}" if registers else ":"
    _executable(bin_dir / "id", "echo 0")
    _executable(bin_dir / "mount", f'echo "mount $*" >> {log}; touch {binfmt}/register')
    _executable(bin_dir / "apt-get", f'echo "apt-get $*" >> {log}; case "$*" in *install*) {handler} ;; esac; exit 0')
    _executable(bin_dir / "update-binfmts", f'echo "update-binfmts $*" >> {log}')
    return log


def test_as_root_mounts_binfmt_misc_and_installs_qemu(tools_path: dict[str, str], tmp_path: Path) -> None:
    log = _as_root(tools_path, tmp_path, registers=True)
    r = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    binfmt = tools_path["VLLM_DFLASH_BINFMT_DIR"]
    assert calls[0] == f"mount -t binfmt_misc binfmt_misc {binfmt}"
    assert any(c.startswith("apt-get install") and c.endswith("qemu-user-static binfmt-support") for c in calls)
    assert not any(c.startswith("update-binfmts") for c in calls)  # the package registered it
    assert EMULATION_TEST in r.stdout
    # Already mounted (register exists) and registered: nothing is mounted or installed again.
    log.unlink()
    again = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert again.returncode == 0 and not log.exists()


def test_as_root_switches_binfmt_misc_back_on(tools_path: dict[str, str], tmp_path: Path) -> None:
    """A handler that is fine on its own does not run while binfmt_misc's own status is `disabled`: the script
    switches it back on (as root) and goes on; left off, the run would stop (the refusal test below)."""
    log = _as_root(tools_path, tmp_path, registers=True)
    first = _script(tools_path, "full", "--", "--collect-only", "-q")  # mounts, installs, registers
    assert first.returncode == 0, first.stderr
    status = Path(tools_path["VLLM_DFLASH_BINFMT_DIR"]) / "status"
    status.write_text("disabled\n")
    log.unlink()
    r = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert r.returncode == 0, r.stderr
    assert status.read_text().strip() == "1"  # what `echo 1 > status` writes (the kernel then reports enabled)
    assert f"+ echo 1 > {status}" in r.stdout


def test_as_root_refuses_when_no_handler_appears(tools_path: dict[str, str], tmp_path: Path) -> None:
    (Path(tools_path["VLLM_DFLASH_BINFMT_DIR"]) / "register").touch()  # mounted already: no mount
    log = _as_root(tools_path, tmp_path, registers=False)
    r = _script(tools_path, "full", "--", "--collect-only", "-q")
    assert r.returncode == 1
    calls = log.read_text().splitlines()
    assert not any(c.startswith("mount") for c in calls)
    assert f"update-binfmts --enable qemu-{FOREIGN}" in calls  # tried to enable what the package installed
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: no enabled qemu-{FOREIGN} binfmt_misc handler with flag F") and " -- " in line
