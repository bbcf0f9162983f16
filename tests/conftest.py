"""Shared fixtures. Downloads are real (PyPI) and cached in $VLLM_DFLASH_CACHE (default ~/.cache/vllm-dflash)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_dflash.manifest import Manifest, load_manifest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def manifest() -> Manifest:
    return load_manifest(REPO)
