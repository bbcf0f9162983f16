"""The conformance test's reference side and harness, and (slow) the whole `vllm-dflash conformance` run.

Fast tests run the real dflash 0.1.0 reference package in its own environment (built once, cached): the oracle must
reproduce the reference's own cached generate loop, and every negative-control oracle must disagree with it. The
slow test runs both vLLM builds through the CLI and asserts the table's outcomes: patched passes every case, stock
0.20.1 fails every case that exercises a bug.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance import compare
from vllm_dflash.envs import reference_python
from vllm_dflash.manifest import Manifest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ref_python(manifest: Manifest) -> Path:
    return reference_python(manifest)


def _in_ref(ref_python: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ref_python), *map(str, args)],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        text=True,
        capture_output=True,
        check=True,
    )


@pytest.fixture(scope="session")
def built_cases(ref_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cases")
    _in_ref(ref_python, "-m", "vllm_dflash.conformance.tiny", json.dumps({"out": str(out), "cases": []}))
    return {s.name: out / f"{s.name}-{s.digest()}" for s in C.CASES}


@pytest.fixture(scope="session")
def selftests(
    ref_python: Path, built_cases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("selftest")
    job = {"selftests": [[str(cdir), str(out / f"{name}.json")] for name, cdir in built_cases.items()]}
    _in_ref(ref_python, "-m", "vllm_dflash.conformance.oracle", json.dumps(job))
    return {name: json.loads((out / f"{name}.json").read_text()) for name in built_cases}


# ---- cases and tiny models -------------------------------------------------------------------------------------


def test_case_table_is_consistent() -> None:
    names = [c.name for c in C.CASES]
    assert len(set(names)) == len(names)
    assert len({c.digest() for c in C.CASES}) == len(C.CASES)
    for c in C.CASES:
        assert all(0 <= i < C.TARGET_LAYERS for i in c.target_layer_ids)
        # Every window case must have a context far longer than the window, or the window could not matter.
        if c.has_sliding:
            assert c.sliding_window is not None and min(c.prompt_lengths) > 3 * c.sliding_window
            assert {C.NEG_FULL_ATTN, C.NEG_WINDOW_MINUS, C.NEG_WINDOW_PLUS} <= set(c.negatives)
    assert any(C.TARGET_LAYERS - 1 in c.target_layer_ids for c in C.CASES), "no last-layer tap case"
    assert any(c.layer_types[:2] == (C.SLIDING, C.SLIDING) and c.layer_types[-1] == C.FULL for c in C.CASES)
    with pytest.raises(ValueError, match="unknown case"):
        C.get_cases(["nope"])


@pytest.mark.network
def test_tiny_models_have_the_layout_vllm_and_the_reference_read(built_cases: dict[str, Path]) -> None:
    for spec in C.CASES:
        cdir = built_cases[spec.name]
        case = C.CaseFile.from_json((cdir / "case.json").read_text())
        assert [len(p) for p in case.prompts] == list(spec.prompt_lengths)
        assert all(0 <= t < 256 for p in case.prompts for t in p)
        cfg = json.loads((cdir / "drafter" / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"]
        assert cfg["model_type"] == "qwen3"
        assert cfg["dflash_config"] == {"target_layer_ids": list(spec.target_layer_ids), "mask_token_id": 257}
        assert cfg["layer_types"] == list(spec.layer_types)
        assert cfg["block_size"] == C.BLOCK_SIZE
        assert cfg["sliding_window"] == spec.sliding_window
        assert cfg["use_sliding_window"] is spec.has_sliding
        tcfg = json.loads((cdir / "target" / "config.json").read_text())
        assert (tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]) == (4, 128, 512)
        tok = json.loads((cdir / "target" / "tokenizer.json").read_text())
        assert len(tok["model"]["vocab"]) + len(tok["added_tokens"]) == C.VOCAB


@pytest.mark.network
def test_tiny_models_are_deterministic(ref_python: Path, built_cases: dict[str, Path], tmp_path: Path) -> None:
    """Same spec, same bytes: the cache keyed by the spec's digest may be trusted."""
    _in_ref(ref_python, "-m", "vllm_dflash.conformance.tiny", json.dumps({"out": str(tmp_path), "cases": ["mixed"]}))
    spec = C.get_cases(["mixed"])[0]
    again, first = tmp_path / f"mixed-{spec.digest()}", built_cases["mixed"]
    for rel in ("target/model.safetensors", "drafter/model.safetensors", "case.json", "target/tokenizer.json"):
        a, b = (hashlib.sha256((d / rel).read_bytes()).hexdigest() for d in (first, again))
        assert a == b, rel


# ---- the oracle against the reference package itself ------------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize("name", C.CASE_NAMES)
def test_oracle_reproduces_the_reference_generate_loop(selftests: dict[str, Any], name: str) -> None:
    st = selftests[name]
    assert st["steps_compared"] >= 3
    assert st["max_abs_vs_loop"] < 1e-4, st
    assert st["loop_is_greedy"], "the reference loop with greedy drafting must reproduce the target's greedy output"


