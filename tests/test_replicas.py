"""How validate treats the servers behind a router (quick tier): `--metrics` names each replica, their counters are
read and added up, every request the run sent must be finished on exactly one of them, and a replica that does not
answer is exit 28. The servers here are fakes on loopback that count like vLLM (the test is about how we treat their
answers); tests/test_cpu_image.py runs the same behind the real vllm-router, with real replicas."""

from __future__ import annotations

import itertools
import json
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from vllm_dflash import report as reports
from vllm_dflash.cli import main
from vllm_dflash.errors import MeasurementError, ReplicaDownError
from vllm_dflash.validate import metrics

K = 3
PROFILE = f"""
[profiles.fleet]
target = "tiny"
method = "ngram"
num_speculative_tokens = {K}
thinking = false
max_tokens = 8
min_acceptance_length = 1.5
prompts = "humaneval"
"""


class Replica:
    """A fake vLLM replica: every chat completion drafts twice (K tokens each) and accepts `accept` tokens per draft,
    counted in its /metrics as vLLM counts them (with vllm:request_success)."""

    def __init__(self, accept: int) -> None:
        self.accept = accept
        self.requests = 0
        self.lock = threading.Lock()

    def metrics(self) -> str:
        n, a = self.requests, self.accept
        pos = "".join(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}} {2 * n if p < a else 0}.0\n'
            for p in range(K)
        )
        return (
            "# TYPE vllm:spec_decode_num_drafts_total counter\n"
            f"vllm:spec_decode_num_drafts_total {2 * n}.0\n"
            "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
            f"vllm:spec_decode_num_draft_tokens_total {2 * K * n}.0\n"
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
            f"vllm:spec_decode_num_accepted_tokens_total {2 * a * n}.0\n"
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n" + pos + ""
            "# TYPE vllm:generation_tokens_total counter\n"
            f"vllm:generation_tokens_total {8 * n}.0\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="length"}} {n}.0\n'
        )


def _handler(replica: Replica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(replica.metrics().encode(), "text/plain")
            elif self.path == "/v1/models":
                self._send(json.dumps({"data": [{"id": "tiny"}]}).encode())
            elif self.path == "/version":
                self._send(b'{"version": "0.20.1"}')
            else:
                self._send(b"{}")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with replica.lock:
                replica.requests += 1
            answer = {"choices": [{"message": {"content": "abcdefgh"}}], "usage": {"completion_tokens": 8}}
            self._send(json.dumps(answer).encode())

    return Handler


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _router(workers: list[str]) -> type[BaseHTTPRequestHandler]:
    """Round robin for completions; every GET to the first worker (as vllm-router answers /metrics: one worker's)."""
    turn = itertools.cycle(workers)

    class Router(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _relay(self, url: str, data: bytes | None) -> None:
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                body = resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._relay(workers[0] + self.path, None)

        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._relay(next(turn) + self.path, data)

    return Router


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, str, str, Replica, Replica]]:
    a, b = Replica(accept=2), Replica(accept=1)
    with serving(_handler(a)) as ua, serving(_handler(b)) as ub, serving(_router([ua, ub])) as router:
        yield router, ua, ub, a, b


def _validate(tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(6)))
    profile = tmp_path / "profiles.toml"
    profile.write_text(PROFILE)
    report = tmp_path / "report.json"
    code = main(["validate", "--profile", "fleet", "--profile-file", str(profile), "--prompts", str(prompts),
                 "--report", str(report), "--quiet", *args])  # fmt: skip
    return code, (json.loads(report.read_text()) if report.is_file() else {})


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(err) == 1, err
    return err[0]


