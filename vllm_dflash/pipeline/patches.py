"""Patch stage: the queue checked without touching the tree, and applied one commit per patch on the fork branch.

Application is exact: `git apply` with full context, no fuzz, no whitespace leniency; a patch that reverse-applies
is already upstream and must be dropped, not re-applied. The queue itself (series, patch files) is read by
vllm_dflash.series; this stage only runs git on what it was given.
"""

from __future__ import annotations

import enum
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.errors import DirtyTreeError, PatchError
from vllm_dflash.pipeline.model import PatchedTree, SourceTree
from vllm_dflash.pipeline.source import FIXED_DATE, check_clean
from vllm_dflash.series import Patch, parse_patch


class PatchState(enum.Enum):
    APPLIES = "applies"
    ALREADY_UPSTREAM = "already upstream"
    CONFLICTS = "conflicts"


@dataclass(frozen=True)
class PatchCheck:
    patch: Patch
    state: PatchState
    failures: tuple[str, ...]  # "path: hunk N (@@ ... @@)" descriptions


# ---------------------------------------------------------------------------------------------------------------
# Checking (never mutates the tree: a throwaway index file, `git apply --cached`)

# Exact application: all context lines must match, whitespace too. (git apply never fuzzes unless -C is given.)
_APPLY = ("apply", "--whitespace=nowarn", "-p1")


def _failures(patch: Patch, output: str) -> tuple[str, ...]:
    hunks = {fd.path: [(h.old_start, h.header) for h in fd.hunks] for fd in patch.diff}
    out: list[str] = []
    other: list[str] = []
    for line in output.splitlines():
        line = line.strip()
        if m := re.match(r"^error: patch failed: (?P<path>.+):(?P<line>\d+)$", line):
            path, start = m.group("path"), int(m.group("line"))
            for i, (old, header) in enumerate(hunks.get(path, []), 1):
                if old == start:
                    out.append(f"{path}: hunk {i} ({header})")
                    break
            else:
                out.append(f"{path}: hunk at line {start}")
        elif m := re.match(r"^error: (?P<path>.+?): (?P<why>does not exist in index|No such file or directory)$", line):
            out.append(f"{m.group('path')}: file does not exist")
        elif m := re.match(r"^error: (?P<path>.+?): already exists in index$", line):
            out.append(f"{m.group('path')}: file already exists")
        elif line.startswith("error:") and not line.endswith(("patch does not apply", "while searching for:")):
            other.append(line.removeprefix("error: "))
    return tuple(dict.fromkeys(out or other)) or ("does not apply",)


def check_series(tree: Path, patches: Sequence[Patch], ref: str = "HEAD") -> tuple[PatchCheck, ...]:
    """Check each patch on top of `ref` plus the earlier patches that apply; the tree itself is never touched."""
    results: list[PatchCheck] = []
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-index.") as td:
        env = {"GIT_INDEX_FILE": str(Path(td) / "index")}
        proc.call("git", "read-tree", ref, cwd=tree, env=env, error=PatchError, hint=f"is '{ref}' a commit in {tree}?")
        for patch in patches:
            fwd = proc.call(
                "git", *_APPLY, "--cached", "--check", "-v", patch.path, cwd=tree, env=env, capture=True, check=False
            )
            if fwd.returncode == 0:
                proc.call("git", *_APPLY, "--cached", patch.path, cwd=tree, env=env, capture=True, error=PatchError)
                results.append(PatchCheck(patch, PatchState.APPLIES, ()))
                continue
            rev = proc.call(
                "git",
                *_APPLY,
                "--cached",
                "--check",
                "--reverse",
                patch.path,
                cwd=tree,
                env=env,
                capture=True,
                check=False,
            )
            if rev.returncode == 0:
                results.append(PatchCheck(patch, PatchState.ALREADY_UPSTREAM, ()))
            else:
                results.append(PatchCheck(patch, PatchState.CONFLICTS, _failures(patch, fwd.stderr + fwd.stdout)))
    return tuple(results)


def check_patch(tree: Path, patch: Patch) -> PatchCheck:
    """Does `patch` apply to `tree`'s HEAD exactly, is it already there (reverse-applies), or does it conflict?"""
    return check_series(tree, [patch])[0]


