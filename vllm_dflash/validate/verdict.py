"""A report's verdict recomputed from its evidence against the manifest's profile: what publish, release and verify
decide on. Nothing a report states about its own outcome is believed.

The report's profile must be the manifest's, field by field. k, the method, the gates and their thresholds are then
the manifest's; the counters must obey the report's rules (report.py) with that k; the acceptance numbers are
recomputed from the counter delta (metrics.acceptance), the lossless rates from the match counts, the reference
loop's AL from its counters; every gate is judged again by the validator's own code (gates.py). A report whose
recorded acceptance, gates or verdict differ from the recomputation is refused: it was edited (and re-sealed) after
validation, or made by other code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dflash import report as rules
from vllm_dflash.errors import DflashError, MeasurementError
from vllm_dflash.manifest import Profile
from vllm_dflash.report import ValidationReport, canonical_json
from vllm_dflash.validate import metrics
from vllm_dflash.validate.gates import Verdict, condition_gates, judge
from vllm_dflash.validate.serving import conditions_difference


@dataclass(frozen=True)
class Rejudged:
    """The outcome its evidence gives a report: `verdict` pass | fail | error (it measured nothing)."""

    verdict: str
    gates: tuple[Verdict, ...] = ()
    acceptance_length: float | None = None
    error: str | None = None  # what stopped a run that measured nothing, as its report says

    @property
    def failed(self) -> tuple[str, ...]:
        return tuple(v.gate for v in self.gates if not v.passed)

    @property
    def reason(self) -> str:
        """Why it did not pass, in a few words: the gates its evidence fails, or the error that stopped it."""
        return f"failed gates {list(self.failed)}" if self.failed else f"error: {self.error or 'none recorded'}"


def profile_difference(recorded: Any, profile: Profile) -> str | None:
    """None when a report's profile section is `profile` exactly (name, digest and every field of its table);
    else the first field that differs."""
    want = {"name": profile.name, "sha256": profile.digest, **profile.definition}
    if not isinstance(recorded, Mapping):
        return "it has no profile section"
    for key in sorted(set(want) | set(recorded), key=str):
        mine = canonical_json(recorded[key]) if key in recorded else None
        theirs = canonical_json(want[key]) if key in want else None
        if mine != theirs:
            said = mine.decode() if mine is not None else "absent"
            holds = theirs.decode() if theirs is not None else "absent"
            return f"its field {str(key)[:40]!r} is {said[:60]}, dist.toml's {holds[:60]}"
    return None


def _rate(section: Any, matches_key: str, rate_key: str, mismatches_key: str, count: Any, where: str) -> float | str:
    """A lossless match rate recomputed from its counts (matches / every output compared), or what is wrong."""
    if not isinstance(section, Mapping):
        return f"its {where} section is not an object"
    matches, rate, mismatches = section.get(matches_key), section.get(rate_key), section.get(mismatches_key)
    if isinstance(matches, bool) or not isinstance(matches, int) or matches < 0 or not isinstance(mismatches, list):
        return f"its {where} section has no match counts"
    total = matches + len(mismatches)
    if total != count:
        return f"its {where} section compared {total} outputs, not the {count!r} prompts it sent"
    want = matches / total if total else 0.0
    if isinstance(rate, bool) or rate != want:
        return f"its {where} match rate {rate!r} is not the {want!r} its {matches} of {total} matches give"
    return want


def _match_rate(data: Mapping[str, Any], count: Any) -> float | str | None:
    """The lossless rate validate gates on: the lowest of the baseline's and the reference's, None when neither ran."""
    rates: list[float] = []
    if data.get("baseline") is not None:
        got = _rate(
            data["baseline"], "lossless_matches", "lossless_match_rate", "lossless_mismatches", count, "baseline"
        )
        if isinstance(got, str):
            return got
        rates.append(got)
    if data.get("lossless_vs_reference") is not None:
        got = _rate(data["lossless_vs_reference"], "matches", "rate", "mismatches", count, "lossless_vs_reference")
        if isinstance(got, str):
            return got
        rates.append(got)
    return min(rates) if rates else None


def _reference_al(data: Mapping[str, Any]) -> float | str | None:
    """The reference loop's AL, recomputed from the loop's own counters when the report has a reference."""
    ref = data.get("reference")
    if ref is None:
        return None
    if not isinstance(ref, Mapping):
        return "its reference section is not an object"
    counters = ref.get("counters")
    if not isinstance(counters, Mapping):
        return "its reference section carries no counters"
    drafts, accepted = counters.get("num_drafts"), counters.get("num_accepted_tokens")
    for name, value in (("reference num_drafts", drafts), ("reference num_accepted_tokens", accepted)):
        problem = rules.count_value_problem(name, value)
        if problem is not None:
            return problem
    assert isinstance(drafts, int | float) and isinstance(accepted, int | float)  # counts, as just checked
    if drafts == 0:
        return "its reference loop drafted nothing"
    want = 1.0 + accepted / drafts
    al = ref.get("acceptance_length")
    if isinstance(al, bool) or al != want:
        return f"its reference AL {al!r} is not the {want!r} the reference loop's counters give"
    return float(want)


def _mismatch_analysis(data: Mapping[str, Any]) -> Sequence[Mapping[str, Any]] | str | None:
    """The near-tie rows, one per output that differs from the reference (none may be left out: the gate on them
    would then not be judged)."""
    rows = data.get("mismatch_analysis")
    lossless = data.get("lossless_vs_reference")
    mismatches = lossless.get("mismatches") if isinstance(lossless, Mapping) else None
    want = len(mismatches) if isinstance(mismatches, list) else 0
    if rows is None:
        return None if want == 0 else f"it lacks the near-tie analysis of its {want} reference mismatches"
    if not isinstance(rows, list) or not all(isinstance(r, Mapping) for r in rows):
        return "its mismatch analysis is not a list of rows"
    if len(rows) != want:
        return f"its mismatch analysis has {len(rows)} rows for {want} reference mismatches"
    if not all(isinstance(r.get("near_tie"), bool) for r in rows):
        return "its mismatch analysis has a row without a near_tie verdict"
    return rows


def rejudge(data: Mapping[str, Any], profile: Profile) -> Rejudged | str:
    """The outcome of the report `data` under `profile` (the manifest's), or what makes it untrustworthy (a string):
    a profile that is not the manifest's, impossible counters, or recorded numbers, gates or verdict other than the
    evidence gives."""
    problem = profile_difference(data.get("profile"), profile)
    if problem is not None:
        return problem
    recorded = data.get("verdict")
    if recorded in ("pass", "fail"):
        problem = conditions_difference(data.get("serving"), data.get("sampling"), profile)
        if problem is not None:
            return problem
    if recorded not in ("pass", "fail"):
        said = data.get("error")
        return Rejudged(verdict="error", error=str(said)[:300] if said is not None else None)
    k, method = profile.num_speculative_tokens, profile.method
    problem = rules.measurement_problem(data, k, method)
    if problem is not None:
        return problem
    counts = rules.measured_counts(data, k, method)
    assert not isinstance(counts, str)  # measurement_problem checked them
    delta = metrics.SpecCounters(
        drafts=counts.values["num_drafts"],
        draft_tokens=counts.values["num_draft_tokens"],
        accepted=counts.values["num_accepted_tokens"],
        per_position=dict(counts.per_position),
        generation_tokens=counts.values["generation_tokens"],
        present=True,
        prefix_cache_queries=counts.values["prefix_cache_queries"],
        prefix_cache_hits=counts.values["prefix_cache_hits"],
    )
    try:
        acc = metrics.acceptance(delta, k, method)
    except MeasurementError as exc:  # measurement_problem ran the same rules: kept for a clean line regardless
        return exc.message
    if data.get("acceptance") != acc.as_dict():
        return f"its acceptance section is not the one its counters give ({canonical_json(acc.as_dict()).decode()})"
    prompts = data.get("prompts")
    count = prompts.get("count") if isinstance(prompts, Mapping) else None
    match_rate = _match_rate(data, count)
    if isinstance(match_rate, str):
        return match_rate
    reference_al = _reference_al(data)
    if isinstance(reference_al, str):
        return reference_al
    analysis = _mismatch_analysis(data)
    if isinstance(analysis, str):
        return analysis
    gates = [*judge(profile, acc, match_rate, reference_al), *condition_gates(profile, delta, analysis)]
    written = data.get("gates")
    want = [g.as_dict() for g in gates]
    if written != want:
        names = [g.get("gate") if isinstance(g, Mapping) else g for g in written or []]
        differ = next(
            (
                f"its gate {w['gate']} says {canonical_json(r).decode()[:160]}, its evidence "
                f"{canonical_json(w).decode()[:160]}"
                for r, w in zip(written or [], want, strict=False)
                if r != w
            ),
            f"its gates {names} are not the {[g.gate for g in gates]} the profile sets",
        )
        return differ
    verdict = "pass" if all(g.passed for g in gates) else "fail"
    if recorded != verdict:
        return f"its verdict {recorded!r} is not the {verdict!r} its gates give"
    return Rejudged(verdict=verdict, gates=tuple(gates), acceptance_length=acc.mean_acceptance_length)


def check(rep: ValidationReport, profiles: Mapping[str, Profile], error: type[DflashError], hint: str = "") -> Rejudged:
    """`rep` judged again under the manifest's profile of its name; `error` (one line) when the manifest has no such
    profile or the report's evidence does not give what it states."""
    profile = profiles.get(rep.profile_name)
    if profile is None:
        raise error(
            f"report {rep.path} is of profile '{rep.profile_name[:64]}', which dist.toml does not define",
            "validate with a profile of the manifest",
        )
    differs = profile_difference(rep.data.get("profile"), profile)
    if differs is not None:
        raise error(
            f"report {rep.path} was made with a different definition of profile '{profile.name}' than dist.toml "
            f"holds now: {differs}",
            "validate again with the manifest's profile",
        )
    got = rejudge(rep.data, profile)
    if isinstance(got, str):
        raise error(f"report {rep.path} does not hold up against dist.toml's profile '{profile.name}': {got}", hint)
    return got
