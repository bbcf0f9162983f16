"""`doctor --context N`: the drafter's KV cache per sequence at N tokens of context, this build against stock 0.20.1,
and the target's attention KV cache beside it (with `--target`), so the drafter's share is plain.

    per_sequence(manifest, queues, checkpoint, diagnosis, context, target=None) -> KVCacheFigures

The bytes are not a formula of ours: each layer's figure is vLLM's own `KVCacheSpec.max_memory_usage_bytes` at the
serve arguments, read by the doctor's columns from the models each build constructs in its own environment
(doctor/vllm_side.py: every layer's own `get_kv_cache_spec`; this build's windows and the tokens a sliding layer keeps
are patch 0002's and 0004's code as the patched model runs it, stock 0.20.1 builds every drafter layer full). With
`--target`, the KV-cache groups of target + drafter and the bytes a request reserves over them are each build's own
`get_kv_cache_groups` in that build's environment (doctor/kvgroups.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_dflash.doctor import kvgroups
from vllm_dflash.doctor.checkpoint import Checkpoint
from vllm_dflash.doctor.diagnose import Diagnosis
from vllm_dflash.errors import CheckpointError
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import Queues

THIS_BUILD = "this build"
_THIS = "this_build"  # its key in per_sequence_bytes
# vLLM's KV block for attention layers on CUDA (CacheConfig.block_size): a hybrid (linear-attention) target raises it
# so its attention pages match the linear layers' state, which rounds each sliding layer's share up to larger blocks.
BLOCK_SIZE = 16
# `vllm serve`'s default token budget on GPUs below 70 GiB (vLLM 0.20.1 EngineArgs.get_batch_default_values): a
# sliding layer holds its window plus one prefill chunk (SlidingWindowSpec.max_admission_blocks_per_request).
MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_DFLASH_BLOCK = 16  # the reference's block size when the config names none (k = block - 1 drafted tokens)
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
_ATTENTION_KINDS = {"full_attention": None, "sliding_attention": "sliding"}  # target layer_types vLLM gives a KV cache


@dataclass(frozen=True)
class LayerKV:
    layer: int
    spec: str  # FullAttentionSpec | SlidingWindowSpec
    window: int | None  # tokens a SlidingWindowSpec keeps
    bytes: int


@dataclass(frozen=True)
class KVCacheFigures:
    context: int
    dtype: str
    block_size: int
    max_num_batched_tokens: int
    num_speculative_tokens: int
    this_build: tuple[LayerKV, ...]
    stock: tuple[LayerKV, ...]
    target: tuple[LayerKV, ...] | None  # the target's attention layers (None: no --target)
    target_note: str  # what of the target is not counted (linear-attention state)
    vllm_version: str
    # With a target: vLLM's own KV-cache groups of target + drafter, each build's code in its own environment
    # (doctor/kvgroups.py): this build's and stock's count, page and attention block size, and the bytes vLLM
    # reserves per request over them (None: no --target).
    groups: Mapping[str, Any] | None = None

    @property
    def per_sequence_bytes(self) -> dict[str, int]:
        out = {_THIS: sum(x.bytes for x in self.this_build), "stock": sum(x.bytes for x in self.stock)}
        if self.target is not None:
            out["target"] = sum(x.bytes for x in self.target)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The `kv_cache` object of `doctor --json`."""
        return {**asdict(self), "per_sequence_bytes": self.per_sequence_bytes}


def dtype_of(raw: Mapping[str, Any]) -> str:
    """The KV dtype vLLM serves the drafter in: its config's (dtype / torch_dtype), bf16 when it names none."""
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return _DTYPES.get(name.removeprefix("torch."), "bfloat16")


def _heads(raw: Mapping[str, Any], what: str) -> tuple[int, int]:
    """(KV heads, head dim) of a config, or one line saying which field is missing."""
    kv = raw.get("num_key_value_heads", raw.get("num_attention_heads"))
    head_dim = raw.get("head_dim")
    if head_dim is None and raw.get("hidden_size") and raw.get("num_attention_heads"):
        head_dim = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
    if not isinstance(kv, int) or not isinstance(head_dim, int) or kv <= 0 or head_dim <= 0:
        raise CheckpointError(
            f"the {what} config gives no num_key_value_heads / head_dim (or hidden_size and num_attention_heads)",
            f"--context sizes the KV cache from them: pass the {what}'s full config.json",
        )
    return kv, head_dim


def drafter_layers(ck: Checkpoint, d: Diagnosis) -> list[dict[str, Any]]:
    """Per drafter layer, its KV heads, head dim and this build's attention window (patch 0002's resolution)."""
    kv, head_dim = _heads(ck.config, "drafter")
    rows = [r for r in d.rows if r.build == THIS_BUILD]
    if not rows:
        raise CheckpointError(
            f"this build does not serve {ck.name} ({d.verdict})", "--context sizes a drafter this build runs"
        )
    return [{"num_kv_heads": kv, "head_dim": head_dim, "window": r.window} for r in sorted(rows, key=lambda r: r.layer)]


