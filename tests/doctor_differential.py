"""TEST-ONLY: the doctor against independent builds (issues 27, 39), shared by tests/test_doctor_differential.py (a
seeded sample that covers every input class) and benchmarks/bench_doctor_differential.py (all generated configs).

Every column of the doctor is its build's own code, run (doctor/sides.py: one code path, the test's readers and the
doctor's are the same), so holding the doctor against those readers would hold it against itself. Instead, this
build's column is held against builds written by others:

- vLLM 0.34.0's own drafter (upstream's implementation of the same windows and causality, V2), and
- dflash 0.1.0's model (the authors' reference),

per config: what refuses, per layer kind / window / causality, and the target layers read. Every disagreement must
be one docs/drafter-config.md names (DEVIATIONS: each a predicate on the config and on what the columns computed);
any other is unexplained. A pair where either side could not build a layer on this CPU machine (an NVFP4 kernel:
the refusal's stage "here") says nothing about the build and is not compared.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from doctor_configs import drafter_configs, input_classes, target_configs
from hypothesis import HealthCheck, given, settings

from vllm_dflash.doctor import checkpoint
from vllm_dflash.doctor import columns as col
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.errors import CheckpointError

SLIDING, FULL = col.SLIDING, col.FULL
TARGET_DEFAULT = "the target model's default aux layers"  # vllm_side's taps_from when the runner fell back

Readings = Mapping[str, col.Reading]


def generated(examples: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(drafter config, target config) pairs, the same on every run (hypothesis derandomized)."""
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(drafter_configs(), target_configs())
    def generate(cfg: dict[str, Any], target: dict[str, Any]) -> None:
        out.append((cfg, target))

    generate()
    return out


