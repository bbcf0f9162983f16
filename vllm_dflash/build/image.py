"""Placeholder: the 'image' command is being written (see the issue that owns it)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("image", help="(not yet implemented)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    raise NotImplementedError("image")
