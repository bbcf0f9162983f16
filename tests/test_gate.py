"""The publish gate cannot be fooled (issue 18), through the CLI.

`validate --endpoint` against a fake OpenAI-compatible server on 127.0.0.1 whose `/metrics` says whatever the test
wants (the test is about how we treat a server's answers): every impossible measurement is exit 2 with its own
line, and the same server made plausible passes. `publish` refusals each leave the index byte-identical (a hash of
the whole tree before and after), and the same input made valid publishes. The token-budget trap (issue 20): drafts
cut below k fail the draft-fill gate with a line saying what to raise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from conftest import checkout_requiring, http_server, provenance_bytes, write_wheel
from test_publish import make_wheel

from vllm_dflash.cli import main
from vllm_dflash.fetch import sha256_file
from vllm_dflash.paths import TEMP_PREFIX
from vllm_dflash.report import key_from_env, loads_strict, seal, write
from vllm_dflash.validate.promptsets import load_prompts

K = 3
PROFILE = "gate-fake"
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
    "min_acceptance_length": 1.5,
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def _generated(drafts: Any, accepted: Any) -> Any:
    try:
        return float(drafts) + float(accepted)
    except (TypeError, ValueError):
        return 0  # a malformed counter under test: the generation count is not what it is about


def metrics(drafts: Any, draft_tokens: Any, accepted: Any, per_pos: list[str] | None = None) -> str:
    """Prometheus text as vLLM writes its spec-decode counters; `per_pos` lines are given whole (label and value)."""
    lines = []
    for name, value in (
        ("vllm:spec_decode_num_drafts_total", drafts),
        ("vllm:spec_decode_num_draft_tokens_total", draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", accepted),
        # every accepted token is a generated one, plus the one token each step samples (report.system_problem)
        ("vllm:generation_tokens_total", _generated(drafts, accepted)),
    ):
        lines += [f"# TYPE {name} counter", f'{name}{{engine="0",model_name="tiny"}} {value}']
    lines.append(f"# TYPE {PER_POS} counter")
    for label_value in per_pos or []:
        lines.append(f'{PER_POS}{{engine="0",model_name="tiny"{label_value}')
    return "\n".join(lines) + "\n"


def pos(*values: Any) -> list[str]:
    return [f',position="{p}"}} {v}' for p, v in enumerate(values)]


ZERO = metrics(0, 0, 0, pos(0, 0, 0))
GOOD = metrics(100, 300, 150, pos(75, 50, 25))  # AL 2.5, k = 3 tokens per draft


@dataclass
class Fake:
    """What the fake server answers: /metrics before the run (first scrape) and after it (every later one)."""

    before: str = ZERO
    after: str = GOOD
    version: str | None = None  # /version (None: 404)
    endless_metrics: bool = False  # /metrics streams without end
    keep_alive: bool = False  # answer as HTTP/1.1: a connection stays open unless the client asks otherwise
    content: str = "ok"  # every chat completion's text
    scrapes: int = 0
    paths: list[str] = field(default_factory=list)
    connections: list[tuple[int, str | None]] = field(default_factory=list)  # (client port, Connection header)


@pytest.fixture
def fake() -> Iterator[tuple[str, Fake]]:
    with fake_server(Fake()) as served:
        yield served


@contextlib.contextmanager
def fake_server(state: Fake) -> Iterator[tuple[str, Fake]]:
    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            if state.keep_alive:
                self.protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            state.connections.append((self.client_address[1], self.headers.get("Connection")))
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            state.paths.append(self.path)
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/version" and state.version is not None:
                self._send(200, json.dumps({"version": state.version}).encode())
            elif self.path == "/v1/models":
                doc = {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "t"}]}
                self._send(200, json.dumps(doc).encode())
            elif self.path == "/metrics" and state.endless_metrics:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                line = b"# HELP filler a comment line, forever\n" * 1000
                try:
                    while True:
                        self.wfile.write(line)
                except OSError:  # the client hung up: what the test wants
                    return
            elif self.path == "/metrics":
                text = state.before if state.scrapes == 0 else state.after
                state.scrapes += 1
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(length)
            doc = {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "tiny",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": state.content}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11},
            }
            self._send(200, json.dumps(doc).encode())

    with http_server(Handler) as url:
        yield url, state


@pytest.fixture
def root(tmp_path: Path, repo_root: Path) -> Path:
    return checkout_requiring(tmp_path / "checkout", {PROFILE: TABLE})


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No report key from the environment, and a private cwd: a default report path lands in tmp, never the repo."""
    monkeypatch.delenv("VLLM_DFLASH_REPORT_KEY", raising=False)
    monkeypatch.chdir(tmp_path)


