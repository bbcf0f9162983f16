"""Counter parsing and the acceptance arithmetic (the live-server check is in test_validate.py)."""

from __future__ import annotations

import pytest

from vllm_dflash.errors import MeasurementError
from vllm_dflash.validate import metrics
from vllm_dflash.validate.metrics import acceptance, parse_spec_counters

# Two engines (data parallel) as vLLM writes them: `_total` samples plus `_created` timestamps.
TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 11.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 33.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 17.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="2"} 1.7e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 99.0
"""


def test_parse_sums_engines_and_ignores_created() -> None:
    c = parse_spec_counters(TEXT)
    assert c.present
    assert (c.drafts, c.draft_tokens, c.accepted, c.generation_tokens) == (21.0, 63.0, 37.0, 99.0)
    assert dict(c.per_position) == {0: 18.0, 1: 12.0, 2: 7.0}


def test_acceptance_of_a_delta() -> None:
    before = parse_spec_counters(TEXT)

    def bump(text: str, family: str, old: str, new: str) -> str:
        line = f'{family}{{engine="0",model_name="m"}} '
        assert line + old in text
        return text.replace(line + old, line + new)

    after_text = bump(TEXT, "vllm:spec_decode_num_drafts_total", "10.0", "30.0")  # +20 drafts
    after_text = bump(after_text, "vllm:spec_decode_num_draft_tokens_total", "30.0", "90.0")  # +60 = 20 x 3
    after_text = bump(after_text, "vllm:spec_decode_num_accepted_tokens_total", "20.0", "50.0")  # +30
    for pos, (old, new) in enumerate((("9.0", "24.0"), ("7.0", "17.0"), ("4.0", "9.0"))):  # +15, +10, +5
        line = f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{pos}"}} '
        after_text = after_text.replace(line + old, line + new)
    delta = parse_spec_counters(after_text).minus(before)
    assert delta.drafts == 20.0 and delta.accepted == 30.0 and dict(delta.per_position) == {0: 15, 1: 10, 2: 5}
    acc = acceptance(delta, 3)
    assert acc.mean_acceptance_length == pytest.approx(2.5) and acc.mean_draft_tokens == 3.0


def test_acceptance_numbers() -> None:
    acc = acceptance(parse_spec_counters(TEXT), 3)
    assert acc.mean_acceptance_length == pytest.approx(1 + 37 / 21)
    assert acc.draft_acceptance_rate == pytest.approx(37 / 63)
    assert acc.per_position_rate == pytest.approx((18 / 21, 12 / 21, 7 / 21))


def test_no_spec_families_cannot_be_measured() -> None:
    text = '# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{engine="0"} 5.0\n'
    c = parse_spec_counters(text)
    assert not c.present
    with pytest.raises(MeasurementError, match="without speculative decoding"):
        acceptance(c.minus(c), 3)


def test_zero_drafts_cannot_be_measured() -> None:
    c = parse_spec_counters(TEXT)
    with pytest.raises(MeasurementError, match="0 drafts"):
        acceptance(c.minus(c), 3)


def test_garbage_is_rejected() -> None:
    with pytest.raises(MeasurementError, match="not Prometheus text"):
        parse_spec_counters("<html>not metrics</html>{{{")


def test_cut_drafts_line_says_what_to_raise() -> None:
    from vllm_dflash.validate.metrics import Acceptance, cut_drafts_line

    cut = Acceptance(2.0, 0.5, (), mean_draft_tokens=4.2, num_speculative_tokens=7)
    assert cut_drafts_line(cut, 8, 32) == (
        "vLLM cut the drafts: 4.20 of k = 7 draft tokens per draft on average; raise --max-num-batched-tokens to at "
        "least 2 x k x max_num_seqs = 112 (now 32), or lower --max-num-seqs below 8"
    )
    assert "(not set: vLLM's default applies)" in (cut_drafts_line(cut, 8, None) or "")
    assert "14 per sequence, 14336 for vLLM's default" in (cut_drafts_line(cut, None, 32) or "")
    assert "runs with other settings" in (cut_drafts_line(cut, 8, 112) or "")
    full = Acceptance(2.0, 0.5, (), mean_draft_tokens=7.0, num_speculative_tokens=7)
    assert cut_drafts_line(full, 8, 32) is None  # negative control: all k drafted, nothing to say
    assert cut_drafts_line(Acceptance(2.0, 0.5, (), mean_draft_tokens=0.0, num_speculative_tokens=0), 8, 32) is None


def test_a_quoted_sample_is_bounded_at_exactly_its_limits() -> None:
    """A malformed sample is quoted with each label value cut at 40 characters and the line at 300, no sooner."""
    from prometheus_client.samples import Sample

    from vllm_dflash.validate.metrics import _sample_line

    for value, quoted in (("v" * 40, "v" * 40), ("v" * 41, "v" * 40 + "...")):
        assert _sample_line(Sample("vllm:x_total", {"a": value}, -1.0)) == f'vllm:x_total{{a="{quoted}"}} -1.0'
    # `NAME{} 1.0`: the name's length sets the line's; 300 characters stay whole, 301 are cut to 297 and "...".
    whole = _sample_line(Sample("n" * 294, {}, 1.0))
    assert whole == "n" * 294 + "{} 1.0" and len(whole) == 300
    cut = _sample_line(Sample("n" * 295, {}, 1.0))
    assert cut == "n" * 295 + "{}..." and len(cut) == 300


def test_only_a_counters_running_total_is_counted() -> None:
    """A spec family declared as a histogram (its `_bucket`, `_count`, `_sum` samples) carries no running total: none
    of its samples is summed into the counter, so the server drafted nothing."""
    text = (
        "# TYPE vllm:spec_decode_num_drafts histogram\n"
        'vllm:spec_decode_num_drafts_bucket{le="+Inf"} 4.0\nvllm:spec_decode_num_drafts_count 4.0\n'
        "vllm:spec_decode_num_drafts_sum 9.0\n"
    )
    c = parse_spec_counters(text)
    assert c.present and c.drafts == 0.0
    # An untyped family keeps its sample's own name, `_total` or not: that sample is the total.
    untyped = parse_spec_counters("vllm:spec_decode_num_drafts 5\nvllm:spec_decode_num_draft_tokens_total 7\n")
    assert (untyped.drafts, untyped.draft_tokens) == (5.0, 7.0)


def test_a_sample_no_count_quotes_the_reports_rule() -> None:
    for value, words in (("-0.5", "is not a finite count >= 0"), ("0.5", "is not a whole number"), ("NaN", "finite")):
        with pytest.raises(MeasurementError) as got:
            parse_spec_counters(f"vllm:spec_decode_num_drafts_total {value}\n")
        assert got.value.message.startswith("malformed metrics: counter sample `vllm:spec_decode_num_drafts_total")
        assert words in got.value.message, got.value.message


def test_nothing_drafted_and_impossible_counts_say_different_things() -> None:
    """0 drafts is a run that measured nothing (check the config); counts no vLLM gives are malformed metrics."""
    nothing = parse_spec_counters("vllm:spec_decode_num_drafts_total 0\n")
    with pytest.raises(MeasurementError) as got:
        acceptance(nothing, 3, "ngram")
    assert got.value.message.startswith("the server drafted nothing") and "speculative config" in got.value.hint
    one = parse_spec_counters("vllm:spec_decode_num_drafts_total 1\nvllm:spec_decode_num_draft_tokens_total 4\n")
    with pytest.raises(MeasurementError) as got:
        acceptance(one, 3, "ngram")
    assert got.value.message.startswith("impossible /metrics counts: 4 draft tokens exceed 1 drafts x k = 3")
    assert "speculative config" not in got.value.hint


def test_the_draft_acceptance_rate_of_few_draft_tokens() -> None:
    def counts(tokens: int, accepted: int) -> str:
        return (
            "vllm:spec_decode_num_drafts_total 1\n"
            f"vllm:spec_decode_num_draft_tokens_total {tokens}\nvllm:spec_decode_num_accepted_tokens_total {accepted}\n"
        )

    assert acceptance(parse_spec_counters(counts(0, 0)), 3, "ngram").draft_acceptance_rate == 0.0  # no 0 / 0
    assert acceptance(parse_spec_counters(counts(1, 1)), 3, "ngram").draft_acceptance_rate == 1.0
    assert acceptance(parse_spec_counters(counts(2, 1)), 3, "ngram").draft_acceptance_rate == 0.5


def test_replicas_counters_add_up_position_by_position() -> None:
    """Replicas behind a router: their counters added up, and their finished requests must be the run's requests."""
    one = metrics.SpecCounters(drafts=2, draft_tokens=6, accepted=3, per_position={0: 2, 1: 1}, present=True,
                               finished_requests=1)  # fmt: skip
    two = metrics.SpecCounters(drafts=4, draft_tokens=12, accepted=2, per_position={0: 2, 2: 0}, present=True,
                               finished_requests=2)  # fmt: skip
    total = metrics.total([one, two])
    assert (total.drafts, total.draft_tokens, total.accepted) == (6, 18, 5)
    assert total.per_position == {0: 4, 1: 1, 2: 0} and total.finished_requests == 3
    assert parse_spec_counters("").finished_requests is None
    assert metrics.accounting_problem([one, two], 3, ["u1", "u2"]) is None
    assert "missing" in str(metrics.accounting_problem([one, two], 4, ["u1", "u2"]))
    assert "named twice" in str(metrics.accounting_problem([one, two], 2, ["u1", "u2"]))
    no_count = metrics.SpecCounters(present=True)
    assert "u2 export no vllm:request_success" in str(metrics.accounting_problem([one, no_count], 1, ["u1", "u2"]))


