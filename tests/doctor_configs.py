"""TEST-ONLY: a hypothesis strategy over the drafter-config spelling space the doctor must read (every attention field
present, absent or odd-typed, lengths off by one, nested dflash_config, model_type qwen3/llama/none, the speculators
format, issue 39's classes and 2026's fields), and the input classes a generated config belongs to (for the
differential test's figures)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

SLIDING, FULL = "sliding_attention", "full_attention"
ABSENT: Any = object()  # a field left out of config.json
# Fixed sizes (valid for every system: not the reading under test), small so the reference builds fast on meta.
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}
ODD = st.sampled_from(["3", 2.5, None, True, [1], {"a": 1}, -1])
# Kinds: ours and upstream's, one every transformers knows, one only 5.24 knows (vLLM's), one 5.24 renames to
# full_attention (and 5.15 refuses), one none knows.
KINDS = st.sampled_from([SLIDING, FULL, SLIDING, FULL, "chunked_attention", "indexed_attention", "attention", "bogus"])


def _maybe(value: st.SearchStrategy[Any], absent_weight: int = 1) -> st.SearchStrategy[Any]:
    return st.one_of(*([st.just(ABSENT)] * absent_weight), value)


@st.composite
def layer_types(draw: st.DrawFn, n: int) -> Any:
    shape = draw(st.sampled_from(["exact", "exact", "exact", "short", "long", "odd", "none"]))
    if shape == "odd":
        return draw(st.sampled_from(["sliding_attention", [SLIDING, None], 3]))
    if shape == "none":
        return None
    length = max(0, n + {"exact": 0, "short": -1, "long": 1}[shape])
    mode = draw(st.sampled_from(["mixed", "all-full", "all-sliding", "any"]))
    if mode == "all-full":
        return [FULL] * length
    if mode == "all-sliding":
        return [SLIDING] * length
    if mode == "mixed":
        return [SLIDING if i < length - 1 else FULL for i in range(length)]
    return draw(st.lists(KINDS, min_size=length, max_size=length))


def _ids(n: int) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(st.integers(0, 11), min_size=max(1, n - 1), max_size=n + 1, unique=True),
        st.just([]),
        st.sampled_from(["1", ["1", "2"], None, 3]),
    )


@st.composite
def dflash_config(draw: st.DrawFn, n: int) -> Any:
    shape = draw(st.sampled_from(["dict"] * 8 + ["list", "pairs", "string", "none", "empty-list"]))
    if shape != "dict":
        return {"list": [1, 2], "pairs": [["causal", True]], "string": "x", "none": None, "empty-list": []}[shape]
    fields = {
        "target_layer_ids": _maybe(_ids(n)),
        "mask_token_id": _maybe(st.sampled_from([200, "200", None])),
        "block_size": _maybe(st.sampled_from([16, 4, "16", None, [1]]), 2),
        "use_swa": _maybe(st.sampled_from([True, False, 1, "true", None]), 3),
        "swa_window_size": _maybe(st.sampled_from([8, 2048, 0, -1, None, "8", True]), 3),
        "causal": _maybe(st.sampled_from([True, False, None, 0, "false"]), 3),
        "attention_sink_bias": _maybe(st.sampled_from([True, False, 0, 1]), 5),
        "layer_ids": _maybe(st.sampled_from([[1, 2], "x"]), 8),
        "conv_kernel_size": _maybe(st.sampled_from([2, None, "2"]), 6),
        "selector_rank": _maybe(st.sampled_from([16, None]), 6),
    }
    out = {}
    for key, strat in fields.items():
        value = draw(strat)
        if value is not ABSENT:
            out[key] = value
    return out


@st.composite
def plausible_config(draw: st.DrawFn) -> dict[str, Any]:
    """A config a checkpoint could carry: well-typed, its attention fields in every combination (so every system
    builds its layers and the per-layer readings are compared), odd values only where real configs have them."""
    n = draw(st.integers(1, 6))
    cfg: dict[str, Any] = {
        **SIZES,
        "architectures": ["DFlashDraftModel"],
        "model_type": draw(st.sampled_from(["qwen3"] * 8 + ["llama"])),
        "num_hidden_layers": n,
        "num_target_layers": draw(st.sampled_from([12, 36, 64])),
    }
    optional = {
        "layer_types": _maybe(
            st.one_of(
                st.lists(st.sampled_from([SLIDING, FULL]), min_size=n, max_size=n),
                st.just([SLIDING] * (n - 1) + [FULL]),
                st.just(["attention"] * n),
            ),
            2,
        ),
        "sliding_window": _maybe(st.sampled_from([8, 2048, 4096, None]), 1),
        "use_sliding_window": _maybe(st.booleans(), 1),
        "max_window_layers": _maybe(st.integers(0, n + 1), 2),
        "is_causal": _maybe(st.sampled_from([True, False, None]), 3),
        "block_size": _maybe(st.sampled_from([16, 8]), 2),
    }
    for key, strat in optional.items():
        value = draw(strat)
        if value is not ABSENT:
            cfg[key] = value
    # Issue 39's classes: a size field of another JSON type (transformers refuses it), a rope type of its own, a
    # window only in a nested text_config.
    odd_size = draw(_maybe(st.sampled_from(sorted(SIZES)), 8))
    if odd_size is not ABSENT:
        cfg[odd_size] = draw(st.sampled_from([str(SIZES[odd_size]), float(SIZES[odd_size]), None]))
    rope = draw(_maybe(st.sampled_from(["default", "linear", "bogus_rope"]), 6))
    for key, value in draw(fields_2026()).items():
        cfg[key] = value
    if draw(st.integers(0, 3)) == 0:
        cfg["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    if rope is not ABSENT:
        cfg["rope_parameters"] = {
            "rope_type": rope,
            "rope_theta": 10000.0,
            **({"factor": 2.0} if rope != "default" else {}),
        }
    if draw(st.integers(0, 9)) == 0:
        cfg["text_config"] = {"model_type": "qwen3", "sliding_window": 8, "use_sliding_window": True}
    dflash: dict[str, Any] = {}
    for key, strat in {
        # ids in any order, duplicates and -1 included (vLLM records them in layer order, once each)
        "target_layer_ids": _maybe(
            st.one_of(
                st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True).map(sorted),
                st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True).map(sorted),
                st.lists(st.integers(-2, 11), min_size=n, max_size=n),
                st.lists(st.integers(0, 11), min_size=n, max_size=n).map(lambda v: [*v[1:], -1]),  # a negative id
                st.lists(st.integers(0, 11), min_size=n, max_size=n, unique=True).map(lambda v: [float(i) for i in v]),
            ),
            8,  # absent now and then: the runner's default taps against an fc sized for the drafter's layers
        ),
        "mask_token_id": _maybe(st.sampled_from([200, 200, 200, "200", 10**6]), 0),
        "use_swa": _maybe(st.booleans(), 3),
        "swa_window_size": _maybe(st.sampled_from([8, 1024]), 3),
        "causal": _maybe(st.booleans(), 3),
        "attention_sink_bias": _maybe(st.sampled_from([True, False, 1, 0]), 5),
        "block_size": _maybe(st.just(16), 3),
        "sample_from_anchor": _maybe(st.booleans(), 8),
        "use_aux_hidden_state": _maybe(st.booleans(), 8),
    }.items():
        value = draw(strat)
        if value is not ABSENT:
            dflash[key] = value
    if draw(st.integers(0, 9)):
        cfg["dflash_config"] = dflash
    else:
        cfg.update({k: v for k, v in dflash.items() if k in ("target_layer_ids", "mask_token_id")})  # top level only
    return cfg


QUANTIZATION = {
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    "mxfp8": {"quant_method": "modelopt", "quant_algo": "MXFP8", "exclude_modules": ["lm_head"]},
    "w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    },
}


@st.composite
def fields_2026(draw: st.DrawFn) -> dict[str, Any]:
    """2026's top-level fields, each now and then: quantized drafters, NoPE layers in both spellings, the rotary
    layout, a logit scale, an own lm_head, no aux hidden states."""
    out: dict[str, Any] = {}
    choices: dict[str, st.SearchStrategy[Any]] = {
        "quantization_config": st.sampled_from(sorted(QUANTIZATION)).map(lambda k: QUANTIZATION[k]),
        "no_rope_layers": st.one_of(st.just([0, 2]), st.just([1, 0, 1, 0, 1])),
        "is_neox_style": st.booleans(),
        "logit_scale": st.sampled_from([1.0, 0.5]),
        "has_own_lm_head": st.booleans(),
        "use_aux_hidden_state": st.booleans(),
    }
    for key, strat in choices.items():
        value = draw(_maybe(strat, 9))
        if value is not ABSENT:
            out[key] = value
    return out


@st.composite
def plain_config(draw: st.DrawFn) -> dict[str, Any]:
    """Anything: every field present, absent or odd-typed."""
    n_choice = draw(st.sampled_from(["int"] * 9 + ["absent", "odd"]))
    n = draw(st.integers(0, 6)) if n_choice == "int" else 3
    cfg: dict[str, Any] = dict(SIZES)
    if n_choice == "int":
        cfg["num_hidden_layers"] = n
    elif n_choice == "odd":
        cfg["num_hidden_layers"] = draw(ODD)
    fields = {
        "model_type": st.sampled_from(["qwen3"] * 6 + ["llama", "gemma_x", ABSENT]),
        "architectures": st.sampled_from(
            [["DFlashDraftModel"]] * 10
            + [["DFlash2DraftModel"], ["Qwen3ForCausalLM"], ["Eagle3LlamaForCausalLM"], [], None, "DFlashDraftModel"]
            + [ABSENT]
        ),
        "layer_types": _maybe(layer_types(n), 2),
        "sliding_window": _maybe(st.sampled_from([8, 8, 2048, 0, -3, None, "8", True, 2.5]), 2),
        "use_sliding_window": _maybe(st.sampled_from([True, False, True, 1, "yes", None]), 3),
        "max_window_layers": _maybe(st.sampled_from([0, 1, 2, 3, 28, "1", None, True]), 3),
        "is_causal": _maybe(st.sampled_from([True, False, None, 0, 1, "no"]), 4),
        "target_layer_ids": _maybe(st.sampled_from([[1, 2], [3], "1"]), 6),
        "num_target_layers": _maybe(st.sampled_from([12, 64, 1, "64", None]), 1),
        "eagle_aux_hidden_state_layer_ids": _maybe(st.sampled_from([[2, 5], [], "2"]), 8),
        "eagle_config": _maybe(st.sampled_from([{}, {"use_aux_hidden_state": True}, [1]]), 10),
        "dflash_config": _maybe(dflash_config(n), 1),
        "add_swa_attention_sink_bias": _maybe(st.sampled_from([True, False]), 10),
    }
    for key, strat in fields.items():
        value = draw(strat)
        if value is not ABSENT:
            cfg[key] = value
    return cfg


@st.composite
def speculators_config(draw: st.DrawFn) -> dict[str, Any]:
    layer = draw(plain_config())
    layer.pop("architectures", None)
    layer.pop("dflash_config", None)
    out: dict[str, Any] = {
        "architectures": draw(st.sampled_from([["DFlashSpeculator"], ["DFlashSpeculator"], ["DFlashDraftModel"]])),
        "speculators_model_type": draw(st.sampled_from(["dflash", "dflash", "dflash", "eagle3", "medusa"])),
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer if draw(st.integers(0, 9)) else [layer],
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "dflash", "speculative_tokens": 3}],
            "default_proposal_method": "dflash",
            "verifier": {"name_or_path": "target", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    if draw(st.integers(0, 4)):
        out["model_type"] = "speculators"
    aux = draw(_maybe(st.one_of(st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True), st.just("2")), 1))
    if aux is not ABSENT:
        out["aux_hidden_state_layer_ids"] = aux
    if draw(st.integers(0, 5)):
        out["mask_token_id"] = 200
    if draw(st.integers(0, 3)) == 0:
        out["sliding_window_non_causal"] = draw(st.booleans())
    return out


def drafter_configs() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(plausible_config(), plausible_config(), plain_config(), speculators_config())


def target_configs() -> st.SearchStrategy[dict[str, Any]]:
    """Target configs for --target: the layer count at the top level or in text_config, present, absent or odd."""
    layers = st.one_of(st.integers(1, 80), ODD)
    arch = st.sampled_from([["Qwen3ForCausalLM"], ["Qwen3_5ForConditionalGeneration"], ["NemotronHForCausalLM"], []])
    return st.one_of(
        st.fixed_dictionaries({"architectures": arch, "num_hidden_layers": layers}),
        st.fixed_dictionaries(
            {"architectures": arch, "text_config": st.fixed_dictionaries({"num_hidden_layers": layers})}
        ),
        st.fixed_dictionaries({"text_config": st.sampled_from(["x", None, [1]])}),
    )


def input_classes(cfg: dict[str, Any]) -> set[str]:
    """The spelling classes one generated config covers (for the figures)."""
    out: set[str] = set()
    speculators = "speculators_model_type" in cfg
    if speculators:
        out.add("speculators format")
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            out.add("speculators: transformer_layer_config not an object")
        cfg = layer if isinstance(layer, dict) else {}
    out.add(f"model_type {cfg.get('model_type', 'absent')}")
    n = cfg.get("num_hidden_layers")
    lt = cfg.get("layer_types", ABSENT)
    if not isinstance(n, int) or isinstance(n, bool):
        out.add("num_hidden_layers absent or odd")
    if lt is ABSENT or lt is None:
        out.add("layer_types absent/null")
        if cfg.get("use_sliding_window") is True and isinstance(cfg.get("sliding_window"), int):
            out.add("sliding layers from max_window_layers")
    elif isinstance(lt, list) and isinstance(n, int) and len(lt) != n:
        out.add("layer_types length off by one")
    elif not isinstance(lt, list):
        out.add("layer_types odd-typed")
    if isinstance(lt, list) and any(k not in (SLIDING, FULL) for k in lt):
        out.add("layer_types kind other than sliding/full")
    if "sliding_window" in cfg and cfg.get("use_sliding_window") is not True:
        out.add("sliding_window dropped by transformers")
    dc = cfg.get("dflash_config", ABSENT)
    if dc is ABSENT:
        out.add("dflash_config absent")
    elif not isinstance(dc, dict):
        out.add("dflash_config not an object")
    else:
        for key in ("use_swa", "swa_window_size", "causal", "attention_sink_bias", "target_layer_ids"):
            if key in dc:
                out.add(f"dflash_config.{key}")
    for key in ("is_causal", "target_layer_ids", "eagle_aux_hidden_state_layer_ids", "num_target_layers"):
        if key in cfg:
            out.add(f"top-level {key}")
    archs = cfg.get("architectures")
    if not speculators and (not isinstance(archs, list) or "DFlashDraftModel" not in archs):
        out.add("architectures other than DFlashDraftModel")
    if isinstance(lt, list) and "attention" in lt:
        out.add("layer kind transformers 5.24 renames (attention)")
    typed = {"sliding_window": int, "use_sliding_window": bool, "max_window_layers": int}
    if any(k in cfg and cfg[k] is not None and type(cfg[k]) is not t for k, t in typed.items()):
        out.add("attention field odd-typed")
    sinks = (dc.get("attention_sink_bias") if isinstance(dc, dict) else None, cfg.get("add_swa_attention_sink_bias"))
    if any(v is True or v == 1 for v in sinks):
        out.add("attention sinks on (true or 1)")
    ids = dc.get("target_layer_ids") if isinstance(dc, dict) else cfg.get("target_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        if ids != sorted(set(ids)):
            out.add("target_layer_ids unsorted or duplicated")
        if any(i < 0 for i in ids):
            out.add("target_layer_ids negative")
    mask = dc.get("mask_token_id") if isinstance(dc, dict) else cfg.get("mask_token_id")
    if isinstance(mask, str) or (isinstance(mask, int) and mask >= int(cfg.get("vocab_size") or 0)):
        out.add("mask token a string or outside the vocabulary")
    if any(k in cfg and type(cfg[k]) is not type(v) for k, v in SIZES.items()):
        out.add("size field odd-typed")
    if "rope_parameters" in cfg:
        out.add(f"rope type {cfg['rope_parameters'].get('rope_type')}")
    if "text_config" in cfg:
        out.add("window only in a nested text_config")
    if isinstance(ids, list) and any(isinstance(i, float) for i in ids):
        out.add("target_layer_ids as floats")
    if isinstance(dc, dict) and "target_layer_ids" not in dc and "target_layer_ids" not in cfg:
        out.add("no target_layer_ids (the runner's default taps)")
    for key in ("quantization_config", "no_rope_layers", "is_neox_style", "logit_scale", "has_own_lm_head"):
        if key in cfg:
            detail = ""
            if key == "quantization_config":
                detail = " " + str(cfg[key].get("quant_algo") or cfg[key].get("format"))
            elif key == "no_rope_layers":
                detail = " (0/1 per layer)" if len(cfg[key]) == 5 else " (indices)"
            out.add(f"2026: {key}{detail}")
    if "use_aux_hidden_state" in cfg or (isinstance(dc, dict) and "use_aux_hidden_state" in dc):
        out.add("2026: use_aux_hidden_state")
    if isinstance(dc, dict) and "sample_from_anchor" in dc:
        out.add("2026: dflash_config.sample_from_anchor")
    if "auto_map" in cfg:
        out.add("auto_map (published z-lab configs)")
    return out
