"""The deployment manifests (vllm_dflash/release/deploy.py, deploy/): generated from the qwen3.6-27b profile, the
full `vllm serve` line each stack runs, the image by digest, and checked offline against the real schemas
(tests/schemas/README.md names their sources) made strict, so that a misspelt field fails."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ModuleTmp

from vllm_dflash.errors import VerifyError
from vllm_dflash.manifest import load_manifest
from vllm_dflash.release import deploy
from vllm_dflash.release.notes import ImageRef

REPO = Path(__file__).resolve().parent.parent
SCHEMAS = REPO / "tests" / "schemas"
SCHEMA_OF = {
    deploy.PRODUCTION_STACK: "production-stack.values.schema.json",
    deploy.SERVING_RUNTIME: "kserve-servingruntime.v1alpha1.schema.json",
    deploy.LLM_INFERENCE_SERVICE: "kserve-llminferenceservice.v1alpha2.schema.json",
}
IMAGE = ImageRef("ghcr.io/example/vllm-dflash", "sha256:" + "ab" * 32)
PROFILES = load_manifest(REPO).profiles
PROFILE = PROFILES[deploy.PROFILE]


def strict(schema: Any) -> Any:
    """The schema as the controller applies it: an object that lists its properties takes no others (Kubernetes
    prunes unknown fields of a CRD, Helm ignores unknown values: either way a misspelt field does nothing)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def strict_schemas(module_tmp: ModuleTmp) -> dict[str, Path]:
    d = module_tmp("schemas")
    out = {}
    for name, file in SCHEMA_OF.items():
        path = d / file
        path.write_text(json.dumps(strict(json.loads((SCHEMAS / file).read_text()))))
        out[name] = path
    return out


def check_jsonschema(schema: Path, doc: Any, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    instance = tmp_path / "instance.json"
    instance.write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), str(instance)]
    print("+", shlex.join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout + done.stderr, file=sys.stderr)
    return done


def docs(image: ImageRef = IMAGE) -> dict[str, Any]:
    return {n: json.loads(b) for n, b in deploy.manifests(PROFILES, image).items()}


def test_repository_deploy_is_generated_from_dist_toml() -> None:
    """deploy/ is what dist.toml's profile gives (with the placeholder image): retyping it by hand shows here."""
    expected = deploy.manifests(PROFILES, deploy.TEMPLATE_IMAGE)
    got = {p.name: p.read_bytes() for p in (REPO / deploy.TEMPLATE_DIR).iterdir()}
    assert got == expected, (
        "deploy/ is stale: regenerate it with python -c 'from pathlib import Path; from vllm_dflash.manifest import "
        "load_manifest; from vllm_dflash.release.deploy import write_templates; "
        'write_templates(load_manifest(Path(".")), Path("."))\''
    )


def _serve_lines() -> Iterator[tuple[str, list[str]]]:
    """Each manifest's `vllm serve` arguments (after `serve`), as the stack will run them."""
    d = docs()
    ps = d[deploy.PRODUCTION_STACK]["servingEngineSpec"]["modelSpec"][0]
    # The chart's own prefix (deployment-vllm-multi.yaml): vllm serve <modelURL> --host 0.0.0.0 --port 8000.
    yield "production-stack", [ps["modelURL"], "--host", "0.0.0.0", "--port", "8000", *ps["vllmConfig"]["extraArgs"]]
    sr = d[deploy.SERVING_RUNTIME]["spec"]["containers"][0]
    assert sr["command"][:2] == ["bash", "-c"]
    words = shlex.split(sr["command"][2])
    assert words[:3] == ["exec", "vllm", "serve"]
    yield "servingruntime", words[3:]
    li = d[deploy.LLM_INFERENCE_SERVICE]["spec"]["template"]["containers"][0]
    assert li["command"] == ["vllm", "serve"]
    yield "llminferenceservice", li["args"]


def test_each_manifest_serves_the_profile() -> None:
    """The speculative config and every serve argument of the profile, in each stack's full command; TP, no PP."""
    lines = dict(_serve_lines())
    assert set(lines) == {"production-stack", "servingruntime", "llminferenceservice"}
    for stack, args in lines.items():
        spec = json.loads(args[args.index("--speculative-config") + 1])
        assert spec == PROFILE.speculative_config, stack
        assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 15
        joined = " ".join(args)
        assert " ".join(PROFILE.serve_args) in joined, stack
        assert "--tensor-parallel-size" in args and "--pipeline-parallel-size" not in args, stack
        assert args[0] == (PROFILE.target if stack == "production-stack" else "/mnt/models"), stack


