"""`vllm-dflash validate`: the acceptance smoke test.

Serve a profile's target + drafter (or use a running server), send the profile's prompts through the
OpenAI-compatible API, and read the drafter's acceptance from the difference of two `/metrics` scrapes. The report
(strict JSON, sealed so edits show) is what `vllm-dflash publish` demands. Exit 0: every gate passed; 1: a gate
failed; 2: acceptance could not be measured (server failed, no speculation, zero drafts, counters no vLLM can
produce: metrics.py) -- never a pass without drafts. This module runs the prompts and assembles the report; the
prompt sets are in promptsets.py, the gates in gates.py, the serving conditions in serving.py, the tables in
render.py.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import __version__
from vllm_dflash import report as reports
from vllm_dflash.errors import MeasurementError
from vllm_dflash.manifest import Profile
from vllm_dflash.validate import client, kvblocks, metrics
from vllm_dflash.validate.gates import Verdict, condition_gates, judge
from vllm_dflash.validate.promptsets import Prompt, load_prompts, own_prompt_set, profile_prompts, prompts_digest
from vllm_dflash.validate.render import render
from vllm_dflash.validate.server import (
    ContainerOptions,
    LaunchSpec,
    RunningServer,
    launch_container,
    launch_spec,
    launch_subprocess,
    use_endpoint,
)
from vllm_dflash.validate.serving import sampling_conditions, serving_conditions

__all__ = ["Prompt", "Verdict", "judge", "load_prompts", "render"]  # re-exported: their modules were split out

EXIT_PASS, EXIT_FAIL, EXIT_UNMEASURED = 0, 1, 2

# ---------------------------------------------------------------------------------------------------------------
# The prompt run


@dataclass(frozen=True)
class Completion:
    prompt_id: str
    text: str
    completion_tokens: int
    start: float  # time.monotonic()
    end: float
    counters: metrics.SpecCounters | None = None  # a /metrics scrape right after this request (sequential runs)


@dataclass(frozen=True)
class RunResult:
    completions: tuple[Completion, ...]
    wall_s: float  # first request sent -> last answer
    busy_s: float  # time with at least one request in flight: the server's share of the run

    @property
    def output_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def texts(self) -> dict[str, str]:
        return {c.prompt_id: c.text for c in self.completions}


def _busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


ANSWER_LIMIT = 16 << 20  # a chat completion of a few thousand tokens is kilobytes; an endless one is no answer
MODELS_DEADLINE_S = 30.0


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ.get('VLLM_API_KEY', 'EMPTY')}", "Content-Type": "application/json"}


def _json(resp: client.Response) -> Any:
    try:
        return json.loads(resp.body)
    except (ValueError, RecursionError):
        return None


def check_model(base_url: str, model: str) -> None:
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        resp = client.request("GET", url, MODELS_DEADLINE_S, ANSWER_LIMIT, headers=_headers())
    except client.TransportError as exc:
        raise MeasurementError(f"{url} failed: {exc}", "check that it is a vLLM OpenAI server") from None
    doc = _json(resp)
    rows = doc.get("data") if resp.status == 200 and isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise MeasurementError(
            f"{url} failed: HTTP {resp.status}, not a list of models", "check that it is a vLLM OpenAI server"
        )
    served = [str(m.get("id")) for m in rows if isinstance(m, dict)]
    if model not in served:
        raise MeasurementError(
            f"{base_url} serves {served[:20]}, not the profile's model '{model}'",
            "serve the profile's model (or set served_model_name in the profile)",
        )


def _completion(resp: client.Response) -> tuple[str, int] | None:
    """(text, completion tokens) of an OpenAI chat completion; None when it is not one."""
    doc = _json(resp)
    if resp.status != 200 or not isinstance(doc, dict):
        return None
    choices, usage = doc.get("choices") or [], doc.get("usage") or {}
    if not isinstance(choices, list) or not isinstance(usage, dict):
        return None
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else {}
    text = message.get("content") if isinstance(message, dict) else None
    tokens = usage.get("completion_tokens", 0)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return None
    return (text if isinstance(text, str) else ""), tokens


def request_deadline(profile: Profile) -> float:
    """How long one chat completion may take in total: generous for max_tokens on a loaded server."""
    return max(600.0, profile.max_tokens * 2.0)


def scrape_counters(
    base_url: str, replicas: Sequence[str] = (), session: client.Session | None = None
) -> tuple[metrics.SpecCounters, tuple[metrics.SpecCounters, ...]]:
    """The server's counters: its own /metrics, or, behind a router, the sum of its `replicas`' (each one's too)."""
    if not replicas:
        return metrics.scrape(base_url, session=session), ()
    each = metrics.scrape_replicas(replicas, session=session)
    return metrics.total(each), each


def run_prompts(
    base_url: str,
    profile: Profile,
    prompts: Sequence[Prompt],
    show_progress: bool = True,
    replicas: Sequence[str] = (),
) -> RunResult:
    """Send every prompt as a chat completion (greedy unless the profile says otherwise), `profile.concurrency` at
    a time, each with a total deadline (client.py).

    With concurrency 1 the requests run one after another and /metrics is scraped after each, so every prompt's own
    drafts and acceptances are known (per-prompt acceptance lengths, not only the pooled one). The requests run in
    daemon threads of one client.Session: a failed request, or Ctrl-C in the waiting main thread, aborts every
    request in flight at once (never a wait for the slowest one) and nothing more is sent."""
    from rich.progress import Progress

    check_model(base_url, profile.model_name)
    extra_body: dict[str, Any] = {"chat_template_kwargs": profile.template_kwargs}
    if profile.ignore_eos:
        extra_body["ignore_eos"] = True
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    session = client.Session()
    deadline = request_deadline(profile)

    def one(prompt: Prompt) -> Completion:
        body = {
            "model": profile.model_name,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": profile.max_tokens,
            "temperature": profile.temperature,
            "seed": 0,
            **extra_body,
        }
        start = time.monotonic()
        try:
            resp = session.request("POST", url, deadline, ANSWER_LIMIT, json.dumps(body).encode(), _headers())
        except client.TransportError as exc:
            raise MeasurementError(f"request for prompt {prompt.id} failed: {exc}", "check the server log") from None
        end = time.monotonic()
        got = _completion(resp)
        if got is None:
            said = resp.body[:200].decode(errors="replace")
            raise MeasurementError(
                f"request for prompt {prompt.id} failed: HTTP {resp.status}: {said}", "check the server log"
            )
        counters = scrape_counters(base_url, replicas, session)[0] if profile.concurrency == 1 else None
        return Completion(prompt.id, got[0], got[1], start, end, counters)

    results: list[Completion | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = iter(enumerate(prompts))

    def worker() -> None:
        while not session.aborted.is_set():
            with lock:
                item = next(queue, None)
            if item is None:
                return
            try:
                results[item[0]] = one(item[1])
            except BaseException as exc:  # recorded for the main thread, which raises it
                with lock:
                    errors.append(exc)
                session.abort()
                return

    threads = [
        threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(profile.concurrency, len(prompts))))
    ]
    with Progress(transient=True, disable=not show_progress) as progress:
        task = progress.add_task(f"{len(prompts)} prompts", total=len(prompts))
        try:
            for t in threads:
                t.start()
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(0.2)  # a bounded wait: Ctrl-C reaches this thread at once
                progress.update(task, completed=sum(r is not None for r in results))
        except BaseException:
            session.abort()
            for t in threads:
                t.join(2.0)
            raise
    if errors:
        raise errors[0]
    done = [r for r in results if r is not None]
    if not done:
        raise MeasurementError("no prompts were sent", "give the profile a non-empty prompt set")
    first, last = min(c.start for c in done), max(c.end for c in done)
    return RunResult(completions=tuple(done), wall_s=last - first, busy_s=_busy_time([(c.start, c.end) for c in done]))


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------
# The stage


