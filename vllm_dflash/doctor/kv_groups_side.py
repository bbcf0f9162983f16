"""vLLM's own KV-cache grouping of a target plus a DFlash drafter, as the build installed in this environment does it.

Runs INSIDE a vLLM environment (a CPU build of the pin: this build's, or stock's; see doctor/kvgroups.py), as
    python -m vllm_dflash.doctor.kv_groups_side '{"dtype", "kernel_block_alignment", "num_speculative_tokens",
        "context", "max_num_batched_tokens", "speculators",
        "target": {"attention": [{"num_kv_heads", "head_dim", "window"}], "gdn": null | {"count", "num_k_heads",
        "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"}}, "drafter": [{"num_kv_heads", "head_dim",
        "window"}]}'
and prints one JSON object (or, given {"jobs": [...]}, a list of them). Standard library, torch and vLLM only.

Every decision is the installed build's code, run here: the tokens each drafter layer's KV-cache spec keeps come from
its `qwen3_dflash.dflash_kv_cache_windows` where the build has one (patch 0004, with the drafter's and the target's KV
bytes per token and whether the target is hybrid; its refusal is reported as the one line it raises), and every
layer keeps the whole context where it has none (stock 0.20.1 builds every drafter Attention without a window); the
groups are that build's `kv_cache_utils.get_kv_cache_groups` on the whole model's specs, with a speculative config
naming dflash, and the bytes a request reserves are its `_max_memory_usage_bytes_from_groups` at `context` tokens. The
attention block size and the Mamba page padding follow vLLM's hybrid alignment (Platform._align_hybrid_block_size, no
prefix caching: the smallest multiple of the kernel alignment whose attention page holds one GDN state); the GDN state
shapes and dtypes come from vLLM's MambaStateShapeCalculator. A grouping vLLM refuses is reported as its one-line
error, never raised.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any


def _config(k: int, context: int, chunk: int) -> Any:
    """The parts of a VllmConfig that vLLM's grouping and per-request reservation read."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=chunk),
        speculative_config=SimpleNamespace(method="dflash", num_speculative_tokens=k, use_eagle=lambda: True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        model_config=SimpleNamespace(max_model_len=context),
        cache_config=SimpleNamespace(mamba_cache_mode="none", num_gpu_blocks_override=None),
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def model_specs(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(what both builds compute alike, with this build's refusal as "error" where it refuses, the whole model's
    KV-cache spec per layer name as this environment's build makes it, the config vLLM's grouping reads)."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models import qwen3_dflash
    from vllm.utils.math_utils import cdiv
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    dtype = getattr(torch, str(job["dtype"]))
    k = int(job["num_speculative_tokens"])
    context = int(job["context"])
    chunk = int(job["max_num_batched_tokens"])
    target = job["target"]
    gdn = target.get("gdn")
    attn = list(target["attention"])
    drafter = list(job["drafter"])

    def per_token(layer: dict[str, Any]) -> int:
        return int(
            FullAttentionSpec(
                block_size=1, num_kv_heads=int(layer["num_kv_heads"]), head_size=int(layer["head_dim"]), dtype=dtype
            ).page_size_bytes
        )

    one_token = per_token(attn[0])
    kv_bytes = (per_token(drafter[0]), one_token)
    align = int(job["kernel_block_alignment"])
    block = align
    mamba: Any = None
    raw = 0
    if gdn:
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
            1, gdn["num_k_heads"], gdn["num_v_heads"], gdn["head_k_dim"], gdn["head_v_dim"], gdn["conv_kernel"]
        )
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(dtype, "auto", "auto")
        raw = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1).page_size_bytes
        block = max(block, align * cdiv(raw, align * one_token))
        mamba = MambaSpec(
            shapes=shapes,
            dtypes=dtypes,
            block_size=context,  # mamba_block_size is max_model_len without prefix caching
            page_size_padded=block * one_token,
            mamba_type="gdn_attention",
            num_speculative_blocks=k,
        )

    def spec(layer: dict[str, Any], window: int | None) -> Any:
        shape = {"block_size": block, "num_kv_heads": int(layer["num_kv_heads"]), "head_size": int(layer["head_dim"])}
        if window is None:
            return FullAttentionSpec(**shape, dtype=dtype)
        return SlidingWindowSpec(**shape, dtype=dtype, sliding_window=int(window))

    out: dict[str, Any] = {
        "vllm_version": __import__("vllm").__version__,
        "attention_block_size": block,
        "attention_page_size_bytes": block * one_token,
        "mamba_page_size_unpadded": raw or None,
        "kv_bytes_per_token": {"drafter": kv_bytes[0], "target": kv_bytes[1]},
    }
    config = _config(k, context, chunk)
    windows = [d.get("window") for d in drafter]
    rule = getattr(qwen3_dflash, "dflash_kv_cache_windows", None)
    kept: list[int | None] = [None] * len(drafter)
    try:
        if rule is not None:
            hybrid = bool(gdn)
            speculators = bool(job.get("speculators"))
            kept = list(rule(windows, k, speculators=speculators, kv_bytes_per_token=kv_bytes, target_is_hybrid=hybrid))
    except ValueError as exc:  # this build refuses the drafter at load
        return {**out, "error": _one_line(exc)}, {}, config
    out["drafter_windows"] = kept
    named: dict[str, Any] = {}
    n_gdn = int(gdn["count"]) if gdn else 0
    for i in range(n_gdn):
        named[f"model.layers.{i}.linear_attn"] = mamba
    for j, layer in enumerate(attn):
        named[f"model.layers.{n_gdn + j}.self_attn.attn"] = spec(layer, layer.get("window"))
    first = n_gdn + len(attn)
    for j, (layer, w) in enumerate(zip(drafter, kept, strict=True)):
        named[f"model.layers.{first + j}.self_attn.attn"] = spec(layer, w)
    return out, named, config


def groups(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.core import kv_cache_utils

    out, named, config = model_specs(job)
    if "error" in out:
        return out
    try:
        found = kv_cache_utils.get_kv_cache_groups(config, named)
    except (NotImplementedError, ValueError, AssertionError) as e:
        return {**out, "error": _one_line(e)}
    drafter_names = set(list(named)[-len(job["drafter"]) :])  # the drafter's layers come last
    return {
        **out,
        "count": len(found),
        "layers_per_group": sorted({len(g.layer_names) for g in found}),
        "page_size_bytes": sorted({g.kv_cache_spec.page_size_bytes for g in found}),
        "block_sizes": sorted({g.kv_cache_spec.block_size for g in found}),
        "groups": [
            [type(g.kv_cache_spec).__name__, len(g.layer_names), len(drafter_names & set(g.layer_names))] for g in found
        ],
        "bytes_per_request": int(kv_cache_utils._max_memory_usage_bytes_from_groups(config, found)),
    }


def main(argv: list[str] | None = None) -> int:
    """One job object, or {"jobs": [...]}: a list of results in one process (vLLM is imported once)."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    from vllm_dflash.conformance.vllm_side import inspect_models_here

    inspect_models_here()
    out = [groups(j) for j in job["jobs"]] if "jobs" in job else groups(job)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