def test_both_replicas_are_read_and_added_up(tmp_path: Path, fleet: tuple[str, str, str, Replica, Replica]) -> None:
    router, ua, ub, a, b = fleet
    code, report = _validate(tmp_path, "--endpoint", router, "--metrics", ua, "--metrics", f"{ub}/metrics/")
    assert code == 0, report.get("error")
    assert (a.requests, b.requests) == (3, 3)
    rows = report["replicas"]
    assert isinstance(rows, list) and [r["metrics"] for r in rows] == [f"{ua}/metrics", f"{ub}/metrics"]
    assert [r["counters"]["num_accepted_tokens"] for r in rows] == [2 * 2 * 3, 2 * 1 * 3]
    delta = report["counters"]["delta"]  # type: ignore[index]
    assert delta["num_drafts"] == 12 and delta["num_accepted_tokens"] == 18
    # AL from both: 1 + 18 / 12; either replica alone would say 3.0 or 2.0
    assert report["acceptance"]["mean_acceptance_length"] == 2.5  # type: ignore[index]
    # What every reader of the report checks again: the replicas add up to the delta the verdict is judged on.
    assert reports.measurement_problem(report) is None
    rows[1]["counters"]["num_drafts"] += 2
    assert "replicas' num_drafts add up to 14, its delta says 12" in str(reports.measurement_problem(report))
    rows[1]["counters"]["num_drafts"] -= 2
    rows[0]["counters"]["num_accepted_tokens_per_pos"]["0"] -= 1
    assert "num_accepted_tokens_per_pos[0] do not add up" in str(reports.measurement_problem(report))


def test_the_routers_own_metrics_are_refused(
    tmp_path: Path, fleet: tuple[str, str, str, Replica, Replica], capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --metrics, the router's /metrics is one replica's: it counts 3 of the 6 requests, and validate says
    so (exit 2) instead of judging half the fleet."""
    router, *_ = fleet
    code, report = _validate(tmp_path, "--endpoint", router)
    assert code == MeasurementError.return_code and report["verdict"] == "error"
    assert "counts 3 finished requests of the 6" in _one_error(capsys)


@pytest.mark.parametrize("case", ["missing", "twice"])
def test_a_replica_left_out_or_counted_twice_is_refused(
    case: str, tmp_path: Path, fleet: tuple[str, str, str, Replica, Replica], capsys: pytest.CaptureFixture[str]
) -> None:
    router, ua, ub, *_ = fleet
    alias = ua.replace("127.0.0.1", "localhost")
    args = ["--metrics", ua] if case == "missing" else ["--metrics", ua, "--metrics", alias, "--metrics", ub]
    code, report = _validate(tmp_path, "--endpoint", router, *args)
    assert code == MeasurementError.return_code and report["verdict"] == "error"
    line = _one_error(capsys)
    assert ("missing from --metrics" if case == "missing" else "named twice") in line, line
    assert "count 3 finished requests" in line if case == "missing" else "count 9 finished requests" in line


def test_the_same_url_twice_is_refused_before_anything_runs(
    tmp_path: Path, fleet: tuple[str, str, str, Replica, Replica], capsys: pytest.CaptureFixture[str]
) -> None:
    router, ua, _, a, _b = fleet
    code, _ = _validate(tmp_path, "--endpoint", router, "--metrics", ua, "--metrics", ua + "/")
    assert code == MeasurementError.return_code and a.requests == 0
    assert "is given twice" in _one_error(capsys)
    code, _ = _validate(tmp_path, "--metrics", ua)  # no endpoint: nothing to be behind
    assert code == MeasurementError.return_code and "pass --endpoint" in _one_error(capsys)


def test_a_replica_that_is_down_exits_28(
    tmp_path: Path, fleet: tuple[str, str, str, Replica, Replica], capsys: pytest.CaptureFixture[str]
) -> None:
    router, ua, _, a, _b = fleet
    with serving(_handler(Replica(1))) as gone:
        pass  # served, then shut: its port refuses connections now
    code, report = _validate(tmp_path, "--endpoint", router, "--metrics", ua, "--metrics", gone)
    assert code == ReplicaDownError.return_code == 28 and report["verdict"] == "error"
    line = _one_error(capsys)
    assert line.startswith(f"error: replica {gone} is down") and "--metrics" in line, line
    assert a.requests == 0  # found before a request was sent


def test_a_replicas_finished_requests_are_read() -> None:
    """The fake replica's /metrics carries vllm:request_success as vLLM's does (tests/test_metrics.py adds them up)."""
    assert metrics.parse_spec_counters(Replica(2).metrics()).finished_requests == 0