@dataclass(frozen=True)
class ServerChoice:
    """How to reach the server: exactly one of endpoint, python (subprocess), image (container)."""

    endpoint: str | None = None
    python: Path | None = None
    image: str | None = None
    wheel: Path | None = None  # the wheel the server runs (named in the report; checked where possible)
    container_tool: str = "docker"
    gpus: str = "all"
    baseline_endpoint: str | None = None
    # endpoint mode: the base URLs of the replicas behind it (a router), whose /metrics are read and added up
    replicas: tuple[str, ...] = ()
    health_timeout_s: float | None = None
    log_dir: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # subprocess: extra environment (a target dir's PYTHONPATH)
    scripts: Path | None = None  # subprocess: where the wheel's console scripts are (default: next to python)

    @property
    def mode(self) -> str:
        return "endpoint" if self.endpoint else "container" if self.image else "subprocess"


@dataclass(frozen=True)
class ValidationResult:
    report: Mapping[str, Any]
    report_path: Path
    exit_code: int
    # Each comparison build's own sealed report, gated like the validated one on the same prompts (the stock build:
    # its report fails the reference gate, and publish refuses it), so a second validation never serves it again.
    comparison_reports: Mapping[str, Path] = field(default_factory=dict)


def comparison_report_path(report_path: Path, name: str) -> Path:
    """Where the report of comparison build `name` goes: beside the validated build's (report.stock.json)."""
    return report_path.with_name(f"{report_path.stem}.{name}{report_path.suffix or '.json'}")


