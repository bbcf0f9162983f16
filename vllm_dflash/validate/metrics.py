"""Speculative-decoding counters from a vLLM server's Prometheus `/metrics`, and the acceptance numbers they give.

The counters are cumulative since the server started, so a measurement is always the difference of two scrapes
taken around the prompt run: traffic before the run (warm-up, other users) does not count.

Only numbers a real vLLM can produce are measured: every counter a whole number >= 0, every per-position label a
draft position as vLLM writes it, none going down between the two scrapes, and a delta that obeys what speculative
decoding is (accepted <= draft tokens <= drafts x k, per-position counts non-increasing and summing to the accepted
ones, present for DFlash). Anything else is MeasurementError (exit 2), never a verdict. Those rules belong to the
report (`report.count_problem` and its helpers): the report's readers (publish, release, verify) apply the same
ones again to the counters it carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_dflash import report as rules
from vllm_dflash.errors import MeasurementError, ReplicaDownError
from vllm_dflash.validate import client

# Prometheus family names as vLLM exports them (the text format adds `_total` to counter samples; the parser
# strips it again from the family name).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # a gauge whose labels are the engine's CacheConfig fields
OBSERVED_CACHE_FIELDS = ("enable_prefix_caching", "block_size", "cache_dtype")
SPEC_FAMILIES = (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS)
_MALFORMED_HINT = "this is not what a vLLM server exports; point --endpoint at a vLLM server"
# A vLLM /metrics page is well under a MiB (a few hundred families, histograms per engine); a server sending more is
# not one, and an endless answer must not be read without end.
MAX_METRICS_BYTES = 32 << 20
# Prefix caching (prompt tokens looked up / found in the cache): a run that claims the condition must show hits.
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
# Finished requests (one sample per finish reason): behind a router, each request finishes on exactly one replica, so
# the replicas' deltas must add up to the requests the run sent (none missing, none counted twice).
REQUEST_SUCCESS = "vllm:request_success"
# When the serving process started (prometheus_client's process collector, on vLLM's default registry): which server
# answered a scrape. A load balancer in front of /metrics answers from one replica, then another.
PROCESS_START = "process_start_time_seconds"


@dataclass(frozen=True)
class SpecCounters:
    """One scrape of the speculative-decoding counters, summed over engines and models.

    `present` is False when the server exports none of the spec-decode families (it runs without speculation).
    """

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: Mapping[int, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    present: bool = False
    # What the server says of its own cache config (vllm:cache_config_info labels): observed, not declared.
    observed: Mapping[str, str] = field(default_factory=dict)

    def named(self) -> dict[str, float]:
        """Every counter by a readable name (what a message about one of them says)."""
        out = {
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted,
            "generation_tokens": self.generation_tokens,
        }
        out.update({f"num_accepted_tokens_per_pos[{p}]": v for p, v in sorted(self.per_position.items())})
        return out

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    # Requests finished (vllm:request_success, every finish reason; None: not exported): not a report counter, the
    # accounting of which servers answered the run's requests.
    finished_requests: float | None = None
    # The answering process's start time (PROCESS_START; None: not exported, or counters of several servers added).
    started: float | None = None

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts added between `before` and this scrape; MeasurementError when a counter went down (the
        server restarted in between, or it is not a counter at all) or another process answered this scrape."""
        if self.started is not None and before.started is not None and self.started != before.started:
            raise MeasurementError(
                f"two scrapes of /metrics were answered by different server processes (started at {before.started:.2f} "
                f"and {self.started:.2f}): a router or load balancer in front of /metrics, or a restart, so the "
                "difference of their counters is no server's drafts",
                "pass each replica behind the router with --metrics (docs/deploy.md), or --endpoint one server",
            )
        mine, theirs = self.named(), before.named()
        for name, old in theirs.items():
            new = mine.get(name, 0.0)
            if new < old:
                raise MeasurementError(
                    f"/metrics counter {name} went down from {old:g} to {new:g} during the run: the server "
                    "restarted (or its counters are not cumulative), so the run's drafts are unknown",
                    "run validate again against a server that stays up for the whole run",
                )
        positions = sorted(set(self.per_position) | set(before.per_position))
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            per_position={p: self.per_position.get(p, 0.0) - before.per_position.get(p, 0.0) for p in positions},
            generation_tokens=self.generation_tokens - before.generation_tokens,
            present=self.present,
            prefix_cache_queries=self.prefix_cache_queries - before.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - before.prefix_cache_hits,
            finished_requests=_op(self.finished_requests, before.finished_requests, -1),
        )

    def plus(self, other: SpecCounters) -> SpecCounters:
        """Two servers' counters together (the replicas behind one router): every counter added, each position's too;
        the cache config is the first one's (replicas are started alike)."""
        positions = sorted(set(self.per_position) | set(other.per_position))
        return SpecCounters(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            per_position={p: self.per_position.get(p, 0.0) + other.per_position.get(p, 0.0) for p in positions},
            generation_tokens=self.generation_tokens + other.generation_tokens,
            present=self.present or other.present,
            observed=self.observed or other.observed,
            prefix_cache_queries=self.prefix_cache_queries + other.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits + other.prefix_cache_hits,
            finished_requests=_op(self.finished_requests, other.finished_requests, 1),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.drafts,
            "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted,
            "num_accepted_tokens_per_pos": {str(p): v for p, v in sorted(self.per_position.items())},
            "generation_tokens": self.generation_tokens,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
        }


