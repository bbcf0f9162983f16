"""`doctor`: one drafter checkpoint, read offline, against stock 0.20.1, this build, upstream 0.33 and the
reference; `--table` prints the compatibility table of the shipped public checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import manifest
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import ours, table
from vllm_dflash.doctor.checkpoint import Checkpoint, read_checkpoint, read_json, read_target
from vllm_dflash.errors import CheckpointError, ManifestError
from vllm_dflash.paths import write_text_atomic

_EPILOG = """\
Exit status (one per verdict class; the printed verdict and --json carry it): 0 served as trained (this build and
stock 0.20.1); 20 served as trained by this build, stock 0.20.1 mis-serves it; 21 refused by this build (the line
it would print at start-up, or transformers' reason when the config cannot load); 22 not a drafter vLLM 0.20.1 can
run (a field it ignores changes the computation: DFlash2, a learnt mask embedding, attention sinks, ...); 23 served
as this build reads it, but the config carries fields no build we know reads; 24 not a DFlash drafter (a target
model, EAGLE, Medusa, MTP); 18 the checkpoint cannot be read, or the target layers it reads lie outside --target's
layers (only --target decides this; the drafter's own num_target_layers is a note). --prove: 1 when the served
twin does not do what the doctor claims (each claim is named), 19 when a case cannot run on this machine, 13 when
its environments cannot be built.
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor",
        help="read a DFlash drafter checkpoint offline: how stock, this build and upstream serve it, one verdict",
        description="Reads a drafter's config.json (a file, a model directory or a Hugging Face cache snapshot; "
        "never downloads) and prints, per drafter layer, kind, window, causality and backend window with the field "
        "each came from, for stock vLLM 0.20.1, this build (patch 0002's own code), upstream vLLM 0.33 and the "
        "dflash 0.1.0 reference; then the taps, what this build ignores, and one verdict.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", type=Path, nargs="?", help="drafter config.json, model directory or HF cache snapshot")
    p.add_argument("--target", type=Path, default=None, help="the target model's config.json or directory")
    p.add_argument("--prove", action="store_true", help="run a shape-preserving tiny twin through conformance")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the diagnosis as JSON")
    p.add_argument(
        "--model-file",
        type=Path,
        default=None,
        help="read this build's resolution from a patched qwen3_dflash.py instead of the checkout's patch 0002",
    )
    p.add_argument("--table", action="store_true", help="print the compatibility table of the shipped checkpoints")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="also size the drafter's KV cache per sequence at N tokens (this build vs stock; the target's too with "
        "--target), with vLLM's own KV-cache specs in this build's CPU environment",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="with --context: the prefill chunk your `vllm serve` uses (a sliding layer keeps its window plus one)",
    )
    p.add_argument("--block-size", type=int, default=None, metavar="N", help="with --context: your KV block size")
    p.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="with --context: take the serve arguments of this dist.toml profile",
    )
    p.set_defaults(func=run)


def our_code(args: argparse.Namespace) -> ours.OurCode:
    """Patch 0002 of the checkout; else a patched qwen3_dflash.py (--model-file, or the installed vLLM)."""
    if args.model_file is not None:
        if not args.model_file.exists():  # a FIFO or device is refused, with its kind, when it is read
            raise CheckpointError(f"--model-file {args.model_file}: no such file", "pass a patched qwen3_dflash.py")
        return ours.from_model_file(args.model_file)
    try:
        return ours.from_patches(manifest(args).patches_dir)
    except ManifestError:
        installed = ours.installed_model_file()
        if installed is None:
            raise CheckpointError(
                "no vllm-dflash checkout here and no patched vLLM installed",
                "run from the checkout (or --root), or pass --model-file PATCHED/qwen3_dflash.py",
            ) from None
        return ours.from_model_file(installed)


