"""What each build does with each field a DFlash drafter checkpoint carries: the one table the verdict reads.

    classify(raw, files, tensors, measured=None) -> Fields
    ablations(raw) -> [(field, config without it)]          (what measure() compares: fields of 2026 checkpoints)
    measure(answers, variants) -> {field: Measured}          (each build's own code with and without the field)

Per field (top level, in `dflash_config`, a file beside the weights, or a weight name): READ by this build, IGNORED
and harmless, or IGNORED although it CHANGES what the drafter computes, in which case `reader` names the release and
file that reads it and `active(value)` says when the value changes the computation (the same test the reading code
applies: e.g. vLLM 0.33.0 turns attention sinks on for any truthy `attention_sink_bias`, so `1` and `"yes"` count, and
`false` never does). A field in no table is UNKNOWN: read by no build we know.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_dflash.doctor.columns import NOT_BUILT_HERE

READ = "read"
HARMLESS = "ignored (harmless)"
CHANGES = "ignored, but changes the computation"
UNKNOWN = "read by no build we know"

V033 = "vLLM 0.33.0"
V033_DFLASH = f"{V033} vllm/model_executor/models/qwen3_dflash.py"
V033_DFLASH2 = f"{V033} vllm/model_executor/models/qwen3_dflash2.py (V2 runner, #52816)"
V033_SPECULATORS = f"{V033} vllm/transformers_utils/configs/speculators/algos.py update_dflash"
REF = "dflash 0.1.0 dflash/model.py"


def _truthy(value: Any) -> bool:
    return bool(value)


def _not_one(value: Any) -> bool:
    """A scale that is not exactly 1 (a bool or a number 1 multiplies by one; a string is no scale: it counts)."""
    if isinstance(value, (int, float)):
        return float(value) != 1.0
    return value is not None


def _positive(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value > 0
    return value is not None


def _present(value: Any) -> bool:
    return value is not None


def _falsy_present(value: Any) -> bool:
    return not value


@dataclass(frozen=True)
class Feature:
    """A field this build ignores although it changes the computation."""

    what: str  # in an operator's words
    reader: str  # the release (and file) that reads it
    active: Callable[[Any], bool]  # when the value changes the computation


# Fields 0.20.1 and this build never read that change what the drafter computes, by spelling.
FEATURES_DFLASH: dict[str, Feature] = {
    "attention_sink_bias": Feature("attention sinks on the drafter's attention", V033_DFLASH, _truthy),
    "attention_value_scale": Feature("a scale on the attention values", V033_DFLASH, _not_one),
    "input_embedding_scale": Feature("a scale on the input embeddings", f"{V033_DFLASH2}; {REF}", _not_one),
    "output_multiplier": Feature("a multiplier on the drafter's logits", f"{V033_DFLASH2}; {REF}", _not_one),
    "final_logit_softcapping": Feature("logit soft-capping", f"{V033_DFLASH2}; {REF}", _positive),
    "conv_kernel_size": Feature("DFlash2's grouped dynamic convolution", V033_DFLASH2, _present),
    "conv_group_size": Feature("DFlash2's grouped dynamic convolution", V033_DFLASH2, _present),
    "selector_rank": Feature("DFlash2's candidate selector", V033_DFLASH2, _present),
    "selector_top_k": Feature("DFlash2's candidate selector", V033_DFLASH2, _present),
}
FEATURES_TOP: dict[str, Feature] = {
    "add_swa_attention_sink_bias": Feature("attention sinks on the drafter's attention", V033_DFLASH, _truthy),
    "is_neox_style": Feature("a rotary embedding layout other than neox", V033_DFLASH, _falsy_present),
    "input_embedding_scale": Feature("a scale on the input embeddings", REF, _not_one),
    "output_multiplier": Feature("a multiplier on the drafter's logits", REF, _not_one),
    "final_logit_softcapping": Feature("logit soft-capping", REF, _positive),
    # speculators format (top level of the speculators config)
    "sample_from_anchor": Feature("drafting from the anchor position", V033_SPECULATORS, _truthy),
    # update_dflash writes dflash_config.causal = not sliding_window_non_causal: true trains non-causal sliding
    # layers, which this build (causal for a declared sliding layer, the field unread) runs causal; false agrees.
    "sliding_window_non_causal": Feature("non-causal sliding-window layers", V033_SPECULATORS, _truthy),
}
# Weights and files this build never loads, by name.
FEATURE_FILES: dict[str, Feature] = {
    "mask_embedding": Feature("a learnt mask embedding", f"{V033_DFLASH} (separate mask embedding, MiMo)", _present),
}
FEATURE_WEIGHTS: dict[str, Feature] = {
    "attention_sink": Feature("attention sinks on the drafter's attention", V033_DFLASH, _present),
    "candidate_selector": Feature("DFlash2's candidate selector", V033_DFLASH2, _present),
    "attention_conv": Feature("DFlash2's grouped dynamic convolution", V033_DFLASH2, _present),
    "mlp_conv": Feature("DFlash2's grouped dynamic convolution", V033_DFLASH2, _present),
}

# What this build reads (its loader, the model, patch 0001/0002, the runner).
READ_TOP = frozenset(
    {
        "architectures",
        "model_type",
        "num_hidden_layers",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "is_causal",
        "dflash_config",
        "eagle_config",
        "eagle_aux_hidden_state_layer_ids",
        "target_layer_ids",  # refused when only here (patch 0002)
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "attention_bias",
        "hidden_act",
        "logit_scale",
        "tie_word_embeddings",
        "torch_dtype",
        "dtype",
        "quantization_config",
        # speculators format
        "speculators_model_type",
        "speculators_config",
        "speculators_version",
        "transformer_layer_config",
        "aux_hidden_state_layer_ids",
        "mask_token_id",
    }
)
READ_DFLASH = frozenset(
    {"target_layer_ids", "mask_token_id", "use_aux_hidden_state", "use_swa", "swa_window_size", "causal", "layer_ids"}
)
# Read by no vLLM but harmless: training and bookkeeping keys, and what only the operator uses.
HARMLESS_TOP = frozenset(
    {
        "attention_dropout",
        "initializer_range",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "num_target_layers",  # the reference's default taps; with dflash_config.target_layer_ids, unused
        "block_size",  # advice for --num-speculative-tokens (k = block_size - 1)
        "layer_norm_eps",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "has_own_lm_head",  # 0.33.0: whether the drafter's lm_head takes its quantization config
    }
)
# Read by transformers' own config loading, by no model: the keys of its base config (PretrainedConfig's fields, as
# `PretrainedConfig().to_dict()` lists them) and the remote-code pointer AutoConfig reads. `auto_map` names custom
# classes that AutoConfig imports only with trust_remote_code and an "AutoConfig" entry, and only for a model_type
# transformers does not know; vLLM's get_config passes trust_remote_code off by default, and model_type qwen3 loads
# transformers' own Qwen3Config. tests/test_doctor_differential.py holds this set against the real transformers of
# both side environments (every base key is in a table; each key here, added to a real config, changes nothing the
# real loader and model read).
SRC_LOADER = (
    "transformers configuration_utils.py PreTrainedConfig (base fields) + models/auto/configuration_auto.py "
    "AutoConfig.from_pretrained (auto_map: custom code only with trust_remote_code)"
)
LOADER_TOP = frozenset(
    {
        "auto_map",
        "_name_or_path",
        "architectures",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
    }
)
HARMLESS_DFLASH = frozenset({"block_size"})  # advice for --num-speculative-tokens (k = block_size - 1)


# ---- 2026's fields: each verdict measured, by building the drafter with and without the field ----------------------


@dataclass(frozen=True)
class Field2026:
    """A field of 2026's DFlash checkpoints: where config.json spells it, and the release and file that reads it (a
    statement `tests/test_doctor.py` checks against the pinned sdists); what it does in each build is measured."""

    spellings: tuple[str, ...]  # paths in config.json ("dflash_config.x": inside dflash_config)
    reader: str
    what: str
    at_load_only: str = ""  # read where no built drafter shows it (said as a rule, not measured)


V034 = "vLLM 0.34.0"
FIELDS_2026: dict[str, Field2026] = {
    "quantization_config": Field2026(
        ("quantization_config",),
        f"{V033} and {V034} vllm/model_executor/models/utils.py get_draft_quant_config (+ "
        "vllm/config/speculative.py); 0.34.0's qwen3_dflash.py skips the raw-weight context path for quantized layers",
        "a quantized drafter (NVFP4, MXFP8, W4A16)",
    ),
    "no_rope_layers": Field2026(
        ("no_rope_layers",),
        f"{V034} vllm/config/speculative.py (DFlash2DraftModel with no_rope_layers -> ricursive_dflash2.py)",
        "layers without rotary embedding (NoPE)",
    ),
    "is_neox_style": Field2026(
        ("is_neox_style",), f"{V033} and {V034} vllm/model_executor/models/qwen3_dflash.py", "the rotary layout"
    ),
    "logit_scale": Field2026(
        ("logit_scale",),
        f"vLLM 0.20.1, {V033} and {V034} vllm/model_executor/models/qwen3_dflash.py (LogitsProcessor scale)",
        "a scale on the drafter's logits",
    ),
    "has_own_lm_head": Field2026(
        ("has_own_lm_head",),
        f"{V033} and {V034} vllm/model_executor/models/qwen3_dflash.py (lm_head quantization) and "
        "vllm/v1/worker/gpu/spec_decode/dflash/utils.py (sharing the target's lm_head)",
        "the drafter's own lm_head",
        at_load_only="whether the target's lm_head is shared is decided when the weights are loaded",
    ),
    "use_aux_hidden_state": Field2026(
        ("use_aux_hidden_state", "dflash_config.use_aux_hidden_state"),
        f"vLLM 0.20.1 (dflash_config only), {V033} and {V034} vllm/model_executor/models/qwen3_dflash.py",
        "the target's hidden states through the fc",
    ),
    "sample_from_anchor": Field2026(
        ("dflash_config.sample_from_anchor", "sample_from_anchor"),
        f"{V033} and {V034} vllm/v1/worker/gpu/spec_decode/dflash/speculator.py (refused) + "
        "vllm/transformers_utils/configs/speculators/algos.py",
        "drafting from the anchor position",
    ),
}


def _get(raw: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    head, _, rest = path.partition(".")
    if not rest:
        return (head in raw, raw.get(head))
    inner = raw.get(head)
    return (isinstance(inner, Mapping) and rest in inner, inner.get(rest) if isinstance(inner, Mapping) else None)


def _without(raw: Mapping[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(raw))
    head, _, rest = path.partition(".")
    if rest:
        out[head] = {k: v for k, v in out[head].items() if k != rest}
    else:
        out.pop(head, None)
    return out


def ablations(raw: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """For each 2026 field the config carries (a speculators config: in its transformer part too), the config
    without it: what measure() compares the config's own reading with."""
    out = []
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else None
    for entry in FIELDS_2026.values():
        for path in entry.spellings:
            if _get(raw, path)[0]:
                out.append((path, _without(raw, path)))
            elif isinstance(layer, Mapping) and _get(layer, path)[0]:
                out.append((path, {**raw, "transformer_layer_config": _without(layer, path)}))
    return out


