"""`vllm-dflash build`: pinned upstream source → patch queue on the fork branch → wheel in dist/.

Output: dist/vllm-<VERSION>-cp38-abi3-<platform>.whl. Each stage checks its inputs before it writes anything, and
the wheel is renamed into dist/ only after it has been verified, so a failed build leaves nothing in dist/.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.pipeline.patches import apply_series, series_or_empty
from vllm_dflash.pipeline.source import add_source_argument, prepare_source, trees_lock
from vllm_dflash.pipeline.wheel import WheelResult, add_wheel_arguments, build_wheel


def run_build(
    manifest: Manifest,
    source_kind: str = "auto",
    mode: str = "auto",
    base_wheel: str | None = None,
    out_dir: Path | None = None,
) -> WheelResult:
    """The whole build: returns the verified wheel in `out_dir` (default: the manifest's dist/)."""
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.monotonic()
    # Read the queue first: a malformed series or an unsafe patch fails before anything is downloaded.
    patches = series_or_empty(manifest.patches_dir)
    from vllm_dflash.pipeline.fullbuild import preflight

    preflight(mode)  # --mode full: refuse before downloading anything when the CUDA toolchain is missing
    with trees_lock():  # the cached tree's HEAD moves (base → fork branch) until the wheel has read it
        console.rule(f"[bold]1/3 source[/] vLLM {manifest.upstream.version} ({source_kind})")
        source = prepare_source(manifest, source_kind)
        console.rule(f"[bold]2/3 patches[/] {len(patches)} patch(es) → {manifest.fork_branch}")
        patched = apply_series(source, patches, manifest.fork_branch)
        console.rule(f"[bold]3/3 wheel[/] mode {mode}")
        result = build_wheel(manifest, patched, mode, base_wheel, out_dir)
    console.print(f"built {result.path.name} in {time.monotonic() - t0:.1f} s ({result.mode} path)")
    return result


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "build", help="source + patches + wheel: build the patched vLLM wheel into dist/", description=__doc__
    )
    add_source_argument(p)
    add_wheel_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.root) if args.root else None)
    result = run_build(manifest, args.source, args.mode, args.base_wheel, args.out)
    print(f"{result.path}\nsha256={result.sha256}")
    return 0
