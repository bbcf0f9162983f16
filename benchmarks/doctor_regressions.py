"""Issue 39's classes (tests/doctor_issue39.py) through a checkout's `vllm-dflash doctor`, each judged against the
verdict the class is due: which classes a given commit gets wrong.

    python benchmarks/doctor_regressions.py [--checkout DIR]     (default: this checkout)

DIR is any checkout of this project (e.g. `git archive COMMIT | tar -x -C DIR`); its own package runs
(PYTHONPATH=DIR), with its own columns, as a user would run that commit. Prints one line per class (the exit code due,
the one got, the words missing) and the count of classes it gets wrong; exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from doctor_issue39 import CASES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, default=REPO)
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    wrong = exits = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            d = Path(tmp) / f"case{i}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(case.config()))
            run = subprocess.run(
                [sys.executable, "-m", "vllm_dflash", "--root", str(checkout), "doctor", str(d)],
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp,  # `-m` puts the working directory first on sys.path: not this checkout's package
                check=False,
            )
            text = run.stdout + run.stderr
            missing = [w for w in case.says if w not in text]
            ok = run.returncode == case.exit and not missing
            wrong += not ok
            exits += run.returncode != case.exit
            why = "" if ok else f" -- got exit {run.returncode}" + (f", missing {missing}" if missing else "")
            print(f"{'ok   ' if ok else 'WRONG'} {case.name}: exit {case.exit} due{why}", flush=True)
    print(
        f"{checkout}: {wrong} of {len(CASES)} classes wrong, {exits} of them with the wrong exit code "
        f"({time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
