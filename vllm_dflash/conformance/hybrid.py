"""Target conformance on the user's architecture family: a tiny hybrid Qwen3.5 target (Gated DeltaNet + gated full
attention, 3 : 1 like Qwen3.6-27B), served by a CPU build of vLLM, against transformers' own classes.

The DFlash cases all stand on the target's hidden states, so the CPU runtime's torch GDN kernels (patches/cpu/0008)
are proven first, on their own: vLLM's log-probabilities over the whole vocabulary, at every prompt position
(chunked prefill across chunk boundaries, three prompts batched) and at every generated token (decode), and once more
with ngram speculative decoding (the verify path of the GDN layers: multi-token updates and the state rolled back
to the accepted column), and once with a DFlash drafter whose taps fall on both layer kinds, must equal transformers'
fp32 forward pass of the same model (its torch GDN path), and vLLM's greedy tokens must be the reference's argmax.

Four process kinds, one module (`python -m vllm_dflash.conformance.hybrid build|vllm|kernels|reference JSON`):
  build      reference env (transformers 5.x): the tiny model, saved as vLLM 0.20.1 loads Qwen3.6-27B
             (`Qwen3_5ForConditionalGeneration`, a one-block vision tower that text-only serving never builds),
             and its drafter (dflash 0.1.0's own class, like every conformance drafter);
  kernels    a build's env: the verify kernels alone against transformers' torch recurrence (acceptance 1..4);
  vllm       the build's env: LLM(...).generate with full-vocabulary log-probs, written as JSON;
  reference  reference env: transformers' log-softmax at the same positions, compared there; a summary as JSON.
The host side (`run_target_conformance`) runs them and returns a typed `HybridResult`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError

if TYPE_CHECKING:
    from vllm_dflash.manifest import Manifest

# Measured 2026-12-04 on this tiny model (fp32): the patched CPU build is 1.4e-4-2.2e-4 from transformers (the GDN
# recurrence step by step vs transformers' chunked torch algorithm); a kernel that drops the state at a chunk
# boundary, or a decode step's state, is 0.5-5 off. So 1e-3 passes the first with margin and a control must exceed 1e-2.
MAX_ABS_LOGPROB = 1e-3
# The verify kernels against transformers' recurrence, token by token in fp32: 4.8e-7 measured; no rollback: >= 0.07.
KERNEL_MAX_ABS = 1e-5
NEGATIVE_MIN = 1e-2
VOCAB = 512


@dataclass(frozen=True)
class HybridSpec:
    """The tiny hybrid target and how it is served: every field enters the cache digest."""

    name: str = "hybrid-target"
    seed: int = 11
    hidden: int = 128
    layer_types: tuple[str, ...] = (
        ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)
    )
    linear_key_heads: int = 2
    linear_value_heads: int = 4  # HV > H: value heads share key heads, as in Qwen3.6-27B
    head_dim: int = 32
    conv_kernel: int = 4
    prompt_lengths: tuple[int, ...] = (40, 100, 13)  # 100 > 3 chunks: prefill resumes from a stored state
    chunk_tokens: int = 32  # max_num_batched_tokens: chunked prefill boundaries
    max_tokens: int = 12
    spec_tokens: int = 3  # ngram and dflash runs: num_speculative_tokens (the drafter's block is spec_tokens + 1)
    drafter_taps: tuple[int, ...] = (1, 2, 3, 5, 6)  # GDN, GDN, full, GDN, GDN
    drafter_window: int = 8

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        h.update(Path(__file__).read_bytes())  # the generator and the side code are inputs too
        h.update(Path(__file__).with_name("tiny.py").read_bytes())  # tiny.build_hybrid_target writes the model
        return h.hexdigest()[:12]

    def prompts(self, repeat: bool = False) -> list[list[int]]:
        """Deterministic token ids below the specials; `repeat` appends the first 8 again, so ngram finds drafts."""
        out = [[(i * 7 + 3 + 31 * n) % 250 for i in range(length)] for n, length in enumerate(self.prompt_lengths)]
        return [p + p[:8] for p in out] if repeat else out


SPEC = HybridSpec()
# batched: chunked prefill + batched decode; ngram: the speculative verify path, one sequence; dflash: the drafter
# below drafting for the batched prompts (the target's output must stay transformers' greedy: lossless).
RUNS = ("batched", "ngram", "dflash")


def drafter_spec(spec: HybridSpec) -> Any:
    """The drafter as a conformance case spec (cases.CaseSpec), so tiny.build_drafter builds it."""
    import dataclasses

    from vllm_dflash.conformance import cases as C

    mixed = next(c for c in C.CASES if c.name == "mixed")
    layer_types = (C.SLIDING,) * 4 + (C.FULL,)
    return dataclasses.replace(
        mixed,
        name=f"{spec.name}-drafter",
        layer_types=layer_types,
        target_layers=len(spec.layer_types),
        target_layer_ids=spec.drafter_taps,
        sliding_window=spec.drafter_window,
        seed=spec.seed,
        block_size=spec.spec_tokens + 1,
    )


@dataclass(frozen=True)
class RunResult:
    run: str
    max_abs: float  # max |dlogprob| over every compared position and vocabulary entry
    greedy_agree: int
    greedy_total: int
    positions: int

    @property
    def passed(self) -> bool:
        return self.max_abs <= MAX_ABS_LOGPROB and self.greedy_agree == self.greedy_total


@dataclass(frozen=True)
class HybridResult:
    build: str
    runs: tuple[RunResult, ...]

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.runs)


# ---- side processes ------------------------------------------------------------------------------------------------


def _build(spec: HybridSpec, out: Path) -> None:
    from vllm_dflash.conformance.tiny import build_drafter, build_hybrid_target

    build_hybrid_target(
        out,
        spec.seed,
        spec.layer_types,
        spec.hidden,
        spec.linear_key_heads,
        spec.linear_value_heads,
        spec.head_dim,
        spec.conv_kernel,
    )
    # A DFlash drafter shaped like z-lab/Qwen3.6-27B-DFlash (4 sliding + 1 full layers) whose taps fall on both
    # layer kinds, built by the reference package's own class like every conformance drafter.
    build_drafter(drafter_spec(spec), out / "drafter")
    (out / "case.json").write_text(json.dumps(asdict(spec), indent=1))


def _vllm(spec: HybridSpec, model: Path, runs: list[tuple[str, Path]]) -> None:
    """Every run in this process, one engine after another, as the conformance side runs its cases (vllm_side): the
    engine core and the worker here, one OpenMP thread, the greedy sampler uncompiled. Start-up is paid once (issue
    37): a process per run, each with its own engine-core and worker processes, cost ~45 s a run."""
    from vllm_dflash.conformance import vllm_side

    vllm_side.one_openmp_thread()
    vllm_side.engine_environ("cpu")
    vllm_side.inspect_models_here()
    from vllm import LLM, SamplingParams

    for run, out in runs:
        kwargs: dict[str, Any] = vllm_side.executor_kwargs({}, "cpu", vllm_side.DEFAULT_EXECUTOR)
        if run == "dflash":
            kwargs["speculative_config"] = {
                "method": "dflash",
                "model": str(model / "drafter"),
                "num_speculative_tokens": spec.spec_tokens,
            }
        if run == "ngram":
            # One sequence at a time: 0.20.1's GDN layer passes the whole batch's gates to the verify kernel, indexed
            # by the speculative tokens' offsets, which is right only when every decoding request has drafts (DFlash
            # always proposes; ngram may not).
            kwargs["speculative_config"] = {
                "method": "ngram",
                "num_speculative_tokens": spec.spec_tokens,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 1,
            }
        llm = LLM(
            model=str(model),
            dtype="float32",
            seed=0,
            max_model_len=256,
            enforce_eager=True,
            limit_mm_per_prompt={"image": 0, "video": 0},
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=1 if run == "ngram" else 4,
            max_logprobs=-1,
            max_num_batched_tokens=spec.chunk_tokens,
            enable_chunked_prefill=True,
            **kwargs,
        )
        prompts = spec.prompts(repeat=run == "ngram")
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, logprobs=-1, prompt_logprobs=-1)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        rows = []
        for prompt, o in zip(prompts, outputs, strict=True):
            first = o.prompt_logprobs or []
            prompt_lp = [[d[t].logprob for t in range(VOCAB)] for d in first[1:] if d is not None]
            gen_lp = [[d[t].logprob for t in range(VOCAB)] for d in (o.outputs[0].logprobs or [])]
            rows.append({"prompt": prompt, "tokens": list(o.outputs[0].token_ids), "logprobs": prompt_lp + gen_lp})
        out.write_text(json.dumps({"run": run, "rows": rows}))
        vllm_side.shutdown(llm)
        del llm, outputs
        gc.collect()


def _reference(model: Path, pairs: list[tuple[Path, Path]]) -> None:
    """Each vLLM run's output (`got`) against transformers' own forward, its summary to `out`; one model load."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    ref = Qwen3_5ForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    for got, out in pairs:
        data = json.loads(got.read_text())
        worst, agree, total, positions = 0.0, 0, 0, 0
        for row in data["rows"]:
            prompt, tokens = row["prompt"], row["tokens"]
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
            want = torch.log_softmax(logits, -1)
            have = torch.tensor(row["logprobs"], dtype=torch.float32)
            # Rows: positions 1..P-1 of the prompt (predicted from what precedes them), then each generated token.
            expected_rows = len(prompt) - 1 + len(tokens)
            if have.shape != (expected_rows, VOCAB):
                raise SystemExit(f"vLLM gave {tuple(have.shape)} log-prob rows, expected {(expected_rows, VOCAB)}")
            worst = max(worst, (have - want[:expected_rows]).abs().max().item())
            greedy = want[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
            agree += sum(int(a == b) for a, b in zip(greedy, tokens, strict=True))
            total += len(tokens)
            positions += expected_rows
        out.write_text(
            json.dumps({"run": data["run"], "max_abs": worst, "agree": agree, "total": total, "positions": positions})
        )


def _kernels(out: Path) -> None:
    """The speculative verify path of the torch GDN kernels, with acceptance > 1 (which the random tiny target rarely
    gives end to end), against transformers' own torch functions run token by token. Runs in a vLLM build's env
    (vLLM's kernels and transformers 5.x side by side). For each number of accepted tokens a = 1..L of a first
    verify step, a second step that starts where the kernel says (state column a - 1, conv window from column a - 1)
    must equal the reference run over the a accepted tokens and then the second step's tokens; the same second step
    read from column 0 (no rollback) is recorded too, and must be far off, so the check can fail."""
    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3_5 import modeling_qwen3_5 as ref
    from vllm.model_executor.layers.mamba.ops import gdn_cpu

    gen = torch.Generator().manual_seed(5)
    h, hv, kd, vd, steps, width, dim = 2, 4, 16, 16, 4, 4, 24

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen)

    a_log, dt_bias = rand(hv), rand(hv)
    weight, bias = rand(dim, width), rand(dim)
    start_state, start_conv = rand(hv, vd, kd) * 0.3, rand(dim, width - 1)
    first = [rand(steps, h, kd), rand(steps, h, kd), rand(steps, hv, vd), rand(steps, hv), rand(steps, hv)]
    second = [rand(steps, h, kd), rand(steps, h, kd), rand(steps, hv, vd), rand(steps, hv), rand(steps, hv)]
    conv_first, conv_second = rand(steps, dim), rand(steps, dim)

    def reference(parts: list[Any], state: Any) -> tuple[Any, Any]:
        """transformers' recurrence over q, k, v, a, b from `state` ([HV, V, K] as vLLM stores it)."""
        q, k, v, a, b = parts
        g = -a_log.exp() * F.softplus(a + dt_bias)
        o, final = ref.torch_recurrent_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            b.sigmoid()[None],
            initial_state=state.transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return o[0], final[0].transpose(-1, -2)

    def kernel(parts: list[Any], states: Any, indices: Any, accepted: int) -> Any:
        q, k, v, a, b = parts
        o, _ = gdn_cpu.fused_sigmoid_gating_delta_rule_update(
            A_log=a_log,
            a=a,
            b=b,
            dt_bias=dt_bias,
            q=q[None],
            k=k[None],
            v=v[None],
            initial_state=states,
            inplace_final_state=True,
            cu_seqlens=torch.tensor([0, steps]),
            ssm_state_indices=indices,
            num_accepted_tokens=torch.tensor([accepted]),
            use_qk_l2norm_in_kernel=True,
        )
        return o[0]

    def conv_reference(tokens: Any, window: Any) -> Any:
        hist = torch.cat([window, tokens.T], dim=1)
        return F.silu(F.conv1d(hist[None], weight[:, None], bias, groups=dim))[0].T

    worst, no_rollback = 0.0, float("inf")
    for accepted in range(1, steps + 1):
        states = torch.zeros(2 * steps + 1, hv, vd, kd)
        states[1] = start_state
        first_cols = torch.tensor([[1, 2, 3, 4]])
        kernel(first, states, first_cols, 1)  # the step after prefill: its state is in column 0
        # Second step: the first `accepted` tokens of step one were kept; the kernel reads column accepted - 1.
        got = kernel(second, states.clone(), first_cols, accepted)
        stale = kernel(second, states.clone(), first_cols, 1)
        _, kept = reference([x[:accepted] for x in first], start_state)
        want, _ = reference(second, kept)
        worst = max(worst, (got - want).abs().max().item())
        if accepted > 1:
            no_rollback = min(no_rollback, (stale - want).abs().max().item())
        # The conv state the same way: step one writes its window history, step two starts after the accepted ones.
        conv = torch.zeros(3, dim, width - 1 + steps - 1)
        conv[1, :, : width - 1] = start_conv
        loc, idx = torch.tensor([0, steps]), torch.tensor([1])
        gdn_cpu.causal_conv1d_update(
            conv_first.clone(),
            conv,
            weight,
            bias,
            "silu",
            conv_state_indices=idx,
            num_accepted_tokens=torch.tensor([1]),
            query_start_loc=loc,
            max_query_len=steps,
        )
        conv_got = gdn_cpu.causal_conv1d_update(
            conv_second.clone(),
            conv.clone(),
            weight,
            bias,
            "silu",
            conv_state_indices=idx,
            num_accepted_tokens=torch.tensor([accepted]),
            query_start_loc=loc,
            max_query_len=steps,
        )
        window = torch.cat([start_conv, conv_first[:accepted].T], dim=1)[:, -(width - 1) :]
        worst = max(worst, (conv_got - conv_reference(conv_second, window)).abs().max().item())
    out.write_text(json.dumps({"max_abs": worst, "no_rollback_min": no_rollback}))


