"""The doctor's document: per drafter layer what each build does, the taps, what this build ignores, one verdict.

    diagnose(checkpoint, our_code, target_layers=None, target_source="") -> Diagnosis

This build's column is patch 0002's own resolution run on the config vLLM would load (ours.py); the other columns
are the rules of rules.py. The verdict compares this build with stock 0.20.1 (this build's reading is the trained
semantics: README, "Drafter config fields").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_dflash.doctor import rules
from vllm_dflash.doctor.checkpoint import Checkpoint, extra_weight_files
from vllm_dflash.doctor.ours import OurCode

# Verdict classes and their exit codes (README, "When something goes wrong"). 0 and 20 both mean: this build serves
# the drafter as trained; 20 adds that stock 0.20.1 does not.
SERVED = "served as trained"
STOCK_MISSERVES = "stock mis-serves it"
REFUSED = "refused by our build"
NOT_RUNNABLE = "not a drafter 0.20.1 can run"
VERDICT_EXIT = {SERVED: 0, STOCK_MISSERVES: 20, REFUSED: 21, NOT_RUNNABLE: 22}

BUILDS = ("stock 0.20.1", "this build", "upstream 0.33", "reference 0.1.0")

# dflash_config keys this build (patch 0002 + stock code it keeps) reads; block_size is advice for
# --num-speculative-tokens (k = block_size - 1), which the operator sets.
READ_DFLASH_KEYS = {
    "target_layer_ids",
    "mask_token_id",
    "use_aux_hidden_state",
    "use_swa",
    "swa_window_size",
    "causal",
    "block_size",
}
# Fields that change what the drafter computes and that vLLM 0.20.1 has no code for: (where, key) -> why, and the
# upstream release or PR that runs it.
FEATURES: dict[str, tuple[str, str]] = {
    "attention_sink_bias": ("attention sinks (dflash_config.attention_sink_bias)", "vLLM 0.33.0 (sinks on SWA layers)"),
    "add_swa_attention_sink_bias": ("attention sinks (add_swa_attention_sink_bias)", "vLLM 0.33.0"),
    "conv_kernel_size": ("DFlash2's grouped dynamic convolution", "vLLM >= 0.28 V2 runner (#52816)"),
    "conv_group_size": ("DFlash2's grouped dynamic convolution", "vLLM >= 0.28 V2 runner (#52816)"),
    "selector_rank": ("DFlash2's candidate selector", "vLLM >= 0.28 V2 runner (#52816)"),
    "selector_top_k": ("DFlash2's candidate selector", "vLLM >= 0.28 V2 runner (#52816)"),
    "final_logit_softcapping": ("logit soft-capping", "the dflash reference / vLLM V2 DFlash2 (#52816)"),
    "output_multiplier": ("an output multiplier on the drafter's hidden state", "vLLM V2 DFlash2 (#52816)"),
    "input_embedding_scale": ("an input embedding scale", "the dflash 0.1.0 reference"),
}
_WEIGHT_FEATURES = (
    ("mask_embedding", "a learnt mask embedding", "vLLM 0.33.0 (separate mask embedding, MiMo)"),
    ("attention_sink", "attention sinks", "vLLM 0.33.0"),
    ("candidate_selector", "DFlash2's candidate selector", "vLLM >= 0.28 V2 runner (#52816)"),
    ("attention_conv", "DFlash2's grouped dynamic convolution", "vLLM >= 0.28 V2 runner (#52816)"),
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
    dflash_ids: list[int] | None
    ids_from: str
    ours_aux: list[int] | None  # vLLM aux indices (input of layer k = output of layer k - 1)
    stock_aux: list[int] | None
    reference_layers: list[int] | None  # output of target layer L
    target_layers: int | None
    target_from: str
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Diagnosis:
    checkpoint: str
    architecture: str
    num_layers: int
    block_size: int | None
    resolution_source: str
    rows: list[LayerRow]
    refusals: dict[str, str]  # build -> the line it prints (builds that do not serve it)
    upstream_runner: str
    taps: Taps
    ignored: list[str]
    not_runnable: list[str]  # features 0.20.1 cannot run, each with who can
    verdict_class: str
    verdict: str
    stock_wrong: dict[str, list[int]]  # "taps" / "windows" / "causality" -> layers (taps: tap positions)

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT[self.verdict_class]

    @property
    def mismatch(self) -> str:
        """A drafter/target mismatch (taps beyond the target's layers): no build can serve this pair."""
        return next((p for p in self.taps.problems if "outside" in p), "")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "exit_code": self.exit_code}, indent=1)


