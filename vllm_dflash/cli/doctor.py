"""`doctor`: one drafter checkpoint, read by the code of stock vLLM 0.20.1, this build, upstream vLLM 0.33.0 and 0.34.0
and the dflash 0.1.0 reference, each run in its own environment; `--table` prints the compatibility table of the
shipped public checkpoints."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import checkout
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import table
from vllm_dflash.doctor.checkpoint import Checkpoint, read_checkpoint, read_json, read_target, resolve_dir
from vllm_dflash.errors import CheckpointError
from vllm_dflash.paths import write_text_atomic

_EPILOG = """\
Exit status (one per verdict class; the printed verdict and --json carry it): 0 served as trained (this build and
stock 0.20.1); 20 served as trained by this build, stock 0.20.1 mis-serves it; 21 refused by this build (the line
it raises when it loads the config or builds the drafter); 22 not a drafter vLLM 0.20.1 can run (a field it ignores
changes the computation: DFlash2, a learnt mask embedding, attention sinks, a quantized drafter, ...; taps the fc
cannot take); 23 served as this build reads it, but the config carries fields no build we know reads; 24 not a
DFlash drafter (a target model, EAGLE, Medusa, MTP); 18 the checkpoint cannot be read, or the target layers it reads
lie outside --target's layers (only --target decides this; the drafter's own num_target_layers is a note). 13 when
a column's environment cannot be built or its process fails. --prove: 1 when the served twin does not do what the
doctor claims (each claim is named), 19 when a case cannot run on this machine.

The first run builds each column's environment (several GB, minutes; progress and sizes are printed); later runs
reuse them, and answers already computed for a config are read from the cache.
"""


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "doctor",
        help="read a DFlash drafter checkpoint with each vLLM build's own code: how stock, this build and upstream "
        "serve it, one verdict",
        description="Reads a drafter's config.json (a file, a model directory or a Hugging Face cache snapshot; "
        "never downloads) and has each build's own code load it as `vllm serve` does and build the drafter on the "
        "meta device: stock vLLM 0.20.1, this build, upstream vLLM 0.33.0 and 0.34.0, and the dflash 0.1.0 "
        "reference. Prints, per drafter layer, kind, window, causality and backend window as the built layers carry "
        "them, the taps the runner takes and the order the target records them in, what this build ignores (each "
        "2026 field measured by building without it), and one verdict.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", type=Path, nargs="?", help="drafter config.json, model directory or HF cache snapshot")
    p.add_argument("--target", type=Path, default=None, help="the target model's config.json or directory")
    p.add_argument("--prove", action="store_true", help="run a shape-preserving tiny twin through conformance")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the diagnosis as JSON")
    p.add_argument("--table", action="store_true", help="print the compatibility table of the shipped checkpoints")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="also size the KV cache per sequence at N tokens (this build vs stock; the target's too with --target), "
        "from the KV-cache specs the built models report at your serve arguments",
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
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="with --context: your --max-model-len (what vLLM reserves a sequence for; default: the context)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="with --context: take the serve arguments of this dist.toml profile (the command line wins)",
    )
    p.set_defaults(func=run)


def _doctor(args: argparse.Namespace) -> Any:
    """The columns' environments (built on the first run, with progress), and the doctor reading through them."""
    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns, server_idle

    co = checkout(args)
    started = time.monotonic()
    cols = columns(co.manifest, co.queues)
    took = time.monotonic() - started
    if took > 5:
        print(f"doctor: environments ready in {took:.0f} s", file=sys.stderr, flush=True)
    return Doctor(Sides(cols, idle=server_idle()))


def _target(args: argparse.Namespace) -> tuple[Any, dict[str, Any] | None]:
    if args.target is None:
        return None, None
    path = args.target if args.target.is_file() else resolve_dir(args.target) / "config.json"
    return read_target(args.target), read_json(path, "target")


def checkpoints(args: argparse.Namespace) -> tuple[list[Checkpoint], table.Entry | None]:
    """What PATH names, read before any column runs (so an unreadable checkpoint costs no environment): the
    checkpoint, or every completion of a shipped table entry."""
    if args.path.is_file() and table.is_entry(read_json(args.path, "drafter")):
        entry = table.load_entry(args.path)
        return [ck for _, ck in table.completions(entry)], entry
    return [read_checkpoint(args.path)], None


def diagnosis(
    args: argparse.Namespace, doc: Any, serve: dict[str, Any] | None, cks: list[Checkpoint], entry: table.Entry | None
) -> tuple[Checkpoint, D.Diagnosis, Any]:
    """The checkpoint's diagnosis (against --target when given), and its columns' readings. A shipped table entry is
    read as the table reads it: its verdict only when every completion of what no public source gives agrees."""
    target, target_raw = _target(args)
    layers, source, archs = (target.layers, target.source, target.architectures) if target else (None, "", ())
    reads = doc.read([ck.config for ck in cks], target_raw, serve)
    if entry is None:
        ck, got = cks[0], reads[0]
        return ck, D.diagnose(ck, got.readings, layers, source, archs, got.measured), got.readings
    pairs = [
        (ck, D.diagnose(ck, r.readings, layers or entry.target_layers, source, archs, r.measured))
        for ck, r in zip(cks, reads, strict=True)
    ]
    classes = sorted({d.verdict_class for _, d in pairs})
    if len(classes) > 1:
        fields = table.depends_on(entry, doc, lambda d: d.verdict_class, [d for _, d in pairs])
        raise CheckpointError(
            f"{args.path}: the verdict depends on {', '.join(fields)}, which no public source gives "
            f"({' / '.join(classes)})",
            "pass the checkpoint's own config.json",
        )
    print(f"table entry {entry.name}: {len(pairs)} completion(s) of what no public source gives, one verdict")
    return pairs[0][0], pairs[0][1], reads[0].readings