def _op(a: float | None, b: float | None, sign: int) -> float | None:
    """a + sign x b for a count a server may not export (None: unknown, and so is the result)."""
    return None if a is None or b is None else a + sign * b


@dataclass(frozen=True)
class Acceptance:
    """What a counter delta says about the drafter."""

    mean_acceptance_length: float  # 1 + accepted / drafts: tokens emitted per target forward pass
    draft_acceptance_rate: float  # accepted / draft tokens
    per_position_rate: tuple[float, ...]  # accepted at position i / drafts, i = 0..k-1
    mean_draft_tokens: float = 0.0  # draft tokens / drafts: k unless vLLM's scheduler cut the drafts
    num_speculative_tokens: int = 0  # k the server was asked to draft

    def as_dict(self) -> dict[str, object]:
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance_rate": list(self.per_position_rate),
            "mean_draft_tokens_per_draft": self.mean_draft_tokens,
            "num_speculative_tokens": self.num_speculative_tokens,
        }


def _sample_line(sample: Any) -> str:
    """The sample as a message quotes it: at most a few hundred characters, whatever the server sent."""
    labels = ",".join(f'{k}="{v[:40]}{"..." if len(v) > 40 else ""}"' for k, v in sorted(sample.labels.items()))
    line = f"{sample.name}{{{labels}}} {sample.value}"
    return line if len(line) <= 300 else line[:297] + "..."


