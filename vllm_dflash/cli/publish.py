"""`publish`: only what a passing validation report names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, manifest
from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.manifest import MACHINES
from vllm_dflash.oci import check_image_ref
from vllm_dflash.paths import local_destination
from vllm_dflash.publish import Gated, publish, publish_release


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "publish",
        help="publish a wheel, an image or a whole release, only with passing validation reports naming them",
        description="Refuses unless --report is a sealed, passing report of a required profile for this exact "
        "artifact; for a release directory, every platform's wheel needs its own attached report. There is no way "
        "to skip the gate.",
    )
    p.add_argument("artifact", help="a .whl file, a release directory (vllm-dflash release), or a local image")
    p.add_argument("--to", required=True, help="wheel: index directory / file:// URL or twine upload URL; image: ref")
    p.add_argument("--report", type=Path, default=None, help="the validation report (validate --report)")
    p.add_argument("--container-tool", default="docker", help="docker or podman (images)")
    p.add_argument(
        "--platform",
        action="append",
        choices=MACHINES,
        default=None,
        help="release: publish only these platforms (default: every platform dist.toml pins)",
    )
    p.add_argument("--attach-to", type=Path, default=None, help="release to an upload URL: where the other files go")
    p.add_argument(
        "--accept-declared-binding",
        action="store_true",
        help="also accept reports whose binding is 'declared' (an endpoint validate did not start: only its /version "
        "was seen to match the wheel); the index records that this was accepted",
    )
    add_pin_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.artifact.endswith(".whl") or Path(args.artifact).is_dir():  # an image's --to is a registry reference
        local_destination(args.to, "--to", PublishRefusedError)
    else:  # both reach the container tool: never an option, a space or an upper-case path
        check_image_ref(args.artifact, "image", PublishRefusedError)
        check_image_ref(args.to, "--to", PublishRefusedError)
    m = manifest(args)
    if Path(args.artifact).is_dir():
        if args.report is not None:
            raise PublishRefusedError(
                "--report is for a single artifact; a release carries its reports",
                "attach them with `release --report`",
            )
        done = publish_release(
            m, Path(args.artifact), args.to, args.platform, args.attach_to, args.accept_declared_binding
        )
        for d in done.plan.decisions:
            print(f"published {d.platform} {d.wheel.name if d.wheel else '-'} ({_judged(d.gated)})")
        print(f"index: {done.index}\nrelease files: {done.files_dir}", flush=True)
        return 0
    result = publish(m, args.artifact, args.to, args.report, args.container_tool, args.accept_declared_binding)
    print(
        f"published {result.artifact.name} ({result.artifact.sha256}) to {result.destination} "
        f"({_judged(result.gated)})",
        flush=True,
    )
    if result.pushed_digest:
        repo = args.to.rsplit(":", 1)[0] if ":" in args.to.rsplit("/", 1)[-1] else args.to
        print(f"pushed {repo}@{result.pushed_digest} (name it so in `release --image`)", flush=True)
    if result.artifact.kind == "wheel" and result.destination.startswith("file:"):
        print(f"install with: pip install --index-url {result.destination} <name>", flush=True)
    return 0


def _judged(gated: Gated | None) -> str:
    """Which report let it in, and the AL its counters give (recomputed: the report's own figure is never printed)."""
    if gated is None:
        return "no report"
    al = gated.judged.acceptance_length
    said = f"AL {al:.2f} from its counters" if al is not None else "no AL"
    from vllm_dflash.report import seal_kind

    kind = seal_kind(gated.report.data)
    seal = "keyed seal (HMAC)" if kind == "keyed" else "keyless seal (catches accidents, not forgery)"
    return f"report {gated.report.path}, profile {gated.report.profile_name}, {said}, {seal}"
