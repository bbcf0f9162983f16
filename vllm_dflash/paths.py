"""Names that come from outside the code (manifest, index answers, series lines, CLI options) and the files we read
and write.

Every such name is confined here, in one place, to the directory it belongs in: no separators, no `..`, no absolute
paths, no symlink escape. Writes go through a temporary sibling and an atomic rename, so a killed process never
leaves a half-written file under a final name. Temporaries carry a mark no user file has by accident
(`.vllm-dflash.<pid>.<random>.<name>.<kind>`), and only marked entries of dead processes are ever swept, only in
directories the tool owns. Every file the tool reads goes through `read_bounded`: a regular file, under a stated
size limit (a device, FIFO or a link to one never hangs a read or fills memory).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_dflash.errors import DISK_FULL_HINT, DflashError, ManifestError, StorageError

# A bare file name: letters, digits and the punctuation wheel, sdist and patch names use. Nothing else.
_BARE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+~=-]*$")


def bare_name(name: str, what: str, error: type[DflashError] = ManifestError) -> str:
    """`name` when it is a plain file name (no directory part, no `..`, no control characters); else `error`."""
    if not isinstance(name, str) or not _BARE_NAME.match(name) or name in (".", "..") or ".." in name.split("."):
        shown = repr(name) if isinstance(name, str) else type(name).__name__
        raise error(
            f"{what} {shown} is not a plain file name",
            "use a bare file name (letters, digits, '.', '_', '-', '+'), without directories or '..'",
        )
    return name


def confine(base: Path, name: str, what: str, error: type[DflashError] = ManifestError) -> Path:
    """`base / name` for a bare `name`, refusing anything that would resolve outside `base` (symlinks included)."""
    path = base / bare_name(name, what, error)
    root = base.resolve()
    resolved = path.resolve()
    if resolved.parent != root:
        raise error(f"{what} '{name}' resolves to {resolved}, outside {root}", f"remove the link at {path}")
    return path


def confine_relative(base: Path, rel: str, what: str, error: type[DflashError] = ManifestError) -> Path:
    """`base / rel` for a relative path with no `..` part whose resolved location stays inside `base`."""
    parts = Path(rel).parts
    if not rel or Path(rel).is_absolute() or ".." in parts or any(p.startswith("~") for p in parts[:1]):
        raise error(f"{what} '{rel}' is not a relative path inside {base}", "use a path relative to the checkout")
    path = base / rel
    root = base.resolve()
    resolved = path.resolve()
    if resolved != root and root not in resolved.parents:
        raise error(f"{what} '{rel}' resolves to {resolved}, outside {root}", f"remove the link under {base}")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Reading: regular files only, never more than a stated size

KIB = 1 << 10
MIB = 1 << 20


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} bytes"


def open_regular(path: Path, what: str, error: type[DflashError] = StorageError, hint: str = "") -> int:
    """A read-only descriptor of `path` when it is (or links to) a regular file; else one `error` line.

    Opened non-blocking so a FIFO without a writer cannot hang the open; the type is checked on the descriptor, so
    nothing swapped in between a check and the read is ever read. FileNotFoundError is the caller's to word.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}", hint or "check the path") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what} {path} is {_kind(mode)}, not a regular file", hint or "pass a regular file")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: Path, limit: int, what: str, error: type[DflashError] = StorageError, hint: str = "") -> bytes:
    """The bytes of the regular file `path`, refusing (one `error` line, the limit stated) anything larger than
    `limit` bytes. FileNotFoundError is left to the caller, which knows what a missing file means there."""
    fd = open_regular(path, what, error, hint)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}", hint or "check the path") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(
            f"{what} {path} is larger than the {_size(limit)} limit for it",
            hint or f"a {what} is never that large; pass the right file",
        )
    return data


def read_zip_member(
    zf: Any, info: Any, limit: int, where: str, error: type[DflashError] = StorageError, hint: str = ""
) -> bytes:
    """The bytes of one member of an open zipfile.ZipFile, read bounded: a member whose size is above `limit`,
    encrypted, stored with a method other than stored or deflate (what wheels use), or corrupt (bad CRC, truncated,
    a broken stream) is one `error` line naming it, never another exception. zipfile inflates no further than the
    size the central directory states, so a bomb that understates its size ends in a CRC error, not in memory."""
    import zipfile
    import zlib

    name = f"{where}: member {str(info.filename)[:120]!r}"
    if info.flag_bits & 0x1:
        raise error(f"{name} is encrypted", hint or "a wheel's members are never encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise error(
            f"{name} is compressed with zip method {info.compress_type}, not stored or deflate",
            hint or "a wheel is written with deflate (PEP 427)",
        )
    if info.file_size > limit:
        raise error(f"{name} is {info.file_size} bytes, larger than the {_size(limit)} limit for it", hint)
    try:
        with zf.open(info) as fh:
            data: bytes = fh.read(limit)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise error(f"{name} is corrupt ({str(exc)[:200]})", hint or "use an intact copy") from None
    return data


