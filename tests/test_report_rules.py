"""The report's rules (report.py) and the verdict judged again from its evidence (validate/verdict.py), one decision
at a time: every bad case next to its valid twin, at the boundaries where a flipped comparison would show.

The valid report is made by the validator's own code paths (scrapes -> delta -> acceptance -> gates); each case
changes one thing. The CLI path of the same rules is test_reseal.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash import report as rules
from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.manifest import Profile, parse_profile
from vllm_dflash.validate import metrics, verdict
from vllm_dflash.validate.gates import condition_gates, judge
from vllm_dflash.validate.serving import sampling_conditions, serving_conditions

K = 3


def profile(**over: Any) -> Profile:
    table: dict[str, Any] = {
        "target": "t",
        "drafter": "d",
        "method": "dflash",
        "num_speculative_tokens": K,
        "thinking": False,
        "serve_args": ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"],
        "min_acceptance_length": 2.0,
        **over,
    }
    return parse_profile("rules", table)


def scrape(drafts: float, tokens: float, accepted: float, per: dict[int, float], **more: Any) -> Any:
    return metrics.SpecCounters(
        drafts=drafts, draft_tokens=tokens, accepted=accepted, per_position=per, present=True, **more
    )


def report(prof: Profile | None = None, **extra: Any) -> dict[str, Any]:
    """A report as validate writes one: AL 2.5 over 100 drafts, k = 3 (before: some earlier traffic)."""
    prof = prof or profile()
    before = scrape(10, 30, 5, {0: 3, 1: 2}, generation_tokens=7)
    after = scrape(110, 330, 155, {0: 78, 1: 52, 2: 25}, generation_tokens=407)
    delta = after.minus(before)
    acc = metrics.acceptance(delta, prof.num_speculative_tokens, prof.method)
    match_rate = extra.pop("match_rate", None)
    ref_al = extra.pop("reference_al", None)
    body: dict[str, Any] = {
        "schema": rules.SCHEMA,
        "profile": {"name": prof.name, "sha256": prof.digest, **prof.definition},
        "prompts": {"set": "mixed", "count": 4, "sha256": "0" * 64},
        "counters": {"before": before.as_dict(), "after": after.as_dict(), "delta": delta.as_dict()},
        "acceptance": acc.as_dict(),
        "server": {"artifact": {"sha256": "1" * 64}},
        "serving": serving_conditions(prof, "subprocess"),
        "sampling": sampling_conditions(prof),
        **extra,
    }
    gates = [*judge(prof, acc, match_rate, ref_al), *condition_gates(prof, delta, extra.get("mismatch_analysis"))]
    body["gates"] = [g.as_dict() for g in gates]
    body["verdict"] = "pass" if all(g.passed for g in gates) else "fail"
    return body


def edited(data: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    edit(out)
    return out


# ---------------------------------------------------------------------------------------------------- strict JSON
def test_duplicate_keys_are_refused_at_any_depth() -> None:
    assert rules.loads_strict('{"a": {"b": 1, "c": 2}}') == {"a": {"b": 1, "c": 2}}
    for text in ('{"verdict": "fail", "verdict": "pass"}', '{"a": {"b": 1, "b": 1}}', '[{"x": 1, "x": 2}]'):
        with pytest.raises(ValueError, match="duplicate key"):
            rules.loads_strict(text)
    with pytest.raises(ValueError, match="not a JSON number"):
        rules.loads_strict('{"a": NaN}')


# --------------------------------------------------------------------------------------------------- the counts
@pytest.mark.parametrize(
    ("value", "words"),
    [
        (True, "not a finite count"),
        ("3", "not a finite count"),
        (None, "not a finite count"),
        (float("inf"), "not a finite count"),
        (float("nan"), "not a finite count"),
        (-1, "not a finite count"),
        (-0.5, "not a finite count"),
        (40.5, "not a whole number"),
        (1e-8, "not a whole number"),
        (2**53 + 1, "above 2^53"),
        (float(2**54), "above 2^53"),
    ],
)
def test_a_count_that_vllm_never_exports(value: Any, words: str) -> None:
    got = rules.count_value_problem("n", value)
    assert got is not None and words in got


@pytest.mark.parametrize("value", [0, 0.0, 40, 40.0, 2**53, float(2**53)])
def test_a_count_as_vllm_exports_one(value: Any) -> None:
    assert rules.count_value_problem("n", value) is None


@pytest.mark.parametrize(
    ("label", "want"),
    [
        ("0", 0),
        ("7", 7),
        ("10", 10),
        ("999999", 999999),
        ("1000000", None),  # 7 digits: no draft position
        ("9" * 5000, None),
        ("00", None),
        ("01", None),
        ("", None),
        ("-1", None),
        ("+1", None),
        (" 1", None),
        ("1.0", None),
        ("\u0661", None),  # ARABIC-INDIC DIGIT ONE: isdigit() says yes, vLLM never writes it
        (1, None),
        (None, None),
    ],
)
def test_position_labels_are_canonical(label: Any, want: int | None) -> None:
    assert rules.position_of(label) == want


def test_per_position_family_is_required_for_dflash_only() -> None:
    assert rules.per_position_required("dflash") and not rules.per_position_required("ngram")
    assert not rules.per_position_required(None)


OK: dict[str, Any] = {"drafts": 10, "draft_tokens": 30, "accepted": 12, "per_position": {0: 6, 1: 4, 2: 2}}


@pytest.mark.parametrize(
    ("counts", "words"),
    [
        ({**OK, "draft_tokens": 40, "accepted": 40, "per_position": {}}, "exceed 10 drafts x k"),
        ({**OK, "draft_tokens": 31}, "31 draft tokens exceed 10 drafts x k = 3"),
        ({**OK, "accepted": 31, "draft_tokens": 30}, "31 accepted tokens exceed the 30 draft tokens"),
        ({**OK, "accepted": float("inf")}, "not a finite count"),
        ({**OK, "drafts": -1}, "not a finite count"),
        ({**OK, "drafts": True}, "not a finite count"),
        ({**OK, "drafts": 1e-8}, "not a whole number"),
        ({**OK, "per_position": {0: 6, 1: 4.5, 2: 1.5}}, "num_accepted_tokens_per_pos[1] = 4.5"),
        ({**OK, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": {}}, "drafted nothing"),
        ({**OK, "per_position": {0: 4, 1: 6, 2: 2}}, "more tokens accepted at position 1"),
        ({**OK, "per_position": {0: 6, 1: 2, 2: 4}}, "more tokens accepted at position 2"),
        ({**OK, "per_position": {0: 6, 1: 4, 2: 1}}, "sum to 11"),
        ({**OK, "per_position": {0: 6, 1: 4, 2: 3}}, "sum to 13"),
        ({**OK, "per_position": {0: 6, 1: 4, 3: 2}}, "outside 0..2"),
        ({**OK, "per_position": {-1: 6, 1: 4, 2: 2}}, "outside 0..2"),
        ({**OK, "accepted": 11, "per_position": {0: 11, 1: 0, 2: 0}}, "more than the 10 drafts"),
    ],
)
def test_impossible_counts(counts: dict[str, Any], words: str) -> None:
    got = rules.count_problem(**counts, k=K)
    assert got is not None and words in got, got


@pytest.mark.parametrize(
    "counts",
    [
        OK,
        {**OK, "draft_tokens": 30, "accepted": 30, "per_position": {0: 10, 1: 10, 2: 10}},  # every boundary met
        {**OK, "per_position": {0: 6, 1: 6, 2: 0}},  # equal neighbours
        {**OK, "per_position": {0: 8, 1: 4}},  # a position vLLM did not report counts 0
        {**OK, "per_position": {}},  # no family: fine where it is not required
        {**OK, "drafts": 10.0, "accepted": 12.0},  # integral floats
    ],
)
def test_possible_counts(counts: dict[str, Any]) -> None:
    assert rules.count_problem(**counts, k=K) is None


def test_the_family_missing_for_dflash() -> None:
    got = rules.count_problem(**{**OK, "per_position": {}}, k=K, require_per_position=True)
    assert got is not None and "no per-position counts" in got
    assert rules.count_problem(**OK, k=K, require_per_position=True) is None


# ------------------------------------------------------------------------------------- the counter sets
def test_counter_sets_and_their_delta() -> None:
    data = report()
    counters = data["counters"]
    assert rules.measurement_problem(data) is None
    got = rules.read_counts(counters["delta"], "delta")
    assert isinstance(got, rules.Counts) and got.values["num_drafts"] == 100 and got.per_position[2] == 25

    cases: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
        (lambda c: c.update(after=None), "it has no after counters"),
        (lambda c: c["after"].update(extra=1), "fields ['extra'] no scrape gives"),
        (lambda c: c["before"].pop("prefix_cache_hits"), "lack ['prefix_cache_hits']"),
        (lambda c: c["after"].update(num_drafts=110.5), "after.num_drafts = 110.5 is not a whole number"),
        (lambda c: c["after"].update(num_accepted_tokens_per_pos=[1]), "after.num_accepted_tokens_per_pos is not"),
        (lambda c: c["after"]["num_accepted_tokens_per_pos"].update({"03": 0}), "has label '03'"),
        (lambda c: c["after"]["num_accepted_tokens_per_pos"].update({"0": -78}), "[0] = -78 is not a finite"),
        (lambda c: c["after"].update(num_drafts=5), "num_drafts went down from 10 to 5"),
        (lambda c: c["delta"].update(num_drafts=101), "delta num_drafts = 101 is not after - before = 110 - 10"),
        (lambda c: c["delta"].update(generation_tokens=401), "delta generation_tokens = 401"),
        (lambda c: c["delta"]["num_accepted_tokens_per_pos"].pop("2"), "delta has draft positions [0, 1]"),
        (lambda c: c["after"]["num_accepted_tokens_per_pos"].update({"1": 1}), "[1] went down from 2 to 1"),
        (lambda c: c["delta"]["num_accepted_tokens_per_pos"].update({"1": 51}), "[1] = 51 is not after - before"),
    ]
    for edit, words in cases:
        bad = edited(data, lambda d, e=edit: e(d["counters"]))  # type: ignore[misc]
        got_problem = rules.measurement_problem(bad)
        assert got_problem is not None and words in got_problem, (words, got_problem)


def test_measurement_problem_decisions() -> None:
    data = report()
    # Measured nothing (validate's error report carries no counters and no acceptance): nothing to judge.
    nothing = {**data, "verdict": "error", "counters": None, "acceptance": None, "gates": []}
    assert rules.measurement_problem(nothing) is None
    assert "no counters" in (rules.measurement_problem({**nothing, "verdict": "fail"}) or "")
    for k in (0, True, "3", None):
        bad = edited(data, lambda d, k=k: d["profile"].update(num_speculative_tokens=k))  # type: ignore[misc]
        assert "no num_speculative_tokens >= 1" in (rules.measurement_problem(bad) or "")
    assert "it has no counters" in (rules.measurement_problem({**data, "counters": None}) or "")
    al = data["acceptance"]["mean_acceptance_length"]
    assert al == 2.5
    for wrong in (2.5000000001, 2.4999999999, True, "2.5", None):
        bad = edited(data, lambda d, w=wrong: d["acceptance"].update(mean_acceptance_length=w))  # type: ignore[misc]
        assert "is not the 2.500000 its counters give" in (rules.measurement_problem(bad) or ""), wrong
    bad = edited(data, lambda d: d["gates"][0].update(value=3.0))
    assert "gate judged 3.0, not the AL 2.5" in (rules.measurement_problem(bad) or "")
    # k and the method are the caller's when given (a reader passes the manifest's), else the report's own.
    assert "exceed 100 drafts x k = 2" in (rules.measurement_problem(data, k=2) or "")
    no_family = edited(data, lambda d: [d["counters"][w].update(num_accepted_tokens_per_pos={}) for w in d["counters"]])
    assert "no per-position counts" in (rules.measurement_problem(no_family) or "")
    assert rules.measurement_problem(no_family, method="ngram") is None


def test_a_routers_replicas_add_up_to_the_delta() -> None:
    """A report measured behind a router carries each replica's counter delta; every reader adds them up again."""
    one = scrape(60, 180, 90, {0: 45, 1: 30, 2: 15}, generation_tokens=240)
    two = scrape(40, 120, 60, {0: 30, 1: 20, 2: 10}, generation_tokens=160)
    rows = [{"metrics": f"http://r{i}/metrics", "counters": c.as_dict()} for i, c in enumerate((one, two))]
    data = report(replicas=rows)
    assert rules.measurement_problem(data) is None
    assert rules.measurement_problem(report()) is None  # one server: no replicas to add up
    cases: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
        (lambda d: d.update(replicas=[]), "its replicas are not a list"),
        (lambda d: d.update(replicas="r0"), "its replicas are not a list"),
        (lambda d: d["replicas"][1].update(counters=None), "replicas[1]"),
        (lambda d: d["replicas"].pop(), "replicas' num_drafts add up to 60, its delta says 100"),
        (lambda d: d["replicas"].append(d["replicas"][0]), "num_drafts add up to 160"),
        (lambda d: d["replicas"][0]["counters"].update(generation_tokens=241), "generation_tokens add up to 401"),
        (
            lambda d: d["replicas"][0]["counters"]["num_accepted_tokens_per_pos"].update({"0": 44, "1": 31}),
            "num_accepted_tokens_per_pos[0] do not add up",
        ),
    ]
    for edit, words in cases:
        got = rules.measurement_problem(edited(data, edit))
        assert got is not None and words in got, (words, got)


