"""Ablation (vllm_dflash/upstream/ablation.py): a carried patch is needed when the pin's queue without it fails a case
that exercises what it fixes. The verdict rule, the key (every input moves it), the cache (a warm run builds and
runs nothing) and the choice of cases are quick; which later patches a removal takes along is read from a real
source tree (heavy)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import copy_manifest_and_patches

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import ConformanceResult, Outcome
from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.series import Queue, Queues, read_queues
from vllm_dflash.upstream import ablation as A
from vllm_dflash.upstream.proof import NEEDED, UNPROVEN

REPO = Path(__file__).resolve().parents[1]


def _queues(m: Manifest, pin: str) -> Queues:
    view = m.for_pin(pin)
    return read_queues(view.series_path, view.cpu_series_path)


def _patch(m: Manifest, pin: str, prefix: str) -> Any:
    return next(p for p in _queues(m, pin).dflash if p.name.startswith(prefix))


def _o(case: str, status: str, ok: bool) -> Outcome:
    return Outcome(case, "patched", status, "pass", ok)


def test_the_verdict_is_the_run_of_the_queue_without_the_patch() -> None:
    fixes = frozenset({C.FEATURE_WINDOW})
    assert A.decide(fixes, [_o("window-only", "fail", False), _o("mixed", "pass", True)]) == (
        NEEDED,
        "without it: window-only fail",
    )
    assert A.decide(fixes, [_o("mixed", "refused", False)]) == (NEEDED, "without it: mixed refused")
    assert A.decide(fixes, [_o("window-only", "pass", True)]) == (A.NOT_NEEDED, "without it: window-only pass")
    # Nothing that ran, or a case this machine cannot run: never "not needed".
    assert A.decide(fixes, [])[0] == UNPROVEN
    assert A.decide(fixes, [_o("window-only", "pass", True), _o("bf16", "unproven", False)])[0] == UNPROVEN


def test_the_cases_are_the_cheapest_that_exercise_each_fix() -> None:
    by = {f: [s.name for s in C.fix_cases(frozenset({f}))] for f in C.QUEUE_FIXES}
    assert by == {
        C.FEATURE_TAPS: ["full"],
        C.FEATURE_WINDOW: ["window-only"],
        C.FEATURE_CAUSAL_WINDOW: ["window-only"],
        C.FEATURE_MIXED: ["mixed"],
        C.FIX_KV_WINDOW: ["evict-long"],
        C.FIX_PREFIX_BLOCK: ["prefix-full"],
    }
    # Each exercises its fix, as the judge reads it: an eviction case on one rank, a prefix case judged per request.
    for fix, (name,) in by.items():
        assert fix in C.exercises(C.get_cases([name])[0])
    assert C.FIX_KV_WINDOW not in C.exercises(C.get_cases(["evict-tp2"])[0])  # no full-kv control at TP 2
    assert C.FIX_PREFIX_BLOCK not in C.exercises(C.get_cases(["evict-prefix"])[0])  # its hits are the window's
    matrix = ["full", "mixed", "window-only", "use-swa", "prefix-full", "evict-long"]
    assert [s.name for s in C.matrix_cases()] == matrix


def test_every_input_moves_the_key(tmp_path: Path) -> None:
    m = load_manifest(REPO)
    view = m.for_pin("0.23.0")
    q = _queues(m, "0.23.0")
    specs = C.fix_cases(frozenset({C.FIX_KV_WINDOW}))
    fixed = frozenset({C.FIX_KV_WINDOW})
    key = A.ablation_key(view, q, fixed, specs)
    assert key == A.ablation_key(view, q, fixed, specs)  # the same inputs, the same key
    shorter = replace(q, dflash=Queue(q.dflash.name, q.dflash.series, q.dflash.patches[:-1]))
    assert A.ablation_key(view, shorter, fixed, specs) != key  # another queue
    assert A.ablation_key(view, q, fixed | {C.FIX_PREFIX_BLOCK}, specs) != key  # judged against other promises
    assert A.ablation_key(view, q, fixed, (replace(specs[0], max_tokens=47),)) != key  # another case
    assert A.ablation_key(m.for_pin("0.25.1"), q, fixed, specs) != key  # another pin
    # A patch's bytes: the same queue read from a copy whose patch gained a line.
    root = copy_manifest_and_patches(tmp_path / "repo")
    p = root / "patches" / "0.23.0" / "0004-dflash-drafter-kv-cache-by-window.patch"
    p.write_text(p.read_text().replace("Python-Only: yes", "Python-Only: yes\nX-Note: changed", 1))
    copy = load_manifest(root)
    assert A.ablation_key(copy.for_pin("0.23.0"), _queues(copy, "0.23.0"), fixed, specs) != key


def test_a_warm_ablation_runs_nothing_and_a_cold_one_leaves_only_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(tmp_path / "cache"))
    m = load_manifest(REPO)
    view, q = m.for_pin("0.25.1"), _queues(m, "0.25.1")
    kv = _patch(m, "0.25.1", "0004")
    calls: list[str] = []

    def without(view: Manifest, queues: Queues, patch: Any) -> tuple[Queues, tuple[str, ...]]:
        rest = tuple(p for p in queues.dflash if p.name != patch.name and not p.name.startswith("0005"))
        return replace(queues, dflash=Queue("dflash", queues.dflash.series, rest)), ("0005-x.patch",)

    def build(view: Manifest, queues: Queues, base: str, variant: str, out: Path) -> Path:
        calls.append("build")
        assert [p.name for p in queues.dflash if p.name.startswith(("0004", "0005"))] == []
        out.mkdir(parents=True)
        (out / "w.whl").write_bytes(b"x")
        return out / "w.whl"

    def run(view: Manifest, queues: Queues, options: Any) -> ConformanceResult:
        calls.append("run")
        # Judged against the whole queue, the ablated wheel as the patched build, its runtime beside it.
        assert options.builds == ("patched",) and options.cases == ("evict-long",)
        assert options.patched_wheel.name == "w.whl" and options.runtime_root == options.patched_wheel.parent.parent
        assert any(p.name.startswith("0004") for p in queues.dflash)
        (options.runtime_root / "envs").mkdir()
        out = (_o("evict-long", "fail", False),)
        return ConformanceResult(False, "cpu", out, options.report, 1.0)

    monkeypatch.setattr(A, "without", without)
    monkeypatch.setattr(A, "scratch_build", build)
    monkeypatch.setattr(A, "run_conformance", run)
    cold = A.ablate(view, q, kv)
    assert (cold.verdict, cold.why, cold.left_out, cold.cached) == (
        NEEDED,
        "without it: evict-long fail",
        ("0005-x.patch",),
        False,
    )
    assert calls == ["build", "run"]
    left = sorted(p.name for p in A.ablation_dir().iterdir())
    assert left == [f".{cold.key}.lock", f"{cold.key}.json"], left  # the scratch build and runtime are gone
    warm = A.ablate(view, q, kv)
    assert calls == ["build", "run"] and warm.cached and warm.as_json() == cold.as_json()
    assert cold.wheel == ("w.whl", hashlib.sha256(b"x").hexdigest())  # the verdict names the bytes that ran
    assert json.loads((A.ablation_dir() / f"{cold.key}.json").read_text())["verdict"] == NEEDED
    # A patch that names no fix is never run: no case could show it.
    log = _patch(m, "0.25.1", "0005")
    assert A.ablate(view, q, log).verdict == UNPROVEN and calls == ["build", "run"]


@pytest.mark.heavy
@pytest.mark.network
def test_a_removal_takes_along_the_patches_that_no_longer_apply() -> None:
    """On 0.20.1's private source tree: 0005 is written on 0004's lines (vllm/envs.py), so it goes with it; 0006
    applies without either; 0003 takes nothing along."""
    m = load_manifest(REPO)
    q = _queues(m, "0.20.1")
    kv, cpu = _patch(m, "0.20.1", "0004"), _patch(m, "0.20.1", "0003")
    ablated, dropped = A.without(m, q, kv)
    assert dropped == ("0005-scheduler-log-kv-blocks-held.patch",)
    assert [p.name[:4] for p in ablated.dflash] == ["0001", "0002", "0003", "0006"]
    assert A.without(m, q, cpu)[1] == ()