def test_image_by_digest() -> None:
    d = docs()
    ps = d[deploy.PRODUCTION_STACK]["servingEngineSpec"]["modelSpec"][0]
    # The chart writes "repository:tag": so the reference is repo@sha256:<hex>.
    assert f"{ps['repository']}:{ps['tag']}" == f"{IMAGE.repository}@{IMAGE.digest}"
    assert d[deploy.SERVING_RUNTIME]["spec"]["containers"][0]["image"] == f"{IMAGE.repository}@{IMAGE.digest}"
    li = d[deploy.LLM_INFERENCE_SERVICE]["spec"]["template"]["containers"][0]
    assert li["image"] == f"{IMAGE.repository}@{IMAGE.digest}"


def test_deploy_image_choice() -> None:
    index = ImageRef("r.example.com/x", "sha256:" + "1" * 64)
    x86 = ImageRef("r.example.com/x", "sha256:" + "2" * 64, "x86_64")
    arm = ImageRef("r.example.com/x", "sha256:" + "3" * 64, "aarch64")
    assert deploy.deploy_image([x86, index, arm]) == index
    assert deploy.deploy_image([arm, x86]) == x86
    assert deploy.deploy_image([arm]) == arm
    with pytest.raises(VerifyError):
        deploy.deploy_image([])


# A misspelt field (each one the controller would drop without a word) and where it sits.
MISSPELT: dict[str, tuple[tuple[str | int, ...], str, str]] = {
    deploy.PRODUCTION_STACK: (("servingEngineSpec", "modelSpec", 0), "replicaCount", "replicaCont"),
    deploy.SERVING_RUNTIME: (("spec",), "supportedModelFormats", "supportedModelFormat"),
    deploy.LLM_INFERENCE_SERVICE: (("spec", "template", "containers", 0), "command", "comand"),
}


def _misspell(doc: Any, name: str) -> Any:
    where, good, bad = MISSPELT[name]
    out = copy.deepcopy(doc)
    node = out
    for key in where:
        node = node[key]
    node[bad] = node.pop(good)
    return out