# -------------------------------------------------------------------------------------- the verdict again
def test_a_genuine_report_is_judged_as_it_says() -> None:
    prof = profile()
    got = verdict.rejudge(report(prof), prof)
    assert isinstance(got, verdict.Rejudged) and got.verdict == "pass" and got.acceptance_length == 2.5
    assert [g.gate for g in got.gates] == ["min_acceptance_length", "draft_fill"] and got.failed == ()
    failing = profile(min_acceptance_length=2.5)  # AL must exceed 2.5: 2.5 fails
    bad = verdict.rejudge(report(failing), failing)
    assert isinstance(bad, verdict.Rejudged) and bad.verdict == "fail" and bad.failed == ("min_acceptance_length",)
    assert verdict.rejudge({**report(prof), "verdict": "error"}, prof) == verdict.Rejudged(verdict="error")


def test_the_profile_is_the_manifests_field_by_field() -> None:
    prof = profile()
    data = report(prof)
    assert verdict.profile_difference(data["profile"], prof) is None
    for edit, words in [
        (lambda p: p.update(num_speculative_tokens=15), "its field 'num_speculative_tokens' is 15, dist.toml's 3"),
        (lambda p: p.update(min_acceptance_length=1.0), "'min_acceptance_length' is 1.0, dist.toml's 2.0"),
        (lambda p: p.update(sha256="f" * 64), "its field 'sha256'"),
        (lambda p: p.update(name="other"), "its field 'name'"),
        (lambda p: p.update(min_match_rate=0.0), "'min_match_rate' is 0.0, dist.toml's absent"),
        (lambda p: p.pop("drafter"), "'drafter' is absent, dist.toml's \"d\""),
    ]:
        got = verdict.profile_difference(edited(data, lambda d, e=edit: e(d["profile"]))["profile"], prof)  # type: ignore[misc]
        assert got is not None and words in got, (words, got)
    assert verdict.profile_difference(None, prof) == "it has no profile section"
    # Judged under another profile than it was made with: refused before any number is read.
    other = profile(min_acceptance_length=1.0)
    assert "'min_acceptance_length'" in str(verdict.rejudge(data, other))


