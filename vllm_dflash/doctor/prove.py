"""`doctor --prove`: the user's drafter scaled down to a tiny random twin of the same shape, run through the
conformance comparison for this build and for stock 0.20.1 (conformance.compare.run_conformance), and every claim of
the diagnosis checked against what the served twin did.

What the twin keeps: the layer kinds as transformers fills them and how they are spelled (`layer_types` written out,
or left to `use_sliding_window` + `max_window_layers`), the number of drafter layers, every causality field
(is_causal, dflash_config.causal, dflash_config.use_swa), where the window is written (dflash_config.swa_window_size,
sliding_window with or without use_sliding_window), where the ids are written (dflash_config, top level only,
speculators format), the block size, and the target layers read, mapped onto a tiny target with the same relative
depths (the target's layer count when it is at most 64). Scaled: the window (2048 -> 24 tokens, as the `real-shape`
case; never below block + 8), prompts about three windows long, hidden size 128, vocabulary 512.

The claims, each checked on the served twin (vLLM's start-up line per layer, and each layer's backend window and the
target layers recorded, read from the loaded models by the conformance recorder): per drafter layer this build's
kind, window and causality; the target layers each build reads; which of those stock reads wrong and which layers it
runs with another window; the twin's own reading equal to the user's config's (shape); and the conformance verdicts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import (
    FAILED_EXIT,
    ConformanceOptions,
    ConformanceResult,
    case_dir,
    new_run_dir,
    render,
    run_conformance,
)
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor.checkpoint import Checkpoint
from vllm_dflash.doctor.columns import OURS, REFERENCE, STOCK, UPSTREAM, UPSTREAM_V1_LAST
from vllm_dflash.errors import CheckpointError
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import Queues

MAX_TARGET_LAYERS = 64  # the largest tiny target (the `real-shape` case's): taps beyond are mapped by depth
WINDOW_PER_2048 = 24


NOT_RUN = "not run"


@dataclass(frozen=True)
class Claim:
    what: str
    expected: Any
    got: Any  # NOT_RUN: nothing the twin did answers it (its build did not serve the twin, or recorded nothing)

    @property
    def ran(self) -> bool:
        return self.got is not None and self.got != NOT_RUN

    @property
    def holds(self) -> bool:
        return self.ran and bool(self.expected == self.got)


@dataclass(frozen=True)
class ProveResult:
    spec: C.CaseSpec
    kept: list[str]  # what of the user's spelling the twin keeps, for the printout
    conformance: ConformanceResult
    claims: list[Claim]

    @property
    def failed(self) -> list[Claim]:
        return [c for c in self.claims if c.ran and not c.holds]

    @property
    def not_run(self) -> list[Claim]:
        return [c for c in self.claims if not c.ran]

    @property
    def ok(self) -> bool:
        return self.conformance.verdict == "pass" and not self.failed and not self.not_run

    @property
    def exit_code(self) -> int:
        """1 when a claim or verdict is wrong or a claim did not run; the conformance run's own code (19: a case
        cannot run here)."""
        if self.failed or (self.not_run and not self.conformance.exit_code):
            return FAILED_EXIT
        return self.conformance.exit_code or (0 if self.ok else FAILED_EXIT)


def _scale_window(window: int, block: int) -> int:
    return max(block + 8, min(64, round(window * WINDOW_PER_2048 / 2048)))


def _map_taps(ids: list[int], target: int) -> tuple[list[int], int]:
    if target <= MAX_TARGET_LAYERS:
        return ids, target
    mapped = [min(MAX_TARGET_LAYERS - 1, round(i * MAX_TARGET_LAYERS / target)) for i in ids]
    if len(set(mapped)) != len(mapped):
        raise CheckpointError(f"taps {ids} of {target} layers collide on a {MAX_TARGET_LAYERS}-layer twin", "")
    return mapped, MAX_TARGET_LAYERS


def _layer_spelling(raw: Any, kinds: list[str]) -> tuple[str, int]:
    """How the user's config spells its layer kinds: written out, or filled by transformers (and from where)."""
    if raw.get("layer_types") is None and C.SLIDING in kinds:
        return "filled", kinds.index(C.SLIDING)
    return "explicit", 0