@contextlib.contextmanager
def _server(choice: ServerChoice, profile: Profile, speculative: bool) -> Iterator[RunningServer]:
    spec = launch_spec(profile, speculative)
    if choice.health_timeout_s is not None:
        spec = LaunchSpec(**{**spec.__dict__, "health_timeout_s": choice.health_timeout_s})
    if choice.endpoint:
        url = choice.endpoint if speculative else choice.baseline_endpoint
        assert url is not None
        wheel = choice.wheel if speculative else None
        image = choice.image if speculative else None
        with use_endpoint(url, wheel, image, choice.container_tool, choice.health_timeout_s or 30.0) as s:
            yield s
    elif choice.image:
        opts = ContainerOptions(image=choice.image, tool=choice.container_tool, gpus=choice.gpus)
        with launch_container(spec, opts) as s:
            yield s
    else:
        python = choice.python or Path(sys.executable)
        wheel = choice.wheel if speculative else None
        with launch_subprocess(
            spec, python, wheel, log_dir=choice.log_dir, env=choice.env, scripts=choice.scripts
        ) as s:
            yield s


@dataclass(frozen=True)
class Reference:
    """The reference's own generation loop on the same prompts (dflash's `dflash_generate`, greedy), pooled the way
    vLLM pools; its outputs are what a lossless build must reproduce."""

    acceptance_length: float
    per_prompt: Mapping[str, float]  # prompt id -> that prompt's AL
    texts: Mapping[str, str]  # prompt id -> generated text (special tokens skipped, as vLLM's API returns it)
    detail: Mapping[str, Any] = field(default_factory=dict)  # what the loop reports beyond that (kept in the report)
    # Given the validated build's mismatches ({"id", "position"}: first differing character) and its texts, one row
    # per mismatch saying whether the differing token was a near-tie of the target's top logit ("near_tie": bool).
    explain: Callable[[Sequence[Mapping[str, Any]], Mapping[str, str]], list[dict[str, Any]]] | None = None


@dataclass(frozen=True)
class Measurement:
    """One server's run of the prompts: what it serves, its counters, its outputs."""

    server: Mapping[str, Any]
    before: metrics.SpecCounters
    after: metrics.SpecCounters
    run: RunResult
    timings: Mapping[str, float]
    # The KV blocks each group held when the longest request finished, from the server's log (our build with
    # VLLM_DFLASH_LOG_KV_BLOCKS=1; None otherwise): see validate/kvblocks.py.
    kv_blocks: Mapping[str, Any] | None = None
    # Behind a router: each replica's scrapes (the totals above are their sums), in the order of `replicas`.
    replicas: tuple[str, ...] = ()
    replicas_before: tuple[metrics.SpecCounters, ...] = ()
    replicas_after: tuple[metrics.SpecCounters, ...] = ()

    @property
    def delta(self) -> metrics.SpecCounters:
        return self.after.minus(self.before)

    def per_prompt_al(self) -> dict[str, float]:
        """Each prompt's own AL, from the scrape after it (sequential runs only; empty otherwise)."""
        out: dict[str, float] = {}
        prev = self.before
        for c in self.run.completions:
            if c.counters is None:
                return {}
            d = c.counters.minus(prev)
            prev = c.counters
            if d.drafts > 0:
                out[c.prompt_id] = 1 + d.accepted / d.drafts
        return out

    def texts(self) -> dict[str, str]:
        return self.run.texts()


