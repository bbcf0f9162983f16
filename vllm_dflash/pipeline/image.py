"""`vllm-dflash image`: the container image for GPU nodes, built with docker, podman or buildah from the Dockerfile.

The `fast` target installs the exact wheel from dist/ on upstream's release image; the `full` target compiles it
in a CUDA builder stage. Either way the image is tagged `<repo>:<upstream version>-dflash.<N>` and carries OCI
labels naming the upstream tag and commit, the patch queue and our version.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import ContainerError, ToolchainError
from vllm_dflash.manifest import Manifest, load_manifest

TARGETS = ("fast", "full")
TOOLS = ("docker", "podman", "buildah")
DEFAULT_REPO = "vllm-dflash"
DOCKERFILE = "Dockerfile"
# Wheel platform tags an image for this machine can install (py3-none-any covers test wheels and pure builds).
_MACHINE_TAGS = {"x86_64": ("x86_64", "any"), "aarch64": ("aarch64", "any"), "arm64": ("aarch64", "any")}
# Label keys the Dockerfile writes; checked after every build so a stale Dockerfile cannot ship unlabelled images.
LABEL_VERSION = "org.opencontainers.image.version"
LABEL_SOURCE = "org.opencontainers.image.source"
LABEL_UPSTREAM_TAG = "io.vllm-dflash.upstream.tag"
LABEL_UPSTREAM_COMMIT = "io.vllm-dflash.upstream.commit"
LABEL_PATCHES = "io.vllm-dflash.patches"
REQUIRED_LABELS = (LABEL_VERSION, LABEL_SOURCE, LABEL_UPSTREAM_TAG, LABEL_UPSTREAM_COMMIT, LABEL_PATCHES)


@dataclass(frozen=True)
class ImageOptions:
    target: str = "fast"
    tool: str | None = None  # None: docker when its daemon answers, else podman, else buildah
    base_image: str | None = None  # fast target: overrides the Dockerfile's pinned vllm/vllm-openai
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


@dataclass(frozen=True)
class ImageResult:
    tag: str
    digest: str  # the image ID: sha256 of the image config, what `<tool> images --digests`/inspect show
    tool: str
    target: str
    wheel: Path | None = None
    seconds: float = 0.0
    labels: Mapping[str, str] = field(default_factory=dict)


def image_tag(manifest: Manifest, repo: str = DEFAULT_REPO) -> str:
    """`<repo>:0.20.1-dflash.N`: the distribution version with '+' (not allowed in tags) turned into '-'."""
    return f"{repo}:{manifest.version.replace('+', '-')}"


def patch_names(manifest: Manifest) -> tuple[str, ...]:
    """Patch file names in series order (what the image label lists)."""
    path = manifest.series_path
    if not path.is_file():
        return ()
    names = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            names.append(entry.split()[0])
    return tuple(names)


def source_url(manifest: Manifest, override: str | None = None) -> str:
    """Where this distribution's source lives: option, dist.toml [distribution].source_url, git origin, upstream."""
    if override:
        return override
    dist = manifest.raw.get("distribution", {})
    if isinstance(dist, Mapping) and isinstance(dist.get("source_url"), str):
        return str(dist["source_url"])
    if (manifest.root / ".git").exists() and shutil.which("git"):
        res = proc.call(
            "git", "-C", manifest.root, "remote", "get-url", "origin", capture=True, check=False, quiet=True
        )
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout.strip()
    return manifest.upstream.git_url


def find_wheel(manifest: Manifest, machine: str | None = None) -> Path:
    """The one wheel of this exact distribution version for this machine in dist/; refuse none or several."""
    machine = machine or platform.machine()
    dist = manifest.dist_dir
    prefix = f"vllm-{manifest.version}-"
    candidates = sorted(dist.glob(f"{prefix}*.whl")) if dist.is_dir() else []
    arch_ok = _MACHINE_TAGS.get(machine, (machine, "any"))
    fitting = [w for w in candidates if w.name.removesuffix(".whl").rsplit("-", 1)[-1].endswith(arch_ok)]
    if not fitting:
        others = sorted(p.name for p in dist.glob("vllm-*.whl")) if dist.is_dir() else []
        seen = f" (dist/ has {', '.join(others)})" if others else ""
        raise ContainerError(
            f"no wheel of vllm {manifest.version} for {machine} in {dist}{seen}",
            "build it first with `vllm-dflash build` (or pass --wheel PATH)",
        )
    if len(fitting) > 1:
        raise ContainerError(
            f"{len(fitting)} wheels of vllm {manifest.version} in {dist}: {', '.join(w.name for w in fitting)}",
            "remove the stale one or pass --wheel PATH",
        )
    return fitting[0]


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


def tool_prefix(tool: str, options: ImageOptions) -> list[str]:
    """The tool and its global storage flags (podman/buildah keep images in `storage_root` when given)."""
    args = [tool]
    if tool in ("podman", "buildah"):
        if options.storage_root is not None:
            args += ["--root", str(options.storage_root / "root"), "--runroot", str(options.storage_root / "run")]
        if options.storage_driver:
            args += ["--storage-driver", options.storage_driver]
    return args


def build_args(manifest: Manifest, options: ImageOptions, wheel: Path | None) -> dict[str, str]:
    args = {
        "DFLASH_VERSION": manifest.version,
        "UPSTREAM_TAG": manifest.upstream.tag,
        "UPSTREAM_COMMIT": manifest.upstream.commit,
        "DFLASH_PATCHES": ",".join(patch_names(manifest)),
        "SOURCE_URL": source_url(manifest, options.source_url),
    }
    if wheel is not None:
        args["WHEEL"] = wheel.name
    if options.base_image:
        args["BASE_IMAGE"] = options.base_image
    args.update(options.build_args)
    return args