# ---------------------------------------------------------------------------------------------------------------
# Outputs, checked before any work

_SYSTEM_DIRS = ("/etc", "/usr", "/proc", "/dev", "/sys", "/boot", "/bin", "/sbin", "/lib", "/lib64")


def check_output_file(path: Path, what: str, probe: bool = False) -> Path:
    """`path` when a result may be written there: absent, or a regular file (which the atomic rename replaces).

    A device, FIFO, socket, directory or symlink at `path` is refused: the rename would replace it with a regular
    file (as root, `/dev/full` would stop being a device), and none of those is ours to replace. With `probe` (the
    CLI's check before the first stage) the place is also tried: a marked file is made and removed beside it (or a
    marked directory in the nearest existing ancestor), since /proc, /sys or a read-only mount say no only when
    asked -- never after an hour of measuring.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise storage_error(exc, path, f"check {what}") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise StorageError(
            f"{what} {path} exists and is {_kind(mode)}, not a regular file",
            "name a new file or a regular file to replace; the tool never writes over anything else",
        )
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise StorageError(f"{what} {path}: {ancestor} is not a directory", "choose a path in a directory")
    if probe:
        try:
            if ancestor == path.parent:
                os.close(os.open(test := temp_sibling(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                os.unlink(test)
            else:
                os.mkdir(test := ancestor / _marked("probe", "tmp"))
                os.rmdir(test)
        except OSError as exc:
            first = path if ancestor == path.parent else ancestor / path.relative_to(ancestor).parts[0]
            raise storage_error(exc, first, f"create {what}") from None
    return path


def check_output_dir(path: Path, what: str, probe_existing: bool = True) -> Path:
    """`path` when a directory of results can be made or filled there; else one line, before any stage ran.

    A directory that exists must be one (a symlink to one is followed); one that does not must be creatable: the
    nearest existing ancestor gets a marked probe directory made and removed at once (`mkdir` is the only honest
    test: /proc or a read-only mount say no only when asked).
    """
    if path.exists() and not path.is_dir():
        kind = "a file" if path.is_file() else _kind(os.stat(path).st_mode)
        raise StorageError(f"{what} {path} is {kind}, not a directory", "pass a directory")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise StorageError(f"{what} {path}: {probe} is a file, not a directory", "choose a directory path")
    if probe == path and not probe_existing:
        return path
    test = probe / _marked("probe", "tmp")
    try:
        os.mkdir(test)
    except OSError as exc:  # name what would have been made: the first missing part (or `path` itself)
        first = path if probe == path else probe / path.relative_to(probe).parts[0]
        raise storage_error(exc, first, f"create {what}") from None
    os.rmdir(test)
    return path


def is_system_dir(path: Path) -> str | None:
    """The system directory (/etc, /usr, /proc, /dev, /sys, /boot, ...) `path` is or lies in, if any."""
    resolved = str(path.resolve())
    if resolved == "/":
        return "/"
    for d in _SYSTEM_DIRS:
        if resolved == d or resolved.startswith(d + "/"):
            return d
    return None


def local_destination(to: str, what: str = "--to", error: type[DflashError] = StorageError) -> Path | None:
    """The directory a publish destination names (a path or a file:// URL), or None for an upload URL (http(s)).

    Refused with one line, before any work: an empty value, `-`, a bare `file:`, a path whose parent does not
    exist, one that is not a directory, and system directories (a `file:///etc` index is never what was meant).
    """
    from urllib.parse import unquote, urlparse

    from vllm_dflash import urls

    value = to.strip()
    if value in ("", "-") or value.rstrip("/") in ("file:", "file:/"):
        raise error(
            f"{what} {to!r} names no directory",
            "pass an index directory (e.g. ./index) or a file:///absolute/path URL",
        )
    try:
        parsed = urlparse(value)
    except ValueError as exc:  # e.g. an unclosed IPv6 literal
        raise error(
            f"{what} {urls.redact(to)[:200]} is not a URL ({exc})", "pass a directory or an http(s) URL"
        ) from None
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            return None  # another host: the publisher's own check words it
        if not parsed.path:
            raise error(f"{what} {to!r} names no directory", "write file:///absolute/path")
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(value)
    else:
        if parsed.scheme in ("http", "https"):
            urls.upload(value, what, error)  # no password in it: it would be echoed with twine's command line
        return None  # an upload URL, or a scheme the publisher refuses itself
    if "\x00" in str(path):
        raise error(f"{what} {to!r} names a path with a NUL byte", "pass a directory path")
    system = is_system_dir(path)
    if system is not None:
        raise error(f"{what} {to} is inside the system directory {system}", "publish into a directory of your own")
    if path.exists():
        if not path.is_dir():
            raise error(f"{what} {to}: {path} is a file, not a directory", "choose a directory for the index")
    elif path.parent.exists() and not path.parent.is_dir():
        raise error(f"{what} {to}: {path.parent} is a file, not a directory", "choose a directory for the index")
    elif not path.parent.is_dir():
        raise error(
            f"{what} {to}: neither {path} nor its parent {path.parent} is an existing directory",
            "create the parent directory first, or choose an existing one",
        )
    return path


# ---------------------------------------------------------------------------------------------------------------
# Writing


def storage_error(exc: OSError, path: Path | str, doing: str) -> StorageError:
    """One line for an OSError at the I/O boundary, naming the path and what to do about it."""
    import errno

    hints = {
        errno.ENOSPC: DISK_FULL_HINT,
        errno.EDQUOT: DISK_FULL_HINT,
        errno.EROFS: "the file system is read-only; choose a writable location",
        errno.EACCES: "you lack permission there; choose a location you can write or fix its permissions",
        errno.EPERM: "you lack permission there; choose a location you can write or fix its permissions",
        errno.ENOTDIR: "a path component is a file, not a directory; choose another location",
        errno.EISDIR: "a directory is in the way of a file; choose another location",
        errno.EEXIST: "something is already in the way there; remove it or choose another location",
        errno.ENOENT: "a directory on the way does not exist; create it or choose another location",
    }
    reason = exc.strerror or str(exc)
    return StorageError(f"cannot {doing} {path}: {reason}", hints.get(exc.errno or 0, "check the path and run again"))


def ensure_dir(path: Path, what: str = "directory") -> Path:
    """`mkdir -p` with a one-line error (read-only, not a directory, no space...)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StorageError(f"{what} {path} is a file, not a directory", "choose a directory path") from None
    except OSError as exc:
        raise storage_error(exc, path, f"create {what}") from None
    return path


TEMP_PREFIX = ".vllm-dflash."
_KINDS = ("tmp", "part", "unpack")


def _marked(name: str, kind: str) -> str:
    return f"{TEMP_PREFIX}{os.getpid()}.{secrets.token_hex(4)}.{name}.{kind}"


def temp_sibling(path: Path, suffix: str = ".tmp") -> Path:
    """A hidden name next to `path` carrying the project mark, our pid and a random part: no user file has it by
    accident, two writers never share it, and a later run can tell a dead writer's leftovers."""
    kind = suffix.lstrip(".")
    if kind not in _KINDS:
        raise ValueError(f"temporary kind {suffix!r}")
    return path.with_name(_marked(path.name, kind))


def fill_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill` a temporary sibling of `path` (a function or a subprocess writing it), then rename it into place;
    nothing half-written keeps the name."""
    check_output_file(path, "output")
    ensure_dir(path.parent)
    tmp = temp_sibling(path)
    try:
        fill(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise storage_error(exc, path, "write") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    def fill(tmp: Path) -> None:
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    fill_atomic(path, fill)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def copy_atomic(src: Path, dest: Path) -> None:
    """Copy a file to `dest` through a temporary sibling (same file system) and rename."""

    def fill(tmp: Path) -> None:
        shutil.copyfile(src, tmp)

    fill_atomic(dest, fill)


@contextlib.contextmanager
def built_dir(dest: Path) -> Iterator[Path]:
    """A directory built under a temporary sibling name and renamed to `dest` when the block ends without error.

    Yields the temporary path, not yet created (a caller may create it by renaming something there). Something
    already at `dest` is never replaced: when another run put it there meanwhile (content-addressed caches), the
    first writer wins and ours is dropped. A killed build leaves only a marked hidden temporary that `sweep_stale`
    removes later where the tool owns the directory.
    """
    ensure_dir(dest.parent)
    tmp = temp_sibling(dest)
    try:
        yield tmp
        if not os.path.lexists(dest):
            os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Leftovers of dead processes

# Only names we make (temp_sibling): `.vllm-dflash.<pid>.<8 hex>.<name>.tmp|part|unpack`; nothing else is touched.
_MARKED = re.compile(r"^\.vllm-dflash\.(?P<pid>[1-9][0-9]{0,9})\.[0-9a-f]{8}\..+\.(?:tmp|part|unpack)$", re.ASCII)


def temporary_pid(name: str) -> int | None:
    """The writer's pid when `name` is one of our temporaries, else None."""
    m = _MARKED.match(name)
    return int(m.group("pid")) if m else None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: Path) -> list[Path]:
    """Remove our marked temporaries in `directory` whose writing process is gone.

    Called only on directories the tool owns (the cache's, the checkout's default dist/), never on a directory a
    user named (`--out`, `--dest`, `--to`). An entry must carry the mark *and* name a dead pid; a live writer's
    files and every other name are left alone. Returns what was removed.
    """
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        pid = temporary_pid(entry.name)
        if pid is None or pid_alive(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    return removed
