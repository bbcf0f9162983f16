"""Crash safety as a property (issue 10): `build` killed at any point — mid-download, and at every command it echoes,
by SIGKILL or Ctrl-C (SIGINT to its process group) — leaves nothing that the next run trusts or trips over. The run
after the last kill succeeds and gives the same wheel, byte for byte, as an undisturbed build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from conftest import Checkout, http_server, make_checkout, send_simple_page

from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import temporary_pid

MACHINE = "x86_64"


@pytest.fixture
def slow_index(manifest: Manifest, real_cache: Path) -> Iterator[str]:
    """A real PEP 691 index on 127.0.0.1 serving the pinned sdist slowly (so a kill lands mid-download) and the
    pinned wheel at full speed."""
    downloads = real_cache / "downloads"
    files = {
        manifest.sdist.filename: (downloads / manifest.sdist.filename, 0.05),
        manifest.wheels[MACHINE].filename: (downloads / manifest.wheels[MACHINE].filename, 0.0),
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = [p for p in self.path.split("/") if p]
            if len(parts) == 2 and parts[0] == "simple" and parts[1] == "vllm":
                send_simple_page(self, "vllm", {n: p.stat().st_size for n, (p, _) in files.items()})
                return
            if len(parts) == 3 and parts[0] == "files" and parts[2] in files:
                path, pause = files[parts[2]]
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with path.open("rb") as fh:
                    while chunk := fh.read(1 << 20):
                        try:
                            self.wfile.write(chunk)
                        except OSError:
                            return  # the client was killed
                        time.sleep(pause)
                return
            self.send_error(404)

    with http_server(Handler) as url:
        yield f"{url}/simple"


def _start(co: Checkout, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(co.root), "build", "--source", "sdist"]
    cmd += ["--platform", MACHINE]
    return subprocess.Popen(
        cmd,
        env={**os.environ, "VLLM_DFLASH_CACHE": str(co.cache), **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the kill reaches git too, as Ctrl-C or a stop would
    )


def _kill(popen: subprocess.Popen[str], sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass
    popen.wait(timeout=120)
    if sig == signal.SIGINT:  # Ctrl-C: the tool's own handler prints one line, then whatever is left is killed
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _dist_is_sound(co: Checkout) -> None:
    """Whatever a kill left in dist/: nothing, or complete wheels only (never a temporary under a final name), and
    every temporary in dist/ and the cache carries the project mark (issue 19: the sweep removes nothing else)."""
    for path in [*co.cache.glob("*/.*"), *co.dist.glob(".*")]:
        if path.name.endswith((".part", ".tmp", ".unpack")):
            assert temporary_pid(path.name) is not None, f"an unmarked temporary: {path}"
    for path in co.dist.glob("*") if co.dist.exists() else []:
        if path.name.startswith("."):
            continue  # a dead writer's temporary: hidden, never trusted, swept by the next run
        assert path.suffix == ".whl", path
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None


@pytest.mark.slow
def test_build_survives_a_kill_at_every_step(
    checkout: Checkout, tmp_path: Path, slow_index: str, manifest: Manifest
) -> None:
    # The undisturbed build (shared downloads, a prepared tree): the bytes every recovered run must give.
    queue = sorted((Path(__file__).parents[1] / "patches").glob("0*.patch"))
    checkout.set_series(*queue)
    ref = checkout.cli("build", "--source", "sdist", "--platform", MACHINE)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (want,) = checkout.dist.glob("*.whl")
    want_sha = sha256_file(want)

    # A fresh checkout and an EMPTY cache: everything is downloaded (from the local index) and made anew.
    co = make_checkout(tmp_path / "killed", tmp_path / "killed-cache")
    co.set_series(*queue)
    env = {"VLLM_DFLASH_INDEX_URL": slow_index}

    # 1. Mid-download: killed once the sdist's .part file has bytes in it.
    popen = _start(co, env)
    downloads = co.cache / "downloads"
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size > 0 for p in downloads.glob(".*.part")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert popen.poll() is None, "the download finished before it could be interrupted"
    _kill(popen, signal.SIGKILL)
    assert not (downloads / manifest.sdist.filename).exists()  # nothing unverified under the artifact's name

    # 2. At the k-th command the build echoes, k = 1, 2, ...: SIGKILL and SIGINT in turn, each run starting from
    # whatever the previous kill left, until a run finishes before reaching its k-th command.
    kills: list[str] = []
    k = 0
    while True:
        k += 1
        sig = signal.SIGKILL if k % 2 else signal.SIGINT
        popen = _start(co, env)
        assert popen.stderr is not None
        seen = 0
        killed_at = ""
        for line in popen.stderr:
            if line.startswith("+ "):
                seen += 1
                if seen == k:
                    killed_at = line.strip()
                    _kill(popen, sig)
                    break
        if not killed_at:
            assert popen.wait(timeout=600) == 0, f"the run after {len(kills)} kills failed"
            break
        kills.append(f"{signal.Signals(sig).name} at {killed_at[:100]}")
        _dist_is_sound(co)
        assert k < 60, "the build never completed"

    print("\n" + "\n".join(kills))
    assert len(kills) >= 8, kills  # the sequence reached the source, patch and wheel stages
    (got,) = co.dist.glob("*.whl")
    assert sha256_file(got) == want_sha, "the build after the kills gives other bytes"
    leftovers = [p for p in co.cache.rglob(".*") if p.name.endswith((".part", ".tmp", ".unpack"))]
    leftovers += [p for p in co.dist.glob(".*")]  # the checkout's own dist/ is swept too
    assert not leftovers, leftovers  # the last run swept what the dead runs left
