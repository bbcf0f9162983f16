"""Bindings that bind (issue 26): how a report ties the code that served to the artifact it names.

- `installed`: every file the wheel ships is hashed on disk against the wheel (a real `pip install` into a venv;
  an installed file edited afterwards breaks it, although pip's installed RECORD text still matches the wheel's);
- `image`: the container runs the image ID that was inspected, not the tag (which may move in between);
- `declared` (an endpoint validate did not start, with an image named): only with a /version equal to the version
  the image declares.

The container engine is a stand-in on PATH here (the test is about what we ask the tool and how we treat its
answers; the real engine's run is in test_image.py and test_registry.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ModuleTmp, checkout_requiring, provenance_bytes, write_wheel
from test_gate import TABLE, cli, error_lines, fake

from vllm_dflash import provenance as prov
from vllm_dflash.errors import MeasurementError
from vllm_dflash.validate.server import (
    ContainerOptions,
    LaunchSpec,
    installed_problem,
    installed_vllm,
    launch_container,
    launch_subprocess,
    use_endpoint,
)

__all__ = ["fake"]  # test_gate's fake OpenAI server, used here

ISOLATED_PIP = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
VERSION = "0.20.1+dflash.7"


def vllm_wheel(dest: Path, body: bytes = b"__version__ = '0.20.1+dflash.7'\n") -> Path:
    files = {
        "vllm/__init__.py": body,
        "vllm/model.py": b"LAYERS = 5\n",
        prov.PATH: provenance_bytes("vllm", VERSION),
    }
    return write_wheel(dest, "vllm", VERSION, files)


@pytest.fixture(scope="module")
def installed(module_tmp: ModuleTmp) -> tuple[Path, Path, Path]:
    """(python, wheel, site-packages): the wheel pip-installed into a fresh venv (~3 s)."""
    tmp = module_tmp("installed")
    wheel = vllm_wheel(tmp / "w")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        env=ISOLATED_PIP,
    )
    site = next((venv / "lib").glob("python*/site-packages"))
    return python, wheel, site


@pytest.fixture
def edited(installed: tuple[Path, Path, Path]) -> Iterator[Path]:
    """vllm/model.py of the install, edited after the install; put back afterwards."""
    _, _, site = installed
    path = site / "vllm" / "model.py"
    original = path.read_bytes()
    path.write_bytes(b"LAYERS = 4  # one early, as 0.20.1 taps\n")
    try:
        yield path
    finally:
        path.write_bytes(original)


def test_installed_binding_holds_for_the_untouched_install(installed: tuple[Path, Path, Path]) -> None:
    python, wheel, _ = installed
    info = installed_vllm(python)
    assert (info.name, info.version) == ("vllm", VERSION)
    assert installed_problem(info, wheel) is None  # negative control of the tests below


def test_an_installed_file_edited_after_the_install_breaks_the_binding(
    installed: tuple[Path, Path, Path], edited: Path
) -> None:
    python, wheel, _ = installed
    info = installed_vllm(python)
    # pip's bookkeeping still says the wheel's files are there: the installed RECORD row is the wheel's own.
    with zipfile.ZipFile(wheel) as zf:
        wheel_rows = zf.read(f"vllm-{VERSION}.dist-info/RECORD").decode()
    row = next(r for r in wheel_rows.splitlines() if r.startswith("vllm/model.py,"))
    assert info.record is not None and row in info.record.splitlines()
    problem = installed_problem(info, wheel)
    assert problem is not None and f"the installed {edited} is not the wheel's vllm/model.py" in problem


def test_a_missing_or_foreign_install_breaks_the_binding(installed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    python, wheel, site = installed
    info = installed_vllm(python)
    other = vllm_wheel(tmp_path / "other", body=b"# another build\n")  # same name and version, one file differs
    assert "is not the wheel's vllm/__init__.py" in (installed_problem(info, other) or "")
    newer = write_wheel(tmp_path / "newer", "vllm", "0.20.1+dflash.8", {"vllm/__init__.py": b"# x\n"})
    assert installed_problem(info, newer) == f"it is version {VERSION}, the wheel 0.20.1+dflash.8"
    torch = write_wheel(tmp_path / "torch", "torch", VERSION, {"torch/__init__.py": b"# x\n"})
    assert installed_problem(info, torch) == f"it is vllm {VERSION}, not torch"
    model = site / "vllm" / "model.py"
    saved = model.read_bytes()
    model.unlink()
    try:
        assert "vllm/model.py is not installed as a file" in (installed_problem(info, wheel) or "")
    finally:
        model.write_bytes(saved)
    assert installed_problem(info, wheel) is None


def test_a_wheel_whose_record_lies_binds_nothing(installed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """The same bytes as the installed wheel, but its RECORD names another hash for one file: the wheel is not what
    its own RECORD says, so nothing is bound by it (the disk matches the bytes; the RECORD does not)."""
    python, wheel, _ = installed
    lying = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(lying, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/RECORD"):
                rows = data.decode().splitlines()
                data = (
                    "\n".join(
                        "vllm/model.py,sha256=" + "A" * 43 + ",11" if r.startswith("vllm/model.py,") else r
                        for r in rows
                    ).encode()
                    + b"\n"
                )
            dst.writestr(info, data)
    problem = installed_problem(installed_vllm(python), lying)
    assert problem is not None and "the wheel's RECORD says sha256=AAAA" in problem and "vllm/model.py" in problem


def test_validate_refuses_the_edited_install_through_the_cli(
    installed: tuple[Path, Path, Path], edited: Path, tmp_path: Path
) -> None:
    """`validate --python --wheel`: refused before any server starts (exit 2, one line), report verdict error."""
    python, wheel, _ = installed
    root = checkout_requiring(tmp_path / "checkout", {"bind": TABLE})
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", "bind", "--python", python, "--wheel", wheel, "--report", report)
    lines = error_lines(run)
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert f"is not {wheel.name}: the installed {edited} is not the wheel's vllm/model.py" in lines[0]
    assert "+ " not in run.stdout + run.stderr.replace(lines[0], "")  # no `vllm serve` was started


def test_launch_subprocess_checks_before_it_starts(installed: tuple[Path, Path, Path], edited: Path) -> None:
    python, wheel, _ = installed
    spec = LaunchSpec(model="m", served_model_name="m", speculative_config=None, health_timeout_s=1)
    with pytest.raises(MeasurementError, match="edited or replaced after the install"):
        with launch_subprocess(spec, python, wheel):
            pytest.fail("a server was launched")


# --------------------------------------------------------------------------------------------- containers
ENGINE = r"""#!/usr/bin/env python3
# A container engine stand-in: answers `image inspect` from state.json (which the test moves), records `run`.
import json, os, sys
state_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state.json")
state = json.load(open(state_path))
args = sys.argv[1:]
state["calls"].append(args)
json.dump(state, open(state_path, "w"))
if args[:2] == ["image", "inspect"]:
    ref = args[-1]
    image = state["tags"].get(ref, ref if ref in state["images"] else None)
    if image is None:
        sys.exit("no such image " + ref)
    info = state["images"][image]
    if "--format" in args:
        print(info["Id"])
    else:
        print(json.dumps([info]))
    state["tags"].update(state.pop("move_after_inspect", {}))  # the tag moves to another image right after
    json.dump(state, open(state_path, "w"))
