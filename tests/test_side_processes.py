"""How our side processes run vLLM (quick tier: a stand-in for vLLM's registry module, no vLLM imported)."""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Iterator

import pytest

from vllm_dflash.conformance.vllm_side import inspect_models_here

_NAMES = ("vllm", "vllm.model_executor", "vllm.model_executor.models", "vllm.model_executor.models.registry")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """vLLM's registry module as far as inspect_models_here sees it: a `_run_in_subprocess` that must not be called."""
    modules = {name: types.ModuleType(name) for name in _NAMES}
    for parent, child in itertools.pairwise(_NAMES):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])

    def subprocess_run(fn: object) -> object:
        raise AssertionError("vLLM's inspection subprocess started")

    modules[_NAMES[-1]]._run_in_subprocess = subprocess_run  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield modules[_NAMES[-1]]


def test_model_classes_are_inspected_in_this_process(registry: types.ModuleType) -> None:
    """A CPU side process runs vLLM's inspection itself: the function vLLM hands its subprocess is called here."""
    inspect_models_here()
    assert registry._run_in_subprocess(lambda: "inspected here") == "inspected here"


def test_a_vllm_without_the_subprocess_helper_is_left_as_it_is(registry: types.ModuleType) -> None:
    del registry._run_in_subprocess
    inspect_models_here()
    assert not hasattr(registry, "_run_in_subprocess")
