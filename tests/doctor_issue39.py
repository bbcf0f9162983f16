"""TEST-ONLY: issue 39's classes as configs, each with the verdict the doctor must give it (exit code and the words
that name why). tests/test_doctor_issue39.py runs them through the doctor's columns; benchmarks/doctor_regressions.py
runs the same configs through any checkout's `vllm-dflash doctor` (a commit before issue 39, to show each failing).

Every case starts from z-lab/Qwen3.6-27B-DFlash's config.json as published (exit 20: this build serves it as
trained, stock 0.20.1 mis-serves it), changed in one place."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

S, F = "sliding_attention", "full_attention"


def published_q36() -> dict[str, Any]:
    """z-lab/Qwen3.6-27B-DFlash's config.json as published (the shape every public copy quotes, with the keys a
    transformers-saved Qwen3 drafter config carries, `auto_map` among them)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": 16,
        "bos_token_id": 248044,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
        "dtype": "bfloat16",
        "eos_token_id": 248046,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 17408,
        "layer_types": [S, S, S, S, F],
        "max_position_embeddings": 262144,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "sliding_window": 2048,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 248320,
    }


def _ids(ids: list[Any]) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        c["dflash_config"]["target_layer_ids"] = ids

    return edit


def _set(**kv: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.update(copy.deepcopy(kv))


def _dflash(**kv: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["dflash_config"].update(kv)


def _no_ids(c: dict[str, Any]) -> None:
    del c["dflash_config"]["target_layer_ids"]


def _nested_window(c: dict[str, Any]) -> None:
    del c["sliding_window"]
    c["text_config"] = {"model_type": "qwen3", "sliding_window": 2048, "use_sliding_window": True}


def _speculators(non_causal: bool) -> Callable[[dict[str, Any]], None]:
    def edit(c: dict[str, Any]) -> None:
        layer = {k: v for k, v in c.items() if k not in ("architectures", "auto_map", "dflash_config")}
        c.clear()
        c.update(
            {
                "architectures": ["DFlashSpeculator"],
                "speculators_model_type": "dflash",
                "speculators_version": "0.3.0",
                "speculators_config": {"algorithm": "dflash"},
                "aux_hidden_state_layer_ids": [2, 17, 32, 47, 62],
                "mask_token_id": 248070,
                "sliding_window_non_causal": non_causal,
                "transformer_layer_config": {**layer, "use_sliding_window": True},
            }
        )

    return edit


NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
MXFP8 = {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}
W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}


@dataclass(frozen=True)
class Case:
    name: str  # the class, in the words
    edit: Callable[[dict[str, Any]], None]
    exit: int
    says: tuple[str, ...] = ()  # words the printed report must carry

    def config(self) -> dict[str, Any]:
        c = published_q36()
        self.edit(c)
        return c


CASES: tuple[Case, ...] = (
    Case("the published config (auto_map and all): the control", lambda c: None, 20, ("lose their sliding window",)),
    Case("a string-typed size field", _set(hidden_size="5120"), 21, ("Field 'hidden_size' expected int, got str",)),
    Case("a float size field", _set(num_attention_heads=32.0), 21, ("expected int, got float",)),
    Case(
        "an unknown rope type",
        _set(rope_scaling=None, rope_parameters={"rope_type": "bogus_rope", "rope_theta": 10000000.0, "factor": 2.0}),
        21,
        ("bogus_rope",),
    ),
    Case("a window only in a nested text_config", _nested_window, 21, ("text_config",)),
    Case("unsorted target_layer_ids", _ids([61, 46, 31, 16, 1]), 22, ("in layer order", "1, 16, 31, 46, 61 (5 taps)")),
    Case("duplicated target_layer_ids", _ids([1, 16, 16, 46, 61]), 22, ("1, 16, 46, 61 (4 taps)",)),
    Case("no target_layer_ids, with an fc sized for 5 taps", _no_ids, 22, ("fc width", "takes 25600 features")),
    Case("a negative id the target never records", _ids([-2, 16, 31, 46, 61]), 22, ("(4 taps) where it was trained",)),
    Case("id -1: the embeddings", _ids([-1, 16, 31, 46, 61]), 20, ("-1 (the embeddings)",)),
    Case("float ids", _ids([1.0, 16.0, 31.0, 46.0, 61.0]), 20, ("target layers 0, 15, 30, 45, 60 instead of",)),
    Case("speculators sliding_window_non_causal: true", _speculators(True), 22, ("sliding_window_non_causal",)),
    Case("speculators sliding_window_non_causal: false (the control)", _speculators(False), 20, ()),
    Case("a mask token outside the vocabulary", _dflash(mask_token_id=248320), 22, ("mask_token_id 248320",)),
    Case("a mask token given as a string", _dflash(mask_token_id="248070"), 22, ("mask_token_id '248070'",)),
    Case("the last target layer, without --target", _ids([1, 16, 31, 46, 63]), 20, ("last target layer (63",)),
    # 2026's fields
    Case("quantized drafter: NVFP4", _set(quantization_config=NVFP4), 22, ("quantized",)),
    Case("quantized drafter: MXFP8", _set(quantization_config=MXFP8), 22, ("quantized",)),
    Case("quantized drafter: W4A16", _set(quantization_config=W4A16), 22, ("qkv_proj",)),
    Case("no_rope_layers as layer indices", _set(no_rope_layers=[0, 2]), 23, ("no_rope_layers",)),
    Case("no_rope_layers as a per-layer 0/1 list", _set(no_rope_layers=[1, 0, 1, 0, 1]), 23, ("no_rope_layers",)),
    Case("is_neox_style: false", _set(is_neox_style=False), 22, ("is_neox_style",)),
    Case("is_neox_style: true (the default: the control)", _set(is_neox_style=True), 20, ()),
    Case("logit_scale", _set(logit_scale=0.5), 20, ("logit_scale = 0.5 (read by this build",)),
    Case("has_own_lm_head", _set(has_own_lm_head=True), 20, ("has_own_lm_head",)),
    Case("use_aux_hidden_state: false at the top level", _set(use_aux_hidden_state=False), 22, ("use_aux_hidden",)),
    Case("dflash_config.use_aux_hidden_state: false", _dflash(use_aux_hidden_state=False), 20, ()),
    Case("dflash_config.sample_from_anchor: true", _dflash(sample_from_anchor=True), 22, ("sample_from_anchor",)),
)
