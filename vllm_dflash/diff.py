"""The one unified-diff parser (git format-patch / git diff output): files, their modes, hunks and hunk lines.

Everything that reads a diff — the queue's path checks, conflict reports, the upstream content checks, splitting a
patch into one-hunk patches — reads it through `parse`, so there is one notion of what a diff says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_DIFF_GIT = re.compile(r"^diff --git (?P<a>\S+) (?P<b>\S+)$")
_HUNK = re.compile(r"^@@ -(?P<old>\d+)(?:,(?P<oldn>\d+))? \+(?P<new>\d+)(?:,(?P<newn>\d+))? @@")
_SYMLINK_MODE = re.compile(r"^(new file mode|old mode|new mode|deleted file mode) 120000")


@dataclass(frozen=True)
class Hunk:
    old_start: int
    new_start: int
    header: str  # "@@ -a,b +c,d @@"
    lines: tuple[str, ...]  # the hunk body, each line with its ' ', '+', '-' or '\' marker and its newline
    text: str  # the '@@' line and the body, exactly as in the diff

    @property
    def added(self) -> tuple[str, ...]:
        return tuple(ln[1:].rstrip("\n") for ln in self.lines if ln.startswith("+"))

    @property
    def removed(self) -> tuple[str, ...]:
        return tuple(ln[1:].rstrip("\n") for ln in self.lines if ln.startswith("-"))


@dataclass(frozen=True)
class FileDiff:
    old_path: str | None  # None for a new file
    new_path: str | None  # None for a deleted file
    header: str  # the 'diff --git' line and the extended headers up to the first hunk, exactly as in the diff
    hunks: tuple[Hunk, ...]
    new_file: bool = False
    deleted: bool = False
    symlink: bool = False  # creates, changes or deletes a symlink (mode 120000)
    raw_paths: tuple[str, ...] = field(default_factory=tuple)  # every path as written (a/ b/ prefixes kept)

    @property
    def path(self) -> str:
        """The path the change lands on (the new path, or the old one for a deletion)."""
        return self.new_path or self.old_path or ""


def _strip(p: str) -> str:
    return p[2:] if p[:2] in ("a/", "b/") else p


def parse(text: str) -> tuple[FileDiff, ...]:
    """Every file section of a diff. Text before the first 'diff --git' (mail headers, message) is skipped; a
    format-patch signature ('-- ' line) ends the last hunk."""
    files: list[FileDiff] = []
    cur: dict[str, object] | None = None
    hunk_lines: list[str] = []
    hunks: list[Hunk] = []
    hunk_head: tuple[int, int, str, str] | None = None

    def end_hunk() -> None:
        nonlocal hunk_head, hunk_lines
        if hunk_head is not None:
            old, new, header, first = hunk_head
            hunks.append(Hunk(old, new, header, tuple(hunk_lines), first + "".join(hunk_lines)))
        hunk_head, hunk_lines = None, []

    def end_file() -> None:
        nonlocal cur, hunks
        end_hunk()
        if cur is not None:
            files.append(
                FileDiff(
                    old_path=cur["old"],  # type: ignore[arg-type]
                    new_path=cur["new"],  # type: ignore[arg-type]
                    header="".join(cur["header"]),  # type: ignore[arg-type]
                    hunks=tuple(hunks),
                    new_file=bool(cur["new_file"]),
                    deleted=bool(cur["deleted"]),
                    symlink=bool(cur["symlink"]),
                    raw_paths=tuple(cur["raw"]),  # type: ignore[arg-type]
                )
            )
        cur, hunks = None, []

    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if bare.startswith("diff --git "):
            end_file()
            m = _DIFF_GIT.match(bare)
            a, b = (m.group("a"), m.group("b")) if m else ("", "")
            cur = {
                "old": _strip(a) or None,
                "new": _strip(b) or None,
                "header": [line],
                "new_file": False,
                "deleted": False,
                "symlink": False,
                "raw": [p for p in (a, b) if p],
            }
            continue
        if cur is None:
            continue
        if hunk_head is None and not bare.startswith("@@"):
            cur["header"].append(line)  # type: ignore[attr-defined]
            if bare.startswith("new file mode"):
                cur["new_file"], cur["old"] = True, None
            elif bare.startswith("deleted file mode"):
                cur["deleted"], cur["new"] = True, None
            if _SYMLINK_MODE.match(bare):
                cur["symlink"] = True
            if bare.startswith(("--- ", "+++ ")):
                target = bare[4:].split("\t")[0]
                if target != "/dev/null":
                    cur["raw"].append(target)  # type: ignore[attr-defined]
            elif bare.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
                cur["raw"].append(bare.split(" ", 2)[2])  # type: ignore[attr-defined]
                if bare.startswith(("rename to ", "copy to ")):
                    cur["new"] = bare.split(" ", 2)[2]
                else:
                    cur["old"] = bare.split(" ", 2)[2]
            continue
        if bare.startswith("@@"):
            end_hunk()
            m = _HUNK.match(bare)
            if m:
                header = bare[: bare.index("@@", 2) + 2]
                hunk_head = (int(m.group("old")), int(m.group("new")), header, line)
            continue
        if bare in ("-- ", "--"):  # format-patch signature: the diff is over
            end_hunk()
            continue
        if hunk_head is not None and line[:1] in (" ", "+", "-", "\\"):
            hunk_lines.append(line)
    end_file()
    return tuple(files)