def _rows(build: str, layers: list[rules.Layer]) -> list[LayerRow]:
    return [
        LayerRow(i, build, x.kind, x.kind_from, x.window, x.window_from, x.causal, x.causal_from, x.backend_window)
        for i, x in enumerate(layers)
    ]


def _ours(code: OurCode, raw: Mapping[str, Any]) -> list[rules.Layer] | rules.Refusal:
    cfg = rules.loaded_config(raw)
    dflash = dict(cfg.dflash_config or {})
    try:
        resolved = code.resolve(cfg, lambda: raw)
    except ValueError as exc:
        return rules.Refusal(str(exc), code.source)
    refusal = code.check_ids(cfg, {**dict(getattr(cfg, "eagle_config", None) or {}), **dflash})
    if refusal:
        return rules.Refusal(refusal, code.source)
    return [rules.Layer(x.kind, x.window, x.causal, x.kind_from, x.window_from, x.causal_from) for x in resolved]


def _features(ck: Checkpoint) -> tuple[list[str], list[str]]:
    """(ignored, not_runnable): what the checkpoint carries that this build does not read, and of that what
    changes the computation (so 0.20.1 cannot serve the drafter as trained)."""
    raw = ck.config
    dflash = raw.get("dflash_config") or {}
    ignored: list[str] = []
    blocking: list[str] = []
    for key in sorted(dflash):
        if key in READ_DFLASH_KEYS:
            continue
        if key in FEATURES and dflash[key] not in (False, None, 0, 1.0):
            what, who = FEATURES[key]
            blocking.append(f"{what}: {who}")
            ignored.append(f"dflash_config.{key} = {json.dumps(dflash[key])} ({what}; ignored by this build)")
        else:
            ignored.append(f"dflash_config.{key} = {json.dumps(dflash[key])} (unknown to this build; ignored)")
    for key in sorted(k for k in FEATURES if k in raw):
        if raw[key] not in (False, None, 0, 1.0):
            what, who = FEATURES[key]
            blocking.append(f"{what}: {who}")
            ignored.append(f"{key} = {json.dumps(raw[key])} ({what}; ignored by this build)")
    for name in extra_weight_files(ck.files):
        hit = next((w for w in _WEIGHT_FEATURES if w[0] in name), None)
        ignored.append(f"file {name} (never loaded by this build)")
        if hit:
            blocking.append(f"{hit[1]} ({name}): {hit[2]}")
        else:
            blocking.append(f"extra weights {name}, meaning unknown: none known")
    for prefix, what, who in _WEIGHT_FEATURES:
        names = [t for t in ck.tensors or () if prefix in t]
        if names:
            ignored.append(f"{len(names)} weight(s) {names[0]}{', ...' if len(names) > 1 else ''} (not loaded)")
            blocking.append(f"{what} (weights {prefix}*): {who}")
    return ignored, list(dict.fromkeys(blocking))


def _taps(ck: Checkpoint, code: OurCode, target_layers: int | None, target_from: str) -> Taps:
    raw = ck.config
    dflash = raw.get("dflash_config") or {}
    eagle = raw.get("eagle_aux_hidden_state_layer_ids")  # read by the runner at the top level only
    if eagle:
        # The runner prefers these (vLLM's own indexing) over dflash_config ids, in every build: no shift.
        aux = [int(i) for i in eagle]
        target = target_layers if target_layers is not None else raw.get("num_target_layers")
        return Taps(
            [i - 1 for i in aux],
            "eagle_aux_hidden_state_layer_ids - 1",
            aux,
            aux,
            rules.reference_ids(raw),
            target,
            target_from or "num_target_layers",
        )
    if "dflash_config.target_layer_ids" in ck.unknown:
        ids: list[int] | None = None
        ids_from = "unknown (no public source)"
    elif "target_layer_ids" in dflash:
        ids = [int(i) for i in dflash["target_layer_ids"]]
        ids_from = "aux_hidden_state_layer_ids - 1 (speculators)" if ck.speculators else "dflash_config"
    elif raw.get("target_layer_ids") is not None:
        ids, ids_from = [int(i) for i in raw["target_layer_ids"]], "top level only"
    else:
        ids, ids_from = None, "absent"
    if target_layers is None and raw.get("num_target_layers") is not None:
        target_layers, target_from = int(raw["num_target_layers"]), "num_target_layers in the drafter's config.json"
    in_dflash = ids is not None and ids_from != "top level only"
    ours = code.taps(dflash) if in_dflash else None
    stock: list[int] | None
    if ck.speculators and ids is not None:
        stock = [i + 1 for i in ids]  # speculators: ids already in vLLM's indexing, stock taps them right
    else:
        stock = rules.stock_taps(ids) if in_dflash else None
    problems = []
    if ids_from == "absent":
        problems.append(
            "no target_layer_ids: vLLM taps the target model's default aux layers, the reference "
            "build_target_layer_ids(num_target_layers, num_hidden_layers): set dflash_config.target_layer_ids"
        )
    if ids is not None and target_layers is not None:
        bad = [i for i in ids if not 0 <= i < target_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} outside the target's {target_layers} layers (0..{target_layers - 1})"
            )
        elif target_layers - 1 in ids:
            problems.append(
                f"a tap on the last target layer ({target_layers - 1}): vLLM records it before the final norm, the "
                "reference after it"
            )
    return Taps(ids, ids_from, ours, stock, rules.reference_ids(raw), target_layers, target_from, problems)