def test_recorded_outcomes_must_be_the_evidences() -> None:
    prof = profile()
    data = report(prof)
    for edit, words in [
        (lambda d: d["acceptance"].update(draft_acceptance_rate=0.6), "its acceptance section is not the one"),
        (lambda d: d["acceptance"].update(per_position_acceptance_rate=[0.75, 0.5]), "its acceptance section"),
        (lambda d: d["gates"][1].update(passed=False), "its gate draft_fill says"),
        (lambda d: d["gates"][1].update(threshold=0.5), "its gate draft_fill says"),
        (lambda d: d["gates"][0].update(detail="AL fine"), "its gate min_acceptance_length says"),
        (lambda d: d["gates"].pop(), "its gates ['min_acceptance_length'] are not the"),
        (lambda d: d["gates"].append(dict(d["gates"][0])), "are not the ['min_acceptance_length', 'draft_fill']"),
        (lambda d: d.update(gates=None), "its gates [] are not the"),
        (lambda d: d.update(verdict="fail"), "its verdict 'fail' is not the 'pass' its gates give"),
        (lambda d: d["counters"]["delta"].update(num_draft_tokens=301), "delta num_draft_tokens = 301"),
    ]:
        got = verdict.rejudge(edited(data, edit), prof)
        assert isinstance(got, str) and words in got, (words, got)


