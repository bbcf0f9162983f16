"""One vLLM release's reading of drafter configs: the doctor's column for stock 0.20.1, this build and upstream.

Runs INSIDE a vLLM environment (doctor/sides.py picks it: the pin's CPU environment with the stock or the patched
wheel, the installed vLLM of this build, or an upstream release's Python files over the pin's environment), as

    python -m vllm_dflash.doctor.vllm_side     (JSON lines: a request per line in, an answer per line out)

A request: {"config": config.json, "target": config.json | null, "serve": {"max_model_len", "block_size",
"max_num_batched_tokens"} (any), "runners": ["default"] | ["v2", "v1"]}. Standard library, torch and vLLM only; one
process answers every request of a batch or a session (vLLM's imports cost seconds).

Per config, what `vllm serve --speculative-config '{"method": "dflash", "model": DRAFTER}'` does up to the drafter's
construction, with this environment's own code:
- EngineArgs(...).create_engine_config(): get_config, the target's and the drafter's ModelConfig, SpeculativeConfig and
  VllmConfig with their checks (a refusal here is the "load" stage);
- the target model (the user's --target config, or a stand-in Qwen3 of the drafter's num_target_layers and target
  hidden size) and then the drafter built on the meta device with the loader's own initialize_model (no weights);
  a refusal while building the drafter is the "model" stage;
- per drafter attention layer, read from the constructed modules: the window, causality and kind, the KV-cache spec
  the layer reports, the rotary layout, sinks and value scale, the quantization of its projections;
- the taps: the runner's own function (aux layers from the config, else the target model's default), given to the
  target model's own set_aux_hidden_state_layers, and the order the target's EagleModelMixin records them in when
  its forward calls it layer after layer; the drafter's fc input width beside them;
- with serve arguments, each KV-cache spec's max_memory_usage_bytes at them (target and drafter).
Answers {"vllm_version", "proposer_causal", "runners": {runner: `read_one`'s record}}.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_SLIDING, _FULL = "sliding_attention", "full_attention"


def _err(exc: BaseException) -> str:
    """One line: the exception's class and its first meaningful line (pydantic wraps a check's message)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Value error, "):
            return f"{type(exc).__name__}: {ln.removeprefix('Value error, ').split(' [type=')[0]}"[:400]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # transformers' validators, vLLM's kernel choice: reasons below
        first = f"{first} {'; '.join(lines[1:3])}"
    return f"{type(exc).__name__}: {first}"[:400]


def _parse_once() -> None:
    """vLLM's config parse tried once, as the first try answers. From 0.33 `get_config` parses through
    `vllm.transformers_utils.repo_utils.with_retry` (2 tries, a 2 s sleep between: "to tolerate a concurrent HF cache
    refresh briefly hiding config.json"), so every config a release refuses cost 2 s here. The doctor's configs are
    files it wrote itself into its own temporary directory, which no cache refresh touches, and the parse of a local
    file is deterministic: the second try raises what the first raised. Replaced in this side process only, in every
    module that imported it by name (0.20.1 has it too, for hub file lists only: its parse never retried)."""
    import importlib
    import inspect

    try:
        repo_utils = importlib.import_module("vllm.transformers_utils.repo_utils")
    except ImportError:
        return
    retry = getattr(repo_utils, "with_retry", None)
    if retry is None or "max_retries" not in inspect.signature(retry).parameters:
        return
    signature = inspect.signature(retry)

    def once(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["max_retries"] = 1
        return retry(*bound.args, **bound.kwargs)

    importlib.import_module("vllm.transformers_utils.config")  # the module that parses through it, by name
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "with_retry", None) is retry:
            module.with_retry = once  # type: ignore[attr-defined]