def _span(layers: list[int]) -> str:
    return ", ".join(str(i) for i in layers)


def diagnose(
    ck: Checkpoint,
    code: OurCode,
    target_layers: int | None = None,
    target_from: str = "",
    target_architectures: tuple[str, ...] = (),
) -> Diagnosis:
    raw = ck.config
    arch = "/".join(rules._architectures(raw)) or "(none)"
    n = int(raw.get("num_hidden_layers", 0))
    dflash = raw.get("dflash_config") or {}
    block = dflash.get("block_size", raw.get("block_size"))
    results: dict[str, list[rules.Layer] | rules.Refusal] = {
        "stock 0.20.1": rules.stock_0_20_1(raw),
        "this build": _ours(code, raw),
        "upstream 0.33": rules.upstream_0_33(raw),
        "reference 0.1.0": rules.reference_0_1_0(raw),
    }
    rows: list[LayerRow] = []
    refusals: dict[str, str] = {}
    for build in BUILDS:
        r = results[build]
        if isinstance(r, rules.Refusal):
            refusals[build] = f"{r.line} [{r.source}]"
        else:
            rows += _rows(build, r)
    up = results["upstream 0.33"]
    runner = rules.upstream_runner_note(raw, up) if not isinstance(up, rules.Refusal) else "refused"
    taps = _taps(ck, code, target_layers, target_from)
    ignored, blocking = _features(ck)
    if target_architectures and not set(target_architectures) & set(rules.AUX_TARGETS_0_20_1):
        blocking.append(
            f"target {'/'.join(target_architectures)} records no auxiliary hidden states in vLLM 0.20.1 "
            f"(no SupportsEagle3) [{rules.SRC_AUX_TARGETS}]: a vLLM release whose model implements it (not checked)"
        )
    if "DFlash2DraftModel" in rules._architectures(raw):
        blocking.insert(0, "DFlash2DraftModel is not registered in vLLM 0.20.1: vLLM >= 0.28 V2 runner (#52816)")
    stock = results["stock 0.20.1"]
    if isinstance(stock, rules.Refusal) and not blocking:
        blocking.append(f"{stock.line}: see upstream")

    ours = results["this build"]
    wrong: dict[str, list[int]] = {}
    if blocking:
        klass = NOT_RUNNABLE
        verdict = f"{NOT_RUNNABLE}: " + "; ".join(blocking)
    elif isinstance(ours, rules.Refusal):
        klass, verdict = REFUSED, f"{REFUSED}: {ours.line}"
    else:
        assert not isinstance(stock, rules.Refusal)
        if taps.ours_aux is not None and taps.stock_aux is not None:
            wrong["taps"] = [i for i, (a, b) in enumerate(zip(taps.ours_aux, taps.stock_aux, strict=True)) if a != b]
        wrong["windows"] = [i for i, (a, b) in enumerate(zip(ours, stock, strict=True)) if a.window != b.window]
        wrong["causality"] = [
            i for i, (a, b) in enumerate(zip(ours, stock, strict=True)) if a.window == b.window and a.causal != b.causal
        ]
        wrong = {k: v for k, v in wrong.items() if v}
        parts = []
        if "taps" in wrong:
            parts.append(f"taps ({len(wrong['taps'])} of {len(taps.ours_aux or [])} one target layer early)")
        if "windows" in wrong:
            w = wrong["windows"]
            parts.append(
                f"windows (layer{'s' if len(w) > 1 else ''} {_span(w)} run full attention instead of "
                + ", ".join(
                    sorted({f"{'causal' if ours[i].causal else 'non-causal'} window {ours[i].window}" for i in w})
                )
                + ")"
            )
        if "causality" in wrong:
            c = wrong["causality"]
            parts.append(f"causality (layer{'s' if len(c) > 1 else ''} {_span(c)} run non-causal instead of causal)")
        if parts:
            klass, verdict = STOCK_MISSERVES, f"{SERVED} by this build; {STOCK_MISSERVES}: " + ", ".join(parts)
        else:
            klass, verdict = SERVED, f"{SERVED} (by this build and by stock 0.20.1)"
    return Diagnosis(
        checkpoint=ck.name,
        architecture=arch,
        num_layers=n,
        block_size=int(block) if block is not None else None,
        resolution_source=code.source,
        rows=rows,
        refusals=refusals,
        upstream_runner=runner,
        taps=taps,
        ignored=ignored,
        not_runnable=blocking,
        verdict_class=klass,
        verdict=verdict,
        stock_wrong=wrong,
    )


