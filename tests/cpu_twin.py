"""Test-only: the CPU twin image (Dockerfile target `cpu`), built once per digest of its inputs into a podman store
kept in the tool's cache, and its containers run as the stacks run them.

The inputs are the Dockerfile, our CPU wheel (its sha256), the CPU runtime environment (its cache key) and the
debootstrapped base: the image is tagged `localhost/vllm-dflash-cpu-<key>` and a warm run finds it there. The store
keeps layers, so a new wheel on the same environment adds one layer (~0.6 GB) and never copies the environment's
~6 GB again. The environment comes in parts of ~1 GB, a layer each (the Dockerfile's cpu-env-N stages), so the
build's temporary space holds one part at a time. With the overlay driver (where the kernel mounts it) a container
costs no copy of the image, and the environment's layers share their files (hard links) with the cache's
environment as soon as the build commits each one, so the cache holds them once (a part or two twice, while the
build runs). vfs is the fallback where overlay cannot mount: correct, but each layer and container is a full copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_dflash import envs
from vllm_dflash.fetch import cache_dir, fetch, sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline import image as img
from vllm_dflash.pipeline.build import cached_build
from vllm_dflash.series import read_queues
from vllm_dflash.validate.server import free_port

REPO = Path(__file__).resolve().parents[1]
SOURCE = "https://example.invalid/vllm-dflash"
REPO_PREFIX = "localhost/vllm-dflash-cpu-"
BASE_REPO = "localhost/vllm-dflash-cpu-base"
# How podman runs here (tests/test_image.py: PODMAN_RUN, RUN_FLAGS), plus the loopback port the stacks' 8000 maps to.
PODMAN_RUN = ("--runtime", "runc", "--cgroup-manager", "cgroupfs")
ULIMITS = ("--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096")
ARBITRARY_USER = "1000650000:0"  # OpenShift's kind of UID: no passwd entry, group 0


def store_root() -> Path:
    return cache_dir() / "containers" / "cpu-twin"


def storage_driver() -> str:
    """overlay when this kernel mounts an overlay here (as root), else vfs."""
    probe = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=cache_dir()))
    try:
        for d in ("l", "u", "w", "m"):
            (probe / d).mkdir()
        opts = f"lowerdir={probe / 'l'},upperdir={probe / 'u'},workdir={probe / 'w'}"
        mounted = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(probe / "m")], capture_output=True, check=False
        )
        if mounted.returncode != 0:
            return "vfs"
        subprocess.run(["umount", str(probe / "m")], capture_output=True, check=False)
        return "overlay"
    finally:
        shutil.rmtree(probe, ignore_errors=True)


@dataclass(frozen=True)
class Twin:
    tag: str
    digest: str
    options: img.ImageOptions
    wheel: Path
    env: Path
    built_s: float | None  # None: found in the store (warm)
    size_bytes: int
    base_bytes: int
    # Bytes of the environment's layers the build's end still found unshared with the cache's environment (0: every
    # layer was linked as soon as an image held it; None: not built now, or a driver without plain layer directories).
    left_after_build: int | None = None

    @property
    def prefix(self) -> list[str]:
        return img.tool_prefix("podman", self.options)


def _inputs_key(wheel: Path, env: Path, base_tarball: Path, driver: str) -> str:
    h = hashlib.sha256()
    for part in (
        (REPO / "Dockerfile").read_bytes(),
        sha256_file(wheel).encode(),
        env.name.encode(),
        sha256_file(base_tarball).encode(),
        driver.encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _exists(prefix: Sequence[str], ref: str) -> bool:
    return subprocess.run([*prefix, "image", "exists", ref], capture_output=True, check=False).returncode == 0


def _inspect(prefix: Sequence[str], ref: str) -> dict[str, object]:
    out = subprocess.run([*prefix, "image", "inspect", ref], check=True, capture_output=True, text=True).stdout
    data: dict[str, object] = json.loads(out)[0]
    return data


def _share_with_env(prefix: Sequence[str], tag: str, env: Path) -> int:
    """Hard-link the environment layers' files to the cache's environment (same bytes, mode, owner): the cache then
    holds them once. Only overlay keeps a layer as a plain directory tree of its own files."""
    info = _inspect(prefix, tag)
    driver = info.get("GraphDriver")
    if not isinstance(driver, dict) or driver.get("Name") != "overlay":
        return 0
    data = driver.get("Data") or {}
    dirs = [*str(data.get("LowerDir") or "").split(":"), str(data.get("UpperDir") or "")]
    shared = 0
    for d in (Path(x) for x in dirs if x):
        venv = d / "opt" / "venv"
        if (venv / "lib").is_dir():  # a layer of the environment's parts (stages cpu-env-N, cpu-runtime) or the wheel's
            shared += envs.share_identical(venv, [env])
    return shared


def _committed_env_layers(graph: Path) -> list[Path]:
    """`opt/venv` of every layer a committed image in the store at `graph` holds (an image is written only once its
    layers are complete) that carries the environment's files. Empty while the store's records are not yet written."""
    try:
        images = json.loads((graph / "overlay-images" / "images.json").read_text())
        layers = {rec["id"]: rec for rec in json.loads((graph / "overlay-layers" / "layers.json").read_text())}
    except (OSError, ValueError, KeyError, TypeError):
        return []
    found: list[Path] = []
    seen: set[str] = set()
    for image in images:
        layer_id = image.get("layer") if isinstance(image, dict) else None
        while isinstance(layer_id, str) and layer_id not in seen:
            seen.add(layer_id)
            venv = graph / "overlay" / layer_id / "diff" / "opt" / "venv"
            if (venv / "lib").is_dir():
                found.append(venv)
            layer_id = layers.get(layer_id, {}).get("parent")
    return found


# Run by _share_outside_store in a mount namespace of its own: bind the directory holding both the store and the
# environment (not recursively, so without the store's own mount) and link there.
_SHARE_SCRIPT = """
import subprocess, sys
from pathlib import Path
from vllm_dflash import envs
top, mount, env, *venvs = map(Path, sys.argv[1:])
subprocess.run(["mount", "--bind", str(top), str(mount)], check=True)
print(sum(envs.share_identical(mount / v.relative_to(top), [mount / env.relative_to(top)]) for v in venvs))
"""


def _share_outside_store(top: Path, venvs: list[Path], env: Path) -> int:
    """envs.share_identical for layers of a store podman is using: c/storage then bind-mounts the store's overlay
    directory onto itself, and Linux refuses a hard link across two mounts (EXDEV) even on one file system. A child
    in its own mount namespace sees `top` (which holds the store and `env`) through one plain bind and links there;
    that bind ends with the child. 0 where that cannot run (no root, no unshare): the build's end shares them."""
    with tempfile.TemporaryDirectory(prefix="twin-share-") as mount:
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _SHARE_SCRIPT]
        res = subprocess.run(
            [*cmd, str(top), mount, str(env), *map(str, venvs)], capture_output=True, text=True, check=False
        )
    out = res.stdout.strip().splitlines()
    return int(out[-1]) if res.returncode == 0 and out and out[-1].isdigit() else 0