def refuse_unless_all_apply(checks: Sequence[PatchCheck], where: str) -> None:
    for c in checks:
        if c.state is PatchState.CONFLICTS:
            raise PatchError(
                f"patch {c.patch.name} conflicts with {where}: {'; '.join(c.failures)}",
                "refresh the patch against this upstream (no fuzz is accepted)",
            )
        if c.state is PatchState.ALREADY_UPSTREAM:
            raise PatchError(
                f"patch {c.patch.name} is already applied in {where} (it reverse-applies): it is already upstream",
                "drop it from patches/series",
            )


# ---------------------------------------------------------------------------------------------------------------
# Applying


def _commit_env(patch: Patch) -> dict[str, str]:
    # Committer date = author date from the patch (or a fixed date): the same queue always gives the same SHAs.
    return {
        "GIT_COMMITTER_NAME": "vllm-dflash",
        "GIT_COMMITTER_EMAIL": "vllm-dflash@localhost",
        "GIT_AUTHOR_NAME": "vllm-dflash",
        "GIT_AUTHOR_EMAIL": "vllm-dflash@localhost",
        "GIT_AUTHOR_DATE": FIXED_DATE,
        "GIT_COMMITTER_DATE": FIXED_DATE,
    }


def apply_series(source: SourceTree, patches: Sequence[Patch], branch: str) -> PatchedTree:
    """Apply the queue on a fork branch `branch` starting at the upstream base, one commit per patch.

    Refuses (PatchError) unsafe paths, conflicts and patches already upstream before changing anything; on any
    failure the tree is put back on its base commit.
    """
    import git

    for patch in patches:  # re-validate: a Patch may have been built by hand
        parse_patch(patch.path, patch.text.encode(), patch.queue)
    tree = source.path
    check_clean(tree)
    checks = check_series(tree, patches, ref=source.base)
    refuse_unless_all_apply(checks, f"upstream {source.version} ({source.kind} {source.commit[:12]})")

    repo = git.Repo(tree)
    proc.echo(["git", "checkout", "-q", "-B", branch, source.base], tree)
    repo.git.checkout("-q", "-B", branch, source.base)
    commits: list[tuple[Patch, str]] = []
    try:
        for patch in patches:
            env = _commit_env(patch)
            if patch.is_mbox:
                # `git am` keeps the patch's own message (DEP-3 headers included) and author.
                proc.call(
                    "git",
                    "am",
                    "-q",
                    "--no-3way",
                    "--committer-date-is-author-date",
                    "--whitespace=nowarn",
                    patch.path,
                    cwd=tree,
                    env={k: v for k, v in env.items() if "AUTHOR" not in k},
                    error=PatchError,
                    hint="git says why above; the queue was checked to apply exactly before this step",
                )
            else:
                proc.call(
                    "git",
                    *_APPLY,
                    "--index",
                    patch.path,
                    cwd=tree,
                    error=PatchError,
                    hint="git says why above; the queue was checked to apply exactly before this step",
                )
                message = patch.subject + "\n\n" + "\n".join(f"{k}: {v}" for k, v in patch.headers.items()) + "\n"
                proc.call("git", "commit", "-q", "--no-verify", "-m", message, cwd=tree, env=env, error=PatchError)
            commits.append((patch, repo.head.commit.hexsha))
            print(f"  applied {patch.name}: {patch.subject}", flush=True)
    except (PatchError, git.GitCommandError) as exc:
        proc.call("git", "am", "--abort", cwd=tree, capture=True, check=False)
        repo.git.checkout("-q", "-f", "--detach", source.base)
        repo.git.branch("-D", branch)
        if isinstance(exc, PatchError):
            raise
        raise PatchError(f"applying the queue failed: {exc}", "see the git output above") from None
    try:
        check_clean(tree)
    except DirtyTreeError as exc:
        raise PatchError(f"applying the queue left changes behind: {exc.message}", "report this") from None
    head = repo.head.commit.hexsha
    print(f"fork branch {branch}: {len(commits)} patch(es) on {source.base[:12]}, head {head[:12]}", flush=True)
    return PatchedTree(path=tree, branch=branch, base=source.base, head=head, commits=tuple(commits), source=source)
