"""The doctor against independent builds (issues 27, 39). Every column of the doctor is its build's own code, run
(doctor/sides.py: one code path, the test's readers and the doctor's are the same), so holding the doctor against
those readers would hold it against itself. Instead, this build's column is held against builds written by others:

- vLLM 0.34.0's own drafter (upstream's implementation of the same windows and causality, V2), and
- dflash 0.1.0's model (the authors' reference),

per config: what refuses, per layer kind / window / causality, and the target layers read. Every disagreement must
be one docs/drafter-config.md names (DEVIATIONS: where this build deliberately reads a config otherwise, each a
predicate on the config); any other fails the test. Hypothesis generates the configs over the spelling space, issue
39's classes and 2026's fields included (tests/doctor_configs.py); the doctor must also never raise on them, and give
one of its exit codes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from doctor_configs import drafter_configs, input_classes, target_configs
from hypothesis import HealthCheck, given, settings

from vllm_dflash.doctor import checkpoint
from vllm_dflash.doctor import columns as col
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.errors import CheckpointError

EXAMPLES = 300
SLIDING, FULL = col.SLIDING, col.FULL


def _layer(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    inner = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    return inner if isinstance(inner, Mapping) else {}


def _dflash(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    d = _layer(raw).get("dflash_config")
    return d if isinstance(d, Mapping) else {}


def _kinds(raw: Mapping[str, Any]) -> list[Any]:
    kinds = _layer(raw).get("layer_types")
    return list(kinds) if isinstance(kinds, list) else []


def _window_dropped(raw: Mapping[str, Any]) -> bool:
    """A top-level window transformers drops (no use_sliding_window) that this build reads back from config.json."""
    layer = _layer(raw)
    return layer.get("sliding_window") is not None and layer.get("use_sliding_window") is not True


def _sliding_somewhere(raw: Mapping[str, Any]) -> bool:
    return SLIDING in _kinds(raw) or _dflash(raw).get("use_swa") is True


# docs/drafter-config.md's deliberate differences, as predicates on the config: (name, against whom, when).
DEVIATIONS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], bool]], ...] = (
    # both: this build reads back the window transformers dropped (the drafters were trained with it)
    ("window read back from config.json", "both", lambda r: _window_dropped(r) and _sliding_somewhere(r)),
    # both: a layer kind other than sliding/full is refused by this build; upstream and the reference run it as full
    ("other layer kinds refused", "both", lambda r: any(k not in (SLIDING, FULL) for k in _kinds(r))),
    # both: top-level-only target_layer_ids refused (the runner reads dflash_config only)
    (
        "top-level-only target_layer_ids refused",
        "both",
        lambda r: "target_layer_ids" in _layer(r) and "target_layer_ids" not in _dflash(r),
    ),
    # upstream: the speculators format's sliding_window_non_causal (0.34.0's update_dflash reads it; this build does
    # not, which the doctor names as a field that changes the computation, exit 22)
    ("speculators sliding_window_non_causal", "upstream", lambda r: "sliding_window_non_causal" in r),
    # upstream: DFlash2 and the other architectures only later releases register
    (
        "architectures only upstream registers",
        "upstream",
        lambda r: (
            not any(a == "DFlashDraftModel" for a in (_layer(r).get("architectures") or []))
            and "speculators_model_type" not in r
        ),
    ),
    # reference: dflash_config.use_swa / swa_window_size / causal are upstream's spellings the reference ignores
    ("dflash_config spellings the reference ignores", "reference", lambda r: bool(_dflash(r))),
    # reference: the speculators format is no reference format
    ("speculators format", "reference", lambda r: "speculators_model_type" in r),
    # reference: it loads with transformers 5.15 and its own Qwen3Config whatever model_type says (llama included)
    (
        "reference loading (transformers 5.15, Qwen3Config)",
        "reference",
        lambda r: _layer(r).get("model_type") != "qwen3",
    ),
)


def explained(raw: Mapping[str, Any], against: str) -> list[str]:
    return [name for name, who, when in DEVIATIONS if who in (against, "both") and when(raw)]


def _shape(r: col.Reading) -> Any:
    """What is compared: whether it builds, and per layer (kind, window, causality)."""
    if r.refusal is not None:
        return ("refuses", r.refusal.stage in ("here",))
    return [(x.kind, x.window, x.causal) for x in r.layers or ()]


def _taps_as_outputs(r: col.Reading, reference: bool) -> Any:
    if r.refusal is not None or r.taps is None:
        return None
    return list(r.taps) if reference else [t - 1 for t in r.taps if isinstance(t, int)]


def compare(raw: Mapping[str, Any], readings: Mapping[str, col.Reading]) -> list[tuple[str, str, list[str]]]:
    """Each disagreement of this build with an independent build: (against, what, deviations that explain it)."""
    ours = readings[col.OURS]
    out = []
    for against, build in (("upstream", col.UPSTREAM), ("reference", col.REFERENCE)):
        other = readings[build]
        if other.refusal is not None and other.refusal.stage == "unavailable":
            continue
        why = explained(raw, against)
        a, b = _shape(ours), _shape(other)
        if a != b:
            out.append((against, f"layers: this build {a}, {build} {b}", why))
        elif ours.refusal is None and other.refusal is None:
            t_ours = _taps_as_outputs(ours, False)
            t_other = _taps_as_outputs(other, build == col.REFERENCE)
            if t_ours is not None and t_other is not None and t_ours != t_other:
                out.append((against, f"target layers: this build {t_ours}, {build} {t_other}", why))
    return out


@pytest.mark.heavy
def test_this_build_against_upstream_and_the_reference(doctor: Any) -> None:
    configs: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(drafter_configs(), target_configs())
    def generate(cfg: dict[str, Any], target: dict[str, Any]) -> None:
        configs.append(cfg)
        targets.append(target)

    generate()
    unique = list({json.dumps(c, sort_keys=True): c for c in configs}.values())
    reads = doctor.read(unique)
    disagreements: Counter[str] = Counter()
    unexplained: list[str] = []
    compared = 0
    codes: Counter[int] = Counter()
    for raw, got in zip(unique, reads, strict=True):
        ck = checkpoint.Checkpoint("generated", raw, speculators="speculators_model_type" in raw)
        d = D.diagnose(ck, got.readings, measured=got.measured)  # never raises, one of its codes
        assert d.exit_code in D.EXIT_CODES.values() and f"(exit {d.exit_code})" in D.render_text(d)
        codes[d.exit_code] += 1
        compared += 2
        for against, what, why in compare(raw, got.readings):
            if why:
                disagreements[f"{against}: {why[0]}"] += 1
            else:
                unexplained.append(f"{json.dumps(raw)}: {what}")
    # the doctor with a target beside the drafter (its layer count at the top level, in text_config, or odd)
    for cfg, target in list(zip(configs, targets, strict=True))[:40]:
        try:
            t = checkpoint.target_from_config(target, "generated")
        except CheckpointError as exc:
            assert exc.one_line().startswith("error: ")
            continue
        got = doctor.read([cfg])[0]
        ck = checkpoint.Checkpoint("generated", cfg, speculators="speculators_model_type" in cfg)
        D.render_text(D.diagnose(ck, got.readings, t.layers, t.source, t.architectures, got.measured))
    classes = Counter(c for raw in unique for c in input_classes(raw))
    print(
        f"differential: {len(configs)} configs generated ({len(unique)} distinct), {len(col.BUILDS)} columns each "
        f"computed by its own code; this build compared with upstream 0.34.0 and the reference on {compared} "
        f"column pairs: {sum(disagreements.values())} disagreements, every one a deviation docs/drafter-config.md "
        f"names ({', '.join(f'{k} {v}' for k, v in sorted(disagreements.items()))}), {len(unexplained)} unexplained; "
        f"exit codes {dict(sorted(codes.items()))}; {len(classes)} input classes: "
        + ", ".join(f"{k} {v}" for k, v in sorted(classes.items()))
    )
    assert not unexplained, "\n".join(unexplained[:20])
    assert len(classes) >= 35


def test_the_comparison_catches_an_unexplained_difference() -> None:
    """Negative control: a layer whose window differs from upstream's, or target layers one off, with no deviation
    that explains it, is reported; the same difference on a config a deviation covers is explained."""
    layer = col.Layer(SLIDING, 8, True, "", "", "")
    full = col.Layer(FULL, None, False, "", "", "")

    def reading(build: str, layers: tuple[col.Layer, ...], taps: list[int]) -> col.Reading:
        return col.Reading(build, layers, None, taps)

    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "layer_types": [SLIDING, FULL]}
    same = {
        col.OURS: reading(col.OURS, (layer, full), [2, 6]),
        col.UPSTREAM: reading(col.UPSTREAM, (layer, full), [2, 6]),
        col.REFERENCE: reading(col.REFERENCE, (layer, full), [1, 5]),
    }
    assert compare(raw, same) == []
    wider = {**same, col.UPSTREAM: reading(col.UPSTREAM, (col.Layer(SLIDING, 9, True, "", "", ""), full), [2, 6])}
    assert [w for _, _, w in compare(raw, wider)] == [[]]
    early = {**same, col.REFERENCE: reading(col.REFERENCE, (layer, full), [0, 4])}
    assert [a for a, _, w in compare(raw, early) if not w] == ["reference"]
    dropped = {**raw, "sliding_window": 8}  # the window transformers drops: a named deviation
    assert all(w == ["window read back from config.json"] for _, _, w in compare(dropped, wider))
