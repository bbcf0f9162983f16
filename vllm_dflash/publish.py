"""`vllm-dflash publish ARTIFACT --to URL --report FILE`: publish only what a passing validation report names.

The gate has no override. It demands a report that (1) verifies against its seal (and HMAC when
$VLLM_DFLASH_REPORT_KEY is set), (2) says "pass", (3) names this exact artifact -- the wheel file's sha256 or the
image's content ID -- and (4) comes from a profile the manifest lists in [publish].required_profiles, with the very
definition the manifest holds now. Wheels go to a local PEP 503 index (a directory or file:// URL) or to an upload
URL via twine; images are tagged and pushed with the container tool.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from vllm_dflash import proc
from vllm_dflash import report as reports
from vllm_dflash.errors import ContainerError, PublishRefusedError, ToolchainError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.report import ValidationReport

_REFUSE_HINT = "run `vllm-dflash validate` on a GPU node for this artifact and pass its report with --report"


@dataclass(frozen=True)
class ArtifactId:
    kind: str  # wheel | image
    name: str  # file name or image reference
    sha256: str  # wheel file sha256, or image ID "sha256:..."
    path: Path | None = None


@dataclass(frozen=True)
class PublishResult:
    artifact: ArtifactId
    destination: str
    profile: str
    report: Path


def identify(artifact: str, container_tool: str = "docker") -> ArtifactId:
    """A wheel file (by its sha256) or a container image reference (by its image ID)."""
    path = Path(artifact)
    if artifact.endswith(".whl"):
        if not path.is_file():
            raise PublishRefusedError(f"{artifact} does not exist", "pass the wheel file that was validated")
        return ArtifactId(kind="wheel", name=path.name, sha256=sha256_file(path), path=path)
    from vllm_dflash.validate.server import image_id

    try:
        digest = image_id(container_tool, artifact)
    except Exception as exc:  # MeasurementError or a missing tool: either way, nothing to publish
        raise PublishRefusedError(f"{artifact} is neither a wheel file nor a local image: {exc}", "") from None
    return ArtifactId(kind="image", name=artifact, sha256=digest)


def check_gate(report_path: Path | None, artifact: ArtifactId, manifest: Manifest) -> ValidationReport:
    """The report, when it allows publishing `artifact`; PublishRefusedError (one line each) otherwise."""
    if report_path is None:
        raise PublishRefusedError(f"no validation report given for {artifact.name}", _REFUSE_HINT)
    rep = reports.load(report_path, reports.key_from_env(), PublishRefusedError, _REFUSE_HINT)
    if rep.verdict != "pass":
        raise PublishRefusedError(
            f"report {report_path} did not pass (verdict {rep.verdict}, {rep.why_not_passed()})", ""
        )
    if rep.artifact_sha256 != artifact.sha256:
        raise PublishRefusedError(
            f"report {report_path} is for another artifact ({rep.artifact_sha256 or 'none named'}), "
            f"not {artifact.name} ({artifact.sha256})",
            "validate this exact artifact (validate --wheel FILE or --image REF)",
        )
    profile = rep.profile_name
    required = manifest.publish.required_profiles
    if profile not in required:
        raise PublishRefusedError(
            f"report profile '{profile}' is not one the manifest requires for publishing {list(required)}",
            "validate with a required profile",
        )
    current = manifest.profiles.get(profile)
    if current is None or current.digest != rep.profile_sha256:
        raise PublishRefusedError(
            f"report was made with a different definition of profile '{profile}' than dist.toml now holds",
            "validate again with the manifest's profile",
        )
    return rep


# ---------------------------------------------------------------------------------------------------------------
# Destinations


def _local_dir(to: str) -> Path | None:
    parsed = urlparse(to)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # plain path (or a Windows drive letter)
        return Path(to)
    return None


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _page(title: str, links: list[tuple[str, str]]) -> str:
    items = "\n".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br/>' for href, text in links)
    return (
        '<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head>\n  <body>\n{items}\n  </body>\n</html>\n"
    )


def publish_wheel_local(wheel: Path, root: Path) -> Path:
    """Add `wheel` to the PEP 503 simple index under `root` (root/simple/<project>/); returns the index URL path.

    Files already published are immutable: the same name with other content is refused, as PyPI does.
    """
    from packaging.utils import parse_wheel_filename

    project = normalize(str(parse_wheel_filename(wheel.name)[0]))
    simple = root / "simple"
    pdir = simple / project
    pdir.mkdir(parents=True, exist_ok=True)
    dest = pdir / wheel.name
    digest = sha256_file(wheel)
    if dest.exists():
        if sha256_file(dest) != digest:
            raise PublishRefusedError(
                f"{dest} already exists with different content", "published files are immutable; bump the version"
            )
    else:
        part = pdir / f".{wheel.name}.{os.getpid()}.part"
        try:
            shutil.copyfile(wheel, part)
            if sha256_file(part) != digest:
                raise PublishRefusedError(f"copy of {wheel.name} to {pdir} is corrupt", "check the disk and retry")
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
    files = sorted(p for p in pdir.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != "index.html")
    _write_atomic(
        pdir / "index.html",
        _page(f"Links for {project}", [(f"{f.name}#sha256={sha256_file(f)}", f.name) for f in files]),
    )
    projects = sorted(d.name for d in simple.iterdir() if d.is_dir())
    _write_atomic(simple / "index.html", _page("Simple index", [(f"{p}/", p) for p in projects]))
    return simple


def publish_wheel_twine(wheel: Path, url: str) -> None:
    """Upload with twine (credentials from TWINE_USERNAME / TWINE_PASSWORD, never from the command line)."""
    import importlib.util

    if importlib.util.find_spec("twine") is None:
        raise ToolchainError("twine is not installed", "pip install twine")
    proc.call(
        sys.executable,
        "-m",
        "twine",
        "upload",
        "--non-interactive",
        "--repository-url",
        url,
        wheel,
        error=PublishRefusedError,
        hint="check the URL and TWINE_USERNAME / TWINE_PASSWORD",
    )


def publish_image(image: str, to: str, tool: str) -> None:
    """Tag the validated image (same image ID) as `to` and push it."""
    proc.call(tool, "tag", image, to, error=ContainerError, hint=f"check that {image} exists")
    proc.call(tool, "push", to, error=ContainerError, hint=f"log in to the registry of {to} first")


def publish(
    manifest: Manifest, artifact: str, to: str, report: Path | None, container_tool: str = "docker"
) -> PublishResult:
    """Gate, then publish. Nothing is written anywhere unless the gate passes."""
    ident = identify(artifact, container_tool)
    rep = check_gate(report, ident, manifest)
    assert report is not None
    if ident.kind == "wheel":
        assert ident.path is not None
        local = _local_dir(to)
        if local is not None:
            index = publish_wheel_local(ident.path, local.resolve())
            destination = index.as_uri()
        else:
            publish_wheel_twine(ident.path, to)
            destination = to
    else:
        publish_image(ident.name, to, container_tool)
        destination = to
    return PublishResult(artifact=ident, destination=destination, profile=rep.profile_name, report=report)
