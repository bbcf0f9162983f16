"""`vllm-dflash` command line: the only place that knows argparse. Each command module registers its sub-commands
and turns options into the typed options of one stage function; the stages know nothing of the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllm_dflash import __version__
from vllm_dflash.cli import build, cache, conformance, doctor, image, publish, release, upstream, validate
from vllm_dflash.cli.common import check_outputs
from vllm_dflash.errors import DflashError

# Sub-command groups in the order `--help` lists them.
GROUPS = (build, image, validate, conformance, doctor, release, publish, upstream, cache)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dflash",
        description="Build, validate and publish vLLM with working DFlash speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--root", type=str, default=None, help="checkout holding dist.toml (default: found from cwd)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


INTERRUPTED = "error: interrupted -- nothing half-written was kept; run the command again"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        given = list(sys.argv[1:] if argv is None else argv)
        if any("\x00" in a for a in given):  # no shell can pass one; a program calling main() might
            print("error: an argument holds a NUL byte -- pass arguments as plain text", file=sys.stderr)
            return 2
        parser = build_parser()
        args = parser.parse_args(given)
        check_outputs(args)
        code: int = args.func(args)
        return code
    except DflashError as exc:
        if exc.detail:
            print(exc.detail.rstrip(), file=sys.stderr)
        print(exc.one_line(), file=sys.stderr)
        return exc.return_code
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except OSError as exc:  # an I/O fault no stage turned into its own error: still one line, never a traceback
        from vllm_dflash.paths import storage_error

        err = storage_error(exc, exc.filename or "a file", "use")
        print(err.one_line(), file=sys.stderr)
        return err.return_code


if __name__ == "__main__":
    sys.exit(main())