def serve_arguments(args: argparse.Namespace) -> dict[str, Any] | None:
    """--context's serve arguments: the profile's, then the command line's, then vLLM serve's CUDA defaults (16-token
    KV blocks, 2048-token prefill chunks). The context N is max_model_len unless --max-model-len says otherwise: a
    profile's own --max-model-len does not override the N the command line asks for."""
    from vllm_dflash.doctor import kvcache

    if args.context is None:
        return None
    if args.context <= 0:
        raise CheckpointError(f"--context {args.context}: not a number of tokens", "pass a positive context length")
    serve: dict[str, Any] = {}
    if args.profile is not None:
        co = checkout(args)
        if args.profile not in co.manifest.profiles:
            known = ", ".join(sorted(co.manifest.profiles))
            raise CheckpointError(f"--profile {args.profile}: no such profile in dist.toml", f"pass one of {known}")
        serve = kvcache.serve_shape(co.manifest.profiles[args.profile].serve_args, f"profile {args.profile}")
    given = [f"--max-num-batched-tokens={args.max_num_batched_tokens}"] if args.max_num_batched_tokens else []
    given += [f"--block-size={args.block_size}"] if args.block_size else []
    given += [f"--max-model-len={args.max_model_len}"] if args.max_model_len else []
    serve.update(kvcache.serve_shape(given, "the command line"))  # what the command line says wins
    serve.setdefault("max_num_batched_tokens", kvcache.MAX_NUM_BATCHED_TOKENS)
    serve.setdefault("block_size", kvcache.BLOCK_SIZE)
    if not args.max_model_len:
        serve["max_model_len"] = args.context
    return serve


def _kv_cache(args: argparse.Namespace, ck: Any, d: D.Diagnosis, serve: dict[str, Any], readings: Any) -> Any:
    from vllm_dflash.doctor import kvcache

    _, target = _target(args)
    co = checkout(args)
    figures = kvcache.per_sequence(
        co.manifest, co.queues, ck, d, int(serve["max_model_len"]), target, serve, readings=readings
    )
    print()
    print(kvcache.render_text(figures))
    return figures


def run(args: argparse.Namespace) -> int:
    if not args.table and args.path is None:
        raise CheckpointError("no checkpoint given", "pass the drafter's config.json or directory (or --table)")
    cks, entry = checkpoints(args) if not args.table else ([], None)
    _target(args)  # an unreadable target is one line before any environment is built too
    serve = serve_arguments(args)
    if serve is not None and cks:
        from vllm_dflash.doctor import kvcache

        serve.setdefault("dtype", kvcache.dtype_of(cks[0].config))
    doc = _doctor(args)
    try:
        if args.table:
            print(table.render_table(doc))
            return 0
        ck, d, readings = diagnosis(args, doc, serve, cks, entry)
        print(D.render_text(d))
        kv = _kv_cache(args, ck, d, serve, readings).to_dict() if serve is not None else None
        extra: dict[str, Any] = {} if kv is None else {"kv_cache": kv}
        if d.mismatch:
            _write_json(args, d, **extra)
            raise CheckpointError(f"this drafter does not fit this target: {d.mismatch}", "pair it with its own target")
        if not args.prove:
            _write_json(args, d, **extra)
            return d.exit_code
        exit_code, claims = _prove(args, doc, ck, d)
        _write_json(args, d, exit_code, prove=claims, **extra)
        return exit_code
    finally:
        doc.sides.close()


def _write_json(args: argparse.Namespace, d: D.Diagnosis, exit_code: int | None = None, **extra: Any) -> None:
    """--json: the diagnosis with the exit code the process ends with."""
    if args.json is not None:
        write_text_atomic(args.json, d.to_json(exit_code, **extra) + "\n")


def _prove(args: argparse.Namespace, doc: Any, ck: Checkpoint, d: D.Diagnosis) -> tuple[int, list[dict[str, Any]]]:
    """--prove: the twin through conformance. The diagnosis's exit code when every claim held and ran, else 1 (each
    claim named), 19 when a case cannot run on this machine; and the claims, for --json."""
    from vllm_dflash.doctor.prove import prove, render_prove

    co = checkout(args)
    sys.stdout.flush()
    result = prove(co.manifest, co.queues, ck, d, doc)
    code = d.exit_code if result.ok else result.exit_code
    render_prove(result, code)
    claims = [
        {"claim": c.what, "holds": c.holds, "ran": c.ran, "expected": c.expected, "got": c.got} for c in result.claims
    ]
    return code, claims
