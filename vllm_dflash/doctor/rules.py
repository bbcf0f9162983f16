"""What OTHER code does with a drafter config: stock vLLM 0.20.1, upstream vLLM 0.33.0, the dflash 0.1.0 reference
and transformers' config loading. Statements of behaviour, each naming the file it was read from (sdists and wheels
as pinned in dist.toml or named below; /work notes: docs "Drafter config fields"). This build's own resolution is
NOT here: it is patch 0002's code (ours.py).

Every rule returns plain data: per layer a `Layer` (kind, window, causal, each with the field it came from) or a
`Refusal` (the build does not start, or cannot run this drafter at all).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"

# Where each statement comes from.
SRC_STOCK_MODEL = "vllm 0.20.1 vllm/model_executor/models/qwen3_dflash.py (Attention built with no window)"
SRC_STOCK_PROPOSER = "vllm 0.20.1 vllm/v1/spec_decode/dflash.py (drafter metadata causal=False)"
SRC_STOCK_TAPS = "vllm 0.20.1 vllm/v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config (ids unshifted)"
SRC_STOCK_REGISTRY = "vllm 0.20.1 vllm/model_executor/models/registry.py (DFlashDraftModel only)"
SRC_UPSTREAM = "vllm 0.33.0 vllm/model_executor/models/qwen3_dflash.py _resolve_layer_attention"
SRC_UPSTREAM_V2 = "vllm 0.33.0 vllm/config/vllm.py use_v2_model_runner (default on; mixed drafters V2 only, #47914)"
SRC_REFERENCE = "dflash 0.1.0 dflash/model.py Qwen3DFlashAttention.__init__"
SRC_REFERENCE_IDS = "dflash 0.1.0 dflash/model.py _draft_value (dflash_config first, then top level)"
SRC_TRANSFORMERS = "transformers models/qwen3/configuration_qwen3.py (sliding_window kept only with use_sliding_window)"

# Architectures each build registers for a DFlash drafter.
STOCK_ARCHITECTURES = ("DFlashDraftModel",)  # SRC_STOCK_REGISTRY
UPSTREAM_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # vllm 0.33.0 registry.py (DFlash2: #52816, V2)
REFERENCE_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # dflash 0.1.0 dflash/__init__.py


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
    runnable_elsewhere: str = ""  # for "not a drafter 0.20.1 can run": which release or PR can


def loaded_config(raw: Mapping[str, Any]) -> SimpleNamespace:
    """The drafter config object vLLM and the reference hand to their model code: config.json through transformers'
    Qwen3Config (model_type qwen3, which every DFlashDraftModel checkpoint declares). SRC_TRANSFORMERS:
    `sliding_window` survives only with `use_sliding_window: true` (its default then is 4096); a missing
    `layer_types` is filled in (sliding from index max_window_layers, default 28, when a window survives)."""
    cfg = dict(raw)
    # A table entry whose layer count no source gives: no layers to describe (a real config.json always has it).
    cfg.setdefault("num_hidden_layers", 0)
    if cfg.get("model_type", "qwen3") == "qwen3":
        use = bool(cfg.get("use_sliding_window", False))
        cfg["sliding_window"] = cfg.get("sliding_window", 4096) if use else None
        if cfg.get("layer_types") is None:
            n = int(cfg.get("num_hidden_layers", 0))
            first = int(cfg.get("max_window_layers", 28))
            cfg["layer_types"] = [
                SLIDING if cfg["sliding_window"] is not None and i >= first else FULL for i in range(n)
            ]
    cfg.setdefault("dflash_config", {})
    return SimpleNamespace(**cfg)


def stock_0_20_1(raw: Mapping[str, Any]) -> list[Layer] | Refusal:
    """Every drafter layer full and non-causal whatever the config says: qwen3_dflash.py builds each Attention
    without a window and the proposer builds one non-causal metadata for all layers."""
    arch = _architectures(raw)
    if not set(arch) & set(STOCK_ARCHITECTURES):
        return Refusal(
            f"architecture {'/'.join(arch) or '(none)'} is not registered (only DFlashDraftModel)",
            SRC_STOCK_REGISTRY,
        )
    n = int(raw.get("num_hidden_layers", 0))
    return [Layer(FULL, None, False, "no per-layer window", None, "one non-causal metadata") for _ in range(n)]


def stock_taps(dflash_ids: list[int] | None) -> list[int] | None:
    """vLLM aux indices stock records: the DFlash ids unshifted (aux index k = input of target layer k)."""
    return None if dflash_ids is None else list(dflash_ids)


def upstream_0_33(raw: Mapping[str, Any]) -> list[Layer] | Refusal:
    """vLLM 0.33.0: kind from layer_types, every layer sliding with dflash_config.use_swa when layer_types is absent
    or names no sliding layer; window dflash_config.swa_window_size, else the LOADED config's sliding_window (a window
    transformers dropped is not recovered: a sliding layer without a window raises); causal = top-level is_causal,
    else dflash_config.causal, else layer_types[i] == sliding. Mixed sliding/full drafters need the V2 model runner
    (the default there). DFlash2DraftModel runs on V2 only (#52816)."""
    arch = _architectures(raw)
    if not set(arch) & set(UPSTREAM_ARCHITECTURES):
        return Refusal(f"architecture {'/'.join(arch) or '(none)'} is not registered", SRC_UPSTREAM)
    cfg = loaded_config(raw)
    dflash: Mapping[str, Any] = cfg.dflash_config or {}
    layer_types = list(cfg.layer_types or [])
    n = int(raw.get("num_hidden_layers", len(layer_types)))
    use_swa = bool(dflash.get("use_swa", False))
    any_sliding = SLIDING in layer_types
    layers: list[Layer] = []
    for i in range(n):
        if not layer_types or (use_swa and not any_sliding):
            kind, kind_from = (SLIDING, "dflash_config.use_swa") if use_swa else (FULL, "no sliding layer")
        else:
            kind, kind_from = layer_types[i], f"layer_types[{i}]"
        window, window_from = None, None
        if kind == SLIDING:
            if "swa_window_size" in dflash:
                window, window_from = dflash["swa_window_size"], "dflash_config.swa_window_size"
            else:
                window, window_from = cfg.sliding_window, "sliding_window (as loaded)"
            if window is None:
                why = " (transformers dropped it: no use_sliding_window)" if raw.get("sliding_window") else ""
                return Refusal(
                    "ValueError: DFlash sliding attention requires a window size configured in "
                    f"dflash_config.swa_window_size or the top-level sliding_window{why}",
                    SRC_UPSTREAM,
                )
        if getattr(cfg, "is_causal", None) is not None:
            causal, causal_from = bool(cfg.is_causal), "is_causal"
        elif dflash.get("causal") is not None:
            causal, causal_from = bool(dflash["causal"]), "dflash_config.causal"
        else:
            declared = layer_types[i] if i < len(layer_types) else FULL
            causal, causal_from = declared == SLIDING, f"default for a declared {declared} layer"
        layers.append(Layer(kind, window, causal, kind_from, window_from, causal_from))
    return layers


def upstream_runner_note(raw: Mapping[str, Any], layers: list[Layer]) -> str:
    """Which model runner 0.33.0 serves this drafter on."""
    kinds = {layer.kind for layer in layers}
    if "DFlash2DraftModel" in _architectures(raw):
        return "V2 runner only (DFlash2, #52816)"
    if len(kinds) > 1:
        return "V2 runner only (mixed sliding/full, #47914; NotImplementedError on V1)"
    return "V1 or V2 runner"


def reference_0_1_0(raw: Mapping[str, Any]) -> list[Layer] | Refusal:
    """dflash 0.1.0: kind from layer_types (missing: full), window config.sliding_window of the LOADED config for
    sliding layers (so none when transformers dropped it), causal = top-level is_causal, else kind == sliding.
    use_swa, swa_window_size and dflash_config.causal are not read."""
    arch = _architectures(raw)
    if not set(arch) & set(REFERENCE_ARCHITECTURES):
        return Refusal(f"architecture {'/'.join(arch) or '(none)'} is not a dflash model class", SRC_REFERENCE)
    cfg = loaded_config(raw)
    layer_types = list(raw.get("layer_types") or [])  # the reference reads config.layer_types
    n = int(raw.get("num_hidden_layers", len(layer_types)))
    layers: list[Layer] = []
    for i in range(n):
        kind = layer_types[i] if layer_types else FULL
        kind_from = f"layer_types[{i}]" if layer_types else "no layer_types"
        window = cfg.sliding_window if kind == SLIDING else None
        window_from = None
        if kind == SLIDING:
            window_from = "sliding_window" if window is not None else "none: transformers dropped sliding_window"
        is_causal = getattr(cfg, "is_causal", None)
        causal = (kind == SLIDING) if is_causal is None else bool(is_causal)
        causal_from = "is_causal" if is_causal is not None else f"default for a {kind} layer"
        layers.append(Layer(kind, window, causal, kind_from, window_from, causal_from))
    return layers


def reference_ids(raw: Mapping[str, Any]) -> list[int] | None:
    """The reference's target_layer_ids: dflash_config first, then the top level (SRC_REFERENCE_IDS); it taps
    hidden_states[L + 1] = output of target layer L."""
    dflash = raw.get("dflash_config") or {}
    ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    return None if ids is None else [int(i) for i in ids]


def _architectures(raw: Mapping[str, Any]) -> list[str]:
    arch = raw.get("architectures") or []
    return [str(a) for a in arch] if isinstance(arch, list) else [str(arch)]
