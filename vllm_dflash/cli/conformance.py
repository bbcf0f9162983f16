"""`conformance`: the patched drafter against the authors' reference."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, checkout
from vllm_dflash.conformance.cases import CASE_NAMES, FULL_KV
from vllm_dflash.conformance.compare import BUILDS, UNPROVEN_EXIT, ConformanceOptions, render, run_conformance
from vllm_dflash.errors import ConformanceError

_EPILOG = f"""\
cases: {", ".join(CASE_NAMES)}.
Exit status: 0 when the patched build passes every case, every negative-control oracle disagrees with it and stock
fails exactly the cases that exercise a feature the pin's queue fixes (its patches' X-Fixes headers) and passes the
others; 1 when any of that does not hold; {UNPROVEN_EXIT} when everything that ran holds
but a case could not run on this machine (bf16 needs a CPU with avx512_bf16): those rows say "unproven", never
passed; 13 when an environment cannot be built.
--device cuda (GPU nodes) compares bf16 logits with looser tolerances; the oracle always runs fp32 on CPU.
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "conformance",
        help="compare vLLM's DFlash drafter (patched and stock) with the dflash reference on tiny random models",
        description="Weight-free conformance test: tiny random Qwen3 target + DFlash drafters, every drafter "
        "proposal of vLLM compared with a no-cache oracle built on the authors' dflash 0.1.0 package.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--build",
        choices=("patched", "stock", FULL_KV, "both"),
        default="both",
        help="which vLLM build(s) to run (both: patched and stock, and on the evict-* cases the patched build with "
        f"today's full drafter KV cache, {FULL_KV}: VLLM_DFLASH_FULL_DRAFTER_KV=1)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where vLLM runs (default: cpu)")
    p.add_argument("--cases", nargs="+", choices=CASE_NAMES, metavar="CASE", default=None, help="subset of cases")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        help="JSON report path (default: dist/conformance-DEVICE.json; with --pin X: dist/conformance-DEVICE-X.json)",
    )
    p.add_argument("--patched-wheel", type=Path, default=None, help="test this wheel as the patched build")
    p.add_argument("--stock-wheel", type=Path, default=None, help="test this wheel as the stock build")
    add_pin_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    for flag, path in (("--patched-wheel", args.patched_wheel), ("--stock-wheel", args.stock_wheel)):
        if path is not None and not path.is_file():
            raise ConformanceError(f"{flag} {path}: no such file", "pass the path of a built .whl")
    co = checkout(args)
    builds = BUILDS if args.build == "both" else (args.build,)
    options = ConformanceOptions(
        builds=builds,
        device=args.device,
        cases=tuple(args.cases or ()),
        report=args.report,
        patched_wheel=args.patched_wheel.resolve() if args.patched_wheel else None,
        stock_wheel=args.stock_wheel.resolve() if args.stock_wheel else None,
    )
    result = run_conformance(co.manifest, co.queues, options)
    render(result)
    return result.exit_code
