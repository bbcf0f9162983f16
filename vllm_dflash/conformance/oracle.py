"""No-cache reference oracle for the DFlash drafter, built on the authors' `dflash` 0.1.0 package, and its negatives.

Runs inside the dflash reference environment (see `reference_spec`):
`python -m vllm_dflash.conformance.oracle '{"jobs": [[CASE_DIR, TRACE.jsonl, METRICS.json, TOLERANCE]], ...}'`
reads the vLLM side's per-step trace and recomputes every drafter proposal from scratch:

1. target forward (fp32, the transformers class its config.json names: `Qwen3ForCausalLM`, or for a hybrid target
   `Qwen3_5ForConditionalGeneration` with its torch Gated DeltaNet path) over the step's context
   `token_ids[:context_len]`;
2. taps with the reference's own `extract_context_feature` (it takes `hidden_states[L + 1]`, "output of layer L");
3. the reference's own `DFlashDraftModel` over the block [bonus, mask x k] at positions context_len.., with each
   layer's (window, causal) set to the case's `attention` (vllm-dflash's reading of the config, README "Drafter config
   fields"; identical to the reference's own attributes except where the README says why not), run through the
   reference's own attention code and masks, then its `compute_logits`.

Why no cache and not the reference's `dflash_generate`: the drafter's context K/V are a pure function of the taps,
so a from-scratch forward equals the cached one, while the generate loop shortens its last blocks near max_length,
which changes what a non-causal full layer sees. The fast tests check the oracle against that loop where they agree.

Last-layer tap (a documented choice): the reference takes HF `hidden_states[num_layers]`, which transformers returns
AFTER the target's final norm; vLLM (upstream >= 0.22 and our patch) records the residual stream after the last layer,
BEFORE the norm. The oracle uses "residual stream after layer L" for every L (identical to `hidden_states[L + 1]`
except for the last layer), so it follows vLLM's convention there; the reference-literal variant is reported as the
negative `postnorm-last-tap`. No published drafter taps the last layer (dflash's own default ids stop at
num_layers - 3; z-lab/Qwen3.6-27B-DFlash uses [1, 16, 31, 46, 61] of 64).

Variants (negative controls): `tap-input` (hidden_states[L], vLLM 0.20.1's tap), `full-attention` (every layer
full and non-causal: vLLM 0.20.1's drafter), `window-1`/`window+1`, `postnorm-last-tap`, `reference-literal` (the
reference package's own reading of the config where ours differs: the window transformers dropped, use_swa and
dflash_config.causal ignored), `causal-window` (every windowed layer causal: the reading that ignored is_causal),
`top-level-ids` (decoy top-level target_layer_ids) and `stock-semantics` (tap-input + full-attention: what stock
0.20.1 computes; informational).

The host side (vllm_dflash.envs creates the environment, compare.py calls this module in it) never imports it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.reference import decoder_layers, has_linear_layers, linear_state_rollback, load_target

MAIN = "oracle"
VARIANTS: tuple[str, ...] = (
    C.NEG_TAP_INPUT,
    C.NEG_FULL_ATTN,
    C.NEG_WINDOW_MINUS,
    C.NEG_WINDOW_PLUS,
    C.NEG_POSTNORM_LAST,
    C.NEG_REFERENCE_LITERAL,
    C.NEG_CAUSAL_WINDOW,
    C.NEG_TOP_LEVEL_IDS,
    C.STOCK_MODEL,
)


@dataclass(frozen=True)
class Variant:
    """How an oracle deviates from the reference semantics."""

    tap_offset: int = 1  # 1: output of layer L (reference); 0: input of layer L (vLLM 0.20.1)
    postnorm_last: bool = False  # last-layer tap after the final norm (the reference package literally)
    # "case": the case's attention | "full": all layers non-causal, no window | "reference": the reference package's
    # own layer attributes | "causal-window": the case's, with every windowed layer causal | "symmetric-window": the
    # case's, with every windowed layer non-causal (|q - k| < W: vLLM 0.25's windows under DFlash's metadata)
    attention: str = "case"
    window_delta: int = 0  # windowed layers use W + delta
    top_level_ids: bool = False  # tap the decoy top-level target_layer_ids


_WINDOW_VARIANTS = (C.NEG_FULL_ATTN, C.NEG_WINDOW_MINUS, C.NEG_WINDOW_PLUS, C.NEG_CAUSAL_WINDOW)


def variant(name: str) -> Variant:
    if name.startswith(C.STOCK_MODEL + "["):  # a pin's stock model (cases.stock_model_name)
        params = dict(kv.split("=", 1) for kv in name[len(C.STOCK_MODEL) + 1 : -1].split(","))
        return Variant(tap_offset=0 if params["taps"] == "input" else 1, attention=params["attention"])
    return {
        MAIN: Variant(),
        C.NEG_TAP_INPUT: Variant(tap_offset=0),
        C.NEG_FULL_ATTN: Variant(attention="full"),
        C.NEG_WINDOW_MINUS: Variant(window_delta=-1),
        C.NEG_WINDOW_PLUS: Variant(window_delta=1),
        C.NEG_POSTNORM_LAST: Variant(postnorm_last=True),
        C.NEG_REFERENCE_LITERAL: Variant(attention="reference"),
        C.NEG_CAUSAL_WINDOW: Variant(attention="causal-window"),
        C.NEG_TOP_LEVEL_IDS: Variant(top_level_ids=True),
        C.STOCK_MODEL: Variant(tap_offset=0, attention="full"),
    }[name]


# --------------------------------------------------------------------------------------------------------------------
# In-environment part (torch, transformers, dflash imported lazily so the host can import this module)
# --------------------------------------------------------------------------------------------------------------------


class ReferenceOracle:
    """The tiny target and the reference drafter of one case directory, fp32 on CPU."""

    def __init__(self, case_dir: Path) -> None:
        import torch
        from dflash.model import DFlashDraftModel
        from safetensors import safe_open

        self.case_dir = case_dir
        self.case = C.CaseFile.from_json((case_dir / "case.json").read_text())
        self.target = load_target(case_dir / self.case.target)
        text = self.target.config.get_text_config()
        self.vocab, self.hidden = int(text.vocab_size), int(text.hidden_size)
        drafter_dir = case_dir / self.case.drafter
        if (drafter_dir / "reference_config.json").is_file():
            # A speculators-format checkpoint: the reference loads the plain config it was made from.
            from safetensors.torch import load_file
            from transformers import Qwen3Config

            config = Qwen3Config.from_dict(json.loads((drafter_dir / "reference_config.json").read_text()))
            self.drafter = DFlashDraftModel(config).eval()
            self.drafter.load_state_dict(load_file(drafter_dir / "model.safetensors"))
        else:
            self.drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
        self.k = self.case.num_speculative_tokens
        if self.drafter.block_size != self.k + 1:
            raise ValueError(f"drafter block_size {self.drafter.block_size} != 1 + k ({self.k + 1})")
        # vLLM uses a drafter's own lm_head when its checkpoint has one and shares the target's otherwise; the
        # reference always uses the target's. Our cases either have none or (zero-lm-head) zero it on both sides.
        self.head: Any = self.target.lm_head
        weights = case_dir / self.case.drafter / "model.safetensors"
        with safe_open(str(weights), "pt") as fh:
            if "lm_head.weight" in fh.keys():
                head = torch.nn.Linear(self.hidden, self.vocab, bias=False)
                head.weight.data.copy_(fh.get_tensor("lm_head.weight"))
                self.head = head
        # The reference's own reading of the config (its layer attributes) must be what cases.py says it is.
        self._reference = [(a.self_attn.sliding_window, bool(a.self_attn.is_causal)) for a in self.drafter.layers]
        literal = [(w, bool(c)) for w, c in self.case.reference_attention]
        if literal and self._reference != literal:
            raise ValueError(f"{self.case.name}: the reference reads {self._reference}, cases.py says {literal}")
        self._case = [(w, bool(c)) for w, c in self.case.attention] or self._reference
        self._copies: dict[Any, Any] = {}  # the target in other dtypes (hidden_states_in)

    # -- target ---------------------------------------------------------------------------------------------------

    def hidden_states(self, ids: Sequence[int]) -> list[Any]:
        """HF hidden_states for `ids` with the last entry replaced by the PRE-norm residual stream after the last
        layer, plus that post-norm tensor appended as the final element (used only by `postnorm-last-tap`)."""
        return self.forward(ids)[0]

    def hidden_states_in(self, ids: Sequence[int], dtype: Any) -> list[Any]:
        """hidden_states() with the target computed in `dtype` (a copy of it), returned in fp32: how far the
        reference's own precision moves what the drafter reads."""
        import copy

        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.target).to(dtype)
        saved, self.target = self.target, self._copies[dtype]
        try:
            return [h.float() for h in self.hidden_states(ids)]
        finally:
            self.target = saved

    def forward(self, ids: Sequence[int]) -> tuple[list[Any], Any]:
        """One from-scratch target forward over `ids`: hidden_states() and the [len(ids), vocab] logits."""
        import torch

        captured: list[Any] = []

        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            captured.append(out[0] if isinstance(out, tuple) else out)

        handle = decoder_layers(self.target)[-1].register_forward_hook(hook)
        try:
            with torch.inference_mode():
                out = self.target(torch.tensor([list(ids)]), output_hidden_states=True)
        finally:
            handle.remove()
        hs = list(out.hidden_states)
        postnorm = hs[-1]
        hs[-1] = captured[-1]
        return [*hs, postnorm], out.logits[0]

    def greedy_checked(
        self, prompt: Sequence[int], output: Sequence[int], logits: Any, max_tokens: int
    ) -> tuple[list[int], list[float]]:
        """greedy(prompt, max_tokens), from the logits of one forward over prompt + output: where every output token
        is the argmax of the logits before it, output IS the greedy continuation (each step's context is then the
        greedy one), and those logits give each step's top-2 gap. Anywhere else: greedy() from scratch."""
        import torch

        n = len(prompt)
        if len(output) != max_tokens or logits.shape[0] != n + len(output):
            return self.greedy(prompt, max_tokens)
        steps = logits[n - 1 : n - 1 + max_tokens]
        top = torch.topk(steps, 2, dim=-1).values
        if [int(t) for t in torch.argmax(steps, dim=-1)] != list(output):
            return self.greedy(prompt, max_tokens)
        return list(output), [float(g) for g in top[:, 0] - top[:, 1]]

    def taps(self, hs: list[Any], v: Variant) -> Any:
        from dflash.model import extract_context_feature

        states = hs[:-1]
        if v.postnorm_last:
            states = [*states[:-1], hs[-1]]
        if v.tap_offset == 0:
            # extract_context_feature reads states[L + 1]; shifting the list by one makes that the input of layer L.
            states = [None, *states[:-1]]
        ids = self.case.decoy_target_layer_ids if v.top_level_ids else self.drafter.target_layer_ids
        return extract_context_feature(states, list(ids))

    def greedy(self, prompt: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Plain greedy continuation of the target (no EOS stop, like the vLLM side) and each step's top-2 gap."""
        import torch

        ids = list(prompt)
        gaps: list[float] = []
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = self.target(torch.tensor([ids])).logits[0, -1]
                top = torch.topk(logits, 2).values
                gaps.append(float(top[0] - top[1]))
                ids.append(int(torch.argmax(logits)))
        return ids[len(prompt) :], gaps

    # -- drafter --------------------------------------------------------------------------------------------------

    def layer_attention(self, v: Variant) -> list[tuple[int | None, bool]]:
        """(window, causal) per drafter layer under variant `v`."""
        if v.attention == "full":
            return [(None, False)] * len(self._case)
        if v.attention == "reference":
            return list(self._reference)
        out = []
        for window, causal in self._case:
            if window is not None:
                window += v.window_delta
                causal = (causal or v.attention == "causal-window") and v.attention != "symmetric-window"
            out.append((window, causal))
        return out

    @contextmanager
    def _attention(self, v: Variant) -> Iterator[None]:
        try:
            for layer, (window, causal) in zip(self.drafter.layers, self.layer_attention(v), strict=True):
                layer.self_attn.sliding_window, layer.self_attn.is_causal = window, causal
            yield
        finally:
            for layer, (window, causal) in zip(self.drafter.layers, self._reference, strict=True):
                layer.self_attn.sliding_window, layer.self_attn.is_causal = window, causal

    def draft_logits(self, hs: list[Any], context_len: int, bonus: int, v: Variant) -> Any:
        """[k, vocab] drafter logits for the block [bonus, mask x k] at positions context_len.. (no cache)."""
        import torch
        from dflash.model import _draft_value, _raw_input_embeddings

        target_hidden = self.taps(hs, v)[:, :context_len, :]
        block = torch.tensor([[bonus] + [int(self.drafter.mask_token_id)] * self.k])
        scale = float(_draft_value(self.drafter.config, "input_embedding_scale", 1.0))
        noise = _raw_input_embeddings(self.target, block, scale)
        positions = torch.arange(context_len + self.k + 1)[None]
        with torch.inference_mode(), self._attention(v):
            out = self.drafter(
                target_hidden=target_hidden, noise_embedding=noise, position_ids=positions, use_cache=False
            )
            return self.drafter.compute_logits(out[:, 1:, :], self.head)[0]


@dataclass
class Diff:
    """Running comparison of vLLM's logits with one oracle's."""

    max_abs: float = 0.0
    argmax_agree: int = 0
    argmax_total: int = 0  # positions where the oracle's top-2 gap exceeds the tie margin
    first_bad_step: int | None = None
    # The most any vocab entry gained on the oracle's top entry at one position (max_b of Δ_b - Δ_top): a top-2 gap
    # above it cannot flip. What a low-precision run's tie margin is derived from (benchmarks/bench_conformance.py).
    max_flip: float = 0.0

    def add(self, step: int, got: Any, want: Any, got_ids: Any, tol: C.Tolerance) -> None:
        import torch

        diff = got - want
        delta = float(diff.abs().max())
        self.max_abs = max(self.max_abs, delta)
        self.max_flip = max(self.max_flip, float((diff - diff.gather(1, want.argmax(-1, keepdim=True))).max()))
        top = torch.topk(want, 2, dim=-1).values
        margin = torch.full((want.shape[0],), tol.tie_margin)
        if tol.decide_by_drift:
            # No logit at this position moved by more than its max |Δ|: a gap above twice that cannot have flipped.
            margin = torch.maximum(margin, 2 * diff.abs().max(-1).values)
        decided = (top[:, 0] - top[:, 1]) > margin
        agree = (got_ids == want.argmax(-1)) & decided
        self.argmax_total += int(decided.sum())
        self.argmax_agree += int(agree.sum())
        if self.first_bad_step is None and (delta > tol.max_abs_logit or int(agree.sum()) != int(decided.sum())):
            self.first_bad_step = step


@dataclass
class CaseMetrics:
    """What the oracle measured on one vLLM trace (judged by compare.py)."""

    case: str
    steps: int = 0
    positions: int = 0
    main: Diff = field(default_factory=Diff)
    variants: dict[str, Diff] = field(default_factory=dict)
    trace_consistent: bool = True
    trace_problems: list[str] = field(default_factory=list)
    lossless: bool = True
    lossless_compared: int = 0  # generated tokens compared (every one of every request)
    lossless_requests_compared: int = 0  # requests whose whole output was compared
    # Not exact (bf16): tokens where the fp32 top-2 gap exceeds the margin, so only the greedy token passes; and the
    # largest fp32 deficit of a generated token (what the margin is derived from).
    lossless_decisive: int = 0
    lossless_max_deficit: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_length: float | None = None
    k: int = 0
    # Added for serving conditions (defaults keep old metrics files readable):
    requests: int = 0
    lossless_requests: int = 0  # requests whose output equals the target's greedy output exactly
    accepted_from_drafts: list[int] = field(default_factory=list)  # [lo, hi] accepted tokens implied by the drafts
    num_proposals_recorded: int = 0
    proposals_by_kind: dict[str, int] = field(default_factory=dict)  # verified / prefill / cut-off / beyond-output
    prefix_cache_hits: int = 0
    prefix_cache_hits_by_round: list[int] = field(default_factory=list)
    dtype: str = "float32"
    prefill_starts: list[list[int]] = field(
        default_factory=list
    )  # per request: starts of proposals drafted mid-prefill
    prompt_lengths: list[int] = field(default_factory=list)  # per request
    # KV-cache groups (from the recorder through the trace summary; see vllm_side): the layout, per request its
    # [tokens with KV, tokens allocated, blocks held per group] at every slot allocation, freed blocks handed out again.
    kv_layout: dict[str, Any] | None = None
    kv_blocks: dict[str, list[list[int]]] = field(default_factory=dict)
    kv_reused: int = 0
    # Prefix caching: per request, the tokens vLLM's KV-cache manager matched (from the recorder), and the most any
    # lookup can match (`prefix_hit_bounds`): every whole KV block of the prompt that an earlier call computed, short
    # of the prompt's last token (its logits are needed).
    prefix_hits: dict[str, int] = field(default_factory=dict)
    prefix_hit_bounds: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0  # the oracle's time on this trace


def read_trace(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    steps: list[dict[str, Any]] = []
    summary: dict[str, Any] | None = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
        if "summary" in record:
            summary = record["summary"]
        else:
            steps.append(record)
    return steps, summary


def token_deficits(logits: Any, prompt_len: int, output: Sequence[int]) -> tuple[list[float], list[float]]:
    """For each generated token, from one forward's [len, vocab] logits over prompt + output: how far its logit is
    below the best one at its position (0 for the greedy token), and the top-2 gap there."""
    import torch

    if not output:
        return [], []
    steps = logits[prompt_len - 1 : prompt_len - 1 + len(output)]
    top = torch.topk(steps, 2, dim=-1).values
    chosen = steps.gather(1, torch.tensor(list(output))[:, None])[:, 0]
    return [float(x) for x in top[:, 0] - chosen], [float(g) for g in top[:, 0] - top[:, 1]]


def proposal_kind(prompt_len: int, seq_len: int, start: int) -> str:
    """What a proposal starting at `start` is to vLLM, for a request of `prompt_len` prompt tokens whose final
    sequence (prompt + output) has `seq_len`: `prefill` (drafted mid-prefill, discarded), `beyond-output` (from a
    bonus token max_tokens cut off), `cut-off` (drafted in the last step, never verified) or `verified` (counted
    in vLLM's num_drafts)."""
    if start < prompt_len:
        return "prefill"
    if start >= seq_len:
        return "beyond-output"
    return "cut-off" if start >= seq_len - 1 else "verified"


def _beyond_output_problem(
    rec: dict[str, Any], start: int, seq_len: int, k: int, mask: int, max_tokens: int, out_len: int
) -> str:
    """What is wrong with a line drafted beyond the output ("" when nothing): its request must have been cut off
    by max_tokens, the start within one verification step (k + 1 tokens) of the output's end, the block k mask
    tokens at consecutive positions, and the proposer's draft ids present."""
    block_ids = [int(t) for t in rec.get("block_input_ids") or []]
    block_pos = [int(t) for t in rec.get("block_positions") or []]
    problems = []
    if out_len != max_tokens:
        problems.append(f"drafted beyond an output of {out_len} tokens that max_tokens ({max_tokens}) did not cut")
    if not seq_len <= start <= seq_len + k:
        problems.append(f"starts {start - seq_len} tokens past the output's end (more than one step of {k + 1})")
    if block_pos != list(range(start, start + k + 1)):
        problems.append(f"block positions {block_pos[:3]}... are not {start}..{start + k}")
    if block_ids[1:] != [mask] * k:
        problems.append(f"block tokens after the bonus are not {k} mask tokens ({mask})")
    draft = rec.get("draft_ids")
    if not isinstance(draft, list) or len(draft) != k:
        problems.append("no draft ids from the proposer's output")
    return "; ".join(problems)


def evaluate(
    oracle: ReferenceOracle,
    trace: Path,
    variants: Sequence[str],
    tol: C.Tolerance = C.TOLERANCES["cpu"],
) -> CaseMetrics:
    """Compare every drafter proposal in `trace` with the oracle and the named variants."""
    import torch

    steps, summary = read_trace(trace)
    case = oracle.case
    m = CaseMetrics(case=case.name, k=oracle.k, variants={name: Diff() for name in variants})
    if summary is None:
        m.trace_consistent = False
        m.trace_problems.append("trace has no summary line (the vLLM run did not finish)")
        return m
    outputs: list[list[int]] = summary.get("outputs", [])
    # Which prompt each request ran (several requests per prompt when a case submits its prompts more than once).
    request_prompts: list[int] = summary.get("request_prompts") or list(range(len(outputs)))
    mask = int(oracle.drafter.mask_token_id)
    accepted_lo = accepted_hi = 0
    # One from-scratch target forward per request over its final sequence: the target is causal, so the hidden states
    # of any context that is a prefix of it (checked per step below) are that forward's first positions, and its
    # logits check the output against the target's greedy choice at every position.
    forwards: dict[int, tuple[list[Any], Any]] = {}
    m.prefill_starts = [[] for _ in request_prompts]
    m.prompt_lengths = [len(case.prompts[i]) for i in request_prompts]
    kinds = {"verified": 0, "prefill": 0, "cut-off": 0, "beyond-output": 0}
    for i, rec in enumerate(steps):
        req, ctx, start, ids = int(rec["request"]), int(rec["context_len"]), int(rec["block_start"]), rec["token_ids"]
        kind = str(rec.get("kind", "verified"))
        prompt = case.prompts[request_prompts[req]] if req < len(request_prompts) else []
        full = prompt + (outputs[req] if req < len(outputs) else [])
        # The kind from the line's start against the case's prompt and vLLM's output, not the driver's word for it.
        want_kind = proposal_kind(len(prompt), len(full), start)
        if want_kind != kind:
            m.trace_consistent = False
            m.trace_problems.append(f"step {i} (request {req}, start {start}): recorded as {kind}, is {want_kind}")
            continue
        if kind == "beyond-output":
            problem = _beyond_output_problem(
                rec, start, len(full), oracle.k, mask, case.max_tokens, len(full) - len(prompt)
            )
            if problem:
                m.trace_consistent = False
                m.trace_problems.append(f"step {i} (request {req}, start {start}): {problem}")
            else:
                kinds[kind] += 1
            continue
        # The block as the recorder saw vLLM's drafter input, against what the recorder did not build: the case's
        # prompt, vLLM's RequestOutput and the drafter's mask token.
        block_ids = [int(t) for t in rec.get("block_input_ids") or []]
        block_pos = [int(t) for t in rec.get("block_positions") or []]
        want_bonus = (
            (prompt[-1] if prompt else None) if kind == "prefill" else (full[start] if start < len(full) else None)
        )
        problems = []
        if ctx != start or len(ids) != start + 1 or ids[:start] != full[:start]:
            problems.append("the context does not describe a prefix of the request's final sequence")
        if block_pos != list(range(start, start + oracle.k + 1)):
            problems.append(f"block positions {block_pos[:3]}... are not {start}..{start + oracle.k}")
        if block_ids[1:] != [mask] * oracle.k:
            problems.append(f"block tokens after the bonus are not {oracle.k} mask tokens ({mask})")
        if not block_ids or block_ids[0] != want_bonus or ids[start] != block_ids[0]:
            problems.append(f"bonus token {block_ids[:1]} is not the request's {kind} token {want_bonus}")
        if kind == "prefill" and start >= len(prompt):
            problems.append("a prefill proposal that starts after the prompt")
        draft = rec.get("draft_ids")
        if not isinstance(draft, list) or len(draft) != oracle.k:
            problems.append("no draft ids from the proposer's output")
        if problems:
            m.trace_consistent = False
            m.trace_problems.append(f"step {i} (request {req}, start {start}): " + "; ".join(problems))
            continue
        got = torch.tensor(rec["logits"], dtype=torch.float32)
        if got.shape != (oracle.k, oracle.vocab):
            m.trace_consistent = False
            m.trace_problems.append(f"step {i}: logits shape {tuple(got.shape)}, expected ({oracle.k}, vocab)")
            continue
        draft = [int(t) for t in draft or []]
        got_ids = torch.tensor(draft)
        kinds[kind] += 1
        if kind == "prefill":
            m.prefill_starts[req].append(start)
        if kind == "verified":
            # Greedy verification accepts the drafts' longest prefix equal to the output's continuation; tokens that
            # max_tokens cut off are not visible, so there the count is a range.
            seen = full[start + 1 : start + 1 + oracle.k]
            n = next((j for j, (a, b) in enumerate(zip(draft, seen, strict=False)) if a != b), len(seen))
            accepted_lo += n
            accepted_hi += oracle.k if n == len(seen) else n
        if req not in forwards:
            forwards[req] = oracle.forward(full)
        hs = [h[:, :ctx] for h in forwards[req][0]]
        bonus = ids[start]
        m.main.add(i, got, oracle.draft_logits(hs, ctx, bonus, variant(MAIN)), got_ids, tol)
        for name in variants:
            m.variants[name].add(i, got, oracle.draft_logits(hs, ctx, bonus, variant(name)), got_ids, tol)
        m.steps += 1
        m.positions += oracle.k
    greedy: dict[int, tuple[list[int], list[float]]] = {}
    for req, pidx in enumerate(request_prompts):
        got_out = outputs[req] if req < len(outputs) else []
        prompt = case.prompts[pidx]
        if req not in forwards and (pidx not in greedy or not tol.exact_lossless):
            forwards[req] = oracle.forward(prompt + got_out)
        if pidx not in greedy:
            greedy[pidx] = oracle.greedy_checked(prompt, got_out, forwards[req][1], case.max_tokens)
        want, _ = greedy[pidx]
        m.lossless_requests += int(got_out == want)
        if tol.exact_lossless:
            same = got_out == want
        else:
            # Low precision: once a near-tie flips, the continuation is another (equally valid) greedy run, so the
            # output is checked token by token against the fp32 target given the tokens vLLM actually generated.
            deficits, gaps = token_deficits(forwards[req][1], len(prompt), got_out)
            m.lossless_max_deficit = max([m.lossless_max_deficit, *deficits])
            m.lossless_decisive += sum(g > tol.lossless_margin for g in gaps)
            same = len(got_out) == case.max_tokens and all(d <= tol.lossless_margin for d in deficits)
        m.lossless_compared += len(got_out)
        m.lossless_requests_compared += 1
        if not same:
            m.lossless = False
    m.requests = len(request_prompts)
    m.accepted_from_drafts = [accepted_lo, accepted_hi]
    # Proposals as the lines this oracle checked count them (a line that failed its check counts for nothing and
    # makes the trace inconsistent); the driver's own tally must agree with them.
    m.num_proposals_recorded = sum(kinds.values())
    m.proposals_by_kind = kinds
    tally = summary.get("num_proposals_recorded")
    if tally is not None and int(tally) != len(steps):
        m.trace_consistent = False
        m.trace_problems.append(f"the driver counted {tally} proposals, the trace holds {len(steps)} lines")
    m.prefix_cache_hits = int(summary.get("prefix_cache_hits", 0))
    m.prefix_cache_hits_by_round = [int(x) for x in summary.get("prefix_cache_hits_by_round") or []]
    m.dtype = str(summary.get("dtype", "float32"))
    m.kv_layout = summary.get("kv_layout")
    m.kv_blocks = dict(summary.get("kv_blocks") or {})
    m.kv_reused = int(summary.get("kv_reused", 0))
    if case.enable_prefix_caching and case.kv_block_size:
        m.prefix_hits = {str(k): int(v) for k, v in (summary.get("kv_prefix_hits") or {}).items()}
        seqs = [case.prompts[p] + (outputs[r] if r < len(outputs) else []) for r, p in enumerate(request_prompts)]
        per_call = len(case.prompts) if case.batched else 1
        lens = [len(case.prompts[p]) for p in request_prompts]
        m.prefix_hit_bounds = prefix_hit_bounds(seqs, lens, per_call, case.kv_block_size)
    m.num_drafts = int(summary.get("num_drafts", 0))
    m.num_draft_tokens = int(summary.get("num_draft_tokens", 0))
    m.num_accepted_tokens = int(summary.get("num_accepted_tokens", 0))
    if m.num_drafts:
        m.acceptance_length = 1 + m.num_accepted_tokens / m.num_drafts
    return m


def prefix_hit_bounds(seqs: list[list[int]], prompt_lens: list[int], per_call: int, block: int) -> dict[str, int]:
    """Per request (its whole sequence, prompt first, in submission order, `per_call` requests per generate call):
    the tokens of its prompt held by whole KV blocks of an earlier call's requests, at most its prompt less one. An
    earlier request computed KV for all of its sequence but the last token (never fed back)."""
    out: dict[str, int] = {}
    for r, seq in enumerate(seqs):
        prompt = seq[: prompt_lens[r]]
        best = 0
        for j in range(r // per_call * per_call):
            done = seqs[j][: len(seqs[j]) - 1]
            n = 0
            while n < min(len(prompt), len(done)) and prompt[n] == done[n]:
                n += 1
            best = max(best, n)
        out[str(r)] = min(best, len(prompt) - 1) // block * block
    return out


@dataclass
class SelfTest:
    """The oracle checked against the reference package's own cached generate loop on one case."""

    case: str
    steps_compared: int = 0
    steps_skipped: int = 0  # the loop's shortened blocks near max_length
    max_abs_vs_loop: float = 0.0
    loop_is_greedy: bool = False  # the reference loop's output equals the target's plain greedy
    variant_max_abs: dict[str, float] = field(default_factory=dict)  # each variant vs the oracle, same steps
    # The reference's own loop cannot run this config (e.g. transformers' DynamicCache refuses a sliding layer type
    # without a window): the error, and the variants are then compared at the greedy sequence's first positions.
    loop_error: str = ""
    # A hybrid target: the loop ran with its GDN states rolled back after a rejection (`linear_state_rollback`), and
    # the same loop without it, as dflash 0.1.0 runs on transformers' cache: whether its output is still the target's
    # greedy output, and the first output position where it is not.
    linear_rollback: bool = False
    unfixed_loop_is_greedy: bool | None = None
    unfixed_first_divergence: int | None = None
    # A hybrid target: the most the oracle's drafter logits move, over the compared steps, when the target's forward
    # runs in fp64 instead of fp32 (the reference's own precision; cases.CPU_HYBRID_TOLERANCE stands above it).
    fp64_drift: float | None = None


def selftest(oracle: ReferenceOracle, max_new_tokens: int = 16) -> SelfTest:
    """Run `dflash_generate` (KV caches, the reference's loop) on the case's first prompt, record the drafter logits
    it computes at every step, and recompute each from scratch with the oracle and every variant."""
    import torch
    from dflash.model import dflash_generate

    drafter = oracle.drafter
    spec = C.get_cases([oracle.case.name])[0]
    # The loop runs the reference literally: its own reading of the config, and hidden_states[L + 1] (post-norm for
    # the last layer). Compare like with like.
    literal = Variant(attention="reference", postnorm_last=(spec.target_layers - 1) in spec.target_layer_ids)
    calls: list[tuple[int, Any]] = []
    block_ends: list[int] = []
    orig_forward, orig_logits = drafter.forward, drafter.compute_logits

    def forward(*args: Any, **kwargs: Any) -> Any:
        block_ends.append(int(kwargs["position_ids"][0, -1]))
        return orig_forward(*args, **kwargs)

    def compute_logits(hidden: Any, head: Any) -> Any:
        logits = orig_logits(hidden, head)
        calls.append((block_ends[-1] - hidden.shape[1], logits[0].clone()))
        return logits

    prompt = oracle.case.prompts[0]
    # Enough new tokens for several full blocks (the loop shortens its last blocks).
    max_new_tokens = max(max_new_tokens, 12 + spec.block_size)
    hybrid = has_linear_layers(oracle.target)
    unfixed: list[int] | None = None
    if hybrid:  # dflash 0.1.0's loop as it runs on transformers' hybrid cache, for the record
        unfixed = dflash_generate(drafter, oracle.target, torch.tensor([prompt]), max_new_tokens, None)[0].tolist()
    drafter.forward, drafter.compute_logits = forward, compute_logits
    loop_error = ""
    try:
        with linear_state_rollback(oracle.target) if hybrid else contextlib.nullcontext():
            ids = dflash_generate(drafter, oracle.target, torch.tensor([prompt]), max_new_tokens, None)[0].tolist()
    except (TypeError, ValueError) as exc:
        loop_error = f"{type(exc).__name__}: {exc}"
    finally:
        del drafter.forward, drafter.compute_logits
    if loop_error:
        greedy, _ = oracle.greedy(prompt, 4)
        ids = list(prompt) + greedy
        calls = [(len(prompt) + j, None) for j in range(4)]
    greedy, _ = oracle.greedy(prompt, len(ids) - len(prompt))
    result = SelfTest(case=oracle.case.name, loop_is_greedy=ids[len(prompt) :] == greedy, loop_error=loop_error)
    if unfixed is not None:
        got = unfixed[len(prompt) :]
        result.linear_rollback = True
        result.unfixed_loop_is_greedy = got == greedy
        pairs = enumerate(zip(got, greedy, strict=False))
        result.unfixed_first_divergence = next((i for i, (a, b) in pairs if a != b), None)
    # Every variant that applies to the case (not only the listed negatives): e.g. `tap-input` on window-only
    # must come out ~0, which proves the identity target layer makes the tap shift invisible there.
    names = tuple(
        n
        for n in VARIANTS
        if (spec.has_sliding or n not in _WINDOW_VARIANTS)
        and (n != C.NEG_TOP_LEVEL_IDS or oracle.case.decoy_target_layer_ids)
    )
    result.variant_max_abs = {name: 0.0 for name in names}
    for start, logits in calls:
        if logits is not None and logits.shape[0] != oracle.k:
            result.steps_skipped += 1
            continue
        hs = oracle.hidden_states(ids[:start])
        if logits is not None:
            want = oracle.draft_logits(hs, start, ids[start], literal)
            result.max_abs_vs_loop = max(result.max_abs_vs_loop, float((logits - want).abs().max()))
        main = oracle.draft_logits(hs, start, ids[start], variant(MAIN))
        if hybrid:
            exact = oracle.draft_logits(
                oracle.hidden_states_in(ids[:start], torch.float64), start, ids[start], variant(MAIN)
            )
            result.fp64_drift = max(result.fp64_drift or 0.0, float((exact - main).abs().max()))
        for name in names:
            other = oracle.draft_logits(hs, start, ids[start], variant(name))
            result.variant_max_abs[name] = max(result.variant_max_abs[name], float((other - main).abs().max()))
        result.steps_compared += 1
    return result


def bf16_drift(oracle: ReferenceOracle, dtype: str = "bfloat16") -> dict[str, Any]:
    """How far the reference's own drafter moves when the same computation runs in `dtype` instead of fp32: at every
    position of each prompt's fp32 greedy continuation, the drafter logits of both, their max |dlogit|, argmax
    agreement (all positions, and where the fp32 top-2 gap exceeds 0.1) and the target's own greedy agreement.
    The measurement behind the bf16 tolerance (cases.CPU_BF16_TOLERANCE); benchmarks/bench_conformance.py prints it."""
    import copy

    import torch

    low = getattr(torch, dtype)
    target_lo = copy.deepcopy(oracle.target).to(low)
    drafter_lo = copy.deepcopy(oracle.drafter).to(low)
    head_lo = copy.deepcopy(oracle.head).to(low)
    out: dict[str, Any] = {"case": oracle.case.name, "dtype": dtype, "max_abs": 0.0, "agree": 0, "total": 0}
    out.update(decided_agree=0, decided_total=0, greedy_equal=0, prompts=len(oracle.case.prompts))
    for prompt in oracle.case.prompts:
        want, _ = oracle.greedy(prompt, oracle.case.max_tokens)
        ids = list(prompt) + want
        for start in range(len(prompt), len(ids)):
            hs = oracle.hidden_states(ids[:start])
            ref = oracle.draft_logits(hs, start, ids[start], variant(MAIN))
            saved = oracle.target, oracle.drafter, oracle.head
            oracle.target, oracle.drafter, oracle.head = target_lo, drafter_lo, head_lo
            try:
                got = oracle.draft_logits(oracle.hidden_states(ids[:start]), start, ids[start], variant(MAIN)).float()
            finally:
                oracle.target, oracle.drafter, oracle.head = saved
            out["max_abs"] = max(out["max_abs"], float((got - ref).abs().max()))
            same = got.argmax(-1) == ref.argmax(-1)
            top = torch.topk(ref, 2, dim=-1).values
            decided = (top[:, 0] - top[:, 1]) > 0.1
            out["agree"] += int(same.sum())
            out["total"] += int(same.numel())
            out["decided_agree"] += int((same & decided).sum())
            out["decided_total"] += int(decided.sum())
        saved = oracle.target
        oracle.target = target_lo
        try:
            low_greedy, _ = oracle.greedy(prompt, oracle.case.max_tokens)
        finally:
            oracle.target = saved
        out["greedy_equal"] += int(low_greedy == want)
    return out


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _oracle_main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"jobs": [[case dir, trace, metrics out, its cases.Tolerance as a dict], ...],
    "selftests": [[case dir, out], ...]}."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    jobs: list[list[Any]] = job.get("jobs") or []
    selftests: list[list[str]] = job.get("selftests") or []
    drifts: list[list[str]] = job.get("bf16_drift") or []  # [[case dir, out json], ...]
    if not jobs and not selftests and not drifts:
        raise SystemExit("oracle: give at least one job or selftest")
    stock_model = str(job.get("stock_model", C.STOCK_MODEL))  # the pin's stock, modelled (informational)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # Tiny matrices: one thread is fastest, and OpenMP spin-waiting on a busy 2-core machine costs 20x.
    torch.set_num_threads(1)
    oracles: dict[Path, ReferenceOracle] = {}

    def get(case_dir: str) -> ReferenceOracle:
        path = Path(case_dir)
        if path not in oracles:
            oracles[path] = ReferenceOracle(path)
        return oracles[path]

    for case_dir, out in selftests:
        st = selftest(get(case_dir))
        _write_json(Path(out), asdict(st))
        print(f"oracle selftest {st.case}: {st.steps_compared} steps, max |dlogit| vs loop {st.max_abs_vs_loop:.3g}")
    for case_dir, out in drifts:
        drift = bf16_drift(get(case_dir))
        _write_json(Path(out), drift)
        print(f"oracle bf16 drift {drift['case']}: max |dlogit| {drift['max_abs']:.3g}", flush=True)
    for case_dir, trace, out, tol in jobs:
        t0 = time.perf_counter()
        oracle = get(case_dir)
        metrics = evaluate(
            oracle,
            Path(trace),
            (*oracle.case.negatives, stock_model),
            C.Tolerance(**tol),
        )
        metrics.elapsed_s = round(time.perf_counter() - t0, 2)
        _write_json(Path(out), asdict(metrics))
        print(f"oracle {metrics.case} ({trace}): {metrics.steps} steps, max |dlogit| {metrics.main.max_abs:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(_oracle_main())