elif args[:1] == ["run"]:
    print("c0ffee")
elif args[:1] == ["inspect"]:
    print("true")
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`docker` on PATH: the stand-in, with two images and a tag pointing at the first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "docker"
    tool.write_text(ENGINE)
    tool.chmod(0o755)
    images = {
        "sha256:" + "a" * 64: {"Id": "sha256:" + "a" * 64, "Config": {"Labels": {img_version(): VERSION}}},
        "sha256:" + "b" * 64: {"Id": "sha256:" + "b" * 64, "Config": {"Labels": {}}},
    }
    state = {"images": images, "tags": {"ours:1": "sha256:" + "a" * 64}, "calls": []}
    (bin_dir / "state.json").write_text(json.dumps(state))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir / "state.json"


def img_version() -> str:
    from vllm_dflash.pipeline.image import LABEL_VERSION

    return LABEL_VERSION


def _state(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text())
    return data


def test_the_container_runs_the_image_id_it_inspected(engine: Path, fake: tuple[str, object]) -> None:
    """The tag moves to another image right after it was inspected: the run still gets the inspected image's ID."""
    state = _state(engine)
    state["move_after_inspect"] = {"ours:1": "sha256:" + "b" * 64}
    engine.write_text(json.dumps(state))
    url = fake[0]
    port = int(url.rsplit(":", 1)[1])  # the fake OpenAI server answers /health where the container would
    spec = LaunchSpec(model="m", served_model_name="m", speculative_config=None, health_timeout_s=5)
    opts = ContainerOptions(image="ours:1", tool="docker", gpus="")
    with launch_container(spec, opts, port=port) as server:
        assert server.provenance.artifact_sha256 == "sha256:" + "a" * 64
        assert server.provenance.artifact_name == "ours:1" and server.provenance.binding == "image"
    calls = _state(engine)["calls"]
    assert isinstance(calls, list)
    runs = [c for c in calls if isinstance(c, list) and c[:1] == ["run"]]
    assert len(runs) == 1
    assert "sha256:" + "a" * 64 in runs[0] and "ours:1" not in runs[0], runs[0]


@pytest.mark.parametrize(
    ("served", "image", "binding", "words"),
    [
        (VERSION, "ours:1", "declared", ""),  # the image declares the version the endpoint runs
        ("0.20.1+dflash.8", "ours:1", None, "runs vLLM 0.20.1+dflash.8, but --image ours:1 declares version"),
        (None, "ours:1", "none", "answers no /version"),
        (VERSION, "sha256:" + "b" * 64, "none", "declares no version label"),
    ],
)
def test_declared_image_binding_needs_a_version_match(
    engine: Path,
    fake: tuple[str, object],
    capsys: pytest.CaptureFixture[str],
    served: str | None,
    image: str,
    binding: str | None,
    words: str,
) -> None:
    url, state = fake
    state.version = served  # type: ignore[attr-defined]
    if binding is None:
        with pytest.raises(MeasurementError, match=words.replace("+", r"\+")):
            with use_endpoint(url, image=image, tool="docker"):
                pass
        return
    with use_endpoint(url, image=image, tool="docker") as server:
        got = server.provenance
    assert got.binding == binding
    if binding == "declared":
        assert got.artifact_sha256 == "sha256:" + "a" * 64 and got.artifact_name == "ours:1"
    else:
        assert got.artifact_sha256 is None and words in capsys.readouterr().err