def build_command(
    tool: str, options: ImageOptions, dockerfile: Path, context: Path, tag: str, iidfile: Path, args: Mapping[str, str]
) -> list[str]:
    cmd = tool_prefix(tool, options)
    cmd += ["bud"] if tool == "buildah" else ["build"]
    if tool in ("podman", "buildah"):
        # HEALTHCHECK exists only in the docker image format; OCI images silently drop it.
        cmd += ["--format", "docker", f"--layers={'true' if options.layers else 'false'}"]
        if options.isolation:
            cmd += ["--isolation", options.isolation]
    if options.network:
        cmd += ["--network", options.network]
    cmd += ["-f", str(dockerfile), "--target", options.target, "-t", tag, "--iidfile", str(iidfile)]
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


def build_image(manifest: Manifest, wheel: Path | None, options: ImageOptions) -> ImageResult:
    """Build the image for `options.target`, tag it and return its digest. `wheel` is required for `fast`."""
    if options.target not in TARGETS:
        raise ContainerError(f"unknown image target '{options.target}'", f"use one of {', '.join(TARGETS)}")
    dockerfile = (options.dockerfile or manifest.root / DOCKERFILE).resolve()
    if not dockerfile.is_file():
        raise ContainerError(f"{dockerfile} does not exist", "run from a vllm-dflash checkout or pass --root")
    if options.target == "fast":
        if wheel is None or not wheel.is_file():
            raise ContainerError(f"wheel {wheel} does not exist", "build it with `vllm-dflash build` first")
        if not wheel.name.startswith(f"vllm-{manifest.version}-"):
            raise ContainerError(
                f"{wheel.name} is not a wheel of vllm {manifest.version} (VERSION)",
                "rebuild the wheel with `vllm-dflash build` or fix VERSION",
            )
    tool = pick_tool(options.tool)
    tag = image_tag(manifest, options.repo)
    args = build_args(manifest, options, wheel if options.target == "fast" else None)
    from vllm_dflash.fetch import cache_dir

    scratch = cache_dir() / "image-build"
    scratch.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=scratch))
    try:
        context = _stage_context(wheel, work) if options.target == "fast" and wheel else manifest.root
        iidfile = work / "iid"
        cmd = build_command(tool, options, dockerfile, context, tag, iidfile, args)
        env = {"DOCKER_BUILDKIT": "1"} if tool == "docker" else {}  # RUN --mount needs BuildKit
        print(f"building {tag} ({options.target} target) with {tool}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc.call(*cmd, env=env, error=ContainerError, hint=f"see the {tool} output above")
        seconds = time.monotonic() - t0
        digest = iidfile.read_text().strip() if iidfile.is_file() else ""
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not digest:
        raise ContainerError(f"{tool} built {tag} but reported no image id", "check the tool's version (--iidfile)")
    if not digest.startswith("sha256:"):
        digest = f"sha256:{digest}"
    labels = image_labels(inspect_image(tool, options, tag))
    missing = [k for k in REQUIRED_LABELS if k not in labels]
    if missing or labels.get(LABEL_VERSION) != manifest.version:
        raise ContainerError(
            f"image {tag} lacks labels {', '.join(missing) or LABEL_VERSION + '=' + manifest.version}",
            f"the Dockerfile at {dockerfile} is not this version's; restore it",
        )
    return ImageResult(
        tag=tag, digest=digest, tool=tool, target=options.target, wheel=wheel, seconds=seconds, labels=labels
    )


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "image",
        help="build the container image from the wheel in dist/ and tag it <repo>:<version>",
        description=__doc__,
    )
    p.add_argument(
        "--target", choices=TARGETS, default="fast", help="fast: upstream image + wheel (default); full: compile"
    )
    p.add_argument("--tool", choices=TOOLS, default=None, help="container tool (default: docker, podman, buildah)")
    p.add_argument("--base-image", default=None, help="fast target: base image (default: pinned vllm/vllm-openai)")
    p.add_argument("--tag", dest="repo", default=DEFAULT_REPO, help=f"image repository (default: {DEFAULT_REPO})")
    p.add_argument("--wheel", type=Path, default=None, help="the wheel to install (default: the one in dist/)")
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="extra build argument")
    p.add_argument("--storage-root", type=Path, default=None, help="podman/buildah: private image storage directory")
    p.add_argument("--storage-driver", default=None, help="podman/buildah: storage driver (e.g. vfs)")
    p.add_argument("--isolation", default=None, help="podman/buildah: build isolation (e.g. chroot)")
    p.add_argument("--network", default=None, help="RUN steps' network, e.g. none (not with chroot)")
    p.set_defaults(func=run)


def _parse_build_args(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ContainerError(f"--build-arg '{item}' is not KEY=VALUE", "write e.g. --build-arg MAX_JOBS=4")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.root) if args.root else None)
    wheel: Path | None = None
    if args.target == "fast":
        wheel = args.wheel.resolve() if args.wheel is not None else find_wheel(manifest)
    options = ImageOptions(
        target=args.target,
        tool=args.tool,
        base_image=args.base_image,
        repo=args.repo,
        storage_root=args.storage_root,
        storage_driver=args.storage_driver,
        isolation=args.isolation,
        network=args.network,
        build_args=_parse_build_args(args.build_arg),
    )
    result = build_image(manifest, wheel, options)
    print(f"built {result.tag} with {result.tool} in {result.seconds:.0f} s", file=sys.stderr)
    print(f"{result.tag}\ndigest={result.digest}")
    return 0