def diagnosis(args: argparse.Namespace, code: ours.OurCode) -> tuple[Checkpoint, D.Diagnosis]:
    """The checkpoint PATH names and its diagnosis (against --target when given). A shipped table entry is read as
    the table reads it: its verdict only when every completion of what no public source gives agrees."""
    target = read_target(args.target) if args.target is not None else None
    layers, source, archs = (target.layers, target.source, target.architectures) if target else (None, "", ())
    if args.path.is_file() and table.is_entry(read_json(args.path, "drafter")):
        entry = table.load_entry(args.path)
        pairs = [
            (ck, D.diagnose(ck, code, layers or entry.target_layers, source, archs))
            for _, ck in table.completions(entry)
        ]
        classes = sorted({d.verdict_class for _, d in pairs})
        if len(classes) > 1:
            fields = table.depends_on(entry, code, lambda d: d.verdict_class)
            raise CheckpointError(
                f"{args.path}: the verdict depends on {', '.join(fields)}, which no public source gives "
                f"({' / '.join(classes)})",
                "pass the checkpoint's own config.json",
            )
        print(f"table entry {entry.name}: {len(pairs)} completion(s) of what no public source gives, one verdict")
        return pairs[0]
    ck = read_checkpoint(args.path)
    return ck, D.diagnose(ck, code, layers, source, archs)


def _kv_cache(args: argparse.Namespace, ck: Any, d: D.Diagnosis) -> Any:
    from vllm_dflash.cli.common import checkout
    from vllm_dflash.doctor import kvcache
    from vllm_dflash.doctor.checkpoint import read_json, resolve_dir

    target = None
    if args.target is not None:
        path = args.target if args.target.is_file() else resolve_dir(args.target) / "config.json"
        target = read_json(path, "target")
    co = checkout(args)
    serve: dict[str, int] = {}
    if args.profile is not None:
        if args.profile not in co.manifest.profiles:
            known = ", ".join(sorted(co.manifest.profiles))
            raise CheckpointError(f"--profile {args.profile}: no such profile in dist.toml", f"pass one of {known}")
        serve = kvcache.serve_shape(co.manifest.profiles[args.profile].serve_args, f"profile {args.profile}")
    given = [f"--max-num-batched-tokens={args.max_num_batched_tokens}"] if args.max_num_batched_tokens else []
    given += [f"--block-size={args.block_size}"] if args.block_size else []
    serve.update(kvcache.serve_shape(given, "the command line"))  # what the command line says wins
    sys.stdout.flush()
    figures = kvcache.per_sequence(co.manifest, co.queues, ck, d, args.context, target, serve)
    print()
    print(kvcache.render_text(figures))
    return figures


def run(args: argparse.Namespace) -> int:
    code = our_code(args)
    if args.table:
        from vllm_dflash.doctor.table import render_table

        print(render_table(code))
        return 0
    if args.path is None:
        raise CheckpointError("no checkpoint given", "pass the drafter's config.json or directory (or --table)")
    ck, d = diagnosis(args, code)
    print(D.render_text(d))
    kv = _kv_cache(args, ck, d).to_dict() if args.context is not None else None
    extra: dict[str, Any] = {} if kv is None else {"kv_cache": kv}
    if d.mismatch:
        _write_json(args, d, **extra)
        raise CheckpointError(f"this drafter does not fit this target: {d.mismatch}", "pair it with its own target")
    if not args.prove:
        _write_json(args, d, **extra)
        return d.exit_code
    exit_code, claims = _prove(args, code, ck, d)
    _write_json(args, d, exit_code, prove=claims, **extra)
    return exit_code


def _write_json(args: argparse.Namespace, d: D.Diagnosis, exit_code: int | None = None, **extra: Any) -> None:
    """--json: the diagnosis with the exit code the process ends with."""
    if args.json is not None:
        write_text_atomic(args.json, d.to_json(exit_code, **extra) + "\n")


def _prove(
    args: argparse.Namespace, code: ours.OurCode, ck: Checkpoint, d: D.Diagnosis
) -> tuple[int, list[dict[str, Any]]]:
    """--prove: the twin through conformance. The diagnosis's exit code when every claim held, else 1 (each claim
    named), 19 when a case cannot run on this machine; and the claims, for --json."""
    from vllm_dflash.cli.common import checkout
    from vllm_dflash.doctor.prove import prove, render_prove

    co = checkout(args)
    sys.stdout.flush()
    result = prove(co.manifest, co.queues, ck, d, code)
    render_prove(result)
    claims = [{"claim": c.what, "holds": c.holds, "expected": c.expected, "got": c.got} for c in result.claims]
    return (d.exit_code if result.ok else result.exit_code), claims
