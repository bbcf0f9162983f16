"""The validation report: its schema, its seal, writing it and reading it back. This module owns the format.

`validate` writes one; `publish`, `release` and `verify` read it. A report carries a sha256 over its canonical
content (any edit made without re-sealing shows) and, with $VLLM_DFLASH_REPORT_KEY set, an HMAC-SHA256 that only
holders of the key can produce.
"""

from __future__ import annotations

import hashlib
import hmac
import json
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
    if key:
        mac = found.get("hmac_sha256")
        if not isinstance(mac, str):
            return f"it has no HMAC although {KEY_ENV} is set"
        if not hmac.compare_digest(mac, hmac.new(key, blob, hashlib.sha256).hexdigest()):
            return f"its HMAC does not verify with {KEY_ENV}"
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_strict(raw: bytes | str) -> Any:
    """JSON as RFC 8259 has it: NaN, Infinity and -Infinity (which Python's json accepts) are refused."""
    return json.loads(raw, parse_constant=_no_constant)


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
class Gate:
    gate: str
    passed: bool
    value: float | None
    threshold: float | None
    detail: str


@dataclass(frozen=True)
class ValidationReport:
    """A sealed report read back from disk, with typed access to what its readers decide on."""

    path: Path
    data: Mapping[str, Any]  # the document exactly as written (the seal covers it)
    raw: bytes = b""  # the bytes it was read from (what a release attaches: read once, checked, copied)

    @property
    def verdict(self) -> str:
        return str(self.data.get("verdict"))

    @property
    def error(self) -> str | None:
        err = self.data.get("error")
        return str(err) if err is not None else None

    @property
    def profile_name(self) -> str:
        return str((self.data.get("profile") or {}).get("name"))

    @property
    def profile_sha256(self) -> str | None:
        sha = (self.data.get("profile") or {}).get("sha256")
        return str(sha) if sha is not None else None

    @property
    def artifact(self) -> Mapping[str, Any]:
        return ((self.data.get("server") or {}).get("artifact")) or {}

    @property
    def artifact_sha256(self) -> str | None:
        sha = self.artifact.get("sha256")
        return str(sha) if sha is not None else None

    @property
    def artifact_name(self) -> str | None:
        name = self.artifact.get("name")
        return str(name) if name is not None else None

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

    @property
    def gates(self) -> tuple[Gate, ...]:
        out: list[Gate] = []
        for g in self.data.get("gates") or []:
            if isinstance(g, Mapping):
                out.append(
                    Gate(
                        gate=str(g.get("gate")),
                        passed=bool(g.get("passed")),
                        value=g.get("value") if isinstance(g.get("value"), int | float) else None,
                        threshold=g.get("threshold") if isinstance(g.get("threshold"), int | float) else None,
                        detail=str(g.get("detail", "")),
                    )
                )
        return tuple(out)

    @property
    def failed_gates(self) -> tuple[str, ...]:
        return tuple(g.gate for g in self.gates if not g.passed)

    def why_not_passed(self) -> str:
        failed = self.failed_gates
        return f"failed gates {list(failed)}" if failed else f"error: {self.error}"


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


def measurement_problem(data: Mapping[str, Any]) -> str | None:
    """None when a report's numbers are ones validate can have measured; else what is impossible about them.

    The same rules validate applies to /metrics (metrics.count_problem) run again on the counter delta the report
    carries, and its AL must be the one that delta gives: a report re-sealed after an edit (with a valid key, even)
    still cannot carry an impossible number. Reports that measured nothing (verdict error) carry no numbers.
    """
    from vllm_dflash.validate.metrics import count_problem

    if data.get("verdict") not in ("pass", "fail"):
        return None
    k = (data.get("profile") or {}).get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return "its profile states no num_speculative_tokens >= 1"
    delta = (data.get("counters") or {}).get("delta") if isinstance(data.get("counters"), Mapping) else None
    if not isinstance(delta, Mapping):
        return "it has no counter delta"
    raw_pos = delta.get("num_accepted_tokens_per_pos") or {}
    if not isinstance(raw_pos, Mapping) or not all(isinstance(p, str) and p.isascii() and p.isdigit() for p in raw_pos):
        return "its per-position counts are not keyed by draft position"
    per_pos = {int(p): v for p, v in raw_pos.items()}
    drafts, draft_tokens, accepted = (delta.get(n) for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    problem = count_problem(drafts, draft_tokens, accepted, per_pos, k)
    if problem is not None:
        return problem
    acc = data.get("acceptance")
    al = acc.get("mean_acceptance_length") if isinstance(acc, Mapping) else None
    assert isinstance(accepted, int | float) and isinstance(drafts, int | float)  # count_problem checked both
    want = 1.0 + accepted / drafts
    if not isinstance(al, int | float) or abs(al - want) > 1e-9 * want:
        return f"its AL {al!r} is not the {want:.6f} its counters give"
    for g in data.get("gates") or []:
        if isinstance(g, Mapping) and g.get("gate") == "min_acceptance_length" and g.get("value") != al:
            return f"its min_acceptance_length gate judged {g.get('value')!r}, not the AL {al!r}"
    return None