def parse_spec_counters(text: str) -> SpecCounters:
    """Parse Prometheus text exposition with prometheus_client's own parser and pick out the spec-decode counters.

    A counter sample that is not finite and >= 0, or a per-position sample without an integer `position` label, is
    malformed metrics: MeasurementError quoting the sample."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    present = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MeasurementError(
            f"/metrics is not Prometheus text format: {str(exc)[:300]}", "check that the URL is a vLLM server"
        ) from None
    observed: dict[str, str] = {}
    started: float | None = None
    for family in families:
        if family.name == PROCESS_START and len(family.samples) == 1:
            started = float(family.samples[0].value)
            continue
        if family.name == CACHE_CONFIG_INFO and family.samples:
            labels = family.samples[0].labels
            observed = {k: str(labels[k]) for k in OBSERVED_CACHE_FIELDS if k in labels}
            continue
        # vLLM declares its counters as `<name>_total` (the parser strips that suffix); a family declared without
        # TYPE keeps it. Either way the family is the same counter.
        name = family.name.removesuffix("_total")
        if name not in (*SPEC_FAMILIES, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS, REQUEST_SUCCESS):
            continue
        present = present or name in SPEC_FAMILIES
        for sample in family.samples:
            # Counters also export `_created` timestamps; only the running total counts.
            if not sample.name.endswith("_total") and sample.name != family.name:
                continue
            value = float(sample.value)
            problem = rules.count_value_problem("its value", value)  # the report owns the rule for a count
            if problem is not None:
                raise MeasurementError(
                    f"malformed metrics: counter sample `{_sample_line(sample)}`: {problem}", _MALFORMED_HINT
                )
            if name == ACCEPTED_PER_POS:
                label = sample.labels.get("position")
                found = rules.position_of(label)
                if found is None:
                    what = (
                        "has no position label"
                        if label is None
                        else f"has position {label[:20]!r}, not an integer as vLLM writes one"
                    )
                    raise MeasurementError(f"malformed metrics: `{_sample_line(sample)}` {what}", _MALFORMED_HINT)
                pos = found
                per_pos[pos] = per_pos.get(pos, 0.0) + value
            else:
                totals[name] = totals.get(name, 0.0) + value
    return SpecCounters(
        drafts=totals.get(DRAFTS, 0.0),
        draft_tokens=totals.get(DRAFT_TOKENS, 0.0),
        accepted=totals.get(ACCEPTED, 0.0),
        per_position=per_pos,
        generation_tokens=totals.get(GENERATION_TOKENS, 0.0),
        present=present,
        observed=observed,
        prefix_cache_queries=totals.get(PREFIX_QUERIES, 0.0),
        prefix_cache_hits=totals.get(PREFIX_HITS, 0.0),
        finished_requests=totals.get(REQUEST_SUCCESS),
        started=started,
    )


def scrape(
    base_url: str, timeout_s: float = 30.0, session: client.Session | None = None, replica: bool = False
) -> SpecCounters:
    """GET `{base_url}/metrics` (answered in full within `timeout_s` seconds) and parse it. A `replica` (one of the
    servers behind a router) that gives no answer is down: ReplicaDownError."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        resp = (session or client.Session()).request("GET", url, timeout_s, MAX_METRICS_BYTES)
    except client.TooLarge:
        raise MeasurementError(
            f"{url} answered more than {MAX_METRICS_BYTES >> 20} MiB: not a vLLM /metrics page",
            "point --endpoint at a vLLM server",
        ) from None
    except client.TransportError as exc:
        if replica and not (session is not None and session.aborted.is_set()):
            raise ReplicaDownError(
                f"replica {base_url} is down (its /metrics: {exc}): the drafts the router sent it cannot be counted",
                "bring it back, or take it out of the router and drop its --metrics, then run validate again",
            ) from None
        raise MeasurementError(
            f"cannot read {url}: {exc}", "check that the server is up and exports /metrics"
        ) from None
    if resp.status != 200:
        raise MeasurementError(f"cannot read {url}: HTTP {resp.status}", "check that the server exports /metrics")
    try:
        text = resp.body.decode()
    except UnicodeDecodeError:
        raise MeasurementError(f"{url} is not UTF-8 text", "check that the URL is a vLLM server") from None
    return parse_spec_counters(text)


def scrape_replicas(
    replicas: Sequence[str], timeout_s: float = 30.0, session: client.Session | None = None
) -> tuple[SpecCounters, ...]:
    """Each replica's /metrics (base URLs, one per server behind the router), in order; ReplicaDownError when one
    does not answer."""
    return tuple(scrape(url, timeout_s, session, replica=True) for url in replicas)


def total(scrapes: Sequence[SpecCounters]) -> SpecCounters:
    """The replicas' counters added up: what the fleet behind a router drafted and accepted."""
    out = SpecCounters(finished_requests=0.0)
    for one in scrapes:
        out = out.plus(one)
    return out


def accounting_problem(deltas: Sequence[SpecCounters], sent: int, replicas: Sequence[str]) -> str | None:
    """None when the replicas' finished requests add up to the `sent` requests of the run (each request finishes on
    one replica); else what that means: a replica missing from the list, or one counted twice (or other traffic)."""
    counts = [d.finished_requests for d in deltas]
    if any(c is None for c in counts):
        missing = [url for url, c in zip(replicas, counts, strict=True) if c is None]
        return f"{', '.join(missing)} export no {REQUEST_SUCCESS}: not vLLM servers, their requests cannot be counted"
    finished = sum(c for c in counts if c is not None)
    if finished == sent:
        return None
    each = ", ".join(f"{url} {c:g}" for url, c in zip(replicas, counts, strict=True) if c is not None)
    if finished < sent:
        why = "a replica the router sent requests to is missing from --metrics"
    else:
        why = "a replica is named twice in --metrics (two URLs of one server), or the replicas served other traffic"
    return f"the replicas' /metrics count {finished:g} finished requests for the {sent} this run sent ({each}): {why}"


