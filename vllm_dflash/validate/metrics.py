"""Speculative-decoding counters from a vLLM server's Prometheus `/metrics`, and the acceptance numbers they give.

The counters are cumulative since the server started, so a measurement is always the difference of two scrapes
taken around the prompt run: traffic before the run (warm-up, other users) does not count.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_dflash.errors import MeasurementError

# Prometheus family names as vLLM exports them (the text format adds `_total` to counter samples; the parser
# strips it again from the family name).
DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
SPEC_FAMILIES = (DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS)
# Prefix caching (prompt tokens looked up / found in the cache): a run that claims the condition must show hits.
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


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
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0

    def minus(self, before: SpecCounters) -> SpecCounters:
        """The counts added between `before` and this scrape."""
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


@dataclass(frozen=True)
class Acceptance:
    """What a counter delta says about the drafter."""

    mean_acceptance_length: float  # 1 + accepted / drafts: tokens emitted per target forward pass
    draft_acceptance_rate: float  # accepted / draft tokens
    per_position_rate: tuple[float, ...]  # accepted at position i / drafts, i = 0..k-1

    def as_dict(self) -> dict[str, object]:
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance_rate": list(self.per_position_rate),
        }


def parse_spec_counters(text: str) -> SpecCounters:
    """Parse Prometheus text exposition with prometheus_client's own parser and pick out the spec-decode counters."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    present = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MeasurementError(
            f"/metrics is not Prometheus text format: {exc}", "check that the URL is a vLLM server"
        ) from None
    for family in families:
        # vLLM declares its counters as `<name>_total` (the parser strips that suffix); a family declared without
        # TYPE keeps it. Either way the family is the same counter.
        name = family.name.removesuffix("_total")
        if name not in (*SPEC_FAMILIES, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS):
            continue
        present = present or name in SPEC_FAMILIES
        for sample in family.samples:
            # Counters also export `_created` timestamps; only the running total counts.
            if not sample.name.endswith("_total") and sample.name != family.name:
                continue
            if name == ACCEPTED_PER_POS:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    return SpecCounters(
        drafts=totals.get(DRAFTS, 0.0),
        draft_tokens=totals.get(DRAFT_TOKENS, 0.0),
        accepted=totals.get(ACCEPTED, 0.0),
        per_position=per_pos,
        generation_tokens=totals.get(GENERATION_TOKENS, 0.0),
        present=present,
        prefix_cache_queries=totals.get(PREFIX_QUERIES, 0.0),
        prefix_cache_hits=totals.get(PREFIX_HITS, 0.0),
    )


def scrape(base_url: str, timeout_s: float = 30.0) -> SpecCounters:
    """GET `{base_url}/metrics` and parse it."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MeasurementError(
            f"cannot read {url}: {reason}", "check that the server is up and exports /metrics"
        ) from None
    return parse_spec_counters(text)


def acceptance(delta: SpecCounters) -> Acceptance:
    """AL, draft acceptance rate and per-position rates of a counter delta; MeasurementError when nothing drafted."""
    if not delta.present:
        raise MeasurementError(
            "the server exports no spec_decode counters: it runs without speculative decoding",
            "serve with --speculative-config (validate sets it when it launches the server)",
        )
    if delta.drafts <= 0:
        raise MeasurementError(
            "the server drafted nothing during the run (0 drafts): acceptance cannot be measured",
            "check the speculative config and that the prompts produced output tokens",
        )
    k = max(delta.per_position) + 1 if delta.per_position else 0
    return Acceptance(
        mean_acceptance_length=1.0 + delta.accepted / delta.drafts,
        draft_acceptance_rate=delta.accepted / delta.draft_tokens if delta.draft_tokens > 0 else 0.0,
        per_position_rate=tuple(delta.per_position.get(p, 0.0) / delta.drafts for p in range(k)),
    )
