from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_dflash.errors import ManifestError
from vllm_dflash.manifest import Manifest, load_manifest


def test_repo_manifest_pins_plain_wheel_not_rebuild(manifest: Manifest) -> None:
    assert manifest.upstream.version == "0.20.1"
    assert "f98b2747f".startswith(manifest.upstream.commit) or manifest.upstream.commit.startswith("f98b2747f")
    for art in manifest.wheels.values():
        assert art.filename.startswith("vllm-0.20.1-cp38-abi3-"), art.filename  # not the -1 rebuild
    assert manifest.version.startswith("0.20.1+dflash.")


def _copy(repo_root: Path, tmp_path: Path) -> Path:
    for name in ("dist.toml", "VERSION"):
        shutil.copy(repo_root / name, tmp_path / name)
    return tmp_path


def test_version_base_must_match_pin(repo_root: Path, tmp_path: Path) -> None:
    root = _copy(repo_root, tmp_path)
    (root / "VERSION").write_text("0.22.0+dflash.1\n")
    with pytest.raises(ManifestError, match="differs from the pinned upstream version"):
        load_manifest(root)


@pytest.mark.parametrize("bad", ["0.20.1", "0.20.1+cpu.1", "0.20.1+dflashcpu.1", "garbage"])
def test_version_label_form(repo_root: Path, tmp_path: Path, bad: str) -> None:
    root = _copy(repo_root, tmp_path)
    (root / "VERSION").write_text(bad)
    with pytest.raises(ManifestError):
        load_manifest(root)


def test_bad_hash_in_manifest(repo_root: Path, tmp_path: Path) -> None:
    root = _copy(repo_root, tmp_path)
    text = (root / "dist.toml").read_text().replace("778df065", "778dfxxx", 1)
    (root / "dist.toml").write_text(text)
    with pytest.raises(ManifestError, match="64 hex"):
        load_manifest(root)
