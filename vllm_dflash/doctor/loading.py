"""How each system turns a drafter's config.json into the config object its model code reads.

    loaded(raw, loader) -> Loaded    (the attributes the model code sees, or the loader's refusal)

Loaders: `VLLM` (vLLM 0.20.1 and 0.33.0's speculative config for method dflash: `get_config`, whose transformers class
follows `model_type` -- or SpeculatorsConfig for a speculators-format config, via its `update_dflash` -- then
`EAGLEConfig(..., method="dflash")`), and `REFERENCE` (dflash 0.1.0's `DFlashDraftModel.from_pretrained`: its
config_class, transformers' Qwen3Config, whatever `model_type` says). The transformers behaviour is its strict
dataclass configs: typed fields checked exactly (a JSON `1` is no bool, `true` no int), `sliding_window` kept only
with `use_sliding_window`, a missing `layer_types` filled from `max_window_layers`, then `layer_types` checked against
`num_hidden_layers` and the layer kinds transformers knows.

These are rules, not the code: `tests/test_doctor_differential.py` holds them against the real loaders (transformers
5.24.0 in the vLLM 0.20.1 CPU environment, 5.15.0 in the reference environment) on generated configs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
VLLM = "vllm"
REFERENCE = "reference 0.1.0"
STOCK, OURS, UPSTREAM = "stock 0.20.1", "this build", "upstream 0.33"
# Where each statement comes from.
SRC_TRANSFORMERS = (
    "transformers models/qwen3/configuration_qwen3.py Qwen3Config.__post_init__ (sliding_window only with "
    "use_sliding_window; layer_types filled from max_window_layers) + configuration_utils.py validate_layer_type"
)
SRC_VLLM_LOAD = (
    "vllm 0.20.1 vllm/transformers_utils/config.py get_config + vllm/config/speculative.py (EAGLEConfig, method "
    "dflash) + vllm/transformers_utils/configs/speculators/algos.py update_dflash"
)
SRC_REFERENCE_LOAD = "dflash 0.1.0 dflash/model.py DFlashDraftModel.config_class = Qwen3Config"

# transformers' configuration_utils.ALLOWED_ATTN_LAYER_TYPES: 5.24.0 (vLLM 0.20.1's CPU environment) and 5.15.0
# (dflash 0.1.0's [local] pin). A kind outside the list is refused at load.
ALLOWED_LAYER_TYPES = {
    VLLM: (
        "full_attention",
        "sliding_attention",
        "chunked_attention",
        "window_attention",
        "indexed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "minimax_m3_sparse",
        "conv",
        "moe",
        "hybrid",
        "hybrid_sliding",
        "reference_sliding_attention",
        "linear_attention",
    ),
    REFERENCE: (
        "full_attention",
        "sliding_attention",
        "chunked_attention",
        "window_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "minimax_m3_sparse",
        "conv",
        "moe",
        "hybrid",
        "hybrid_sliding",
        "deepseek_sparse_attention",
        "linear_attention",
    ),
}

# Typed fields of the config classes that a drafter config.json sets, as the strict dataclasses check them:
# name -> (accepted JSON types, default when absent).
_INT = "int"
_BOOL = "bool"
_LIST_STR = "list[str]"
_NONE = "None"
_BASE: dict[str, tuple[tuple[str, ...], Any]] = {"architectures": ((_LIST_STR, _NONE), None)}
QWEN3_FIELDS: dict[str, tuple[tuple[str, ...], Any]] = {
    **_BASE,
    "num_hidden_layers": ((_INT,), 32),
    "use_sliding_window": ((_BOOL,), False),
    "sliding_window": ((_INT, _NONE), 4096),
    "max_window_layers": ((_INT,), 28),
    "layer_types": ((_LIST_STR, _NONE), None),
}
LLAMA_FIELDS: dict[str, tuple[tuple[str, ...], Any]] = {**_BASE, "num_hidden_layers": ((_INT,), 32)}
# The size fields, checked only when config.json sets them (their defaults are no reading of ours). Measured with
# Qwen3Config(**{name: value}) / LlamaConfig(...) under transformers 5.15.0 and 5.25.0: a string, a float for an
# int, an int for rms_norm_eps and a null head_dim (Qwen3) are all refused (StrictDataclassFieldValidationError).
_FLOAT = "float"
_SIZES: dict[str, tuple[str, ...]] = {
    "hidden_size": (_INT,),
    "intermediate_size": (_INT,),
    "num_attention_heads": (_INT,),
    "num_key_value_heads": (_INT, _NONE),
    "vocab_size": (_INT,),
    "max_position_embeddings": (_INT,),
    "rms_norm_eps": (_FLOAT,),
}
SIZE_FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "Qwen3Config": {**_SIZES, "head_dim": (_INT,)},
    "LlamaConfig": {**_SIZES, "head_dim": (_INT, _NONE)},
}
CONFIG_CLASSES = {"qwen3": ("Qwen3Config", QWEN3_FIELDS), "llama": ("LlamaConfig", LLAMA_FIELDS)}
MODEL_CLASSES = {"qwen3": "Qwen3Model", "llama": "LlamaModel"}  # transformers MODEL_MAPPING_NAMES
MISSING = object()  # an attribute the loaded config does not have


@dataclass(frozen=True)
class Loaded:
    """The config object a model sees: its attributes (absent ones missing), or why the loader refused."""

    attrs: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""  # the loader's own reason (one line)
    config_class: str = ""
    speculators: bool = False

    def get(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.attrs


def _json_type(value: Any) -> str:
    if value is None:
        return _NONE
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return _LIST_STR
    return type(value).__name__


def _check(name: str, value: Any, accepted: tuple[str, ...]) -> str:
    got = _json_type(value)
    if got in accepted:
        return ""
    return (
        f"transformers refuses {name} = {json.dumps(value)}: the field takes "
        f"{' or '.join(a if a != _NONE else 'null' for a in accepted)}"
    )


def _transformers(
    raw: Mapping[str, Any], fields: Mapping[str, tuple[tuple[str, ...], Any]], family: str, cls: str = "Qwen3Config"
) -> Loaded:
    """A transformers config class built from config.json (Qwen3Config's __post_init__ when it has its fields)."""
    attrs: dict[str, Any] = dict(raw)
    for name, accepted in SIZE_FIELDS[cls].items():
        problem = _check(name, raw[name], accepted) if name in raw else ""
        if problem:
            return Loaded(error=problem)
    for name, (accepted, default) in fields.items():
        if name in raw:
            if name == "architectures" and family == VLLM:
                accepted = (*accepted, "str")  # transformers 5.24 takes a bare string (5.15 refuses it)
            problem = _check(name, raw[name], accepted)
            if problem:
                return Loaded(error=problem)
        else:
            attrs[name] = default
    if "use_sliding_window" in fields:
        attrs["sliding_window"] = attrs["sliding_window"] if attrs["use_sliding_window"] else None
        if attrs["layer_types"] is None:
            first = attrs["max_window_layers"]
            attrs["layer_types"] = [
                SLIDING if attrs["sliding_window"] is not None and i >= first else FULL
                for i in range(attrs["num_hidden_layers"])
            ]
    problem = remap_layer_types(attrs, family) or validate_layer_types(attrs, family)
    return Loaded(error=problem) if problem else Loaded(attrs=attrs)


# transformers 5.24.0 configuration_utils._LEGACY_LAYER_TYPE_REMAP, applied to every config's layer_types in
# PreTrainedConfig.__post_init__ (5.15.0 remaps only custom-code configs, inside its validator: not Qwen3Config).
LEGACY_LAYER_TYPES = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}


