"""Source stage with real git and the real vLLM 0.20.1 sdist from PyPI."""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

import pytest
from conftest import Checkout, clone_tree, git

from vllm_dflash.errors import DirtyTreeError, NetworkError, PinMismatchError
from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.model import SourceTree
from vllm_dflash.pipeline.source import BASE_TAG, prepare_source, release_tree, sdist_commit


def with_upstream(manifest: Manifest, **changes: str) -> Manifest:
    return dataclasses.replace(manifest, upstream=dataclasses.replace(manifest.upstream, **changes))


def test_sdist_commit_reads_version_py(manifest: Manifest) -> None:
    assert sdist_commit(fetch(manifest.sdist)) == "f98b2747f"


def test_sdist_tree_is_the_pinned_release(sdist_tree: SourceTree, manifest: Manifest) -> None:
    assert sdist_tree.kind == "sdist"
    assert sdist_tree.commit == "f98b2747f"
    assert git(sdist_tree.path, "rev-parse", "HEAD").strip() == sdist_tree.base
    assert git(sdist_tree.path, "rev-parse", f"{BASE_TAG}^{{commit}}").strip() == sdist_tree.base
    assert git(sdist_tree.path, "status", "--porcelain") == ""
    # Every file of the sdist is committed, including those upstream's .gitignore lists (vllm/_version.py).
    with tarfile.open(fetch(manifest.sdist)) as tar:
        in_tar = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    tracked = set(git(sdist_tree.path, "ls-files", "-z").split("\0")) - {""}
    assert in_tar == tracked
    assert "gf98b2747f" in (sdist_tree.path / "vllm/_version.py").read_text()


def test_sdist_base_commit_is_reproducible(sdist_tree: SourceTree, manifest: Manifest, tmp_path: Path) -> None:
    again = release_tree("0.20.1", manifest.sdist, "f98b2747f", tmp_path / "again")
    assert again.base == sdist_tree.base


def test_sdist_pin_mismatch_refused(manifest: Manifest, tmp_path: Path) -> None:
    wrong = with_upstream(manifest, commit="0b3ba88f1")  # 0.22.0's commit
    with pytest.raises(PinMismatchError, match="records commit f98b2747f, but the pin is 0b3ba88f1"):
        prepare_source(wrong, "sdist", tmp_path / "tree")
    assert not (tmp_path / "tree").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no half-unpacked leftovers


def test_existing_tree_is_reused_and_reset_to_base(work_tree: SourceTree, manifest: Manifest) -> None:
    git(work_tree.path, "checkout", "-q", "-b", "elsewhere")
    (work_tree.path / "vllm/v1/spec_decode/dflash.py").write_text("# changed\n")
    git(work_tree.path, "commit", "-qam", "local commit")
    tree = prepare_source(manifest, "sdist", work_tree.path)
    assert tree.base == work_tree.base
    assert git(tree.path, "rev-parse", "HEAD").strip() == work_tree.base


@pytest.mark.parametrize("how", ["modified", "untracked", "staged"])
def test_dirty_tree_refused(work_tree: SourceTree, manifest: Manifest, how: str) -> None:
    target = work_tree.path / "vllm/v1/spec_decode/dflash.py"
    if how == "modified":
        target.write_text(target.read_text() + "# local edit\n")
    elif how == "untracked":
        (work_tree.path / "vllm/new_file.py").write_text("x = 1\n")
    else:
        target.write_text("# staged\n")
        git(work_tree.path, "add", str(target))
    with pytest.raises(DirtyTreeError, match="has local changes"):
        prepare_source(manifest, "sdist", work_tree.path)


@pytest.fixture
def local_upstream(sdist_tree: SourceTree, tmp_path: Path) -> tuple[Path, str]:
    """A real git remote (bare repo) whose tag v0.20.1 is the 0.20.1 source commit."""
    bare = tmp_path / "upstream.git"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    git(sdist_tree.path, "push", "-q", str(bare), f"{sdist_tree.base}:refs/heads/main")
    git(bare, "tag", "v0.20.1", sdist_tree.base)
    return bare, sdist_tree.base