def _plain(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


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
    "vocab_size",
    "draft_vocab_size",
    "hidden_size",
    "target_hidden_size",
)
_MISSING = "<absent>"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stand_in_target(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3 target for a drafter given alone: as deep as the drafter's num_target_layers (else its ids), as wide
    as its target hidden size, with its vocabulary; sizes only, nothing the drafter's reading depends on."""
    got = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    layer: dict[str, Any] = got if isinstance(got, dict) else {}
    dflash: dict[str, Any] = layer["dflash_config"] if isinstance(layer.get("dflash_config"), dict) else {}
    ids = [i for i in (dflash.get("target_layer_ids") or raw.get("aux_hidden_state_layer_ids") or []) if _int(i)]
    # deep enough for every id (the drafter's own num_target_layers is a note; only --target decides a misfit)
    depth = max([_int(layer.get("num_target_layers")) or 36, *(i + 2 for i in ids if i < 1024)])
    depth = depth if 1 <= depth <= 1024 else 36
    hidden = _int(layer.get("target_hidden_size")) or _int(layer.get("hidden_size")) or 64
    heads = _int(layer.get("num_attention_heads")) or 4
    heads = heads if hidden % heads == 0 else 1
    kv = _int(layer.get("num_key_value_heads")) or heads
    kv = kv if heads % kv == 0 else heads
    vocab = _int(layer.get("vocab_size")) or 256
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": _int(layer.get("head_dim")) or hidden // heads,
        "intermediate_size": 64,
        "vocab_size": vocab,
        "max_position_embeddings": max(_int(layer.get("max_position_embeddings")) or 0, 1 << 20),
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


class Side:
    """This environment's vLLM, imported once."""

    def __init__(self) -> None:
        import torch
        import vllm

        from vllm_dflash.conformance.vllm_side import inspect_models_here

        inspect_models_here()  # the meta device and the CPU: no CUDA for a subprocess to keep out
        if os.environ.get("VLLM_DFLASH_SIDE_WAIVE_TRITON"):
            # An upstream release whose x86 CPU platform refuses to configure without triton-cpu (0.34): nothing here
            # runs a kernel (the models are built on the meta device), so the check is waived (sides.py says so).
            import vllm.triton_utils as tu

            tu.HAS_TRITON = True
        _parse_once()
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.engine.arg_utils import EngineArgs

        self.torch = torch
        self.version = str(vllm.__version__)
        self.root = Path(vllm.__file__).resolve().parent
        self.EngineArgs = EngineArgs
        self.set_current_vllm_config = set_current_vllm_config
        self._init_dist = (init_distributed_environment, ensure_model_parallel_initialized)
        self._dist_ready = False
        try:  # where a release keeps it
            from vllm.utils.torch_utils import set_default_torch_dtype
        except ImportError:
            from vllm.model_executor.model_loader.utils import set_default_torch_dtype
        self.set_default_torch_dtype = set_default_torch_dtype
        from vllm.model_executor.model_loader.utils import initialize_model

        self.initialize_model = initialize_model
        self.proposer_causal = self._proposer_metadata_causal()
        self._targets: dict[str, tuple[Any, str]] = {}

    # -- facts read from this release's code -------------------------------------------------------------------
    def _proposer_metadata_causal(self) -> bool | None:
        """The V1 DFlash proposer's attention metadata for drafter layers: `causal=False` in its
        CommonAttentionMetadata (vllm/v1/spec_decode/dflash.py); None where the release has no V1 proposer."""
        path = self.root / "v1" / "spec_decode" / "dflash.py"
        if not path.is_file():
            return None
        values = {
            kw.value.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("CommonAttentionMetadata")
            for kw in node.keywords
            if kw.arg == "causal" and isinstance(kw.value, ast.Constant)
        }
        return None if len(values) != 1 else bool(next(iter(values)))

    def _dist(self, cfg: Any) -> None:
        if self._dist_ready:
            return
        init, ensure = self._init_dist
        with self.set_current_vllm_config(cfg):
            init(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-dflash-doctor-')}",
                backend="gloo",
            )
            ensure(1, 1)
        self._dist_ready = True

    # -- one config ---------------------------------------------------------------------------------------------
    def engine_config(self, drafter_dir: str, target_dir: str, k: int, serve: dict[str, Any], runner: str) -> Any:
        """The VllmConfig `vllm serve TARGET --speculative-config {...}` builds (no tokenizer, weights never read)."""
        if runner in ("v1", "v2"):
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        else:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        kwargs: dict[str, Any] = {
            "model": target_dir,
            "speculative_config": {"method": "dflash", "model": drafter_dir, "num_speculative_tokens": k},
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "load_format": "dummy",
        }
        for key in ("max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if serve.get(key) is not None:
                kwargs[key] = int(serve[key])
        if serve.get("dtype"):
            kwargs["dtype"] = str(serve["dtype"])
        return self.EngineArgs(**kwargs).create_engine_config()

    def _align_blocks(self, cfg: Any, rec: dict[str, Any]) -> None:
        """What the executor does before the models are built: the platform's block size for its attention backend,
        and for a hybrid target the attention block raised to hold a Mamba state page (may override --block-size)."""
        from vllm.platforms import current_platform

        update = getattr(current_platform, "update_block_size_for_backend", None)
        if update is None:
            return
        try:
            with self.set_current_vllm_config(cfg):
                update(cfg)
        except Exception as exc:
            rec["block_size_error"] = _err(exc)

    def target(self, cfg: Any, tcfg: dict[str, Any], serve: dict[str, Any], rec: dict[str, Any]) -> Any:
        """The target model built on the meta device, once per distinct target config and serve arguments (configs
        of a batch share it: only its layers, default aux layers and recording are read)."""
        key = json.dumps([tcfg, serve], sort_keys=True)
        if key not in self._targets:
            try:
                with self.set_current_vllm_config(cfg):
                    self._targets[key] = (self.build(cfg, cfg.model_config), "")
            except Exception as exc:
                self._targets[key] = (None, _err(exc))
        model, error = self._targets[key]
        if error:
            rec["target_error"] = error
        else:
            rec["target_class"] = type(model).__name__
            rec["target_supports_eagle3"] = bool(getattr(model, "supports_eagle3", False))
        return model

    def build(self, cfg: Any, model_config: Any, prefix: str = "") -> Any:
        torch = self.torch
        with self.set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            return self.initialize_model(vllm_config=cfg, model_config=model_config, prefix=prefix)

    def read_one(
        self, raw: dict[str, Any], target: dict[str, Any] | None, serve: dict[str, Any], runner: str
    ) -> dict[str, Any]:
        """{"load_error" | "model_error" (one line each, where the release refuses), "loaded" (the loaded config's
        attention attributes), "architecture", "layers" (per drafter layer), "taps", "recorded", "fc_in",
        "target_hidden", "model", "kv" (per layer KV-cache specs and bytes: target and drafter), "resolution"
        (this build's per-layer attribution, where the release has patch 0002)}."""
        rec: dict[str, Any] = {"runner": runner}
        k = _num_speculative_tokens(raw)
        with tempfile.TemporaryDirectory(prefix="vllm-dflash-doctor-") as d:
            drafter_dir, target_dir = Path(d, "drafter"), Path(d, "target")
            drafter_dir.mkdir()
            target_dir.mkdir()
            (drafter_dir / "config.json").write_text(json.dumps(raw))
            tcfg = target if target is not None else stand_in_target(raw)
            rec["target_stand_in"] = target is None
            if target is not None:
                rec["target_registry"] = _registry_eagle3(target)
            (target_dir / "config.json").write_text(json.dumps(tcfg))
            try:
                cfg = self.engine_config(str(drafter_dir), str(target_dir), k, serve, runner)
            except Exception as exc:  # the release refuses the config: the line it prints
                if target is None:
                    rec["load_error"] = _err(exc)
                    return rec
                # the user's target is what vLLM refuses? Then the drafter is read beside the stand-in, and said.
                tcfg = stand_in_target(raw)
                (target_dir / "config.json").write_text(json.dumps(tcfg))
                try:
                    cfg = self.engine_config(str(drafter_dir), str(target_dir), k, serve, runner)
                except Exception:
                    rec["load_error"] = _err(exc)
                    return rec
                rec["target_load_error"] = _err(exc)
                rec["target_stand_in"] = True
            self._align_blocks(cfg, rec)
            spec = cfg.speculative_config
            hf = spec.draft_model_config.hf_config
            rec["loaded"] = {name: _plain(getattr(hf, name, _MISSING)) for name in LOADED}
            rec["architecture"] = _plain(getattr(spec.draft_model_config, "architecture", None))
            rec["num_speculative_tokens"] = spec.num_speculative_tokens
            rec["use_v2_model_runner"] = _plain(getattr(cfg, "use_v2_model_runner", None))
            self._dist(cfg)
            target_model = self.target(cfg, tcfg, serve, rec)
            with self.set_current_vllm_config(cfg):
                resolution: list[Any] = []
                try:
                    with _capture_resolution(resolution):
                        drafter = self.build(cfg, spec.draft_model_config)
                except Exception as exc:
                    rec["model_error"] = _err(exc)
                    rec.update(self.taps(cfg, target_model))
                    rec["model_class"] = _model_class(spec.draft_model_config)
                    return rec
            rec["model_class"] = type(drafter).__name__
            rec["resolution"] = [
                {"kind": x.kind, "kind_from": x.kind_from, "window_from": x.window_from, "causal_from": x.causal_from}
                for x in resolution
            ]
            rec["layers"] = [self.layer(cfg, m) for m in _attention_layers(drafter)]
            rec["model"] = self.model_facts(drafter)
            rec.update(self.taps(cfg, target_model))
            inner = getattr(drafter, "model", None)
            fc = getattr(inner, "fc", None)
            rec["fc_in"] = _int(getattr(fc, "input_size", None))
            rec["target_hidden"] = _int(cfg.model_config.get_hidden_size())
            rec["kv"] = self.kv(cfg, drafter, target_model)
            rec["v2_unsupported"] = self.v2_unsupported(cfg)
            rec["speculator_error"] = self.speculator(cfg)
        return rec

    def layer(self, cfg: Any, attn: Any) -> dict[str, Any]:
        """One drafter attention layer as constructed: window and causality (0.33+: the layer's own `sliding_window`
        and `causal`; 0.20.1: the backend window the layer's impl carries, under the proposer's metadata), the kind
        those give, the KV-cache spec it reports."""
        owner = getattr(attn, "_doctor_owner", None)
        impl = getattr(attn, "impl", None)
        out: dict[str, Any] = {"name": getattr(attn, "layer_name", "")}
        if owner is not None and hasattr(owner, "causal"):  # 0.33+: DFlashQwen3Attention(sliding_window, causal)
            window = _int(getattr(attn, "sliding_window", None))
            causal = bool(owner.causal)
            out["read_from"] = "self_attn.attn.sliding_window, self_attn.causal"
        else:
            pair = getattr(impl, "sliding_window", None)
            left, right = pair if isinstance(pair, tuple) and len(pair) == 2 else (-1, -1)
            window = left + 1 if isinstance(left, int) and left >= 0 else None
            # the proposer's metadata is non-causal; a right edge of 0 is a causal mask (FlashAttention's convention)
            causal = right == 0 if self.proposer_causal is False else bool(self.proposer_causal)
            out["read_from"] = "self_attn.attn.impl.sliding_window under the proposer's causal=False metadata"
            out["backend_window"] = [left, right]
        out.update({"kind": _SLIDING if window is not None else _FULL, "window": window, "causal": causal})
        try:
            s = attn.get_kv_cache_spec(cfg)
        except Exception as exc:
            out["spec_error"] = _err(exc)
        else:
            out["spec"] = type(s).__name__ if s is not None else None
            out["spec_window"] = _int(getattr(s, "sliding_window", None))
        if owner is not None:
            rope = getattr(owner, "rotary_emb", None)
            out["rope"] = (
                None
                if rope is None
                else {
                    "class": type(rope).__name__,
                    "is_neox_style": _plain(getattr(rope, "is_neox_style", None)),
                    "rotary_dim": _plain(getattr(rope, "rotary_dim", None)),
                    "base": _plain(getattr(rope, "base", None)),
                }
            )
            out["sink"] = getattr(owner, "attention_sink_bias", None) is not None
            out["v_scale"] = _plain(getattr(owner, "v_scale", None))
            qkv = getattr(owner, "qkv_proj", None)
            out["qkv"] = _linear(qkv)
        return out

    def model_facts(self, drafter: Any) -> dict[str, Any]:
        inner = getattr(drafter, "model", None)
        lp = getattr(drafter, "logits_processor", None)
        return {
            "logit_scale": _plain(getattr(lp, "scale", None)),
            "soft_cap": _plain(getattr(lp, "soft_cap", None)),
            "use_aux_hidden_state": _plain(getattr(inner, "use_aux_hidden_state", None)),
            "lm_head": _linear(getattr(drafter, "lm_head", None)),
            "fc": _linear(getattr(inner, "fc", None)),
            "quant_config": type(getattr(inner, "quant_config", None)).__name__,
        }

    def taps(self, cfg: Any, target_model: Any) -> dict[str, Any]:
        """The runner's aux layers for the drafter, set on the target the runner's way, and the order the target's
        forward records them in (EagleModelMixin._maybe_add_hidden_state, called with 0 before the first layer
        and with i + 1 after layer i, as the target's forward does)."""
        out: dict[str, Any] = {}
        try:
            taps, where = self._config_taps(cfg)
        except Exception as exc:
            out["taps_error"] = _err(exc)
            return out
        out["taps_from"] = where
        if not taps and target_model is not None:
            default = getattr(target_model, "get_eagle3_default_aux_hidden_state_layers", None)
            if default is not None:
                taps, out["taps_from"] = tuple(default()), "the target model's default aux layers"
        out["taps"] = None if not taps else [_plain(t) for t in taps]
        if taps and target_model is not None:
            try:
                target_model.set_aux_hidden_state_layers(tuple(taps))
                out["recorded"] = _recorded(target_model)
            except Exception as exc:
                out["recorded_error"] = _err(exc)
        return out

    def _config_taps(self, cfg: Any) -> tuple[Any, str]:
        """The aux layers the runner serving this config reads from the drafter's config: Model Runner V1's own
        `_get_eagle3_aux_layers_from_config` where V1 serves it, else the V2 runner's
        `get_eagle3_aux_layers_from_config`."""
        v1 = (self.root / "v1" / "worker" / "gpu_model_runner.py").is_file()
        if v1 and not getattr(cfg, "use_v2_model_runner", False):
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner

            stub = SimpleNamespace(speculative_config=cfg.speculative_config)
            return GPUModelRunner._get_eagle3_aux_layers_from_config(stub), "V1 gpu_model_runner"
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(cfg.speculative_config), "V2 eagle3_utils"

    def kv(self, cfg: Any, drafter: Any, target_model: Any) -> dict[str, Any]:
        """Every attention (and state) layer's KV-cache spec, as the runner collects them (each layer's own
        get_kv_cache_spec), and the bytes vLLM reserves per sequence for it at this config's max_model_len and
        scheduler (KVCacheSpec.max_memory_usage_bytes)."""
        out: dict[str, Any] = {"drafter": _specs(cfg, drafter)}
        if target_model is not None:
            out["target"] = _specs(cfg, target_model)
        return {
            **out,
            "max_model_len": cfg.model_config.max_model_len,
            "block_size": cfg.cache_config.block_size,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        }

    def v2_unsupported(self, cfg: Any) -> Any:
        fn = getattr(cfg, "_get_v2_model_runner_unsupported_features", None)
        if fn is None:
            return None
        try:
            return _plain(fn())
        except Exception as exc:
            return _err(exc)

    def speculator(self, cfg: Any) -> str | None:
        """The V2 runner's DFlash speculator built for this config (its own checks), where the release has one."""
        try:
            from vllm.v1.worker.gpu.spec_decode.dflash import speculator as mod
        except ImportError:
            return None
        except Exception as exc:  # 0.34's imports Triton's runtime, which this environment lacks
            return f"not built here: {_err(exc)}"
        cls = next(
            (v for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("Speculator") and "DFlash" in k),
            None,
        )
        if cls is None:
            return None
        try:
            with self.set_current_vllm_config(cfg):
                cls(cfg, self.torch.device("meta"))
        except Exception as exc:
            return _err(exc)
        return None


def _specs(cfg: Any, model: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, layer in model.named_modules():
        getter = getattr(layer, "get_kv_cache_spec", None)
        if getter is None or not callable(getter):
            continue
        row: dict[str, Any] = {"name": getattr(layer, "layer_name", name)}
        try:
            s = getter(cfg)
        except Exception as exc:
            rows.append({**row, "error": _err(exc)})
            continue
        if s is None:
            continue
        row.update(spec=type(s).__name__, window=_int(getattr(s, "sliding_window", None)))
        row["block_size"] = _int(getattr(s, "block_size", None))
        try:
            row["bytes"] = int(s.max_memory_usage_bytes(cfg))
        except Exception as exc:
            row["error"] = _err(exc)
        rows.append(row)
    return rows


def _num_speculative_tokens(raw: dict[str, Any]) -> int:
    """k = block_size - 1, from the drafter's own block size (dflash_config first), else the reference's 16."""
    got = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    layer: dict[str, Any] = got if isinstance(got, dict) else {}
    dflash: dict[str, Any] = layer["dflash_config"] if isinstance(layer.get("dflash_config"), dict) else {}
    block = _int(dflash.get("block_size")) or _int(layer.get("block_size")) or 16
    return max(1, block - 1)


@contextlib.contextmanager
def _capture_resolution(into: list[Any]) -> Any:
    """Record what this build's patch 0002 resolves while the drafter is built (only where the release has it): the
    per-layer attribution the doctor prints; the values themselves are read from the built modules."""
    try:
        from vllm.model_executor.models import qwen3_dflash as qd
    except Exception:
        yield
        return
    original = getattr(qd, "resolve_dflash_layer_attention", None)
    if original is None:
        yield
        return

    def recording(*args: Any, **kwargs: Any) -> Any:
        got = original(*args, **kwargs)
        into[:] = list(got)
        return got

    qd.resolve_dflash_layer_attention = recording
    try:
        yield
    finally:
        qd.resolve_dflash_layer_attention = original


def _attention_layers(model: Any) -> list[Any]:
    """The drafter's attention layers in layer order, each tagged with the module that owns it (self_attn)."""
    out = []
    for _name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if attn is not None and hasattr(attn, "get_kv_cache_spec") and hasattr(module, "qkv_proj"):
            attn._doctor_owner = module
            out.append(attn)
    return out


def _linear(layer: Any) -> dict[str, Any] | None:
    if layer is None:
        return None
    weight = getattr(layer, "weight", None)
    return {
        "quant_method": type(getattr(layer, "quant_method", None)).__name__,
        "weight_dtype": str(getattr(weight, "dtype", None)).removeprefix("torch."),
        "weight_shape": list(getattr(weight, "shape", ()) or ()),
    }


def _model_class(model_config: Any) -> str | None:
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        cls, _arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
        return str(cls.__name__)
    except Exception:
        return None


def _registry_eagle3(target: dict[str, Any]) -> dict[str, Any]:
    """Per architecture the target config names: whether this release's registry has a model for it and whether that
    model class implements SupportsEagle3 (records aux hidden states), without building it."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    named = target.get("architectures")
    archs: list[Any] = named if isinstance(named, list) else []
    out: dict[str, Any] = {}
    for arch in archs:
        if not isinstance(arch, str):
            continue
        try:
            cls = ModelRegistry._try_load_model_cls(arch)
        except Exception:
            cls = None
        out[arch] = None if cls is None else bool(supports_eagle3(cls))
    return out


def _recorded(target: Any) -> list[int] | None:
    """The aux indices the target's forward records, in its order."""
    lm = target
    if hasattr(target, "get_language_model"):
        lm = target.get_language_model()
    inner = getattr(lm, "model", None)
    add = getattr(inner, "_maybe_add_hidden_state", None)
    layers = getattr(inner, "layers", None)
    if add is None or layers is None:
        return None
    marks: list[Any] = []
    marks = add(marks, 0, _Mark(0), None)
    for idx in range(len(layers)):
        marks = add(marks, idx + 1, _Mark(idx + 1), None)
    return [m.index for m in marks]


class _Mark:
    """Stands in for a hidden-state tensor: which aux index the forward recorded."""

    def __init__(self, index: int) -> None:
        self.index = index


def serve_lines(answer: Any) -> int:
    """JSON lines: a ready line, then one answer line per request line; everything else anything prints goes to
    stderr (vLLM logs to stdout). On stdin/stdout, or (`--serve SOCKET --idle S`) as a server on a unix socket
    that answers every connection at once and exits after S seconds without one."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        ready = answer(None)
    except Exception as exc:
        out.write(json.dumps({"side_error": _err(exc)}) + "\n")
        return 1
    args = sys.argv[1:]
    if args[:1] == ["--serve"]:
        return _serve_socket(answer, ready, args[1], float(args[3]) if args[2:3] == ["--idle"] else 600.0)
    out.write(json.dumps({"ready": ready}) + "\n")
    _answer_lines(answer, sys.stdin, out)
    return 0


def _answer_lines(answer: Any, lines: Any, out: Any) -> None:
    for line in lines:
        if not line.strip():
            continue
        try:
            got = answer(json.loads(line))
        except Exception as exc:  # never lose the batch to one config
            got = {"side_error": _err(exc)}
        out.write(json.dumps(got) + "\n")
        out.flush()


def _serve_socket(answer: Any, ready: Any, path: str, idle: float) -> int:
    """Every client served at once, each on its own thread (two doctor runs never wait for each other's whole
    batch), their requests answered one at a time under one lock (vLLM's config state and the runner's environment
    variable are process-wide). Gone after `idle` seconds with no client connected."""
    import socket
    import threading

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    sock.bind(tmp)
    sock.listen(8)
    os.replace(tmp, path)  # published whole: a client never connects to a half-made server
    mine = os.stat(path).st_ino
    sock.settimeout(idle)
    one_at_a_time = threading.Lock()
    clients = [0]
    counted = threading.Lock()

    def locked(request: Any) -> Any:
        with one_at_a_time:
            return answer(request)

    def serve(conn: Any) -> None:
        try:
            # one file to read, one to write: a text file that does both cannot write after reading ahead
            with conn, conn.makefile("r") as rf, conn.makefile("w", buffering=1) as wf:
                wf.write(json.dumps({"ready": ready}) + "\n")
                wf.flush()
                _answer_lines(locked, rf, wf)
        except OSError:  # a client that went away (or only checked that we are here)
            pass
        finally:
            with counted:
                clients[0] -= 1

    try:
        while True:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                with counted:
                    if clients[0] == 0:
                        break
                continue  # idle counts from the last client's end, not while one is served
            conn.settimeout(None)
            with counted:
                clients[0] += 1
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    finally:
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == mine:
                os.unlink(path)
    sys.stderr.flush()
    os._exit(0)  # torch's and vLLM's exit hooks (process groups) have nothing to finish here


def main() -> int:
    side: Side | None = None

    def answer(request: dict[str, Any] | None) -> dict[str, Any]:
        nonlocal side
        if request is None:
            side = Side()
            return {"vllm_version": side.version, "proposer_causal": side.proposer_causal}
        assert side is not None
        runs = {}
        for runner in request.get("runners") or ["default"]:
            try:
                runs[runner] = side.read_one(
                    request["config"], request.get("target"), dict(request.get("serve") or {}), runner
                )
            except Exception as exc:
                runs[runner] = {"side_error": _err(exc)}
        return {"vllm_version": side.version, "proposer_causal": side.proposer_causal, "runners": runs}

    return serve_lines(answer)


if __name__ == "__main__":
    sys.exit(main())
