"""Side environments share identical large files with the finished ones beside them (hard links), so a cold cache
holds each pin's torch stack once; anything that differs in bytes, mode or place stays a file of its own."""

from __future__ import annotations

import json
import os
import time
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


def test_a_venv_cloned_from_its_seed_links_the_files_and_owns_its_paths(tmp_path: Path) -> None:
    """The seed's files as hard links; what a venv writes its own path into (pyvenv.cfg, bin/) rewritten in new files;
    the seed's completion marker left out (a clone killed half-way must not look finished); the seed unchanged."""
    seed = tmp_path / "cpu-torch-aaaaaaaaaaaa"
    (seed / "bin").mkdir(parents=True)
    (seed / "lib" / "site-packages" / "torch").mkdir(parents=True)
    (seed / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {seed}\n")
    script = seed / "bin" / "torchrun"
    script.write_text(f"#!{seed}/bin/python\nimport torch\n")
    script.chmod(0o755)
    (seed / "bin" / "python").symlink_to("/usr/bin/python3")
    lib = seed / "lib" / "site-packages" / "torch" / "lib.so"
    lib.write_bytes(b"\0" * 4096)
    (seed / envs._MARKER).write_text("{}")
    dest = tmp_path / "vllm-cpu-base-bbbbbbbbbbbb"
    envs._clone_venv(seed, dest)
    assert not (dest / envs._MARKER).exists() and (seed / envs._MARKER).exists()
    assert (dest / "lib" / "site-packages" / "torch" / "lib.so").stat().st_ino == lib.stat().st_ino
    assert (dest / "bin" / "torchrun").read_text() == f"#!{dest}/bin/python\nimport torch\n"
    assert (dest / "bin" / "torchrun").stat().st_ino != script.stat().st_ino and os.access(
        dest / "bin" / "torchrun", os.X_OK
    )
    assert str(dest) in (dest / "pyvenv.cfg").read_text() and str(seed) in (seed / "pyvenv.cfg").read_text()
    assert script.read_text().startswith(f"#!{seed}/bin/python")
    assert os.readlink(dest / "bin" / "python") == "/usr/bin/python3"


def test_a_seed_must_be_the_first_steps_of_what_it_seeds() -> None:
    good = envs.cpu_torch_spec()
    bad = envs.VenvSpec(name="x", steps=(("numpy",),))
    spec = envs.VenvSpec(name="vllm-cpu-base", steps=(good.steps[0], ("vllm",)), seed=bad)
    with pytest.raises(ValueError, match="is no seed of vllm-cpu-base"):
        envs.ensure_venv(spec)


def _store(graph: Path, images: list[dict[str, object]], layers: list[dict[str, object]]) -> None:
    for name, records in (("overlay-images/images.json", images), ("overlay-layers/layers.json", layers)):
        (graph / name).parent.mkdir(parents=True, exist_ok=True)
        (graph / name).write_text(json.dumps(records))


def test_the_twin_shares_each_environment_layer_once_an_image_holds_it(tmp_path: Path) -> None:
    """The CPU twin's build links the environment's layers to the cache's environment while it runs: only layers that
    a committed image holds (the image's top layer and its parents), and only those carrying opt/venv/lib."""
    from cpu_twin import _committed_env_layers, _share_as_committed

    if os.geteuid() != 0:
        pytest.skip("the twin links in a mount namespace of its own, which needs root (as the twin itself does)")
    graph, env = tmp_path / "store", tmp_path / "env"
    same = b"t" * BIG
    _write(env / "lib" / "torch.so", same)
    for layer in ("base", "part1", "part2", "running"):
        _write(graph / "overlay" / layer / "diff" / "opt" / "venv" / "lib" / "torch.so", same)
    chain: list[dict[str, object]] = [
        {"id": "base"},
        {"id": "part1", "parent": "base"},
        {"id": "part2", "parent": "part1"},
    ]
    assert _committed_env_layers(graph) == []  # nothing written yet: nothing to share
    _store(graph, [{"id": "img1", "layer": "part1"}], [*chain, {"id": "running", "parent": "part2"}])
    venvs = {p.parts[-4] for p in _committed_env_layers(graph)}
    assert venvs == {"base", "part1"}  # part2 and the running step's layer: no image holds them yet

    _store(graph, [{"id": "img1", "layer": "part1"}, {"id": "img2", "layer": "part2"}], chain)
    with _share_as_committed(graph, env, every_s=0.01, top=tmp_path) as shared:
        deadline = time.monotonic() + 10
        while shared[0] < 3 * BIG and time.monotonic() < deadline:
            time.sleep(0.01)
    torch = env / "lib" / "torch.so"
    for layer in ("base", "part1", "part2"):
        assert _ino(graph / "overlay" / layer / "diff" / "opt" / "venv" / "lib" / "torch.so") == _ino(torch)
    assert _ino(graph / "overlay" / "running" / "diff" / "opt" / "venv" / "lib" / "torch.so") != _ino(torch)
    assert shared == [3 * BIG]