def twin_spec(ck: Checkpoint, d: D.Diagnosis) -> tuple[C.CaseSpec, list[str]]:
    """The CaseSpec of the tiny twin and a list saying what of the user's file it keeps."""
    if d.verdict_class in (D.NOT_RUNNABLE, D.NOT_DFLASH, D.MISFIT):
        raise CheckpointError(f"{ck.name} cannot be proven on 0.20.1: {d.verdict}", "act on the verdict first")
    if not d.taps.dflash_ids:
        raise CheckpointError(
            f"{ck.name}: no target_layer_ids ({d.taps.ids_from}), so no twin can read the same relative depths",
            "give the drafter's dflash_config.target_layer_ids",
        )
    raw = ck.config["transformer_layer_config"] if ck.speculators else ck.config
    dflash = raw.get("dflash_config") or {}
    ours = [r for r in d.rows if r.build == OURS]
    n = d.num_layers or len(ours)
    kept: list[str] = [f"{n} drafter layers"]
    kinds = d.layer_types or [C.FULL] * n
    spelling, first = _layer_spelling(raw, kinds)
    where = f"sliding from layer {first}" if spelling == "filled" else "all full"
    kept.append(
        "layer_types as written"
        if raw.get("layer_types") is not None
        else f"layer_types left to transformers ({where})"
    )
    block = d.block_size or 16
    window = next((r.window for r in ours if r.window is not None), None)
    declared = dflash.get("swa_window_size") or raw.get("sliding_window")
    if "swa_window_size" in dflash:
        wspell: str = "swa_window_size"
    elif raw.get("sliding_window") is not None:
        wspell = "sliding_window" if raw.get("use_sliding_window") else "dropped"
    else:
        wspell = "none"
    given = window or declared
    small = _scale_window(int(given), block) if isinstance(given, int) and not isinstance(given, bool) else None
    if small:
        kept.append(f"window {given} -> {small} via {wspell}")
    if wspell == "swa_window_size" and raw.get("sliding_window") is not None:
        kept.append("NOT kept: the top-level sliding_window beside swa_window_size (the twin writes only the latter)")
    target = d.taps.target_layers or max(d.taps.dflash_ids) + 4
    if not d.taps.target_layers:
        kept.append(f"target layer count unknown: {target} assumed (pass --target)")
    ids, tiny_target = _map_taps(list(d.taps.dflash_ids or []), target)
    kept.append(f"target layers {d.taps.dflash_ids} of {target} -> {ids} of {tiny_target} ({d.taps.ids_from})")
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
    is_causal = raw.get("is_causal")
    spec = C.CaseSpec(
        name=f"prove-{re.sub(r'[^a-z0-9]+', '-', Path(ck.name).name.lower()).strip('-')[:40] or 'drafter'}",
        summary=f"doctor --prove twin of {ck.name}",
        layer_types=tuple(kinds),
        target_layer_ids=tuple(ids),
        sliding_window=small,
        expect_stock="fail" if d.stock_wrong else "pass",
        seed=11,
        prompt_lengths=prompt_lengths,
        max_tokens=20,
        target_layers=tiny_target,
        block_size=block,
        window_spelling=wspell,  # type: ignore[arg-type]
        use_swa=dflash.get("use_swa") is True,
        is_causal=None if is_causal is None else bool(is_causal),
        dflash_causal=None if dflash.get("causal") is None else bool(dflash["causal"]),
        ids_spelling=ids_spelling,  # type: ignore[arg-type]
        refusal=refusal,
        layer_types_spelling=spelling,
        max_window_layers=first if spelling == "filled" else 0,
    )
    if spec.has_sliding:
        negatives += [C.NEG_FULL_ATTN, C.NEG_WINDOW_MINUS, C.NEG_WINDOW_PLUS]
        if any(w is not None and not c for w, c in spec.attention):
            negatives.append(C.NEG_CAUSAL_WINDOW)
    if spec.reference_attention != spec.attention:
        negatives.append(C.NEG_REFERENCE_LITERAL)
    return replace(spec, negatives=tuple(dict.fromkeys(negatives))), kept


# ---- the claims -------------------------------------------------------------------------------------------------


def parse_attention_line(line: str | None) -> list[tuple[str, int | None, bool, tuple[int, int]]]:
    """This build's start-up line per layer: (kind, window, causal, backend window)."""
    if not line:
        return []
    out = []
    for chunk in re.split(r"; (?=layer \d+: )", line.split("DFlash drafter attention:", 1)[1].strip()):
        m = re.match(r"layer (\d+): (\w+) ", chunk)
        w = re.search(r"\), window (\d+) \(", chunk)
        b = re.search(r"-> window \((-?\d+), (-?\d+)\)\s*$", chunk)
        if not m or not b:
            continue
        causal = bool(re.search(r"\), causal \(", chunk))
        out.append((m.group(2), int(w.group(1)) if w else None, causal, (int(b.group(1)), int(b.group(2)))))
    return out


def _summary(trace: Path) -> dict[str, Any]:
    if not trace.is_file():
        return {}
    lines = trace.read_text().strip().splitlines()
    return dict(json.loads(lines[-1]).get("summary") or {}) if lines else {}


