"""`vllm-dflash` command line. Each stage module registers its own sub-commands; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vllm_dflash import __version__
from vllm_dflash.errors import DflashError

# Modules that define `register(subparsers)`; each sub-command sets `func(args) -> int` via set_defaults.
COMMAND_MODULES = (
    "vllm_dflash.pipeline.pipeline",  # build
    "vllm_dflash.pipeline.source",  # source
    "vllm_dflash.pipeline.patches",  # patches status
    "vllm_dflash.pipeline.wheel",  # wheel
    "vllm_dflash.pipeline.image",  # image
    "vllm_dflash.validate.smoke",  # validate
    "vllm_dflash.conformance.cli",  # conformance
    "vllm_dflash.publish",  # publish
    "vllm_dflash.upstream",  # upstream, rebase
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dflash",
        description="Build, validate and publish vLLM with working DFlash speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--root", type=str, default=None, help="checkout holding dist.toml (default: found from cwd)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except DflashError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.return_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
