"""The doctor against independent builds (issues 27, 39): this build's column held against vLLM 0.34.0's and dflash
0.1.0's, each computed by its own code (tests/doctor_differential.py says how, and what counts as explained).

The heavy test reads a seeded sample of the generated configs that covers every input class the generator makes
(issue 39's classes and 2026's fields included); benchmarks/bench_doctor_differential.py reads all of them. The quick
tests are the comparison's negative controls: a difference no deviation explains is reported, and each deviation's
evidence is what the columns computed, so the same difference with that evidence taken away is unexplained.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import doctor_differential as DD
import pytest
from doctor_configs import input_classes

from vllm_dflash.doctor import columns as col

GENERATED = 300  # what the generator makes; the benchmark reads all of them
SAMPLE = 60  # the heavy test's configs: every input class at least once, then seeded picks
SEED = 39
SLIDING, FULL = col.SLIDING, col.FULL


@pytest.mark.heavy
def test_this_build_against_upstream_and_the_reference(doctor: Any) -> None:
    pairs = DD.generated(GENERATED)
    picked = DD.sample(pairs, SAMPLE, SEED)
    every = {c for cfg, _ in pairs for c in input_classes(cfg)}
    fig = DD.run(doctor, picked, len(pairs))
    print(fig.line())
    assert set(fig.classes) == every >= ISSUE39  # the sample covers every class generated, issue 39's among them
    assert not fig.unexplained, "\n".join(fig.unexplained[:20])
    assert fig.pairs >= SAMPLE  # most pairs compared, not skipped as not built here
    # Negative control on the real readings: this build's column mutated to read every DFlash id one layer early
    # (stock 0.20.1's bug) must show as unexplained disagreements wherever an independent build served it too.
    caught = 0
    for raw, got in zip(fig.configs, fig.readings, strict=True):
        ours = got[col.OURS]
        if ours.refusal is not None or not ours.taps or ours.taps_from == DD.TARGET_DEFAULT:
            continue
        early = dataclasses.replace(ours, taps=[t - 1 if DD._number(t) else t for t in ours.taps])
        caught += any(not why for _, _, why in DD.compare(raw, {**got, col.OURS: early}))
    print(f"negative control: this build's column read one layer early is caught on {caught} configs")
    assert caught >= 3, f"a column mutated one layer early was caught on {caught} configs"


def _reading(build: str, layers: tuple[col.Layer, ...] | None, taps: list[int] | None, **kw: Any) -> col.Reading:
    return col.Reading(build, layers, kw.pop("refusal", None), taps, **kw)


LAYER = col.Layer(SLIDING, 8, True, "", "", "")
FULL_LAYER = col.Layer(FULL, None, False, "", "", "")
RAW = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "layer_types": [SLIDING, FULL]}


def test_the_comparison_catches_an_unexplained_difference() -> None:
    """Negative control: a layer whose window differs from upstream's, or target layers one off, with no deviation
    that explains it, is reported; the same difference on a config a deviation covers is explained."""
    same = {
        col.OURS: _reading(col.OURS, (LAYER, FULL_LAYER), [2, 6]),
        col.UPSTREAM: _reading(col.UPSTREAM, (LAYER, FULL_LAYER), [2, 6]),
        col.REFERENCE: _reading(col.REFERENCE, (LAYER, FULL_LAYER), [1, 5]),
    }
    assert DD.compare(RAW, same) == []
    wider = {
        **same,
        col.UPSTREAM: _reading(col.UPSTREAM, (col.Layer(SLIDING, 9, True, "", "", ""), FULL_LAYER), [2, 6]),
    }
    assert [w for _, _, w in DD.compare(RAW, wider)] == [[]]
    early = {**same, col.REFERENCE: _reading(col.REFERENCE, (LAYER, FULL_LAYER), [0, 4])}
    assert [a for a, _, w in DD.compare(RAW, early) if not w] == ["reference"]
    dropped = {**RAW, "sliding_window": 8}  # the window transformers drops: a named deviation
    assert all(w == ["window read back from config.json"] for _, _, w in DD.compare(dropped, wider))


def test_a_pair_not_built_here_is_not_compared() -> None:
    """An NVFP4 drafter upstream 0.34.0 cannot build on a CPU (no kernel): no statement about the release, so no
    disagreement; the same refusal at the "model" stage (the release's own code refused) is one."""
    line = "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer."
    ours = _reading(col.OURS, (LAYER, FULL_LAYER), [2, 6])
    ref = _reading(col.REFERENCE, (LAYER, FULL_LAYER), [1, 5])
    here = _reading(col.UPSTREAM, None, None, refusal=col.Refusal(line, "", "here"))
    got = {col.OURS: ours, col.UPSTREAM: here, col.REFERENCE: ref}
    assert DD.compare(RAW, got) == [] and DD.comparable(got) == 1
    refused = {**got, col.UPSTREAM: _reading(col.UPSTREAM, None, None, refusal=col.Refusal(line, "", "model"))}
    assert [a for a, _, w in DD.compare(RAW, refused) if not w] == ["upstream"]


def test_the_default_taps_deviation_needs_the_runner_to_have_fallen_back() -> None:
    """No target_layer_ids: vLLM taps the target model's EAGLE-3 default (outputs 1, 31, 60 of 64 layers), the
    reference its build_target_layer_ids (1, 31, 61 for 3 drafter layers). Explained only where this build's column
    says its runner fell back and upstream 0.34.0 computed the same; otherwise reported."""
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_target_layers": 64}
    fell = _reading(col.OURS, (FULL_LAYER,) * 3, [2, 32, 61], taps_from=DD.TARGET_DEFAULT)
    got = {
        col.OURS: fell,
        col.UPSTREAM: _reading(col.UPSTREAM, (FULL_LAYER,) * 3, [2, 32, 61], taps_from=DD.TARGET_DEFAULT),
        col.REFERENCE: _reading(col.REFERENCE, (FULL_LAYER,) * 3, [1, 31, 61]),
    }
    assert [w for _, _, w in DD.compare(raw, got)] == [["default taps without target_layer_ids"]]
    from_config = {**got, col.OURS: dataclasses.replace(fell, taps_from="V1 gpu_model_runner")}
    assert [w for _, _, w in DD.compare(raw, from_config)] == [[]]
    upstream_differs = {**got, col.UPSTREAM: dataclasses.replace(got[col.UPSTREAM], taps=[2, 32, 62])}
    assert [w for a, _, w in DD.compare(raw, upstream_differs) if a == "reference"] == [[]]


def test_the_text_config_deviation_needs_vllm_to_refuse_it_alike() -> None:
    """A nested text_config: every vLLM release refuses it at load (get_hf_text_config), the reference ignores it.
    Explained only where this build's refusal names text_config and upstream refused with the same line."""
    raw = {**RAW, "text_config": {"model_type": "qwen3", "sliding_window": 8}}
    line = "ValidationError: The text_config extracted from the model config does not have `num_attention_heads`"
    refused = col.Refusal(line, "", "load")
    got = {
        col.OURS: _reading(col.OURS, None, None, refusal=refused),
        col.UPSTREAM: _reading(col.UPSTREAM, None, None, refusal=refused),
        col.REFERENCE: _reading(col.REFERENCE, (FULL_LAYER, FULL_LAYER), [1, 5]),
    }
    assert [w for _, _, w in DD.compare(raw, got)] == [["nested text_config is vLLM's text config"]]
    served_upstream = {**got, col.UPSTREAM: _reading(col.UPSTREAM, (FULL_LAYER, FULL_LAYER), [2, 6])}
    assert [w for a, _, w in DD.compare(raw, served_upstream) if a == "reference"] == [[]]
    other = {**got, col.OURS: _reading(col.OURS, None, None, refusal=col.Refusal("ValueError: x", "", "load"))}
    assert [w for a, _, w in DD.compare(raw, other) if a == "reference"] == [[]]


# issue 39's classes: each must be generated, hence in the sample
ISSUE39 = {
    "size field odd-typed",
    "rope type bogus_rope",
    "window only in a nested text_config",
    "target_layer_ids unsorted or duplicated",
    "no target_layer_ids (the runner's default taps)",
    "target_layer_ids negative",
    "speculators format",
    "mask token a string or outside the vocabulary",
    "target_layer_ids as floats",
    "auto_map (published z-lab configs)",
    "2026: quantization_config NVFP4",
    "2026: quantization_config MXFP8",
    "2026: quantization_config pack-quantized",
    "2026: no_rope_layers (indices)",
    "2026: no_rope_layers (0/1 per layer)",
    "2026: is_neox_style",
    "2026: logit_scale",
    "2026: has_own_lm_head",
    "2026: use_aux_hidden_state",
    "2026: dflash_config.sample_from_anchor",
}


def test_the_sample_covers_every_class_and_is_seeded() -> None:
    pairs = DD.generated(GENERATED)
    picked = DD.sample(pairs, SAMPLE, SEED)
    every = {c for cfg, _ in pairs for c in input_classes(cfg)}
    assert ISSUE39 <= every, sorted(ISSUE39 - every)
    assert {c for cfg, _ in picked for c in input_classes(cfg)} == every
    assert len(picked) == SAMPLE and picked == DD.sample(pairs, SAMPLE, SEED)
    assert picked != DD.sample(pairs, SAMPLE, SEED + 1)
