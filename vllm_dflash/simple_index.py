"""The local package index `publish` writes: PEP 503 HTML pages, the PEP 691 JSON form beside them, and PEP 658
metadata files, so a resolver reads a wheel's METADATA without fetching the wheel. This module owns that layout.

    <root>/simple/index.html, index.json             every project
    <root>/simple/<project>/index.html, index.json   its files, each with sha256, size, Requires-Python and a
                                                     `data-core-metadata` / `core-metadata` pointer (PEP 714 names)
    <root>/simple/<project>/<wheel>                  the wheel, immutable once there
    <root>/simple/<project>/<wheel>.metadata         its METADATA (PEP 658), immutable
    <root>/simple/<project>/<wheel>.publish.json     what let it in, one record per publish (report, profile, AL,
                                                     binding), appended, never overwritten (PEP 691's
                                                     `_vllm_dflash` key of the file's JSON entry carries the same)
    <root>/.publish.lock                             held (flock) by the publish writing the index

`pip --index-url file://<root>/simple` reads the HTML; a web server that answers
`Accept: application/vnd.pypi.simple.v1+json` with the `index.json` beside each page serves PEP 691. No library on
PyPI writes an incremental static index with PEP 658 and 691 (simple503, dumb-pypi and simple-repository-generator
regenerate whole trees from a package list, HTML first), so it is written here, checked by pip and uv in the tests.

The name and version a wheel is published under come from its own METADATA, and its machine from its own WHEEL,
which must agree with its file name (pipeline/wheelfile.inspect_wheel).
Every check runs before the first byte is written; only real directories are written through (no symlinked
`simple/` or project directory); a copy is hashed as it is written and must equal the sha256 the caller vouches
for (the validation report's, SHA256SUMS'), else it is removed and nothing changes.

A publish is a transaction (`LocalIndex.transaction`): it holds the index's lock from its first check to its last
rename, so concurrent publishes (threads or processes) run one after another and none loses or contradicts
another's entry; every page is rebuilt from the files there and replaced atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import html
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.paths import storage_error, sweep_stale, temp_sibling
from vllm_dflash.pipeline.wheelfile import inspect_wheel

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
API_VERSION = "1.1"
METADATA_SUFFIX = ".metadata"
RECORD_SUFFIX = ".publish.json"
LOCK_NAME = ".publish.lock"
RECORDS_LIMIT = 16 << 20  # a record is ~500 bytes: tens of thousands of publishes of one file
_CHUNK = 1 << 20


@dataclass(frozen=True)
class WheelMeta:
    """What a wheel says about itself (its one .dist-info/METADATA)."""

    filename: str
    project: str  # PEP 503 normalised Name
    name: str  # Name as METADATA writes it
    version: str
    requires_python: str | None
    metadata: bytes  # the METADATA file, byte for byte (PEP 658 serves it)


def read_wheel_meta(path: Path, filename: str | None = None) -> WheelMeta:
    """METADATA of the wheel at `path` (published as `filename`, default its own name), whose name, version, machine
    and interpreter must be the file name's (pipeline/wheelfile.inspect_wheel); PublishRefusedError otherwise."""
    got = inspect_wheel(path, PublishRefusedError, filename)
    return WheelMeta(got.filename, got.project, got.name, got.version, got.requires_python, got.metadata)


def real_dir(path: Path, what: str) -> None:
    """Refuse a symlink (or a non-directory) where the index needs a directory of its own; absent is fine."""
    if path.is_symlink():
        raise PublishRefusedError(
            f"{what} {path} is a symbolic link; the index is written only through its own directories",
            f"replace {path} with a real directory",
        )
    if path.exists() and not path.is_dir():
        raise PublishRefusedError(f"{what} {path} is not a directory", f"move {path} away")


def copy_hashed(source: Path, dest: Path) -> str:
    """Copy `source` to `dest` (created), returning the sha256 of the bytes actually written, synced to disk."""
    h = hashlib.sha256()
    with source.open("rb") as src, dest.open("wb") as out:
        while chunk := src.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return h.hexdigest()


