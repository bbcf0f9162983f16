"""The evidence an upstream verdict is made of: a patch's Drop-When header, the watch records of patches/watch.toml
(this module owns that format), and a content check of the patch's own added and removed lines in the target tree.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import diff
from vllm_dflash.errors import ManifestError

WATCH_RECORD = "watch.toml"
# Share of a patch's own (non-trivial) lines that must be found (added) or gone (removed) for the content check.
CONTENT_THRESHOLD = 0.9
# "merged as #40727, released in v0.22.0" (also: first in / fixed in / shipped in / since / >= vX.Y.Z)
_RELEASED_IN = re.compile(
    r"(?:released in|first in|fixed in|shipped in|landed in|reaches|since|>=|≥)\s*(?:vllm\s*)?"
    r"v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)",
    re.IGNORECASE,
)
_PR = re.compile(r"#(?P<n>\d+)")


@dataclass(frozen=True)
class Probe:
    file: str
    pattern: str  # regular expression searched in the target file

    def matches(self, text: str | None) -> bool:
        return text is not None and re.search(self.pattern, text, re.MULTILINE) is not None


@dataclass(frozen=True)
class WatchRule:
    """What upstream did for a patch in a form a Drop-When header cannot express (patches/watch.toml)."""

    name: str
    patches: tuple[str, ...]  # globs on the patch file name
    subject: str  # regular expression on the patch subject ("" = none); either kind of match selects the patch
    since: str  # first release with the upstream change
    scope: str  # e.g. "V2 runner only"
    summary: str
    probes: tuple[Probe, ...]

    def selects(self, name: str, subject: str) -> bool:
        if any(fnmatch.fnmatch(name, g) for g in self.patches):
            return True
        return bool(self.subject) and re.search(self.subject, subject) is not None


@dataclass(frozen=True)
class DropWhen:
    text: str
    release: str | None  # "released in vX.Y.Z"
    prs: tuple[str, ...]

    def met(self, version: str | None) -> bool | None:
        """True/False when both the header and the target name a release; None when either does not."""
        if self.release is None or version is None:
            return None
        from packaging.version import Version

        return Version(version) >= Version(self.release)


def parse_drop_when(text: str) -> DropWhen:
    m = _RELEASED_IN.search(text)
    return DropWhen(text=text, release=m.group("v") if m else None, prs=tuple(_PR.findall(text)))


def load_watch_rules(patches_dir: Path) -> tuple[WatchRule, ...]:
    """patches/watch.toml (this module owns the format); no file means no rules."""
    path = patches_dir / WATCH_RECORD
    if not path.is_file():
        return ()
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ManifestError(f"{path} is not UTF-8 text", "save it as UTF-8") from None
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}", "check the file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}", "fix the syntax error it names") from None
    rules: list[WatchRule] = []
    for name, entry in (data.get("watch") or {}).items():
        try:
            probes = tuple(Probe(file=str(p["file"]), pattern=str(p["pattern"])) for p in entry["probe"])
            globs = entry.get("patch", [])
            rules.append(
                WatchRule(
                    name=name,
                    patches=(globs,) if isinstance(globs, str) else tuple(str(g) for g in globs),
                    subject=str(entry.get("subject", "")),
                    since=str(entry["since"]).removeprefix("v"),
                    scope=str(entry["scope"]),
                    summary=str(entry.get("summary", "")),
                    probes=probes,
                )
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(
                f"{path}: [watch.{name}] lacks {exc}", "give it patch, since, scope and probe"
            ) from None
        if not probes:
            raise ManifestError(f"{path}: [watch.{name}] has no probe", "add at least one [[watch.NAME.probe]]")
    return tuple(rules)


# ---------------------------------------------------------------------------------------------------------------
# Content check: the patch's own lines in the target files


@dataclass(frozen=True)
class FileChange:
    path: str
    new_file: bool
    deleted: bool
    added: tuple[str, ...]
    removed: tuple[str, ...]


def _significant(line: str) -> bool:
    """Lines that say something: not blank, not a comment, not bare punctuation or a keyword alone."""
    s = line.strip()
    if len(s) < 8 or s.startswith(("#", '"""', "'''", "//")):
        return False
    return re.search(r"[A-Za-z0-9_]{3}", s) is not None


def parse_changes(text: str) -> tuple[FileChange, ...]:
    """Per file, the significant lines a unified diff adds and removes (lines that only move are ignored)."""
    out: list[FileChange] = []
    for fd in diff.parse(text):
        add = [ln.strip() for h in fd.hunks for ln in h.added]
        rm = [ln.strip() for h in fd.hunks for ln in h.removed]
        added, removed = set(add), set(rm)
        out.append(
            FileChange(
                path=fd.path,
                new_file=fd.new_file,
                deleted=fd.deleted,
                added=tuple(dict.fromkeys(s for s in add if s not in removed and _significant(s))),
                removed=tuple(dict.fromkeys(s for s in rm if s not in added and _significant(s))),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class ContentCheck:
    added_total: int
    added_present: int
    removed_total: int
    removed_absent: int

    @property
    def added_found(self) -> bool:
        return self.added_total > 0 and self.added_present >= CONTENT_THRESHOLD * self.added_total

    @property
    def removed_gone(self) -> bool:
        return self.removed_total > 0 and self.removed_absent >= CONTENT_THRESHOLD * self.removed_total

    @property
    def matches(self) -> bool:
        """The target looks like the patched tree: our added lines there, our removed lines gone (if any)."""
        return self.added_found and (self.removed_total == 0 or self.removed_gone)

    def describe(self) -> str:
        added = f"added {self.added_present}/{self.added_total} present"
        return f"{added}, removed {self.removed_absent}/{self.removed_total} gone"


def content_check(changes: Sequence[FileChange], read: Any) -> ContentCheck:
    """`read(path) -> str | None` gives a target file's text (None: no such file)."""
    at = ap = rt = ra = 0
    for ch in changes:
        text = read(ch.path)
        lines = {ln.strip() for ln in text.splitlines()} if text is not None else set()
        at += len(ch.added)
        ap += sum(1 for s in ch.added if s in lines)
        rt += len(ch.removed)
        ra += sum(1 for s in ch.removed if s not in lines)
    return ContentCheck(added_total=at, added_present=ap, removed_total=rt, removed_absent=ra)
