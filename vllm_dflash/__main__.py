"""`python -m vllm_dflash` and the `vllm-dflash` script: Ctrl-C from our first instant ends with one line, exit 130.

The command modules take from a few hundred milliseconds to over a second to import. Until they are imported
nothing is written, so an interrupt then needs no clean-up: our own handler prints the line and ends the process at
once. (Letting KeyboardInterrupt fly during imports is not enough: landing inside an `exec` -- dataclasses make
their methods that way -- it makes Python end the process by SIGINT at exit, whatever we return.) From the first
stage on, KeyboardInterrupt is back, so every `finally` runs; `cli.main` says the line and returns 130.
"""

import os
import signal
import sys
from types import FrameType

_INTERRUPTED = "error: interrupted -- nothing half-written was kept; run the command again"


def _before_any_work(signum: int, frame: FrameType | None) -> None:
    os.write(2, (_INTERRUPTED + "\n").encode())
    os._exit(130)


def main() -> int:
    previous = signal.signal(signal.SIGINT, _before_any_work)
    from vllm_dflash.cli import main as cli_main

    signal.signal(signal.SIGINT, previous)
    code = cli_main()
    if code == 130:  # interrupted in a stage, cleaned up: make sure the exit status says so (see above)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return code


if __name__ == "__main__":
    sys.exit(main())
