"""The doctor's document: per drafter layer what each build does, the target layers read, what this build ignores,
one verdict (with its exit code) and what to do.

    diagnose(checkpoint, readings, target_layers=None, target_from="", target_architectures=()) -> Diagnosis

Every column is what its build's own code did with the config (`readings`: columns.py, computed by sides.py): the
loading, the layers built, the taps, the order the target records them in, the fc width. The verdict compares this
build with stock 0.20.1 (this build's reading is the trained semantics: docs/drafter-config.md); what a field does is
fields.py's table, each 2026 field's effect measured by building the drafter without it (fields.measured). What is
still a rule (no code runs it on a built drafter) says so where it is printed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_dflash.doctor import columns as col
from vllm_dflash.doctor import fields as F
from vllm_dflash.doctor.checkpoint import Checkpoint
from vllm_dflash.doctor.columns import OURS, REFERENCE, STOCK, UPSTREAM, UPSTREAM_V1_LAST

# Verdict classes and their exit codes (docs/doctor.md). 0 and 20 both mean: this build
# serves the drafter as trained; 20 adds that stock 0.20.1 does not.
SERVED = "served as trained"
STOCK_MISSERVES = "stock mis-serves it"
REFUSED = "refused by our build"
NOT_RUNNABLE = "not a drafter 0.20.1 can run"
UNREAD = "served as this build reads it"
NOT_DFLASH = "not a DFlash drafter"
MISFIT = "does not fit this target"
EXIT_CODES = {SERVED: 0, STOCK_MISSERVES: 20, REFUSED: 21, NOT_RUNNABLE: 22, UNREAD: 23, NOT_DFLASH: 24, MISFIT: 18}
VERDICT_EXIT = EXIT_CODES
BUILDS = col.BUILDS
INSTALL = (
    "install this build's wheel (vllm-dflash build; pip install --no-deps dist/vllm-0.20.1+dflash.*.whl) over your "
    "vLLM 0.20.1"
)
FLASH_ATTN = (
    "on CUDA its windowed layers need the FLASH_ATTN attention backend (--attention-backend FLASH_ATTN); this build "
    "checks that at start-up and refuses any other backend with one line"
)


@dataclass(frozen=True)
class LayerRow:
    layer: int
    build: str
    kind: str
    kind_from: str
    window: int | None
    window_from: str | None
    causal: bool
    causal_from: str
    backend_window: tuple[int, int]


@dataclass(frozen=True)
class Taps:
    """Which target layers' outputs the drafter reads, per build (vLLM records "aux" index k = the input of target
    layer k = the output of layer k - 1; a DFlash target_layer_ids entry L names the output of layer L)."""

    dflash_ids: list[int] | None  # what the checkpoint asks for, as output-of-layer ids
    ids_from: str
    ours_aux: list[Any] | None
    stock_aux: list[Any] | None
    upstream_aux: list[Any] | None  # the newest release's (0.34.0)
    reference_layers: list[Any] | None  # output of target layer L, in the order the reference concatenates them
    target_layers: int | None
    target_from: str
    problems: list[str] = field(default_factory=list)
    ours_recorded: list[int] | None = None  # the aux indices the target records for this build, in forward order
    stock_recorded: list[int] | None = None
    upstream_v1_last_aux: list[Any] | None = None  # 0.33.0's
    fc_in: int | None = None  # the width of this build's drafter fc, as built
    fc_fed: int | None = None  # what the target feeds it: recorded taps x the target's hidden size


@dataclass(frozen=True)
class Diagnosis:
    checkpoint: str
    architecture: str
    drafter: str  # "DFlash drafter", or what else the config is
    num_layers: int | None
    block_size: int | None
    columns: dict[str, str]  # build -> which code computed it, in which environment
    rows: list[LayerRow]
    refusals: dict[str, str]  # build -> the line it prints (builds that do not serve it)
    upstream_runner: dict[str, str]  # upstream build -> which model runner serves it
    taps: Taps
    ignored: list[str]  # fields this build ignores, with what they are
    unknown_fields: list[str]  # fields in no table
    not_runnable: list[str]  # what 0.20.1 cannot run, each with who can
    verdict_class: str
    verdict: str
    stock_wrong: dict[str, list[int]]  # "taps" (positions) / "windows" / "causality" (layers)
    stock_words: list[str]  # what stock 0.20.1 does, in plain terms
    advice: list[str]  # what to do
    layer_types: list[str] | None = None  # as this build's loader filled them (transformers' Qwen3Config)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict_class]

    @property
    def mismatch(self) -> str:
        """A drafter/target mismatch (taps beyond --target's layers): no build can serve this pair."""
        return next((p for p in self.taps.problems if "outside" in p), "") if self.verdict_class == MISFIT else ""

    def to_json(self, exit_code: int | None = None, **extra: Any) -> str:
        """The document; `exit_code` when the process ends with another one (--prove), `extra` beside it."""
        code = self.exit_code if exit_code is None else exit_code
        return json.dumps({**asdict(self), **extra, "exit_code": code}, indent=1)


def _rows(build: str, layers: tuple[col.Layer, ...], raw: Mapping[str, Any]) -> list[LayerRow]:
    return [
        LayerRow(
            i,
            build,
            x.kind,
            _attributed(x.kind_from, raw),
            x.window,
            x.window_from,
            x.causal,
            _attributed(x.causal_from, raw),
            x.backend_window,
        )
        for i, x in enumerate(layers)
    ]


def _attributed(source: str, raw: Mapping[str, Any]) -> str:
    """A field the code names as its source, said as config.json has it: without layer_types in the file, the kinds
    it reads are the ones transformers filled in (from use_sliding_window and max_window_layers), none declared."""
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    if not isinstance(layer, Mapping) or layer.get("layer_types") is not None:
        return source
    if source.startswith("layer_types["):
        return f"{source}, filled by transformers"
    return source.replace("a declared ", "a ").replace("default for a ", "default for a transformers-filled ")


_EAGLE = ("eagle",)
_MTP = ("mtp",)


def drafter_kind(raw: Mapping[str, Any]) -> str:
    """What kind of checkpoint this is: "" for a DFlash drafter, else a description (EAGLE, Medusa, MTP, a model)."""
    archs = raw.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    mt = str(raw.get("model_type") or "").lower()
    spec = raw.get("speculators_model_type")
    if spec is not None:
        if str(spec).lower() in ("dflash", "dflash2"):
            return ""
        return f"a speculators-format {spec} drafter (speculators_model_type {json.dumps(spec)})"
    lowered = " ".join(names).lower()
    if "dflash" in lowered or isinstance(raw.get("dflash_config"), (dict, list, str)):
        return ""
    if "eagle3" in lowered or mt == "eagle3" or "eagle_aux_hidden_state_layer_ids" in raw:
        return f"an EAGLE-3 drafter ({'/'.join(names) or 'model_type ' + mt}); serve it with method eagle3"
    if "eagle" in lowered or mt == "eagle":
        return f"an EAGLE drafter ({'/'.join(names) or 'model_type ' + mt}); serve it with method eagle"
    if "medusa" in lowered or mt == "medusa":
        return f"a Medusa drafter ({'/'.join(names) or 'model_type medusa'}); serve it with method medusa"
    if "mtp" in lowered or mt.endswith("_mtp") or "num_nextn_predict_layers" in raw:
        return f"a multi-token-prediction (MTP) module ({'/'.join(names) or 'model_type ' + mt}); serve it as MTP"
    if any(n.endswith(("ForCausalLM", "ForConditionalGeneration")) for n in names) or "text_config" in raw:
        return (
            f"a model ({'/'.join(names) or 'model_type ' + mt}), not a drafter: pass the drafter's config.json "
            "(pass this one as --target)"
        )
    return f"no DFlash drafter config (architectures {json.dumps(archs)}, no dflash_config)"


def _dflash_ids(raw: Mapping[str, Any]) -> tuple[list[int] | None, str]:
    """The target layers the checkpoint asks for, as output-of-layer ids, and where they are written."""

    def ints(v: Any) -> list[int] | None:
        ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
        return list(v) if ok else None

    if "speculators_model_type" in raw:
        aux = ints(raw.get("aux_hidden_state_layer_ids"))
        return (
            ([i - 1 for i in aux], "aux_hidden_state_layer_ids - 1 (speculators, vLLM's indexing)")
            if aux
            else (
                None,
                "absent",
            )
        )
    aux = ints(raw.get("eagle_aux_hidden_state_layer_ids"))
    if aux:
        return [i - 1 for i in aux], "eagle_aux_hidden_state_layer_ids - 1 (vLLM's indexing)"
    dflash = raw.get("dflash_config")
    if isinstance(dflash, Mapping) and "target_layer_ids" in dflash:
        ids = ints(dflash["target_layer_ids"])
        return ids, "dflash_config.target_layer_ids" if ids is not None else "dflash_config.target_layer_ids (odd)"
    top = ints(raw.get("target_layer_ids"))
    if top is not None:
        return top, "top level only"
    return None, "absent"


def _positions(a: list[Any] | None, b: list[Any] | None) -> list[int]:
    if a is None or b is None:
        return []
    n = max(len(a), len(b))
    return [i for i in range(n) if (a[i] if i < len(a) else None) != (b[i] if i < len(b) else None)]


def _outputs(aux: list[Any] | None) -> list[Any] | None:
    if aux is None:
        return None
    # vLLM matches `layer_idx in aux`, so an integral float id taps that layer: word it as the int it matches.
    return [int(i) - 1 if isinstance(i, float) and i.is_integer() else i - 1 if _is_int(i) else i for i in aux]


SRC_MASK = "vllm 0.20.1 vllm/v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params"


def _mask_token(ours: col.Reading, raw: Mapping[str, Any]) -> list[str]:
    """The proposer fills every masked slot with dflash_config.mask_token_id as it is, and the drafter embeds it: a
    string or an id outside the vocabulary config.json gives is no token it can embed (a rule read from the code, not
    run; a vocabulary config.json does not give is the target's, not checked)."""
    dflash = ours.loaded.get("dflash_config") if ours.loaded.attrs else None
    if not isinstance(dflash, Mapping) or "mask_token_id" not in dflash:
        return []
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    mask, vocab = dflash["mask_token_id"], (layer.get("vocab_size") if isinstance(layer, Mapping) else None)
    if _is_int(mask) and (not _is_int(vocab) or 0 <= mask < vocab):
        return []
    return [
        f"mask_token_id {mask!r} is no token of the drafter's vocabulary (vocab_size {vocab!r}): the proposer fills "
        f"the masked slots with it as written [rule read from {SRC_MASK}, not run]: fix dflash_config.mask_token_id"
    ]


def _layers(outputs: list[Any]) -> str:
    """Output-of-layer ids in words: -1 is the input of layer 0, the embeddings."""
    return ", ".join("-1 (the embeddings)" if i == -1 else str(i) for i in outputs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SRC_RECORDED = "EagleModelMixin._maybe_add_hidden_state"
# What no built drafter shows (a rule, said as one where it is printed): which hidden state "the last layer" is.
SRC_LAST_LAYER = (
    "rule read from vllm 0.20.1 EagleModelMixin (pre-norm residual stream) and dflash 0.1.0 extract_context_feature "
    "(hidden_states[L + 1], after the final norm for the last layer), not run"
)


def _span(items: list[int]) -> str:
    return ", ".join(str(i) for i in items)


def _taps(
    raw: Mapping[str, Any], readings: Mapping[str, col.Reading], target_layers: int | None, target_from: str
) -> Taps:
    ids, ids_from = _dflash_ids(raw)
    ours, stock = readings[OURS], readings[STOCK]
    problems: list[str] = []
    if ids is None and ids_from == "absent":
        problems.append(
            "no target_layer_ids: vLLM reads the target model's default layers, not the ones the drafter was trained "
            "on -- set dflash_config.target_layer_ids"
        )
    if target_layers is not None and ids is not None:
        bad = [i for i in ids if not 0 <= i < target_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} outside the target's {target_layers} layers (0..{target_layers - 1})"
            )
        elif target_layers - 1 in ids:
            problems.append(
                f"a read of the last target layer ({target_layers - 1}): vLLM takes it before the final norm, the "
                f"reference after it [{SRC_LAST_LAYER}]"
            )
    aux, got = ours.taps, ours.recorded
    if aux and got is not None and list(got) != list(aux) and not any("outside" in p for p in problems):
        problems.append(
            f"recorded: the target records its taps in layer order, once each, never a negative index (its "
            f"forward's {SRC_RECORDED}, run on the built target): this build feeds the drafter's fc the outputs of "
            f"target layers {_span(_outputs(list(got)) or [])} ({len(got)} taps) where it was trained on "
            f"{_span(_outputs(list(aux)) or [])} in that order ({len(aux)} taps) -- list target_layer_ids ascending, "
            "each once, each 0 or more"
        )
    hidden = ours.target_hidden
    if ours.target.get("target_stand_in"):  # no --target: the target is as wide as the drafter says it is, as loaded
        width = ours.loaded.get("target_hidden_size") or ours.loaded.get("hidden_size")
        hidden = width if isinstance(width, int) and not isinstance(width, bool) else hidden
    fed = len(got) * hidden if got is not None and hidden else None
    if ours.fc_in is not None and fed is not None and ours.fc_in != fed and not any("outside" in p for p in problems):
        default = "the target model's default aux layers"
        where = "from the config" if aux and ours.taps_from != default else "its default"
        problems.append(
            f"fc width: this build's drafter fc takes {ours.fc_in} features ({ours.fc_in / (hidden or 1):g} hidden "
            f"states of {hidden}), but the target records {len(got or [])} taps ({where}): {fed} features -- give "
            "dflash_config.target_layer_ids the layers the drafter was trained on"
        )
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    n_target = layer.get("num_target_layers") if isinstance(layer, Mapping) else None
    if target_layers is None and isinstance(n_target, int) and not isinstance(n_target, bool) and ids is not None:
        bad = [i for i in ids if isinstance(i, int) and not 0 <= i < n_target]
        if bad:
            problems.append(
                f"note: target_layer_ids {bad} lie beyond the drafter's own num_target_layers {n_target} (pass "
                "--target to check against the target you serve)"
            )
        elif n_target - 1 in ids:
            problems.append(
                f"a read of the last target layer ({n_target - 1}, from the drafter's own num_target_layers): vLLM "
                f"takes it before the final norm, the reference after it [{SRC_LAST_LAYER}]"
            )
    return Taps(
        ids,
        ids_from,
        ours.taps,
        stock.taps,
        readings[UPSTREAM].taps,
        readings[REFERENCE].taps,
        target_layers,
        target_from,
        problems,
        ours_recorded=list(got) if got is not None else None,
        stock_recorded=list(stock.recorded) if stock.recorded is not None else None,
        upstream_v1_last_aux=readings[UPSTREAM_V1_LAST].taps,
        fc_in=ours.fc_in,
        fc_fed=fed,
    )


def _stock_words(ours: col.Reading, stock: col.Reading, taps: Taps, wrong: dict[str, list[int]]) -> list[str]:
    out = []
    if "taps" in wrong and taps.ours_aux is not None and taps.stock_aux is not None:
        # What stock's target records (an aux index -1 never is), not the list it was given.
        fed = taps.stock_recorded if taps.stock_recorded is not None else list(taps.stock_aux)
        lost = len(taps.stock_aux) - len(fed)
        out.append(
            f"stock vLLM 0.20.1 feeds the drafter the outputs of target layers {_layers(_outputs(fed) or [])}"
            f" instead of {_layers(_outputs(taps.ours_aux) or [])} (one layer too early each"
            + (
                f"; {lost} tap{'s' * (lost > 1)} never recorded: the fc gets {len(fed)} of {len(taps.stock_aux)})"
                if lost
                else ")"
            )
        )
    assert ours.layers is not None and stock.layers is not None
    if "windows" in wrong:
        w = wrong["windows"]
        sizes = sorted({ours.layers[i].window or 0 for i in w})
        many = len(w) > 1
        out.append(
            f"drafter layer{'s' if many else ''} {_span(w)} lose{'' if many else 's'} {'their' if many else 'its'} "
            f"sliding window: stock attends to the whole context instead of the last {'/'.join(map(str, sizes))} tokens"
        )
    if "causality" in wrong:
        c = wrong["causality"]
        out.append(
            f"drafter layer{'s' if len(c) > 1 else ''} {_span(c)} also attend to the later positions of the drafted "
            "block on stock (trained causal: earlier positions only)"
        )
    return out


def diagnose(
    ck: Checkpoint,
    readings: Mapping[str, col.Reading],
    target_layers: int | None = None,
    target_from: str = "",
    target_architectures: tuple[str, ...] = (),
    measured: Mapping[str, F.Measured] | None = None,
) -> Diagnosis:
    """`readings`: each build's own reading of `ck` (sides.read); `measured`: each 2026 field's effect, measured by
    building the drafter without it (fields.measure)."""
    raw = ck.config
    ours, stock = readings[OURS], readings[STOCK]
    archs = raw.get("architectures")
    arch = "/".join(str(a) for a in archs) if isinstance(archs, list) else json.dumps(archs)
    rows: list[LayerRow] = []
    refusals: dict[str, str] = {}
    for build in BUILDS:
        r = readings[build]
        if r.refusal is not None:
            refusals[build] = f"{r.refusal.line} [{r.refusal.source}]" if r.refusal.source else r.refusal.line
        elif r.layers is not None:
            rows += _rows(build, r.layers, raw)
    runners = {
        b: readings[b].runner if readings[b].refusal is None else "refused" for b in (UPSTREAM_V1_LAST, UPSTREAM)
    }
    taps = _taps(raw, readings, target_layers, target_from)
    table = F.classify(raw, ck.files, ck.tensors, measured)
    ignored = [f"{h.name} = {h.value} ({h.feature.what}; read by {h.feature.reader})" for h in table.blocking]
    ignored += table.harmless
    unknown = [u for u in table.unknown if not ck.unknown or u.split(" = ", 1)[0] not in ck.unknown]
    blocking = list(dict.fromkeys(f"{h.feature.what} ({h.name}): {h.feature.reader}" for h in table.blocking))
    target = ours.target
    registry = target.get("target_registry") or {}
    built = target.get("target_supports_eagle3") is False and not target.get("target_stand_in")
    # not built (vLLM cannot load the --target config): every architecture it names has no model, or no Eagle3
    listed = bool(target.get("target_stand_in")) and bool(registry) and not any(registry.values())
    if target_architectures and (built or listed):
        how = (
            f"its model {target.get('target_class')} does not implement SupportsEagle3 (built here)"
            if built
            else f"vLLM 0.20.1's registry: {', '.join(f'{a} {_eagle3_words(v)}' for a, v in registry.items())}"
        )
        blocking.append(
            f"target {'/'.join(target_architectures)} records no auxiliary hidden states in vLLM 0.20.1: {how} -- a "
            "vLLM release whose model implements it (not checked)"
        )
    blocking += _mask_token(ours, raw)
    if target.get("target_load_error"):
        taps.problems.append(
            f"note: vLLM cannot load the --target config ({target['target_load_error']}): the drafter was read beside "
            "a stand-in target of its own sizes"
        )
    kind = drafter_kind(raw)
    layer = raw.get("transformer_layer_config") if ck.speculators else raw
    dflash = (layer.get("dflash_config") if isinstance(layer, Mapping) else None) or {}
    block = dflash.get("block_size") if isinstance(dflash, Mapping) else None
    if block is None and isinstance(layer, Mapping):
        block = layer.get("block_size")
    n = ours.loaded.get("num_hidden_layers") if ours.loaded.attrs else None

    wrong: dict[str, list[int]] = {}
    words: list[str] = []
    advice: list[str] = []
    if kind:
        klass, verdict = NOT_DFLASH, f"{NOT_DFLASH}: this is {kind}"
        advice.append("the doctor checks DFlash drafters (architectures DFlashDraftModel): pass one")
    elif ours.refusal is not None and ours.refusal.stage == "load":
        every = all(_refused_at_load(readings[b]) for b in (STOCK, UPSTREAM_V1_LAST, UPSTREAM))
        who = "every vLLM build" if every else "this build"
        klass, verdict = REFUSED, f"{REFUSED}: {who} refuses to load the config: {ours.refusal.line}"
        advice.append("fix that field in the drafter's config.json (the reason names it), then run the doctor again")
    elif any("outside" in p for p in taps.problems):
        klass = MISFIT
        verdict = f"{MISFIT}: " + next(p for p in taps.problems if "outside" in p)
        advice.append("pair the drafter with the target it was trained for (--target), or fix target_layer_ids")
    elif any(p.startswith(("recorded: ", "fc width: ")) for p in taps.problems):
        klass = NOT_RUNNABLE
        verdict = f"{NOT_RUNNABLE}: " + "; ".join(
            p.removeprefix("recorded: ") for p in taps.problems if p.startswith(("recorded: ", "fc width: "))
        )
        advice.append("fix target_layer_ids as the line says (the fc's inputs follow the recorded order)")
    elif ours.refusal is not None and ours.refusal.stage == "class":
        serving = [(b, readings[b]) for b in (UPSTREAM, UPSTREAM_V1_LAST) if readings[b].refusal is None]
        where = (
            f"vLLM {serving[0][1].version} serves it ({serving[0][1].model}, {runners[serving[0][0]]})"
            if serving
            else "no vLLM release we know"
        )
        blocking.insert(0, f"{ours.refusal.line} in vLLM 0.20.1 (this build neither): {where}")
        klass, verdict = NOT_RUNNABLE, f"{NOT_RUNNABLE}: " + "; ".join(blocking)
        advice.append("serve it with the release named above" if serving else "check the drafter's architectures")
    elif blocking:
        klass, verdict = NOT_RUNNABLE, f"{NOT_RUNNABLE}: " + "; ".join(blocking)
        advice.append(
            "this build (and stock 0.20.1) would ignore the fields above and compute something else than the drafter "
            "was trained to: serve it with the release that reads them"
        )
    elif ours.refusal is not None and ours.refusal.stage == "here":
        klass, verdict = NOT_RUNNABLE, f"{NOT_RUNNABLE}: {ours.refusal.line}"
        advice.append("check the drafter on a machine that builds its layers (a GPU), or with --prove")
    elif ours.refusal is not None:
        klass, verdict = REFUSED, f"{REFUSED}: {ours.refusal.line}"
        advice.append("change the field the line names in the drafter's config.json, then run the doctor again")
    else:
        if stock.refusal is not None:
            wrong["start"] = []
            words.append(f"stock vLLM 0.20.1 does not start with it: {stock.refusal.line}")
        else:
            assert ours.layers is not None and stock.layers is not None
            fed_ours = taps.ours_recorded if taps.ours_recorded is not None else taps.ours_aux
            fed_stock = taps.stock_recorded if taps.stock_recorded is not None else taps.stock_aux
            pos = _positions(fed_ours, fed_stock)
            if pos:
                wrong["taps"] = pos
            wrong["windows"] = [
                i for i, (a, b) in enumerate(zip(ours.layers, stock.layers, strict=False)) if a.window != b.window
            ]
            wrong["causality"] = [
                i
                for i, (a, b) in enumerate(zip(ours.layers, stock.layers, strict=False))
                if a.window == b.window and a.causal != b.causal
            ]
            wrong = {k: v for k, v in wrong.items() if v}
            words = _stock_words(ours, stock, taps, wrong)
        if wrong:
            served = f"{SERVED} by this build; {STOCK_MISSERVES}"
            advice.append(INSTALL + (f"; {FLASH_ATTN}" if _windowed(ours) else ""))
        else:
            served = f"{SERVED} (by this build and by stock 0.20.1)"
            if _windowed(ours):
                advice.append(FLASH_ATTN[0].upper() + FLASH_ATTN[1:])
        if unknown:
            klass = UNREAD
            names = ", ".join(u.split(" = ", 1)[0] for u in unknown)
            verdict = f"{UNREAD}; these fields are read by no build we know: {names} ({served})"
            advice.insert(0, f"ask the drafter's authors what {names} mean{'s' if len(unknown) == 1 else ''}")
        elif wrong:
            klass, verdict = STOCK_MISSERVES, served + ": " + "; ".join(words)
        else:
            klass, verdict = SERVED, served
    if klass == NOT_RUNNABLE and ours.refusal is None:
        words.append("stock 0.20.1 and this build ignore what is named above")
    return Diagnosis(
        checkpoint=ck.name,
        architecture=arch,
        drafter=kind or "DFlash drafter",
        num_layers=n if isinstance(n, int) and not isinstance(n, bool) else None,
        block_size=block if isinstance(block, int) and not isinstance(block, bool) and block > 1 else None,
        columns={b: readings[b].how for b in BUILDS},
        rows=rows,
        refusals=refusals,
        upstream_runner=runners,
        taps=taps,
        ignored=ignored,
        unknown_fields=unknown,
        not_runnable=(blocking or [verdict.removeprefix(f"{NOT_RUNNABLE}: ")]) if klass == NOT_RUNNABLE else [],
        verdict_class=klass,
        verdict=verdict,
        stock_wrong=wrong,
        stock_words=words,
        advice=advice,
        layer_types=_layer_types(ours),
    )


def _eagle3_words(value: Any) -> str:
    return "has no model" if value is None else "implements SupportsEagle3" if value else "no SupportsEagle3"


def _layer_types(r: col.Reading) -> list[str] | None:
    got = r.loaded.get("layer_types")
    return [str(k) for k in got] if isinstance(got, list) else None


def _refused_at_load(r: col.Reading) -> bool:
    return r.refusal is not None and r.refusal.stage == "load"


def _windowed(r: col.Reading) -> bool:
    return any(x.window is not None or x.causal for x in r.layers or ())


def _window(row: LayerRow) -> str:
    return "-" if row.window is None else f"{row.window} ({row.window_from})"


_TAP_WORDS = (
    ("this build", "ours_aux"),
    ("stock 0.20.1", "stock_aux"),
    ("upstream 0.33.0", "upstream_v1_last_aux"),
    ("upstream 0.34.0", "upstream_aux"),
)


def render_text(d: Diagnosis) -> str:
    """The doctor's printed report."""
    out = [f"drafter: {d.checkpoint}"]
    head = f"  {d.drafter}, architectures {d.architecture}"
    if d.num_layers is not None:
        head += f", {d.num_layers} layers"
    if d.block_size:
        head += f", block_size {d.block_size} (serve with num_speculative_tokens {d.block_size - 1})"
    out += [head, "  each column is its build's own code, run (the drafter built on the meta device):"]
    out += [f"    {b + ':':17} {how}" for b, how in d.columns.items() if how]
    out.append("")
    cols = ("layer", "build", "kind (from)", "window (from)", "causal (from)", "backend window")
    table = [cols]
    order = {b: i for i, b in enumerate(BUILDS)}
    for r in sorted(d.rows, key=lambda r: (r.layer, order[r.build])):
        causal = f"{'causal' if r.causal else 'non-causal'} ({r.causal_from})"
        table.append((str(r.layer), r.build, f"{r.kind} ({r.kind_from})", _window(r), causal, str(r.backend_window)))
    if len(table) > 1:
        widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
        out += ["  " + "  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip() for t in table]
    if any("filled by transformers" in r.kind_from for r in d.rows):
        out.append(
            "  layer_types is not in config.json: transformers fills it (sliding from index max_window_layers on "
            "when use_sliding_window keeps a window, else full) before any build reads it"
        )
    for build, line in d.refusals.items():
        out.append(f"  {build}: does not serve it: {line}")
    for build, runner in d.upstream_runner.items():
        if build not in d.refusals and runner:
            out.append(f"  {build} runner: {runner}")
    t = d.taps
    out += ["", f"target layers the drafter reads: {t.dflash_ids} ({t.ids_from}) -- the outputs of these target layers"]
    if t.target_layers is not None:
        out.append(f"  target: {t.target_layers} layers ({t.target_from})")
    for build, attr in _TAP_WORDS:
        aux = getattr(t, attr)
        if build in d.refusals and aux is None:
            continue
        if aux is None:
            out.append(f"  {build + ':':16} the target model's default layers (no ids it reads)")
        else:
            out.append(f"  {build + ':':16} outputs of layers {_outputs(aux)} (vLLM aux indices {aux})")
    if t.ours_recorded is not None:
        out.append(f"  {'recorded:':16} this build's target records aux {t.ours_recorded}, in its forward's order")
    if t.fc_in is not None:
        out.append(f"  {'fc:':16} this build's drafter fc takes {t.fc_in} features; the target feeds {t.fc_fed}")
    if t.reference_layers is not None:
        out.append(f"  {'reference 0.1.0:':16} outputs of layers {t.reference_layers}, concatenated in that order")
    out += [f"  ! {p}" for p in t.problems]
    if d.ignored or d.unknown_fields:
        out += ["", "carried by the checkpoint, not used by this build:"]
        out += [f"  - {x}" for x in d.ignored]
        out += [f"  - {x} (read by no build we know)" for x in d.unknown_fields]
    out += ["", f"verdict: {d.verdict} (exit {d.exit_code})"]
    if d.stock_words and d.verdict_class != STOCK_MISSERVES:
        out += [f"  on stock 0.20.1: {w}" for w in d.stock_words]
    out += [f"  what to do: {a}" for a in d.advice]
    return "\n".join(out)
