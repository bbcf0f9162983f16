"""What OTHER code does with a drafter config: stock vLLM 0.20.1, upstream vLLM 0.33.0 and the dflash 0.1.0 reference
(this build's own resolution is patch 0002's code: ours.py). Each reading starts from the config object that build's
loader makes (loading.py) and follows that build's code, each statement naming the file it mirrors.

These are rules, not the code; `tests/test_doctor_differential.py` holds every one against the real functions
(vLLM 0.20.1's in its CPU environment, 0.33.0's extracted from its pinned sdist, the reference's in the conformance
reference environment) on generated configs: per layer kind, window and causality, the taps, and what refuses.

    read(build, raw, code=None) -> Reading
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_dflash.doctor import loading as L
from vllm_dflash.doctor.loading import FULL, OURS, REFERENCE, SLIDING, STOCK, UPSTREAM

BUILDS = (STOCK, OURS, UPSTREAM, REFERENCE)

SRC_STOCK_MODEL = "vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py (Attention built with no window)"
SRC_STOCK_INIT = "vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py DFlashQwen3Model.__init__ (drafter_config)"
SRC_STOCK_PROPOSER = "vllm 0.20.1 vllm/v1/spec_decode/dflash.py (drafter metadata causal=False)"
SRC_STOCK_TAPS = "vllm 0.20.1 vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (ids unshifted)"
SRC_STOCK_REGISTRY = "vllm 0.20.1 vllm/model_executor/models/registry.py (DFlashDraftModel only)"
SRC_OURS_TAPS = "patches/0001-dflash-target-layer-taps.patch (gpu_model_runner.py: DFlash id L -> aux L + 1)"
SRC_UPSTREAM = "vllm 0.33.0 vllm/model_executor/models/qwen3_dflash.py _resolve_layer_attention, _dflash_layer_causal"
SRC_UPSTREAM_TAPS = "vllm 0.33.0 vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config"
SRC_UPSTREAM_REGISTRY = "vllm 0.33.0 vllm/model_executor/models/registry.py"
SRC_REFERENCE = "dflash 0.1.0 dflash/model.py Qwen3DFlashAttention.__init__, DFlashDraftModel.__init__"
SRC_REFERENCE_IDS = "dflash 0.1.0 dflash/model.py _draft_value (dflash_config first, then top level)"

# The registry entries whose model is a DFlash drafter (vLLM matches the first architecture it knows).
STOCK_REGISTRY = {"DFlashDraftModel": "qwen3_dflash"}
UPSTREAM_REGISTRY = {
    "DFlashDraftModel": "qwen3_dflash",
    "DFlash2DraftModel": "qwen3_dflash2",
    "DFlash2BeamDraftModel": "vllm.models.beam",
    "MuseGlimmerAssistantModel": "qwen3_dflash",
    "DFlashMuseGlimmerAssistantModel": "qwen3_dflash",
    "DFlashQwen3XPressModel": "qwen3_xpress",
    "DFlashLagunaForCausalLM": "laguna_dflash",
}
REFERENCE_CLASSES = ("DFlashDraftModel", "DFlash2DraftModel")  # dflash 0.1.0 dflash/__init__.py

# Target architectures whose vLLM 0.20.1 model records auxiliary hidden states (the class implements SupportsEagle3:
# set_aux_hidden_state_layers), i.e. the targets a DFlash drafter can tap at all; our patches do not change this list.
# Derived with `ast` from the 0.20.1 sdist (vllm/model_executor/models/registry.py + the model classes' bases);
# drafter/embedding/Eagle entries left out.
SRC_AUX_TARGETS = "vllm 0.20.1 vllm/model_executor/models/registry.py + classes implementing SupportsEagle3"
AUX_TARGETS_0_20_1 = (
    "AfmoeForCausalLM",
    "ApertusForCausalLM",
    "AquilaForCausalLM",
    "ArceeForCausalLM",
    "CwmForCausalLM",
    "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Exaone4_5_ForConditionalGeneration",
    "Fairseq2LlamaForCausalLM",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "GlmForCausalLM",
    "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM",
    "HunYuanDenseV1ForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "HunYuanVLForConditionalGeneration",
    "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM",
    "InternLMForCausalLM",
    "InternS1ProForConditionalGeneration",
    "KimiK25ForConditionalGeneration",
    "LLaMAForCausalLM",
    "LightOnOCRForConditionalGeneration",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "MantisForConditionalGeneration",
    "MiMoForCausalLM",
    "MiniCPM3ForCausalLM",
    "MiniCPMForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Ministral3ForCausalLM",
    "Mistral3ForConditionalGeneration",
    "MistralForCausalLM",
    "MistralLarge3ForCausalLM",
    "OpenCUAForConditionalGeneration",
    "Phi3ForCausalLM",
    "PixtralForConditionalGeneration",
    "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Step1ForCausalLM",
    "TeleChat2ForCausalLM",
    "TeleChat3ForCausalLM",
    "TeleChatForCausalLM",
    "TeleFLMForCausalLM",
    "XverseForCausalLM",
)


@dataclass(frozen=True)
class Layer:
    kind: str
    window: int | None
    causal: bool
    kind_from: str
    window_from: str | None
    causal_from: str

    @property
    def backend_window(self) -> tuple[int, int]:
        """FlashAttention's (left, right) for this layer (-1 unbounded), as FA aligns windows to the key end."""
        left = -1 if self.window is None else self.window - 1
        return (left, 0 if self.causal else left)


