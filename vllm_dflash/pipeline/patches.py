"""Patch stage: the queue in patches/series, checked without touching the tree and applied one commit per patch.

Each patch is a `git format-patch` file whose message carries DEP-3 style headers (Description/Subject, Origin,
Forwarded, Applied-Upstream, Bug, Last-Update, Drop-When). Application is exact: `git apply` with full context, no
fuzz, no whitespace leniency; a patch that reverse-applies is already upstream and must be dropped, not re-applied.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import DirtyTreeError, ManifestError, PatchError
from vllm_dflash.manifest import SERIES_PATH, load_manifest
from vllm_dflash.pipeline.source import FIXED_DATE, SourceTree, check_clean

DEP3_KEYS = ("Description", "Subject", "Origin", "Forwarded", "Applied-Upstream", "Bug", "Last-Update", "Drop-When")
# Paths that the wheel does not ship: a .py change there cannot affect the fast-path overlay.
UNSHIPPED_PREFIXES = ("tests/", "docs/", "examples/", "benchmarks/")
_HEADER = re.compile(r"^(?P<key>[A-Z][A-Za-z0-9-]*):\s?(?P<value>.*)$")
_DIFF_GIT = re.compile(r"^diff --git (?P<a>\S+) (?P<b>\S+)$")
_HUNK = re.compile(r"^@@ -(?P<old>\d+)(?:,(?P<oldn>\d+))? \+(?P<new>\d+)(?:,(?P<newn>\d+))? @@")


@dataclass(frozen=True)
class Patch:
    path: Path
    name: str
    subject: str
    headers: Mapping[str, str]  # DEP-3 style: Description/Subject, Origin, Forwarded, Applied-Upstream, Bug, ...
    files: tuple[str, ...]  # repository-relative paths the patch touches (old and new names)
    sha256: str
    python_only: bool  # every touched file is a .py file under vllm/ (or not shipped in the wheel at all)

    @property
    def drop_when(self) -> str:
        return self.headers.get("Drop-When", "")


class PatchState(enum.Enum):
    APPLIES = "applies"
    ALREADY_UPSTREAM = "already upstream"
    CONFLICTS = "conflicts"


@dataclass(frozen=True)
class PatchCheck:
    patch: Patch
    state: PatchState
    failures: tuple[str, ...]  # "path: hunk N (@@ ... @@)" descriptions


@dataclass(frozen=True)
class PatchedTree:
    path: Path
    branch: str
    base: str
    head: str
    commits: tuple[tuple[Patch, str], ...]  # (patch, commit SHA) in series order
    source: SourceTree


# ---------------------------------------------------------------------------------------------------------------
# Reading patches


def _hunks(text: str) -> dict[str, list[tuple[int, str]]]:
    """path -> [(old start line, '@@ ... @@' header)] for every hunk, in order."""
    out: dict[str, list[tuple[int, str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            target = line[4:].split("\t")[0]
            current = target[2:] if target.startswith("b/") else target
        elif line.startswith("--- ") and current is None:
            pass
        elif line.startswith("diff --git "):
            m = _DIFF_GIT.match(line)
            current = m.group("b")[2:] if m else None
        elif current and (m := _HUNK.match(line)):
            header = line[: line.index("@@", 2) + 2]
            out.setdefault(current, []).append((int(m.group("old")), header))
    return out


def _touched(text: str) -> tuple[list[str], list[str]]:
    """Touched paths (as written, a/ b/ prefixes stripped) and the reasons any of them is unsafe."""
    paths: list[str] = []
    problems: list[str] = []
    for line in text.splitlines():
        raw: list[str] = []
        if m := _DIFF_GIT.match(line):
            raw = [m.group("a"), m.group("b")]
        elif line.startswith(("--- ", "+++ ")):
            target = line[4:].split("\t")[0]
            if target != "/dev/null":
                raw = [target]
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            raw = ["x/" + line.split(" ", 2)[2]]
        elif re.match(r"^(new file mode|old mode|new mode|deleted file mode) 120000", line):
            problems.append("creates or changes a symlink")
        for r in raw:
            p = r[2:] if r[:2] in ("a/", "b/", "x/") else r
            if p.startswith("/") or r.startswith("/"):
                problems.append(f"absolute path '{r}'")
            elif ".." in PurePosixPath(p).parts or p.startswith("../"):
                problems.append(f"path '{p}' escapes the tree")
            elif PurePosixPath(p).parts[:1] == (".git",):
                problems.append(f"path '{p}' is inside .git")
            if p not in paths:
                paths.append(p)
    return paths, problems


def _is_python_only(path: str) -> bool:
    if path.startswith(UNSHIPPED_PREFIXES):
        return True
    return path.startswith("vllm/") and path.endswith(".py")


def load_patch(path: Path) -> Patch:
    """Parse one patch file: subject, DEP-3 headers, touched files. Unsafe paths raise PatchError."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"cannot read patch {path}: {exc.strerror}", "fix patches/series") from None
    text = data.decode("utf-8", errors="replace")
    head, sep, _ = text.partition("\ndiff --git ")
    if not sep:
        head = text.split("\n--- ", 1)[0]
    # Everything before the diffstat separator ('---' on its own line) is mail headers + message.
    message = head.split("\n---\n", 1)[0]
    headers: dict[str, str] = {}
    subject = ""
    last: str | None = None
    for line in message.splitlines():
        if line.startswith(" ") and last is not None:  # RFC 822 / DEP-3 continuation line
            sep = " " if last == "Subject" else "\n"  # RFC 822 folds long subjects; they are one line
            headers[last] = (headers[last] + sep + line.strip()).strip()
            continue
        m = _HEADER.match(line)
        if m and m.group("key") != "From " and not line.startswith("From "):
            last = m.group("key")
            value = m.group("value").strip()
            if last in headers and value:
                headers[last] += "\n" + value
            else:
                headers.setdefault(last, value)
        else:
            last = None
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers.get("Subject", "")).strip()
    if not subject:
        subject = headers.get("Description", "").splitlines()[0] if headers.get("Description") else path.name
    dep3 = {k: v for k, v in headers.items() if k in DEP3_KEYS or k.startswith("X-")}
    if "Subject" in dep3:
        dep3["Subject"] = subject
    files, problems = _touched(text)
    if problems:
        raise PatchError(
            f"patch {path.name} is refused: {problems[0]}",
            "patches may only change regular files inside the vLLM tree; rewrite the patch",
        )
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
    )


