"""Record every DFlash drafter proposal (test infrastructure).

One proposal step drafts for every request in the batch at once: the proposer runs the drafter over the stacked
blocks [bonus, mask x k] (one per request, request i's block at query rows i*(k+1)..), computes logits for the k mask
rows of each block and returns the drafted ids as a [batch, k] tensor. We wrap the proposer's `propose` (to see what
it returned: the draft ids vLLM actually proposes), the model runner's `propose_draft_token_ids` (which requests were
in the batch, from the runner's input batch and request states), the drafter model's
`forward` (the blocks' input ids and positions) and `compute_logits` (the logits), split the step per request, and
append one JSON line per request block to the file named by $VLLM_DFLASH_RECORD_FILE at that moment:
    {"pid", "call", "index", "batch", "req_id", "prompt_len", "prompt_sha", "block_input_ids", "block_positions",
     "logits" (k rows), "draft_ids" (k, from propose's return value)}
`req_id`, `prompt_len` and `prompt_sha` come from the runner's request state (not from the block), so the driver can
map a block to its request by its prompt and check that against the block's positions and bonus token.

Under tensor parallelism every rank runs the drafter; only tensor-parallel rank 0 records (its logits are gathered).
Nothing is changed: every wrapper returns what the wrapped method returns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

RECORD_FILE_VAR = "VLLM_DFLASH_RECORD_FILE"
_state: dict[str, Any] = {"active": False, "block": None, "logits": None, "call": 0, "runner": None}


def prompt_sha(ids: list[int]) -> str:
    """The fingerprint the driver computes the same way (vllm_side.prompt_sha)."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (in-process worker before init): a single rank
        return 0


def _requests(batch: int) -> list[dict[str, Any]]:
    """What the model runner that called the proposer says the batch's requests are, in its batch order (None
    entries when it cannot tell: the driver then maps by content alone)."""
    runner = _state["runner"]
    out: list[dict[str, Any]] = []
    try:
        req_ids = list(runner.input_batch.req_ids[:batch])  # type: ignore[union-attr]
    except AttributeError:
        return [{"req_id": None, "prompt_len": None, "prompt_sha": None}] * batch
    for rid in req_ids:
        state = getattr(runner, "requests", {}).get(rid)
        prompt = list(getattr(state, "prompt_token_ids", None) or [])
        out.append({"req_id": rid, "prompt_len": len(prompt), "prompt_sha": prompt_sha(prompt) if prompt else None})
    return out


def _write(draft_ids: Any) -> None:
    path = os.environ.get(RECORD_FILE_VAR)
    block, logits = _state["block"], _state["logits"]
    if not path or block is None or logits is None or draft_ids is None or _tp_rank() != 0:
        return
    drafts = draft_ids.detach().cpu().tolist()
    batch = len(drafts)
    k = len(drafts[0]) if batch else 0
    ids, pos = block
    rows = logits.detach().float().cpu()
    if rows.shape[0] < batch * k or len(ids) < batch * (k + 1):
        raise RuntimeError(
            f"dflash recorder: a proposal step of {batch} request(s) x {k} drafts came with {len(ids)} block "
            f"tokens and {rows.shape[0]} logit rows"
        )
    _state["call"] += 1
    lines = []
    for i, req in enumerate(_requests(batch)):
        lo = i * (k + 1)
        lines.append(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "call": _state["call"],
                    "index": i,
                    "batch": batch,
                    **req,
                    "block_input_ids": ids[lo : lo + k + 1],
                    "block_positions": pos[lo : lo + k + 1],
                    "logits": rows[i * k : (i + 1) * k].tolist(),
                    "draft_ids": drafts[i],
                }
            )
        )
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def _layout(runner: Any) -> dict[str, Any]:
    """What the served drafter attends with, read from the loaded models: each drafter layer's backend window
    (left, right) as its attention implementation holds it, and the target layers whose input the target records
    for the drafter (vLLM's aux indices)."""
    drafter = getattr(getattr(runner, "drafter", None), "model", None)
    inner = getattr(drafter, "model", None)
    windows = []
    for layer in getattr(inner, "layers", []):
        impl = getattr(getattr(getattr(layer, "self_attn", None), "attn", None), "impl", None)
        window = getattr(impl, "sliding_window", None)
        windows.append(list(window) if isinstance(window, (tuple, list)) else window)
    target = getattr(runner, "model", None)
    aux = getattr(getattr(target, "model", target), "aux_hidden_state_layers", None)
    if aux is None and hasattr(target, "get_language_model"):
        aux = getattr(getattr(target.get_language_model(), "model", None), "aux_hidden_state_layers", None)
    return {"windows": windows, "aux_layers": None if aux is None else [int(a) for a in aux]}


def _write_layout(runner: Any) -> None:
    """One {"layout": ...} line per record file (per case), before its first proposal."""
    path = os.environ.get(RECORD_FILE_VAR)
    if not path or _state.get("layout_for") == path or _tp_rank() != 0:
        return
    _state["layout_for"] = path
    with open(path, "a") as f:
        f.write(json.dumps({"layout": _layout(runner)}) + "\n")


def install() -> None:
    if not os.environ.get(RECORD_FILE_VAR):
        return
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.spec_decode import dflash
    from vllm.v1.worker import gpu_model_runner

    cls = qwen3_dflash.DFlashQwen3ForCausalLM
    if getattr(cls, "_vllm_dflash_recorder", False):
        return
    orig_forward = cls.forward
    orig_logits = cls.compute_logits
    orig_propose = dflash.DFlashProposer.propose
    runner_cls = gpu_model_runner.GPUModelRunner  # the CPU runner subclasses it and keeps this method
    orig_runner_propose = runner_cls.propose_draft_token_ids

    @functools.wraps(orig_runner_propose)
    def runner_propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state["runner"] = self  # the proposer keeps no reference to its runner: remember who called it
        _write_layout(self)
        try:
            return orig_runner_propose(self, *args, **kwargs)
        finally:
            _state["runner"] = None

    @functools.wraps(orig_forward)
    def forward(self: Any, input_ids: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        if _state["active"]:
            _state["block"] = (input_ids.detach().cpu().tolist(), positions.detach().cpu().tolist())
        return orig_forward(self, input_ids, positions, *args, **kwargs)

    @functools.wraps(orig_logits)
    def compute_logits(self: Any, hidden_states: Any) -> Any:
        logits = orig_logits(self, hidden_states)
        if _state["active"]:
            _state["logits"] = logits
        return logits

    @functools.wraps(orig_propose)
    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.update(active=True, block=None, logits=None)
        try:
            out = orig_propose(self, *args, **kwargs)
        finally:
            _state["active"] = False
        _write(out)
        _state.update(block=None, logits=None)
        return out

    cls.forward = forward  # type: ignore[method-assign]
    cls.compute_logits = compute_logits  # type: ignore[method-assign]
    dflash.DFlashProposer.propose = propose  # type: ignore[method-assign]
    runner_cls.propose_draft_token_ids = runner_propose  # type: ignore[method-assign]
    cls._vllm_dflash_recorder = True