def _expected_rows(d: D.Diagnosis, build: str, small: int | None) -> list[tuple[str, int | None, bool]]:
    """The diagnosis's per-layer claim for `build`, at the twin's scale (the window scaled)."""
    return [(r.kind, small if r.window is not None else None, r.causal) for r in d.rows if r.build == build]


def _backend(rows: list[tuple[str, int | None, bool]]) -> list[list[int]]:
    out = []
    for _, w, causal in rows:
        left = -1 if w is None else w - 1
        out.append([left, 0 if causal else left])
    return out


def claims(
    d: D.Diagnosis, spec: C.CaseSpec, summaries: dict[str, dict[str, Any]], twin: D.Diagnosis | None
) -> list[Claim]:
    """Every claim of `d` (the user's diagnosis) against what the served twin did (`summaries`: build -> trace
    summary) and against the twin's own reading (`twin`)."""
    out: list[Claim] = []
    ours_rows = _expected_rows(d, OURS, spec.sliding_window)
    stock_rows = _expected_rows(d, STOCK, spec.sliding_window)
    patched = summaries.get("patched", {})
    stock = summaries.get("stock", {})
    served = (patched.get("layout") or {}).get("windows")
    out.append(
        Claim(
            "this build: backend window of each layer (recorded from the loaded drafter)", _backend(ours_rows), served
        )
    )
    line = parse_attention_line(patched.get("attention_line"))
    out.append(
        Claim(
            "this build: kind, window, causality of each layer (its start-up line)",
            ours_rows,
            [(k, w, c) for k, w, c, _ in line],
        )
    )
    ids = list(spec.target_layer_ids)
    ours_taps = [i + 1 for i in ids]
    wrong = set(d.stock_wrong.get("taps", []))
    stock_taps = [t - 1 if k in wrong else t for k, t in enumerate(ours_taps)]
    out.append(
        Claim(
            "this build: target layers recorded for the drafter (aux indices)",
            ours_taps,
            (patched.get("layout") or {}).get("aux_layers"),
        )
    )
    if twin is not None:  # what the fc receives, in order: the doctor's twin reading against the served target
        out.append(
            Claim(
                "this build: the target layers the drafter's fc receives, in the order it receives them",
                twin.taps.ours_recorded,
                (patched.get("layout") or {}).get("fed"),
            )
        )
    if spec.refusal or "stock" not in spec.builds:
        return out + _shape(d, twin)
    stock_served = (stock.get("layout") or {}).get("windows")
    out.append(Claim("stock 0.20.1: backend window of each layer (recorded)", _backend(stock_rows), stock_served))
    out.append(
        Claim(
            "stock 0.20.1: target layers recorded (aux indices)",
            stock_taps,
            (stock.get("layout") or {}).get("aux_layers"),
        )
    )
    got_aux = ((patched.get("layout") or {}).get("aux_layers"), (stock.get("layout") or {}).get("aux_layers"))
    a, b = got_aux
    if isinstance(a, list) and isinstance(b, list):
        out.append(
            Claim(
                "stock 0.20.1: which target layers it reads wrong (positions)",
                sorted(wrong),
                [k for k in range(max(len(a), len(b))) if (a[k : k + 1] or [None]) != (b[k : k + 1] or [None])],
            )
        )
    if isinstance(served, list) and isinstance(stock_served, list):
        layers = sorted(set(d.stock_wrong.get("windows", [])) | set(d.stock_wrong.get("causality", [])))
        out.append(
            Claim(
                "stock 0.20.1: which drafter layers it runs with another window or causality",
                layers,
                [i for i, (x, y) in enumerate(zip(served, stock_served, strict=False)) if x != y],
            )
        )
    return out + _shape(d, twin)


# What a twin scales (sizes) or spells its own way (where the window and ids sit): not expected in its config.json.
_SCALED = frozenset(
    {
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "max_position_embeddings", "rms_norm_eps", "num_target_layers", "transformers_version", "dtype", "torch_dtype",
        "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window", "use_sliding_window", "max_window_layers",
        "layer_types", "target_layer_ids", "mask_token_id", "block_size", "swa_window_size", "rope_theta",
        "rope_scaling", "rope_parameters", "initializer_range", "tie_word_embeddings", "architectures", "model_type",
        "num_hidden_layers", "attention_bias", "attention_dropout", "hidden_act", "use_cache", "auto_map",
    }
)  # fmt: skip


def kept_fields(user: Any, twin: Any) -> list[str]:
    """Fields of the user's config (top level and dflash_config) the twin's config.json does not carry, sizes and
    the spellings a twin writes its own way aside: what the twin would silently drop."""

    def names(cfg: Any) -> set[str]:
        if not isinstance(cfg, dict):
            return set()
        layer = cfg.get("transformer_layer_config") if "speculators_model_type" in cfg else cfg
        layer = layer if isinstance(layer, dict) else {}
        out = {k for k in (*cfg, *layer) if k not in ("dflash_config", "transformer_layer_config")}
        dflash = layer.get("dflash_config")
        out |= {f"dflash_config.{k}" for k in dflash} if isinstance(dflash, dict) else set()
        return {n for n in out if n.split(".")[-1] not in _SCALED}

    return sorted(names(user) - names(twin))