def distinct(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    seen: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for cfg, target in pairs:
        seen.setdefault(json.dumps(cfg, sort_keys=True), (cfg, target))
    return list(seen.values())


def sample(
    pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], size: int, seed: int
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """A seeded sample of the distinct configs that covers every input class the pairs cover: greedily the config
    covering most classes not yet covered (ties by the seeded order), then seeded picks up to `size`."""
    pool = distinct(pairs)
    random.Random(seed).shuffle(pool)
    classes = [input_classes(c) for c, _ in pool]
    wanted = set().union(*classes)
    chosen: list[int] = []
    while wanted:
        best = max(range(len(pool)), key=lambda i: len(classes[i] & wanted))
        chosen.append(best)
        wanted -= classes[best]
    rest = [i for i in range(len(pool)) if i not in chosen]
    chosen += rest[: max(0, size - len(chosen))]
    return [pool[i] for i in chosen]


# -- evidence, read from the config and from what the columns computed ------------------------------------------


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


def _shape(r: col.Reading) -> Any:
    """What is compared: whether it builds, and per layer (kind, window, causality)."""
    if r.refusal is not None:
        return ("refuses", r.refusal.stage in ("here",))
    return [(x.kind, x.window, x.causal) for x in r.layers or ()]


def _vllm_agrees(got: Readings) -> bool:
    """Upstream 0.34.0, computed beside this build, did what this build did (the same refusal line, or the same
    layers and aux layers): the difference with the reference is vLLM's, not this build's."""
    ours, up = got[col.OURS], got[col.UPSTREAM]
    if ours.refusal is not None or up.refusal is not None:
        return ours.refusal is not None and up.refusal is not None and ours.refusal.line == up.refusal.line
    return _shape(ours) == _shape(up) and ours.taps == up.taps


def _refused_with(r: col.Reading, *words: str) -> bool:
    return r.refusal is not None and all(w in r.refusal.line for w in words)


def _default_taps(raw: Mapping[str, Any], got: Readings) -> bool:
    """No target_layer_ids: this build's runner fell back to the target model's EAGLE-3 default (vLLM's
    get_eagle3_default_aux_hidden_state_layers), the reference to its build_target_layer_ids, which needs
    num_target_layers (without it the reference refuses)."""
    ours, ref = got[col.OURS], got[col.REFERENCE]
    return ours.taps_from == TARGET_DEFAULT and (ref.refusal is None or _refused_with(ref, "num_target_layers"))


# docs/drafter-config.md's differences, as predicates on the config and the columns' readings: (name, against
# whom, when).
LAYERS, TAPS = "layers", "target layers"  # what a disagreement is about
DEVIATIONS: tuple[tuple[str, str, tuple[str, ...], Callable[[Mapping[str, Any], Readings], bool]], ...] = (
    # both: this build reads back the window transformers dropped (the drafters were trained with it)
    ("window read back from config.json", "both", (LAYERS,), lambda r, g: _window_dropped(r) and _sliding_somewhere(r)),
    # both: a layer kind other than sliding/full is refused by this build; upstream and the reference run it as full
    ("other layer kinds refused", "both", (LAYERS,), lambda r, g: any(k not in (SLIDING, FULL) for k in _kinds(r))),
    # both: top-level-only target_layer_ids refused (the runner reads dflash_config only)
    (
        "top-level-only target_layer_ids refused",
        "both",
        (LAYERS,),
        lambda r, g: "target_layer_ids" in _layer(r) and "target_layer_ids" not in _dflash(r),
    ),
    # upstream: the speculators format's sliding_window_non_causal (0.34.0's update_dflash reads it; this build does
    # not, which the doctor names as a field that changes the computation, exit 22)
    ("speculators sliding_window_non_causal", "upstream", (LAYERS,), lambda r, g: "sliding_window_non_causal" in r),
    # upstream: DFlash2 and the other architectures only later releases register
    (
        "architectures only upstream registers",
        "upstream",
        (LAYERS,),
        lambda r, g: (
            not any(a == "DFlashDraftModel" for a in (_layer(r).get("architectures") or []))
            and "speculators_model_type" not in r
        ),
    ),
    # reference: dflash_config.use_swa / swa_window_size / causal are upstream's spellings the reference ignores
    (
        "dflash_config spellings the reference ignores",
        "reference",
        (LAYERS,),
        lambda r, g: any(k in _dflash(r) for k in ("use_swa", "swa_window_size", "causal")),
    ),
    # reference: the speculators format is no reference format
    ("speculators format", "reference", (LAYERS, TAPS), lambda r, g: "speculators_model_type" in r),
    # reference: it loads with transformers 5.15 and its own Qwen3Config whatever model_type says (llama included)
    (
        "reference loading (transformers 5.15, Qwen3Config)",
        "reference",
        (LAYERS, TAPS),
        lambda r, g: _layer(r).get("model_type") != "qwen3",
    ),
    # reference: every vLLM release takes a nested text_config as the model's text config (get_hf_text_config) and
    # refuses one without the attention sizes; transformers' Qwen3Config, the reference's, ignores it
    (
        "nested text_config is vLLM's text config",
        "reference",
        (LAYERS,),
        lambda r, g: "text_config" in _layer(r) and _refused_with(g[col.OURS], "text_config") and _vllm_agrees(g),
    ),
    # reference: vLLM's DFlash model reads eagle_config as a dict (qwen3_dflash.py: eagle_config.update(dflash_config));
    # the reference never reads eagle_config
    (
        "eagle_config not an object refused by vLLM",
        "reference",
        (LAYERS,),
        lambda r, g: (
            "eagle_config" in _layer(r)
            and not isinstance(_layer(r)["eagle_config"], Mapping)
            and _refused_with(g[col.OURS], "object has no attribute")
            and _vllm_agrees(g)
        ),
    ),
    # reference: no target_layer_ids -- vLLM taps the target model's EAGLE-3 default, the reference its own
    # build_target_layer_ids (from num_target_layers; refused without it)
    (
        "default taps without target_layer_ids",
        "reference",
        (LAYERS, TAPS),
        lambda r, g: _default_taps(r, g) and _vllm_agrees(g),
    ),
)


def explained(raw: Mapping[str, Any], got: Readings, against: str, aspect: str) -> list[str]:
    """The deviations that explain a disagreement about `aspect` with `against` on this config."""
    return [
        name
        for name, who, aspects, when in DEVIATIONS
        if who in (against, "both") and aspect in aspects and when(raw, got)
    ]


def _taps_as_outputs(r: col.Reading, reference: bool) -> Any:
    if r.refusal is not None or r.taps is None:
        return None
    return list(r.taps) if reference else [t - 1 if _number(t) else t for t in r.taps]


def _number(t: Any) -> bool:
    return isinstance(t, int | float) and not isinstance(t, bool)


def _not_built_here(r: col.Reading) -> bool:
    return r.refusal is not None and r.refusal.stage in ("unavailable", "here")


def compare(raw: Mapping[str, Any], got: Readings) -> list[tuple[str, str, list[str]]]:
    """Each disagreement of this build with an independent build: (against, what, deviations that explain it)."""
    ours = got[col.OURS]
    out = []
    for against, build in (("upstream", col.UPSTREAM), ("reference", col.REFERENCE)):
        other = got[build]
        if _not_built_here(other) or _not_built_here(ours):
            continue
        a, b = _shape(ours), _shape(other)
        if a != b:
            out.append((against, f"layers: this build {a}, {build} {b}", explained(raw, got, against, LAYERS)))
        if ours.refusal is None and other.refusal is None:  # the taps too, whatever the layers did
            t_ours = _taps_as_outputs(ours, False)
            t_other = _taps_as_outputs(other, build == col.REFERENCE)
            if t_ours is not None and t_other is not None and t_ours != t_other:
                what = f"target layers: this build {t_ours}, {build} {t_other}"
                out.append((against, what, explained(raw, got, against, TAPS)))
    return out


def comparable(got: Readings) -> int:
    """How many of this config's two pairs were compared (not a column that cannot build here)."""
    ours = got[col.OURS]
    return sum(not (_not_built_here(got[b]) or _not_built_here(ours)) for b in (col.UPSTREAM, col.REFERENCE))


@dataclass
class Figures:
    generated: int
    configs: list[dict[str, Any]]
    readings: list[dict[str, col.Reading]] = field(default_factory=list)
    pairs: int = 0
    not_comparable: int = 0
    disagreements: Counter[str] = field(default_factory=Counter)
    unexplained: list[str] = field(default_factory=list)
    codes: Counter[int] = field(default_factory=Counter)
    classes: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def line(self) -> str:
        return (
            f"differential: {len(self.configs)} distinct configs (of {self.generated} generated), {len(col.BUILDS)} "
            f"columns each computed by its own code; this build compared with upstream 0.34.0 and the reference on "
            f"{self.pairs} column pairs ({self.not_comparable} more not comparable: a layer no CPU builds): "
            f"{sum(self.disagreements.values())} disagreements explained by a deviation docs/drafter-config.md names "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.disagreements.items()))}), {len(self.unexplained)} "
            f"unexplained; exit codes {dict(sorted(self.codes.items()))}; {len(self.classes)} input classes; "
            f"{self.seconds:.0f} s"
        )


