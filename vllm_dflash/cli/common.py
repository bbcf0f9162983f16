"""What every command needs first: the checkout's documents, read once."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.series import Queues, read_queues


@dataclass(frozen=True)
class Checkout:
    manifest: Manifest
    queues: Queues


def manifest(args: argparse.Namespace) -> Manifest:
    return load_manifest(Path(args.root) if args.root else None)


def checkout(args: argparse.Namespace) -> Checkout:
    """dist.toml, VERSION and both patch queues, each parsed once; stages receive these and read no file again."""
    m = manifest(args)
    return Checkout(m, read_queues(m.series_path, m.cpu_series_path))
