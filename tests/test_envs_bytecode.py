"""Side environments install without pip's byte-compiling and compile what a process imports, once, even where
PYTHONDONTWRITEBYTECODE is set (envs.BYTECODE_PTH)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import write_wheel

from vllm_dflash import envs


def test_an_environment_compiles_only_what_is_imported_and_keeps_it(tmp_path: Path) -> None:
    wheel = write_wheel(tmp_path / "wheels", "probe", "1.0", {"probe_used.py": b"X = 1\n", "probe_idle.py": b"Y = 2\n"})
    spec = envs.VenvSpec(name="probe", steps=(("--no-index", "--no-deps", str(wheel)),))
    venv = envs.ensure_venv(spec, root=tmp_path / "cache")
    (site,) = venv.glob("lib/python*/site-packages")
    assert not list(site.glob("__pycache__/probe_*.pyc")), "pip compiled at install"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([str(envs.venv_python(venv)), "-c", "import probe_used"], check=True, env=env)
    cached = sorted(p.name.split(".")[0] for p in site.glob("__pycache__/probe_*.pyc"))
    assert cached == ["probe_used"], cached  # the imported module once, the idle one never
