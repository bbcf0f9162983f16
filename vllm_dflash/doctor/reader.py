"""The doctor's one code path from a checkpoint to its diagnosis: each column's code run on the config (sides.py),
each 2026 field measured by building the drafter without it (fields.ablations / fields.measure), then diagnose().
`vllm-dflash doctor`, `--table`, `--prove`, `--context` and the tests all read drafters through `Doctor`.

    Doctor(sides).read(configs, target=None, serve=None) -> [Read]     (one batch per column, answers cached)
    Doctor(sides).diagnose(checkpoint, target_layers=None, ...) -> Diagnosis
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dflash.doctor import columns as col
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import fields as F
from vllm_dflash.doctor.checkpoint import Checkpoint
from vllm_dflash.doctor.sides import Column, Sides, Unavailable


@dataclass(frozen=True)
class Read:
    """One config through every column: each build's reading, and each 2026 field's measured effect."""

    readings: dict[str, col.Reading]
    measured: dict[str, F.Measured]
    answers: Mapping[str, Mapping[str, Any]]


class Doctor:
    def __init__(self, sides: Sides) -> None:
        self.sides = sides

    @property
    def how(self) -> dict[str, str]:
        return {
            b: (c.how if isinstance(c, Column) else f"not computed: {c.why}") for b, c in self.sides.columns.items()
        }

    def read(
        self,
        configs: Sequence[Mapping[str, Any]],
        target: Mapping[str, Any] | None = None,
        serve: Mapping[str, Any] | None = None,
    ) -> list[Read]:
        """Every config (and, for each 2026 field it carries, the config without it) through every column, one
        batch per column."""
        requests: list[dict[str, Any]] = []
        spans: list[tuple[int, list[str], bool]] = []
        for raw in configs:
            start = len(requests)
            requests.append({"config": dict(raw), "target": target, "serve": dict(serve or {})})
            pairs = F.ablations(raw)
            for _path, variant in pairs:
                requests.append({"config": variant, "target": target, "serve": {}})
            fixed = F.repaired(raw) if pairs else None
            if fixed is not None:  # the same pairs on the config as this build reads its window
                requests.append({"config": fixed, "target": target, "serve": {}})
                requests += [{"config": v, "target": target, "serve": {}} for _p, v in F.ablations(fixed)]
            spans.append((start, [p for p, _ in pairs], fixed is not None))
        answers = self.sides.ask(requests)
        how = self.how
        out = []
        for start, paths, has_fixed in spans:
            main = {b: a[start] for b, a in answers.items()}
            readings = col.readings(main, how)
            for build, c in self.sides.columns.items():
                if isinstance(c, Unavailable):
                    readings[build] = col.unavailable(build, c.why)
            n = len(paths)
            variants = {p: {b: a[start + 1 + j] for b, a in answers.items()} for j, p in enumerate(paths)}
            rep_main, rep_variants = None, None
            if has_fixed:
                at = start + 1 + n
                rep_main = {b: a[at] for b, a in answers.items()}
                rep_variants = {p: {b: a[at + 1 + j] for b, a in answers.items()} for j, p in enumerate(paths)}
            out.append(Read(readings, F.measure(main, variants, rep_main, rep_variants), main))
        return out

    def diagnose(
        self,
        ck: Checkpoint,
        target_layers: int | None = None,
        target_from: str = "",
        target_architectures: tuple[str, ...] = (),
        target: Mapping[str, Any] | None = None,
        serve: Mapping[str, Any] | None = None,
    ) -> D.Diagnosis:
        got = self.read([ck.config], target, serve)[0]
        return D.diagnose(ck, got.readings, target_layers, target_from, target_architectures, got.measured)

    def diagnose_many(
        self, cks: Sequence[Checkpoint], target_layers: int | None = None, target_from: str = ""
    ) -> list[D.Diagnosis]:
        reads = self.read([ck.config for ck in cks])
        return [
            D.diagnose(ck, r.readings, target_layers, target_from, (), r.measured)
            for ck, r in zip(cks, reads, strict=True)
        ]