@dataclass(frozen=True)
class PlannedWheel:
    """A wheel checked against the index, ready to be written: every refusal has happened already."""

    source: Path
    sha256: str  # what the copy must hash to
    meta: WheelMeta
    record: Mapping[str, Any]  # the publish record (report, profile, binding, ...)
    present: bool  # the same file is already published (nothing to copy)
    earlier: tuple[Mapping[str, Any], ...] = ()  # the records of earlier publishes of the same file, kept


@dataclass
class Staged:
    """Wheels copied beside their final names, not yet renamed into place."""

    planned: tuple[PlannedWheel, ...]
    pdirs: list[Path]
    created: list[Path]  # directories the staging created (removed again on abort)
    parts: list[tuple[Path, Path]]  # (part, final name)


class LocalIndex:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.simple = root / "simple"

    def project_dir(self, project: str) -> Path:
        return self.simple / project

    def check_dirs(self, *extra: Path) -> None:
        real_dir(self.root, "index directory")
        real_dir(self.simple, "index directory")
        for d in extra:
            real_dir(d, "index directory")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Hold the index's lock (flock on `<root>/.publish.lock`, which conflicts between threads as between
        processes) for a whole publish: plan, stage and commit inside it see no other publish half-done. Callers
        check first without it (a refusal then touches nothing) and again inside it. When the publish inside is
        refused, the lock file and the root this call created are removed again: the destination is as it was
        (a waiting publish sees its lock file gone and takes the new one)."""
        real_dir(self.root, "index directory")
        lock_path = self.root / LOCK_NAME
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            made_root = made_lock = False
            try:
                if not self.root.exists():
                    self.root.mkdir()
                    made_root = True
                try:
                    fd = os.open(lock_path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                    made_lock = True
                except FileExistsError:
                    fd = os.open(lock_path, flags)
            except FileNotFoundError:
                continue  # removed between the two opens: take the next one
            except FileExistsError:
                continue  # root made by another publish between the check and the mkdir
            except OSError as exc:
                raise storage_error(exc, self.root, "lock the index in") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:  # the file locked must still be the one at its name (a refused publish removes its own)
                    same = os.stat(lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                break
            os.close(fd)
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):
                if made_lock:
                    lock_path.unlink()
                if made_root:
                    self.root.rmdir()  # only when empty
            raise
        finally:
            os.close(fd)

    def plan(self, source: Path, sha256: str, record: Mapping[str, Any]) -> PlannedWheel:
        """Check `source` (published as the file whose sha256 is `sha256`) against the index; nothing written."""
        meta = read_wheel_meta(source)
        pdir = self.project_dir(meta.project)
        self.check_dirs(pdir)
        dest = pdir / source.name
        present = False
        for path, want, what in (
            (dest, sha256, "wheel"),
            (dest.with_name(dest.name + METADATA_SUFFIX), hashlib.sha256(meta.metadata).hexdigest(), "metadata"),
        ):
            if path.is_symlink() or (path.exists() and not path.is_file()):
                raise PublishRefusedError(f"{path} is not a regular file", f"remove {path} from the index")
            if path.exists():
                if sha256_file(path) != want:
                    raise PublishRefusedError(
                        f"{path} already exists with different content",
                        "published files are immutable; bump the version",
                    )
                present = present or what == "wheel"
        if not present:
            self._refuse_same_version(pdir, source.name, sha256)
        earlier = read_records(dest.with_name(dest.name + RECORD_SUFFIX))
        return PlannedWheel(source, sha256, meta, dict(record), present, earlier)

    @staticmethod
    def _refuse_same_version(pdir: Path, filename: str, sha256: str) -> None:
        """PEP 440 calls `+dflash.01` and `+dflash.1` one version: a file with another name but an equal version and
        the same tags is the same release to a resolver, so other bytes under it are refused like a changed file."""
        from packaging.utils import InvalidWheelFilename, parse_wheel_filename

        _, version, build, tags = parse_wheel_filename(filename)
        if not pdir.is_dir():
            return
        for other in sorted(pdir.glob("*.whl")):
            if other.name == filename or other.is_symlink() or not other.is_file():
                continue
            try:
                _, o_version, o_build, o_tags = parse_wheel_filename(other.name)
            except InvalidWheelFilename:
                continue
            if (o_version, o_build) == (version, build) and o_tags & tags and sha256_file(other) != sha256:
                raise PublishRefusedError(
                    f"{filename} is version {version}, which {other.name} in {pdir} already is (PEP 440 normalises "
                    "them equal), with other content",
                    "published versions are immutable; bump the dflash.N label in VERSION and build again",
                )

    def write(self, *planned: PlannedWheel) -> list[Path]:
        """Publish planned wheels (stage, then commit)."""
        return self.commit(self.stage(*planned))

    def stage(self, *planned: PlannedWheel) -> Staged:
        """Copy each wheel to a hidden `.part` beside its final name, hashed as it is written. Any refused copy
        removes every part and every directory this call created: the index is as it was."""
        pdirs = sorted({self.project_dir(p.meta.project) for p in planned})
        created = [d for d in (self.root, self.simple, *pdirs) if not d.exists()]
        staged = Staged(planned, pdirs, created, [])
        try:
            for d in created:
                d.mkdir(exist_ok=True)
            for p in planned:
                dest = self.project_dir(p.meta.project) / p.meta.filename
                if not p.present:
                    staged.parts.append((self._stage(p.source, dest, p.sha256, p.meta), dest))
        except BaseException as exc:
            self.abort(staged)
            if isinstance(exc, OSError):
                raise storage_error(exc, self.simple, "write the index in") from None
            raise
        return staged

    def abort(self, staged: Staged) -> None:
        for part, _ in staged.parts:
            with contextlib.suppress(OSError):
                part.unlink()
        for d in reversed(staged.created):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty: what this run created and nothing else

    def commit(self, staged: Staged) -> list[Path]:
        """Rename the parts into place, then write the metadata files, records and pages."""
        out: list[Path] = []
        try:
            for d in staged.pdirs:
                sweep_stale(d)  # a killed earlier run's `.part` (never one of ours: our pid is alive)
            for part, dest in staged.parts:
                os.replace(part, dest)
            for p in staged.planned:
                dest = self.project_dir(p.meta.project) / p.meta.filename
                self._write_file(dest.with_name(dest.name + METADATA_SUFFIX), p.meta.metadata)
                records = [*p.earlier, dict(p.record)]  # this publish's record after every earlier one
                text = json.dumps(records, indent=2, sort_keys=True, allow_nan=False) + "\n"
                self._write_file(dest.with_name(dest.name + RECORD_SUFFIX), text.encode())
                out.append(dest)
            for d in staged.pdirs:
                self._project_pages(d.name)
            self._root_pages()
        except OSError as exc:
            raise storage_error(exc, self.simple, "write the index in") from None
        return out

    def _stage(self, source: Path, dest: Path, sha256: str, meta: WheelMeta) -> Path:
        """Copy `source` to a hidden part beside `dest`; refused (part removed) unless its bytes hash to `sha256`
        and say the same METADATA as planned."""
        part = temp_sibling(dest, ".part")
        try:
            got = copy_hashed(source, part)
            if got != sha256:
                raise PublishRefusedError(
                    f"{source} changed: the bytes copied have sha256 {got}, not the validated {sha256}",
                    "publish again from an untouched copy of the validated wheel",
                )
            if read_wheel_meta(part, meta.filename) != meta:  # the very bytes published say the same
                raise PublishRefusedError(f"{source} changed while it was published", "publish it again")
        except BaseException:
            with contextlib.suppress(OSError):
                part.unlink()
            raise
        return part

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        if path.is_file() and path.read_bytes() == data:
            return
        tmp = temp_sibling(path)
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def _files(self, pdir: Path) -> list[Path]:
        return sorted(p for p in pdir.iterdir() if p.name.endswith(".whl") and p.is_file() and not p.is_symlink())

    def _project_pages(self, project: str) -> None:
        pdir = self.project_dir(project)
        links: list[tuple[str, str, dict[str, str]]] = []
        entries: list[dict[str, Any]] = []
        versions: set[str] = set()
        for f in self._files(pdir):
            meta_path = f.with_name(f.name + METADATA_SUFFIX)
            try:
                meta: WheelMeta | None = read_wheel_meta(f)
            except PublishRefusedError:
                meta = None  # a file put there by hand, not by publish: listed, but nothing read from it
            if meta is not None:
                versions.add(meta.version)
            sha = sha256_file(f)
            attrs: dict[str, str] = {}
            entry: dict[str, Any] = {"filename": f.name, "url": f.name, "hashes": {"sha256": sha}}
            entry["size"] = f.stat().st_size
            if meta is not None and meta.requires_python:
                attrs["data-requires-python"] = meta.requires_python
                entry["requires-python"] = meta.requires_python
            if meta_path.is_file():
                msha = hashlib.sha256(meta_path.read_bytes()).hexdigest()
                attrs["data-dist-info-metadata"] = attrs["data-core-metadata"] = f"sha256={msha}"
                entry["core-metadata"] = entry["dist-info-metadata"] = {"sha256": msha}
            record = f.with_name(f.name + RECORD_SUFFIX)
            if record.is_file():
                with contextlib.suppress(PublishRefusedError):
                    entry["_vllm_dflash"] = list(read_records(record))
            links.append((f"{f.name}#sha256={sha}", f.name, attrs))
            entries.append(entry)
        doc = {"meta": {"api-version": API_VERSION}, "name": project, "files": entries, "versions": sorted(versions)}
        self._write_file(pdir / "index.html", _page(f"Links for {project}", links).encode())
        self._write_file(pdir / "index.json", (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode())

    def _root_pages(self) -> None:
        projects = sorted(d.name for d in self.simple.iterdir() if d.is_dir() and not d.is_symlink())
        self._write_file(
            self.simple / "index.html", _page("Simple index", [(f"{p}/", p, {}) for p in projects]).encode()
        )
        doc = {"meta": {"api-version": API_VERSION}, "projects": [{"name": p} for p in projects]}
        self._write_file(self.simple / "index.json", (json.dumps(doc, indent=2) + "\n").encode())


def read_records(path: Path) -> tuple[Mapping[str, Any], ...]:
    """The publish records kept beside a wheel, oldest first (none when there is no file yet). A file holding one
    record object is an index written before records were appended: that one record. Anything else is not ours to
    replace: PublishRefusedError."""
    from vllm_dflash.paths import read_bounded
    from vllm_dflash.report import loads_strict

    hint = f"move {path} out of the index; publish keeps one record per publish there"
    if not path.exists() and not path.is_symlink():
        return ()
    raw = read_bounded(path, RECORDS_LIMIT, "publish record", PublishRefusedError, hint)
    try:
        data = loads_strict(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PublishRefusedError(f"{path} is not a publish record list ({exc})", hint) from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise PublishRefusedError(f"{path} is not a publish record list", hint)
    return tuple(data)


def _page(title: str, links: list[tuple[str, str, dict[str, str]]]) -> str:
    def anchor(href: str, text: str, attrs: Mapping[str, str]) -> str:
        extra = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
        return f'    <a href="{html.escape(href)}"{extra}>{html.escape(text)}</a><br/>'

    items = "\n".join(anchor(h, t, a) for h, t, a in links)
    return (
        f'<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" content="{API_VERSION}">'
        f"<title>{html.escape(title)}</title></head>\n  <body>\n{items}\n  </body>\n</html>\n"
    )
