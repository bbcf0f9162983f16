"""Source stage: a git work tree whose HEAD is the pinned upstream vLLM commit, from git or from the PyPI sdist.

`--source git` fetches the release tag into a bare cache mirror and checks out the pin; `--source sdist` unpacks the
hash-pinned sdist (whose `vllm/_version.py` must name the pinned commit) and commits it as one upstream-base commit.
`auto` tries git first and falls back to the sdist, loudly, when the remote cannot be reached.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import DirtyTreeError, ManifestError, NetworkError, PinMismatchError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import Artifact, Manifest
from vllm_dflash.paths import built_dir, ensure_dir, sweep_stale, temp_sibling
from vllm_dflash.pipeline.model import COMMIT_ID, SOURCE_KINDS, SourceTree, commits_match

# Tag that marks the upstream-base commit inside every work tree we prepare (the fork branch starts there).
BASE_TAG = "dflash-base"
# Fixed identity and date for the commits we create: the same sdist always gives the same base SHA.
BOT_IDENTITY = {
    "GIT_AUTHOR_NAME": "vllm-dflash",
    "GIT_AUTHOR_EMAIL": "vllm-dflash@localhost",
    "GIT_COMMITTER_NAME": "vllm-dflash",
    "GIT_COMMITTER_EMAIL": "vllm-dflash@localhost",
}
FIXED_DATE = "2000-01-01T00:00:00+0000"
# Give up on an unreachable remote quickly (DNS failures are instant; a black-holed host is not).
GIT_REMOTE_TIMEOUT_S = 20
_GIT_NET_ENV = {"GIT_TERMINAL_PROMPT": "0", "GIT_HTTP_LOW_SPEED_LIMIT": "1000", "GIT_HTTP_LOW_SPEED_TIME": "15"}
# Git's own markers of an operation that was under way when a process died.
_IN_PROGRESS = ("rebase-apply", "rebase-merge", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD")


def _git_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**BOT_IDENTITY, "GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE, **_GIT_NET_ENV}
    return {**env, **(extra or {})}


def _version_py_commit(text: str, where: str) -> str:
    m = COMMIT_ID.search(text)
    if not m:
        raise PinMismatchError(
            f"{where} records no commit id (__commit_id__)", "this is not an upstream release sdist; check dist.toml"
        )
    return m.group(1)


def sdist_commit(sdist: Path) -> str:
    """The abbreviated commit recorded in `vllm/_version.py` inside an sdist tarball (without the leading 'g')."""
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for member in tar:
                parts = member.name.split("/")
                if len(parts) == 3 and parts[1:] == ["vllm", "_version.py"] and member.isfile():
                    fh = tar.extractfile(member)
                    assert fh is not None
                    return _version_py_commit(fh.read().decode(), f"{sdist.name}:{member.name}")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PinMismatchError(f"{sdist} is not a readable sdist: {exc}", "delete it and download it again") from None
    raise PinMismatchError(f"{sdist.name} has no vllm/_version.py", "this is not a vLLM sdist; check dist.toml")


def _repo(path: Path) -> Any:
    import git

    return git.Repo(path)


def check_clean(path: Path) -> None:
    """Refuse a work tree with staged, unstaged or untracked changes (ignored files such as __pycache__ are fine)."""
    repo = _repo(path)
    status = repo.git.status("--porcelain", "--untracked-files=normal")
    if status.strip():
        first = status.strip().splitlines()
        raise DirtyTreeError(
            f"work tree {path} has local changes ({len(first)} paths, e.g. '{first[0].strip()}')",
            f"commit or discard them, or delete {path} to start afresh; vllm-dflash never reuses a dirty tree",
        )


def interrupted_state(path: Path) -> list[str]:
    """What a killed git process left in `path`: an operation in progress, or a lock file."""
    git_dir = path / ".git"
    found = [name for name in _IN_PROGRESS if (git_dir / name).exists()]
    found += [str(p.relative_to(git_dir)) for p in git_dir.glob("*.lock")]
    return found


def _reset_owned(path: Path) -> None:
    """Put a cached tree of ours back to a clean state after an interrupted run, saying what was found.

    Only for trees under our cache (ours by construction, never a user's work): whatever a killed `git am`, apply or
    checkout left there is discarded. The caller holds `trees_lock`, so no live process of ours is using the tree.
    """
    state = interrupted_state(path)
    dirty = proc.call("git", "status", "--porcelain", cwd=path, capture=True, check=False, quiet=True)
    if not state and not (dirty.stdout or "").strip() and dirty.returncode == 0:
        return
    what = ", ".join(state) if state else "uncommitted changes"
    print(f"resetting the cached tree {path} (ours; an earlier run was interrupted: {what})", flush=True)
    git_dir = path / ".git"
    for lock in git_dir.glob("*.lock"):
        lock.unlink(missing_ok=True)
    if (git_dir / "rebase-apply").exists():
        proc.call("git", "am", "--abort", cwd=path, capture=True, check=False)
        shutil.rmtree(git_dir / "rebase-apply", ignore_errors=True)
    for name in ("rebase-merge",):
        shutil.rmtree(git_dir / name, ignore_errors=True)
    for name in ("MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD"):
        (git_dir / name).unlink(missing_ok=True)
    proc.call("git", "reset", "-q", "--hard", cwd=path, error=DirtyTreeError, hint=f"delete {path} and run again")
    proc.call("git", "clean", "-qfd", cwd=path, error=DirtyTreeError, hint=f"delete {path} and run again")


def _checkout_base(path: Path, kind: str, version: str, commit: str, owned: bool) -> SourceTree:
    """Verify an existing prepared tree, make sure it is clean and put HEAD back on its base commit.

    A tree of ours (`owned`) that an interrupted run left mid-operation or dirty is reset, loudly; anybody else's
    tree is refused with git's own account of its state.
    """
    import git

    if owned:
        for lock in (path / ".git").glob("*.lock"):  # a lock left by a killed git blocks even rev-parse's peers
            lock.unlink(missing_ok=True)
    try:
        repo = git.Repo(path)
        base = repo.git.rev_parse(f"{BASE_TAG}^{{commit}}")
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandError):
        # Not a tree we made: never suggest deleting it (it may be `/`, a home directory, somebody's work).
        raise DirtyTreeError(
            f"{path} exists but is not a tree prepared by vllm-dflash (no '{BASE_TAG}' tag); it is left alone",
            "choose a --dest that does not exist yet (vllm-dflash creates it) or one it prepared earlier",
        ) from None
    if owned:
        _reset_owned(path)
    else:
        state = interrupted_state(path)
        if state:
            raise DirtyTreeError(
                f"work tree {path} has a git operation in progress ({', '.join(state)})",
                f"finish or abort it there (e.g. `git -C {path} am --abort`), or delete {path}",
            )
        check_clean(path)
    proc.echo(["git", "checkout", "--detach", base], path)
    repo.git.checkout("--detach", base)
    return SourceTree(path=path, kind=kind, version=version, commit=commit, base=base)


def _safe_extract(sdist: Path, dest: Path) -> None:
    """Unpack the sdist's single top-level directory into `dest` (tarfile's 'data' filter refuses escapes)."""
    with tarfile.open(sdist, "r:*") as tar:
        members = tar.getmembers()
        tops = {m.name.split("/", 1)[0] for m in members}
        if len(tops) != 1:
            raise PinMismatchError(f"{sdist.name} has {len(tops)} top-level entries, expected one", "check dist.toml")
        top = tops.pop()
        stage = temp_sibling(dest, ".unpack")
        shutil.rmtree(stage, ignore_errors=True)
        try:
            tar.extractall(stage, filter="data")
            (stage / top).rename(dest)
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def release_tree(version: str, sdist: Artifact, commit: str | None, dest: Path, owned: bool = True) -> SourceTree:
    """Any release's hash-pinned sdist → verified `_version.py` commit → unpacked → `git init` + one commit.

    An existing clean tree at `dest` prepared from the same release is reused (HEAD reset to its base commit); an
    `owned` tree (ours, in the cache) that an interrupted run left dirty is reset first.
    """
    path = fetch(sdist)
    recorded = sdist_commit(path)
    if commit is not None and not commits_match(recorded, commit):
        raise PinMismatchError(
            f"{sdist.filename} records commit {recorded}, but the pin is {commit}",
            "the sdist is another build of the release; fix the pin or the sdist entry in dist.toml",
        )
    ensure_dir(dest.parent)
    if owned:
        sweep_stale(dest.parent)  # half-unpacked trees of killed runs in the cache; a user's --dest parent: never
    if dest.exists():
        tree = _checkout_base(dest, "sdist", version, recorded, owned)
        import git

        msg = str(git.Repo(dest).commit(tree.base).message)
        if f"commit g{recorded}" not in msg:
            raise PinMismatchError(
                f"{dest} holds another upstream base ({msg.splitlines()[0]!r})",
                f"delete {dest} and run again",
            )
        return tree

    import git
    from rich.console import Console

    with built_dir(dest) as work:
        status = Console(stderr=True).status(f"unpacking {path.name} and committing it as the upstream base")
        status.start()
        try:
            _commit_release(path, work, version, sdist, recorded)
        finally:
            status.stop()
        base = git.Repo(work).head.commit.hexsha
    print(f"source tree {dest}: vLLM {version} from sdist, commit g{recorded}, base {base[:12]}", flush=True)
    return SourceTree(path=dest, kind="sdist", version=version, commit=recorded, base=base)


def _commit_release(path: Path, work: Path, version: str, sdist: Artifact, recorded: str) -> None:
    """Unpack the sdist at `work` and commit it (fixed identity and date: the same sdist gives the same SHA)."""
    import git

    print(f"unpacking {path.name} (commit g{recorded})", flush=True)
    _safe_extract(path, work)
    proc.echo(["git", "init", "-q", work])
    repo = git.Repo.init(work)
    with repo.config_writer() as cw:
        cw.set_value("core", "autocrlf", "false")
        cw.set_value("commit", "gpgsign", "false")  # our commits are local bookkeeping; never prompt for a key
    # The sdist ships upstream's .gitattributes; keep bytes exactly as unpacked (no eol or filter rewriting).
    (work / ".git" / "info").mkdir(parents=True, exist_ok=True)
    (work / ".git" / "info" / "attributes").write_text("* -text -filter -ident -export-subst\n")
    # -f: the sdist contains files upstream's .gitignore lists (vllm/_version.py among them); commit them all.
    proc.echo(["git", "add", "-A", "-f", "."], work)
    repo.git.add("-A", "-f", ".")
    message = f"vLLM {version} (sdist {sdist.filename}, commit g{recorded})\n\nsha256: {sdist.sha256}\n"
    proc.echo(["git", "commit", "-q", "-m", message.splitlines()[0]], work)
    with repo.git.custom_environment(**_git_env()):
        repo.git.commit("-q", "--no-verify", "-m", message)
        repo.git.tag("-f", BASE_TAG)
    repo.close()


def _git_remote(repo: Any, *args: str) -> str:
    """Run a network git command with a hard time limit; unreachable or slow remotes raise NetworkError."""
    import git

    proc.echo(["git", *args], Path(repo.working_dir) if repo.working_dir else None)
    shown = next((a for a in args[1:] if not a.startswith("-")), "")
    try:
        with repo.git.custom_environment(**_GIT_NET_ENV):
            out: str = repo.git.execute(["git", *args], kill_after_timeout=GIT_REMOTE_TIMEOUT_S)
            return out
    except git.GitCommandError as exc:
        text = re.sub(r"^\s*stderr: '|'\s*$", "", str(exc.stderr or "")).strip() or f"exit status {exc.status}"
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        raise NetworkError(
            f"git {args[0]} {shown} failed: {lines[-1] if lines else text}",
            "check the network and upstream.git_url, or use --source sdist",
        ) from None


def _mirror(manifest: Manifest) -> Any:
    """A bare cache mirror holding the pinned tag (fetched shallowly: one commit is all we need)."""
    import git

    up = manifest.upstream
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", up.git_url.rstrip("/").split("://")[-1])
    path = cache_dir() / "git" / key
    if not (path / "HEAD").exists():
        path.mkdir(parents=True, exist_ok=True)
        proc.echo(["git", "init", "--bare", "-q", path])
        git.Repo.init(path, bare=True)
    for lock in path.glob("*.lock"):  # left by a killed fetch; callers hold trees_lock, so nobody else is using it
        lock.unlink(missing_ok=True)
    repo = git.Repo(path)
    _git_remote(repo, "ls-remote", "--exit-code", up.git_url, f"refs/tags/{up.tag}")
    _git_remote(repo, "fetch", "--depth=1", "--no-tags", up.git_url, f"+refs/tags/{up.tag}:refs/tags/{up.tag}")
    return repo


def git_tree(manifest: Manifest, dest: Path, owned: bool = True) -> SourceTree:
    """Fetch the pinned tag into the cache mirror, verify it is the pinned commit, check it out at `dest`."""
    import git

    up = manifest.upstream
    mirror = _mirror(manifest)
    sha: str = mirror.git.rev_parse(f"refs/tags/{up.tag}^{{commit}}")
    if not commits_match(sha, up.commit):
        raise PinMismatchError(
            f"tag {up.tag} at {up.git_url} is commit {sha[:12]}, but dist.toml pins {up.commit}",
            "the tag moved or the pin is wrong; check upstream.commit in dist.toml",
        )
    ensure_dir(dest.parent)
    if owned:
        sweep_stale(dest.parent)  # the cache's own trees directory only
    if dest.exists():
        tree = _checkout_base(dest, "git", up.version, sha, owned)
        if tree.base != sha:
            raise PinMismatchError(f"{dest} is based on {tree.base[:12]}, not {sha[:12]}", f"delete {dest}")
        return tree
    with built_dir(dest) as work:
        proc.echo(["git", "clone", "--no-checkout", mirror.git_dir, work])
        repo = git.Repo.clone_from(mirror.git_dir, work, no_checkout=True)
        proc.echo(["git", "checkout", "--detach", sha], work)
        repo.git.checkout("--detach", sha)
        repo.git.tag("-f", BASE_TAG, sha)
        with repo.config_writer() as cw:
            cw.set_value("commit", "gpgsign", "false")
        if not commits_match(repo.head.commit.hexsha, up.commit):  # belt and braces: what is checked out
            raise PinMismatchError(f"checked out {repo.head.commit.hexsha}, not the pin {up.commit}", "report this")
        repo.close()
    print(f"source tree {dest}: vLLM {up.version} from git, commit {sha}", flush=True)
    return SourceTree(path=dest, kind="git", version=up.version, commit=sha, base=sha)


@contextlib.contextmanager
def trees_lock() -> Iterator[None]:
    """Serialise the stages that move a cached work tree (prepare, apply, read for the wheel) between processes."""
    path = cache_dir() / "trees" / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another vllm-dflash process using {path.parent} ...", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def default_dest(manifest: Manifest, kind: str) -> Path:
    return cache_dir() / "trees" / f"vllm-{manifest.upstream.version}-{manifest.upstream.commit[:9]}-{kind}"


def prepare_source(
    manifest: Manifest, kind: str = "auto", dest: Path | None = None, owned: bool | None = None
) -> SourceTree:
    """The source stage: a clean work tree at the pinned commit, HEAD on the upstream base.

    `owned`: the tree at `dest` is ours to reset after an interrupted run (default: only the cache's own trees).
    """
    if kind not in SOURCE_KINDS:
        raise ManifestError(f"unknown source kind '{kind}'", f"use one of {', '.join(SOURCE_KINDS)}")
    ours = dest is None if owned is None else owned
    if kind in ("git", "auto"):
        try:
            return git_tree(manifest, dest or default_dest(manifest, "git"), ours)
        except NetworkError as exc:
            if kind == "git":
                raise
            print(
                f"WARNING: git source unavailable ({exc.message}); FALLING BACK TO THE PyPI SDIST "
                f"{manifest.sdist.filename} (commit recorded in the sdist; full SHA unknown)",
                flush=True,
            )
    up = manifest.upstream
    return release_tree(up.version, manifest.sdist, up.commit, dest or default_dest(manifest, "sdist"), ours)


def tree_at(manifest: Manifest, path: Path) -> SourceTree:
    """Describe a tree that `prepare_source` made earlier at `path` (kind and commit read from its base commit)."""
    import git

    try:
        repo = git.Repo(path)
        base = repo.git.rev_parse(f"{BASE_TAG}^{{commit}}")
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandError):
        raise ManifestError(
            f"{path} is not a source tree prepared by vllm-dflash", "run `vllm-dflash source`"
        ) from None
    m = re.search(r"\(sdist .*, commit g([0-9a-f]+)\)", str(repo.commit(base).message))
    if m:
        return SourceTree(path=path, kind="sdist", version=manifest.upstream.version, commit=m.group(1), base=base)
    return SourceTree(path=path, kind="git", version=manifest.upstream.version, commit=base, base=base)


def find_prepared(manifest: Manifest) -> SourceTree | None:
    """The tree a previous `vllm-dflash source` prepared at the default location (git preferred), if any."""
    for kind in ("git", "sdist"):
        path = default_dest(manifest, kind)
        if (path / ".git").exists():
            return tree_at(manifest, path)
    return None


def reopen(manifest: Manifest, path: Path, owned: bool) -> SourceTree:
    """A tree `prepare_source` made earlier, checked (reset when it is ours and an earlier run was interrupted) and
    back on its base commit."""
    tree = tree_at(manifest, path)
    return _checkout_base(path, tree.kind, tree.version, tree.commit, owned)
