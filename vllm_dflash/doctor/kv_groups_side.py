"""vLLM's own KV-cache grouping of a hybrid target plus a DFlash drafter, stock against this build.

Runs INSIDE a vLLM environment (a CPU build of the pin; see doctor/kvcache.py), as
    python -m vllm_dflash.doctor.kv_groups_side '{"dtype", "kernel_block_alignment", "num_speculative_tokens",
        "target": {"attention": [{"num_kv_heads", "head_dim", "window"}], "gdn": {"count", "num_k_heads",
        "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"}}, "drafter": [{"num_kv_heads", "head_dim",
        "window"}]}'
and prints one JSON object. Standard library, torch and vLLM only.

The attention block size and the mamba page padding follow vLLM's hybrid alignment (Platform._align_hybrid_block_size,
no prefix caching: the smallest multiple of the kernel alignment whose attention page holds one GDN state); the GDN
state shapes and dtypes come from vLLM's MambaStateShapeCalculator. The groups are `kv_cache_utils.get_kv_cache_groups`
on the whole model's specs: the drafter's layers as stock builds them (FullAttentionSpec) and as this build does
(patch 0004: a sliding layer keeps `dflash_kv_cache_windows` tokens in a SlidingWindowSpec). A grouping vLLM refuses
is reported as its one-line error, never raised.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any


def _config() -> Any:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        speculative_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1),
    )


def groups(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models import qwen3_dflash
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    dtype = getattr(torch, str(job["dtype"]))
    target = job["target"]
    gdn = target.get("gdn")
    attn = list(target["attention"])
    one_token = FullAttentionSpec(
        block_size=1, num_kv_heads=int(attn[0]["num_kv_heads"]), head_size=int(attn[0]["head_dim"]), dtype=dtype
    ).page_size_bytes
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
            block_size=block,
            page_size_padded=block * one_token,
            mamba_type="gdn_attention",
        )

    def spec(layer: dict[str, Any], window: int | None) -> Any:
        shape = {"block_size": block, "num_kv_heads": int(layer["num_kv_heads"]), "head_size": int(layer["head_dim"])}
        if window is None:
            return FullAttentionSpec(**shape, dtype=dtype)
        return SlidingWindowSpec(**shape, dtype=dtype, sliding_window=int(window))

    base: dict[str, Any] = {}
    n_gdn = int(gdn["count"]) if gdn else 0
    for i in range(n_gdn):
        base[f"model.layers.{i}.linear_attn"] = mamba
    for j, layer in enumerate(attn):
        base[f"model.layers.{n_gdn + j}.self_attn.attn"] = spec(layer, layer.get("window"))
    first = n_gdn + len(attn)
    drafter = list(job["drafter"])
    windows = [d.get("window") for d in drafter]
    ours = qwen3_dflash.dflash_kv_cache_windows(windows, int(job["num_speculative_tokens"]), speculators=False)

    def grouped(drafter_windows: list[int | None]) -> dict[str, Any]:
        named = dict(base)
        for j, (layer, w) in enumerate(zip(drafter, drafter_windows, strict=True)):
            named[f"model.layers.{first + j}.self_attn.attn"] = spec(layer, w)
        try:
            out = kv_cache_utils.get_kv_cache_groups(_config(), named)
        except (NotImplementedError, ValueError, AssertionError) as e:
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        sizes = sorted({g.kv_cache_spec.page_size_bytes for g in out})
        return {
            "count": len(out),
            "layers_per_group": sorted({len(g.layer_names) for g in out}),
            "page_size_bytes": sizes,
            "block_sizes": sorted({g.kv_cache_spec.block_size for g in out}),
            "groups": [[type(g.kv_cache_spec).__name__, len(g.layer_names)] for g in out],
        }

    return {
        "attention_block_size": block,
        "attention_page_size_bytes": block * one_token,
        "mamba_page_size_unpadded": raw or None,
        "drafter_windows": {"this_build": list(ours), "stock": [None] * len(drafter)},
        "this_build": grouped(list(ours)),
        "stock": grouped([None] * len(drafter)),
        "vllm_version": __import__("vllm").__version__,
    }


def main(argv: list[str] | None = None) -> int:
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    print(json.dumps(groups(job)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
