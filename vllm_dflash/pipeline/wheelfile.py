"""Wheel files at the byte level: copy entries without re-encoding them, write our own entries reproducibly, keep
RECORD right, verify the result, and add files to a finished wheel (how a full build gets its provenance).
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import struct
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_dflash.errors import HashMismatchError
from vllm_dflash.paths import temp_sibling

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
