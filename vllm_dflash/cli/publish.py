"""`publish`: only what a passing validation report names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import manifest
from vllm_dflash.publish import publish


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "publish",
        help="publish a wheel or image, only with a passing validation report naming it",
        description="Refuses unless --report is a sealed, passing report of a required profile for this exact "
        "artifact. There is no way to skip the gate.",
    )
    p.add_argument("artifact", help="a .whl file, or a local container image reference")
    p.add_argument("--to", required=True, help="wheel: index directory / file:// URL or twine upload URL; image: ref")
    p.add_argument("--report", type=Path, default=None, help="the validation report (validate --report)")
    p.add_argument("--container-tool", default="docker", help="docker or podman (images)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = publish(manifest(args), args.artifact, args.to, args.report, args.container_tool)
    print(
        f"published {result.artifact.name} ({result.artifact.sha256}) to {result.destination} "
        f"(report {result.report}, profile {result.profile})",
        flush=True,
    )
    if result.artifact.kind == "wheel" and result.destination.startswith("file:"):
        print(f"install with: pip install --index-url {result.destination} <name>", flush=True)
    return 0
