"""Patch stage: the queue checked and applied with real git on the real 0.20.1 tree, with patches written by git."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Checkout, PatchFactory, git, replace_line

from vllm_dflash.errors import ManifestError, PatchError
from vllm_dflash.pipeline.model import SourceTree
from vllm_dflash.pipeline.patches import (
    PatchState,
    apply_series,
    check_patch,
    check_series,
)
from vllm_dflash.series import load_patch, read_queue


def read_series(d: Path) -> tuple:  # type: ignore[type-arg]
    return read_queue(d / "series", missing_ok=False).patches


DFLASH = "vllm/v1/spec_decode/dflash.py"
VERSION_PY = "vllm/_version.py"


@pytest.fixture(scope="module")
def patches(patch_factory: PatchFactory) -> dict[str, Path]:
    """Small real patches: a one-line Python change, one that builds on it, a conflicting and an upstream one."""
    f = patch_factory
    first_line = "# SPDX-License-Identifier: Apache-2.0\n"
    return {
        "one": f.make(
            "0001-one.patch",
            {DFLASH: replace_line(first_line, first_line + "# dflash test marker 1\n")},
            "Mark dflash.py",
            headers={"Bug": "https://example.invalid/1", "Drop-When": "vLLM >= 0.22.0 (PR #40727)"},
        ),
        "two": f.make(
            "0002-two.patch",
            {DFLASH: replace_line("# dflash test marker 1\n", "# dflash test marker 2\n")},
            "Build on the marker",
            on_top_of={DFLASH: replace_line(first_line, first_line + "# dflash test marker 1\n")},
        ),
        "conflict": f.make(
            "0003-conflict.patch",
            {DFLASH: replace_line("# context nobody has\n", "# conflicting\n")},
            "Needs context the tree does not have",
            on_top_of={DFLASH: replace_line(first_line, first_line + "# context nobody has\n")},
        ),
        "upstream": f.make(
            "0004-upstream.patch",
            {VERSION_PY: replace_line("__version__ = version = '0.20.1'", "__version__ = version = '0.19.0'")},
            "A change upstream already made",
            already_upstream=True,
        ),
        "csrc": f.make(
            "0005-csrc.patch",
            {"csrc/cache.h": lambda t: t + "// dflash test\n", DFLASH: lambda t: t + "# also python\n"},
            "Touch a kernel header",
        ),
        "version": f.make(
            "0006-version.patch",
            {VERSION_PY: replace_line("__version__ = version = '0.20.1'", "__version__ = version = '0.20.1.x'")},
            "Edit the 0.20.1 version line (conflicts on any other release)",
        ),
    }


def series_dir(tmp_path: Path, *paths: Path, extra: str = "") -> Path:
    d = tmp_path / "patches"
    d.mkdir(exist_ok=True)
    for p in paths:
        (d / p.name).write_bytes(p.read_bytes())
    (d / "series").write_text("# queue\n\n" + "".join(f"{p.name}  # comment\n" for p in paths) + extra)
    return d


def test_load_patch_reads_dep3_headers(patches: dict[str, Path]) -> None:
    p = load_patch(patches["one"])
    assert p.subject == "Mark dflash.py"
    assert p.headers["Origin"] == "vllm-dflash tests"
    assert p.headers["Bug"] == "https://example.invalid/1"
    assert p.drop_when == "vLLM >= 0.22.0 (PR #40727)"
    assert p.files == (DFLASH,)
    assert p.python_only
    assert len(p.sha256) == 64
    assert not load_patch(patches["csrc"]).python_only


def test_read_series_order_and_comments(tmp_path: Path, patches: dict[str, Path]) -> None:
    d = series_dir(tmp_path, patches["two"], patches["one"])
    assert [p.name for p in read_series(d)] == ["0002-two.patch", "0001-one.patch"]


def test_read_series_errors(tmp_path: Path, patches: dict[str, Path]) -> None:
    with pytest.raises(ManifestError, match="series does not exist"):
        read_series(tmp_path)
    d = series_dir(tmp_path, patches["one"], extra="0009-missing.patch\n")
    with pytest.raises(ManifestError, match=r"0009-missing\.patch does not exist"):
        read_series(d)


def test_check_states_without_touching_the_tree(sdist_tree: SourceTree, patches: dict[str, Path]) -> None:
    head = git(sdist_tree.path, "rev-parse", "HEAD")
    ok = check_patch(sdist_tree.path, load_patch(patches["one"]))
    up = check_patch(sdist_tree.path, load_patch(patches["upstream"]))
    bad = check_patch(sdist_tree.path, load_patch(patches["conflict"]))
    assert (ok.state, ok.failures) == (PatchState.APPLIES, ())
    assert up.state is PatchState.ALREADY_UPSTREAM
    assert bad.state is PatchState.CONFLICTS
    assert len(bad.failures) == 1
    assert bad.failures[0].startswith(f"{DFLASH}: hunk 1 (@@ -1,")
    # Nothing changed: same HEAD, clean work tree and index.
    assert git(sdist_tree.path, "rev-parse", "HEAD") == head
    assert git(sdist_tree.path, "status", "--porcelain") == ""


def test_check_series_is_sequential(sdist_tree: SourceTree, patches: dict[str, Path]) -> None:
    one, two = load_patch(patches["one"]), load_patch(patches["two"])
    assert check_patch(sdist_tree.path, two).state is PatchState.CONFLICTS  # needs patch one first
    states = [c.state for c in check_series(sdist_tree.path, [one, two])]
    assert states == [PatchState.APPLIES, PatchState.APPLIES]
    assert git(sdist_tree.path, "status", "--porcelain") == ""


def test_apply_series_one_commit_per_patch(work_tree: SourceTree, patches: dict[str, Path]) -> None:
    queue = [load_patch(patches["one"]), load_patch(patches["two"])]
    patched = apply_series(work_tree, queue, "dflash/v0.20.1")
    assert patched.base == work_tree.base
    assert [p.name for p, _ in patched.commits] == ["0001-one.patch", "0002-two.patch"]
    log = git(work_tree.path, "log", "--format=%H %s", f"{work_tree.base}..dflash/v0.20.1").splitlines()
    assert [line.split(" ", 1)[1] for line in reversed(log)] == ["Mark dflash.py", "Build on the marker"]
    assert [line.split(" ")[0] for line in reversed(log)] == [sha for _, sha in patched.commits]
    assert git(work_tree.path, "rev-parse", "HEAD").strip() == patched.head
    assert git(work_tree.path, "symbolic-ref", "--short", "HEAD").strip() == "dflash/v0.20.1"
    assert "# dflash test marker 2\n" in (work_tree.path / DFLASH).read_text()
    body = git(work_tree.path, "log", "-1", "--format=%B", patched.commits[0][1])
    assert "Drop-When: vLLM >= 0.22.0 (PR #40727)" in body
    # Re-applying rebuilds the branch from the base: same commits (fixed dates and identities).
    again = apply_series(work_tree, queue, "dflash/v0.20.1")
    assert again.head == patched.head


def test_apply_refuses_conflict_and_leaves_the_tree_on_base(work_tree: SourceTree, patches: dict[str, Path]) -> None:
    queue = [load_patch(patches["one"]), load_patch(patches["conflict"])]
    with pytest.raises(PatchError, match=r"0003-conflict.patch conflicts .*vllm/v1/spec_decode/dflash.py: hunk 1"):
        apply_series(work_tree, queue, "dflash/v0.20.1")
    assert git(work_tree.path, "rev-parse", "HEAD").strip() == work_tree.base
    assert git(work_tree.path, "status", "--porcelain") == ""
    assert "dflash/v0.20.1" not in git(work_tree.path, "branch", "--list")


def test_apply_refuses_already_applied(work_tree: SourceTree, patches: dict[str, Path]) -> None:
    with pytest.raises(PatchError, match=r"is already applied .*: it is already upstream") as err:
        apply_series(work_tree, [load_patch(patches["upstream"])], "dflash/v0.20.1")
    assert "drop it from patches/series" in err.value.hint
    assert git(work_tree.path, "rev-parse", "HEAD").strip() == work_tree.base


ESCAPES = {
    "dotdot": "diff --git a/../evil.py b/../evil.py\n--- a/../evil.py\n+++ b/../evil.py\n@@ -1 +1 @@\n-a\n+b\n",
    "absolute": "--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n",
    "symlink": (
        "diff --git a/vllm/link.py b/vllm/link.py\nnew file mode 120000\nindex 0000000..1111111\n"
        "--- /dev/null\n+++ b/vllm/link.py\n@@ -0,0 +1 @@\n+../../../etc/passwd\n\\ No newline at end of file\n"
    ),
    "git-dir": "diff --git a/.git/config b/.git/config\n--- a/.git/config\n+++ b/.git/config\n@@ -1 +1 @@\n-a\n+b\n",
}


@pytest.mark.parametrize("kind", sorted(ESCAPES))
def test_unsafe_paths_refused(tmp_path: Path, kind: str, work_tree: SourceTree) -> None:
    p = tmp_path / f"0001-{kind}.patch"
    p.write_text("Subject: [PATCH] escape\n\n---\n" + ESCAPES[kind])
    with pytest.raises(PatchError, match="is refused"):
        load_patch(p)
    with pytest.raises(PatchError, match="is refused"):
        read_series(series_dir(tmp_path, p))
    assert git(work_tree.path, "status", "--porcelain") == ""


# --- `patches status` through the CLI --------------------------------------------------------------------------


def test_cli_status_table(checkout: Checkout, patches: dict[str, Path]) -> None:
    checkout.set_series(patches["one"], patches["conflict"], patches["upstream"])
    r = checkout.cli("patches", "status")
    assert r.returncode == 6, r.stderr
    rows = {line.split("│")[3].strip(): line for line in r.stdout.splitlines() if line.count("│") >= 6}
    assert "applies" in rows["0001-one.patch"]
    assert "conflicts" in rows["0003-conflict.patch"] and f"{DFLASH}: hunk 1" in rows["0003-conflict.patch"]
    assert "already upstream" in rows["0004-upstream.patch"]
    assert "vLLM >= 0.22.0" in rows["0001-one.patch"]

    checkout.set_series(patches["one"], patches["two"])
    r = checkout.cli("patches", "status")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("applies") == 2


def test_cli_status_against_release(checkout: Checkout, patches: dict[str, Path]) -> None:
    checkout.set_series(patches["version"])
    r = checkout.cli("patches", "status")
    assert r.returncode == 0 and "applies" in r.stdout, r.stdout + r.stderr
    r = checkout.cli("patches", "status", "--against", "0.22.0")
    assert r.returncode == 6, r.stdout + r.stderr
    assert "release 0.22.0" in r.stdout and "conflicts" in r.stdout and f"{VERSION_PY}: hunk 1" in r.stdout


def test_cli_status_against_unpinned_release(checkout: Checkout) -> None:
    r = checkout.cli("patches", "status", "--against", "0.99.0")
    assert r.returncode == 14
    assert "release 0.99.0 has no sdist vllm-0.99.0.tar.gz" in r.stderr


def test_cli_build_refuses_escaping_patch(checkout: Checkout, tmp_path: Path) -> None:
    p = tmp_path / "0001-escape.patch"
    p.write_text("Subject: [PATCH] escape\n\n---\n" + ESCAPES["dotdot"])
    checkout.set_series(p)
    r = checkout.cli("build", "--source", "sdist")
    assert r.returncode == 6 and "escapes the tree" in r.stderr, r.stderr
    assert checkout.dist_files() == []


def test_cli_build_refuses_conflict_and_already_applied(checkout: Checkout, patches: dict[str, Path]) -> None:
    checkout.set_series(patches["conflict"])
    r = checkout.cli("build", "--source", "sdist")
    assert r.returncode == 6 and f"conflicts with upstream 0.20.1 (sdist f98b2747f): {DFLASH}: hunk 1" in r.stderr
    assert checkout.dist_files() == []
    checkout.set_series(patches["upstream"])
    r = checkout.cli("build", "--source", "sdist")
    assert r.returncode == 6 and "is already applied" in r.stderr and "drop it from patches/series" in r.stderr
    assert checkout.dist_files() == []