def run(
    doctor: Any, pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], generated_count: int, with_targets: int = 40
) -> Figures:
    """Every config through every column (one batch per column), compared; the doctor's verdict on each (never a
    raise, always one of its exit codes), and on the first `with_targets` with a target beside them."""
    import time

    started = time.monotonic()
    configs = [c for c, _ in pairs]
    fig = Figures(generated_count, configs)
    reads = doctor.read(configs)
    for raw, got in zip(configs, reads, strict=True):
        fig.readings.append(dict(got.readings))
        ck = checkpoint.Checkpoint("generated", raw, speculators="speculators_model_type" in raw)
        d = D.diagnose(ck, got.readings, measured=got.measured)
        assert d.exit_code in D.EXIT_CODES.values() and f"(exit {d.exit_code})" in D.render_text(d)
        fig.codes[d.exit_code] += 1
        n = comparable(got.readings)
        fig.pairs += n
        fig.not_comparable += 2 - n
        for against, what, why in compare(raw, got.readings):
            if why:
                fig.disagreements[f"{against}: {why[0]}"] += 1
            else:
                fig.unexplained.append(f"{json.dumps(raw)}: {what}")
    # the doctor with a target beside the drafter (its layer count at the top level, in text_config, or odd)
    for (cfg, target), got in list(zip(pairs, reads, strict=True))[:with_targets]:
        try:
            t = checkpoint.target_from_config(target, "generated")
        except CheckpointError as exc:
            assert exc.one_line().startswith("error: ")
            continue
        ck = checkpoint.Checkpoint("generated", cfg, speculators="speculators_model_type" in cfg)
        D.render_text(D.diagnose(ck, got.readings, t.layers, t.source, t.architectures, got.measured))
    fig.classes = Counter(c for raw in configs for c in input_classes(raw))
    fig.seconds = time.monotonic() - started
    return fig