@dataclass(frozen=True)
class Refusal:
    """The build does not serve this drafter: the line it prints (or the reason it cannot), and where it says so."""

    line: str
    source: str
    stage: str = "load"  # "load" (config loading: every layer unknown) | "model" (building the drafter) | "class"


@dataclass(frozen=True)
class Reading:
    """What one build does with one config: per layer attention (or a refusal) and the taps."""

    build: str
    layers: tuple[Layer, ...] | None
    refusal: Refusal | None
    taps: list[Any] | None  # vLLM: aux indices recorded (input of layer k); reference: output-of-layer ids
    taps_from: str = ""
    loaded: L.Loaded = field(default_factory=L.Loaded)
    runner: str = ""  # upstream 0.33: which model runner serves it
    model: str = ""  # the model module the registry picks


def _err(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _namespace(attrs: Mapping[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(**{k: v for k, v in attrs.items() if k.isidentifier()})


def _drafter_config(attrs: Mapping[str, Any]) -> str:
    """DFlashQwen3Model.__init__ (0.20.1, this build, 0.33.0): `drafter_config = getattr(config, "eagle_config", {})`
    then `drafter_config.update(getattr(config, "dflash_config", {}))`; the error the load then fails with."""
    eagle = attrs.get("eagle_config", {})
    if not isinstance(eagle, dict):
        return f"AttributeError: '{type(eagle).__name__}' object has no attribute 'update'"
    try:
        {}.update(attrs.get("dflash_config", {}))
    except (TypeError, ValueError) as exc:
        return _err(exc)
    return ""


def _first_registered(archs: Any, registry: Mapping[str, str]) -> str:
    return next((registry[a] for a in archs or () if isinstance(a, str) and a in registry), "")


def _vllm_taps_0201(attrs: Mapping[str, Any], shift: bool) -> tuple[list[Any] | None, str]:
    """_get_eagle3_aux_layers_from_config: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids
    (stock: as written; this build's patch 0001: each + 1); a list or tuple, else the target's default layers."""
    ids = attrs.get("eagle_aux_hidden_state_layer_ids")
    where = "eagle_aux_hidden_state_layer_ids"
    if not ids:
        dflash = attrs.get("dflash_config")
        if dflash and isinstance(dflash, dict):
            raw_ids = dflash.get("target_layer_ids")
            where = "dflash_config.target_layer_ids" + (" + 1" if shift else "")
            ids = [i + 1 for i in (raw_ids or [])] if shift else raw_ids
    if ids and isinstance(ids, (list, tuple)):
        return list(ids), where
    return None, "none: the target model's default aux layers"


def _stock_like(raw: Mapping[str, Any], build: str) -> tuple[L.Loaded, Reading | None, str]:
    got = L.loaded(raw, L.VLLM, build)
    if got.error:
        return got, Reading(build, None, Refusal(got.error, L.SRC_VLLM_LOAD), None, loaded=got), ""
    registry = UPSTREAM_REGISTRY if build == UPSTREAM else STOCK_REGISTRY
    model = _first_registered(got.get("architectures"), registry)
    if not model:
        archs = "/".join(str(a) for a in got.get("architectures") or ()) or "(none)"
        src = SRC_UPSTREAM_REGISTRY if build == UPSTREAM else SRC_STOCK_REGISTRY
        refusal = Refusal(f"architecture {archs} is not registered", src, "class")
        return got, Reading(build, None, refusal, None, loaded=got), ""
    return got, None, model


def stock(raw: Mapping[str, Any]) -> Reading:
    """Stock 0.20.1: every drafter layer full and non-causal whatever the config says (qwen3_dflash.py builds each
    Attention without a window; the proposer builds one non-causal metadata for all layers)."""
    got, early, model = _stock_like(raw, STOCK)
    if early:
        return early
    try:
        taps, taps_from = _vllm_taps_0201(got.attrs, shift=False)
    except TypeError as exc:
        return Reading(STOCK, None, Refusal(_err(exc), SRC_STOCK_TAPS, "model"), None, loaded=got, model=model)
    problem = _drafter_config(got.attrs)
    if problem:
        return Reading(STOCK, None, Refusal(problem, SRC_STOCK_INIT, "model"), taps, taps_from, got, model=model)
    n = got.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool):
        refusal = Refusal(f"num_hidden_layers {n!r} is no layer count", SRC_STOCK_INIT, "model")
        return Reading(STOCK, None, refusal, taps, taps_from, got, model=model)
    layer = Layer(FULL, None, False, "no per-layer window", None, "one non-causal metadata")
    return Reading(STOCK, (layer,) * max(0, n), None, taps, taps_from, got, model=model)


def ours(raw: Mapping[str, Any], code: Any) -> Reading:
    """This build: the loading and model code of 0.20.1 with patch 0001's speculators reading and tap shift, and
    patch 0002's own resolution and top-level-ids check (`code`, an ours.OurCode) run on the loaded config."""
    got, early, model = _stock_like(raw, OURS)
    if early:
        return early
    try:
        taps, taps_from = _vllm_taps_0201(got.attrs, shift=True)
    except TypeError as exc:
        return Reading(OURS, None, Refusal(_err(exc), SRC_OURS_TAPS, "model"), None, loaded=got, model=model)
    problem = _drafter_config(got.attrs)
    if problem:
        return Reading(OURS, None, Refusal(problem, SRC_STOCK_INIT, "model"), taps, taps_from, got, model=model)
    cfg = _namespace(got.attrs)
    # In DFlashQwen3Model.__init__'s order: the top-level-ids check on drafter_config, then the resolution.
    drafter = {**dict(got.get("eagle_config", {})), **dict(got.get("dflash_config", {}))}
    try:
        refusal = code.check_ids(cfg, drafter)
    except Exception as exc:  # the patch's own statement fails on this config: so does vLLM's start-up
        refusal = _err(exc)
    if refusal:
        return Reading(OURS, None, Refusal(refusal, code.source, "model"), taps, taps_from, got, model=model)
    spelled = raw.get("transformer_layer_config") if got.speculators else raw
    try:
        resolved = code.resolve(cfg, lambda: spelled if isinstance(spelled, Mapping) else {})
    except ValueError as exc:  # the patch's one-line refusal
        return Reading(OURS, None, Refusal(str(exc), code.source, "model"), taps, taps_from, got, model=model)
    except Exception as exc:  # the patch's code fails on this config: so does vLLM's start-up
        return Reading(OURS, None, Refusal(_err(exc), code.source, "model"), taps, taps_from, got, model=model)
    layers = tuple(Layer(x.kind, x.window, x.causal, x.kind_from, x.window_from, x.causal_from) for x in resolved)
    return Reading(OURS, layers, None, taps, taps_from, got, model=model)


def _upstream_taps(attrs: Mapping[str, Any]) -> tuple[list[Any] | None, str]:
    """0.33.0's get_eagle3_aux_layers_from_config: eagle ids; else dflash_config.target_layer_ids + 1; else
    dspark_target_layer_ids + 1 (+0 for deepseek_v41); else the top-level target_layer_ids + 1; else a `layer_ids`
    of dflash_config / eagle_config."""
    ids: Any = attrs.get("eagle_aux_hidden_state_layer_ids")
    where = "eagle_aux_hidden_state_layer_ids"
    dflash = attrs.get("dflash_config")
    if not ids and dflash and isinstance(dflash, dict):
        ids, where = [i + 1 for i in (dflash.get("target_layer_ids") or [])], "dflash_config.target_layer_ids + 1"
    if not ids and attrs.get("dspark_target_layer_ids"):
        shift = 0 if attrs.get("model_type") == "deepseek_v41" else 1
        ids, where = [i + shift for i in attrs["dspark_target_layer_ids"]], "dspark_target_layer_ids"
    if not ids and attrs.get("target_layer_ids"):
        ids, where = [i + 1 for i in attrs["target_layer_ids"]], "top-level target_layer_ids + 1"
    if not ids:
        for name in ("dflash_config", "eagle_config"):
            sub = attrs.get(name)
            if sub and isinstance(sub, dict):
                ids, where = sub.get("layer_ids"), f"{name}.layer_ids"
                if ids:
                    break
    if ids and isinstance(ids, (list, tuple)):
        return list(ids), where
    return None, "none: the target model's default aux layers"


def _upstream_causal(cfg: Mapping[str, Any], i: int) -> tuple[bool, str]:
    """0.33.0 _dflash_layer_causal."""
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"]), "is_causal"
    override = (cfg.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override), "dflash_config.causal"
    types = cfg.get("layer_types")
    if not types:
        return False, "no layer_types"
    return types[i] == SLIDING, f"default for a declared {types[i]} layer"


def _upstream_layers(cfg: Mapping[str, Any]) -> tuple[list[Layer], str]:
    """0.33.0 _resolve_layer_attention for every layer: (layers, the V1 runner's refusal or "")."""
    dflash = cfg.get("dflash_config") or {}
    types = cfg.get("layer_types")
    use_swa = dflash.get("use_swa", False)
    any_sliding = False
    v1 = ""
    if types is not None:
        num_sliding = sum(t == SLIDING for t in types)
        any_sliding = num_sliding > 0
        if 0 < num_sliding < len(types):
            v1 = "NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 model runner"
    out = []
    for i in range(cfg["num_hidden_layers"]):
        if types is None or (use_swa and not any_sliding):
            sliding, kind_from = bool(use_swa), ("dflash_config.use_swa" if use_swa else "no layer_types")
        else:
            sliding, kind_from = types[i] == SLIDING, f"layer_types[{i}]"
        window, window_from = None, None
        if sliding:
            if "swa_window_size" in dflash:
                window, window_from = dflash["swa_window_size"], "dflash_config.swa_window_size"
            else:
                window, window_from = cfg.get("sliding_window"), "sliding_window (as loaded)"
            if window is None:
                dropped = " (transformers dropped it: no use_sliding_window)" if cfg.get("_raw_window") else ""
                raise ValueError(
                    "DFlash sliding attention requires a window size configured in "
                    f"dflash_config.swa_window_size or the top-level sliding_window{dropped}"
                )
        causal, causal_from = _upstream_causal(cfg, i)
        kind = SLIDING if window is not None else FULL
        out.append(Layer(kind, window, causal, kind_from, window_from, causal_from))
    return out, v1


def upstream(raw: Mapping[str, Any]) -> Reading:
    """vLLM 0.33.0 (V2 model runner, its default): see _upstream_layers / _upstream_taps. DFlash2 and the other
    DFlash-family drafters have model modules of their own (their layers are not read here)."""
    got, early, model = _stock_like(raw, UPSTREAM)
    if early:
        return early
    try:
        taps, taps_from = _upstream_taps(got.attrs)
    except TypeError as exc:
        return Reading(UPSTREAM, None, Refusal(_err(exc), SRC_UPSTREAM_TAPS, "model"), None, loaded=got, model=model)
    problem = _drafter_config(got.attrs)
    if problem:
        return Reading(UPSTREAM, None, Refusal(problem, SRC_UPSTREAM, "model"), taps, taps_from, got, model=model)
    if model != "qwen3_dflash":
        return Reading(UPSTREAM, None, None, taps, taps_from, got, f"V2 runner ({model})", model)
    cfg = {**got.attrs, "_raw_window": raw.get("sliding_window")}
    try:
        layers, v1 = _upstream_layers(cfg)
    except (ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        return Reading(UPSTREAM, None, Refusal(_err(exc), SRC_UPSTREAM, "model"), taps, taps_from, got, model=model)
    runner = "V2 runner only (mixed sliding/full; V1 raises NotImplementedError)" if v1 else "V1 or V2 runner"
    return Reading(UPSTREAM, tuple(layers), None, taps, taps_from, got, runner, model)


def build_target_layer_ids(num_target_layers: Any, num_draft_layers: Any) -> list[int]:
    """dflash 0.1.0's default taps (dflash/model.py build_target_layer_ids), same arithmetic."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start = 1
    end = num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _int(value: Any, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} {value!r}: {_err(exc)}") from None


def reference(raw: Mapping[str, Any]) -> Reading:
    """dflash 0.1.0 as its DFlashDraftModel builds itself from the loaded config: per layer kind = layer_types[i]
    (none: full), causal = is_causal if set else kind == sliding, window = config.sliding_window on sliding layers
    (so none when transformers dropped it); then target_layer_ids (dflash_config, top level, else
    build_target_layer_ids(num_target_layers, ...), evaluated first: without num_target_layers the model cannot be
    built), block_size, and DFlash2's convolution and selector sizes. use_swa, swa_window_size and
    dflash_config.causal are not read."""
    got = L.loaded(raw, L.REFERENCE)
    if got.error:
        return Reading(REFERENCE, None, Refusal(got.error, L.SRC_REFERENCE_LOAD), None, loaded=got)
    # The class a user builds: the one config.json's architectures names (the reference has no dispatcher).
    named = raw.get("architectures")
    archs: list[Any] = named if isinstance(named, list) else []
    cls = next((a for a in archs if isinstance(a, str) and a in REFERENCE_CLASSES), "")
    if not cls:
        line = f"architecture {'/'.join(map(str, archs)) or '(none)'} is not a dflash model class"
        return Reading(REFERENCE, None, Refusal(line, SRC_REFERENCE, "class"), None, loaded=got)
    types = got.get("layer_types")
    is_causal = got.get("is_causal")
    layers = []
    for i in range(got.get("num_hidden_layers") if isinstance(got.get("num_hidden_layers"), int) else 0):
        kind = types[i] if types else FULL
        window = got.get("sliding_window") if kind == SLIDING else None
        layers.append(
            Layer(
                kind,
                window,
                (kind == SLIDING) if is_causal is None else bool(is_causal),
                f"layer_types[{i}]" if types else "no layer_types",
                ("sliding_window" if window is not None else "none: transformers dropped sliding_window")
                if kind == SLIDING
                else None,
                "is_causal" if is_causal is not None else f"default for a {kind} layer",
            )
        )
    try:
        ids = _reference_ids(got, cls)
    except (ValueError, TypeError, AttributeError) as exc:
        why = str(exc) if isinstance(exc, ValueError) else _err(exc)
        return Reading(
            REFERENCE,
            None,
            Refusal(f"the reference cannot build this drafter: {why}", SRC_REFERENCE, "model"),
            None,
            loaded=got,
            model=cls,
        )
    return Reading(REFERENCE, tuple(layers), None, ids, SRC_REFERENCE_IDS, got, model=cls)


# transformers 5.15.0 modeling_rope_utils.ROPE_INIT_FUNCTIONS (read in the reference environment), plus "default",
# which the rotary class computes itself. A rope_type outside them only warns at config load ("Missing validation
# function"), then the drafter's rotary embedding raises KeyError when the model is built: a rule, measured.
SRC_REFERENCE_ROPE = "transformers 5.15.0 models/qwen3/modeling_qwen3.py Qwen3RotaryEmbedding (ROPE_INIT_FUNCTIONS)"
REFERENCE_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "proportional", "yarn")


def _rope_type(got: L.Loaded) -> Any:
    """The rope type the loaded config carries: rope_parameters, else the legacy rope_scaling (transformers 5 moves
    one into the other), rope_type before the older key type."""
    for name in ("rope_parameters", "rope_scaling"):
        rope = got.get(name)
        if isinstance(rope, Mapping):
            return rope.get("rope_type", rope.get("type", "default"))
    return "default"


def _reference_ids(got: L.Loaded, cls: str) -> Any:
    """DFlashDraftModel.__init__'s reads after the layers, in its order (errors as it raises them)."""
    rope = _rope_type(got)
    if rope not in REFERENCE_ROPE_TYPES:
        raise ValueError(f"rope type {rope!r} is none transformers knows (rule: {SRC_REFERENCE_ROPE})")
    if not got.has("num_target_layers"):
        raise AttributeError("'Qwen3Config' object has no attribute 'num_target_layers'")
    default = build_target_layer_ids(got.get("num_target_layers"), got.get("num_hidden_layers"))
    dflash = got.get("dflash_config", {}) if got.has("dflash_config") else {}
    ids = _draft_value(got, dflash, "target_layer_ids", default)
    len(ids)  # nn.Linear(len(target_layer_ids) * hidden_size, ...)
    _int(_draft_value(got, dflash, "block_size", 16), "block_size")
    if cls == "DFlash2DraftModel":
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            _int(_draft_value(got, dflash, name), name)
    return ids


def _draft_value(got: L.Loaded, dflash: Any, name: str, default: Any = None) -> Any:
    """dflash 0.1.0 _draft_value: dflash_config[name], else the config attribute, else the default."""
    return dflash.get(name, got.get(name, default) if got.has(name) else default)


READERS: dict[str, Callable[..., Reading]] = {STOCK: stock, UPSTREAM: upstream, REFERENCE: reference}


def read(build: str, raw: Mapping[str, Any], code: Any = None) -> Reading:
    """One build's reading of `raw` (OURS needs this build's code, an ours.OurCode)."""
    if build == OURS:
        return ours(raw, code)
    return READERS[build](raw)


def runs_on_stock(target_architectures: tuple[str, ...]) -> bool:
    return bool(set(target_architectures) & set(AUX_TARGETS_0_20_1))
