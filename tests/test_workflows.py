"""The users' GitHub Actions workflows in ci/: schema-valid, zizmor-clean, actions pinned by SHA, least privilege.

Each linter is also run on a deliberately bad workflow, so a linter that silently checks nothing fails the test.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((REPO / "ci").glob("*.yml"))
SHA_PIN = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}$")
BAD_WORKFLOW = """\
name: bad
on: pull_request_target
jobs:
  j:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.pull_request.title }}"
"""


def _tool(name: str) -> str:
    """The linter from this interpreter's environment (the test extra), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(args))
    return subprocess.run(args, capture_output=True, text=True, check=False)


def _load(path: Path) -> Any:
    from ruamel.yaml import YAML  # check-jsonschema's YAML parser (test extra)

    return YAML(typ="safe").load(path.read_text())


def test_the_three_workflows_exist() -> None:
    assert [p.name for p in WORKFLOWS] == ["build.yml", "upstream-watch.yml", "validate.yml"]


def test_workflows_match_the_github_schema(tmp_path: Path) -> None:
    tool = _tool("check-jsonschema")
    res = _run(tool, "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS))
    assert res.returncode == 0, res.stdout + res.stderr
    # Negative control: a job without runs-on is not a workflow the schema accepts.
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  j:\n    steps:\n      - run: true\n")
    assert _run(tool, "--builtin-schema", "vendor.github-workflows", str(broken)).returncode != 0


def _zizmor(*paths: Path) -> list[dict[str, Any]]:
    res = _run(_tool("zizmor"), "--offline", "--format", "json", *map(str, paths))
    # zizmor exits non-zero when it has findings; the JSON on stdout is what we judge.
    assert res.stdout.strip().startswith("["), res.stdout + res.stderr
    findings: list[dict[str, Any]] = json.loads(res.stdout)
    return findings


def test_zizmor_finds_nothing_above_low(tmp_path: Path) -> None:
    findings = _zizmor(*WORKFLOWS)
    serious = [
        (f["ident"], f["determinations"]["severity"], f["locations"][0]["concrete"]["feature"])
        for f in findings
        if f["determinations"]["severity"].lower() in ("medium", "high")
    ]
    assert serious == []
    # Negative control: the same run flags unpinned actions and template injection in a bad workflow.
    bad = tmp_path / "bad.yml"
    bad.write_text(BAD_WORKFLOW)
    idents = {f["ident"] for f in _zizmor(bad) if f["determinations"]["severity"].lower() == "high"}
    assert {"unpinned-uses", "template-injection"} <= idents


def _steps(doc: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(job, step) for job, body in doc["jobs"].items() for step in body.get("steps", [])]


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_pinned_by_full_sha_with_version_comment(path: Path) -> None:
    uses = [step["uses"] for _, step in _steps(_load(path)) if "uses" in step]
    assert uses, f"{path.name} uses no action at all"
    for u in uses:
        assert SHA_PIN.match(u), f"{path.name}: '{u}' is not pinned to a 40-hex commit SHA"
    text = path.read_text()
    for line in text.splitlines():
        if re.search(r"\buses:\s", line):
            assert re.search(r"@[0-9a-f]{40}\s+#\s*v\d", line), f"{path.name}: no '# vX.Y' note on: {line.strip()}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_least_privilege_and_no_expressions_in_scripts(path: Path) -> None:
    doc = _load(path)
    assert doc["permissions"] == {}, f"{path.name}: top-level permissions must be empty"
    for name, job in doc["jobs"].items():
        perms = job.get("permissions")
        assert isinstance(perms, dict), f"{path.name}: job {name} must declare its permissions"
        writes = {k for k, v in perms.items() if v == "write"}
        allowed = {"issues"} if path.name == "upstream-watch.yml" else set()
        assert writes <= allowed, f"{path.name}: job {name} writes {writes - allowed}"
    for job, step in _steps(doc):
        # Inputs, titles, variables reach scripts only through env: never expanded into the script text.
        assert "${{" not in step.get("run", ""), f"{path.name}: job {job} expands an expression inside run:"
        if "actions/checkout@" in step.get("uses", ""):
            assert step.get("with", {}).get("persist-credentials") is False


def test_validate_runs_on_configurable_self_hosted_gpu_and_publishes_only_after_validate() -> None:
    doc = _load(REPO / "ci" / "validate.yml")
    job = doc["jobs"]["validate"]
    assert job["runs-on"][0] == "self-hosted"
    assert "inputs.runner-label" in job["runs-on"][1] and "vars." in job["runs-on"][1]
    runs = [s.get("run", "") for s in job["steps"]]
    i_validate = next(i for i, r in enumerate(runs) if "vllm-dflash validate --profile" in r)
    i_publish = next(i for i, r in enumerate(runs) if "vllm-dflash publish" in r)
    assert i_validate < i_publish
    assert "--report" in runs[i_publish]
    publish = job["steps"][i_publish]
    assert "success()" in publish["if"] and "inputs.publish" in publish["if"]
    assert doc["on"]["workflow_dispatch"]["inputs"]["profile"]["default"] == "qwen3.6-27b"
    assert set(doc["on"]) == {"workflow_dispatch"}, "untrusted pull requests must never reach the GPU runner"


def test_upstream_watch_checks_latest_and_main_and_dedups_one_issue_by_title() -> None:
    doc = _load(REPO / "ci" / "upstream-watch.yml")
    assert "schedule" in doc["on"]
    job = doc["jobs"]["watch"]
    script = "\n".join(s.get("run", "") for s in job["steps"])
    assert "upstream --against latest" in script and "upstream --against main" in script
    assert "select(.title == env.ISSUE_TITLE)" in script
    assert "gh issue edit" in script and "gh issue create" in script
    assert job["env"]["ISSUE_TITLE"]


def test_build_tests_builds_uploads_and_caches_downloads() -> None:
    doc = _load(REPO / "ci" / "build.yml")
    assert {"push", "pull_request"} <= set(doc["on"])
    steps = doc["jobs"]["build"]["steps"]
    text = json.dumps(steps)
    assert ".ci/run" in text and "vllm-dflash build" in text
    cache = next(s for s in steps if "actions/cache@" in s.get("uses", ""))
    assert cache["with"]["path"] == "~/.cache/vllm-dflash"
    upload = next(s for s in steps if "actions/upload-artifact@" in s.get("uses", ""))
    assert upload["with"]["path"] == "dist/*.whl"