def test_git_source_checks_out_and_verifies_the_pin(
    local_upstream: tuple[Path, str], manifest: Manifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, sha = local_upstream
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(tmp_path / "cache"))
    m = with_upstream(manifest, git_url=str(bare), commit=sha[:12])
    tree = prepare_source(m, "auto", tmp_path / "tree")
    assert (tree.kind, tree.commit, tree.base) == ("git", sha, sha)
    assert git(tree.path, "rev-parse", "HEAD").strip() == sha
    assert (tmp_path / "cache" / "git").is_dir()  # fetched through the cache mirror
    # A second prepare reuses the clean tree.
    assert prepare_source(m, "git", tmp_path / "tree") == tree


def test_git_pin_mismatch_refused(
    local_upstream: tuple[Path, str], manifest: Manifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, sha = local_upstream
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(tmp_path / "cache"))
    m = with_upstream(manifest, git_url=str(bare), commit="0123456789ab")
    with pytest.raises(PinMismatchError, match=rf"tag v0.20.1 at .* is commit {sha[:12]}, but dist.toml pins"):
        prepare_source(m, "git", tmp_path / "tree")
    assert not (tmp_path / "tree").exists()


def test_git_unreachable_fails_fast_or_falls_back_loudly(
    sdist_tree: SourceTree, manifest: Manifest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = with_upstream(manifest, git_url="http://127.0.0.1:9/vllm.git")  # nothing listens on port 9
    with pytest.raises(NetworkError, match=r"git ls-remote http://127\.0\.0\.1:9/vllm\.git failed"):
        prepare_source(m, "git", tmp_path / "git-tree")
    reuse = clone_tree(sdist_tree, tmp_path / "sdist-tree")
    tree = prepare_source(m, "auto", reuse.path)
    assert tree.kind == "sdist" and tree.commit == "f98b2747f"
    assert "FALLING BACK TO THE PyPI SDIST" in capsys.readouterr().out


# --- through the CLI: one line, its own exit code, nothing in dist/ ---------------------------------------------


def assert_one_line_error(result, code: int, text: str, checkout: Checkout) -> None:  # type: ignore[no-untyped-def]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == code, result.stderr[-2000:]
    assert len(errors) == 1 and text in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert checkout.dist_files() == []


def test_cli_source_prints_the_tree(checkout: Checkout) -> None:
    r = checkout.cli("source", "--source", "sdist")
    assert r.returncode == 0, r.stderr
    assert "kind=sdist version=0.20.1 commit=f98b2747f" in r.stdout
    assert "+ " in r.stderr  # external commands are echoed


def test_cli_pin_mismatch(checkout: Checkout) -> None:
    checkout.edit_manifest('commit = "f98b2747f"', 'commit = "0b3ba88f1"')
    r = checkout.cli("build", "--source", "sdist")
    assert_one_line_error(r, 9, "records commit f98b2747f, but the pin is 0b3ba88f1", checkout)


def test_cli_version_pin_mismatch(checkout: Checkout) -> None:
    (checkout.root / "VERSION").write_text("0.22.0+dflash.1\n")
    r = checkout.cli("build", "--source", "sdist")
    assert_one_line_error(r, 3, "differs from the pinned upstream version '0.20.1'", checkout)


def test_cli_dirty_tree(checkout: Checkout, tmp_path: Path) -> None:
    """A user's tree with local changes is refused; the cache's own tree (ours) is reset, loudly, and reused."""
    tree = next(p for p in (checkout.cache / "trees").iterdir() if p.is_dir())
    mine = tmp_path / "my-tree"
    git(tmp_path, "clone", "-q", "--shared", str(tree), str(mine))
    (mine / "setup.py").write_text("# my work\n")
    r = checkout.cli("source", "--source", "sdist", "--dest", str(mine))
    assert_one_line_error(r, 7, "has local changes", checkout)
    assert (mine / "setup.py").read_text() == "# my work\n"  # never touched

    (tree / "setup.py").write_text("# left by a killed run\n")
    r = checkout.cli("build", "--source", "sdist", "--platform", "x86_64")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resetting the cached tree {tree} (ours" in r.stdout
    assert (tree / "setup.py").read_text() != "# left by a killed run\n"
