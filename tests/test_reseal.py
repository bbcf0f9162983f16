"""A verdict is computed, never read (issue 26): reports re-sealed by an attacker with our own seal, through the CLI.

Every report here starts as a real one: `validate --endpoint` against test_gate's fake OpenAI server (the test is
about how we treat what a report says, so its numbers come from a server that says what the test wants). Each
attack is then re-sealed with report.seal -- what anyone who can run our code can do without the HMAC key -- and
offered to `publish`, `release` and `verify`. Each is refused with one line naming what the evidence gives, the
index (hashed as a whole tree) and the release directory byte-identical; the genuine report, offered the same way,
is accepted (the negative control of every case).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import checkout_requiring
from test_gate import _isolated, cli, error_lines, fake, make_vllm_wheel, metrics, pos, tree_hash

from vllm_dflash import report as reports
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import load_manifest
from vllm_dflash.validate.gates import condition_gates, judge
from vllm_dflash.validate.metrics import Acceptance, SpecCounters

__all__ = ["_isolated", "fake"]  # test_gate's fixtures, used here

K = 15  # as the publishable Qwen3.6 profile drafts
PROFILE = "reseal-k15"
TABLE: dict[str, Any] = {
    "target": "tiny",
    "drafter": "tiny-drafter",
    "method": "dflash",
    "num_speculative_tokens": K,
    "thinking": False,
    "prompts": "chat",
    "max_tokens": 16,
    "concurrency": 4,
    "serve_args": ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"],
    "min_acceptance_length": 2.0,
}
PASS_POS = (60, 40, 20, 10, 10, 5, 5) + (0,) * 8  # 150 accepted over 100 drafts: AL 2.5
FAIL_POS = (30, 15, 5) + (0,) * 12  # 50 accepted: AL 1.5, below the 2.0 gate
ZERO15 = metrics(0, 0, 0, pos(*(0,) * K))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return checkout_requiring(tmp_path / "checkout", {PROFILE: TABLE})


def served(drafts: Any, draft_tokens: Any, accepted: Any, per_pos: tuple[Any, ...]) -> str:
    return metrics(drafts, draft_tokens, accepted, pos(*per_pos))


@pytest.fixture
def made(fake: Any, root: Path, tmp_path: Path) -> Callable[[str], tuple[Path, Path]]:
    """`made("pass" | "fail")`: (wheel, report) from a real `validate --endpoint --wheel` run on the fake server."""
    url, state = fake
    wheel = make_vllm_wheel(tmp_path / "dist")

    def run(outcome: str) -> tuple[Path, Path]:
        passing = outcome == "pass"
        state.before, state.scrapes, state.version = ZERO15, 0, "0.20.1+dflash.1"
        state.after = served(100, 100 * K, 150 if passing else 50, PASS_POS if passing else FAIL_POS)
        report = tmp_path / f"{outcome}.json"
        done = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--wheel", wheel, "--report", report,
                   "--quiet")  # fmt: skip
        assert done.returncode == (0 if passing else 1), done.stdout + done.stderr  # AL 2.5 passes, 1.5 fails
        return wheel, report

    return run


def _url(fake: Any) -> str:
    return str(fake[0])


def reseal(report: Path, edit: Callable[[dict[str, Any]], None], out: Path) -> Path:
    """`report` edited, then sealed again with our own seal (as anyone can without the HMAC key)."""
    data = reports.loads_strict(report.read_bytes())
    del data["seal"]
    edit(data)
    reports.write(reports.seal(data), out)
    assert (
        reports.seal_problem(reports.loads_strict(out.read_bytes())) is None
    )  # the seal holds: only evidence can tell
    return out


def consistent(root: Path, data: dict[str, Any], after: dict[str, Any], k: int | None = None) -> None:
    """What a careful attacker writes: counters, acceptance, gates and verdict all recomputed with our own code for
    the forged `after` scrape (before: zero), so nothing but the rules on the counts themselves can refuse it."""
    profile = load_manifest(root).profiles[PROFILE]
    k = k or profile.num_speculative_tokens
    zero: dict[str, Any] = {name: 0.0 for name in reports.COUNTER_NAMES} | {reports.PER_POSITION: {}}
    # Every drafting step generates its accepted tokens and one more (a forgery that knows the relations keeps them).
    generated = {"generation_tokens": after.get("num_accepted_tokens", 0.0) + after.get("num_drafts", 0.0)}
    full = {**zero, **generated, **after}
    data["counters"] = {"before": zero, "after": full, "delta": full}
    d, t, a = full["num_drafts"], full["num_draft_tokens"], full["num_accepted_tokens"]
    per = {int(p): v for p, v in full[reports.PER_POSITION].items()}
    acc = Acceptance(1 + a / d, a / t, tuple(per.get(p, 0.0) / d for p in range(k)), t / d, k)
    data["acceptance"] = acc.as_dict()
    delta = SpecCounters(drafts=d, draft_tokens=t, accepted=a, per_position=per, present=True)
    gates = [*judge(profile, acc, None), *condition_gates(profile, delta, None)]
    data["gates"] = [g.as_dict() for g in gates]
    data["verdict"] = "pass" if all(g.passed for g in gates) else "fail"
    assert data["verdict"] == "pass"  # the forgery claims a pass by the gates' own arithmetic


def flip(data: dict[str, Any]) -> None:
    """The failed AL 1.5 report claimed passed: verdict and gate flag (the numbers left as measured)."""
    data["verdict"] = "pass"
    for g in data["gates"]:
        g["passed"] = True


def flip_verdict_only(data: dict[str, Any]) -> None:
    data["verdict"] = "pass"


def scrape(
    drafts: float, draft_tokens: float, accepted: float, per_pos: dict[str, float] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted}
    if per_pos is not None:
        out[reports.PER_POSITION] = per_pos
    return out


def k_50(root: Path, d: dict[str, Any]) -> None:
    """AL 51 under a profile body that says k = 50 (its digest left as the manifest's)."""
    consistent(root, d, scrape(100.0, 5000.0, 5000.0, {str(p): 100.0 for p in range(50)}), k=50)
    d["profile"].update(num_speculative_tokens=50)


ATTACKS: dict[str, tuple[str, Callable[[Path, dict[str, Any]], None], str]] = {
    # name -> (which report it starts from, the edit, words of the refusal)
    "flipped-verdict-al-1.5": ("fail", lambda r, d: flip(d), "its gate min_acceptance_length says"),
    "flipped-verdict-only": ("fail", lambda r, d: flip_verdict_only(d), "its verdict 'pass' is not the 'fail'"),
    "al-51-k-15-sub-epsilon": (
        "pass",
        lambda r, d: consistent(r, d, scrape(1e-8, 1.5e-7, 5e-7, {"0": 1e-8, "1": 1e-8, "2": 4.8e-7})),
        "1e-08 is not a whole number",
    ),
    "al-51-profile-says-k-50": ("pass", k_50, "its field 'num_speculative_tokens' is 50, dist.toml's 15"),
    "al-51-whole-counts": (
        "pass",
        lambda r, d: consistent(r, d, scrape(100.0, 5000.0, 5000.0, {"0": 100.0})),
        "5000 draft tokens exceed 100 drafts x k = 15",
    ),
    "fractional-counts": (
        "pass",
        lambda r, d: consistent(r, d, scrape(100.0, 1500.0, 150.5, {"0": 100.0, "1": 50.5})),
        "150.5 is not a whole number",
    ),
    "zero-padded-label": (
        "pass",
        lambda r, d: consistent(r, d, scrape(100.0, 1500.0, 150.0, {"00": 100.0, "1": 50.0})),
        "has label '00', not a draft position",
    ),
    "no-per-position-family": (
        "pass",
        lambda r, d: consistent(r, d, scrape(100.0, 1500.0, 150.0)),
        "no per-position counts",
    ),
    "delta-is-not-after-minus-before": (
        "pass",
        lambda r, d: d["counters"]["after"].update(num_drafts=d["counters"]["after"]["num_drafts"] + 7),
        "its delta num_drafts = 100 is not after - before = 107 - 0",
    ),
}


def duplicate_verdict(report: Path, out: Path) -> Path:
    """The genuine passing report's bytes with a first `"verdict": "fail"` key in front (its seal is still right for
    the last value, which Python's json keeps)."""
    text = report.read_text()
    assert text.startswith("{\n")
    out.write_text('{\n  "verdict": "fail",\n' + text[2:])
    return out


def forged(name: str, made: Callable[[str], tuple[Path, Path]], root: Path, tmp_path: Path) -> tuple[Path, Path]:
    start, edit, _ = ATTACKS[name]
    wheel, report = made(start)
    return wheel, reseal(report, lambda d: edit(root, d), tmp_path / f"{name}.json")


def refused(root: Path, code: int, words: str, *args: str | Path) -> None:
    run = cli(root, *args)
    lines = error_lines(run)
    assert run.returncode == code and len(lines) == 1 and words in lines[0], (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_resealed_report_is_refused_by_publish(
    name: str, made: Callable[[str], tuple[Path, Path]], root: Path, tmp_path: Path
) -> None:
    wheel, report = made("pass")
    index = tmp_path / "index"
    first = cli(root, "publish", wheel, "--report", report, "--to", index, "--accept-declared-binding")
    assert first.returncode == 0, first.stderr  # the genuine report publishes (and the index is not empty)
    _, bad = forged(name, made, root, tmp_path)
    before = tree_hash(index)
    refused(root, 12, ATTACKS[name][2], "publish", wheel, "--report", bad, "--to", index, "--accept-declared-binding")
    assert tree_hash(index) == before, "a refused publish changed the index"


def test_duplicate_keys_are_refused_by_publish(
    made: Callable[[str], tuple[Path, Path]], root: Path, tmp_path: Path
) -> None:
    wheel, report = made("pass")
    bad = duplicate_verdict(report, tmp_path / "dup.json")
    assert json.loads(bad.read_text())["verdict"] == "pass"  # what Python's json alone would have read
    index = tmp_path / "index"
    before = tree_hash(index)
    words = "duplicate key 'verdict'"
    refused(root, 12, words, "publish", wheel, "--report", bad, "--to", index, "--accept-declared-binding")
    assert tree_hash(index) == before
    run = cli(root, "publish", wheel, "--report", report, "--to", index, "--accept-declared-binding")
    assert run.returncode == 0, run.stderr  # negative control: the same report without the duplicate


@pytest.mark.parametrize("name", ["flipped-verdict-al-1.5", "al-51-k-15-sub-epsilon", "al-51-profile-says-k-50"])
def test_resealed_report_is_refused_by_release_and_verify(
    name: str, made: Callable[[str], tuple[Path, Path]], root: Path, tmp_path: Path
) -> None:
    wheel, report = made("pass")
    _, bad = forged(name, made, root, tmp_path)
    words = ATTACKS[name][2]
    refused(root, 17, words, "release", wheel, "--out", tmp_path / "rel-bad", "--report", bad)
    assert not (tmp_path / "rel-bad").exists()
    rel = tmp_path / "rel"
    made_ok = cli(root, "release", wheel, "--out", rel, "--report", report)
    assert made_ok.returncode == 0, made_ok.stderr  # negative control: the genuine report
    assert cli(root, "verify", rel).returncode == 0
    # An unsigned release re-summed by someone else: the forged report in the genuine one's place.
    attached = next(p for p in rel.iterdir() if ".validation-" in p.name)
    attached.unlink()
    shutil.copy(bad, attached)
    sums = [
        f"{sha256_file(attached)}  {attached.name}" if line.endswith(f"  {attached.name}") else line
        for line in (rel / "SHA256SUMS").read_text().splitlines()
    ]
    (rel / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    before = tree_hash(rel)
    refused(root, 17, words, "verify", rel)
    index = tmp_path / "index"
    refused(root, 17, words, "publish", rel, "--platform", "x86_64", "--accept-declared-binding", "--to", index)
    assert tree_hash(rel) == before and not index.exists()


def test_validate_refuses_what_vllm_never_exports(fake: Any, root: Path, tmp_path: Path) -> None:
    """The same rules at the source: a server whose /metrics carries these is unmeasurable (exit 2, one line)."""
    _, state = fake
    cases = {
        "sub-epsilon": (served(1e-8, 1.5e-7, 5e-7, (1e-8, 1e-8, 4.8e-7) + (0,) * 12), "is not a whole number"),
        "fractional": (served(100, 1500, 150.5, (100, 50.5) + (0,) * 13), "is not a whole number"),
        "zero-padded": (metrics(100, 1500, 150, [',position="00"} 100', ',position="1"} 50']), "not an integer"),
        "5000-digit": (metrics(100, 1500, 150, [f',position="{"9" * 5000}"}} 150']), "not an integer"),
        "no-family": (metrics(100, 1500, 150, []), "no per-position counts"),
        "valid": (served(100, 1500, 150, PASS_POS), ""),
    }
    for name, (after, words) in cases.items():
        state.before = ZERO15 if name != "no-family" else metrics(0, 0, 0, [])  # neither scrape has the family
        state.after, state.scrapes = after, 0
        run = cli(root, "validate", "--profile", PROFILE, "--endpoint", _url(fake), "--report",
                  tmp_path / f"{name}.json", "--quiet")  # fmt: skip
        if not words:
            assert run.returncode == 0, run.stderr  # negative control
            continue
        lines = error_lines(run)
        assert run.returncode == 2 and len(lines) == 1 and words in lines[0], (name, run.stderr)
        assert "Traceback" not in run.stderr