@pytest.mark.parametrize("name", deploy.NAMES)
def test_schema_check_passes_and_a_misspelt_field_fails(
    name: str, strict_schemas: dict[str, Path], tmp_path: Path
) -> None:
    doc = docs()[name]
    ok = check_jsonschema(strict_schemas[name], doc, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = check_jsonschema(strict_schemas[name], _misspell(doc, name), tmp_path)
    assert bad.returncode != 0
    assert MISSPELT[name][2] in bad.stdout + bad.stderr


def test_upstream_schema_alone_lets_the_misspelling_through(tmp_path: Path) -> None:
    """Why the tests add strictness: the vendored schema as published accepts the misspelt production-stack field."""
    doc = _misspell(docs()[deploy.PRODUCTION_STACK], deploy.PRODUCTION_STACK)
    loose = check_jsonschema(SCHEMAS / SCHEMA_OF[deploy.PRODUCTION_STACK], doc, tmp_path)
    assert loose.returncode == 0, loose.stdout + loose.stderr


def _pods() -> Iterator[tuple[str, dict[str, Any]]]:
    """The core kinds inside the KServe resources: each container set as the Pod the controller will make."""
    d = docs()
    sr = d[deploy.SERVING_RUNTIME]["spec"]
    yield "servingruntime", {"containers": sr["containers"], "volumes": sr["volumes"]}
    yield "llminferenceservice", d[deploy.LLM_INFERENCE_SERVICE]["spec"]["template"]


def kubernetes_validate(doc: Any, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "pod.json"
    path.write_text(json.dumps(doc))
    exe = Path(sys.executable).parent / "kubernetes-validate"
    cmd = [str(exe), "--strict", str(path)]
    print("+", shlex.join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(done.stdout + done.stderr, file=sys.stderr)
    return done


@pytest.mark.parametrize("stack", ["servingruntime", "llminferenceservice"])
def test_core_kinds_validate_and_a_misspelt_field_fails(stack: str, tmp_path: Path) -> None:
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
    spec = dict(_pods())[stack]
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-dflash"}, "spec": spec}
    ok = kubernetes_validate(pod, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = copy.deepcopy(pod)
    container = bad["spec"]["containers"][0]
    container["imag"] = container.pop("image")
    failed = kubernetes_validate(bad, tmp_path)
    assert failed.returncode != 0 and "imag" in failed.stdout + failed.stderr


def test_verify_check_refuses_an_edited_manifest() -> None:
    good = deploy.manifests(PROFILES, IMAGE)
    deploy.check(good, [IMAGE], PROFILES)
    edited = dict(good)
    edited[deploy.SERVING_RUNTIME] = good[deploy.SERVING_RUNTIME].replace(b"16384", b"32768")
    with pytest.raises(VerifyError, match="not what dist"):
        deploy.check(edited, [IMAGE], PROFILES)
    other = ImageRef(IMAGE.repository, "sha256:" + "cd" * 32)
    with pytest.raises(VerifyError, match="does not pull"):
        deploy.check(good, [other], {})
    with pytest.raises(VerifyError, match="missing"):
        deploy.check({deploy.PRODUCTION_STACK: good[deploy.PRODUCTION_STACK]}, [IMAGE], PROFILES)
    with pytest.raises(VerifyError, match="names no image"):
        deploy.check(good, [], PROFILES)


# The production-stack chart the values are rendered with, vendored under tests/charts/ (GitHub, its only source, is
# out of reach of CI): vllm-project/production-stack@a6c01db05f65f556235413ba8dbcfb0c01132fff:helm, pinned by the
# sha256 of `sha256sum` over its files, sorted by path.
CHART_FILES_SHA256 = "4d212a8b87f67ea5cef9e6e209cbe0be6be0042d5f3e06d4e62235d495235017"
CHART = REPO / "tests" / "charts" / "production-stack" / "helm"


def _files_digest(root: Path) -> str:
    import hashlib

    lines = "".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(root.parent).as_posix()}\n"
        for p in sorted(root.rglob("*"), key=lambda p: p.relative_to(root.parent).as_posix())
        if p.is_file()
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def _production_stack_chart() -> Path:
    """The vendored chart's helm/ directory, checked against its pin (an edited copy is not the chart we name)."""
    assert _files_digest(CHART) == CHART_FILES_SHA256, f"{CHART.relative_to(REPO)} is not the pinned chart"
    return CHART


@pytest.mark.heavy
def test_production_stack_chart_renders_the_full_command(tmp_path: Path) -> None:
    """The real chart, rendered offline by helm-python-sdk (Helm's engine, no helm binary): its Deployment is a
    valid core kind, runs `vllm serve <model> --host 0.0.0.0 --port 8000 …` with the profile's arguments, pulls
    the image by digest and probes /health on 8000."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extra")
    values = docs()[deploy.PRODUCTION_STACK]
    with helm.Chart.load(str(_production_stack_chart())) as chart:
        rendered = chart.render(values, name="dflash", namespace="default", is_install=True)
    import yaml  # type: ignore[import-untyped]  # kubernetes-validate's dependency

    objects = [o for text in rendered.values() for o in yaml.safe_load_all(text) if o]
    deployments = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-deployment-vllm")
    ]
    assert len(deployments) == 1, [o["metadata"]["name"] for o in objects]
    dep = deployments[0]
    print(json.dumps(dep["spec"]["template"]["spec"]["containers"][0], indent=1), file=sys.stderr)
    ok = kubernetes_validate(dep, tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == f"{IMAGE.repository}@{IMAGE.digest}"
    assert c["command"][:7] == ["vllm", "serve", PROFILE.target, "--host", "0.0.0.0", "--port", "8000"]
    spec = json.loads(c["command"][c["command"].index("--speculative-config") + 1])
    assert spec == PROFILE.speculative_config
    assert " ".join(PROFILE.serve_args) in " ".join(c["command"])
    assert "--no-enable-prefix-caching" not in c["command"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8000}, probe
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = bad["spec"]["template"]["spec"]["containers"][0].pop(
        "command"
    )
    failed = kubernetes_validate(bad, tmp_path)
    assert failed.returncode != 0 and "comand" in failed.stdout + failed.stderr


# The drafter's public F16 GGUF (the doctor's table entry quotes it): a check on the sizes the sizing table counts with.
DRAFTER_GGUF_MIB = 3310.7


@pytest.mark.heavy
@pytest.mark.slow
def test_sizing_table_is_what_the_doctor_computes() -> None:
    """docs/deploy.md's sizing table is what tests/deploy_sizing.py computes now: the weights counted by the models'
    own classes (a 27B target; the drafter within 1 % of its public GGUF), the KV cache per sequence by the doctor."""
    import deploy_sizing

    counts = deploy_sizing.parameters()
    assert 26e9 < counts["target"] < 28e9, counts
    assert abs(2 * counts["drafter"] / 2**20 - DRAFTER_GGUF_MIB) < 0.01 * DRAFTER_GGUF_MIB, counts
    made = deploy_sizing.table(counts)
    print(made)
    assert deploy_sizing.in_docs((REPO / "docs" / "deploy.md").read_text()) == made, (
        "docs/deploy.md's sizing table is stale: python tests/deploy_sizing.py --write"
    )
