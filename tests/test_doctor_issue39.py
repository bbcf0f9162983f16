"""Issue 39's classes, each a config the doctor once got wrong (tests/doctor_issue39.py holds them, with the verdict
due), read here through every column's own code. `python benchmarks/doctor_regressions.py --checkout DIR` runs the
same configs through another checkout's `vllm-dflash doctor` (docs/doctor.md has the figures for the commit before
issue 39: each class that failed there)."""

from __future__ import annotations

from typing import Any

import pytest
from doctor_issue39 import CASES, Case

from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def diagnoses(doctor: Any) -> dict[str, D.Diagnosis]:
    """Every case in one batch per column."""
    configs = [c.config() for c in CASES]
    reads = doctor.read(configs)
    return {
        c.name: D.diagnose(
            Checkpoint(c.name, cfg, speculators="speculators_model_type" in cfg), r.readings, measured=r.measured
        )
        for c, cfg, r in zip(CASES, configs, reads, strict=True)
    }


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_class_gets_its_verdict(case: Case, diagnoses: dict[str, D.Diagnosis]) -> None:
    d = diagnoses[case.name]
    text = D.render_text(d)
    assert d.exit_code == case.exit, text[-1500:]
    assert f"(exit {case.exit})" in text
    for words in case.says:
        assert words in text, (words, text[-1500:])
