"""Issue 39's classes, each a config the doctor once got wrong (tests/doctor_issue39.py holds them, with the verdict
due), read here through every column's own code. `python benchmarks/doctor_regressions.py --checkout DIR` runs the
same configs through another checkout's `vllm-dflash doctor` (docs/doctor.md has the figures for the commit before
issue 39: each class that failed there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from doctor_issue39 import CASES, Case

from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import fields as F
from vllm_dflash.doctor.checkpoint import Checkpoint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reads(doctor: Any) -> dict[str, Any]:
    """Every case in one batch per column."""
    return dict(zip([c.name for c in CASES], doctor.read([c.config() for c in CASES]), strict=True))


@pytest.fixture(scope="module")
def diagnoses(reads: dict[str, Any]) -> dict[str, D.Diagnosis]:
    out = {}
    for c in CASES:
        cfg = c.config()
        ck = Checkpoint(c.name, cfg, speculators="speculators_model_type" in cfg)
        out[c.name] = D.diagnose(ck, reads[c.name].readings, measured=reads[c.name].measured)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_class_gets_its_verdict(case: Case, diagnoses: dict[str, D.Diagnosis]) -> None:
    d = diagnoses[case.name]
    text = D.render_text(d)
    assert d.exit_code == case.exit, text[-1500:]
    assert f"(exit {case.exit})" in text
    for words in case.says:
        assert words in text, (words, text[-1500:])


def fields_table(reads: dict[str, Any], diagnoses: dict[str, D.Diagnosis]) -> str:
    rows = []
    for c in CASES:
        measured = reads[c.name].measured
        for path, m in measured.items():
            layer = c.config()
            value: Any = layer
            for part in path.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            shown = value.get("quant_algo") or value.get("format") if isinstance(value, dict) else json.dumps(value)
            rows.append((path, str(shown), m, diagnoses[c.name].exit_code))
    return F.render_fields_table(rows)


def test_docs_fields_table_is_the_doctors_output(reads: dict[str, Any], diagnoses: dict[str, D.Diagnosis]) -> None:
    """docs/doctor.md's table of 2026's fields is what the doctor measured on the cases (a verdict computed, never
    written by hand); an edited cell fails."""
    page = (REPO / "docs" / "doctor.md").read_text()
    table = fields_table(reads, diagnoses)
    start, end = page.find(F.FIELDS_BEGIN), page.find(F.FIELDS_END)
    assert start >= 0 and end > start, "docs/doctor.md has no fields-table markers"
    assert page[start : end + len(F.FIELDS_END)] == table, "docs/doctor.md's fields table is stale:\n" + table
    assert "| `is_neox_style` = `false` |" in table and table.count("| 22 |") >= 5
