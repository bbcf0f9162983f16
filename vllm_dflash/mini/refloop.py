"""The reference's own generation loop (`dflash` 0.1.0 `dflash_generate`, greedy) on the miniature's prompts.

Runs inside the dflash reference environment:
`python -m vllm_dflash.mini.refloop '{"models": DIR, "out": RESULT.json, ...}'` (see `main` for every key).

Acceptance is reported two ways:

* `pooled` -- the way vLLM pools: one draft per verification step per request, `accepted` = draft tokens accepted
  in that step (0..k, k = block_size - 1; vLLM drafts all k even in the last step), AL = 1 + accepted / drafts over
  every step of every prompt. `dflash_generate` records `produced` per step = accepted + 1 (it includes the bonus
  token) but shortens its last blocks near max_length and truncates `produced` there, which vLLM does not do (vLLM
  counts `len(sampled) - 1` before max_tokens truncation, scheduler.py update_from_output). So the loop is run
  with max_new_tokens = max_tokens + block_size (no block is shortened before max_tokens is reached; greedy output
  is a prefix-stable function, so the first max_tokens tokens are the same) and exactly the steps vLLM would run
  are counted: the first token comes from the prefill (no draft), then steps run while fewer than max_tokens
  tokens exist; each counts accepted = produced - 1 in full, including acceptances beyond max_tokens.
* `literal` -- the loop exactly as the authors' benchmark calls it (max_new_tokens = max_tokens) and averages it:
  the mean over requests of each request's mean `produced` (bonus included, truncated last steps included).

`semantics` emulates vLLM 0.20.1 inside the reference (monkeypatching only, the model weights are the same):
"reference"; "tap-input" (context features hidden_states[L] -- the input of layer L -- instead of [L + 1]);
"full-attention" (every drafter layer non-causal with no window: 0.20.1 runs sliding layers as full attention;
the drafter's cache is then a full cache for every layer too -- the reference's own cache keeps only the last W - 1
context tokens of a sliding layer, so without it "full attention" would still see only the window);
"stock" (both: what stock 0.20.1 computes).

The target is loaded as the class its config.json names (conformance/reference.py `load_target`); on a hybrid target
(the hybrid miniature: Gated DeltaNet layers) the loop runs under `linear_state_rollback`, without which dflash 0.1.0's
loop keeps rejected drafts in the GDN recurrent state and is not the target's greedy output.

Losslessness: every mode's output is compared with the target's plain greedy output (HF, one token at a time;
"greedy": "recompute" runs a full forward per token instead of the KV cache) for every prompt.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SEMANTICS = ("reference", "tap-input", "full-attention", "stock")


def vllm_pooling(produced: Sequence[int], max_tokens: int) -> list[int]:
    """Accepted draft tokens per verification step as vLLM counts them, from an un-truncated run's `produced`
    (accepted + 1 per step): steps run while fewer than max_tokens output tokens exist (the prefill gave one)."""
    accepted: list[int] = []
    have = 1
    for n in produced:
        if have >= max_tokens:
            break
        accepted.append(n - 1)
        have += n
    if have < max_tokens:
        raise ValueError(f"the loop produced {have} tokens, fewer than max_tokens {max_tokens}")
    return accepted


def pooled_stats(per_step: Sequence[Sequence[int]], k: int) -> dict[str, Any]:
    """vLLM's counters over all steps of all prompts (per_step: accepted counts per prompt)."""
    steps = [a for prompt in per_step for a in prompt]
    drafts, accepted = len(steps), sum(steps)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": [sum(1 for a in steps if a > p) for p in range(k)],
        "acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def summary(values: Sequence[float]) -> dict[str, float]:
    qs = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "q1": qs[0],
        "median": qs[1],
        "q3": qs[2],
        "max": max(values),
    }


