"""What `validate` prints: the summary table, per-position acceptance bars, the side-by-side table and the gates."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any


def render(report: Mapping[str, Any], console: Any = None) -> None:
    """Summary table, per-position acceptance bars, and the gates."""
    from rich.console import Console
    from rich.table import Table

    # Not a terminal (CI logs, pytest): rich would wrap at 80 columns and cut the artifact names.
    console = console or Console(stderr=False, width=None if sys.stdout.isatty() else 140)
    server = report.get("server") or {}
    artifact = server.get("artifact") or {}
    counters = (report.get("counters") or {}).get("delta") or {}
    acc = report.get("acceptance") or {}
    base = report.get("baseline") or {}
    summary = Table(title=f"validation: profile {report['profile']['name']}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    rows: list[tuple[str, Any]] = [
        ("server", f"{server.get('mode')} {server.get('base_url', '')}"),
        ("vLLM", server.get("vllm_version")),
        ("artifact", f"{artifact.get('name')} {str(artifact.get('sha256') or '')[:19]} ({artifact.get('binding')})"),
        ("thinking", report["sampling"]["thinking"]),
        ("prompts", f"{report['prompts']['set']} x {report['prompts']['count']}"),
        ("drafts", _count(counters.get("num_drafts"))),
        ("draft tokens", _count(counters.get("num_draft_tokens"))),
        ("accepted tokens", _count(counters.get("num_accepted_tokens"))),
        ("mean acceptance length", _fmt(acc.get("mean_acceptance_length"))),
        ("draft acceptance rate", _fmt(acc.get("draft_acceptance_rate"))),
        ("draft tokens per draft", _draft_fill(acc)),
        ("serving", _serving(report.get("serving") or {})),
        ("speedup vs no-spec", _fmt(base.get("speedup"))),
        ("lossless match rate", _fmt(base.get("lossless_match_rate"))),
    ]
    if report.get("exploratory"):
        rows.append(("publishable", f"no, exploratory: {report['exploratory']}"))
    for key, value in rows:
        summary.add_row(key, "-" if value is None else str(value))
    console.print(summary)
    rates = acc.get("per_position_acceptance_rate") or []
    if rates:
        chart = Table(title="acceptance rate per draft position", show_header=True)
        chart.add_column("pos", justify="right")
        chart.add_column("rate", justify="right")
        chart.add_column("")
        for pos, rate in enumerate(rates):
            bar = "█" * round(rate * 40)
            chart.add_row(str(pos), f"{rate:.3f}", f"[green]{bar}[/green]")
        console.print(chart)
    side = side_by_side(report)
    if side:
        table = Table(title="mean acceptance length, same prompts and max tokens")
        for col in ("what", "artifact", "AL", "drafts", "accepted", "per-prompt median", "lossless"):
            table.add_column(col)
        for row in side:
            table.add_row(*[_fmt(v) for v in row])
        console.print(table)
    gates = Table(title=f"verdict: {report['verdict'].upper()}")
    for col in ("gate", "value", "threshold", "result"):
        gates.add_column(col)
    for g in report.get("gates", []):
        result = "[green]PASS[/green]" if g["passed"] else "[red]FAIL[/red]"
        gates.add_row(g["gate"], _fmt(g["value"]), _fmt(g["threshold"]), result)
    console.print(gates)


def side_by_side(report: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """Rows (what, artifact, AL, drafts, accepted, per-prompt median, lossless) for the validated build, each
    comparison and the reference loop; empty when the report has neither comparisons nor a reference."""
    import statistics

    comparisons = report.get("comparisons") or {}
    ref = report.get("reference")
    if not comparisons and not ref:
        return []
    per_prompt = report.get("per_prompt") or []

    def median(key: str) -> float | None:
        vals = [r[key] for r in per_prompt if isinstance(r.get(key), int | float)]
        return statistics.median(vals) if vals else None

    def lossless(entry: Mapping[str, Any] | None) -> str:
        return "-" if not entry else f"{entry['matches']}/{report['prompts']['count']}"

    rows: list[tuple[Any, ...]] = []
    for name, comp in comparisons.items():
        c = comp.get("counters") or {}
        art = ((comp.get("server") or {}).get("artifact") or {}).get("name")
        rows.append(
            (name, art, (comp.get("acceptance") or {}).get("mean_acceptance_length"), _count(c.get("num_drafts")),
             _count(c.get("num_accepted_tokens")), median(f"al_{name}"), lossless(comp.get("lossless_vs_reference")))
        )  # fmt: skip
    mine = report.get("counters", {}).get("delta") or {}
    art = ((report.get("server") or {}).get("artifact") or {}).get("name")
    al = (report.get("acceptance") or {}).get("mean_acceptance_length")
    rows.append(
        ("validated", art, al, _count(mine.get("num_drafts")), _count(mine.get("num_accepted_tokens")), median("al"),
         lossless(report.get("lossless_vs_reference")))
    )  # fmt: skip
    if ref:
        rc = ref.get("counters") or {}
        rows.append(
            ("reference loop", "dflash 0.1.0", ref.get("acceptance_length"), rc.get("num_drafts"),
             rc.get("num_accepted_tokens"), median("al_reference"), "= target greedy")
        )  # fmt: skip
    return rows


def _draft_fill(acc: Mapping[str, Any]) -> str | None:
    mean, k = acc.get("mean_draft_tokens_per_draft"), acc.get("num_speculative_tokens")
    if not isinstance(mean, int | float) or not k:
        return None
    return f"{mean:.2f} of k = {k}" + ("" if mean >= k else " (vLLM cut the drafts)")


def _serving(s: Mapping[str, Any]) -> str | None:
    """The serving conditions in one cell ('default': vLLM's own, the flag was not given)."""
    if not s:
        return None

    def v(key: str) -> str:
        value = s.get(key)
        return "default" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    return (
        f"max_num_seqs {v('max_num_seqs')}, concurrency {v('concurrency')}, batched tokens "
        f"{v('max_num_batched_tokens')}, chunked prefill {v('chunked_prefill')}, prefix caching "
        f"{v('prefix_caching')}, TP {v('tensor_parallel_size')}, dtype {v('dtype')}"
    )


def _count(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)
