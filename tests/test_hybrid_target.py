"""The user's architecture family on the CPU twin: a tiny hybrid Qwen3.5 target (Gated DeltaNet + gated attention,
3 : 1) served by this build of vLLM 0.20.1 equals transformers' own classes, through chunked prefill, batched decode,
ngram speculative verify and DFlash drafting (vllm_dflash/conformance/hybrid.py). The torch GDN kernels of the CPU
runtime queue (patches/cpu/0008) are what make it run; each negative control breaks one of them and must be caught."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from vllm_dflash.conformance import compare, hybrid
from vllm_dflash.envs import reference_python
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import read_queues

MUTANT_DIR = Path(__file__).resolve().parent / "hybrid_mutant"


@pytest.fixture(scope="module")
def ref_python(manifest: Manifest) -> Path:
    return reference_python(manifest)


@pytest.fixture(scope="module")
def runner(manifest: Manifest, ref_python: Path) -> compare.Runner:
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    return compare.vllm_runner(manifest, queues, compare.patched_wheel(manifest, queues, "cpu"), "cpu")


def _run(
    manifest: Manifest,
    runner: compare.Runner,
    ref_python: Path,
    work: Path,
    mutant: str = "",
    runs: tuple[str, ...] = hybrid.RUNS,
) -> hybrid.HybridResult:
    environ = dict(runner.environ)
    if mutant:
        environ["PYTHONPATH"] = os.pathsep.join([str(MUTANT_DIR), environ["PYTHONPATH"]])
        environ["VLLM_DFLASH_GDN_MUTANT"] = mutant
    return hybrid.run_target_conformance(manifest, runner.python, environ, ref_python, "dflash", work, runs=runs)


def test_hybrid_target_equals_transformers(
    manifest: Manifest, runner: compare.Runner, ref_python: Path, tmp_path: Path
) -> None:
    result = _run(manifest, runner, ref_python, tmp_path)
    for r in result.runs:
        greedy = f"{r.greedy_agree}/{r.greedy_total}"
        print(f"{r.run}: max |dlogprob| {r.max_abs:.2e} over {r.positions} positions, greedy {greedy}")
    assert [r.run for r in result.runs] == list(hybrid.RUNS)
    assert all(r.positions > 0 and r.greedy_total > 0 for r in result.runs)
    assert result.passed, result


@pytest.mark.parametrize("mutant", ["drop-initial-state", "decode-keeps-state"])
def test_a_broken_gdn_kernel_disagrees(
    manifest: Manifest, runner: compare.Runner, ref_python: Path, tmp_path: Path, mutant: str
) -> None:
    result = _run(manifest, runner, ref_python, tmp_path, mutant, runs=("batched",))
    (r,) = result.runs
    print(f"{mutant}: max |dlogprob| {r.max_abs:.2e}, greedy {r.greedy_agree}/{r.greedy_total}")
    assert r.max_abs > hybrid.NEGATIVE_MIN and not result.passed


def test_verify_kernels_roll_back_to_the_accepted_column(runner: compare.Runner, tmp_path: Path) -> None:
    """Acceptance > 1, which the random tiny target rarely reaches end to end: after a verify step that kept a of
    its tokens, the next step must equal transformers' recurrence over exactly those; read without the rollback it
    must not (the check's own negative)."""
    worst, stale = hybrid.check_kernels(runner.python, runner.environ, tmp_path)
    print(f"verify kernels: max |delta| {worst:.1e}; without rollback >= {stale:.2g}")
    assert worst <= hybrid.KERNEL_MAX_ABS
    assert stale > hybrid.NEGATIVE_MIN


def test_spec_digest_covers_every_field_and_the_generator() -> None:
    base = hybrid.HybridSpec()
    assert base.digest() == hybrid.HybridSpec().digest()
    for changed in (
        dataclasses.replace(base, seed=12),
        dataclasses.replace(base, chunk_tokens=16),
        dataclasses.replace(base, prompt_lengths=(40, 101, 13)),
    ):
        assert changed.digest() != base.digest(), changed
    lengths = [len(p) for p in base.prompts()]
    assert lengths == list(base.prompt_lengths)
    # The long prompt spans several prefill chunks, so a later chunk starts from a stored state.
    assert max(lengths) > 2 * base.chunk_tokens


def test_judge_needs_both_the_bound_and_every_greedy_token() -> None:
    ok = hybrid.RunResult("batched", hybrid.MAX_ABS_LOGPROB, 10, 10, 100)
    assert ok.passed
    assert not hybrid.RunResult("batched", hybrid.MAX_ABS_LOGPROB * 1.01, 10, 10, 100).passed
    assert not hybrid.RunResult("batched", 0.0, 9, 10, 100).passed