# ---- host side -----------------------------------------------------------------------------------------------------


def ensure_case(manifest: Manifest, ref_python: Path, spec: HybridSpec = SPEC) -> Path:
    """The tiny model's directory, keyed by the spec and this module's bytes; built (atomically) when missing."""
    from vllm_dflash.conformance import compare

    base = compare.conformance_dir() / "cases"
    base.mkdir(parents=True, exist_ok=True)
    final = base / f"{spec.name}-{spec.digest()}"
    if (final / "case.json").is_file():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=base))
    try:
        job = json.dumps({"spec": asdict(spec), "out": str(tmp)})
        proc.call(
            ref_python,
            "-m",
            "vllm_dflash.conformance.hybrid",
            "build",
            job,
            env=compare.ref_environ(manifest),
            error=ConformanceError,
            hint="the reference environment is broken: delete it under the cache's envs/ and retry",
        )
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "case.json").is_file():  # a concurrent run won the rename; anything else is an error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def run_target_conformance(
    manifest: Manifest,
    python: Path,
    environ: Mapping[str, str],
    ref_python: Path,
    build: str,
    work: Path,
    spec: HybridSpec = SPEC,
    runs: tuple[str, ...] = RUNS,
) -> HybridResult:
    """Every run of `spec` through one vLLM build (`python` with `environ`), each judged against transformers."""
    from vllm_dflash.conformance import compare

    model = ensure_case(manifest, ref_python, spec)
    got = {run: work / f"{build}-{run}.vllm.json" for run in runs}
    summary = {run: work / f"{build}-{run}.ref.json" for run in runs}
    # One vLLM process for every run, then one reference process for every output (start-up paid once each).
    side = json.dumps({"spec": asdict(spec), "model": str(model), "runs": [[r, str(got[r])] for r in runs]})
    proc.call(
        python,
        "-m",
        "vllm_dflash.conformance.hybrid",
        "vllm",
        side,
        env=environ,
        error=ConformanceError,
        hint=f"the {build} build could not serve the hybrid target: its last lines above say why",
    )
    pairs = [[str(got[r]), str(summary[r])] for r in runs]
    ref = json.dumps({"spec": asdict(spec), "model": str(model), "pairs": pairs})
    proc.call(
        ref_python,
        "-m",
        "vllm_dflash.conformance.hybrid",
        "reference",
        ref,
        env=compare.ref_environ(manifest),
        error=ConformanceError,
        hint="the reference could not read the vLLM side's output",
    )
    results = []
    for run in runs:
        s = json.loads(summary[run].read_text())
        results.append(RunResult(run, float(s["max_abs"]), int(s["agree"]), int(s["total"]), int(s["positions"])))
    return HybridResult(build, tuple(results))


def check_kernels(python: Path, environ: Mapping[str, str], work: Path) -> tuple[float, float]:
    """The verify-path kernel check (`_kernels`) in a build's env: (max |delta| with rollback, min |delta| without)."""
    out = work / "kernels.json"
    proc.call(
        python,
        "-m",
        "vllm_dflash.conformance.hybrid",
        "kernels",
        json.dumps({"spec": {}, "out": str(out)}),
        env=environ,
        error=ConformanceError,
        hint="this build has no CPU GDN kernels (patches/cpu/0008)",
    )
    s = json.loads(out.read_text())
    return float(s["max_abs"]), float(s["no_rollback_min"])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    job = json.loads(args[1])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in job["spec"].items()}
    spec = HybridSpec(**fields)
    if args[0] == "build":
        _build(spec, Path(job["out"]))
    elif args[0] == "vllm":
        _vllm(spec, Path(job["model"]), [(str(r), Path(o)) for r, o in job["runs"]])
    elif args[0] == "kernels":
        _kernels(Path(job["out"]))
    elif args[0] == "reference":
        _reference(Path(job["model"]), [(Path(g), Path(o)) for g, o in job["pairs"]])
    else:
        raise SystemExit(f"unknown command {args[0]!r}: build, vllm, kernels or reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
