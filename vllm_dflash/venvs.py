"""Cached side environments (vLLM CPU builds, the DFlash reference) that the tool creates and reuses.

Each environment is a venv under cache_dir()/envs named by a hash of its spec, so a changed spec builds a new one
and an interrupted build is never mistaken for a finished one (the marker file is written last).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError
from vllm_dflash.fetch import cache_dir

_MARKER = ".vllm-dflash-complete"


@dataclass(frozen=True)
class VenvSpec:
    """A named venv built by running `pip install <step>` for each step in order."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the pip steps
    python: str = sys.executable

    @property
    def key(self) -> str:
        blob = json.dumps([self.name, self.steps, sorted(self.env.items()), self.python]).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_venv(spec: VenvSpec, root: Path | None = None) -> Path:
    """Return the path of a finished venv for `spec`, building it first when needed."""
    base = (root or cache_dir()) / "envs"
    base.mkdir(parents=True, exist_ok=True)
    path = base / f"{spec.name}-{spec.key}"
    with (base / f".{path.name}.lock").open("w") as lock:
        # Two test processes asking for the same env wait for one build instead of racing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / _MARKER).is_file():
            return path
        if path.exists():
            print(f"removing unfinished environment {path}", flush=True)
            shutil.rmtree(path)
        print(f"creating environment {spec.name} in {path}", flush=True)
        proc.call(spec.python, "-m", "venv", path, error=ConformanceError, hint="check that python3-venv works")
        py = venv_python(path)
        for step in spec.steps:
            proc.call(
                py,
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                *step,
                env=dict(spec.env),
                error=ConformanceError,
                hint=f"delete {path} and retry; check network to PyPI",
            )
        (path / _MARKER).write_text(json.dumps({"name": spec.name, "steps": spec.steps}, indent=1))
        return path
