"""Names from outside the code stay inside the directory they belong in (issue 10: the `../` manifest case)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_checkout

from vllm_dflash.errors import ManifestError
from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import Artifact
from vllm_dflash.paths import bare_name, confine


@pytest.mark.parametrize(
    "name",
    ["../victim", "a/../../victim", "/etc/passwd", "..", ".", "sub/file.whl", "x\\..\\y", "", "a\nb", "~root"],
)
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ManifestError):
        bare_name(name, "artifact file name")


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    base = tmp_path / "downloads"
    base.mkdir()
    (base / "vllm-0.20.1.tar.gz").symlink_to(tmp_path / "elsewhere.tar.gz")
    with pytest.raises(ManifestError, match="outside"):
        confine(base, "vllm-0.20.1.tar.gz", "artifact file name")


def test_fetch_never_deletes_outside_the_cache(tmp_path: Path) -> None:
    """A cached "copy" that fails its hash is deleted: a `../` name must never reach that unlink."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    art = Artifact("placeholder", "0" * 64)  # built directly: the manifest parser would refuse this name itself
    object.__setattr__(art, "filename", "../../victim.txt")
    object.__setattr__(art, "sha256", "0" * 64)
    with pytest.raises(ManifestError):
        fetch(art, downloads)
    assert victim.read_text() == "precious"


def test_manifest_with_dotdot_filename_is_refused_by_the_cli(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    co = make_checkout(tmp_path, tmp_path / "cache")
    co.edit_manifest('filename = "vllm-0.20.1.tar.gz"', f'filename = "../../{victim.name}"')
    res = co.cli("build", "--source", "sdist")
    assert res.returncode == ManifestError.return_code, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: artifacts.sdist.filename") and "plain file name" in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    assert victim.read_text() == "precious"
    assert co.dist_files() == []