def read_series(patches_dir: Path) -> tuple[Patch, ...]:
    """The patch queue listed in `patches_dir/series` (one file name per line, '#' comments), in order."""
    series = patches_dir / SERIES_PATH.name
    if not series.is_file():
        raise ManifestError(f"{series} does not exist", "create it (it may be empty: no patches)")
    patches: list[Patch] = []
    seen: set[str] = set()
    for n, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or name in (".", ".."):
            raise ManifestError(f"{series}:{n}: '{name}' is not a file name in {patches_dir}", "list bare file names")
        if name in seen:
            raise ManifestError(f"{series}:{n}: '{name}' is listed twice", "remove the duplicate line")
        seen.add(name)
        path = patches_dir / name
        if not path.is_file():
            raise ManifestError(f"{series}:{n}: {path} does not exist", "add the patch file or remove the line")
        patches.append(load_patch(path))
    return tuple(patches)


def series_or_empty(patches_dir: Path) -> tuple[Patch, ...]:
    """Like read_series, but a queue without a series file is empty (a build with 0 patches)."""
    if not (patches_dir / SERIES_PATH.name).exists():
        print(f"note: {patches_dir / SERIES_PATH.name} does not exist; the patch queue is empty", flush=True)
        return ()
    return read_series(patches_dir)


