"""`doctor --prove`: the user's drafter scaled down to a tiny random twin of the same shape, run through the
conformance comparison for this build and for stock 0.20.1 (conformance.compare.run_conformance).

What the twin keeps: the declared layer_types, the number of drafter layers, every causality field (is_causal,
dflash_config.causal, dflash_config.use_swa), where the window is written (dflash_config.swa_window_size,
sliding_window with or without use_sliding_window), where the ids are written (dflash_config, top level only,
speculators format), the block size, and the taps mapped onto a tiny target with the same relative depths (the
target's layer count when it is at most 64). Scaled: the window (2048 -> 24 tokens for block 16, as the `real-shape`
case; never below block + 8) with prompts about three windows long, hidden size 128, vocabulary 512.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import ConformanceOptions, ConformanceResult, new_run_dir, render, run_conformance
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor.checkpoint import Checkpoint
from vllm_dflash.errors import CheckpointError
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import Queues

MAX_TARGET_LAYERS = 64  # the largest tiny target (the `real-shape` case's): taps beyond are mapped by depth
WINDOW_PER_2048 = 24


@dataclass(frozen=True)
class ProveResult:
    spec: C.CaseSpec
    kept: list[str]  # what of the user's spelling the twin keeps, for the printout
    conformance: ConformanceResult
    stock_as_predicted: bool

    @property
    def ok(self) -> bool:
        return self.conformance.ok and self.stock_as_predicted


def _scale_window(window: int, block: int) -> int:
    return max(block + 8, min(64, round(window * WINDOW_PER_2048 / 2048)))


def _map_taps(ids: list[int], target: int) -> tuple[list[int], int]:
    if target <= MAX_TARGET_LAYERS:
        return ids, target
    mapped = [min(MAX_TARGET_LAYERS - 1, round(i * MAX_TARGET_LAYERS / target)) for i in ids]
    if len(set(mapped)) != len(mapped):
        raise CheckpointError(f"taps {ids} of {target} layers collide on a {MAX_TARGET_LAYERS}-layer twin", "")
    return mapped, MAX_TARGET_LAYERS


def twin_spec(ck: Checkpoint, d: D.Diagnosis) -> tuple[C.CaseSpec, list[str]]:
    """The CaseSpec of the tiny twin and a list saying what of the user's file it keeps."""
    if d.verdict_class == D.NOT_RUNNABLE:
        raise CheckpointError(
            f"{ck.name} cannot be proven on 0.20.1: {d.verdict}", "serve it with the upstream release the verdict names"
        )
    if not d.taps.dflash_ids:
        raise CheckpointError(
            f"{ck.name}: no target_layer_ids ({d.taps.ids_from}), so no twin can tap the same relative depths",
            "give the drafter's dflash_config.target_layer_ids",
        )
    raw = ck.config
    dflash = raw.get("dflash_config") or {}
    n = d.num_layers
    kept: list[str] = [f"{n} drafter layers"]
    layer_types = raw.get("layer_types")
    if layer_types:
        kept.append("layer_types as written")
    else:
        layer_types = [C.FULL] * n
        kept.append("layer_types absent in the file: written all full_attention (what transformers fills in)")
    ours = [r for r in d.rows if r.build == "this build"]
    block = d.block_size or 16
    window = next((r.window for r in ours if r.window is not None), None)
    declared = dflash.get("swa_window_size") or raw.get("sliding_window")
    if "swa_window_size" in dflash:
        spelling: str = "swa_window_size"
    elif raw.get("sliding_window") is not None:
        spelling = "sliding_window" if raw.get("use_sliding_window") else "dropped"
    else:
        spelling = "none"
    given = window or declared
    small = _scale_window(int(given), block) if given else None
    if small:
        kept.append(f"window {given} -> {small} via {spelling}")
    if spelling == "swa_window_size" and raw.get("sliding_window") is not None:
        kept.append("NOT kept: the top-level sliding_window beside swa_window_size (the twin writes only the latter)")
    target = d.taps.target_layers or max(d.taps.dflash_ids) + 4
    if not d.taps.target_layers:
        kept.append(f"target layer count unknown: {target} assumed (pass --target)")
    ids, tiny_target = _map_taps(list(d.taps.dflash_ids or []), target)
    kept.append(f"taps {d.taps.dflash_ids} of {target} -> {ids} of {tiny_target} ({d.taps.ids_from})")
    ids_spelling = (
        "speculators" if ck.speculators else ("top_level" if d.taps.ids_from == "top level only" else "default")
    )
    refusal = ""
    if d.verdict_class == D.REFUSED:
        msg = d.verdict.split(": ", 1)[1]
        refusal = re.sub(r"^DFlash drafter config: ", "", msg)[:48]
    negatives: list[str] = []
    if ids_spelling == "default":
        negatives.append(C.NEG_TAP_INPUT)
    prompt_lengths = (3 * small + 5, 3 * small + 18) if small else (37, 45)
    spec = C.CaseSpec(
        name=f"prove-{re.sub(r'[^a-z0-9]+', '-', Path(ck.name).name.lower()).strip('-')[:40] or 'drafter'}",
        summary=f"doctor --prove twin of {ck.name}",
        layer_types=tuple(layer_types),
        target_layer_ids=tuple(ids),
        sliding_window=small,
        expect_stock="fail" if d.stock_wrong else "pass",
        seed=11,
        prompt_lengths=prompt_lengths,
        max_tokens=20,
        target_layers=tiny_target,
        block_size=block,
        window_spelling=spelling,  # type: ignore[arg-type]
        use_swa=dflash.get("use_swa") is True,
        is_causal=raw.get("is_causal"),
        dflash_causal=dflash.get("causal"),
        ids_spelling=ids_spelling,  # type: ignore[arg-type]
        refusal=refusal,
    )
    if spec.has_sliding:
        negatives += [C.NEG_FULL_ATTN, C.NEG_WINDOW_MINUS, C.NEG_WINDOW_PLUS]
        if any(w is not None and not c for w, c in spec.attention):
            negatives.append(C.NEG_CAUSAL_WINDOW)
    if spec.reference_attention != spec.attention:
        negatives.append(C.NEG_REFERENCE_LITERAL)
    from dataclasses import replace

    return replace(spec, negatives=tuple(dict.fromkeys(negatives))), kept


def prove(manifest: Manifest, queues: Queues, ck: Checkpoint, d: D.Diagnosis) -> ProveResult:
    spec, kept = twin_spec(ck, d)
    print(f"--prove: tiny twin '{spec.name}': " + "; ".join(kept), flush=True)
    # The run's traces and report stay in the cache's runs/ (the user's dist/ untouched).
    work = new_run_dir("cpu")
    options = ConformanceOptions(extra_cases=(spec,), work_dir=work, report=work / "prove-report.json")
    result = run_conformance(manifest, queues, options)
    stock = [o for o in result.outcomes if o.build == "stock"]
    predicted = all(o.as_expected for o in stock)
    return ProveResult(spec, kept, result, predicted)


def render_prove(result: ProveResult) -> None:
    render(result.conformance)
    stock = [o for o in result.conformance.outcomes if o.build == "stock"]
    want = result.spec.expect_stock
    got = ", ".join(o.status for o in stock) or "not run"
    print(
        f"--prove: stock 0.20.1 {got} (the doctor predicted {'a failure' if want == 'fail' else 'a pass'}): "
        + ("as predicted" if result.stock_as_predicted else "NOT as predicted")
    )
