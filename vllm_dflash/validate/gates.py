"""The gates a profile sets on a measurement, and their verdicts (what the report's `gates` list holds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dflash.manifest import Profile
from vllm_dflash.validate import metrics
from vllm_dflash.validate.metrics import Acceptance


@dataclass(frozen=True)
class Verdict:
    gate: str
    passed: bool
    value: float | None
    threshold: float | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "gate": self.gate,
            "passed": self.passed,
            "value": self.value,
            "threshold": self.threshold,
            "detail": self.detail,
        }


def judge(
    profile: Profile, acc: Acceptance, match_rate: float | None, reference_al: float | None = None
) -> list[Verdict]:
    al = acc.mean_acceptance_length
    out = [
        Verdict(
            "min_acceptance_length",
            al > profile.min_acceptance_length,
            al,
            profile.min_acceptance_length,
            f"AL {al:.3f} must exceed {profile.min_acceptance_length:g}",
        )
    ]
    if profile.expected_acceptance_length is not None:
        floor = profile.expected_tolerance * profile.expected_acceptance_length
        out.append(
            Verdict(
                "expected_acceptance_length",
                al >= floor,
                al,
                floor,
                f"AL {al:.3f} >= {profile.expected_tolerance:g} x reference {profile.expected_acceptance_length:g}",
            )
        )
    if profile.reference_tolerance is not None:
        ok = reference_al is not None and al >= profile.reference_tolerance * reference_al
        floor_ref = profile.reference_tolerance * reference_al if reference_al is not None else None
        detail = (
            f"AL {al:.3f} >= {profile.reference_tolerance:g} x the reference loop's {reference_al:.3f} (same run)"
            if reference_al is not None
            else "needs the reference loop's AL (no reference was run)"
        )
        out.append(Verdict("reference_acceptance_length", ok, al, floor_ref, detail))
    fill_floor = profile.draft_fill_floor
    if fill_floor is not None and acc.num_speculative_tokens > 0:
        fill = acc.mean_draft_tokens / acc.num_speculative_tokens
        out.append(
            Verdict(
                "draft_fill",
                fill >= fill_floor,
                fill,
                fill_floor,
                f"{acc.mean_draft_tokens:.2f} of k = {acc.num_speculative_tokens} draft tokens per draft: "
                f"fraction >= {fill_floor:g} (below it vLLM's token budget cut the drafts)",
            )
        )
    for pos, floor in enumerate(profile.position_floors):
        rate = acc.per_position_rate[pos] if pos < len(acc.per_position_rate) else 0.0
        out.append(Verdict(f"position_{pos}_rate", rate >= floor, rate, floor, f"position {pos} rate >= {floor:g}"))
    if profile.min_match_rate is not None:
        ok = match_rate is not None and match_rate >= profile.min_match_rate
        detail = (
            "needs a baseline or reference run"
            if match_rate is None
            else f"outputs equal to the target's plain greedy ones: rate >= {profile.min_match_rate:g}"
        )
        out.append(Verdict("min_match_rate", ok, match_rate, profile.min_match_rate, detail))
    return out


def condition_gates(
    profile: Profile, delta: metrics.SpecCounters, mismatch_analysis: Sequence[Mapping[str, Any]] | None
) -> list[Verdict]:
    """Gates on the conditions a run claims: prompts sent more than once (rounds, there to exercise prefix caching)
    must have hit the prefix cache (else the run proved nothing about cached prefixes); every output that differs
    from the reference must differ at a near-tie of the target's top logit (else it is a bug, whatever the rate)."""
    out: list[Verdict] = []
    if profile.rounds > 1:
        hits = delta.prefix_cache_hits
        detail = f"prefix-cache hits {hits:g} of {delta.prefix_cache_queries:g} prompt tokens looked up must be > 0"
        out.append(Verdict("prefix_cache_hits", hits > 0, hits, 0.0, detail))
    if mismatch_analysis:
        bugs = sum(1 for row in mismatch_analysis if not row.get("near_tie"))
        detail = f"{bugs} of {len(mismatch_analysis)} mismatches are not near-ties of the target's top logit"
        out.append(Verdict("mismatches_are_near_ties", bugs == 0, float(bugs), 0.0, detail))
    return out
