"""Side environments share identical large files with the finished ones beside them (hard links), so a cold cache
holds each pin's torch stack once; anything that differs in bytes, mode or place stays a file of its own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_dflash import envs

BIG = 2 * envs.SHARE_MIN_BYTES


def _write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _ino(path: Path) -> int:
    return os.lstat(path).st_ino


def test_only_identical_large_files_at_the_same_place_are_linked(tmp_path: Path) -> None:
    a, b = tmp_path / "env-a", tmp_path / "env-b"
    same = b"x" * BIG
    _write(a / "lib" / "torch.so", same)
    _write(b / "lib" / "torch.so", same)
    # Same size, one byte different: a size-only (shallow) comparison would link it; the bytes decide.
    _write(a / "lib" / "vllm.so", b"y" * BIG)
    _write(b / "lib" / "vllm.so", b"y" * (BIG - 1) + b"z")
    _write(a / "lib" / "tool", same, 0o755)
    _write(b / "lib" / "tool", same, 0o644)  # other mode: kept apart
    _write(a / "elsewhere.so", same)
    _write(b / "moved" / "elsewhere.so", same)  # another relative path: kept apart
    _write(a / "small.py", b"s" * 100)
    _write(b / "small.py", b"s" * 100)  # below the threshold: left alone
    (b / "link.so").symlink_to("lib/torch.so")

    shared = envs.share_identical(b, [a])

    assert shared == BIG
    assert _ino(b / "lib" / "torch.so") == _ino(a / "lib" / "torch.so")
    assert (b / "lib" / "torch.so").read_bytes() == same
    for rel in ("lib/vllm.so", "lib/tool", "moved/elsewhere.so", "small.py"):
        assert _ino(b / rel) != _ino(a / rel.replace("moved/", "")), rel
    assert (b / "lib" / "vllm.so").read_bytes().endswith(b"z")
    assert (b / "link.so").is_symlink()
    assert not list(b.rglob(".*.share"))
    # Once shared, sharing again changes nothing and counts nothing.
    assert envs.share_identical(b, [a]) == 0


def test_a_build_shares_with_finished_siblings_only(tmp_path: Path) -> None:
    root = tmp_path / "envs"
    root.mkdir()
    payload = b"t" * BIG

    def build(path: Path) -> None:
        _write(path / "site-packages" / "torch" / "lib.so", payload)

    first = envs._build_once(root / "first", build, "first")
    # An unfinished sibling (no completion marker) is never a source: its bytes may still change.
    _write(root / "half" / "site-packages" / "torch" / "lib.so", payload)
    second = envs._build_once(root / "second", build, "second")
    lib = Path("site-packages") / "torch" / "lib.so"
    assert _ino(second / lib) == _ino(first / lib)
    assert _ino(root / "half" / lib) != _ino(first / lib)
    assert os.lstat(first / lib).st_nlink == 2


def test_each_vllm_build_keeps_its_own_vllm_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's model-info cache holds one file per model class, stamped with its module's hash: builds sharing one
    VLLM_CACHE_ROOT overwrite each other's and re-inspect the class at every start. Each build gets its own root, even
    where the caller's environment names one."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "shared"))
    py = Path("/nonexistent/python")
    stock = envs.VllmEnv(python=py, vllm_dir=tmp_path / "vllm-build-aaa", wheel=tmp_path / "a.whl")
    ours = envs.VllmEnv(python=py, vllm_dir=tmp_path / "vllm-build-bbb", wheel=tmp_path / "b.whl")
    roots = {e.environ()["VLLM_CACHE_ROOT"] for e in (stock, ours)}
    assert roots == {str(tmp_path / "vllm-build-aaa" / ".vllm-cache"), str(tmp_path / "vllm-build-bbb" / ".vllm-cache")}
