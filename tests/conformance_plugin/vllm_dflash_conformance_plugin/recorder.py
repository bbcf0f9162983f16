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
KV-cache groups: in the process that runs vLLM's scheduler, the recorder also appends to $VLLM_DFLASH_RECORD_FILE.kv
one line with the KV-cache layout when a scheduler starts, and one line per slot allocation that succeeded (every
scheduled request of every step) with the blocks each KV-cache group then holds for that request:
    {"layout": {"groups": [{"gid", "spec", "window", "block_size", "layers", "drafter_layers"}], "num_blocks",
     "max_concurrency", "bytes_per_request", "pool_bytes_per_block" (each as vLLM's own KV-cache config code
     computes it), "max_model_len"}}
    {"alloc": {"req_id", "prompt_sha", "prompt_len", "computed", "new", "lookahead", "held": [per group],
     "reused": freed blocks of a running request's group that this allocation handed out again (so far)}}
A layer is a drafter layer when its index is at least the target's layer count (the drafter's layers follow the
target's in vLLM's naming).

Nothing is changed: every wrapper returns what the wrapped method returns (unless $VLLM_DFLASH_RECORDER_PERTURB=1,
which only the test that the run catches a proposal other than the drafter's argmax sets).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
from typing import Any

RECORD_FILE_VAR = "VLLM_DFLASH_RECORD_FILE"
# Test-only, for the test that the run catches it: "1" makes propose() return, for every request, a first draft id
# one above what the drafter computed (so not the argmax of the logits it recorded); vLLM then verifies those ids.
PERTURB_VAR = "VLLM_DFLASH_RECORDER_PERTURB"
KV_SUFFIX = ".kv"  # the KV-cache group records go to $VLLM_DFLASH_RECORD_FILE + this
_state: dict[str, Any] = {"active": False, "block": None, "logits": None, "call": 0, "runner": None}
# Kept on each KV-cache manager (attribute _KV_STATE): each request's block ids per group at its last allocation, the
# ids freed while their request was still running (a sliding-window group dropping blocks outside its window), and how
# often those came back. On the manager, not in a table keyed by id(manager): one process runs engine after engine, and
# a new manager at a freed one's address inherited its evicted ids (a full-KV run counted 8 "reused" blocks).
_KV_STATE = "_vllm_dflash_kv_state"
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


def prompt_sha(ids: list[int]) -> str:
    """The fingerprint the driver computes the same way (vllm_side.prompt_sha)."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (in-process worker before init): a single rank
        return 0


def _lists(x: Any) -> Any:
    """A tensor as plain (nested) lists of Python numbers (a bf16 tensor's too); anything else as it is."""
    return x.detach().cpu().tolist() if hasattr(x, "detach") else x


def requests_of(runner: Any, batch: int) -> list[dict[str, Any]]:
    """What the model runner that called the proposer says the batch's requests are, in its batch order (None
    entries when it cannot tell: the driver then maps by content alone)."""
    try:
        req_ids = list(runner.input_batch.req_ids[:batch])
    except AttributeError:
        return [{"req_id": None, "prompt_len": None, "prompt_sha": None}] * batch
    out: list[dict[str, Any]] = []
    for rid in req_ids:
        state = getattr(runner, "requests", {}).get(rid)
        prompt = list(getattr(state, "prompt_token_ids", None) or [])
        out.append({"req_id": rid, "prompt_len": len(prompt), "prompt_sha": prompt_sha(prompt) if prompt else None})
    return out


def block_lines(
    drafts: list[list[int]],
    ids: list[int],
    pos: list[int],
    rows: list[list[float]],
    requests: list[dict[str, Any]],
    call: int,
    pid: int,
) -> list[dict[str, Any]]:
    """One line per request block of a proposal step: request i's block is at query rows i*(k+1).., its logits at
    rows i*k.., and its draft ids are `drafts[i]` -- what propose() returned, never recomputed from the logits."""
    batch = len(drafts)
    k = len(drafts[0]) if batch else 0
    if len(rows) < batch * k or len(ids) < batch * (k + 1):
        raise RuntimeError(
            f"dflash recorder: a proposal step of {batch} request(s) x {k} drafts came with {len(ids)} block "
            f"tokens and {len(rows)} logit rows"
        )
    lines = []
    for i, req in enumerate(requests[:batch]):
        lo = i * (k + 1)
        lines.append(
            {
                "pid": pid,
                "call": call,
                "index": i,
                "batch": batch,
                **req,
                "block_input_ids": ids[lo : lo + k + 1],
                "block_positions": pos[lo : lo + k + 1],
                "logits": rows[i * k : (i + 1) * k],
                "draft_ids": drafts[i],
            }
        )
    return lines


def _write(draft_ids: Any) -> None:
    path = os.environ.get(RECORD_FILE_VAR)
    block, logits = _state["block"], _state["logits"]
    if not path or block is None or logits is None or draft_ids is None or _tp_rank() != 0:
        return
    drafts = _lists(draft_ids)
    _state["call"] += 1
    lines = block_lines(
        drafts, block[0], block[1], _lists(logits), requests_of(_state["runner"], len(drafts)), _state["call"],
        os.getpid(),
    )  # fmt: skip
    with open(path, "a") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))


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
    if aux is None and target is not None and hasattr(target, "get_language_model"):
        aux = getattr(getattr(target.get_language_model(), "model", None), "aux_hidden_state_layers", None)
    return {"windows": windows, "aux_layers": None if aux is None else [int(a) for a in aux], "fed": _fed(target)}


class _Mark:
    def __init__(self, index: int) -> None:
        self.index = index


def _fed(target: Any) -> list[int] | None:
    """The aux indices the loaded target records, in the order its forward hands them to the drafter's fc: its own
    EagleModelMixin._maybe_add_hidden_state, called with 0 before the first layer and i + 1 after layer i."""
    lm = target.get_language_model() if hasattr(target, "get_language_model") else target
    inner = getattr(lm, "model", None)
    add, layers = getattr(inner, "_maybe_add_hidden_state", None), getattr(inner, "layers", None)
    if add is None or layers is None:
        return None
    marks: list[Any] = add([], 0, _Mark(0), None)
    for i in range(len(layers)):
        marks = add(marks, i + 1, _Mark(i + 1), None)
    return [m.index for m in marks]


def _write_layout(runner: Any) -> None:
    """One {"layout": ...} line per record file (per case), before its first proposal."""
    path = os.environ.get(RECORD_FILE_VAR)
    if not path or _state.get("layout_for") == path or _tp_rank() != 0:
        return
    _state["layout_for"] = path
    with open(path, "a") as f:
        f.write(json.dumps({"layout": _layout(runner)}) + "\n")


def _append_kv(record: dict[str, Any]) -> None:
    path = os.environ.get(RECORD_FILE_VAR)
    if path:
        with open(path + KV_SUFFIX, "a") as f:
            f.write(json.dumps(record) + "\n")


def _kv_layout(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The KV-cache groups as the scheduler sees them, and what vLLM's own config code computes from them."""
    from vllm.v1.core import kv_cache_utils

    target_layers = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        idx = [int(m.group(1)) for name in group.layer_names if (m := _LAYER_INDEX.search(name))]
        spec = group.kv_cache_spec
        groups.append(
            {
                "gid": gid,
                "spec": type(spec).__name__,
                "window": getattr(spec, "sliding_window", None),
                "block_size": int(spec.block_size),
                "layers": len(group.layer_names),
                "drafter_layers": sum(i >= target_layers for i in idx),
            }
        )
    return {
        "groups": groups,
        "num_blocks": int(kv_cache_config.num_blocks),
        "max_concurrency": float(kv_cache_utils.get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)),
        "bytes_per_request": int(
            kv_cache_utils._max_memory_usage_bytes_from_groups(vllm_config, kv_cache_config.kv_cache_groups)
        ),
        "max_model_len": int(vllm_config.model_config.max_model_len),
        # What one block id costs in the shared pools (vLLM's own divisor of its KV memory; releases without it: None)
        "pool_bytes_per_block": _pool_bytes_per_block(kv_cache_utils, vllm_config, kv_cache_config.kv_cache_groups),
    }


def _pool_bytes_per_block(kv_cache_utils: Any, vllm_config: Any, groups: Any) -> int | None:
    """vLLM's own divisor of its KV memory (releases without it: None). 0.25 added the config to its arguments (it
    decides whether pools are packed), so it is called with what the release's own signature names."""
    pool = getattr(kv_cache_utils, "_pool_bytes_per_block", None)
    if pool is None:
        return None
    if "vllm_config" in inspect.signature(pool).parameters:
        return int(pool(vllm_config, groups))
    return int(pool(groups))


def _kv_state(manager: Any) -> dict[str, Any]:
    state: dict[str, Any] | None = getattr(manager, _KV_STATE, None)
    if state is None:
        state = {"last": {}, "evicted": set(), "reused": 0}
        setattr(manager, _KV_STATE, state)
    return state


def _record_alloc(manager: Any, request: Any, num_new_tokens: int, num_new_computed: int, lookahead: int) -> None:
    state = _kv_state(manager)
    rid = request.request_id
    ids_now = []
    held = []
    for single in manager.coordinator.single_type_managers:
        ids = [b.block_id for b in single.req_to_blocks.get(rid, ()) if not b.is_null]
        ids_now.append(ids)
        held.append(len(ids))
    for gid, ids in enumerate(ids_now):
        fresh = set(ids) - set(state["last"].get(rid, [[]] * len(ids_now))[gid])
        state["reused"] += len(fresh & state["evicted"])
        state["evicted"] -= fresh
    prev = state["last"].get(rid)
    if prev is not None:
        for gid, ids in enumerate(ids_now):
            state["evicted"] |= set(prev[gid]) - set(ids)  # freed while the request runs: outside a window
    state["last"][rid] = ids_now
    prompt = list(getattr(request, "prompt_token_ids", None) or [])
    _append_kv(
        {
            "alloc": {
                "req_id": rid,
                "prompt_sha": prompt_sha(prompt) if prompt else None,
                "prompt_len": len(prompt),
                "computed": int(request.num_computed_tokens) + int(num_new_computed),
                "new": int(num_new_tokens),
                "lookahead": int(lookahead),
                "held": held,
                "reused": state["reused"],
            }
        }
    )


def _install_kv_recorder() -> None:
    from vllm.v1.core import kv_cache_manager
    from vllm.v1.core.sched import scheduler

    mgr_cls = kv_cache_manager.KVCacheManager
    if getattr(mgr_cls, "_vllm_dflash_recorder", False):
        return
    orig_alloc = mgr_cls.allocate_slots
    orig_free = mgr_cls.free
    orig_init = scheduler.Scheduler.__init__

    @functools.wraps(orig_alloc)
    def allocate_slots(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        out = orig_alloc(self, request, num_new_tokens, *args, **kwargs)
        if out is not None:
            num_new_computed = kwargs.get("num_new_computed_tokens", args[0] if args else 0)
            lookahead = kwargs.get("num_lookahead_tokens", args[2] if len(args) > 2 else 0)
            _record_alloc(self, request, num_new_tokens, num_new_computed, lookahead)
        return out

    @functools.wraps(orig_free)
    def free(self: Any, request: Any) -> Any:
        _kv_state(self)["last"].pop(request.request_id, None)  # its blocks go back: not evictions
        return orig_free(self, request)

    @functools.wraps(orig_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        _append_kv({"layout": _kv_layout(self.vllm_config, self.kv_cache_config)})

    mgr_cls.allocate_slots = allocate_slots
    mgr_cls.free = free
    scheduler.Scheduler.__init__ = init
    mgr_cls._vllm_dflash_recorder = True


def perturbed(draft_ids: Any, vocab: int) -> Any:
    """`draft_ids` with every request's first id moved one up (mod the vocabulary): a proposal that is not the
    drafter's argmax, of the type propose() returns (a tensor, or lists)."""
    if hasattr(draft_ids, "clone"):
        out = draft_ids.clone()
        out[:, 0] = (out[:, 0] + 1) % vocab
        return out
    return [[(int(r[0]) + 1) % vocab, *r[1:]] for r in draft_ids]


def wrap(model_cls: Any, proposer_cls: Any, runner_cls: Any) -> None:
    """Wrap the drafter model's forward/compute_logits, the proposer's propose and the runner's
    propose_draft_token_ids (once per class); every wrapper returns what the wrapped method returns, except that
    PERTURB_VAR makes propose() return perturbed() ids."""
    if getattr(model_cls, "_vllm_dflash_recorder", False):
        return
    orig_forward = model_cls.forward
    orig_logits = model_cls.compute_logits
    orig_propose = proposer_cls.propose
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
            _state["block"] = (_lists(input_ids), _lists(positions))
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
        if os.environ.get(PERTURB_VAR) == "1" and out is not None and _state["logits"] is not None:
            logits = _state["logits"]
            out = perturbed(out, int(logits.shape[-1]) if hasattr(logits, "shape") else len(logits[0]))
        _write(out)
        _state.update(block=None, logits=None)
        return out

    model_cls.forward = forward
    model_cls.compute_logits = compute_logits
    proposer_cls.propose = propose
    runner_cls.propose_draft_token_ids = runner_propose
    model_cls._vllm_dflash_recorder = True


def install() -> None:
    if not os.environ.get(RECORD_FILE_VAR):
        return
    _install_kv_recorder()
    from vllm.model_executor.models import qwen3_dflash
    from vllm.v1.spec_decode import dflash
    from vllm.v1.worker import gpu_model_runner

    # The CPU runner subclasses GPUModelRunner and keeps propose_draft_token_ids.
    wrap(qwen3_dflash.DFlashQwen3ForCausalLM, dflash.DFlashProposer, gpu_model_runner.GPUModelRunner)