@contextlib.contextmanager
def _share_as_committed(graph: Path, env: Path, every_s: float = 5.0, top: Path | None = None) -> Iterator[list[int]]:
    """While the build runs, hard-link each environment layer's files to the cache's environment as soon as an image
    holds that layer, so the store never holds the whole environment beside the cache's (each part is ~1 GB; the
    cache's peak was the environment twice). `graph` and `env` are both under `top` (default: the cache directory).
    Yields a one-item list: the bytes shared so far."""
    stop = threading.Event()
    done: set[Path] = set()
    shared = [0]
    top = top or cache_dir()

    def sweep() -> None:
        if new := [venv for venv in _committed_env_layers(graph) if venv not in done]:
            done.update(new)
            shared[0] += _share_outside_store(top, new, env)

    def loop() -> None:
        while not stop.wait(every_s):
            sweep()

    sharer = threading.Thread(target=loop, name="twin-layer-sharer", daemon=True)
    sharer.start()
    try:
        yield shared
    finally:
        stop.set()
        sharer.join()
        sweep()  # what was committed after the last poll


def _collect(prefix: Sequence[str], keep: str) -> None:
    """Remove this store's other twin images (unless a container uses one) and the layers only they held, keeping
    every image the kept one is built on (its cached stages)."""
    listing = subprocess.run(
        [*prefix, "images", "-a", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split("\n")
    keep_ids: set[str] = set()
    ref: str | None = keep
    while ref:
        info = _inspect(prefix, ref)
        keep_ids.add(str(info["Id"])[:12])
        ref = str(info.get("Parent") or "") or None
    for line in listing:
        if not line.strip():
            continue
        image_id, name = line.split(" ", 1)
        if image_id[:12] in keep_ids or name.startswith(BASE_REPO):
            continue
        if name.startswith(REPO_PREFIX) or name.startswith("<none>"):
            subprocess.run([*prefix, "rmi", image_id], capture_output=True, check=False)


def ensure_twin(manifest: Manifest) -> Twin:
    """The CPU twin of this checkout's CPU build, from the store when its inputs are unchanged."""
    from test_image import _base_tarball  # the debootstrapped base image, cached

    machine = platform.machine()
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    wheel = cached_build(manifest, queues, "cpu", "dflash")
    env = envs.ensure_venv(envs.cpu_base_spec(fetch(manifest.cpu_wheels[machine])))
    tarball = _base_tarball()
    root = store_root()
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root.parent / ".cpu-twin.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers and other runs: one builds, the others find it built
        driver_file = root / "driver"
        driver = driver_file.read_text().strip() if driver_file.is_file() else storage_driver()
        driver_file.write_text(driver)
        key = _inputs_key(wheel, env, tarball, driver)
        base = f"{BASE_REPO}:{sha256_file(tarball)[:12]}"
        opts = img.ImageOptions(
            target="cpu",
            tool="podman",
            storage_root=root,
            storage_driver=driver,
            isolation="chroot",
            repo=f"{REPO_PREFIX}{key}",
            base_image=base,
            layers=True,
            cpu_env=env,
        )
        prefix = img.tool_prefix("podman", opts)
        labels = img.labels_from_wheel(wheel, SOURCE)
        tag = img.image_tag(labels.version, opts.repo) + "-cpu"
        built_s: float | None = None
        left: int | None = None
        if not _exists(prefix, tag):
            if not _exists(prefix, base):
                subprocess.run([*prefix, "import", str(tarball), base], check=True, capture_output=True)
            t0 = time.monotonic()
            graph = root / "root"
            with _share_as_committed(graph, env) if driver == "overlay" else contextlib.nullcontext([0]) as early:
                img.build_image(labels, REPO / "Dockerfile", wheel, opts)
            built_s = time.monotonic() - t0
            after = _share_with_env(prefix, tag, env)
            left = after if driver == "overlay" else None
            print(
                f"CPU twin {tag}: built in {built_s:.0f} s ({driver}); {(early[0] + after) / 2**30:.1f} GiB shared "
                f"with {env}, {early[0] / 2**30:.1f} GiB of it as the build committed it"
            )
            _collect(prefix, tag)
        info = _inspect(prefix, tag)
        base_info = _inspect(prefix, base)
        twin = Twin(
            tag=tag,
            digest="sha256:" + str(info["Id"]).removeprefix("sha256:"),
            options=replace(opts),
            wheel=wheel,
            env=env,
            built_s=built_s,
            left_after_build=left,
            size_bytes=int(str(info["Size"])),
            base_bytes=int(str(base_info["Size"])),
        )
    return twin


# ---------------------------------------------------------------------------------------------------------------
# Running it


@dataclass(frozen=True)
class Container:
    name: str
    url: str  # http://127.0.0.1:PORT, the container's 8000
    command: tuple[str, ...]  # what `podman run` was given after the image name (and its entrypoint)


def run_command(
    twin: Twin,
    name: str,
    port: int,
    args: Sequence[str],
    entrypoint: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    mounts: Sequence[str] = (),
    user: str = ARBITRARY_USER,
    container_port: int = 8000,
) -> list[str]:
    """`podman run -d` of the twin by its ID, as a stack runs it: an arbitrary UID in group 0, the server's port
    published on loopback only, the image's entrypoint unless `entrypoint` overrides it (a Kubernetes `command`)."""
    cmd = [*twin.prefix, "run", "-d", "--name", name, *PODMAN_RUN, *ULIMITS, "--no-healthcheck"]
    cmd += ["--user", user, "-p", f"127.0.0.1:{port}:{container_port}"]
    for mount in mounts:
        cmd += ["-v", mount]
    for key, value in sorted((env or {}).items()):
        cmd += ["-e", f"{key}={value}"]
    if entrypoint is not None:
        cmd += ["--entrypoint", json.dumps(list(entrypoint))]
    return [*cmd, twin.digest, *args]


@contextlib.contextmanager
def container(
    twin: Twin,
    args: Sequence[str],
    entrypoint: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    mounts: Sequence[str] = (),
    user: str = ARBITRARY_USER,
    container_port: int = 8000,
) -> Iterator[Container]:
    """One running container of the twin; removed afterwards, whatever happened."""
    name = f"vllm-dflash-twin-{free_port()}-{time.monotonic_ns() % 10**6}"
    port = free_port()
    cmd = run_command(twin, name, port, args, entrypoint, env, mounts, user, container_port)
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    try:
        yield Container(name, f"http://127.0.0.1:{port}", tuple(args))
    finally:
        subprocess.run([*twin.prefix, "rm", "-f", "-t", "5", name], capture_output=True, check=False)


def logs(twin: Twin, name: str, lines: int = 60) -> str:
    res = subprocess.run([*twin.prefix, "logs", "--tail", str(lines), name], capture_output=True, text=True)
    return (res.stdout or "") + (res.stderr or "")