def cli(root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """`vllm-dflash --root ROOT ARGS...` through the CLI's entry point, in this process (no interpreter start per
    case: the quick tier stays quick); stdout and stderr captured as a subprocess would give them."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    argv = ["--root", str(root), *map(str, args)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse refusing an option
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def error_lines(run: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in run.stderr.splitlines() if ln.startswith("error: ")]


# ---------------------------------------------------------------------------------------------------------------
# validate: measurements that cannot be real are unmeasurable (exit 2), each with its own line

IMPOSSIBLE = {
    # what the server claims after the run -> the words of its one error line
    "al-above-k-plus-1": (metrics(10, 390, 390, pos(10, 10, 10)), "exceed 10 drafts x k = 3"),
    "plus-inf": (
        metrics(100, 300, "+Inf", pos(75, 50, 25)),
        'model_name="tiny"} inf`: its value = inf is not a finite count',
    ),
    "nan": (
        metrics(100, 300, "NaN", pos(75, 50, 25)),
        'model_name="tiny"} nan`: its value = nan is not a finite count',
    ),
    "negative": (metrics(100, 300, -150, pos(75, 50, 25)), "-150"),
    "decreasing": (None, "went down from 100 to 40"),
    "position-label-missing": (metrics(100, 300, 150, ["} 150"]), "has no position label"),
    "position-label-not-integer": (metrics(100, 300, 150, [',position="one"} 150']), "not an integer"),
    "position-outside-k": (metrics(100, 300, 150, pos(75, 50, 15, 10)), "outside 0..2"),
    "position-increasing": (metrics(100, 300, 150, pos(50, 60, 40)), "more tokens accepted at position 1"),
    "position-sum": (metrics(100, 300, 150, pos(75, 50, 20)), "sum to 145"),
    "position-above-drafts": (metrics(100, 300, 230, pos(110, 70, 50)), "more than the 100 drafts"),
    "accepted-above-draft-tokens": (metrics(100, 100, 150, pos(75, 50, 25)), "exceed the 100 draft tokens"),
    "zero-drafts": (ZERO, "drafted nothing"),
    "no-speculation": ("# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 5\n", "without"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_measurements_exit_2_with_their_own_line(
    case: str, fake: tuple[str, Fake], root: Path, tmp_path: Path
) -> None:
    url, state = fake
    after, words = IMPOSSIBLE[case]
    if case == "decreasing":  # the server restarted between the scrapes
        state.before, after = GOOD, metrics(40, 120, 60, pos(30, 20, 10))
    assert after is not None
    if case == "no-speculation":
        state.before = after
    state.after = after
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", report, "--quiet")
    assert run.returncode == 2, run.stdout + run.stderr
    lines = error_lines(run)
    assert len(lines) == 1 and words in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    data = loads_strict(report.read_bytes())  # strict JSON, no NaN/Infinity anywhere
    assert data["verdict"] == "error" and data["acceptance"] is None


def test_endless_metrics_are_refused(fake: tuple[str, Fake], root: Path, tmp_path: Path) -> None:
    url, state = fake
    state.endless_metrics = True
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", tmp_path / "r.json", "--quiet")
    assert run.returncode == 2 and "answered more than 32 MiB" in run.stderr, run.stderr


def test_impossible_lines_are_distinct() -> None:
    """Each class says something the others do not (the matrix is not one message matched loosely)."""
    words = [w for _, w in IMPOSSIBLE.values()]
    assert len(set(words)) == len(words)


def test_plausible_server_passes(fake: tuple[str, Fake], root: Path, tmp_path: Path) -> None:
    """Negative control of the matrix: the same fake server with counts a vLLM can produce."""
    url, state = fake
    info = 'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0\n'
    state.before = "# TYPE vllm:cache_config_info gauge\n" + info + ZERO
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", report)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "verdict: pass (AL 2.500)" in run.stdout and error_lines(run) == []
    assert "3.00 of k = 3" in run.stdout and "max_num_seqs 8, concurrency 4" in run.stdout  # the table says so
    data = loads_strict(report.read_bytes())
    assert data["acceptance"]["mean_draft_tokens_per_draft"] == 3.0 and data["drafts_cut"] is None
    assert [g["gate"] for g in data["gates"]] == ["min_acceptance_length", "draft_fill"]
    assert data["prompts"]["count"] == 12 and data["exploratory"] is None
    serving = data["serving"]
    assert (serving["max_num_seqs"], serving["max_num_batched_tokens"], serving["concurrency"]) == (8, 512, 4)
    assert serving["source"].startswith("declared by the profile")
    assert serving["observed_in_metrics"] == {
        "enable_prefix_caching": "True",
        "block_size": "16",
        "cache_dtype": "auto",
    }
    assert data["server"]["artifact"]["binding"] == "none"  # no --wheel named: nothing to publish


def test_cut_drafts_fail_the_draft_fill_gate(fake: tuple[str, Fake], root: Path, tmp_path: Path) -> None:
    """Issue 20's trap: fewer than k draft tokens per draft is vLLM's token budget cutting the drafts."""
    url, state = fake
    state.after = metrics(100, 200, 150, pos(75, 50, 25))  # 2 of k = 3 per draft
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", report, "--quiet")
    assert run.returncode == 1, run.stdout + run.stderr
    warn = [ln for ln in run.stderr.splitlines() if ln.startswith("warning: vLLM cut the drafts")]
    assert len(warn) == 1 and "2.00 of k = 3" in warn[0], run.stderr
    # The profile declares 512 >= 2 x 3 x 8 = 48: the server (an endpoint) must run with other settings.
    assert "runs with other settings than the profile's" in warn[0] and "--max-num-batched-tokens >= 48" in warn[0]
    data = loads_strict(report.read_bytes())
    assert [g["gate"] for g in data["gates"] if not g["passed"]] == ["draft_fill"]


def test_outputs_that_differ_from_the_baseline_fail_the_lossless_gate(fake: tuple[str, Fake], tmp_path: Path) -> None:
    """min_match_rate through the CLI: the speculative server's outputs differ from the no-speculation baseline's on
    every prompt, so the rate is 0 and the gate fails (exit 1, the only failed gate); the same baseline answering
    the same text passes (rate 1.0); without a baseline the gate cannot pass."""
    url, state = fake
    root = checkout_requiring(tmp_path / "lossless", {PROFILE: {**TABLE, "min_match_rate": 0.5}})
    report = tmp_path / "r.json"
    with fake_server(Fake(content="another answer")) as (base_url, base):
        run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--baseline-endpoint", base_url,
                  "--report", report, "--quiet")  # fmt: skip
        assert run.returncode == 1, run.stdout + run.stderr
        data = loads_strict(report.read_bytes())
        gate = next(g for g in data["gates"] if g["gate"] == "min_match_rate")
        assert [g["gate"] for g in data["gates"] if not g["passed"]] == ["min_match_rate"]
        assert (gate["value"], gate["threshold"]) == (0.0, 0.5) and data["baseline"]["lossless_matches"] == 0
        base.content, state.scrapes, base.scrapes = "ok", 0, 0
        run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--baseline-endpoint", base_url,
                  "--report", report, "--quiet")  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert loads_strict(report.read_bytes())["baseline"]["lossless_match_rate"] == 1.0
    state.scrapes = 0
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", report, "--quiet")
    assert run.returncode == 1 and "needs a baseline" in report.read_text(), run.stdout + run.stderr


def test_token_budget_below_the_floor_is_refused_at_parse_time(root: Path, tmp_path: Path) -> None:
    doc = tomlkit.parse((root / "dist.toml").read_text())
    doc["profiles"][PROFILE]["serve_args"] = ["--max-num-seqs", "8", "--max-num-batched-tokens", "40"]
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", "http://127.0.0.1:9")
    assert run.returncode == 3 and "below 2 x k x max_num_seqs = 48" in run.stderr, run.stderr
    doc["profiles"][PROFILE]["serve_args"] = ["--max-num-seqs", "8", "--max-num-batched-tokens", "48"]
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", "http://127.0.0.1:9", "--health-timeout", "1",
              "--report", tmp_path / "r.json")  # fmt: skip
    assert run.returncode == 2 and "/health did not answer" in run.stderr  # got past the manifest


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--num-prompts", "-1"),
        ("--num-prompts", "0"),
        ("--num-prompts", "nan"),
        ("--num-prompts", "10000000000"),
        ("--health-timeout", "nan"),
        ("--health-timeout", "-5"),
        ("--health-timeout", "inf"),
        ("--health-timeout", "1e12"),
    ],
)
def test_bad_numeric_options_are_refused_at_parse_time(root: Path, option: str, value: str) -> None:
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", "http://127.0.0.1:9", option, value)
    assert run.returncode == 2 and f"validate: error: argument {option}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "report:" not in run.stderr  # refused before anything ran


def test_report_path_that_is_no_regular_file_is_refused(root: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", "http://127.0.0.1:9", "--report", fifo)
    # An output path in the way is a storage fault (exit 15), refused before anything runs, like every output.
    assert run.returncode == 15 and "not a regular file" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and stat.S_ISFIFO(fifo.lstat().st_mode)


# ---------------------------------------------------------------------------------------------------------------
# publish: refusals leave the index byte-identical


def tree_hash(path: Path) -> str:
    """Every entry under `path` (names, link targets, file bytes): equal hashes, identical trees."""
    h = hashlib.sha256()
    if not path.exists():
        return "absent"
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            h.update(f"L {rel} {os.readlink(p)}\n".encode())
        elif p.is_dir():
            h.update(f"D {rel}\n".encode())
        else:
            h.update(f"F {rel} {hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


@pytest.fixture
def validated(fake: tuple[str, Fake], root: Path, tmp_path: Path) -> Callable[..., Path]:
    """A report from `validate --endpoint` on the fake server, for a wheel whose version /version declares."""
    url, state = fake

    def run(wheel: Path, *extra: str) -> Path:
        state.scrapes = 0
        from packaging.utils import parse_wheel_filename

        state.version = str(parse_wheel_filename(wheel.name)[1])
        report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
        done = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--wheel", wheel, "--report", report,
                   "--quiet", *extra)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return report

    return run


def resealed(report: Path, edit: Callable[[dict[str, Any]], None], out: Path) -> Path:
    """The report edited and sealed again, as anyone without the HMAC key can."""
    data = json.loads(report.read_text())
    del data["seal"]
    edit(data)
    write(seal(data, key_from_env()), out, key_from_env())
    return out


def publish_refused(root: Path, index: Path, *args: str | Path, words: str) -> None:
    before = tree_hash(index)
    run = cli(root, "publish", *args, "--to", index)
    assert run.returncode == 12, run.stdout + run.stderr
    lines = error_lines(run)
    assert len(lines) == 1 and words in lines[0], run.stderr
    assert tree_hash(index) == before, "a refused publish changed the index"


def test_declared_binding_needs_the_flag_and_is_recorded(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = validated(wheel)
    assert json.loads(report.read_text())["server"]["artifact"]["binding"] == "declared"
    index = tmp_path / "index"
    publish(root, index, wheel, report)  # a first, unrelated publish: refusals must leave its files alone
    other = make_wheel(tmp_path / "w2", version="1.0.1")
    report2 = validated(other)
    publish_refused(root, index, other, "--report", report2, words="binding 'declared'")
    # Negative control: with the flag it publishes, and the index says so.
    run = cli(root, "publish", other, "--report", report2, "--to", index, "--accept-declared-binding")
    assert run.returncode == 0, run.stderr
    records = json.loads((index / "simple" / "gatedemo" / f"{other.name}.publish.json").read_text())
    assert len(records) == 1 and records[0]["binding"] == "declared" and records[0]["declared_binding_accepted"]
    delta = json.loads(report2.read_text())["counters"]["delta"]  # the AL recorded is the counters' AL
    assert records[0]["acceptance_length"] == 1 + delta["num_accepted_tokens"] / delta["num_drafts"]
    assert f"AL {records[0]['acceptance_length']:.2f} from its counters" in run.stdout
    entry = next(
        f for f in json.loads((index / "simple" / "gatedemo" / "index.json").read_text())["files"]
        if f["filename"] == other.name
    )  # fmt: skip
    assert entry["_vllm_dflash"][0]["declared_binding_accepted"] is True


def publish(root: Path, index: Path, wheel: Path, report: Path) -> None:
    run = cli(root, "publish", wheel, "--report", report, "--to", index, "--accept-declared-binding")
    assert run.returncode == 0, run.stdout + run.stderr


def test_renamed_wheel_is_refused(validated: Callable[..., Path], root: Path, tmp_path: Path) -> None:
    """A hard link of the validated wheel under another project's name or another version publishes nothing."""
    wheel = make_wheel(tmp_path / "w")
    report = validated(wheel)
    index = tmp_path / "index"
    for name in ("torch-2.11.0-py3-none-any.whl", "gatedemo-9.9.9-py3-none-any.whl"):
        alias = tmp_path / "alias" / name
        alias.parent.mkdir(exist_ok=True)
        os.link(wheel, alias)
        assert sha256_file(alias) == sha256_file(wheel)  # the report's sha256 matches: only the name lies
        publish_refused(root, index, alias, "--report", report, "--accept-declared-binding", words="METADATA says")
    publish(root, index, wheel, report)  # negative control: its own name
    assert sorted(p.name for p in (index / "simple").iterdir()) == ["gatedemo", "index.html", "index.json"]


def test_a_version_equal_to_a_published_one_is_refused(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    """`+dflash.01` is `+dflash.1` to PEP 440: other bytes under an equal version are refused, the index unchanged."""
    index = tmp_path / "index"
    first = make_wheel(tmp_path / "w1", version="1.0.0+dflash.1")
    publish(root, index, first, validated(first))
    alias = make_wheel(tmp_path / "w2", version="1.0.0+dflash.01", body="VALUE = 2\n")
    words = "PEP 440 normalises them equal"
    publish_refused(root, index, alias, "--report", validated(alias), "--accept-declared-binding", words=words)
    # Negative control: the next label is another version and publishes beside the first.
    second = make_wheel(tmp_path / "w3", version="1.0.0+dflash.2", body="VALUE = 2\n")
    publish(root, index, second, validated(second))
    assert {f.name for f in (index / "simple" / "gatedemo").glob("*.whl")} == {first.name, second.name}


@pytest.mark.parametrize("linked", ["simple", "simple/gatedemo"])
def test_symlinked_index_directory_is_refused(
    validated: Callable[..., Path], root: Path, tmp_path: Path, linked: str
) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = validated(wheel)
    index = tmp_path / "index"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (index / linked).parent.mkdir(parents=True, exist_ok=True)
    (index / linked).symlink_to(elsewhere, target_is_directory=True)
    publish_refused(root, index, wheel, "--report", report, "--accept-declared-binding", words="symbolic link")
    assert list(elsewhere.iterdir()) == []
    (index / linked).unlink()  # negative control: a real directory there
    publish(root, index, wheel, report)


def test_prompt_subset_report_is_refused(validated: Callable[..., Path], root: Path, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w")
    index = tmp_path / "index"
    subset = validated(wheel, "--num-prompts", "1")
    assert json.loads(subset.read_text())["exploratory"] == "1 prompts sent, the profile's gate is defined on 12"
    publish_refused(root, index, wheel, "--report", subset, "--accept-declared-binding", words="exploratory")
    # Re-sealed without the exploratory mark, the digest still says which prompts were measured.
    forged = resealed(subset, lambda d: d.update(exploratory=None), tmp_path / "forged.json")
    publish_refused(root, index, wheel, "--report", forged, "--accept-declared-binding", words="gate is defined on 12")
    counted = resealed(
        subset, lambda d: d.update(exploratory=None, prompts={**d["prompts"], "count": 12}), tmp_path / "count.json"
    )
    publish_refused(root, index, wheel, "--report", counted, "--accept-declared-binding", words="not the first 12")
    other_set = validated(wheel, "--prompts", "math")
    publish_refused(root, index, wheel, "--report", other_set, "--accept-declared-binding", words="'math'")
    publish(root, index, wheel, validated(wheel))  # negative control: the whole set


def test_report_with_impossible_numbers_is_refused_even_resealed(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = validated(wheel)
    index = tmp_path / "index"

    def al_40(d: dict[str, Any]) -> None:
        d["counters"]["delta"].update(num_accepted_tokens=3900.0, num_draft_tokens=3900.0)
        d["acceptance"]["mean_acceptance_length"] = 40.0
        d["gates"][0]["value"] = 40.0

    impossible = resealed(report, al_40, tmp_path / "al40.json")
    publish_refused(root, index, wheel, "--report", impossible, "--accept-declared-binding", words="no measurement")
    inflated = resealed(report, lambda d: d["acceptance"].update(mean_acceptance_length=3.0), tmp_path / "al3.json")
    publish_refused(root, index, wheel, "--report", inflated, "--accept-declared-binding", words="not the 2.500000")
    nan = tmp_path / "nan.json"
    nan.write_text(report.read_text().replace('"mean_acceptance_length": 2.5', '"mean_acceptance_length": NaN'))
    publish_refused(root, index, wheel, "--report", nan, "--accept-declared-binding", words="not strict JSON")
    publish(root, index, wheel, report)  # negative control


def test_endpoint_without_version_names_no_artifact(fake: tuple[str, Fake], root: Path, tmp_path: Path) -> None:
    url, _ = fake
    wheel = make_wheel(tmp_path / "w")
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--wheel", wheel, "--report", report)
    assert run.returncode == 0 and "answers no /version" in run.stderr
    artifact = json.loads(report.read_text())["server"]["artifact"]
    assert artifact["binding"] == "none" and artifact["sha256"] is None
    publish_refused(root, tmp_path / "index", wheel, "--report", report, "--accept-declared-binding",
                    words="another artifact")  # fmt: skip


def test_interrupted_copy_is_cleaned_by_the_next_run(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = validated(wheel)
    index = tmp_path / "index"
    publish(root, index, wheel, report)
    pdir = index / "simple" / "gatedemo"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # What a killed publish leaves: our marked temporary name with the dead writer's pid.
    stale = pdir / f"{TEMP_PREFIX}{dead.stdout.strip()}.0123abcd.gatedemo-1.0.1-py3-none-any.whl.part"
    user_file = pdir / ".gatedemo-1.0.1-py3-none-any.whl.999999.part"  # not ours: never swept
    user_file.write_bytes(b"a user's file")
    stale.write_bytes(b"half a wheel")
    second = make_wheel(tmp_path / "w2", version="1.0.1")
    publish(root, index, second, validated(second))
    assert not stale.exists() and user_file.read_bytes() == b"a user's file"


# ---------------------------------------------------------------------------------------------------------------
# The index users' tools read: pip (HTML, and PEP 691 JSON + PEP 658 over HTTP) and uv


def _published_index(validated: Callable[..., Path], root: Path, tmp_path: Path) -> tuple[Path, Path]:
    wheel = make_wheel(tmp_path / "w", version="1.2.3", body="VALUE = 'from the index'\n")
    index = tmp_path / "index"
    publish(root, index, wheel, validated(wheel))
    return index, wheel


ISOLATED = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "UV_NO_CONFIG": "1"}


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    return path / "bin" / "python"


def _value(python: Path) -> str:
    out = subprocess.run([python, "-c", "import gatedemo; print(gatedemo.VALUE)"], capture_output=True, text=True)
    return out.stdout.strip()


def test_pip_and_uv_install_from_the_local_index(validated: Callable[..., Path], root: Path, tmp_path: Path) -> None:
    index, wheel = _published_index(validated, root, tmp_path)
    pdir = index / "simple" / "gatedemo"
    page = (pdir / "index.html").read_text()
    meta_sha = hashlib.sha256((pdir / f"{wheel.name}.metadata").read_bytes()).hexdigest()
    assert f'data-core-metadata="sha256={meta_sha}"' in page and f"#sha256={sha256_file(wheel)}" in page
    with zipfile.ZipFile(wheel) as zf:
        assert (pdir / f"{wheel.name}.metadata").read_bytes() == zf.read("gatedemo-1.2.3.dist-info/METADATA")
    doc = json.loads((pdir / "index.json").read_text())
    assert doc["meta"]["api-version"] == "1.1" and doc["versions"] == ["1.2.3"]
    assert doc["files"][0]["core-metadata"] == {"sha256": meta_sha}
    py = _venv(tmp_path / "pip-venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", "--disable-pip-version-check",
         "--index-url", (index / "simple").as_uri(), "gatedemo==1.2.3"],
        check=True, env=ISOLATED,
    )  # fmt: skip
    assert _value(py) == "from the index"
    # The venv's own bin first: the suite may run as .venv/bin/python without activating it.
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv is not None, "uv is in the test extra (pip install -e '.[test]')"
    py2 = _venv(tmp_path / "uv-venv")
    subprocess.run(
        [uv, "pip", "install", "--python", str(py2), "--no-deps", "--index-url", (index / "simple").as_uri(),
         "--no-cache", "gatedemo==1.2.3"],
        check=True, env=ISOLATED, capture_output=True,
    )  # fmt: skip
    assert _value(py2) == "from the index"


def test_resolver_reads_pep658_metadata_over_pep691_json(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    """The index served over HTTP as a static host would (index.json for `Accept: ...pypi.simple.v1+json`): pip's
    resolver asks for the JSON page and the `.metadata` file and never for the wheel (`--dry-run`)."""
    index, wheel = _published_index(validated, root, tmp_path)
    seen: list[tuple[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            rel = self.path.split("?")[0].strip("/")
            target = index / rel
            accept = self.headers.get("Accept", "")
            if target.is_dir():
                want_json = "application/vnd.pypi.simple.v1+json" in accept
                target = target / ("index.json" if want_json else "index.html")
                ctype = "application/vnd.pypi.simple.v1+json" if want_json else "text/html"
            else:
                ctype = "application/octet-stream"
            if not target.is_file():
                self.send_error(404)
                return
            seen.append((rel, target.name))
            body = target.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with http_server(Handler) as base:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--disable-pip-version-check",
             "--no-cache-dir", "--ignore-installed", "--report", "-", "--quiet", "--index-url", f"{base}/simple/",
             "gatedemo==1.2.3"],
            check=True, env=ISOLATED, capture_output=True, text=True,
        )  # fmt: skip
    resolved = json.loads(out.stdout)["install"]
    assert [r["metadata"]["version"] for r in resolved] == ["1.2.3"]
    served = [name for _, name in seen]
    assert "index.json" in served, seen  # pip took the PEP 691 form
    assert f"{wheel.name}.metadata" in served, seen  # and the PEP 658 file
    assert wheel.name not in served, seen  # never the wheel itself


def test_no_prompt_set_count_drift() -> None:
    """The fake profile's set is the shipped `chat` set of 12 (the subset test's numbers depend on it)."""
    assert len(load_prompts("chat")) == 12


# ---------------------------------------------------------------------------------------------------------------
# Releases: symlinked files refused by verify and publish, a wheel swapped after verify refused by the copy


def make_vllm_wheel(dest: Path, body: str = "# ours\n") -> Path:
    """A small wheel as `vllm-dflash build` shapes it: named vllm, our version, an x86_64 tag, and the provenance
    document a release needs (the release's documents are computed from it)."""

    from vllm_dflash import provenance as prov

    version, tag = "0.20.1+dflash.1", "py3-none-manylinux_2_35_x86_64"
    files = {"vllm/__init__.py": body.encode(), prov.PATH: provenance_bytes("vllm", version, tag)}
    return write_wheel(dest, "vllm", version, files, tag=tag)


@pytest.fixture
def release(validated: Callable[..., Path], root: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A release of one x86_64 wheel with a passing report from the fake server (declared binding)."""
    wheel = make_vllm_wheel(tmp_path / "dist")
    report = validated(wheel)
    rel = tmp_path / "release"
    run = cli(root, "release", wheel, "--out", rel, "--report", report)
    assert run.returncode == 0, run.stdout + run.stderr
    assert cli(root, "verify", rel).returncode == 0
    return rel, wheel


def publish_release_args(rel: Path) -> tuple[str, ...]:
    return (str(rel), "--platform", "x86_64", "--accept-declared-binding")


def test_release_publishes_its_wheel_under_its_metadata(release: tuple[Path, Path], root: Path, tmp_path: Path) -> None:
    rel, wheel = release
    index = tmp_path / "index"
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sha256_file(index / "simple" / "vllm" / wheel.name) == sha256_file(wheel)
    assert (index / "releases" / "0.20.1+dflash.1" / "SHA256SUMS").read_bytes() == (rel / "SHA256SUMS").read_bytes()
    notes = (rel / "RELEASE-NOTES.md").read_text()
    assert "| x86_64 | gate-fake | 2.50 |" in notes and "| chat x 12 | declared | pass |" in notes


def test_symlinked_release_file_is_refused(release: tuple[Path, Path], root: Path, tmp_path: Path) -> None:
    rel, wheel = release
    outside = tmp_path / "outside.whl"
    shutil.copy(rel / wheel.name, outside)  # same bytes: only the link is wrong
    (rel / wheel.name).unlink()
    (rel / wheel.name).symlink_to(outside)
    run = cli(root, "verify", rel)
    assert run.returncode == 17 and "is a symbolic link" in run.stderr, run.stderr
    index = tmp_path / "index"
    before = tree_hash(index)
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 17 and "is a symbolic link" in run.stderr and tree_hash(index) == before
    (rel / wheel.name).unlink()
    shutil.copy(outside, rel / wheel.name)  # negative control: the file itself
    assert cli(root, "verify", rel).returncode == 0


def test_release_wheel_swapped_after_verify_is_refused(
    release: tuple[Path, Path], root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between `verify` and the copy, the release's wheel is replaced: the copy's own hash refuses it."""
    import vllm_dflash.publish as pub
    from vllm_dflash.release.verify import verify as real_verify

    rel, wheel = release
    swapped = make_vllm_wheel(tmp_path / "evil", body="# not what was validated\n")

    def verify_then_swap(*args: Any, **kwargs: Any) -> Any:
        result = real_verify(*args, **kwargs)
        (rel / wheel.name).unlink()  # after the check, before the copy (a new file: the release hard-links)
        shutil.copy(swapped, rel / wheel.name)
        return result

    monkeypatch.setattr(pub, "verify", verify_then_swap)
    index = tmp_path / "index"
    before = tree_hash(index)
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 12 and "changed" in run.stderr, run.stdout + run.stderr
    assert tree_hash(index) == before
    monkeypatch.setattr(pub, "verify", real_verify)
    (rel / wheel.name).unlink()
    shutil.copy(wheel, rel / wheel.name)  # negative control: the validated bytes back
    assert cli(root, "publish", *publish_release_args(rel), "--to", index).returncode == 0


def test_refused_release_publish_writes_nothing(release: tuple[Path, Path], root: Path, tmp_path: Path) -> None:
    """Release notes already published with other content: refused before the wheel or a page is written."""
    rel, _ = release
    index = tmp_path / "index"
    notes = index / "releases" / "0.20.1+dflash.1" / "RELEASE-NOTES.md"
    notes.parent.mkdir(parents=True)
    notes.write_text("other notes\n")
    before = tree_hash(index)
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 12 and "already exists with different content" in run.stderr, run.stderr
    assert tree_hash(index) == before and not (index / "simple").exists()


def test_a_release_publish_decides_platform_by_platform(release: tuple[Path, Path], root: Path, tmp_path: Path) -> None:
    """Every platform the manifest builds is decided: one without a wheel refuses the release, a report that fails
    the gate is named with its reason, and a wheel file given for a release directory is refused."""
    import vllm_dflash.publish as pub
    from vllm_dflash.errors import PublishRefusedError
    from vllm_dflash.manifest import load_manifest

    rel, wheel = release
    index = tmp_path / "index"
    publish_refused(root, index, rel, "--accept-declared-binding", words="aarch64: the release has no wheel for it")
    name = next(p.name for p in rel.iterdir() if ".validation-" in p.name)
    publish_refused(root, index, rel, "--platform", "x86_64", words=f"x86_64: {name}: report ")
    run = cli(root, "publish", rel, "--platform", "x86_64", "--to", index)
    assert "declared" in run.stderr and "no validation report" not in run.stderr, run.stderr
    plan = pub.publish_plan(rel, load_manifest(root), ["x86_64"], accept_declared=True)
    assert [(d.platform, d.refusal, d.profile) for d in plan.decisions] == [("x86_64", None, PROFILE)]
    # Both platforms' wheels, only x86_64 validated: aarch64 is refused for want of a report, and one wheel of the
    # two (a part of the release) is no release to publish.
    from vllm_dflash import provenance as prov

    version, tag = "0.20.1+dflash.1", "py3-none-manylinux_2_35_aarch64"
    files = {"vllm/__init__.py": b"# ours\n", prov.PATH: provenance_bytes("vllm", version, tag)}
    arm = write_wheel(tmp_path / "arm", "vllm", version, files, tag=tag)
    both = tmp_path / "both"
    report = next(rel.glob("*.validation-*"))
    assert cli(root, "release", wheel, arm, "--out", both, "--report", report).returncode == 0
    publish_refused(
        root, index, both, "--accept-declared-binding", words=f"aarch64: no validation report for {arm.name}"
    )
    with pytest.raises(PublishRefusedError, match="is one artifact, not a release directory"):
        pub.publish_plan(both / wheel.name, load_manifest(root), ["x86_64"], accept_declared=True)


def test_a_release_publish_takes_the_first_report_that_passes(
    fake: tuple[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two reports for one wheel, the first of a profile publishing does not require: it is passed over (named in
    no refusal), the second lets the wheel in, and the index records that one."""
    root = checkout_requiring(tmp_path / "checkout", {PROFILE: TABLE, "gate-aside": TABLE})
    doc = tomlkit.parse((root / "dist.toml").read_text())
    doc["publish"]["required_profiles"] = [PROFILE]
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    url, state = fake
    wheel = make_vllm_wheel(tmp_path / "dist")
    state.version = "0.20.1+dflash.1"
    reports = []
    for profile in ("gate-aside", PROFILE):  # "gate-aside" sorts first in the release
        state.scrapes = 0
        out = tmp_path / f"{profile}.json"
        done = cli(root, "validate", "--profile", profile, "--endpoint", url, "--wheel", wheel, "--report", out,
                   "--quiet")  # fmt: skip
        assert done.returncode == 0, done.stderr
        reports.append(out)
    rel = tmp_path / "release"
    assert cli(root, "release", wheel, "--out", rel, "--report", reports[0], "--report", reports[1]).returncode == 0
    index = tmp_path / "index"
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 0, run.stdout + run.stderr
    records = list((index / "simple" / "vllm").glob("*.publish*"))
    assert records and all(PROFILE in r.read_text() and "gate-aside" not in r.read_text() for r in records)


def test_a_release_to_an_upload_url_needs_a_place_for_its_other_files(
    release: tuple[Path, Path], root: Path, tmp_path: Path
) -> None:
    rel, _ = release
    run = cli(root, "publish", *publish_release_args(rel), "--to", "https://upload.example/legacy/")
    assert run.returncode == 12 and "is an upload URL, which carries wheels only" in run.stderr, run.stderr


def test_a_release_published_again_replaces_nothing(release: tuple[Path, Path], root: Path, tmp_path: Path) -> None:
    """The same release published twice: the second run finds every file in place, byte for byte, and leaves each
    one as it is (the same inode: nothing rewritten). A destination that is a directory is refused."""
    rel, _ = release
    index = tmp_path / "index"
    assert cli(root, "publish", *publish_release_args(rel), "--to", index).returncode == 0
    files = index / "releases" / "0.20.1+dflash.1"
    inodes = {p.name: p.stat().st_ino for p in files.iterdir()}
    assert cli(root, "publish", *publish_release_args(rel), "--to", index).returncode == 0
    assert {p.name: p.stat().st_ino for p in files.iterdir()} == inodes
    (files / "RELEASE-NOTES.md").unlink()
    (files / "RELEASE-NOTES.md").mkdir()
    publish_refused(root, index, *publish_release_args(rel), words="RELEASE-NOTES.md is not a regular file")


def test_a_release_publish_that_fails_midway_leaves_the_index_as_it_was(
    release: tuple[Path, Path], root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the release's files are staged: one storage line (exit 15), and neither the staged
    wheel nor any release file nor a new directory is left; the same publish then succeeds."""
    import errno

    import vllm_dflash.publish as pub

    rel, _ = release
    index = tmp_path / "index"
    real, calls = pub._stage_release_file, []

    def fill_up(src: Path, dest: Path, sha256: str) -> Path:
        calls.append(dest.name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dest, sha256)

    monkeypatch.setattr(pub, "_stage_release_file", fill_up)
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 15 and len(error_lines(run)) == 1 and "No space left" in run.stderr, run.stderr
    assert not (index / "releases" / "0.20.1+dflash.1").exists() and not (index / "simple" / "vllm").exists()
    assert not [p for p in index.rglob("*") if p.is_file() and not p.name.startswith(".")], list(index.rglob("*"))
    assert not [p for p in index.rglob("*.part")], "a staged part was left"
    # A refusal while staging (a release file changed after verify) is its own line and cleans up alike.
    from vllm_dflash.errors import PublishRefusedError

    def changed(src: Path, dest: Path, sha256: str) -> Path:
        raise PublishRefusedError(f"{src} changed after it was verified", "verify and publish the release again")

    monkeypatch.setattr(pub, "_stage_release_file", changed)
    run = cli(root, "publish", *publish_release_args(rel), "--to", index)
    assert run.returncode == 12 and "changed after it was verified" in run.stderr, run.stderr
    assert not (index / "simple" / "vllm").exists() and not [p for p in index.rglob("*.part")]
    monkeypatch.setattr(pub, "_stage_release_file", real)
    assert cli(root, "publish", *publish_release_args(rel), "--to", index).returncode == 0


def test_a_release_writes_through_the_index_s_own_directories_in_one_transaction(
    release: tuple[Path, Path], root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`releases/` a symbolic link is refused before anything is written; a publish holds the index's lock from
    its checks to the last rename."""
    from vllm_dflash import simple_index

    rel, _ = release
    index = tmp_path / "index"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    index.mkdir()
    (index / "releases").symlink_to(elsewhere)
    publish_refused(root, index, *publish_release_args(rel), words="index directory")
    assert not list(elsewhere.iterdir())
    (index / "releases").unlink()
    real = simple_index.LocalIndex.transaction
    held: list[object] = []

    @contextlib.contextmanager
    def watched(self: Any) -> Iterator[None]:
        with real(self):
            held.append("in")
            yield
            held.append((index / "releases" / "0.20.1+dflash.1" / "SHA256SUMS").exists())

    monkeypatch.setattr(simple_index.LocalIndex, "transaction", watched)
    assert cli(root, "publish", *publish_release_args(rel), "--to", index).returncode == 0
    assert held == ["in", True], held  # the release files were in place before the lock was let go


def test_a_release_to_an_upload_url_uploads_each_wheel_and_attaches_the_rest(
    release: tuple[Path, Path], root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm_dflash.publish as pub

    rel, wheel = release
    uploads: list[tuple[str, str, str | None]] = []
    monkeypatch.setattr(pub, "publish_wheel_twine", lambda w, url, sha=None: uploads.append((Path(w).name, url, sha)))
    files = tmp_path / "attached"
    url = "https://upload.example/legacy/"
    run = cli(root, "publish", *publish_release_args(rel), "--to", url, "--attach-to", files)
    assert run.returncode == 0, run.stdout + run.stderr
    assert uploads == [(wheel.name, url, sha256_file(wheel))]
    assert (files / "SHA256SUMS").read_bytes() == (rel / "SHA256SUMS").read_bytes()


def test_release_refuses_a_resealed_impossible_report(
    validated: Callable[..., Path], root: Path, tmp_path: Path
) -> None:
    wheel = make_vllm_wheel(tmp_path / "dist")
    report = validated(wheel)

    def al_40(d: dict[str, Any]) -> None:
        d["counters"]["delta"].update(num_accepted_tokens=3900.0, num_draft_tokens=3900.0)

    bad = resealed(report, al_40, tmp_path / "bad.json")
    run = cli(root, "release", wheel, "--out", tmp_path / "rel", "--report", bad)
    assert run.returncode == 17 and "no measurement can give" in run.stderr, run.stderr
    assert cli(root, "release", wheel, "--out", tmp_path / "rel", "--report", report).returncode == 0
    # verify re-checks an attached report too: replace it (and its sum) with the impossible one.
    rel = tmp_path / "rel"
    name = next(p.name for p in rel.iterdir() if ".validation-" in p.name)
    shutil.copy(bad, rel / name)
    sums = (rel / "SHA256SUMS").read_text().splitlines()
    fixed = [f"{sha256_file(rel / name)}  {name}" if ln.endswith(f"  {name}") else ln for ln in sums]
    (rel / "SHA256SUMS").write_text("\n".join(fixed) + "\n")
    run = cli(root, "verify", rel)
    assert run.returncode == 17 and "no measurement can give" in run.stderr, run.stderr


def test_publish_report_that_is_no_regular_file_is_refused(root: Path, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w")
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)  # reading it would wait forever
    index = tmp_path / "index"
    publish_refused(root, index, wheel, "--report", fifo, words="not a regular file")
    publish_refused(root, index, wheel, "--report", tmp_path, words="not a regular file")


def test_each_request_gets_its_own_connection(manifest: Any, fake: tuple[str, Fake]) -> None:
    """No pooled keep-alive connection is reused (one the server has just closed as idle fails a request before it
    reaches vLLM, and we never retry: a retry could count a request twice). Control: the same server sees a plain
    OpenAI client reuse one connection for all of them."""
    from dataclasses import replace

    from openai import OpenAI

    from vllm_dflash.validate.promptsets import Prompt
    from vllm_dflash.validate.smoke import run_prompts

    url, state = fake
    state.keep_alive = True
    profile = replace(manifest.profiles["mini-cpu-serving"], served_model_name="tiny", concurrency=2)
    prompts = [Prompt(id=f"p{i}", category="t", text="hello") for i in range(4)]
    run_prompts(url, profile, prompts, show_progress=False)
    ours = list(state.connections)
    state.connections.clear()
    plain = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for p in prompts:
        plain.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p.text}])
    seen = state.connections
    assert len(ours) == 1 + len(prompts) and len({port for port, _ in ours}) == len(ours), ours
    assert {h for _, h in ours} == {"close"}
    assert len({port for port, _ in seen}) == 1 and len(seen) == len(prompts)


# --- issue 42's fuzz tier: reports and wheels through `publish`, every ending in the documented table -------------

from cli_fuzz import Ending, run_in_process, run_subprocess  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# The same strategies through a real `python -m vllm_dflash` per example (~1 s each): what a shell user meets,
# interpreter start, stderr and exit status included.
FUZZ_PROCESS = settings(FUZZ, max_examples=12)
# Values a hostile report puts in a leaf: the boundaries of every rule (negative, huge, fractional, 2^70, wrong type).
ODD_VALUES: st.SearchStrategy[Any] = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, -1, 1, 2**63, 2**70, 10**12, 1025, 0.5, 1e308, -0.0, True, None, "", "3", [], {}, [1]]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)


def _leaves(doc: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in _leaves(v, (*at, k))] or [at]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in _leaves(v, (*at, i))] or [at]
    return [at]


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for part in path[:-1]:
        doc = doc[part]
    doc[path[-1]] = value


@pytest.fixture
def gated_wheel(validated: Callable[..., Path], root: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    wheel = make_wheel(tmp_path / "w")
    body = json.loads(validated(wheel).read_text())
    del body["seal"]
    return wheel, body


def _publish(
    root: Path, tmp: Path, wheel: Path, body: dict[str, Any], run: Callable[..., Ending] = run_in_process
) -> Ending:
    report = tmp / "r.json"
    write(seal(body, key_from_env()), report, key_from_env())
    return run("--root", root, "publish", wheel, "--report", report, "--to", tmp / "index",
               "--accept-declared-binding")  # fmt: skip


@FUZZ
@given(data=st.data())
def test_fuzzed_reports_through_publish_end_in_the_table(
    gated_wheel: tuple[Path, dict[str, Any]], root: Path, tmp_path: Path, data: st.DataObject
) -> None:
    """One to three leaves of a passing report replaced by odd values and the report sealed again (as anyone without
    the key can): publish ends with a documented code, one line, no trace, in bound."""
    _fuzz_report(gated_wheel, root, tmp_path, data, run_in_process)


@FUZZ_PROCESS
@given(data=st.data())
def test_fuzzed_reports_through_a_publish_process_end_in_the_table(
    gated_wheel: tuple[Path, dict[str, Any]], root: Path, tmp_path: Path, data: st.DataObject
) -> None:
    _fuzz_report(gated_wheel, root, tmp_path, data, run_subprocess)


def _fuzz_report(
    gated_wheel: tuple[Path, dict[str, Any]],
    root: Path,
    tmp_path: Path,
    data: st.DataObject,
    run: Callable[..., Ending],
) -> None:
    import copy
    import tempfile

    wheel, base = gated_wheel
    body = copy.deepcopy(base)
    paths = _leaves(body)
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3, unique=True)):
        _set(body, path, data.draw(ODD_VALUES))
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        ending = _publish(root, Path(tmp), wheel, body, run)
    ending.check()


# members a hostile wheel carries: traversal names, duplicate and odd METADATA, a RECORD that lies, provenance junk
_MEMBERS = st.sampled_from([
    "gatedemo/__init__.py", "gatedemo-1.0.0.dist-info/METADATA", "gatedemo-1.0.0.dist-info/RECORD",
    "gatedemo-1.0.0.dist-info/WHEEL", "vllm/dflash_build.json", "../escape.py", "/abs.py", "a/../../b",
    "gatedemo-1.0.0.dist-info/", "other-2.0.dist-info/METADATA", "x" * 300,
])  # fmt: skip
_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"Metadata-Version: 2.1\nName: gatedemo\nVersion: 1.0.0\n", b"\xff\xfe", b"{}", b"[1]",
                     b'{"schema": 1}', b"Name: other\nVersion: 9\n", b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"]),
)  # fmt: skip


@FUZZ
@given(members=st.lists(st.tuples(_MEMBERS, _BODIES), max_size=6), keep=st.booleans())
def test_fuzzed_wheels_through_publish_end_in_the_table(
    gated_wheel: tuple[Path, dict[str, Any]], root: Path, tmp_path: Path, members: list[tuple[str, bytes]], keep: bool
) -> None:
    """A wheel zip rebuilt from odd members (on top of the real ones, or instead of them), with a report resealed to
    name its bytes, so the gate lets it through to the wheel reader: every ending is in the table."""
    _fuzz_wheel(gated_wheel, root, tmp_path, members, keep, run_in_process)


@FUZZ_PROCESS
@given(members=st.lists(st.tuples(_MEMBERS, _BODIES), max_size=6), keep=st.booleans())
def test_fuzzed_wheels_through_a_publish_process_end_in_the_table(
    gated_wheel: tuple[Path, dict[str, Any]], root: Path, tmp_path: Path, members: list[tuple[str, bytes]], keep: bool
) -> None:
    _fuzz_wheel(gated_wheel, root, tmp_path, members, keep, run_subprocess)


def _fuzz_wheel(
    gated_wheel: tuple[Path, dict[str, Any]],
    root: Path,
    tmp_path: Path,
    members: list[tuple[str, bytes]],
    keep: bool,
    run: Callable[..., Ending],
) -> None:
    import copy
    import tempfile
    import warnings

    wheel, base = gated_wheel
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        fuzzed = Path(tmp) / wheel.name
        with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(fuzzed, "w") as dst, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # duplicate names are the point
            for info in src.infolist() if keep else []:
                dst.writestr(info, src.read(info))
            for name, data in members:
                dst.writestr(name, data)
        body = copy.deepcopy(base)
        body["server"]["artifact"]["sha256"] = sha256_file(fuzzed)
        ending = _publish(root, Path(tmp), fuzzed, body, run)
    ending.check()


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        (("timings", "total_s"), 2**70, "timings.total_s = 1180591620717411303424 is not a duration"),
        (("timings", "scrape_before_s"), -1.5, "timings.scrape_before_s = -1.5 is not a duration"),
        (("timings", "scrape_after_s"), "3", "timings.scrape_after_s = 3 is not a duration"),
        (("serving", "tensor_parallel_size"), -0.0, "its serving.tensor_parallel_size is -0.0"),
        (("serving", "num_speculative_tokens"), "3", 'its serving.num_speculative_tokens is "3", not the 3'),
        (("serving", "concurrency"), 64, "its serving.concurrency is 64"),
        (("serving", "observed_in_metrics"), 0, "serving.observed_in_metrics is not a mapping"),
        (("sampling", "max_tokens"), None, "its sampling.max_tokens is null"),
        (("serving", "source"), "made up", "its serving source 'made up' is not one validate writes"),
    ],
)
def test_the_fuzzers_findings_are_refused_with_their_field(
    gated_wheel: tuple[Path, dict[str, Any]], root: Path, tmp_path: Path, path: tuple[str, ...], value: Any, words: str
) -> None:
    """What the report fuzzer found publishing with exit 0 (issue 42: non-counter fields typed and bounded): a
    resealed report whose timings are no durations, or whose serving or sampling sections are not the ones the
    profile gives, is refused in one line naming the field. The control: the untouched report publishes."""
    import copy

    wheel, base = gated_wheel
    assert _publish(root, tmp_path / "ok", wheel, copy.deepcopy(base)).code == 0
    body = copy.deepcopy(base)
    _set(body, path, value)
    (tmp_path / "bad").mkdir()
    ending = _publish(root, tmp_path / "bad", wheel, body)
    ending.check()
    errors = [line for line in ending.err.splitlines() if line.startswith("error:")]
    assert ending.code == 12 and len(errors) == 1 and words in errors[0], ending.err
