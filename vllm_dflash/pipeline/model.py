"""The types the pipeline stages hand each other (source tree → patched tree → wheel), and the provenance they add up
to. Shared here so no stage imports another stage for a type.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import __version__ as TOOL_VERSION
from vllm_dflash.manifest import Manifest
from vllm_dflash.provenance import BuildInfo, ForkRef, PatchRecord, Provenance, UpstreamRef
from vllm_dflash.series import Patch

MODES = ("auto", "fast", "full")
SOURCE_KINDS = ("auto", "git", "sdist")
VARIANTS = ("dflash", "stock")  # stock: no DFlash queue (CPU runtime fixes still apply on CPU base wheels)
# `__commit_id__ = commit_id = 'g<hex>'` in vllm/_version.py (sdists and wheels alike).
COMMIT_ID = re.compile(r"""^__commit_id__\s*=\s*commit_id\s*=\s*['"]g?([0-9a-f]{7,40})['"]""", re.MULTILINE)


def commits_match(a: str, b: str) -> bool:
    """True when two commit ids (full or abbreviated, at least 7 hex digits) name the same commit."""
    n = min(len(a), len(b))
    return n >= 7 and a[:n].lower() == b[:n].lower()


@dataclass(frozen=True)
class SourceTree:
    """A prepared upstream work tree. `base` is the local SHA of its upstream-base commit (HEAD after prepare)."""

    path: Path
    kind: str  # "git" | "sdist"
    version: str
    commit: str  # upstream commit: the full SHA from git, or the abbreviated id recorded by the sdist
    base: str


@dataclass(frozen=True)
class PatchedTree:
    path: Path
    branch: str
    base: str
    head: str
    commits: tuple[tuple[Patch, str], ...]  # (patch, commit SHA) in application order
    source: SourceTree


@dataclass(frozen=True)
class ModeChoice:
    mode: str  # "fast" | "full"
    reason: str


@dataclass(frozen=True)
class WheelResult:
    path: Path
    sha256: str
    mode: str  # "fast" | "full"
    base_wheel: Path | None  # the upstream wheel overlaid (fast path); None for a full build
    changed: tuple[str, ...]  # wheel paths added, changed or removed relative to the base wheel's package files
    provenance: Provenance
    platform: str = ""  # x86_64 | aarch64 (the machine the wheel is for)


def dist_version(manifest: Manifest, variant: str) -> str:
    """The version a build carries: VERSION for ours; `<upstream>+stock.<N>` for the stock comparison build."""
    if variant == "stock":
        return f"{manifest.upstream.version}+stock.{manifest.local_label.rsplit('.', 1)[-1]}"
    return manifest.version


def make_provenance(
    manifest: Manifest,
    patched: PatchedTree,
    build: BuildInfo,
    changed: Sequence[str],
    variant: str = "dflash",
) -> Provenance:
    """What went into a wheel, from the typed documents the stages produced (no host facts, no timestamps)."""
    src = patched.source
    return Provenance(
        version=dist_version(manifest, variant),
        upstream=UpstreamRef(
            version=manifest.upstream.version,
            tag=manifest.upstream.tag,
            git_url=manifest.upstream.git_url,
            commit=src.commit,
            commit_pinned=manifest.upstream.commit,
            source_kind=src.kind,
            sdist_filename=manifest.sdist.filename if src.kind == "sdist" else None,
            sdist_sha256=manifest.sdist.sha256 if src.kind == "sdist" else None,
        ),
        fork=ForkRef(branch=patched.branch, base=patched.base, head=patched.head),
        patches=tuple(
            PatchRecord(
                name=p.name,
                sha256=p.sha256,
                subject=p.subject,
                commit=sha,
                drop_when=p.drop_when,
                queue=p.queue,
                description=p.headers.get("Description", ""),
            )
            for p, sha in patched.commits
        ),
        build=build,
        changed_files=tuple(changed),
        variant=variant,
    )


def build_info(mode: str, reason: str, base_wheel: str | None, base_sha256: str | None) -> BuildInfo:
    return BuildInfo(
        tool="vllm-dflash",
        tool_version=TOOL_VERSION,
        mode=mode,
        mode_reason=reason,
        base_wheel=base_wheel,
        base_wheel_sha256=base_sha256,
    )