def paired(base: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """Per-prompt pairs: how `other` (an emulated mode) compares with `base` (reference semantics)."""
    deltas = [o - b for b, o in zip(base, other, strict=True)]
    ratios = [o / b for b, o in zip(base, other, strict=True)]
    return {
        "lower": sum(1 for d in deltas if d < 0),
        "equal": sum(1 for d in deltas if d == 0),
        "higher": sum(1 for d in deltas if d > 0),
        "mean_delta": statistics.fmean(deltas),
        "median_ratio": statistics.median(ratios),
    }


# --------------------------------------------------------------------------------------------------------------------
# In-environment part
# --------------------------------------------------------------------------------------------------------------------


class Mini:
    """The miniature's target and drafter (fp32, CPU), as the reference loads them."""

    def __init__(self, target: Any, drafter: Any) -> None:
        self.target = target
        self.drafter = drafter
        self.block_size = int(self.drafter.block_size)
        self._attn = [(la.self_attn.is_causal, la.self_attn.sliding_window) for la in self.drafter.layers]

    @classmethod
    def load(cls, models: Path) -> Mini:
        import torch
        from dflash.model import DFlashDraftModel

        from vllm_dflash.conformance.reference import load_target

        target = load_target(models / "target")  # the class its config names (a Qwen3.5 hybrid too)
        drafter = DFlashDraftModel.from_pretrained(models / "drafter", dtype=torch.float32).eval()
        return cls(target, drafter)

    @contextmanager
    def semantics(self, name: str) -> Iterator[None]:
        """Emulate vLLM 0.20.1's tap and/or attention inside the reference loop, restoring everything after."""
        import dflash.model as dm

        if name not in SEMANTICS:
            raise ValueError(f"unknown semantics {name!r} (one of {', '.join(SEMANTICS)})")
        orig = dm.extract_context_feature
        make_cache = dm._make_cache
        try:
            if name in ("tap-input", "stock"):
                # dflash_generate looks the function up in its module at call time; it reads states[L + 1], so
                # shifting the list by one hands it states[L], the input of layer L.
                def tap_input(hidden_states: Sequence[Any], layer_ids: list[int]) -> Any:
                    return orig([None, *list(hidden_states)[:-1]], layer_ids)

                dm.extract_context_feature = tap_input
            if name in ("full-attention", "stock"):
                for layer in self.drafter.layers:
                    layer.self_attn.is_causal, layer.self_attn.sliding_window = False, None
                drafter_config = self.drafter.config

                # dflash_generate builds the drafter's cache from its config (sliding layers: last W - 1 tokens only);
                # full attention must see the whole context, so the drafter gets a cache with every layer full.
                def full_cache(config: Any) -> Any:
                    return make_cache(full_attention_config(config) if config is drafter_config else config)

                dm._make_cache = full_cache
            yield
        finally:
            dm.extract_context_feature = orig
            dm._make_cache = make_cache
            for layer, (causal, window) in zip(self.drafter.layers, self._attn, strict=True):
                layer.self_attn.is_causal, layer.self_attn.sliding_window = causal, window

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
        """`dflash_generate` (greedy, no stop tokens): generated ids and its per-step `produced` counts."""
        import dflash.model as dm
        import torch

        from vllm_dflash.conformance.reference import has_linear_layers, linear_state_rollback

        # return_stats times with torch.cuda.synchronize(); on a CPU-only torch use a plain clock instead.
        cuda_time = dm._cuda_time
        dm._cuda_time = time.perf_counter
        # On a hybrid target the loop's cache crop leaves rejected drafts in the GDN state: roll it back (see there).
        exact = linear_state_rollback(self.target) if has_linear_layers(self.target) else contextlib.nullcontext()
        try:
            with exact:
                out = dm.dflash_generate(
                    self.drafter, self.target, torch.tensor([prompt]), max_new_tokens, None, return_stats=True
                )
        finally:
            dm._cuda_time = cuda_time
        return out.output_ids[0, len(prompt) :].tolist(), [int(x) for x in out.acceptance_lengths]

    def greedy(self, prompt: list[int], n: int, recompute: bool = False) -> tuple[list[int], float]:
        """The target's plain greedy continuation, token by token (HF KV cache, or with `recompute` a full forward
        per token), and its smallest top-2 logit gap."""
        import torch

        ids = list(prompt)
        gap = float("inf")
        with torch.inference_mode():
            out = self.target(torch.tensor([ids]), use_cache=not recompute)
            for _ in range(n):
                logits = out.logits[0, -1]
                top = torch.topk(logits, 2).values
                gap = min(gap, float(top[0] - top[1]))
                ids.append(int(torch.argmax(logits)))
                if recompute:
                    out = self.target(torch.tensor([ids]))
                else:
                    out = self.target(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
        return ids[len(prompt) :], gap


def full_attention_config(config: Any) -> Any:
    """A copy of a drafter config whose every layer is full attention (what transformers' cache reads)."""
    import copy

    full = copy.deepcopy(config)
    full.layer_types = ["full_attention"] * int(config.num_hidden_layers)
    return full


def near_ties(job: dict[str, Any]) -> list[dict[str, Any]]:
    """For each mismatch {"id", "position", "reference_ids", "got_token"} (the reference's output token ids and the
    token another build produced at the first differing position): the target's logits there (HF, fp32, one
    forward over the prompt and the common prefix), the gap between the top logit and the other build's token's
    logit, and whether that gap is within `tolerance` (a near-tie that batched fp32 kernels may flip)."""
    import torch

    models = Path(job["models"])
    tolerance = float(job.get("tolerance", 1e-5))
    torch.set_num_threads(int(job.get("threads", 1)))
    mini = Mini.load(models)
    prompts = {
        p["id"]: p["prompt"]
        for p in (json.loads(line) for line in (models / "prompts.jsonl").read_text().splitlines() if line.strip())
    }
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for m in job["mismatches"]:
            pos, ref_ids, got = int(m["position"]), [int(t) for t in m["reference_ids"]], m.get("got_token")
            ids = list(prompts[m["id"]].encode()) + ref_ids[:pos]
            logits = mini.target(torch.tensor([ids])).logits[0, -1]
            top = int(torch.argmax(logits))
            row: dict[str, Any] = {
                "id": m["id"],
                "position": pos,
                "reference_token": ref_ids[pos] if pos < len(ref_ids) else None,
                "target_top_token": top,
                "got_token": got,
                "top_logit": float(logits[top]),
            }
            if got is None or not 0 <= int(got) < logits.shape[0]:
                row.update(got_logit=None, gap=None, near_tie=False)  # shorter output or no single token: a bug
            else:
                gap = float(logits[top] - logits[int(got)])
                row.update(got_logit=float(logits[int(got)]), gap=gap, near_tie=gap <= tolerance)
            rows.append(row)
    return rows


def run(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    models = Path(job["models"])
    manifest = json.loads((models / "mini.json").read_text())
    max_tokens = int(job.get("max_tokens") or manifest["max_tokens"])
    modes = job.get("semantics") or list(SEMANTICS)
    modes = [modes] if isinstance(modes, str) else list(modes)
    prompts = [json.loads(line) for line in (models / "prompts.jsonl").read_text().splitlines() if line.strip()]
    if job.get("prompts") is not None:
        prompts = prompts[: int(job["prompts"])]
    literal = bool(job.get("literal", True))
    torch.set_num_threads(int(job.get("threads", 1)))
    mini = Mini.load(models)
    k = mini.block_size - 1
    encoded = [list(p["prompt"].encode()) for p in prompts]
    t0 = time.perf_counter()
    recompute = job.get("greedy", "cache") == "recompute"
    check = job.get("check_lossless", True)
    greedy = [mini.greedy(ids, max_tokens, recompute) for ids in encoded] if check else None
    result: dict[str, Any] = {
        "models": str(models),
        "max_tokens": max_tokens,
        "block_size": mini.block_size,
        "num_speculative_tokens": k,
        "prompts": len(prompts),
        "greedy_s": round(time.perf_counter() - t0, 1),
        "min_top2_gap": min(g for _, g in greedy) if greedy else None,
        "modes": {},
    }
    for mode in modes:
        t1 = time.perf_counter()
        rows: list[dict[str, Any]] = []
        with mini.semantics(mode):
            for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
                out, produced = mini.generate(ids, max_tokens + mini.block_size)
                accepted = vllm_pooling(produced, max_tokens)
                row: dict[str, Any] = {
                    "id": p["id"],
                    "token_ids": out[:max_tokens],
                    "text": bytes(t for t in out[:max_tokens] if t < 256).decode(errors="replace"),
                    "accepted": accepted,
                    "al": 1 + sum(accepted) / len(accepted) if accepted else None,
                }
                if literal:
                    lit_out, lit_produced = mini.generate(ids, max_tokens)
                    row["literal_produced"] = lit_produced
                    row["literal_al"] = statistics.fmean(lit_produced)
                    if lit_out != out[:max_tokens]:
                        row["literal_output_differs"] = True
                if greedy is not None:
                    row["lossless"] = out[:max_tokens] == greedy[i][0]
                    row["greedy_min_top2_gap"] = greedy[i][1]
                rows.append(row)
        als = [r["al"] for r in rows if r["al"] is not None]
        entry: dict[str, Any] = {
            "pooled": pooled_stats([r["accepted"] for r in rows], k),
            "per_prompt_al": summary(als),
            "lossless": all(r.get("lossless", True) for r in rows) if greedy is not None else None,
            "seconds": round(time.perf_counter() - t1, 1),
            "rows": rows,
        }
        if literal:
            entry["literal"] = {
                "mean_of_request_means": statistics.fmean(r["literal_al"] for r in rows),
                "pooled_produced_mean": statistics.fmean(x for r in rows for x in r["literal_produced"]),
                "outputs_equal": not any(r.get("literal_output_differs") for r in rows),
            }
        result["modes"][mode] = entry
        print(
            f"refloop {mode:15s} pooled AL {entry['pooled']['acceptance_length']:.3f} "
            f"({entry['pooled']['num_drafts']} drafts), per-prompt median {entry['per_prompt_al']['median']:.2f}, "
            f"lossless {entry['lossless']} ({entry['seconds']} s)",
            flush=True,
        )
    if "reference" in result["modes"]:
        base = [r["al"] for r in result["modes"]["reference"]["rows"]]
        result["pairs_vs_reference"] = {
            mode: paired(base, [r["al"] for r in entry["rows"]])
            for mode, entry in result["modes"].items()
            if mode != "reference"
        }
    return result


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"models": mini model dir, "out": result JSON path (optional: stdout summary only),
    "mismatches": [...] (instead of the loop: `near_ties`, with "tolerance" (default 1e-5)),
    "semantics": name or list (default all of SEMANTICS), "max_tokens": int (default mini.json's),
    "prompts": first N prompts (default all), "literal": bool (default true), "check_lossless": bool (default true),
    "greedy": "cache" | "recompute" (how the plain greedy baseline runs; default cache), "threads": int (default 1)}.
    """
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    result: Any = {"near_ties": near_ties(job)} if "mismatches" in job else run(job)
    if job.get("out"):
        out = Path(job["out"])
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