def test_one_servers_metrics_that_miss_requests() -> None:
    """A router's /metrics is one replica's: fewer finished requests than the run sent is refused, all is fine, and
    a server that exports no count cannot be told."""
    seen = metrics.SpecCounters(present=True, finished_requests=3)
    assert "counts 3 finished requests of the 6" in str(metrics.hidden_servers_problem(seen, 6, "http://r"))
    assert metrics.hidden_servers_problem(seen, 3, "http://r") is None
    assert metrics.hidden_servers_problem(metrics.SpecCounters(present=True), 6, "http://r") is None


def test_scrapes_answered_by_two_servers_are_no_delta() -> None:
    """A load balancer in front of /metrics (vllm-router answers it from one replica, then another): the two scrapes'
    process start times differ, and their difference is no server's drafts."""
    body = "# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total 5.0\n"
    a, b = (parse_spec_counters(f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {s}\n{body}")
            for s in ("1765000000.25", "1765000001.5"))  # fmt: skip
    assert (a.started, b.started) == (1765000000.25, 1765000001.5)
    assert a.minus(a).drafts == 0
    with pytest.raises(MeasurementError, match="answered by different server processes"):
        b.minus(a)
    assert parse_spec_counters(body).minus(a).drafts == 0  # a server that exports no start time: nothing to tell
