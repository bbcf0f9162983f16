"""The vLLM side of the conformance test: run DFlash in vLLM on a tiny case and record every drafter proposal.

Runs INSIDE the vLLM environment (see envs.py), as
    python -m vllm_dflash.conformance.vllm_side '{"device": "cpu", "jobs": [[CASE_DIR, TRACE.jsonl], ...]}'
with our test plugin (tests/conformance_plugin) importable. Standard library, torch and vLLM only: this module must
import without vllm_dflash's own dependencies.

Per case it builds `LLM(target, speculative_config={"method": "dflash", ...})` (float32, greedy, eager, in-process
engine; on CPU also an in-process worker, see `_executor`), generates each prompt on its own (one sequence at a
time, so the recorder's lines for a prompt are the ones it appends during that prompt's generate call), and writes
one JSON line per drafter proposal:
    {"request", "step", "token_ids" (sequence up to and including the block's bonus token), "context_len",
     "block_start", "logits" (k rows x vocab), "draft_ids" (k)}
then {"summary": {"outputs", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", ...}}.

A case whose config the build must refuse (case.json "refusal") records, instead of proposals, whether vLLM refused to
start and the log line that says why: {"summary": {"refused": bool, "refusal_line": str | null, ...}}. The drafter is
built in vLLM's worker process, so the message is read from the start-up log (stderr, captured and passed through).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PLUGIN_ENABLE_VAR = "VLLM_DFLASH_TEST_PLUGIN"
RECORD_FILE_VAR = "VLLM_DFLASH_RECORD_FILE"  # the plugin's recorder appends one line per proposal here
_SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def _prepare_environ(device: str) -> None:
    # Before vLLM is imported: worker processes inherit this environment.
    os.environ[PLUGIN_ENABLE_VAR] = "1"
    # Engine core in this process (saves a second `import vllm`); vLLM still runs the model in a worker process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
        # Every LLM starts a fresh worker whose warm-up torch.compile's the top-k/top-p sampler (20-50 s on 2 cores).
        # Greedy decoding never uses it and the drafter runs eagerly (enforce_eager) either way: run it uncompiled.
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


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
    found = next((line for line in [error, *lines] if refusal in line), None)
    summary = {"case": case_dir.name, "refused": refused, "refusal_line": found, "error": error[:2000]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"summary": summary}) + "\n")
    return summary


def _spec_metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {v: 0 for v in _SPEC_METRICS.values()}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        name = getattr(m, "name", "")
        if name in _SPEC_METRICS:
            out[_SPEC_METRICS[name]] = int(getattr(m, "value", 0))
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(x) for x in getattr(m, "values", [])]
    out["accepted_per_pos"] = per_pos
    return out


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_case(case_dir: Path, out_path: Path, device: str) -> dict[str, Any]:
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
        # float32 on CPU (tolerance 1e-4); bfloat16 on GPUs unless the case names a CUDA dtype.
        dtype=case.get("dtype", "float32") if device == "cpu" else case.get("cuda_dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=int(case.get("max_model_len", 256)),
        max_num_seqs=1,
        # Tiny prompts: a small token budget keeps vLLM's warm-up (a dummy batch of this size) short.
        max_num_batched_tokens=int(case.get("max_num_batched_tokens", 64)),
        seed=int(case.get("seed", 0)),
        disable_log_stats=False,
        enable_prefix_caching=False,
        distributed_executor_backend=_executor(device),
    )
    if case.get("refusal"):
        return check_refusal(case_dir, out_path, llm_kwargs, case["refusal"])
    llm = LLM(**llm_kwargs)
    t_init = time.perf_counter() - t0
    params = SamplingParams(
        temperature=0.0, max_tokens=int(case["max_tokens"]), ignore_eos=bool(case.get("ignore_eos", True))
    )
    outputs: list[list[int]] = []
    records: list[tuple[int, int, dict[str, Any]]] = []
    t1 = time.perf_counter()
    for i, prompt in enumerate(case["prompts"]):
        before = _read_records(record_file)
        res = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
        outputs.append(list(res[0].outputs[0].token_ids))
        new = _read_records(record_file)[len(before) :]
        records.extend((i, step, rec) for step, rec in enumerate(new))
    t_gen = time.perf_counter() - t1

    lines: list[str] = []
    beyond_output = 0
    for i, step, rec in records:
        seq = list(case["prompts"][i]) + outputs[i]
        start = int(rec["block_positions"][0])
        bonus = int(rec["block_input_ids"][0])
        if start >= len(seq):
            # Drafted from a bonus token that max_tokens cut off: never verified, not part of the output.
            beyond_output += 1
            continue
        if seq[start] != bonus:
            raise RuntimeError(
                f"{case_dir.name}: request {i} step {step}: bonus token {bonus} at {start} "
                "does not match the generated sequence"
            )
        lines.append(
            json.dumps(
                {
                    "request": i,
                    "step": step,
                    "token_ids": seq[: start + 1],
                    "context_len": start,
                    "block_start": start,
                    "logits": rec["logits"],
                    "draft_ids": rec["draft_ids"],
                }
            )
        )
    summary = {
        "case": case.get("name", case_dir.name),
        "outputs": outputs,
        **_spec_metrics(llm),
        "num_proposals_recorded": len(records),
        "proposals_beyond_output": beyond_output,
        "vllm_version": __import__("vllm").__version__,
        "torch_version": torch.__version__,
        "init_s": round(t_init, 2),
        "generate_s": round(t_gen, 2),
    }
    lines.append(json.dumps({"summary": summary}))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out_path)
    del llm
    gc.collect()
    return summary


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"device": "cpu" | "cuda", "jobs": [[case directory, trace path], ...]}."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    device = str(job.get("device", "cpu"))
    for case_dir, out in ((Path(c), Path(o)) for c, o in job["jobs"]):
        out.parent.mkdir(parents=True, exist_ok=True)
        record_file = out.with_name(out.name + ".records")
        record_file.unlink(missing_ok=True)
        os.environ[RECORD_FILE_VAR] = str(record_file)
        _prepare_environ(device)
        try:
            summary = run_case(case_dir, out, device)
        finally:
            record_file.unlink(missing_ok=True)
        if "refused" in summary:
            print(f"vllm_side: {summary['case']}: refused={summary['refused']}: {summary['refusal_line']}", flush=True)
            continue
        print(
            f"vllm_side: {summary['case']}: {summary['num_proposals_recorded']} proposals, "
            f"drafts {summary['num_drafts']}, accepted {summary['num_accepted_tokens']}, "
            f"init {summary['init_s']}s, generate {summary['generate_s']}s -> {out}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