def hidden_servers_problem(delta: SpecCounters, sent: int, url: str) -> str | None:
    """One server's /metrics that counts fewer finished requests than the run sent: others answered some of them,
    e.g. replicas behind a router whose /metrics shows one of them. None when it counts them all (or exports no
    count: then nothing can be told)."""
    if delta.finished_requests is None or delta.finished_requests >= sent:
        return None
    return (
        f"{url}/metrics counts {delta.finished_requests:g} finished requests of the {sent} this run sent: other "
        "servers answered the rest (a router shows one replica's /metrics), so their drafts are not in these counters"
    )


def acceptance(delta: SpecCounters, k: int, method: str | None = None) -> Acceptance:
    """AL, draft acceptance rate and per-position rates of a counter delta for a server drafting `k` tokens with
    `method` (DFlash must export per-position counts); MeasurementError when nothing was drafted or the counts are
    impossible."""
    if not delta.present:
        raise MeasurementError(
            "the server exports no spec_decode counters: it runs without speculative decoding",
            "serve with --speculative-config (validate sets it when it launches the server)",
        )
    problem = rules.count_problem(
        delta.drafts,
        delta.draft_tokens,
        delta.accepted,
        delta.per_position,
        k,
        rules.per_position_required(method),
    )
    if problem is not None:
        if delta.drafts == 0:
            raise MeasurementError(problem, "check the speculative config and that the prompts produced output tokens")
        raise MeasurementError(f"impossible /metrics counts: {problem}", _MALFORMED_HINT)
    return Acceptance(
        mean_acceptance_length=1.0 + delta.accepted / delta.drafts,
        draft_acceptance_rate=delta.accepted / delta.draft_tokens if delta.draft_tokens > 0 else 0.0,
        per_position_rate=tuple(delta.per_position.get(p, 0.0) / delta.drafts for p in range(k))
        if delta.per_position
        else (),
        mean_draft_tokens=delta.draft_tokens / delta.drafts,
        num_speculative_tokens=k,
    )


# ---------------------------------------------------------------------------------------------------------------
# The token-budget trap (issue 20): DFlash reserves (k-1) x max_num_seqs scheduler slots; below about
# 2k x max_num_seqs tokens per step a decode step silently gets fewer draft tokens.


def budget_floor(k: int, max_num_seqs: int) -> int:
    """The `--max-num-batched-tokens` at and above which no decode step has its drafts cut."""
    return 2 * k * max_num_seqs


def cut_drafts_line(acc: Acceptance, max_num_seqs: int | None, budget: int | None) -> str | None:
    """One line when vLLM drafted fewer than k tokens per draft on average (its token budget cut them), saying which
    serve argument to raise and to what, from k and max_num_seqs (as the serve args state them; None: not given)."""
    k = acc.num_speculative_tokens
    if acc.mean_draft_tokens >= k:  # all k drafted (k = 0, no k known, too: a mean is never below 0)
        return None
    said = f"vLLM cut the drafts: {acc.mean_draft_tokens:.2f} of k = {k} draft tokens per draft on average"
    if max_num_seqs is None:
        return (
            f"{said}; raise --max-num-batched-tokens to at least 2 x k x max_num_seqs ({2 * k} per sequence, "
            f"{budget_floor(k, 1024)} for vLLM's default of up to 1024), or set a lower --max-num-seqs"
        )
    floor = budget_floor(k, max_num_seqs)
    if budget is not None and budget >= floor:
        return (
            f"{said}, although the profile's --max-num-batched-tokens {budget} is at least 2 x k x max_num_seqs = "
            f"{floor}: the server runs with other settings than the profile's; serve it with "
            f"--max-num-batched-tokens >= {floor} (--max-num-seqs {max_num_seqs})"
        )
    now = f" (now {budget})" if budget is not None else " (not set: vLLM's default applies)"
    return (
        f"{said}; raise --max-num-batched-tokens to at least 2 x k x max_num_seqs = {floor}{now}, or lower "
        f"--max-num-seqs below {max_num_seqs}"
    )
