"""Record the DFlash drafter's logits for every proposal (test infrastructure).

The proposer runs the drafter over one block per request, [bonus, mask x k] at positions block_start..block_start+k,
then computes logits for the k mask rows and drafts their argmax. We wrap the drafter model's `forward` (to see the
block's input ids and positions) and `compute_logits` (to see the logits), pair them, and append one JSON line per
proposal to the file named by $VLLM_DFLASH_RECORD_FILE at that moment (the model may run in a worker process, so
the driver reads the file; with an in-process worker, one process runs several cases, each with its own file).
Nothing is changed: both wrappers return what the wrapped method returns.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

RECORD_FILE_VAR = "VLLM_DFLASH_RECORD_FILE"
_state: dict[str, Any] = {"block": None}


def install() -> None:
    if not os.environ.get(RECORD_FILE_VAR):
        return
    import torch
    from vllm.model_executor.models import qwen3_dflash

    cls = qwen3_dflash.DFlashQwen3ForCausalLM
    if getattr(cls, "_vllm_dflash_recorder", False):
        return
    orig_forward = cls.forward
    orig_logits = cls.compute_logits

    @functools.wraps(orig_forward)
    def forward(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _state["block"] = (input_ids.detach().cpu().tolist(), positions.detach().cpu().tolist())
        return orig_forward(self, input_ids, positions, *args, **kwargs)

    @functools.wraps(orig_logits)
    def compute_logits(self: Any, hidden_states: torch.Tensor) -> Any:
        logits = orig_logits(self, hidden_states)
        block = _state["block"]
        _state["block"] = None
        path = os.environ.get(RECORD_FILE_VAR)
        if block is not None and logits is not None and path:
            ids, pos = block
            k = int(logits.shape[0])
            rows = logits.detach().float().cpu()
            line = {
                "block_input_ids": ids[: k + 1],
                "block_positions": pos[: k + 1],
                "logits": rows.tolist(),
                "draft_ids": rows.argmax(dim=-1).tolist(),
            }
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return logits

    cls.forward = forward  # type: ignore[method-assign]
    cls.compute_logits = compute_logits  # type: ignore[method-assign]
    cls._vllm_dflash_recorder = True