def test_lossless_rates_are_recomputed_from_the_match_counts() -> None:
    prof = profile(min_match_rate=0.75)
    base = {"lossless_matches": 3, "lossless_match_rate": 0.75, "lossless_mismatches": [{"id": "p3", "position": 9}]}
    ref = {"matches": 4, "rate": 1.0, "mismatches": []}
    data = report(prof, baseline=base, lossless_vs_reference=ref, match_rate=0.75)
    got = verdict.rejudge(data, prof)
    assert isinstance(got, verdict.Rejudged) and got.verdict == "pass"  # min(0.75, 1.0) = 0.75 >= 0.75
    alone = report(prof, lossless_vs_reference=ref, match_rate=1.0)
    assert isinstance(verdict.rejudge(alone, prof), verdict.Rejudged)
    none = report(prof)  # the profile gates lossless, nothing measured it: the gate fails, so does the verdict
    got_none = verdict.rejudge(none, prof)
    assert isinstance(got_none, verdict.Rejudged) and got_none.failed == ("min_match_rate",)
    for edit, words in [
        (lambda d: d["baseline"].update(lossless_match_rate=1.0), "baseline match rate 1.0 is not the 0.75"),
        (lambda d: d["baseline"].update(lossless_match_rate=True), "baseline match rate True"),
        (lambda d: d["baseline"].update(lossless_matches=4), "compared 5 outputs, not the 4 prompts"),
        (lambda d: d["baseline"].update(lossless_matches=-1), "baseline section has no match counts"),
        (lambda d: d["baseline"].update(lossless_matches=True), "baseline section has no match counts"),
        (lambda d: d["baseline"].update(lossless_mismatches=None), "baseline section has no match counts"),
        (lambda d: d.update(baseline=[1]), "its baseline section is not an object"),
        (lambda d: d["lossless_vs_reference"].update(rate=0.9), "lossless_vs_reference match rate 0.9"),
        (lambda d: d["lossless_vs_reference"].update(matches=3), "compared 3 outputs"),
    ]:
        got_bad = verdict.rejudge(edited(data, edit), prof)
        assert isinstance(got_bad, str) and words in got_bad, (words, got_bad)
    # The rate the gate sees is the lower one: a baseline at 0.5 fails a 0.75 gate although the reference says 1.0.
    low = {**base, "lossless_matches": 2, "lossless_match_rate": 0.5, "lossless_mismatches": [{}, {}]}
    failing = report(prof, baseline=low, lossless_vs_reference=ref, match_rate=0.5)
    got_low = verdict.rejudge(failing, prof)
    assert isinstance(got_low, verdict.Rejudged) and got_low.failed == ("min_match_rate",)
    assert verdict._rate({"matches": 0, "rate": 0.0, "mismatches": []}, "matches", "rate", "mismatches", 0, "x") == 0.0


