"""Names that come from outside the code (manifest, index answers, series lines, CLI options) and the files we write.

Every such name is confined here, in one place, to the directory it belongs in: no separators, no `..`, no absolute
paths, no symlink escape. Writes go through a temporary sibling and an atomic rename, so a killed process never
leaves a half-written file under a final name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

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


def temp_sibling(path: Path, suffix: str = ".tmp") -> Path:
    """A hidden name next to `path` that carries our pid, so a later run can tell a dead writer's leftovers."""
    return path.with_name(f".{path.name}.{os.getpid()}{suffix}")


def fill_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill` a temporary sibling of `path` (a function or a subprocess writing it), then rename it into place;
    nothing half-written keeps the name."""
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

    Yields the temporary path, not yet created (a caller may create it by renaming something there). A directory
    already at `dest` is replaced; a killed build leaves only a hidden `.<name>.<pid>.tmp` that `sweep_stale`
    removes later.
    """
    ensure_dir(dest.parent)
    tmp = temp_sibling(dest)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Leftovers of dead processes

# Only names we make (temp_sibling): `.<name>.<pid>.tmp|part|unpack`; nothing else in a directory is touched.
_PID_IN_NAME = re.compile(r"^\..+\.(?P<pid>\d+)\.(?:tmp|part|unpack)$")


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
    """Remove hidden temporaries (`.<name>.<pid>...`) in `directory` whose writing process is gone.

    Our temporaries carry the writer's pid; a live writer's files are left alone, a dead one's can only be the
    remains of a kill, and nothing ever trusts them. Returns what was removed.
    """
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        m = _PID_IN_NAME.match(entry.name)
        if not m or pid_alive(int(m.group("pid"))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    return removed