@pytest.mark.network
@pytest.mark.parametrize("spec", [c for c in C.CASES if c.negatives], ids=lambda c: c.name)
def test_negative_control_oracles_disagree(selftests: dict[str, Any], spec: C.CaseSpec) -> None:
    got = selftests[spec.name]["variant_max_abs"]
    for name in spec.negatives:
        assert got[name] > 1.0, f"{name} on {spec.name}: {got[name]}"


@pytest.mark.network
def test_window_only_case_hides_the_tap_shift(selftests: dict[str, Any]) -> None:
    """The identity target layer makes input- and output-of-layer taps equal, so only the window can differ."""
    got = selftests["window-only"]["variant_max_abs"]
    assert got[C.NEG_TAP_INPUT] < 1e-5
    assert got[C.NEG_FULL_ATTN] > 1.0


@pytest.mark.network
def test_zero_lm_head_reference_accepts_every_draft(selftests: dict[str, Any]) -> None:
    st = selftests["zero-lm-head"]
    assert st["max_abs_vs_loop"] == 0.0 and st["loop_is_greedy"]


# ---- verdicts ----------------------------------------------------------------------------------------------------


def _metrics(spec: C.CaseSpec, max_abs: float, neg: float = 3.0, accepted: int = 0) -> dict[str, Any]:
    diff = {"max_abs": max_abs, "argmax_agree": 9, "argmax_total": 9, "first_bad_step": None}
    return {
        "case": spec.name,
        "steps": 3,
        "positions": 9,
        "main": diff,
        "variants": {n: {**diff, "max_abs": neg} for n in (*spec.negatives, C.STOCK_MODEL)},
        "trace_consistent": True,
        "trace_problems": [],
        "lossless": True,
        "lossless_compared": 48,
        "num_drafts": 3,
        "num_draft_tokens": 9,
        "num_accepted_tokens": accepted,
        "acceptance_length": 1 + accepted / 3,
        "k": 3,
    }


def test_judge_verdicts() -> None:
    tol = C.TOLERANCES["cpu"]
    sliding = C.get_cases(["sliding"])[0]
    ok = compare.judge(sliding, "patched", _metrics(sliding, 5e-6), tol)
    assert ok.status == "pass" and ok.as_expected
    off = compare.judge(sliding, "patched", _metrics(sliding, 2e-3), tol)
    assert off.status == "fail" and not off.as_expected
    weak = compare.judge(sliding, "patched", _metrics(sliding, 5e-6, neg=1e-3), tol)
    assert weak.status == "pass" and not weak.as_expected, "a negative control that agrees must fail the run"
    stock_bad = compare.judge(sliding, "stock", _metrics(sliding, 4.0), tol)
    assert stock_bad.status == "fail" and stock_bad.as_expected
    stock_ok = compare.judge(sliding, "stock", _metrics(sliding, 5e-6), tol)
    assert stock_ok.status == "pass" and not stock_ok.as_expected, "stock passing a bug case must fail the run"
    missing = compare.judge(sliding, "patched", None, tol, "vLLM exited 1")
    assert missing.status == "error" and not missing.as_expected
    zero = C.get_cases(["zero-lm-head"])[0]
    assert compare.judge(zero, "patched", _metrics(zero, 0.0, accepted=9), tol).as_expected
    short = compare.judge(zero, "patched", _metrics(zero, 0.0, accepted=8), tol)
    assert short.status == "fail" and any("acceptance length" in r for r in short.reasons)


# ---- the whole thing ---------------------------------------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
def test_conformance_patched_passes_and_stock_fails(tmp_path: Path) -> None:
    report = tmp_path / "conformance.json"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "conformance", "--report", str(report)],
        text=True,
    )
    data = json.loads(report.read_text())
    by = {(o["case"], o["build"]): o for o in data["outcomes"]}
    for spec in C.CASES:
        patched = by[(spec.name, "patched")]
        assert patched["status"] == "pass", patched["reasons"]
        assert patched["max_abs"] <= 1e-4 and patched["argmax_agree"] == patched["argmax_total"]
        if not spec.zero_lm_head:  # all-zero logits are one big tie: no position has a decided argmax
            assert patched["argmax_total"] > 0
        assert patched["lossless"]
        for neg in patched["negatives"]:
            assert neg["disagrees"] and neg["max_abs"] > 1e-2, neg
        stock = by[(spec.name, "stock")]
        if spec.expect_stock == "fail":
            assert stock["status"] == "fail" and stock["max_abs"] > 1e-2, (spec.name, stock)
    zero = by[("zero-lm-head", "patched")]
    assert zero["acceptance_length"] == 1 + C.NUM_SPEC_TOKENS
    assert run.returncode == 0 and data["ok"]


def test_cli_refuses_a_missing_wheel_with_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dflash",
            "--root",
            str(REPO),
            "conformance",
            "--patched-wheel",
            str(tmp_path / "x.whl"),
        ],
        text=True,
        capture_output=True,
    )
    assert run.returncode == 13
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "x.whl: no such file" in lines[0] and " -- " in lines[0]
    assert not (tmp_path / "x.whl").exists()