def remap_layer_types(attrs: dict[str, Any], family: str) -> str:
    """transformers 5.24's remap_legacy_layer_types (vLLM's loaders only): "attention" becomes "full_attention"."""
    layers = attrs.get("layer_types")
    if family != VLLM or layers is None:
        return ""
    try:
        remapped = [LEGACY_LAYER_TYPES.get(t, t) for t in layers]
    except TypeError as exc:
        return f"transformers refuses layer_types = {json.dumps(layers)}: {exc}"
    if remapped != layers:
        attrs["layer_types"] = remapped
    return ""


def validate_layer_types(attrs: Mapping[str, Any], family: str) -> str:
    """transformers' validate_layer_type: every kind one it knows, one kind per layer (only when the config has a
    num_hidden_layers at all)."""
    layers = attrs.get("layer_types")
    if layers is None or "num_hidden_layers" not in attrs:
        return ""
    allowed = ALLOWED_LAYER_TYPES[family]
    bad = [k for k in layers if k not in allowed]
    if bad:
        return f"transformers refuses layer_types: {json.dumps(bad[0])} is not a layer kind it knows"
    n = attrs["num_hidden_layers"]
    if n is not None and n != len(layers):  # a JSON string's length is its characters', as in transformers
        return (
            f"transformers refuses layer_types: {len(layers)} kinds for num_hidden_layers = {json.dumps(n)} "
            "(it needs one kind per layer)"
        )
    return ""


def is_speculators(raw: Mapping[str, Any]) -> bool:
    """vLLM 0.20.1's get_config: model_type "speculators", or no model_type and a speculators_config."""
    mt = raw.get("model_type")
    return mt == "speculators" or (mt is None and raw.get("speculators_config") is not None)


