"""What every command needs first: the checkout's documents, read once, and its output paths, checked once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.paths import check_output_dir, check_output_file
from vllm_dflash.series import Queues, read_queues


@dataclass(frozen=True)
class Checkout:
    manifest: Manifest
    queues: Queues


def add_pin_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pin",
        metavar="VERSION",
        default=None,
        help="which pinned vLLM release (dist.toml [upstream], or a [pins.VERSION] table; default: [upstream]): its "
        "artifacts, its queues (patches/VERSION/), its distribution version",
    )


def manifest(args: argparse.Namespace) -> Manifest:
    """dist.toml and VERSION as the chosen pin (`--pin`, where the command has it) sees them."""
    return load_manifest(Path(args.root) if args.root else None).for_pin(getattr(args, "pin", None))


def checkout(args: argparse.Namespace) -> Checkout:
    """dist.toml, VERSION and both patch queues, each parsed once; stages receive these and read no file again."""
    m = manifest(args)
    return Checkout(m, read_queues(m.series_path, m.cpu_series_path))


# Every option that names where a command writes: (command, option attribute, "dir" | "tree" | "file"). Checked in
# `main` right after parsing, before any command reads or writes anything (publish --to: cli/publish.py, own rules).
OUTPUTS: tuple[tuple[str, str, str], ...] = (
    ("build", "out", "dir"),
    ("wheel", "out", "dir"),
    ("source", "dest", "tree"),  # an existing --dest is judged by the source stage (reused or refused)
    ("release", "out", "dir"),
    ("validate", "report", "file"),
    ("conformance", "report", "file"),
)


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before the first stage, an output that cannot be written or would replace what is not ours."""
    for command, attr, kind in OUTPUTS:
        value = getattr(args, attr, None) if getattr(args, "command", None) == command else None
        if value is None:
            continue
        flag = f"--{attr}"
        if kind in ("dir", "tree"):
            check_output_dir(Path(value), flag, probe_existing=kind == "dir")
        else:
            check_output_file(Path(value), flag, probe=True)