def test_the_reference_loops_al_is_recomputed_from_its_counters() -> None:
    prof = profile(reference_tolerance=0.9)
    ref = {"acceptance_length": 2.5, "counters": {"num_drafts": 40, "num_accepted_tokens": 60}}
    data = report(prof, reference=ref, reference_al=2.5)
    got = verdict.rejudge(data, prof)
    assert isinstance(got, verdict.Rejudged) and got.verdict == "pass"
    for edit, words in [
        (lambda d: d["reference"].update(acceptance_length=2.0), "reference AL 2.0 is not the 2.5"),
        (lambda d: d["reference"].update(acceptance_length=True), "reference AL True"),
        (lambda d: d["reference"].pop("counters"), "carries no counters"),
        (lambda d: d["reference"]["counters"].update(num_drafts=0.5), "reference num_drafts = 0.5"),
        (lambda d: d["reference"]["counters"].update(num_drafts=0, num_accepted_tokens=0), "drafted nothing"),
        (lambda d: d.update(reference="x"), "its reference section is not an object"),
    ]:
        got_bad = verdict.rejudge(edited(data, edit), prof)
        assert isinstance(got_bad, str) and words in got_bad, (words, got_bad)
    gone = report(prof)  # no reference run at all: the profile's reference gate fails
    got_gone = verdict.rejudge(gone, prof)
    assert isinstance(got_gone, verdict.Rejudged) and got_gone.failed == ("reference_acceptance_length",)


