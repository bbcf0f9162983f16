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


@pytest.mark.parametrize(
    ("old", "new", "hint"),
    [
        ('dist_dir = "dist"', 'dist_dri = "dist"', "did you mean 'dist_dir'?"),
        ("\n[upstream]\n", "\n[upstrem]\n", "did you mean 'upstream'?"),
        ("num_speculative_tokens = 15  # drafter", "num_speculative_token = 15  # drafter", "did you mean"),
        ('required_profiles = ["', 'required_profile = ["', "did you mean 'required_profiles'?"),
    ],
)
def test_unknown_keys_are_refused_with_a_hint(repo_root: Path, tmp_path: Path, old: str, new: str, hint: str) -> None:
    root = _copy(repo_root, tmp_path)
    text = (root / "dist.toml").read_text()
    assert old in text
    (root / "dist.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(ManifestError, match="unknown key") as info:
        load_manifest(root)
    assert hint in info.value.one_line()


def test_every_table_is_typed(manifest: Manifest) -> None:
    """Profiles, releases, publish policy and the reference are parsed once, into dataclasses."""
    assert manifest.reference is not None and manifest.reference.filename.startswith("dflash-")
    assert "0.22.0" in manifest.releases and manifest.releases["0.22.0"].commit == "0b3ba88f1"
    assert set(manifest.publish.required_profiles) <= set(manifest.profiles)
    prof = manifest.profiles["qwen3.6-27b"]
    assert prof.num_speculative_tokens == 15 and prof.thinking is False and prof.serve_args
    assert len(prof.digest) == 64


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ("num_speculative_tokens = 15  # drafter", 'num_speculative_tokens = "15"  # drafter', "must be int"),
        ("thinking = false", "thinking = 0", "must be bool"),
        ('required_profiles = ["qwen3.6-27b"', 'required_profiles = ["qwen3.6-72b"', "no \\[profiles"),
        ('dist_dir = "dist"', 'dist_dir = "../elsewhere"', "not a relative path inside"),
        ("[artifacts.wheel.aarch64]", "[artifacts.wheel.arm64]", "no known platform"),
        ('fork_branch = "dflash/v{version}"', 'fork_branch = "dflash/{ver}"', "placeholder"),
        ('fork_branch = "dflash/v{version}"', 'fork_branch = "a b"', "not a git branch name"),
    ],
)
def test_bad_values_are_refused(repo_root: Path, tmp_path: Path, old: str, new: str, match: str) -> None:
    root = _copy(repo_root, tmp_path)
    text = (root / "dist.toml").read_text()
    assert old in text
    (root / "dist.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(ManifestError, match=match):
        load_manifest(root)
