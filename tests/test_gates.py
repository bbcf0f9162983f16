"""Every gate of validate/gates.py fed its bad case, its boundary and its missing input (issue 26): a gate that no test
fails is one a bad measurement walks through. Through the CLI the lossless gate is failed in test_gate.py."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_dflash.manifest import parse_profile
from vllm_dflash.validate import gates, metrics
from vllm_dflash.validate.metrics import Acceptance

BASE: dict[str, Any] = {
    "target": "t",
    "drafter": "d",
    "method": "dflash",
    "num_speculative_tokens": 3,
    "thinking": False,
    "min_acceptance_length": 2.0,
    "serve_args": ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"],
}


def profile(**table: Any) -> Any:
    return parse_profile("p", {**BASE, **table})


def acc(al: float = 2.5, k: int = 3, fill: float | None = None, rates: tuple[float, ...] = ()) -> Acceptance:
    return Acceptance(
        mean_acceptance_length=al,
        draft_acceptance_rate=0.5,
        per_position_rate=rates,
        mean_draft_tokens=k if fill is None else fill,
        num_speculative_tokens=k,
    )


def verdicts(p: Any, a: Acceptance, match: float | None = None, ref: float | None = None) -> dict[str, Any]:
    return {v.gate: v for v in gates.judge(p, a, match, ref)}


def test_min_acceptance_length_is_strict() -> None:
    p = profile(min_acceptance_length=2.0)
    assert verdicts(p, acc(2.0001))["min_acceptance_length"].passed
    v = verdicts(p, acc(2.0))["min_acceptance_length"]  # "must exceed": the floor itself fails
    assert not v.passed and (v.value, v.threshold) == (2.0, 2.0) and "must exceed 2" in v.detail


def test_expected_acceptance_length_inclusive_and_only_when_set() -> None:
    p = profile(expected_acceptance_length=4.0, expected_tolerance=0.5)
    assert verdicts(p, acc(2.0))["expected_acceptance_length"].passed  # 2.0 >= 0.5 x 4.0
    v = verdicts(p, acc(1.999))["expected_acceptance_length"]
    assert not v.passed and v.threshold == 2.0
    assert "expected_acceptance_length" not in verdicts(profile(), acc())


def test_reference_acceptance_length_needs_the_reference() -> None:
    p = profile(reference_tolerance=0.9)
    assert verdicts(p, acc(2.7), ref=3.0)["reference_acceptance_length"].passed  # 2.7 >= 0.9 x 3.0
    below = verdicts(p, acc(2.69), ref=3.0)["reference_acceptance_length"]
    assert not below.passed and below.threshold == pytest.approx(2.7) and "reference loop's 3.000" in below.detail
    missing = verdicts(p, acc(9.0))["reference_acceptance_length"]
    assert not missing.passed and missing.threshold is None and "no reference was run" in missing.detail
    assert "reference_acceptance_length" not in verdicts(profile(), acc(), ref=3.0)


def test_draft_fill_at_its_floor_and_only_with_a_k() -> None:
    p = profile(min_draft_fill=0.9)
    assert verdicts(p, acc(fill=2.7))["draft_fill"].passed  # 2.7 / 3 = 0.9
    v = verdicts(p, acc(fill=2.69))["draft_fill"]
    assert not v.passed and v.threshold == 0.9
    assert verdicts(profile(min_draft_fill=0.9), acc(k=1, fill=1.0))["draft_fill"].passed  # k = 1 is a k
    assert "draft_fill" not in verdicts(p, acc(k=0, fill=0.0))  # no k: no fraction of it
    assert "draft_fill" in verdicts(profile(), acc())  # dflash is gated by default ...
    ngram = parse_profile("p", {**{k: v for k, v in BASE.items() if k != "drafter"}, "method": "ngram"})
    assert "draft_fill" not in verdicts(ngram, acc())  # ... other methods only when asked


def test_position_floors_each_and_missing_positions_fail() -> None:
    p = profile(position_floors=[0.5, 0.25])
    got = verdicts(p, acc(rates=(0.5, 0.25, 0.1)))
    assert got["position_0_rate"].passed and got["position_1_rate"].passed  # the floors themselves pass
    got = verdicts(p, acc(rates=(0.49, 0.3, 0.1)))
    assert not got["position_0_rate"].passed and got["position_1_rate"].passed
    short = verdicts(p, acc(rates=(0.9,)))  # no rate for position 1: 0, below its floor
    assert (
        short["position_0_rate"].passed and not short["position_1_rate"].passed and short["position_1_rate"].value == 0
    )


def test_min_match_rate_fails_below_and_without_a_comparison() -> None:
    p = profile(min_match_rate=0.5)
    assert verdicts(p, acc(), match=0.5)["min_match_rate"].passed
    low = verdicts(p, acc(), match=0.49)["min_match_rate"]
    assert not low.passed and low.value == 0.49 and "rate >= 0.5" in low.detail
    none = verdicts(p, acc(), match=None)["min_match_rate"]
    assert not none.passed and none.detail == "needs a baseline or reference run"
    assert "min_match_rate" not in verdicts(profile(), acc(), match=0.0)


def _delta(hits: float) -> metrics.SpecCounters:
    return metrics.SpecCounters(drafts=1, draft_tokens=3, accepted=1, present=True, prefix_cache_hits=hits,
                                prefix_cache_queries=100)  # fmt: skip


def test_condition_gates() -> None:
    rounds = parse_profile("p", {**BASE, "rounds": 2, "serve": "cpu-builds"})
    got = {v.gate: v for v in gates.condition_gates(rounds, _delta(1), None)}
    assert got["prefix_cache_hits"].passed  # one hit is a hit
    miss = {v.gate: v for v in gates.condition_gates(rounds, _delta(0), None)}["prefix_cache_hits"]
    assert not miss.passed and "hits 0 of 100" in miss.detail
    assert gates.condition_gates(profile(), _delta(0), None) == []  # one round proves nothing about the cache
    ties = [{"id": "a", "near_tie": True}, {"id": "b", "near_tie": True}]
    (ok,) = gates.condition_gates(profile(), _delta(0), ties)
    assert ok.gate == "mismatches_are_near_ties" and ok.passed and ok.value == 0.0
    (bug,) = gates.condition_gates(profile(), _delta(0), [*ties, {"id": "c", "near_tie": False}])
    assert not bug.passed and bug.value == 1.0 and "1 of 3 mismatches" in bug.detail
    (unknown,) = gates.condition_gates(profile(), _delta(0), [{"id": "d"}])  # no verdict on the tie: a bug
    assert not unknown.passed
    assert gates.condition_gates(profile(), _delta(0), []) == []


def test_verdict_as_dict_is_what_reports_carry() -> None:
    v = gates.Verdict("g", False, 1.5, 2.0, "d")
    assert v.as_dict() == {"gate": "g", "passed": False, "value": 1.5, "threshold": 2.0, "detail": "d"}


def test_every_publishable_profile_gates_lossless(manifest: Any) -> None:
    """A report that publishes must have compared outputs with a run that cannot be lossy (a baseline without
    speculation, or the reference loop) and gated the rate: the GPU profiles included (issue 26)."""
    for name in manifest.publish.required_profiles:
        p = manifest.profiles[name]
        assert p.min_match_rate is not None and 0 < p.min_match_rate <= 1, name
        assert p.baseline or p.reference_tolerance is not None, name
