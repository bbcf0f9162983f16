"""`python -m vllm_dflash` and the `vllm-dflash` script: Ctrl-C from the first instant ends with one line.

The command modules take a few hundred milliseconds to import; an interrupt then, or before the first stage, is
caught here (exit 130, no traceback). Nothing is written before a stage runs, so there is nothing to clean up.
"""

import sys

_INTERRUPTED = "error: interrupted -- nothing half-written was kept; run the command again"


def main() -> int:
    try:
        from vllm_dflash.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:  # during the imports; cli.main catches it from parsing on
        print(_INTERRUPTED, file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
