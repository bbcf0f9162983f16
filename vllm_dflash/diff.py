"""The one unified-diff parser (git format-patch / git diff output): files, their modes, hunks and hunk lines.

Everything that reads a diff — the queue's path checks, conflict reports, the upstream content checks, splitting a
patch into one-hunk patches — reads it through `parse`, so there is one notion of what a diff says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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


# git quotes a path that holds '"', '\\', a control character or (core.quotePath) a non-ASCII byte: C style, in double
# quotes, with \ooo octal escapes for bytes. A space is never quoted; a TAB then ends the name on ---/+++ lines.
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def _unquote_at(text: str, start: int) -> tuple[str, int]:
    """The C-quoted name opening at `text[start]` ('"'), unquoted, and the index after its closing quote."""
    out = bytearray()
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            return out.decode("utf-8", "surrogateescape"), i + 1
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in "0123" and re.match(r"[0-7]{3}", text[i + 1 : i + 4]):
                out.append(int(text[i + 1 : i + 4], 8))
                i += 4
                continue
            if nxt in _C_ESCAPES:
                out.append(_C_ESCAPES[nxt])
                i += 2
                continue
            raise ValueError(f"bad escape \\{nxt}")
        out += c.encode("utf-8", "surrogateescape")
        i += 1
    raise ValueError("unterminated quoted name")


def unquote(name: str) -> str:
    """A path as git writes it on a ---/+++/rename/copy line: C-unquoted when quoted, else up to a TAB."""
    if name.startswith('"'):
        try:
            return _unquote_at(name, 0)[0]
        except ValueError:
            return name  # not git's quoting: kept as written (the path checks then see the quote characters)
    return name.split("\t")[0]


def _git_header_names(rest: str) -> tuple[str, str] | None:
    """The two names of a `diff --git A B` line (after 'diff --git '), read as git does: either may be C-quoted;
    two unquoted names (spaces allowed) are split where both sides name the same path. None: not decidable here
    (a rename with unquoted spaces; its rename lines name the paths)."""
    try:
        if rest.startswith('"'):
            a, end = _unquote_at(rest, 0)
            second = rest[end + 1 :] if rest[end : end + 1] == " " else ""
            b = _unquote_at(second, 0)[0] if second.startswith('"') else second
            return (a, b) if b else None
        q = rest.find(' "')
        if q > 0 and rest.endswith('"'):
            return rest[:q], _unquote_at(rest, q + 1)[0]
    except ValueError:
        return None
    for i, c in enumerate(rest):
        if c == " " and _strip(rest[:i]) == _strip(rest[i + 1 :]) and rest[:i]:
            return rest[:i], rest[i + 1 :]
    parts = rest.split(" ")
    return (parts[0], parts[1]) if len(parts) == 2 else None


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
            names = _git_header_names(bare[len("diff --git ") :])
            a, b = names or ("", "")
            cur = start(line, _strip(a) or None, _strip(b) or None, [p for p in (a, b) if p])
            continue
        plain_start = bare.startswith("--- ") and n + 1 < len(lines) and lines[n + 1].startswith("+++ ")
        if plain_start and (cur is None or hunks or head is not None or not cur["git"]):
            end_file()
            a = unquote(bare[4:])
            b = unquote(lines[n + 1].rstrip("\n")[4:])
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
                target = unquote(bare[4:])
                if target != "/dev/null":
                    cur["raw"].append(target)
                    if cur["old" if bare.startswith("---") else "new"] is None and not (
                        cur["new_file"] if bare.startswith("---") else cur["deleted"]
                    ):
                        cur["old" if bare.startswith("---") else "new"] = _strip(target)
            elif bare.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
                path = unquote(bare.split(" ", 2)[2])
                cur["raw"].append(path)
                cur["new" if bare.startswith(("rename to ", "copy to ")) else "old"] = path
    end_file()
    return tuple(files)
