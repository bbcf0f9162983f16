"""The Kubernetes manifests of a release: how the three stacks users run start this image for the deployment profile.

    deploy-production-stack.values.yaml    vLLM production-stack Helm chart values (vllm-project/production-stack)
    deploy-kserve-servingruntime.yaml      KServe ServingRuntime, the kserve-vllmserver form (`bash -c "vllm serve …"`)
    deploy-kserve-llminferenceservice.yaml KServe LLMInferenceService (llm-d based, `vllm serve /mnt/models …`)

Every stack overrides the image's command, so each manifest gives the whole `vllm serve` line, built from the profile
by `validate.server.launch_spec` (the same arguments `validate` serves with): one source of truth, dist.toml.
The image is named by digest. Written as JSON, which is YAML (1.2), so no YAML library is needed to write them.
Scale-out is replicas, each with tensor parallelism inside a node; never pipeline parallelism (docs/deploy.md).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dflash.errors import VerifyError
from vllm_dflash.manifest import Manifest, Profile
from vllm_dflash.release import layout
from vllm_dflash.release.notes import ImageRef
from vllm_dflash.validate.server import launch_spec

PROFILE = "qwen3.6-27b"  # the user's deployment
NAMES = layout.DEPLOY_NAMES
PRODUCTION_STACK, SERVING_RUNTIME, LLM_INFERENCE_SERVICE = NAMES
# The repository's deploy/ holds these with this image: `release` writes them with the real one.
TEMPLATE_IMAGE = ImageRef("registry.example.com/vllm-dflash", "sha256:" + "0" * 64)
TEMPLATE_DIR = "deploy"

_NAME = "vllm-dflash"
_PORT = 8000  # production-stack's container port and /health probe
_KSERVE_PORT = 8080  # kserve-vllmserver's port (its probes and prometheus annotation)
_LLMISVC_PORT = 8001  # llm-d: the routing sidecar listens on 8000 and forwards to vLLM on 8001
_TP = 1  # tensor parallel size per replica: the 27B target fits one 80 GB GPU (docs/deploy.md, sizing)


def deploy_image(images: Sequence[ImageRef]) -> ImageRef:
    """The image the manifests pull: the multi-platform index when named, else the x86_64 (GPU node) image, else
    the one image named."""
    by_platform = {i.platform: i for i in images}
    for key in (None, "x86_64"):
        if key in by_platform:
            return by_platform[key]
    if len(images) == 1:
        return images[0]
    raise VerifyError("no image for the deployment manifests", "name the image index or the x86_64 image (--image)")


def _serve_args(profile: Profile, model: str, port: int, served_name: str | None = None) -> list[str]:
    """`vllm serve` arguments (after `serve`) for `model` on 0.0.0.0:`port`, tensor parallel inside the replica."""
    spec = dataclasses.replace(launch_spec(profile), model=model)
    if served_name is not None:
        spec = dataclasses.replace(spec, served_model_name=served_name)
    return [*spec.vllm_args("0.0.0.0", port), "--tensor-parallel-size", str(_TP)]


def _env(profile: Profile) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in sorted(profile.env.items())]


def production_stack(profile: Profile, image: ImageRef) -> dict[str, Any]:
    """Values for the production-stack chart. Its template writes the command itself (`vllm serve <modelURL> --host
    0.0.0.0 --port 8000` then `vllmConfig`'s flags and `extraArgs`) and the image as `repository:tag`, so the digest
    rides in those two fields (`repo@sha256` + `:` + hex)."""
    args = _serve_args(profile, profile.target, _PORT)
    # The chart already passes the model, host and port; the rest goes in extraArgs as the profile has it.
    extra = args[args.index(str(_PORT)) + 1 :]
    algo, _, hexdigest = image.digest.partition(":")
    spec: dict[str, Any] = {
        "name": _NAME,
        "repository": f"{image.repository}@{algo}",
        "tag": hexdigest,
        "modelURL": profile.target,
        "replicaCount": 2,
        "requestCPU": 8,
        "requestMemory": "64Gi",
        "requestGPU": _TP,
        "shmSize": "16Gi",
        # The chart passes --no-enable-prefix-caching unless this is true; vLLM's default is on.
        "vllmConfig": {"enablePrefixCaching": True, "extraArgs": extra},
    }
    if profile.env:
        spec["env"] = _env(profile)
    return {"servingEngineSpec": {"modelSpec": [spec]}}


def serving_runtime(profile: Profile, image: ImageRef) -> dict[str, Any]:
    """A KServe ServingRuntime in the kserve-vllmserver form: the model is mounted at /mnt/models."""
    line = shlex.join(["exec", "vllm", "serve", *_serve_args(profile, "/mnt/models", _KSERVE_PORT)])
    probe = {"httpGet": {"path": "/health", "port": _KSERVE_PORT}, "periodSeconds": 10, "timeoutSeconds": 5}
    container: dict[str, Any] = {
        "name": "kserve-container",
        "image": f"{image.repository}@{image.digest}",
        "command": ["bash", "-c", line],
        "env": [{"name": "HF_HOME", "value": "/tmp/hf"}, *_env(profile)],
        "ports": [{"containerPort": _KSERVE_PORT, "protocol": "TCP"}],
        "resources": {"limits": {"nvidia.com/gpu": str(_TP)}, "requests": {"nvidia.com/gpu": str(_TP)}},
        "readinessProbe": probe,
        "startupProbe": {**probe, "failureThreshold": 60, "periodSeconds": 30},
        "volumeMounts": [{"name": "devshm", "mountPath": "/dev/shm"}],
    }
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": {"name": _NAME, "annotations": {"prometheus.kserve.io/port": str(_KSERVE_PORT)}},
        "spec": {
            "supportedModelFormats": [{"name": "vLLM", "version": "1", "autoSelect": True}],
            "containers": [container],
            "volumes": [{"name": "devshm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def llm_inference_service(profile: Profile, image: ImageRef) -> dict[str, Any]:
    """A KServe LLMInferenceService (v1alpha2): replicas of one main container, the model at /mnt/models."""
    args = _serve_args(profile, "/mnt/models", _LLMISVC_PORT)
    container: dict[str, Any] = {
        "name": "main",
        "image": f"{image.repository}@{image.digest}",
        "command": ["vllm", "serve"],
        "args": args,
        "env": _env(profile),
        "resources": {"limits": {"nvidia.com/gpu": str(_TP)}, "requests": {"nvidia.com/gpu": str(_TP)}},
    }
    if not container["env"]:
        del container["env"]
    return {
        "apiVersion": "serving.kserve.io/v1alpha2",
        "kind": "LLMInferenceService",
        "metadata": {"name": _NAME},
        "spec": {
            "model": {"uri": f"hf://{profile.target}", "name": profile.model_name},
            "replicas": 2,
            "parallelism": {"tensor": _TP},
            "router": {"route": {}, "scheduler": {}},
            "template": {"containers": [container]},
        },
    }


def _text(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def manifests(profiles: Mapping[str, Profile], image: ImageRef) -> dict[str, bytes]:
    """file name -> bytes of the three manifests for the deployment profile and `image`."""
    profile = profiles.get(PROFILE)
    if profile is None:
        raise VerifyError(f"dist.toml has no [profiles.{PROFILE!r}]", "restore the deployment profile in dist.toml")
    return {
        PRODUCTION_STACK: _text(production_stack(profile, image)),
        SERVING_RUNTIME: _text(serving_runtime(profile, image)),
        LLM_INFERENCE_SERVICE: _text(llm_inference_service(profile, image)),
    }


def image_named(data: bytes, image: ImageRef) -> bool:
    """Whether a manifest's bytes pull `image` (production-stack splits the reference at the digest's colon)."""
    return f'"{image.repository}@{image.digest}"'.encode() in data or (
        f'"{image.repository}@{image.digest.partition(":")[0]}"'.encode() in data
        and f'"{image.digest.partition(":")[2]}"'.encode() in data
    )


def check(present: Mapping[str, bytes], images: Sequence[ImageRef], profiles: Mapping[str, Profile]) -> None:
    """A release's manifests: all three when it names images (none otherwise), each pulling the deployment image;
    with the deployment profile known, each exactly what `manifests` writes for it."""
    hint = "restore the release's own files (or run `vllm-dflash release` again)"
    if not images:
        for name in sorted(present):
            raise VerifyError(f"{name}: a deployment manifest in a release that names no image", hint)
        return
    image = deploy_image(images)
    for name in NAMES:
        if name not in present:
            raise VerifyError(f"{name}: missing (a release that names images carries its manifests)", hint)
    expected = manifests(profiles, image) if PROFILE in profiles else None
    for name in NAMES:
        if not image_named(present[name], image):
            raise VerifyError(f"{name}: does not pull {image.repository}@{image.digest}", hint)
        if expected is not None and present[name] != expected[name]:
            raise VerifyError(f"{name}: not what dist.toml's {PROFILE} profile gives for this image", hint)


def write_templates(manifest: Manifest, root: Path) -> None:
    """Rewrite the repository's deploy/ from dist.toml (the image a placeholder that `release` fills in)."""
    out = root / TEMPLATE_DIR
    out.mkdir(exist_ok=True)
    for name, data in manifests(manifest.profiles, TEMPLATE_IMAGE).items():
        (out / name).write_bytes(data)