def test_every_reference_mismatch_has_its_near_tie_row() -> None:
    prof = profile()
    ref = {"matches": 2, "rate": 0.5, "mismatches": [{"id": "a", "position": 1}, {"id": "b", "position": 2}]}
    rows = [{"id": "a", "near_tie": True}, {"id": "b", "near_tie": True}]
    data = report(prof, lossless_vs_reference=ref, mismatch_analysis=rows)
    got = verdict.rejudge(data, prof)
    assert isinstance(got, verdict.Rejudged) and "mismatches_are_near_ties" in [g.gate for g in got.gates]
    assert got.verdict == "pass"
    for edit, words in [
        (lambda d: d.pop("mismatch_analysis"), "lacks the near-tie analysis of its 2 reference mismatches"),
        (lambda d: d["mismatch_analysis"].pop(), "has 1 rows for 2 reference mismatches"),
        (lambda d: d.update(mismatch_analysis={"a": 1}), "is not a list of rows"),
        (lambda d: d["mismatch_analysis"][0].update(near_tie="yes"), "a row without a near_tie verdict"),
        (lambda d: d["mismatch_analysis"][1].update(near_tie=False), "its gate mismatches_are_near_ties says"),
    ]:
        got_bad = verdict.rejudge(edited(data, edit), prof)
        assert isinstance(got_bad, str) and words in got_bad, (words, got_bad)


def test_prefix_cache_gate_is_judged_from_the_delta() -> None:
    prof = profile(rounds=2, serve="cpu-builds")
    data = report(prof)  # the scrapes carry no prefix-cache hits: the gate fails
    got = verdict.rejudge(data, prof)
    assert isinstance(got, verdict.Rejudged) and got.failed == ("prefix_cache_hits",)


def test_check_names_the_report_and_the_profile(tmp_path: Path) -> None:
    prof = profile()
    path = tmp_path / "r.json"
    rules.write(rules.seal(report(prof)), path)
    rep = rules.load(path, None, PublishRefusedError)
    assert verdict.check(rep, {prof.name: prof}, PublishRefusedError).verdict == "pass"
    with pytest.raises(PublishRefusedError, match=r"of profile 'rules', which dist\.toml does not define"):
        verdict.check(rep, {}, PublishRefusedError)
    with pytest.raises(PublishRefusedError, match=r"different definition of profile 'rules'"):
        verdict.check(rep, {prof.name: profile(min_acceptance_length=1.0)}, PublishRefusedError)
    bad = rules.seal(edited(report(prof), lambda d: d.update(verdict="fail")))
    path.write_text(json.dumps(bad))
    with pytest.raises(PublishRefusedError, match=r"does not hold up against dist\.toml's profile 'rules'"):
        verdict.check(rules.load(path, None, PublishRefusedError), {prof.name: prof}, PublishRefusedError)


# ------------------------------------------------------------------------------------------------ seal and loading
def test_a_seal_that_is_no_seal() -> None:
    body = report()
    assert rules.seal_problem(rules.seal(body)) is None
    for seal in (None, "abc", {"sha256": 5}, {"hmac_sha256": "0" * 64}):
        assert rules.seal_problem({**body, "seal": seal}) == "it has no seal", seal
    assert "does not match its seal" in str(rules.seal_problem({**rules.seal(body), "verdict": "fail"}))


def _load(path: Path) -> str:
    with pytest.raises(PublishRefusedError) as got:
        rules.load(path, None, PublishRefusedError)
    return got.value.message


