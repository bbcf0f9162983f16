"""The one unified-diff parser (git format-patch / git diff output): files, their modes, hunks and hunk lines.

Everything that reads a diff — the queue's path checks, conflict reports, the upstream content checks, splitting a
patch into one-hunk patches — reads it through `parse`, so there is one notion of what a diff says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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
    """Every file section of a diff (git's `diff --git` sections, or plain `---`/`+++` ones).

    Hunk bodies are consumed by the line counts their `@@` header gives, as `git apply` does, so a body line that
    looks like a header (`--- x`) or the format-patch signature (`-- `) is never misread. Text before the first
    section (mail headers, the message) is skipped.
    """
    files: list[FileDiff] = []
    cur: dict[str, Any] | None = None
    hunks: list[Hunk] = []
    body: list[str] = []
    head: tuple[int, int, str, str] | None = None
    left_old = left_new = 0  # body lines still owed to the current hunk

    def end_hunk() -> None:
        nonlocal head, body
        if head is not None:
            old, new, header, first = head
            hunks.append(Hunk(old, new, header, tuple(body), first + "".join(body)))
        head, body = None, []

    def end_file() -> None:
        nonlocal cur, hunks
        end_hunk()
        if cur is not None:
            files.append(
                FileDiff(
                    old_path=cur["old"],
                    new_path=cur["new"],
                    header="".join(cur["header"]),
                    hunks=tuple(hunks),
                    new_file=bool(cur["new_file"]),
                    deleted=bool(cur["deleted"]),
                    symlink=bool(cur["symlink"]),
                    raw_paths=tuple(cur["raw"]),
                )
            )
        cur, hunks = None, []

    def start(header_line: str, a: str | None, b: str | None, raw: list[str]) -> dict[str, Any]:
        return {
            "old": a,
            "new": b,
            "header": [header_line],
            "new_file": False,
            "deleted": False,
            "symlink": False,
            "raw": raw,
            "git": header_line.startswith("diff --git "),
        }

    lines = text.splitlines(keepends=True)
    for n, line in enumerate(lines):
        bare = line.rstrip("\n")
        if head is not None and (left_old > 0 or left_new > 0):
            marker = line[:1]
            if marker in (" ", "\n", "\r") or line == "\n":
                left_old, left_new = left_old - 1, left_new - 1
            elif marker == "-":
                left_old -= 1
            elif marker == "+":
                left_new -= 1
            elif marker != "\\":
                end_hunk()  # a short hunk: git would refuse it; we keep what it said
                left_old = left_new = 0
            if head is not None:
                body.append(line)
            continue
        if head is not None and line.startswith("\\"):  # "\ No newline at end of file" after the last line
            body.append(line)
            continue
        if bare.startswith("diff --git "):
            end_file()
            m = _DIFF_GIT.match(bare)
            a, b = (m.group("a"), m.group("b")) if m else ("", "")
            cur = start(line, _strip(a) or None, _strip(b) or None, [p for p in (a, b) if p])
            continue
        plain_start = bare.startswith("--- ") and n + 1 < len(lines) and lines[n + 1].startswith("+++ ")
        if plain_start and (cur is None or hunks or head is not None or not cur["git"]):
            end_file()
            a = bare[4:].split("\t")[0]
            b = lines[n + 1].rstrip("\n")[4:].split("\t")[0]
            cur = start(line, None if a == "/dev/null" else _strip(a), None if b == "/dev/null" else _strip(b), [])
            cur["raw"] += [p for p in (a, b) if p != "/dev/null"]
            cur["new_file"], cur["deleted"] = a == "/dev/null", b == "/dev/null"
            continue
        if cur is None:
            continue
        if bare.startswith("@@"):
            end_hunk()
            m = _HUNK.match(bare)
            if m:
                header = bare[: bare.index("@@", 2) + 2]
                head = (int(m.group("old")), int(m.group("new")), header, line)
                left_old = int(m.group("oldn") or 1)
                left_new = int(m.group("newn") or 1)
            continue
        if head is None and not hunks:
            cur["header"].append(line)
            if bare.startswith("new file mode"):
                cur["new_file"], cur["old"] = True, None
            elif bare.startswith("deleted file mode"):
                cur["deleted"], cur["new"] = True, None
            if _SYMLINK_MODE.match(bare):
                cur["symlink"] = True
            if bare.startswith(("--- ", "+++ ")):
                target = bare[4:].split("\t")[0]
                if target != "/dev/null":
                    cur["raw"].append(target)
            elif bare.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
                path = bare.split(" ", 2)[2]
                cur["raw"].append(path)
                cur["new" if bare.startswith(("rename to ", "copy to ")) else "old"] = path
    end_file()
    return tuple(files)
