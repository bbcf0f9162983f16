"""The dflash 0.1.0 reference's reading of drafter configs: the doctor's reference column.

Runs INSIDE the conformance reference environment (envs.reference_python: dflash 0.1.0 with its pinned transformers
and torch), as

    python -m vllm_dflash.doctor.reference_side     (JSON lines: {"config": config.json} in, an answer out)

Per config, the reference's own loading (`config_class.from_pretrained(dir)`: DFlashDraftModel's Qwen3Config), the
model class `architectures` names (DFlashDraftModel or DFlash2DraftModel) built on the meta device (no weights, real
sizes), and read back from the built modules: each layer's `sliding_window` and `is_causal`, the model's
`target_layer_ids` (the hidden states it concatenates, in that order), its fc input width, block size and mask token.
A speculators-format config is no reference format: it is loaded the same way and reported as it goes.

Answers {"load_error" | "class_error" | "init_error", "loaded", "layers" ([kind, window, causal]), "target_layer_ids",
"fc_in", "hidden_size", ...}.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

LOADED = ("num_hidden_layers", "layer_types", "sliding_window", "use_sliding_window", "is_causal", "dflash_config")
_MISSING = "<absent>"


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def _plain(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def read_one(raw: dict[str, Any], classes: dict[str, Any], torch: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    named = raw.get("architectures")
    archs: list[Any] = named if isinstance(named, list) else []
    cls = next((classes[a] for a in archs if isinstance(a, str) and a in classes), None)
    if cls is None:
        rec["class_error"] = f"no dflash model class for architectures {archs!r}"
        cls = classes["DFlashDraftModel"]  # the loading is still the reference's
    try:
        with tempfile.TemporaryDirectory() as d:
            Path(d, "config.json").write_text(json.dumps(raw))
            config = cls.config_class.from_pretrained(d)
    except Exception as exc:
        return {"load_error": _err(exc)}
    rec["loaded"] = {k: _plain(getattr(config, k, _MISSING)) for k in LOADED}
    if "class_error" in rec:
        return rec
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        rec["init_error"] = _err(exc)
        return rec
    types = getattr(config, "layer_types", None)
    rec["model_class"] = cls.__name__
    rec["layers"] = [
        [
            types[i] if types else "full_attention",
            _plain(layer.self_attn.sliding_window),
            bool(layer.self_attn.is_causal),
        ]
        for i, layer in enumerate(model.layers)
    ]
    rec["target_layer_ids"] = _plain(model.target_layer_ids)
    rec["fc_in"] = int(model.fc.in_features)
    rec["hidden_size"] = _plain(config.hidden_size)
    rec["block_size"] = _plain(model.block_size)
    rec["mask_token_id"] = _plain(model.mask_token_id)
    return rec


def main() -> int:
    from vllm_dflash.doctor.vllm_side import serve_lines

    state: dict[str, Any] = {}

    def answer(request: dict[str, Any] | None) -> dict[str, Any]:
        if request is None:
            import dflash
            import torch
            from dflash import model as M

            state.update(
                torch=torch, classes={"DFlashDraftModel": M.DFlashDraftModel, "DFlash2DraftModel": M.DFlash2DraftModel}
            )
            state["version"] = getattr(dflash, "__version__", "0.1.0")
            return {"dflash_version": state["version"]}
        return {"dflash_version": state["version"], **read_one(request["config"], state["classes"], state["torch"])}

    return serve_lines(answer)


if __name__ == "__main__":
    sys.exit(main())