def measure(
    choice: ServerChoice, profile: Profile, prompts: Sequence[Prompt], show: bool, speculative: bool = True
) -> Measurement:
    """Start (or reach) the server, run the prompts, and take the counters around the run."""
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    replicas = choice.replicas if speculative else ()
    with _server(choice, profile, speculative=speculative) as server:
        timings["server_ready_s"] = time.monotonic() - t0
        t = time.monotonic()
        before, each_before = scrape_counters(server.base_url, replicas)
        timings["scrape_before_s"] = time.monotonic() - t
        run = run_prompts(server.base_url, profile, prompts, show_progress=show, replicas=replicas)
        t = time.monotonic()
        after, each_after = scrape_counters(server.base_url, replicas)
        timings["scrape_after_s"] = time.monotonic() - t
        timings["requests_busy_s"] = run.busy_s
        described = {"base_url": server.base_url, **server.provenance.as_dict()}
        kv = kvblocks.from_log(server.log_path)
    if replicas:
        problem = metrics.accounting_problem(
            [a.minus(b) for a, b in zip(each_after, each_before, strict=True)], len(run.completions), replicas
        )
        if problem is not None:
            raise MeasurementError(problem, "pass each replica behind the router once with --metrics")
    else:
        problem = metrics.hidden_servers_problem(after.minus(before), len(run.completions), server.base_url)
        if problem is not None:
            raise MeasurementError(problem, "pass each replica behind the router with --metrics URL")
    return Measurement(
        server=described,
        before=before,
        after=after,
        run=run,
        timings=timings,
        kv_blocks=kv,
        replicas=replicas,
        replicas_before=each_before,
        replicas_after=each_after,
    )


