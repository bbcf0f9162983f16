"""How the doctor talks to its columns and reads their answers (issue 39), without vLLM: the JSON-lines protocol on
pipes and as a server (a toy side that answers with what it was asked), the server outliving the doctor run that
started it and a client that only checks it is there, then leaving when idle; and how a 2026 field's effect is
measured from a build's answers with and without it. The columns' real code runs in tests/test_doctor*.py."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash.doctor import columns as col
from vllm_dflash.doctor import fields as F
from vllm_dflash.doctor import sides

REPO = Path(__file__).resolve().parents[1]

TOY = """
import os, sys
from vllm_dflash.doctor.vllm_side import serve_lines

def answer(request):
    if request is None:
        return {"pid": os.getpid()}
    print("a log line vLLM would print", flush=True)  # must never reach the protocol
    return {"pid": os.getpid(), "echo": request["config"]}

sys.exit(serve_lines(answer))
"""


yield_dir: list[Path] = []


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sides.Column]:
    (tmp_path / "toy_side.py").write_text(TOY)
    short = Path(tempfile.mkdtemp(prefix="vd-", dir="/tmp"))  # a unix socket's path is at most 107 bytes
    monkeypatch.setenv("VLLM_DFLASH_CACHE", str(short))
    yield_dir.append(short)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    yield sides.Column("toy", "toy_side", Path(sys.executable), env, "a toy side")
    shutil.rmtree(yield_dir.pop(), ignore_errors=True)


def _pids(answers: dict[str, list[dict[str, Any]]]) -> set[int]:
    return {a["pid"] for a in answers["toy"]}


def test_pipes_answer_a_batch_in_order_and_keep_logs_off_the_protocol(toy: sides.Column) -> None:
    requests = [{"config": {"n": i}} for i in range(30)]
    with sides.Sides({"toy": toy}, cache=False) as s:
        got = s.ask(requests)["toy"]
    assert [a["echo"] for a in got] == [{"n": i} for i in range(30)]


def test_a_server_outlives_its_run_and_a_probe_then_leaves_when_idle(
    toy: sides.Column, capsys: pytest.CaptureFixture[str]
) -> None:
    """The warm doctor: a second run (a new Sides) reaches the server the first started, after a client that only
    connected and left (what _connectable does); the server exits after `idle` seconds without a client."""
    with sides.Sides({"toy": toy}, cache=False, idle=3) as s:
        first = _pids(s.ask([{"config": {"n": 1}}, {"config": {"n": 2}}]))
    sock = next((Path(os.environ["VLLM_DFLASH_CACHE"]) / "doctor" / "sides").glob("*.sock"))
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:  # connect and leave at once
        probe.connect(str(sock))
    with sides.Sides({"toy": toy}, cache=False, idle=3) as s:
        again = s.ask([{"config": {"n": 3}}] * 5)
    assert _pids(again) == first and len(first) == 1  # the same process answered both runs
    assert capsys.readouterr().err.count("starting the toy column") == 1  # and only one was ever started
    assert [a["echo"] for a in again["toy"]] == [{"n": 3}] * 5
    deadline = time.monotonic() + 30
    while sock.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not sock.exists()  # idle: gone, its socket with it
    pid = next(iter(first))
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_answers_are_cached_by_digest(toy: sides.Column) -> None:
    with sides.Sides({"toy": toy}) as s:
        first = s.ask([{"config": {"n": 1}}])["toy"][0]
    with sides.Sides({"toy": toy}) as s:
        again = s.ask([{"config": {"n": 1}}])["toy"][0]
        assert s.started == []  # read from the cache: no process
        other = s.ask([{"config": {"n": 2}}])["toy"][0]
    assert again == first and other["echo"] == {"n": 2}


def test_a_side_that_dies_is_one_error_with_its_last_lines(tmp_path: Path, toy: sides.Column) -> None:
    (tmp_path / "toy_side.py").write_text("import sys\nprint('cannot import vllm: broken env', file=sys.stderr)\n")
    with pytest.raises(sides.SideError, match="broken env"), sides.Sides({"toy": toy}, cache=False) as s:
        s.ask([{"config": {}}])


# ---- a 2026 field's effect, from a build's answers with and without it ------------------------------------------


def _answer(**rec: Any) -> dict[str, Any]:
    base = {"layers": [{"kind": col.FULL, "window": None, "causal": False, "rope": {"is_neox_style": True}}]}
    return {"runners": {"default": {**base, **rec}}}


def test_measurement_reads_ignores_refuses_and_not_built_here() -> None:
    plain = _answer()
    neox = _answer(layers=[{"kind": col.FULL, "window": None, "causal": False, "rope": {"is_neox_style": False}}])
    refused = _answer(model_error="ValueError: sample_from_anchor=True is not supported for DFlash.")
    unbuilt = _answer(model_error="ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.")
    either = _answer(load_error="ValueError: no window")
    m = F.measure(
        {
            "this build": plain,
            "upstream 0.34.0": neox,
            "upstream 0.33.0": refused,
            "stock 0.20.1": unbuilt,
            "x": either,
        },
        {
            "is_neox_style": {
                "this build": plain,
                "upstream 0.34.0": plain,
                "upstream 0.33.0": plain,
                "stock 0.20.1": plain,
                "x": either,
            }
        },
    )["is_neox_style"].effects
    assert m["this build"] == "ignores it"
    assert m["upstream 0.34.0"].startswith("reads it: default.layers[0].rope.is_neox_style: false")
    assert m["upstream 0.33.0"].startswith("refuses it: default.model_error")
    assert m["stock 0.20.1"].startswith("not computed: not built here")
    assert m["x"].startswith("not computed: it refuses the config with the field and without it")


def test_a_field_this_build_ignores_and_upstream_reads_blocks(tmp_path: Path) -> None:
    """The verdict from the measurement: ignored here and read by 0.34.0 -> changes the computation (exit 22's
    list); read here -> read; read by no build -> no build we know (exit 23's)."""
    raw = {"is_neox_style": False, "logit_scale": 0.5, "no_rope_layers": [0, 2]}
    reads = F.Measured("is_neox_style", {"this build": "ignores it", "upstream 0.34.0": "reads it: rope"})
    ours = F.Measured("logit_scale", {"this build": "reads it: scale", "upstream 0.34.0": "reads it: scale"})
    none = F.Measured("no_rope_layers", {"this build": "ignores it", "upstream 0.34.0": "ignores it"})
    got = F.classify(raw, measured={"is_neox_style": reads, "logit_scale": ours, "no_rope_layers": none})
    assert [h.name for h in got.blocking] == ["is_neox_style"] and "measured" in got.blocking[0].feature.reader
    assert any(x.startswith("logit_scale = 0.5 (read by this build") for x in got.harmless)
    assert [u.split(" = ")[0] for u in got.unknown] == ["no_rope_layers"]
    # the control: the same fields, every build ignoring them -> nothing blocks
    calm = {k: F.Measured(k, {"this build": "ignores it", "upstream 0.34.0": "ignores it"}) for k in raw}
    assert not F.classify(raw, measured=calm).blocking


def test_ablations_cover_every_spelling_present() -> None:
    raw = {"use_aux_hidden_state": False, "dflash_config": {"use_aux_hidden_state": False, "sample_from_anchor": True}}
    paths = [p for p, _ in F.ablations(raw)]
    assert paths == ["use_aux_hidden_state", "dflash_config.use_aux_hidden_state", "dflash_config.sample_from_anchor"]
    for path, without in F.ablations(raw):
        head, _, rest = path.partition(".")
        assert (rest not in without[head]) if rest else (head not in without)
        assert {k: v for k, v in raw.items() if k != head} == {k: v for k, v in without.items() if k != head}


def test_a_side_that_never_answers_is_stopped(
    tmp_path: Path, toy: sides.Column, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No endless wait: a config that makes a build's code wait (a hub retry loop did, before the sides ran offline)
    ends in one error after the bound, pipes and server alike, and the silent process is stopped."""
    silent = TOY.replace('    print("a log', '    import time; time.sleep(60)\n    print("a log')
    (tmp_path / "toy_side.py").write_text(silent)
    monkeypatch.setattr(sides, "SIDE_TIMEOUT_S", 2)
    for idle in (0.0, 30.0):
        started = time.monotonic()
        with (
            pytest.raises(sides.SideError, match="answered nothing for 2 s"),
            sides.Sides({"toy": toy}, cache=False, idle=idle) as s,
        ):
            s.ask([{"config": {"n": 1}}])
        assert time.monotonic() - started < 30


def test_a_long_batch_of_slow_answers_reaches_the_server_whole(
    tmp_path: Path, toy: sides.Column, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch larger than the socket's buffers, answered more slowly in all than the per-answer bound but each answer
    well within it (the differential's 300 configs on the upstream 0.33.0 column, 2 s a refused config): every answer
    comes back. Sent with one sendall, the send itself timed out after the bound and the batch never ended."""
    slow = TOY.replace('    print("a log', '    import time; time.sleep(0.05)\n    print("a log')
    (tmp_path / "toy_side.py").write_text(slow)
    monkeypatch.setattr(sides, "SIDE_TIMEOUT_S", 2)
    pad = "x" * 20_000  # 60 requests of 20 kB: more than a unix socket holds, answered in about 3 s
    requests = [{"config": {"n": i, "pad": pad}} for i in range(60)]
    with sides.Sides({"toy": toy}, cache=False, idle=30.0) as s:
        got = s.ask(requests)["toy"]
    assert [a["echo"]["n"] for a in got] == list(range(60))


def test_two_doctor_runs_at_once_are_both_served(
    tmp_path: Path, toy: sides.Column, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two doctor runs on one column's server: the second's one config is answered while the first's long batch is
    still being answered (the server serves each client on its own thread; one client at a time made the second wait
    for the whole batch, or past the bound), and neither gets the other's answers."""
    import threading

    slow = TOY.replace('    print("a log', '    import time; time.sleep(0.1)\n    print("a log')
    (tmp_path / "toy_side.py").write_text(slow)
    done: dict[str, float] = {}
    got: dict[str, list[dict[str, Any]]] = {}
    with sides.Sides({"toy": toy}, cache=False, idle=30.0) as warm:  # the server up before either run
        warm.ask([{"config": {"n": -1}}])

    def run(name: str, requests: list[dict[str, Any]]) -> None:
        with sides.Sides({"toy": toy}, cache=False, idle=30.0) as s:
            got[name] = s.ask(requests)["toy"]
        done[name] = time.monotonic()

    first = threading.Thread(target=run, args=("long", [{"config": {"n": i}} for i in range(40)]))  # about 4 s
    first.start()
    time.sleep(0.5)
    second = threading.Thread(target=run, args=("short", [{"config": {"n": "short"}}]))
    second.start()
    first.join(60)
    second.join(60)
    assert [a["echo"]["n"] for a in got["long"]] == list(range(40))
    assert [a["echo"]["n"] for a in got["short"]] == ["short"]
    assert done["short"] < done["long"] - 1.0, "the second run waited for the first's whole batch"


FAKE_RETRY = """
ATTEMPTS = []

def with_retry(func, log_msg, max_retries=2, retry_delay=2, fatal_errors=()):
    for attempt in range(max_retries):
        ATTEMPTS.append(attempt)
        try:
            return func()
        except Exception:
            if attempt == max_retries - 1:
                raise
"""

FAKE_CONFIG = """
from .repo_utils import with_retry

def get_config():
    def parse():
        raise ValueError("a config this release refuses")
    return with_retry(parse, "Error parsing config")
"""


def test_a_refused_config_is_parsed_once_in_a_side(tmp_path: Path) -> None:
    """vLLM 0.33+'s get_config parses through with_retry (two tries, 2 s apart): in a side process the parse is tried
    once, and what it raises is what the release raises. A fake release of the same shape (the config module holds
    the function by name, as 0.33.0's and 0.34.0's do), in a subprocess: the side's own process is the only one
    changed."""
    pkg = tmp_path / "vllm" / "transformers_utils"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "repo_utils.py").write_text(FAKE_RETRY)
    (pkg / "config.py").write_text(FAKE_CONFIG)
    probe = (
        "from vllm_dflash.doctor.vllm_side import _parse_once\n"
        "from vllm.transformers_utils import config, repo_utils\n"
        "_parse_once()\n"
        "try:\n    config.get_config()\nexcept ValueError as exc:\n    print(len(repo_utils.ATTEMPTS), exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1 a config this release refuses"


def test_a_runner_that_cannot_compute_the_taps_is_a_refusal() -> None:
    """String target_layer_ids: the drafter builds on the meta device, but the runner's own aux-layer function (called
    by `vllm serve` in load_model) raises on `"1" + 1`. The column answered both; the reading said "served" (the taps
    error was dropped), where upstream 0.34.0, computing its fc width with the same function, refused."""
    rec: dict[str, Any] = {**_answer()["runners"]["default"]}
    answer = {"vllm_version": "0.20.1", "runners": {"default": rec}}
    rec["taps_error"] = 'TypeError: can only concatenate str (not "int") to str'
    r = col.from_vllm(col.OURS, answer)
    assert r.refusal is not None and r.refusal.stage == "model"
    assert "aux layers" in r.refusal.line and "concatenate str" in r.refusal.line
    del rec["taps_error"]
    assert col.from_vllm(col.OURS, answer).refusal is None