def _speculators(raw: Mapping[str, Any], build: str) -> Loaded:
    """SpeculatorsConfig: the transformer part with that build's update_dflash applied: dflash_config.target_layer_ids
    = the aux ids (stock 0.20.1) or the aux ids - 1 (this build's patch 0001, upstream 0.33.0, which also writes
    dflash_config.causal = not sliding_window_non_causal (default true) and sample_from_anchor)."""
    shift = 0 if build == STOCK else -1
    kind = raw.get("speculators_model_type")
    if kind not in ("eagle3", "dflash"):
        return Loaded(error=f"vLLM refuses speculators_model_type {json.dumps(kind)} (it knows eagle3, dflash)")
    layer = raw.get("transformer_layer_config", {})
    if not isinstance(layer, dict):
        return Loaded(error="vLLM refuses transformer_layer_config: not a JSON object")
    if kind == "eagle3":
        attrs = {**layer, "architectures": ["Eagle3LlamaForCausalLM"], "draft_vocab_size": raw.get("draft_vocab_size")}
        if raw.get("eagle_aux_hidden_state_layer_ids"):
            attrs["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
        return _speculators_config(attrs)
    if "aux_hidden_state_layer_ids" not in raw or "mask_token_id" not in raw:
        missing = "aux_hidden_state_layer_ids" if "aux_hidden_state_layer_ids" not in raw else "mask_token_id"
        return Loaded(error=f"vLLM refuses this speculators config: no {missing} (KeyError)")
    aux = raw["aux_hidden_state_layer_ids"]
    if shift:
        try:
            ids = [i + shift for i in aux]
        except TypeError:
            return Loaded(error=f"vLLM refuses aux_hidden_state_layer_ids = {json.dumps(aux)}: not a list of ints")
    else:
        ids = aux
    attrs = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "eagle_aux_hidden_state_layer_ids": aux,
        "dflash_config": {"mask_token_id": raw["mask_token_id"], "target_layer_ids": ids},
    }
    if raw.get("target_hidden_size") is not None:
        attrs["target_hidden_size"] = raw["target_hidden_size"]
    if build == UPSTREAM:
        attrs["dflash_config"]["sample_from_anchor"] = raw.get("sample_from_anchor", False)
        attrs["dflash_config"]["causal"] = not raw.get("sliding_window_non_causal", True)
    return _speculators_config(attrs)


def _speculators_config(attrs: dict[str, Any]) -> Loaded:
    """SpeculatorsConfig(**attrs) (transformers 5: the base fields checked, the rest set as they are)."""
    problem = (
        _check("architectures", attrs["architectures"], (_LIST_STR, _NONE))
        or remap_layer_types(attrs, VLLM)
        or validate_layer_types(attrs, VLLM)
    )
    return Loaded(error=problem) if problem else Loaded(attrs=attrs, config_class="SpeculatorsConfig", speculators=True)


def loaded(raw: Mapping[str, Any], loader: str, build: str = STOCK) -> Loaded:
    """`raw` as `loader` loads it (see the module docstring); `build` picks the speculators reading."""
    if loader == REFERENCE:
        # PretrainedConfig.from_pretrained: a config of another model_type whose value is a qwen3 config dict loads
        # that dict (the last one) instead.
        if "model_type" in raw and raw["model_type"] != "qwen3":
            for v in raw.values():
                if isinstance(v, dict) and v.get("model_type") == "qwen3":
                    raw = v
        got = _transformers(raw, QWEN3_FIELDS, REFERENCE)
        return Loaded(got.attrs, got.error, "Qwen3Config")
    if is_speculators(raw):
        return _speculators(raw, build)
    mt = raw.get("model_type")
    if mt is None:
        return Loaded(error="vLLM refuses a config.json without model_type (transformers: Unrecognized model)")
    if not isinstance(mt, str) or mt not in CONFIG_CLASSES:  # a list or object there is no key AutoConfig has
        return Loaded(error=f"model_type {json.dumps(mt)}: not a DFlash drafter's (qwen3; llama also loads)")
    name, fields = CONFIG_CLASSES[mt]
    got = _transformers(raw, fields, VLLM, name)
    if got.error:
        return Loaded(error=got.error, config_class=name)
    attrs = dict(got.attrs)
    # get_config: a config without architectures gets the model_type's base model class.
    archs = attrs.get("architectures") or [MODEL_CLASSES[mt]]
    # EAGLEConfig(method="dflash"): DFlash* names kept, anything else prefixed.
    attrs["architectures"] = [a if a.startswith("DFlash") or a.endswith("DFlash") else f"DFlash{a}" for a in archs]
    return Loaded(attrs=attrs, config_class=name)