def test_load_refuses_what_is_no_report_each_in_its_words(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    assert _load(path) == f"cannot read report {path}: No such file or directory"
    for doc in ([1], "text", {"schema": "another/1"}, {}):
        path.write_text(json.dumps(rules.seal(doc) if isinstance(doc, dict) else doc))
        assert _load(path) == f"{path} is not a vllm-dflash validation report", doc
    for section in ("profile", "server"):
        path.write_text(json.dumps(rules.seal({**report(), section: [section]})))
        assert _load(path) == f"report {path} lacks its '{section}' section"
    for gates in ("abc", 5, {"gate": "x"}, None):
        path.write_text(json.dumps(rules.seal({**report(), "gates": gates})))
        assert _load(path) == f"report {path} has no list of gates", gates
    path.write_text(json.dumps(rules.seal(report())))
    assert rules.load(path, None, PublishRefusedError).data == rules.seal(report())


def test_a_report_that_measured_nothing_says_why() -> None:
    prof = profile()
    errored = edited(report(prof), lambda d: d.update(verdict="error", error="the server did not start", gates=[]))
    got = verdict.rejudge(errored, prof)
    assert got == verdict.Rejudged(verdict="error", error="the server did not start")
    assert got.reason == "error: the server did not start"
    silent = verdict.rejudge(edited(errored, lambda d: d.pop("error")), prof)
    assert isinstance(silent, verdict.Rejudged) and silent.reason == "error: none recorded"
    failed = verdict.rejudge(report(profile(min_acceptance_length=3.0)), profile(min_acceptance_length=3.0))
    assert isinstance(failed, verdict.Rejudged) and failed.reason == "failed gates ['min_acceptance_length']"


def test_k_of_one_is_a_profile_and_zero_none() -> None:
    """k = 1 (one draft token per draft) is the smallest k a profile states; k = 0, a bool or a float is none."""
    before = scrape(0, 0, 0, {})
    after = scrape(10, 10, 6, {0: 6}, generation_tokens=16)
    data = {
        "verdict": "pass",
        "counters": {"before": before.as_dict(), "after": after.as_dict(), "delta": after.minus(before).as_dict()},
    }
    got = rules.measured_counts(data, 1, "dflash")
    assert isinstance(got, rules.Counts) and got.values["num_accepted_tokens"] == 6
    bad_k: tuple[Any, ...] = (0, -1, True, 1.0)
    for k in bad_k:
        assert rules.measured_counts(data, k, "dflash") == "its profile states no num_speculative_tokens >= 1", k
    assert "exceed 10 drafts x k = 1" in str(rules.measured_counts(edited(data, _more_tokens), 1, "dflash"))


def _more_tokens(d: dict[str, Any]) -> None:
    for where in ("after", "delta"):
        d["counters"][where]["num_draft_tokens"] = 11


@pytest.mark.parametrize(
    ("edit", "relation"),
    [
        # accepted 150 of the delta; 400 generated; 4 requests at k = 3 allow 12 truncated tokens: 161 generated is not
        (lambda d: d.update(generation_tokens=137.0), "relation accepted <= generated + k x requests broken"),
        (lambda d: d.update(prefix_cache_queries=3.0, prefix_cache_hits=4.0), "relation prefix hits <= queries"),
    ],
)
def test_counters_are_checked_against_each_other(edit: Any, relation: str) -> None:
    """Each relation between counters is a rule; `after` is kept before + delta so only the relation breaks."""
    data = report()

    def both(d: dict[str, Any], change: Any = edit) -> None:
        c = d["counters"]
        change(c["delta"])
        for name in rules.COUNTER_NAMES:
            c["after"][name] = c["before"][name] + c["delta"][name]

    assert rules.measurement_problem(data) is None
    assert relation in (rules.measurement_problem(edited(data, both)) or "")
    # the allowance is k x requests, no more: 138 generated + 12 = 150 accepted holds
    fine = edited(data, lambda d: both(d, lambda c: c.update(generation_tokens=138.0)))
    assert rules.measurement_problem(fine) is None


@pytest.mark.parametrize(
    ("edit", "want"),
    [
        (lambda d: d["throughput"].update(output_tokens=-1), "throughput.output_tokens = -1"),
        (lambda d: d["throughput"].update(wall_s=2.0**70), "throughput.wall_s"),
        (lambda d: d["throughput"].update(tokens_per_s="fast"), "throughput.tokens_per_s"),
        (lambda d: d["profile"].update(num_speculative_tokens=10**12), "above 1024"),
    ],
)
def test_other_fields_are_typed_and_bounded(edit: Any, want: str) -> None:
    data = {**report(), "throughput": {"output_tokens": 400, "wall_s": 2.0, "tokens_per_s": 200.0}}
    assert rules.measurement_problem(data) is None
    assert want in (rules.measurement_problem(edited(data, edit)) or "")