def _shape(d: D.Diagnosis, twin: D.Diagnosis | None) -> list[Claim]:
    """The twin's own reading (its config.json through the doctor) has the user's shape: per layer kind, causality,
    whether it is windowed and where the window comes from; the same wrong target layers and verdict."""

    def shape(x: D.Diagnosis) -> Any:
        # vLLM's builds only: the reference needs num_target_layers to build at all, which the twin must carry.
        rows = [
            (r.build, r.layer, r.kind, r.kind_from, r.window is not None, r.window_from, r.causal, r.causal_from)
            for r in x.rows
            if r.build in (STOCK, OURS, UPSTREAM_V1_LAST, UPSTREAM)
        ]
        return rows, x.stock_wrong.get("taps"), x.verdict_class

    what = "the twin's reading has the user's shape (per layer kind, window spelling, causality; taps; verdict)"
    return [Claim(what, shape(d), shape(twin) if twin is not None else "no twin config.json")]


def _first_difference(expected: Any, got: Any) -> str:
    """The claim and the twin where they first differ (a whole list is too long to read)."""
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        for a, b in zip(expected, got, strict=False):
            if a != b:
                nested = isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(str(a)) > 120
                return _first_difference(a, b) if nested else f"{a} / {b}"
        return f"{len(expected)} entries / {len(got)}"
    return f"{expected} / {got}"


def prove(
    manifest: Manifest, queues: Queues, ck: Checkpoint, d: D.Diagnosis, doc: Any, spec: C.CaseSpec | None = None
) -> ProveResult:
    """Run the twin (`spec` overrides it: a negative control builds a deliberately wrong twin) and check the claims."""
    twin_of_user, kept = twin_spec(ck, d)
    spec = spec or twin_of_user
    print(f"--prove: tiny twin '{spec.name}': " + "; ".join(kept), flush=True)
    work = new_run_dir("cpu")  # the run's traces and report stay in the cache's runs/ (the user's dist/ untouched)
    options = ConformanceOptions(extra_cases=(spec,), work_dir=work, report=work / "prove-report.json")
    result = run_conformance(manifest, queues, options)
    summaries = {b: _summary(work / b / f"{spec.name}.jsonl") for b in ("patched", "stock")}
    twin_config = case_dir(spec) / "drafter" / "config.json"
    twin = None
    dropped: Any = NOT_RUN
    if twin_config.is_file():
        raw = json.loads(twin_config.read_text())
        dropped = kept_fields(dict(ck.config), raw)
        twin = doc.diagnose(
            Checkpoint(str(twin_config), raw, speculators="speculators_model_type" in raw),
            spec.target_layers,
            "the twin's target",
        )
    keeps = Claim("the twin carries every field of the user's config (sizes scaled)", [], dropped)
    # The reference run: conformance's oracle loads the twin with dflash 0.1.0 (weights and all) and refuses to run
    # unless its layers read what cases.py says the reference reads (spec.reference_attention).
    ran = result.verdict in ("pass", "fail")
    reference = Claim(
        "reference 0.1.0: window and causality of each layer (the doctor's meta-device reading against the reference "
        "run's)",
        [[r.window, r.causal] for r in twin.rows if r.build == REFERENCE] if twin is not None else NOT_RUN,
        [[w, bool(c)] for w, c in spec.reference_attention] if ran else NOT_RUN,
    )
    return ProveResult(spec, kept, result, [*claims(d, spec, summaries, twin), keeps, reference])


def render_prove(result: ProveResult, exit_code: int | None = None) -> None:
    """Each claim as predicted, NOT as predicted, or not run; the summary carries `exit_code`, the process's own."""
    render(result.conformance)
    for c in result.claims:
        if not c.ran:
            print(f"--prove: NOT RUN: {c.what} (the twin gave nothing to check it against)")
        elif c.holds:
            print(f"--prove: as predicted: {c.what}")
        else:
            where = _first_difference(c.expected, c.got)
            print(f"--prove: NOT as predicted: {c.what} (the doctor's claim / the twin's, where they differ: {where})")
    verdict = result.conformance.verdict
    held = len(result.claims) - len(result.failed) - len(result.not_run)
    code = result.exit_code if exit_code is None else exit_code
    print(
        f"--prove: {held}/{len(result.claims)} claims as predicted, {len(result.not_run)} not run; conformance "
        f"{verdict}; " + ("as predicted" if result.ok else "NOT as predicted") + f" (exit {code})"
    )
