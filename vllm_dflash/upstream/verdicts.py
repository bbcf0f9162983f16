"""Verdicts: per patch of the queue, where it stands on an upstream target, and the evidence that decided it.

"Already upstream" is never decided by reverse-apply alone: a later upstream edit of the same lines makes
reverse-apply fail, and a coincidental match makes it pass. git apply (forward and reverse), a content check of the
patch's own lines, the Drop-When header and the watch records are combined, and all of them are printed.
"""

from __future__ import annotations

import enum
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import UpstreamError
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.patches import PatchState, check_series
from vllm_dflash.series import Patch
from vllm_dflash.upstream.evidence import (
    ContentCheck,
    DropWhen,
    WatchRule,
    content_check,
    parse_changes,
    parse_drop_when,
)
from vllm_dflash.upstream.lineend import LineEnd, line_end
from vllm_dflash.upstream.targets import Target


class Status(enum.Enum):
    APPLIES = "needed, applies"
    CONFLICTS = "needed, conflicts"
    UPSTREAM = "already upstream"
    SUPERSEDED = "superseded upstream"
    REVIEW = "unclear, review"


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
    end: LineEnd | None = None  # the target has no Model Runner V1: this verdict instead of per-patch ones

    @property
    def needs_attention(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.status is not Status.APPLIES)

    def as_json(self) -> dict[str, Any]:
        return {
            "against": self.target.ref,
            "v1_removed": self.end.as_json() if self.end is not None else None,
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
        if self.end is not None:
            return "\n".join([*lines, *self.end.lines()]) + "\n"
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
        ]
        if self.end is not None:
            facts = [f"- {x.strip()}" for x in self.end.lines()[1:]]
            return "\n".join([*out, f"**{self.end.verdict()}**", "", *facts]) + "\n"
        out += [
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


def failing_hunks(target: Target, patch: Patch) -> tuple[str, ...]:
    """Every hunk that does not apply on its own to the pristine target (git stops at a file's first failure)."""
    failing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-hunks.") as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
        proc.call("git", "read-tree", target.rev, cwd=target.tree, env=env, quiet=True, error=UpstreamError)
        pieces = [(fd.path, n, h.header, fd.header + h.text) for fd in patch.diff for n, h in enumerate(fd.hunks, 1)]
        for path, n, head, one in pieces:
            piece = Path(td) / "hunk.patch"
            piece.write_text(one)
            res = proc.call("git", "apply", "--cached", "--check", "-p1", piece, cwd=target.tree, env=env,
                            capture=True, check=False, quiet=True)  # fmt: skip
            if res.returncode != 0:
                failing.append(f"{path}: hunk {n} ({head})")
    return tuple(failing)


def analyse(
    manifest: Manifest,
    target: Target,
    queue: Sequence[Patch],
    rules: Sequence[WatchRule],
    drafter: str | None = None,
) -> UpstreamReport:
    """The `upstream` stage: a verdict per patch of the queue (in series order) on `target`; on a target without Model
    Runner V1, the one end-of-V1 verdict instead (for `drafter`'s kind, or every kind). Changes no tree."""
    pinned = f"{manifest.upstream.version} ({manifest.upstream.tag})"
    end = line_end(manifest, target.version, target.read, drafter)
    if end is not None:
        return UpstreamReport(target=target, pinned=pinned, verdicts=(), end=end)
    checks = check_series(target.tree, queue, ref=target.rev)
    verdicts: list[Verdict] = []
    for check in checks:
        patch = check.patch
        changes = parse_changes(patch.text)
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
                failures=failing_hunks(target, patch) or check.failures if check.state is PatchState.CONFLICTS else (),
                notes=notes,
            )
        )
    return UpstreamReport(target=target, pinned=pinned, verdicts=tuple(verdicts))
