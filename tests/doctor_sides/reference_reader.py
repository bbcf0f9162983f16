"""TEST-ONLY: what the dflash 0.1.0 reference does with drafter configs, for the doctor's differential test.

Runs INSIDE the conformance reference environment (envs.reference_python: dflash 0.1.0 with its pinned transformers
and torch), stdlib + that environment only:

    python reference_reader.py '{"configs": CONFIGS.json, "out": OUT.json}'

Per config: config.json written to a temporary directory and loaded the way `DFlashDraftModel.from_pretrained`
loads it (its `config_class`, Qwen3Config, `.from_pretrained(dir)`); the model class named by `architectures`
(DFlashDraftModel or DFlash2DraftModel) built on the meta device (no weights, real sizes), and each layer's own
`self_attn.sliding_window` / `self_attn.is_causal` and the model's `target_layer_ids` read back. A speculators-format
config is not a reference format: it is loaded the same way and reported as it goes.

Writes one JSON list: {"load_error", "loaded", "class_error", "init_error", "layers" ([layer_type, window, causal]),
"target_layer_ids"}.
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


def main() -> int:
    import torch
    from dflash import model as M

    job = json.loads(sys.argv[1])
    configs = json.loads(Path(job["configs"]).read_text())
    classes = {"DFlashDraftModel": M.DFlashDraftModel, "DFlash2DraftModel": M.DFlash2DraftModel}
    out = []
    for raw in configs:
        rec: dict[str, Any] = {}
        archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
        cls = next((classes[a] for a in archs if isinstance(a, str) and a in classes), None)
        if cls is None:
            rec["class_error"] = f"no dflash model class for architectures {archs!r}"
            cls = M.DFlashDraftModel  # the loading is still the reference's
        try:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "config.json").write_text(json.dumps(raw))
                config = cls.config_class.from_pretrained(d)
        except Exception as exc:
            out.append({"load_error": _err(exc)})
            continue
        rec["loaded"] = {k: _plain(getattr(config, k, _MISSING)) for k in LOADED}
        if "class_error" not in rec:
            try:
                with torch.device("meta"):
                    model = cls(config)
                types = getattr(config, "layer_types", None)
                rec["layers"] = [
                    [
                        types[i] if types else "full_attention",
                        layer.self_attn.sliding_window,
                        bool(layer.self_attn.is_causal),
                    ]
                    for i, layer in enumerate(model.layers)
                ]
                rec["target_layer_ids"] = _plain(model.target_layer_ids)
            except Exception as exc:
                rec["init_error"] = _err(exc)
        out.append(rec)
    Path(job["out"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