def repaired(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config with `use_sliding_window: true` when transformers would drop its window (upstream then refuses
    every sliding layer, with and without any field, and so measures nothing): the config as this build reads the
    window. None when there is nothing to repair."""
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    if not isinstance(layer, Mapping) or layer.get("sliding_window") is None or layer.get("use_sliding_window") is True:
        return None
    fixed = {**layer, "use_sliding_window": True}
    return {**raw, "transformer_layer_config": fixed} if layer is not raw else fixed


REPAIRED = "measured on the config with use_sliding_window: true (the window as this build reads it)"


@dataclass(frozen=True)
class Measured:
    """What each build's own code did differently with the field than without it: "reads it: <what changed>",
    "refuses it: <line>", "ignores it" (nothing built changed), or "not computed: <why>"; and, per build, how the
    drafter's projections were built with it (the quantization each linear layer got)."""

    path: str
    effects: Mapping[str, str]
    linears: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def reads(self, build: str) -> bool:
        return self.effects.get(build, "").startswith(("reads it", "refuses it"))


_VOLATILE = {"name", "resolution", "kv", "target_stand_in", "runner", "loaded", "architecture", "read_from"}


def _fingerprint(answer: Mapping[str, Any]) -> Any:
    """What decides the drafter's computation in a build's answer (names and attributions left out)."""

    def clean(x: Any) -> Any:
        if isinstance(x, Mapping):
            return {k: clean(v) for k, v in x.items() if k not in _VOLATILE}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    runs = answer.get("runners")
    return clean(runs if isinstance(runs, Mapping) else answer)


def _diff(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out: list[str] = []
        for k in list(a) + [k for k in b if k not in a]:
            out += _diff(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += _diff(x, y, f"{where}[{i}]")
        return out
    return [] if a == b else [f"{where}: {json.dumps(a)} (without it: {json.dumps(b)})"]


def _primary(answer: Mapping[str, Any]) -> Mapping[str, Any]:
    runs = answer.get("runners")
    if not isinstance(runs, Mapping):
        return answer
    got: Any = runs.get("v2") or runs.get("default") or next(iter(runs.values()), {})
    return got if isinstance(got, Mapping) else {}


def _rule_active(path: str, value: Any) -> bool:
    """Where no build measured it: whether the value changes the computation, as the feature table says (a value
    equal to the default changes nothing)."""
    feature = FEATURES_TOP.get(path) or (FEATURES_DFLASH.get(path.removeprefix("dflash_config.")))
    return feature.active(value) if feature is not None else _present(value)


def _refused(answer: Mapping[str, Any]) -> str:
    rec = _primary(answer)
    return str(rec.get("load_error") or rec.get("model_error") or rec.get("init_error") or rec.get("class_error") or "")


def _linears(answer: Mapping[str, Any] | None) -> dict[str, str]:
    """How the built drafter's projections were quantized: qkv_proj of layer 0, the fc, the lm_head."""
    if not answer:
        return {}
    rec = _primary(answer)
    layers = rec.get("layers") or [{}]
    first = layers[0] if isinstance(layers[0], Mapping) else {}  # the reference's layers are [kind, window, causal]
    got = rec.get("model")
    model: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
    out = {}
    for name, lin in (("qkv_proj", first.get("qkv")), ("fc", model.get("fc")), ("lm_head", model.get("lm_head"))):
        if isinstance(lin, Mapping):
            out[name] = str(lin.get("quant_method"))
    return out


def _effect(with_: Mapping[str, Any] | None, without: Mapping[str, Any] | None) -> str:
    if not with_ or not without:
        return "not computed: no answer"
    a, b = _fingerprint(with_), _fingerprint(without)
    changes = _diff(a, b)
    here = [c for c in changes if any(m in c.split(" (without it", 1)[0] for m in NOT_BUILT_HERE)]
    if here:
        return "not computed: not built here: " + here[0]
    either = _refused(with_)
    if not changes and either:
        return f"not computed: it refuses the config with the field and without it ({either})"
    unbuilt = str(_primary(with_).get("speculator_error") or "")
    if not changes and unbuilt.startswith("not built here"):
        return f"its drafter ignores it; its V2 speculator is not measured ({unbuilt})"
    if not changes:
        return "ignores it"
    refused = [c for c in changes if ("_error" in c.split(":")[0]) and not c.split(": ", 1)[1].startswith("null")]
    if refused:
        return "refuses it: " + refused[0]
    more = f" (and {len(changes) - 2} more)" if len(changes) > 2 else ""
    return "reads it: " + "; ".join(changes[:2]) + more


def measure(
    answers: Mapping[str, Mapping[str, Any]],
    variants: Mapping[str, Mapping[str, Mapping[str, Any]]],
    repaired_answers: Mapping[str, Mapping[str, Any]] | None = None,
    repaired_variants: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
) -> dict[str, Measured]:
    """`answers`: each build's answer to the config; `variants`: path -> each build's answer to the config without
    that field; the same for the repaired config (`repaired`), used for a build that refuses the config either way.
    Per field, what each build's code did with it."""
    repaired_answers = repaired_answers or {}
    repaired_variants = repaired_variants or {}
    out = {}
    for path, without in variants.items():
        effects = {}
        entry = next((e for e in FIELDS_2026.values() if path in e.spellings), None)
        by_speculator = entry is not None and "speculator.py" in entry.reader
        for b in answers:
            effect = _effect(answers.get(b), without.get(b))
            if effect.startswith("its drafter ignores it") and not by_speculator:
                effect = "ignores it"  # no speculator reads this field: the drafter's is the whole reading
            again = repaired_variants.get(path, {}).get(b)
            if "refuses the config with the field and without it" in effect and again is not None:
                second = _effect(repaired_answers.get(b), again)
                if second.startswith("its drafter ignores it") and not by_speculator:
                    second = "ignores it"
                effect = effect if second.startswith("not computed") else f"{second} ({REPAIRED})"
            effects[b] = effect
        out[path] = Measured(path, effects, {b: _linears(answers.get(b)) for b in answers})
    return out


@dataclass(frozen=True)
class Hit:
    """One field of the checkpoint that changes the computation and that this build ignores."""

    name: str  # e.g. "dflash_config.attention_sink_bias" or "file mask_embedding.pt"
    value: str
    feature: Feature


@dataclass(frozen=True)
class Fields:
    blocking: list[Hit] = field(default_factory=list)  # ignored, and they change the computation
    harmless: list[str] = field(default_factory=list)  # ignored and harmless (also inactive feature values)
    unknown: list[str] = field(default_factory=list)  # in no table


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) or len(value) < 60 else json.dumps(value[:57] + "...")
    return text if len(text) <= 80 else text[:77] + "..."


def classify(
    raw: Mapping[str, Any],
    files: tuple[str, ...] = (),
    tensors: tuple[str, ...] | None = None,
    measured: Mapping[str, Measured] | None = None,
) -> Fields:
    """The checkpoint's fields through the table. `raw` is config.json as written (for a speculators config, its top
    level and its transformer part are both classified). A 2026 field with a measurement gets its verdict from it:
    ignored by this build while a release's code reads or refuses it -> changes the computation (named with what
    changed); read by this build -> read; read by no build -> read by no build we know."""
    out = Fields()
    done: set[str] = set()
    for path, m in (measured or {}).items():
        entry = next(e for e in FIELDS_2026.values() if path in e.spellings)
        done.add(path)
        here, value = _get(raw, path)
        if not here and isinstance(raw.get("transformer_layer_config"), Mapping):
            here, value = _get(raw["transformer_layer_config"], path)
        ours = m.effects.get("this build", "")
        others = {b: e for b, e in m.effects.items() if b.startswith("upstream") and m.reads(b)}
        unmeasured = [b for b, e in m.effects.items() if b.startswith("upstream") and "refuses the config" in e]
        quant = _quantized(path, m) if path == "quantization_config" else ""
        if quant:
            out.blocking.append(Hit(path, _short(value), Feature(entry.what, f"{entry.reader}; {quant}", _present)))
        elif ours.startswith("not computed") or not ours:
            out.unknown.append(f"{path} = {_short(value)} (not measured: {ours or 'no answer'})")
        elif m.reads("this build"):
            out.harmless.append(f"{path} = {_short(value)} (read by this build, measured: {ours})")
        elif others:
            said = "; ".join(f"{b} {e}" for b, e in others.items())
            out.blocking.append(
                Hit(path, _short(value), Feature(entry.what, f"{entry.reader} (measured: {said})", _present))
            )
        elif entry.at_load_only and not unmeasured:
            out.harmless.append(
                f"{path} = {_short(value)} (no drafter built here changes with it; {entry.at_load_only}: "
                f"{entry.reader}, a rule, not measured)"
            )
        elif unmeasured:
            said = f"{' and '.join(unmeasured)} refuse this config either way, so who reads it is the table's word"
            rule = f"{entry.reader} ({said}: a rule, not measured)"
            if _rule_active(path, value):
                out.blocking.append(Hit(path, _short(value), Feature(entry.what, rule, _present)))
            else:
                out.harmless.append(f"{path} = {_short(value)} ({entry.what}: this value changes nothing; {rule})")
        elif entry.at_load_only:
            out.harmless.append(
                f"{path} = {_short(value)} (no drafter built here changes with it; {entry.at_load_only}: "
                f"{entry.reader}, a rule, not measured)"
            )
        elif not _rule_active(path, value):
            out.harmless.append(f"{path} = {_short(value)} ({entry.what}: the default; no build's drafter changes)")
        else:
            out.unknown.append(f"{path} = {_short(value)} (no build's drafter changes with it, measured)")
    layers = [raw]
    inner = raw.get("transformer_layer_config")
    if "speculators_model_type" in raw and isinstance(inner, Mapping):
        layers.append(inner)
    for cfg in layers:
        for key in cfg:
            if key in done:
                continue
            if key in FEATURES_TOP:
                _feature(out, key, cfg[key], FEATURES_TOP[key])
            elif key not in READ_TOP and key not in HARMLESS_TOP and key not in LOADER_TOP:
                out.unknown.append(f"{key} = {_short(cfg[key])}")
        dflash = cfg.get("dflash_config")
        if not isinstance(dflash, Mapping):
            continue
        for key in dflash:
            name = f"dflash_config.{key}"
            if name in done:
                continue
            if key in FEATURES_DFLASH:
                _feature(out, name, dflash[key], FEATURES_DFLASH[key])
            elif key in HARMLESS_DFLASH:
                out.harmless.append(f"{name} = {_short(dflash[key])}")
            elif key not in READ_DFLASH:
                out.unknown.append(f"{name} = {_short(dflash[key])}")
    _sinks_precedence(out, raw, layers)
    for name in files:
        hit = next((f for key, f in FEATURE_FILES.items() if key in name), None)
        if hit:
            out.blocking.append(Hit(f"file {name}", "present", hit))
        else:
            out.unknown.append(f"file {name} (weights this build never loads)")
    for prefix, feature in FEATURE_WEIGHTS.items():
        names = [t for t in tensors or () if prefix in t]
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.blocking.append(Hit(f"weights {names[0]}{more}", "present", feature))
    return out


# vLLM 0.20.1's drafter multiplies qkv_proj.weight itself (F.linear in DFlashQwen3Attention.forward) and slices it
# for the context K/V (_build_fused_kv_buffers): right only for a plain float weight. A rule read from its code; the
# weight's dtype and shape are what the built drafter reports.
SRC_RAW_WEIGHT = (
    "vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py forward (F.linear on qkv_proj.weight) and "
    "_build_fused_kv_buffers (slices it): a rule read from the code, not run"
)


def _quantized(path: str, m: Measured) -> str:
    """A quantized drafter on this build: the projections as built here (measured) against vLLM 0.34.0's, and the
    raw-weight path of 0.20.1's drafter (a rule). "" when the config quantizes nothing this build builds."""
    ours = m.linears.get("this build") or {}
    newest = m.linears.get("upstream 0.34.0") or {}
    effect = m.effects.get("this build", "")
    if effect.startswith("not computed"):
        return f"its quantized layers are not built here ({effect}); {SRC_RAW_WEIGHT}"
    if not m.reads("this build") and not any(m.reads(b) for b in m.effects if b.startswith("upstream")):
        return ""
    plain = "UnquantizedLinearMethod"
    built = ", ".join(f"{k} {v}" for k, v in ours.items())
    if ours.get("qkv_proj", plain) != plain:
        return f"this build quantizes qkv_proj ({built}; measured), which {SRC_RAW_WEIGHT}"
    if newest.get("qkv_proj", plain) != plain:
        return (
            f"this build builds qkv_proj unquantized where vLLM 0.34.0 quantizes it ({built}; 0.34.0: "
            f"{', '.join(f'{k} {v}' for k, v in newest.items())}; measured): the checkpoint's quantized qkv weights "
            "do not fit it"
        )
    return f"this build's drafter: {built} (measured); {SRC_RAW_WEIGHT}"


def _feature(out: Fields, name: str, value: Any, feature: Feature) -> None:
    if feature.active(value):
        out.blocking.append(Hit(name, _short(value), feature))
    else:
        out.harmless.append(f"{name} = {_short(value)} ({feature.what}: this value changes nothing)")


def _sinks_precedence(out: Fields, raw: Mapping[str, Any], layers: list[Mapping[str, Any]]) -> None:
    """vLLM 0.33.0 reads dflash_config.attention_sink_bias first and the top-level add_swa_attention_sink_bias only
    without it: a top-level flag that the dflash_config one overrides decides nothing."""
    for cfg in layers:
        dflash = cfg.get("dflash_config")
        if isinstance(dflash, Mapping) and "attention_sink_bias" in dflash and "add_swa_attention_sink_bias" in cfg:
            top = [h for h in out.blocking if h.name == "add_swa_attention_sink_bias"]
            for h in top:
                out.blocking.remove(h)
                out.harmless.append(f"{h.name} = {h.value} (overridden by dflash_config.attention_sink_bias)")


FIELDS_BEGIN = "<!-- fields-table:begin (generated from the doctor's run on tests/doctor_issue39.py; do not edit) -->"
FIELDS_END = "<!-- fields-table:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_fields_table(rows: list[tuple[str, str, Measured | None, int]]) -> str:
    """docs/doctor.md's table of 2026's fields: per (field, value) of the Qwen3.6-27B-DFlash shape, the release and
    file that reads it, what this build's, vLLM 0.33.0's and 0.34.0's code did with it (measured: the drafter built
    with and without it), and the doctor's verdict."""
    out = [
        FIELDS_BEGIN,
        "| field = value | read by (release and file) | this build | vLLM 0.33.0 | vLLM 0.34.0 | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, value, m, code in rows:
        entry = next(e for e in FIELDS_2026.values() if name in e.spellings)
        got = [m.effects.get(b, "-") if m else "-" for b in ("this build", "upstream 0.33.0", "upstream 0.34.0")]
        cells = [f"`{name}` = `{value}`", entry.reader, *got, str(code)]
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    out.append(FIELDS_END)
    return "\n".join(out)