# ---------------------------------------------------------------------------------------------------------------
# Checking (never mutates the tree: a throwaway index file, `git apply --cached`)

# Exact application: all context lines must match, whitespace too. (git apply never fuzzes unless -C is given.)
_APPLY = ("apply", "--whitespace=nowarn", "-p1")


def _failures(patch: Patch, output: str) -> tuple[str, ...]:
    hunks = _hunks(patch.path.read_text(errors="replace"))
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


def _is_mbox(patch: Patch) -> bool:
    return patch.path.read_text(errors="replace").startswith("From ")


def apply_series(source: SourceTree, patches: Sequence[Patch], branch: str) -> PatchedTree:
    """Apply the queue on a fork branch `branch` starting at the upstream base, one commit per patch.

    Refuses (PatchError) unsafe paths, conflicts and patches already upstream before changing anything; on any
    failure the tree is put back on its base commit.
    """
    import git

    for patch in patches:  # re-validate: a Patch may have been built by hand
        load_patch(patch.path)
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
            if _is_mbox(patch):
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
                    hint="refresh the patch (no fuzz is accepted)",
                )
            else:
                proc.call(
                    "git",
                    *_APPLY,
                    "--index",
                    patch.path,
                    cwd=tree,
                    error=PatchError,
                    hint="refresh the patch (no fuzz is accepted)",
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


# ---------------------------------------------------------------------------------------------------------------
# CLI: `patches status [--against REF]`


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("patches", help="inspect the patch queue", description=__doc__)
    psub = p.add_subparsers(dest="patches_command", metavar="ACTION", required=True)
    st = psub.add_parser(
        "status",
        help="table per patch: applies / already upstream / conflicts (with failing files and hunks)",
        description="Check every patch in patches/series against the pinned upstream, a release or a git ref. "
        "Never changes any tree. Exit 0 when every patch applies, 6 otherwise.",
    )
    st.add_argument(
        "--against",
        metavar="REF",
        default=None,
        help="a release (e.g. 0.22.0; its hash-pinned sdist) or a git ref when git is reachable, judged like "
        "`vllm-dflash upstream --against REF` (default: the pinned upstream)",
    )
    st.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    manifest = load_manifest(Path(args.root) if args.root else None)
    if args.against is not None and args.against not in (manifest.upstream.version, manifest.upstream.tag):
        # Against another upstream, "already upstream" needs more than a reverse-apply (upstream may have
        # reworded the lines around a fix): the upstream stage weighs git apply, content and Drop-When.
        from vllm_dflash import upstream

        report = upstream.analyse(manifest, upstream.resolve_target(manifest, args.against))
        print(report.text(), end="", flush=True)
        applies = all(v.status is upstream.Status.APPLIES for v in report.verdicts)
        return 0 if applies else PatchError.return_code
    patches = series_or_empty(manifest.patches_dir)
    from vllm_dflash.pipeline.source import prepare_source, trees_lock

    with trees_lock():
        tree = prepare_source(manifest, "auto")
        where = f"pinned upstream {tree.version} ({tree.kind} {tree.commit[:12]})"
        checks = check_series(tree.path, patches, ref=tree.base)
    table = Table(title=f"patch queue against {where}")
    table.add_column("#", justify="right")
    table.add_column("patch")
    table.add_column("state")
    table.add_column("failing files / hunks")
    table.add_column("drop when")
    colour = {PatchState.APPLIES: "green", PatchState.ALREADY_UPSTREAM: "yellow", PatchState.CONFLICTS: "red"}
    for i, c in enumerate(checks, 1):
        table.add_row(
            str(i),
            c.patch.name,
            f"[{colour[c.state]}]{c.state.value}[/]",
            "\n".join(c.failures),
            c.patch.drop_when,
        )
    Console(width=200).print(table)
    if not checks:
        print("the patch queue is empty")
    return 0 if all(c.state is PatchState.APPLIES for c in checks) else PatchError.return_code