def first_difference(got: str, want: str) -> int:
    """Index of the first character where two texts differ (the shorter one's length when one is a prefix)."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))


def _matching(got: Mapping[str, str], want: Mapping[str, str]) -> dict[str, Any]:
    """How many of `want`'s outputs (by prompt id) `got` reproduced exactly, the rate, and every mismatch with its
    first differing character."""
    mismatches = [
        {"id": pid, "position": first_difference(got.get(pid, ""), text)}
        for pid, text in want.items()
        if got.get(pid) != text
    ]
    matches = len(want) - len(mismatches)
    return {"matches": matches, "rate": matches / len(want) if want else 0.0, "mismatches": mismatches}


def _comparison(m: Measurement, reference: Reference | None, k: int, method: str) -> dict[str, Any]:
    acc = metrics.acceptance(m.delta, k, method)
    out: dict[str, Any] = {"server": dict(m.server), "counters": m.delta.as_dict(), "acceptance": acc.as_dict()}
    out["throughput"] = {
        "output_tokens": m.run.output_tokens,
        "wall_s": m.run.wall_s,
        "tokens_per_s": m.run.tokens_per_s,
    }
    if reference is not None:
        out["lossless_vs_reference"] = _matching(m.texts(), reference.texts)
    if m.kv_blocks is not None:
        out["kv_blocks_longest_prompt"] = dict(m.kv_blocks)
    return out


def validate(
    profile: Profile,
    choice: ServerChoice,
    report_path: Path,
    prompts: Sequence[Prompt] | None = None,
    baseline: bool | None = None,
    show: bool = True,
    prompt_set: str | None = None,
    comparisons: Mapping[str, ServerChoice] | None = None,
    reference: Callable[[], Reference] | None = None,
    full_count: int | None = None,
) -> ValidationResult:
    """Run the smoke test and write the sealed report; the exit code says pass (0), fail (1) or unmeasured (2).

    `comparisons` are other servers run on the same prompts and reported beside the validated one (the stock build,
    say); `reference` computes the reference loop's result on them (its AL gates `reference_tolerance`, its outputs
    the lossless check). Neither changes what is validated: the artifact of `choice`. `full_count` is how many
    prompts the profile's own set holds (default: as many as are sent); a run on fewer, or on another set, is
    exploratory: its report says so and publish refuses it.
    """
    t0 = time.monotonic()
    started = _now()
    prompts = list(prompts) if prompts is not None else load_prompts(profile.prompts, profile.num_prompts)
    own_set = own_prompt_set(profile)
    sent_set = prompt_set or own_set
    if full_count is None and sent_set == own_set:
        own = profile_prompts(profile)
        full_count = len(own) if own is not None else len(prompts)
    exploratory = exploratory_reason(profile, sent_set, len(prompts), full_count)
    want_baseline = profile.baseline if baseline is None else baseline
    if choice.mode == "endpoint":
        want_baseline = choice.baseline_endpoint is not None
    body: dict[str, Any] = {
        "schema": reports.SCHEMA,
        "tool": {"name": "vllm-dflash", "version": __version__},
        "profile": {"name": profile.name, "sha256": profile.digest, **profile.definition},
        "prompts": {"set": sent_set, "count": len(prompts), "sha256": prompts_digest(prompts)},
        "exploratory": exploratory,  # why the report is not publishable whatever its verdict, or None
        "serving": serving_conditions(profile, choice.mode),
        "sampling": sampling_conditions(profile),
        "server": {"mode": choice.mode},
        "counters": None,
        "acceptance": None,
        "baseline": None,
        "comparisons": None,
        "reference": None,
        "gates": [],
        "verdict": "error",
        "error": None,
        "timestamps": {"started": started},
    }
    timings: dict[str, float] = {}
    try:
        m = measure(choice, profile, prompts, show)
        timings.update(m.timings)
        body["server"] = dict(m.server)
        delta = m.delta
        body["counters"] = {"before": m.before.as_dict(), "after": m.after.as_dict(), "delta": delta.as_dict()}
        body["throughput"] = {
            "output_tokens": m.run.output_tokens,
            "wall_s": m.run.wall_s,
            "tokens_per_s": m.run.tokens_per_s,
        }
        if m.kv_blocks is not None:
            body["kv_blocks_longest_prompt"] = dict(m.kv_blocks)
        if m.replicas:
            body["replicas"] = [
                {"metrics": f"{url}/metrics", "counters": a.minus(b).as_dict()}
                for url, b, a in zip(m.replicas, m.replicas_before, m.replicas_after, strict=True)
            ]
        # MeasurementError on no speculation, zero drafts, or counts no vLLM can produce.
        acc = metrics.acceptance(delta, profile.num_speculative_tokens, profile.method)
        body["acceptance"] = acc.as_dict()
        serving = body["serving"]
        serving["observed_in_metrics"] = dict(m.before.observed) or None
        cut = metrics.cut_drafts_line(acc, serving["max_num_seqs"], serving["max_num_batched_tokens"])
        body["drafts_cut"] = cut
        match_rate = None
        if want_baseline:
            t = time.monotonic()
            body["baseline"], match_rate = _baseline(choice, profile, prompts, m.run, show)
            timings["baseline_s"] = time.monotonic() - t
        others: dict[str, Measurement] = {}
        for name, other in (comparisons or {}).items():
            t = time.monotonic()
            others[name] = measure(other, profile, prompts, show)
            timings[f"{name}_s"] = time.monotonic() - t
        ref = None
        if reference is not None:
            t = time.monotonic()
            ref = reference()
            timings["reference_s"] = time.monotonic() - t
            body["reference"] = {"acceptance_length": ref.acceptance_length, **ref.detail}
            lossless = body["lossless_vs_reference"] = _matching(m.texts(), ref.texts)
            match_rate = lossless["rate"] if match_rate is None else min(match_rate, lossless["rate"])
            if ref.explain is not None and lossless["mismatches"]:
                body["mismatch_analysis"] = ref.explain(lossless["mismatches"], m.texts())
        if others:
            body["comparisons"] = {
                name: _comparison(o, ref, profile.num_speculative_tokens, profile.method) for name, o in others.items()
            }
        body["per_prompt"] = _per_prompt(m, others, ref)
        verdicts = judge(profile, acc, match_rate, ref.acceptance_length if ref is not None else None)
        verdicts += condition_gates(profile, delta, body.get("mismatch_analysis"))
        body["gates"] = [v.as_dict() for v in verdicts]
        body["verdict"] = "pass" if all(v.passed for v in verdicts) else "fail"
        code = EXIT_PASS if body["verdict"] == "pass" else EXIT_FAIL
    except MeasurementError as exc:
        body["error"] = exc.message + (f"\n{exc.detail}" if exc.detail else "")
        body["timestamps"]["finished"] = _now()
        timings["total_s"] = time.monotonic() - t0
        body["timings"] = timings
        reports.write(reports.seal(body, reports.key_from_env()), report_path, reports.key_from_env())
        raise
    body["timestamps"]["finished"] = _now()
    timings["total_s"] = time.monotonic() - t0
    body["timings"] = timings
    report = reports.seal(body, reports.key_from_env())
    reports.write(report, report_path, reports.key_from_env())
    written: dict[str, Path] = {}
    for name, other_m in others.items():
        path = comparison_report_path(report_path, name)
        try:
            other_body = _comparison_body(body, name, other_m, ref, profile, report_path)
        except MeasurementError as exc:  # e.g. it drafted nothing: its row in the report above says so
            print(f"note: no report for the {name} build: {exc.message}", file=sys.stderr, flush=True)
            continue
        reports.write(reports.seal(other_body, reports.key_from_env()), path, reports.key_from_env())
        written[name] = path
    if show:
        render(report)
    return ValidationResult(report=report, report_path=report_path, exit_code=code, comparison_reports=written)


def _comparison_body(
    body: Mapping[str, Any],
    name: str,
    m: Measurement,
    ref: Reference | None,
    profile: Profile,
    report_path: Path,
) -> dict[str, Any]:
    """The report of comparison build `name` as if it were the validated one: its own server, counters and outputs,
    the same prompts, reference loop and gates (no baseline, no comparisons of its own)."""
    skip = ("comparisons", "per_prompt", "baseline", "mismatch_analysis", "drafts_cut", "lossless_vs_reference")
    out = {k: v for k, v in body.items() if k not in skip}
    out["server"] = dict(m.server)
    out["counters"] = {"before": m.before.as_dict(), "after": m.after.as_dict(), "delta": m.delta.as_dict()}
    out["throughput"] = {
        "output_tokens": m.run.output_tokens,
        "wall_s": m.run.wall_s,
        "tokens_per_s": m.run.tokens_per_s,
    }
    out["baseline"] = None
    out["comparisons"] = None
    out["compared_in"] = {"report": report_path.name, "as": name}
    acc = metrics.acceptance(m.delta, profile.num_speculative_tokens)
    out["acceptance"] = acc.as_dict()
    match_rate = None
    if ref is not None:
        lossless = out["lossless_vs_reference"] = _matching(m.texts(), ref.texts)
        match_rate = lossless["rate"]
        if ref.explain is not None and lossless["mismatches"]:
            out["mismatch_analysis"] = ref.explain(lossless["mismatches"], m.texts())
    verdicts = judge(profile, acc, match_rate, ref.acceptance_length if ref is not None else None)
    verdicts += condition_gates(profile, m.delta, out.get("mismatch_analysis"))
    out["gates"] = [v.as_dict() for v in verdicts]
    out["verdict"] = "pass" if all(v.passed for v in verdicts) else "fail"
    return out


def exploratory_reason(profile: Profile, sent_set: str, count: int, full_count: int | None) -> str | None:
    """Why a run on these prompts cannot gate publishing (None: it can): another set than the profile's, or fewer
    prompts than its minimum (default: all of its set)."""
    if sent_set != own_prompt_set(profile):
        return f"prompt set {sent_set!r} is not the profile's own {own_prompt_set(profile)!r}"
    minimum = profile.min_prompts if profile.min_prompts is not None else full_count
    if minimum is not None and count < minimum:
        return f"{count} prompts sent, the profile's gate is defined on {minimum}"
    return None


def _per_prompt(m: Measurement, others: Mapping[str, Measurement], ref: Reference | None) -> list[dict[str, Any]]:
    """Per-prompt ALs side by side (validated build, each comparison, the reference loop), where known."""
    mine = m.per_prompt_al()
    if not mine:
        return []
    theirs = {name: o.per_prompt_al() for name, o in others.items()}
    rows: list[dict[str, Any]] = []
    for c in m.run.completions:
        row: dict[str, Any] = {"id": c.prompt_id, "al": mine.get(c.prompt_id)}
        for name, per in theirs.items():
            row[f"al_{name}"] = per.get(c.prompt_id)
        if ref is not None:
            row["al_reference"] = ref.per_prompt.get(c.prompt_id)
        rows.append(row)
    return rows


def _baseline(
    choice: ServerChoice, profile: Profile, prompts: Sequence[Prompt], spec_run: RunResult, show: bool
) -> tuple[dict[str, Any], float]:
    """Same prompts without speculation: throughput ratio, and how many greedy outputs match exactly."""
    with _server(choice, profile, speculative=False) as server:
        base = run_prompts(server.base_url, profile, prompts, show_progress=show)
    lossless = _matching(spec_run.texts(), base.texts())
    speedup = spec_run.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else None
    return (
        {
            "output_tokens": base.output_tokens,
            "wall_s": base.wall_s,
            "tokens_per_s": base.tokens_per_s,
            "speedup": speedup,
            "lossless_matches": lossless["matches"],
            "lossless_match_rate": lossless["rate"],
            "lossless_mismatches": lossless["mismatches"],
        },
        lossless["rate"],
    )
