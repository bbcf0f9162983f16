"""What each build does with each field a DFlash drafter checkpoint carries: the one table the verdict reads.

    classify(raw, files, tensors) -> Fields

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


def classify(raw: Mapping[str, Any], files: tuple[str, ...] = (), tensors: tuple[str, ...] | None = None) -> Fields:
    """The checkpoint's fields through the table. `raw` is config.json as written (for a speculators config, its top
    level and its transformer part are both classified)."""
    out = Fields()
    layers = [raw]
    inner = raw.get("transformer_layer_config")
    if "speculators_model_type" in raw and isinstance(inner, Mapping):
        layers.append(inner)
    for cfg in layers:
        for key in cfg:
            if key in FEATURES_TOP:
                _feature(out, key, cfg[key], FEATURES_TOP[key])
            elif key not in READ_TOP and key not in HARMLESS_TOP and key not in LOADER_TOP:
                out.unknown.append(f"{key} = {_short(cfg[key])}")
        dflash = cfg.get("dflash_config")
        if not isinstance(dflash, Mapping):
            continue
        for key in dflash:
            name = f"dflash_config.{key}"
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