def target_layers(raw: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The target's attention layers (text_config for multimodal configs) and a note on the layers not counted."""
    text: Mapping[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    kv, head_dim = _heads(text, "target")
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise CheckpointError("the target config gives no num_hidden_layers", "pass the target model's config.json")
    kinds = list(text.get("layer_types") or ["full_attention"] * n)
    window = text.get("sliding_window")
    layers, other = [], []
    for kind in kinds:
        if kind not in _ATTENTION_KINDS:
            other.append(kind)
            continue
        sliding = _ATTENTION_KINDS[kind] == "sliding" and isinstance(window, int)
        layers.append({"num_kv_heads": kv, "head_dim": head_dim, "window": window if sliding else None})
    note = ""
    if other:
        counts = {k: other.count(k) for k in dict.fromkeys(other)}
        note = (
            ", ".join(f"{c} {k}" for k, c in counts.items())
            + " layer(s) not counted: their state per sequence does not grow with the context"
        )
    return layers, note


# The target config's Gated DeltaNet fields (Qwen3.5/3.6, Qwen3-Next) -> kv_groups_side's names.
_GDN_FIELDS = {
    "linear_num_key_heads": "num_k_heads",
    "linear_num_value_heads": "num_v_heads",
    "linear_key_head_dim": "head_k_dim",
    "linear_value_head_dim": "head_v_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}


def target_gdn(raw: Mapping[str, Any]) -> dict[str, int] | None:
    """The target's Gated DeltaNet layers (count and state shape), or None for a target without linear layers."""
    text: Mapping[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    count = list(text.get("layer_types") or []).count("linear_attention")
    if not count:
        return None
    missing = [k for k in _GDN_FIELDS if not isinstance(text.get(k), int)]
    if missing:
        raise CheckpointError(
            f"the target config has {count} linear_attention layers but no {', '.join(missing)}",
            "--context groups the KV cache from them: pass the target's full config.json",
        )
    return {"count": count, **{ours: int(text[k]) for k, ours in _GDN_FIELDS.items()}}


def _layer_rows(rows: Sequence[Mapping[str, Any]]) -> tuple[LayerKV, ...]:
    return tuple(LayerKV(i, str(r["spec"]), r.get("window"), int(r["bytes"])) for i, r in enumerate(rows))


def built_rows(readings: Mapping[str, Any]) -> dict[str, Any]:
    """The per-layer KV-cache figures the built models reported (vllm_side: each layer's own get_kv_cache_spec and
    KVCacheSpec.max_memory_usage_bytes at the serve arguments): this build's and stock's drafter
    layers, the target's layers (this build's run), and what vLLM release computed them."""
    from vllm_dflash.doctor.columns import OURS, STOCK

    def rows(build: str, part: str) -> list[dict[str, Any]] | None:
        kv = readings[build].kv
        if not kv or part not in kv:
            return None
        bad = [r for r in kv[part] if "error" in r]
        if bad:
            raise CheckpointError(
                f"{build}: vLLM could not size {bad[0]['name']}'s KV cache: {bad[0]['error']}",
                "check the serve arguments (--max-model-len, --block-size, --max-num-batched-tokens)",
            )
        return [{"spec": r["spec"], "window": r.get("window"), "bytes": r["bytes"]} for r in kv[part]]

    target_error = readings[OURS].target.get("target_load_error") or readings[OURS].target.get("target_error")
    if target_error and readings[OURS].kv and "target" in readings[OURS].kv:
        raise CheckpointError(
            f"vLLM does not build the --target model: {target_error}",
            "--context sizes the target you serve: pass its full config.json",
        )
    for build in (OURS, STOCK):
        r = readings[build]
        if r.refusal is not None or not r.kv:
            raise CheckpointError(
                f"{build} does not build this drafter ({r.refusal.line if r.refusal else 'no KV-cache specs'})",
                "--context sizes a drafter both builds run",
            )
    return {
        "this_build": rows(OURS, "drafter"),
        "stock": rows(STOCK, "drafter"),
        "target": rows(OURS, "target"),
        "vllm_version": readings[OURS].version,
        "serve": {
            k: readings[OURS].kv.get(k) for k in ("max_model_len", "block_size", "max_num_batched_tokens", "dtype")
        },
    }


def per_sequence(
    manifest: Manifest,
    queues: Queues,
    ck: Checkpoint,
    d: Diagnosis,
    context: int,
    target: Mapping[str, Any] | None = None,
    serve: Mapping[str, int] | None = None,
    readings: Mapping[str, Any] | None = None,
) -> KVCacheFigures:
    """This build's and stock's drafter KV cache per sequence at `context` tokens (and the target's attention KV
    cache), from vLLM's spec classes in this build's CPU environment (built once, cached like conformance's)."""
    if context <= 0:
        raise CheckpointError(f"--context {context}: not a number of tokens", "pass a positive context length")
    chunk = int((serve or {}).get("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS))
    kv_block = int((serve or {}).get("block_size", BLOCK_SIZE))
    drafter = drafter_layers(ck, d)
    k = (d.block_size or DEFAULT_DFLASH_BLOCK) - 1
    tlayers, note = target_layers(target) if target is not None else ([], "")
    dtype = dtype_of(ck.config)
    if readings is None:
        raise CheckpointError("--context needs the built models' readings", "run it through the doctor (Doctor.read)")
    out = built_rows(readings)
    if out["target"] is not None:
        state = [r for r in out["target"] if r["spec"] not in ("FullAttentionSpec", "SlidingWindowSpec")]
        if state:
            kinds = sorted({r["spec"] for r in state})
            note = f"{len(state)} target layer(s) keep a state ({', '.join(kinds)}) that does not grow with the context"
    built = out.get("serve") or {}
    groups = None
    if target is not None:
        gjob = {
            "context": int(built.get("max_model_len") or context),
            "max_num_batched_tokens": chunk,
            "dtype": str(built.get("dtype") or dtype),
            "num_speculative_tokens": k,
            "drafter": drafter,
            "target": {"attention": tlayers, "gdn": target_gdn(target)},
            "speculators": ck.speculators,
        }
        groups = kvgroups.groups(manifest, queues, gjob)
    return KVCacheFigures(
        context=context,
        dtype=str(built.get("dtype") or dtype),
        block_size=int(built.get("block_size") or kv_block),
        max_num_batched_tokens=chunk,
        num_speculative_tokens=k,
        this_build=_layer_rows(out["this_build"]),
        stock=_layer_rows(out["stock"]),
        target=_layer_rows(out["target"]) if out.get("target") is not None else None,
        target_note=note,
        vllm_version=str(out.get("vllm_version", "")),
        groups=groups,
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def render_text(f: KVCacheFigures) -> str:
    """The doctor's printed KV-cache section."""
    per = f.per_sequence_bytes
    out = [
        f"KV cache per sequence at {f.context:,} tokens of context ({f.dtype}, KV blocks of {f.block_size} tokens, "
        f"prefill chunks of {f.max_num_batched_tokens:,}, k = {f.num_speculative_tokens}; vLLM {f.vllm_version}'s "
        "KVCacheSpec.max_memory_usage_bytes):"
    ]
    for name, rows in ((THIS_BUILD, f.this_build), ("stock 0.20.1", f.stock)):
        layers = ", ".join(
            f"{r.layer}: {r.spec}" + (f" {r.window}" if r.window else "") + f" {_mib(r.bytes)}" for r in rows
        )
        out.append(f"  drafter, {name}: {sum(r.bytes for r in rows):,} bytes ({_mib(sum(r.bytes for r in rows))})")
        out.append(f"    layers {layers}")
    if per["stock"]:
        out.append(f"  this build keeps {per[_THIS] / per['stock']:.1%} of stock's drafter KV cache")
    if f.target is not None:
        t = per["target"]
        out.append(f"  target, every layer's KV cache or state ({len(f.target)}): {t:,} bytes ({_mib(t)})")
        if f.target_note:
            out.append(f"    {f.target_note}")
        for name, key in ((THIS_BUILD, _THIS), ("stock 0.20.1", "stock")):
            if t + per[key]:
                out.append(f"  drafter share, {name}: {per[key] / (t + per[key]):.1%} of target + drafter")
    if f.groups:
        out.append(kvgroups.render(f.groups))
    return "\n".join(out)


# The `vllm serve` arguments that size the KV cache per sequence, as --context takes them.
SERVE_SIZING = {
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--block-size": "block_size",
    "--max-model-len": "max_model_len",
}


def serve_shape(args: Sequence[str], where: str) -> dict[str, int]:
    """The sizing arguments of a `vllm serve` command line (`--name value` or `--name=value`); others are skipped."""
    out: dict[str, int] = {}
    items = list(args)
    for i, item in enumerate(items):
        name, eq, value = item.partition("=")
        if name not in SERVE_SIZING:
            continue
        text = value if eq else (items[i + 1] if i + 1 < len(items) else "")
        if not text.isdigit() or int(text) <= 0:
            raise CheckpointError(f"{where}: {name} {text!r} is no positive number", f"give {name} a token count")
        out[SERVE_SIZING[name]] = int(text)
    return out
