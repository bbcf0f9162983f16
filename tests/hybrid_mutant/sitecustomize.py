"""Negative controls for the hybrid target conformance (test-only): put this directory first on a vLLM side's
PYTHONPATH with VLLM_DFLASH_GDN_MUTANT set, and one torch GDN kernel of the CPU runtime queue (patches/cpu/0008)
is broken before the GDN layer imports it. The conformance run must then disagree with transformers."""

import os

_MUTANT = os.environ.get("VLLM_DFLASH_GDN_MUTANT", "")

if _MUTANT:
    from vllm.model_executor.layers.mamba.ops import gdn_cpu

    if _MUTANT == "drop-initial-state":
        # Chunked prefill forgets the recurrent state stored by the previous chunk.
        _chunk = gdn_cpu.chunk_gated_delta_rule

        def _forgetful_chunk(*args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs["initial_state"] = None
            return _chunk(*args, **kwargs)

        gdn_cpu.chunk_gated_delta_rule = _forgetful_chunk
    elif _MUTANT == "decode-keeps-state":
        # The packed decode step computes its output but never stores the updated state.
        _decode = gdn_cpu.fused_recurrent_gated_delta_rule_packed_decode

        def _stale_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, **kw):  # type: ignore[no-untyped-def]
            kept = initial_state.clone()
            result = _decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices, **kw)
            initial_state.copy_(kept)
            return result

        gdn_cpu.fused_recurrent_gated_delta_rule_packed_decode = _stale_decode
    else:
        raise SystemExit(f"unknown VLLM_DFLASH_GDN_MUTANT {_MUTANT!r}")
