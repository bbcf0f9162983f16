"""The validation report: its schema, its seal, writing it and reading it back. This module owns the format.

`validate` writes one; `publish`, `release` and `verify` read it. A report carries a sha256 over its canonical
content (any edit made without re-sealing shows) and, with $VLLM_DFLASH_REPORT_KEY set, an HMAC-SHA256 that only
holders of the key can produce. A seal says who wrote it, not that it is true: the rules on the numbers a report may
carry live here too (the counts a vLLM exports; validate applies them to /metrics and every reader again), and the
readers judge its verdict again from its counters (validate/verdict.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash.errors import DflashError
from vllm_dflash.paths import write_text_atomic

SCHEMA = "vllm-dflash.validation-report/1"
KEY_ENV = "VLLM_DFLASH_REPORT_KEY"  # optional HMAC key: reports become unforgeable without it


def canonical_json(data: Any) -> bytes:
    """The bytes a seal or a digest is computed over: sorted keys, no whitespace, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def key_from_env() -> bytes | None:
    value = os.environ.get(KEY_ENV)
    return value.encode() if value else None


def seal(body: Mapping[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """The report with a `seal` over its canonical body (sha256, plus an HMAC when a key is given)."""
    report = {k: v for k, v in body.items() if k != "seal"}
    blob = canonical_json(report)
    report["seal"] = {"sha256": hashlib.sha256(blob).hexdigest()}
    if key:
        report["seal"]["hmac_sha256"] = hmac.new(key, blob, hashlib.sha256).hexdigest()
    return report


def seal_problem(report: Mapping[str, Any], key: bytes | None = None) -> str | None:
    """None when the seal holds; otherwise what is wrong with it."""
    found = report.get("seal")
    if not isinstance(found, Mapping) or not isinstance(found.get("sha256"), str):
        return "it has no seal"
    blob = canonical_json({k: v for k, v in report.items() if k != "seal"})
    if not hmac.compare_digest(str(found["sha256"]), hashlib.sha256(blob).hexdigest()):
        return "its content does not match its seal (edited after validation)"
    if not key and "hmac_sha256" in found:
        return f"it is sealed with a key (HMAC) and {KEY_ENV} is not set: set the key it was sealed with"
    if key:
        mac = found.get("hmac_sha256")
        if not isinstance(mac, str):
            return f"it has no HMAC although {KEY_ENV} is set"
        if not hmac.compare_digest(mac, hmac.new(key, blob, hashlib.sha256).hexdigest()):
            return f"its HMAC does not verify with {KEY_ENV}"
    return None


def seal_kind(report: Mapping[str, Any]) -> str:
    """Which seal a verified report carries: `keyed` (an HMAC only key holders can make) or `keyless` (a sha256
    anyone can recompute: it catches accidents, an edited or truncated file, not a forgery)."""
    found = report.get("seal")
    return "keyed" if isinstance(found, Mapping) and "hmac_sha256" in found else "keyless"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r} in one object")
        out[key] = value
    return out


def loads_strict(raw: bytes | str) -> Any:
    """JSON as RFC 8259 has it: NaN, Infinity and -Infinity (which Python's json accepts) are refused, and so is an
    object naming a key twice anywhere in the document (Python keeps the last one silently, another reader the first:
    a `"verdict": "fail"` shadowed by a later `"pass"` must not read as a pass here)."""
    return json.loads(raw, parse_constant=_no_constant, object_pairs_hook=_unique_keys)


def write(report: Mapping[str, Any], path: Path, key: bytes | None = None) -> None:
    """Write a sealed report atomically, after checking that what is written is strict JSON and verifies."""
    try:
        text = json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise DflashError(f"report for {path} holds a number JSON cannot carry ({exc})", "report this") from None
    problem = seal_problem(loads_strict(text), key)
    if problem is not None:
        raise DflashError(f"report for {path} does not verify before writing: {problem}", "report this")
    write_text_atomic(path, text)


@dataclass(frozen=True)
class ValidationReport:
    """A sealed report read back from disk, with typed access to what its readers decide on."""

    path: Path
    data: Mapping[str, Any]  # the document exactly as written (the seal covers it)
    raw: bytes = b""  # the bytes it was read from (what a release attaches: read once, checked, copied)

    @property
    def profile_name(self) -> str:
        return str((self.data.get("profile") or {}).get("name"))

    @property
    def artifact(self) -> Mapping[str, Any]:
        return ((self.data.get("server") or {}).get("artifact")) or {}

    @property
    def artifact_sha256(self) -> str | None:
        sha = self.artifact.get("sha256")
        return str(sha) if sha is not None else None

    @property
    def acceptance_length(self) -> float | None:
        al = (self.data.get("acceptance") or {}).get("mean_acceptance_length")
        return float(al) if isinstance(al, int | float) else None

    @property
    def binding(self) -> str:
        return str(self.artifact.get("binding") or "none")

    @property
    def prompts(self) -> Mapping[str, Any]:
        found = self.data.get("prompts")
        return found if isinstance(found, Mapping) else {}

    @property
    def exploratory(self) -> str | None:
        why = self.data.get("exploratory")
        return str(why) if why else None


REPORT_LIMIT = 64 << 20  # a report of thousands of prompts is a few MB


def load(path: Path, key: bytes | None, error: type[DflashError], hint: str = "") -> ValidationReport:
    """Read a report and check its schema and seal; any problem is one `error` line (never another exception)."""
    from vllm_dflash.paths import read_bounded

    try:
        raw = read_bounded(path, REPORT_LIMIT, "report", error, hint)
        data = loads_strict(raw)
    except OSError as exc:
        raise error(f"cannot read report {path}: {exc.strerror or exc}", hint) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise error(f"report {path} is not strict JSON: {exc}", hint) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise error(f"{path} is not a vllm-dflash validation report", hint)
    problem = seal_problem(data, key)
    if problem is not None:
        raise error(f"report {path} is not trustworthy: {problem}", hint)
    for section in ("profile", "server"):
        if not isinstance(data.get(section), Mapping):
            raise error(f"report {path} lacks its '{section}' section", hint)
    gates = data.get("gates")
    if not isinstance(gates, Sequence) or isinstance(gates, str):
        raise error(f"report {path} has no list of gates", hint)
    problem = measurement_problem(data)
    if problem is not None:
        raise error(f"report {path} carries numbers no measurement can give: {problem}", hint)
    return ValidationReport(path=path, data=data, raw=raw)


# ---------------------------------------------------------------------------------------------------------------
# The numbers a report may carry. Validate applies these rules to the /metrics it scrapes (validate/metrics.py) and
# every reader (publish, release, verify) applies them again to the counters the report carries: one set of rules,
# stated here, where the document that carries the numbers is owned.

# The counters of one scrape as a report writes them (metrics.SpecCounters.as_dict), the per-position family apart.
COUNTER_NAMES = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
PER_POSITION = "num_accepted_tokens_per_pos"
# vLLM counts with Prometheus counters, i.e. floats: whole numbers are exact up to 2^53, and no run comes near it.
MAX_COUNT = 2**53
# A draft position is below k (vLLM's k is a few dozen at most); a longer label is no position (and a 5000-digit one
# must not reach int(), which refuses more than 4300 digits with an exception of its own).
MAX_POSITION_DIGITS = 6
# Methods whose vLLM exports the per-position family on every server (the DFlash proposer always drafts k tokens).
PER_POSITION_METHODS = ("dflash",)
# vLLM's num_speculative_tokens is a few dozen at most; a larger k is no profile (and k = 10^12 must not reach a
# per-position list of k entries).
MAX_K = 1024
# A run's wall time: a day is far beyond any validation run, 2^70 s is no clock reading.
MAX_WALL_S = 86400.0


def count_value_problem(name: str, value: Any) -> str | None:
    """None when `value` is a count as vLLM exports one: a whole number >= 0 (an integral float like 40.0 is one,
    40.5 or 1e-8 is not); else what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return f"{name} = {value!r} is not a finite count >= 0"
    if value > MAX_COUNT:
        return f"{name} = {value!r} is above 2^53, beyond what a counter holds exactly"
    if isinstance(value, float) and not value.is_integer():
        return f"{name} = {value!r} is not a whole number (vLLM counts drafts and tokens)"
    return None


def position_of(label: Any) -> int | None:
    """The draft position a per-position label names when it is written as vLLM writes one (`str(int)`: ASCII
    digits, no sign, no zero padding, at most MAX_POSITION_DIGITS of them); else None."""
    if not isinstance(label, str) or len(label) > MAX_POSITION_DIGITS:
        return None
    if not (label.isascii() and label.isdigit()) or (label != "0" and label.startswith("0")):  # "" is no digit
        return None
    return int(label)


def per_position_required(method: str | None) -> bool:
    return method in PER_POSITION_METHODS


def count_problem(
    drafts: Any,
    draft_tokens: Any,
    accepted: Any,
    per_position: Mapping[int, Any],
    k: int,
    require_per_position: bool = False,
) -> str | None:
    """None when a delta of counts is one a vLLM drafting up to `k` tokens per draft can produce; else what is
    impossible about it. Drafted nothing is a problem too: there is nothing to measure. Counts are whole numbers, so
    every comparison is exact (no tolerance: a count below one is no count at all)."""
    named = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted}
    named.update({f"num_accepted_tokens_per_pos[{p}]": v for p, v in per_position.items()})
    for name, value in named.items():
        problem = count_value_problem(name, value)
        if problem is not None:
            return problem
    if drafts == 0:
        return "the server drafted nothing during the run (0 drafts): acceptance cannot be measured"
    if accepted > draft_tokens:
        return f"{accepted:g} accepted tokens exceed the {draft_tokens:g} draft tokens"
    if draft_tokens > drafts * k:
        return f"{draft_tokens:g} draft tokens exceed {drafts:g} drafts x k = {k} (AL can never exceed k + 1)"
    if require_per_position and not per_position:
        return (
            "there are no per-position counts (vllm:spec_decode_num_accepted_tokens_per_pos), which vLLM exports "
            "for every DFlash server"
        )
    if per_position:
        outside = [p for p in per_position if not 0 <= p < k]
        if outside:
            return f"accepted tokens at draft position {max(outside)}, outside 0..{k - 1} (k = {k})"
        ordered = [per_position.get(p, 0) for p in range(k)]
        for p, count in enumerate(ordered):
            if count > drafts:
                return f"{count:g} tokens accepted at position {p}, more than the {drafts:g} drafts"
            if p and count > ordered[p - 1]:
                return (
                    f"more tokens accepted at position {p} ({count:g}) than at position {p - 1} "
                    f"({ordered[p - 1]:g}): a draft is accepted up to its first rejected token"
                )
        if sum(ordered) != accepted:
            return f"the per-position counts sum to {sum(ordered):g}, not the {accepted:g} accepted tokens"
    return None


@dataclass(frozen=True)
class Counts:
    """One counter set of a report (`counters.before`, `.after` or `.delta`), checked: every value a count."""

    values: Mapping[str, float]  # COUNTER_NAMES
    per_position: Mapping[int, float]


def read_counts(found: Any, where: str) -> Counts | str:
    """The counter set `found` (as a report writes it), or what is wrong with it (a string)."""
    if not isinstance(found, Mapping):
        return f"it has no {where} counters"
    names = {*COUNTER_NAMES, PER_POSITION}
    if set(found) != names:
        extra, missing = sorted(set(found) - names), sorted(names - set(found))
        return f"its {where} counters have fields {extra} no scrape gives and lack {missing}"
    for name in COUNTER_NAMES:
        problem = count_value_problem(f"{where}.{name}", found[name])
        if problem is not None:
            return problem
    raw = found[PER_POSITION]
    if not isinstance(raw, Mapping):
        return f"its {where}.{PER_POSITION} is not keyed by draft position"
    per_pos: dict[int, float] = {}
    for label, value in raw.items():
        pos = position_of(label)
        if pos is None:
            return f"its {where}.{PER_POSITION} has label {str(label)[:20]!r}, not a draft position as vLLM writes one"
        problem = count_value_problem(f"{where}.{PER_POSITION}[{label}]", value)
        if problem is not None:
            return problem
        per_pos[pos] = float(value)
    return Counts({n: float(found[n]) for n in COUNTER_NAMES}, per_pos)


_DOWN = "relation before <= after broken: its counter"
_DELTA = "relation delta = after - before broken: its delta"


def delta_problem(before: Counts, after: Counts, delta: Counts) -> str | None:
    """None when `delta` is exactly `after - before`, field by field (no counter went down)."""
    for name in COUNTER_NAMES:
        b, a, d = before.values[name], after.values[name], delta.values[name]
        if a < b:
            return f"{_DOWN} {name} went down from {b:g} to {a:g} during the run"
        if a - b != d:
            return f"{_DELTA} {name} = {d:g} is not after - before = {a:g} - {b:g}"
    positions = set(before.per_position) | set(after.per_position)
    if set(delta.per_position) != positions:
        return f"its delta has draft positions {sorted(delta.per_position)}, its scrapes {sorted(positions)}"
    for p in sorted(positions):
        b, a = before.per_position.get(p, 0.0), after.per_position.get(p, 0.0)
        if a < b:
            return f"{_DOWN} {PER_POSITION}[{p}] went down from {b:g} to {a:g} during the run"
        if a - b != delta.per_position[p]:
            return f"{_DELTA} {PER_POSITION}[{p}] = {delta.per_position[p]:g} is not after - before = {a:g} - {b:g}"
    return None


def measured_counts(data: Mapping[str, Any], k: int, method: str | None) -> Counts | str:
    """The counter delta of a report that measured something (verdict pass or fail), checked against its scrapes and
    against what a vLLM drafting `k` tokens (with `method`) can produce; or what is wrong with it (a string)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return "its profile states no num_speculative_tokens >= 1"
    if k > MAX_K:
        return f"its num_speculative_tokens {str(k)[:20]} is above {MAX_K}, no vLLM drafts that many"
    counters = data.get("counters")
    if not isinstance(counters, Mapping):
        return "it has no counters"
    sets: dict[str, Counts] = {}
    for where in ("before", "after", "delta"):
        got = read_counts(counters.get(where), where)
        if isinstance(got, str):
            return got
        sets[where] = got
    problem = delta_problem(sets["before"], sets["after"], sets["delta"])
    if problem is not None:
        return problem
    d = sets["delta"]
    problem = count_problem(
        d.values["num_drafts"],
        d.values["num_draft_tokens"],
        d.values["num_accepted_tokens"],
        d.per_position,
        k,
        per_position_required(method),
    )
    if problem is None:
        problem = system_problem(d, k, requests(data))
    return problem if problem is not None else d


def requests(data: Mapping[str, Any]) -> int | None:
    """How many requests the run sent (its prompt count), when the report states it as a whole number >= 1."""
    found = data.get("prompts")
    count = found.get("count") if isinstance(found, Mapping) else None
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_COUNT:
        return None
    return count


def system_problem(d: Counts, k: int, sent: int | None) -> str | None:
    """None when the counters of one delta agree with each other (count_problem checks the drafting family); else
    the relation they break.

    accepted <= generated does not hold exactly in vLLM: the scheduler counts every accepted draft token, and the
    output processor then cuts a request at max_tokens or a stop string, so a request's last step may count up to k
    accepted tokens that are never generated (that step keeps at least one token). What vLLM guarantees is
    accepted <= generated + k x requests, and that is the rule here."""
    v = d.values
    accepted, generated = v["num_accepted_tokens"], v["generation_tokens"]
    # A report stating no request count gets no allowance for truncated steps: accepted <= generated, exactly.
    if accepted > generated + k * (sent or 0):
        return (
            f"relation accepted <= generated + k x requests broken: {accepted:g} accepted tokens, "
            f"{generated:g} generated, k = {k}, {sent or 0} requests"
        )
    if v["prefix_cache_hits"] > v["prefix_cache_queries"]:
        return (
            f"relation prefix hits <= queries broken: {v['prefix_cache_hits']:g} prefix-cache hits, "
            f"{v['prefix_cache_queries']:g} queries"
        )
    return None


def field_problem(data: Mapping[str, Any]) -> str | None:
    """None when the report's non-counter numbers are typed and bounded (its timings and the throughput of its run)."""
    timings = data.get("timings")
    if timings is not None:
        if not isinstance(timings, Mapping):
            return "its timings are not an object"
        for name, secs in timings.items():
            if isinstance(secs, bool) or not isinstance(secs, int | float) or not 0 <= secs <= MAX_WALL_S:
                return f"timings.{str(name)[:40]} = {str(secs)[:24]} is not a duration in 0..{MAX_WALL_S:g} s"
    found = data.get("throughput")
    if found is None:
        return None
    if not isinstance(found, Mapping):
        return "its throughput is not an object"
    out = found.get("output_tokens")
    problem = count_value_problem("throughput.output_tokens", out)
    if problem is not None:
        return problem
    if isinstance(out, float):
        return f"throughput.output_tokens = {out!r} is not an integer"
    wall = found.get("wall_s")
    if isinstance(wall, bool) or not isinstance(wall, int | float) or not 0 <= wall <= MAX_WALL_S:
        return f"throughput.wall_s = {str(wall)[:24]} is not a duration in 0..{MAX_WALL_S:g} s"
    tps = found.get("tokens_per_s")
    if isinstance(tps, bool) or not isinstance(tps, int | float) or not math.isfinite(tps) or tps < 0:
        return f"throughput.tokens_per_s = {str(tps)[:24]} is not a finite rate >= 0"
    return None


def measurement_problem(data: Mapping[str, Any], k: Any = None, method: Any = None) -> str | None:
    """None when a report's numbers are ones validate can have measured; else what is impossible about them.

    `k` and `method` default to what the report's own profile states (a reader passes the manifest's). The counter
    delta must be after - before and obey count_problem, and the AL must be the one it gives, exactly: a report
    re-sealed after an edit (with a valid key, even) still cannot carry an impossible number. Reports that measured
    nothing (verdict error) carry no numbers.
    """
    if data.get("verdict") not in ("pass", "fail"):
        return None
    problem = field_problem(data)
    if problem is not None:
        return problem
    found = data.get("profile")
    profile: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    k = profile.get("num_speculative_tokens") if k is None else k
    method = profile.get("method") if method is None else method
    got = measured_counts(data, k, method)
    if isinstance(got, str):
        return got
    acc = data.get("acceptance")
    al = acc.get("mean_acceptance_length") if isinstance(acc, Mapping) else None
    want = 1.0 + got.values["num_accepted_tokens"] / got.values["num_drafts"]
    if isinstance(al, bool) or not isinstance(al, int | float) or al != want:
        return f"its AL {al!r} is not the {want:.6f} its counters give"
    for g in data.get("gates") or []:
        if isinstance(g, Mapping) and g.get("gate") == "min_acceptance_length" and g.get("value") != al:
            return f"its min_acceptance_length gate judged {g.get('value')!r}, not the AL {al!r}"
    return replicas_problem(data, got)


def replicas_problem(data: Mapping[str, Any], delta: Counts) -> str | None:
    """None when a report measured behind a router carries its replicas' own counter deltas and they add up to its
    delta, counter by counter and position by position (or it names no replicas); else what does not add up."""
    rows = data.get("replicas")
    if rows is None:
        return None
    if not isinstance(rows, Sequence) or isinstance(rows, str) or not rows:
        return "its replicas are not a list of the replicas' counters"
    sums = dict.fromkeys(COUNTER_NAMES, 0.0)
    per_pos: dict[int, float] = {}
    for i, row in enumerate(rows):
        got = read_counts(row.get("counters") if isinstance(row, Mapping) else None, f"replicas[{i}]")
        if isinstance(got, str):
            return got
        for name in COUNTER_NAMES:
            sums[name] += got.values[name]
        for pos, value in got.per_position.items():
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    for name in COUNTER_NAMES:
        if sums[name] != delta.values[name]:
            return f"its replicas' {name} add up to {sums[name]:g}, its delta says {delta.values[name]:g}"
    for pos in sorted(set(per_pos) | set(delta.per_position)):
        if per_pos.get(pos, 0.0) != delta.per_position.get(pos, 0.0):
            return f"its replicas' {PER_POSITION}[{pos}] do not add up to its delta's"
    return None
