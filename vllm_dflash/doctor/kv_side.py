"""The KV-cache side of `doctor --context`: per layer, the bytes one sequence's KV cache takes, as vLLM's own KV-cache
spec classes size it.

Runs INSIDE a vLLM environment of this build (the patched CPU wheel; see doctor/kvcache.py), as
    python -m vllm_dflash.doctor.kv_side '{"context", "max_num_batched_tokens", "block_size", "dtype",
        "num_speculative_tokens", "speculators", "drafter": [{"num_kv_heads", "head_dim", "window"}],
        "target": [...]}'
and prints one JSON object. Standard library, torch and vLLM only.

The drafter's layers are sized twice: as this build keeps them (the patched qwen3_dflash.py's own
`dflash_kv_cache_windows`: a sliding layer's SlidingWindowSpec keeps its window plus the drafted tokens) and as stock
0.20.1 keeps them (every drafter Attention is built without a window: FullAttentionSpec). The target's attention
layers as vLLM gives any model's layers: FullAttentionSpec, or SlidingWindowSpec for a sliding one. Each figure is
`spec.max_memory_usage_bytes(config)`: what vLLM reserves per sequence (admission, the max_model_len check and the
start-up "maximum concurrency" line are computed from it), at max_model_len = the context. With a target, also the
whole model's reservation as vLLM's KV-cache config code computes it over its KV-cache groups
(kv_cache_utils.get_kv_cache_groups, then _max_memory_usage_bytes_from_groups: hybrid allocator, padding layers
included), this build's layout against stock's.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any


def _config(context: int, max_num_batched_tokens: int) -> Any:
    """The parts of a VllmConfig the specs' max_memory_usage_bytes and kv_cache_utils' grouping read."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=context),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        scheduler_config=SimpleNamespace(
            max_num_batched_tokens=max_num_batched_tokens, disable_hybrid_kv_cache_manager=False
        ),
        # a DFlash drafter: this build's grouping (patch 0004) applies to it; stock's ignores the method
        speculative_config=SimpleNamespace(method="dflash"),
    )


def sizes(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dtype = getattr(torch, str(job["dtype"]))
    block = int(job["block_size"])
    cfg = _config(int(job["context"]), int(job["max_num_batched_tokens"]))

    def spec(layer: dict[str, Any], window: int | None) -> Any:
        shape = {"block_size": block, "num_kv_heads": int(layer["num_kv_heads"]), "head_size": int(layer["head_dim"])}
        if window is None:
            return FullAttentionSpec(**shape, dtype=dtype)
        return SlidingWindowSpec(**shape, dtype=dtype, sliding_window=int(window))

    def rows(layers: list[dict[str, Any]], windows: list[int | None]) -> list[dict[str, Any]]:
        out = []
        for layer, window in zip(layers, windows, strict=True):
            s = spec(layer, window)
            out.append({"spec": type(s).__name__, "window": window, "bytes": int(s.max_memory_usage_bytes(cfg))})
        return out

    def reserved(target_specs: list[Any], drafter_specs: list[Any]) -> int:
        """vLLM's own per-sequence reservation for the whole model's attention layers: its KV-cache groups (hybrid
        allocator, padding included) and the bytes its admission and max_model_len check use."""
        from vllm.v1.core import kv_cache_utils

        named = {f"model.layers.{i}.self_attn.attn": s for i, s in enumerate([*target_specs, *drafter_specs])}
        groups = kv_cache_utils.get_kv_cache_groups(cfg, named)
        return int(kv_cache_utils._max_memory_usage_bytes_from_groups(cfg, groups))

    drafter = list(job["drafter"])
    windows = [layer.get("window") for layer in drafter]
    target = list(job.get("target") or [])
    # This build's rule, as the patched model runs it (a speculators-format drafter keeps the whole context, and so
    # does one whose KV bytes per token are not its target's: known with a target only).
    per_token = [
        spec({**layer, "window": None}, None).page_size_bytes // block for layer in (*drafter[:1], *target[:1])
    ]
    ours = qwen3_dflash.dflash_kv_cache_windows(
        windows,
        int(job["num_speculative_tokens"]),
        speculators=bool(job.get("speculators")),
        kv_bytes_per_token=(per_token[0], per_token[1]) if target else None,
        target_is_hybrid=bool(job.get("target_is_hybrid")),
    )
    target_specs = [spec(layer, layer.get("window")) for layer in target]
    return {
        "this_build": rows(drafter, list(ours)),
        "stock": rows(drafter, [None] * len(drafter)),
        "target": rows(target, [layer.get("window") for layer in target]) if target else None,
        "reserved": {
            "this_build": reserved(target_specs, [spec(x, w) for x, w in zip(drafter, ours, strict=True)]),
            "stock": reserved(target_specs, [spec(x, None) for x in drafter]),
        }
        if target
        else None,
        "vllm_version": __import__("vllm").__version__,
    }


def main(argv: list[str] | None = None) -> int:
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    print(json.dumps(sizes(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