def _window(row: LayerRow) -> str:
    return "-" if row.window is None else f"{row.window} ({row.window_from})"


def render_text(d: Diagnosis) -> str:
    """The doctor's printed report."""
    out = [
        f"drafter: {d.checkpoint}",
        f"  {d.architecture}, {d.num_layers} layers"
        + (
            f", block_size {d.block_size} (serve with --speculative-config num_speculative_tokens {d.block_size - 1})"
            if d.block_size
            else ""
        ),
    ]
    out.append(f"  this build's resolution: {d.resolution_source} (the patch's own code)")
    out.append("")
    head = ("layer", "build", "kind (from)", "window (from)", "causal (from)", "backend window")
    table = [head]
    for r in d.rows:
        table.append(
            (
                str(r.layer),
                r.build,
                f"{r.kind} ({r.kind_from})",
                _window(r),
                f"{'causal' if r.causal else 'non-causal'} ({r.causal_from})",
                str(r.backend_window),
            )
        )
    order = {b: i for i, b in enumerate(BUILDS)}
    body = sorted(table[1:], key=lambda t: (int(t[0]), order[t[1]]))
    widths = [max(len(t[i]) for t in [head, *body]) for i in range(len(head))]
    for t in [head, *body]:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    out.append(
        f"  sources: stock [{rules.SRC_STOCK_MODEL}; {rules.SRC_STOCK_PROPOSER}]; upstream [{rules.SRC_UPSTREAM}];"
    )
    out.append(f"           reference [{rules.SRC_REFERENCE}]; loaded config [{rules.SRC_TRANSFORMERS}]")
    for build, line in d.refusals.items():
        out.append(f"  {build}: does not serve it: {line}")
    if "upstream 0.33" not in d.refusals:
        out.append(f"  upstream 0.33 runner: {d.upstream_runner}")
    taps = d.taps
    out.append("")
    out.append(f"taps: target_layer_ids {taps.dflash_ids} ({taps.ids_from}); DFlash id L = output of target layer L")
    if taps.target_layers is not None:
        out.append(f"  target: {taps.target_layers} layers ({taps.target_from})")
    if taps.ours_aux is not None:
        out.append(
            f"  this build:      aux {taps.ours_aux} = output of layers {[i - 1 for i in taps.ours_aux]} (patch 0001)"
        )
    else:
        out.append("  this build:      no dflash_config.target_layer_ids")
    if taps.stock_aux is not None:
        out.append(
            f"  stock 0.20.1:    aux {taps.stock_aux} = output of layers {[i - 1 for i in taps.stock_aux]}"
            f" [{rules.SRC_STOCK_TAPS}]"
        )
    if taps.stock_aux is None:
        out.append("  stock 0.20.1:    no dflash_config.target_layer_ids: the target model's default aux layers")
    if taps.dflash_ids is not None:
        up = (
            [i + 1 for i in taps.dflash_ids]
            if taps.ids_from != "eagle_aux_hidden_state_layer_ids - 1"
            else taps.ours_aux
        )
        out.append(f"  upstream 0.33:   aux {up} (dflash_config first, then top level; +1 since 0.22.0, #40727)")
    out.append(f"  reference 0.1.0: output of layers {taps.reference_layers} [{rules.SRC_REFERENCE_IDS}]")
    for p in taps.problems:
        out.append(f"  ! {p}")
    if d.ignored:
        out.append("")
        out.append("carried by the checkpoint, not used by this build:")
        out += [f"  - {x}" for x in d.ignored]
    out.append("")
    out.append(f"verdict: {d.verdict}")
    return "\n".join(out)
