"""Publish only what a passing validation report names: one artifact (`publish ARTIFACT --to URL --report FILE`)
or a whole release directory (`publish RELEASE_DIR --to DIR`), where every platform's wheel needs its own report.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from vllm_dflash import proc
from vllm_dflash import report as reports
from vllm_dflash.errors import ContainerError, DflashError, NetworkError, PublishRefusedError, ToolchainError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import copy_atomic, temp_sibling, write_text_atomic
from vllm_dflash.release import layout
from vllm_dflash.release.verify import VerifyOptions, VerifyResult, verify
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


UPLOAD_SCHEMES = ("http", "https")


def _local_dir(to: str) -> Path | None:
    """The directory a wheel destination names (a path or a file:// URL on this host), or None for an upload URL.

    Checked before any work: an unsupported scheme, a file:// URL naming another host, or a destination that is a
    file or cannot be created is one clear line, never a late failure.
    """
    parsed = urlparse(to)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise PublishRefusedError(
                f"--to {to} names host '{parsed.netloc}'; a file:// destination must be on this machine",
                "write file:///path (three slashes) or a plain path",
            )
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "":
        path = Path(to)
    elif parsed.scheme in UPLOAD_SCHEMES:
        if not parsed.netloc:
            raise PublishRefusedError(f"--to {to} has no host", "write e.g. https://upload.example.com/legacy/")
        return None
    else:
        raise PublishRefusedError(
            f"--to {to}: unsupported scheme '{parsed.scheme}'",
            "use a directory, a file:// URL or an http(s):// upload URL",
        )
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise PublishRefusedError(f"--to {to}: {probe} is a file, not a directory", "choose a directory for the index")
    if not os.access(probe, os.W_OK):
        raise PublishRefusedError(f"--to {to}: {probe} is not writable", "choose a directory you can write")
    return path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _write_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text)


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
        part = temp_sibling(pdir / wheel.name, ".part")
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
        error=NetworkError,
        hint="twine's reason is above; check the URL and TWINE_USERNAME / TWINE_PASSWORD",
    )


def publish_image(image: str, to: str, tool: str) -> None:
    """Tag the validated image (same image ID) as `to` and push it."""
    proc.call(tool, "tag", image, to, error=ContainerError, hint=f"check that {image} exists")
    proc.call(tool, "push", to, error=ContainerError, hint=f"log in to the registry of {to} first")


def publish(
    manifest: Manifest, artifact: str, to: str, report: Path | None, container_tool: str = "docker"
) -> PublishResult:
    """Gate, then publish. Nothing is written anywhere unless the gate passes."""
    local = None if not artifact.endswith(".whl") else _local_dir(to)  # the destination first: before any work
    ident = identify(artifact, container_tool)
    rep = check_gate(report, ident, manifest)
    assert report is not None
    if ident.kind == "wheel":
        assert ident.path is not None
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


# ---------------------------------------------------------------------------------------------------------------
# A whole release: what may be published, per platform


@dataclass(frozen=True)
class PlatformDecision:
    platform: str
    wheel: Path | None
    sha256: str | None
    report: Path | None  # the report that passed the gate
    profile: str | None
    refusal: str | None  # why not, when refused

    @property
    def publishable(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True)
class PublishPlan:
    release: VerifyResult
    decisions: tuple[PlatformDecision, ...]
    files: tuple[Path, ...]  # every file of the release, to publish together

    @property
    def refused(self) -> tuple[PlatformDecision, ...]:
        return tuple(d for d in self.decisions if not d.publishable)

    def require_all(self) -> None:
        """PublishRefusedError (exit 12, one line) unless every platform has a passing report for its wheel."""
        if self.refused:
            raise PublishRefusedError(
                "; ".join(f"{d.platform}: {d.refusal}" for d in self.refused),
                "validate each platform's wheel on a GPU node of that platform and make the release with its report",
            )


def publish_plan(
    release_dir: Path,
    manifest: Manifest,
    platforms: Sequence[str] | None = None,
    options: VerifyOptions | None = None,
) -> PublishPlan:
    """Verify the release (VerifyError, exit 17, when it does not), then decide per platform.

    `options` default: no signature required, reports checked with $VLLM_DFLASH_REPORT_KEY when set (as publish).
    """
    result = verify(release_dir, options or VerifyOptions(report_key=reports.key_from_env()))
    if result.partial:
        raise PublishRefusedError(f"{release_dir} is one artifact, not a release directory", "pass the directory")
    wanted = tuple(platforms) if platforms is not None else tuple(sorted(manifest.wheels))
    by_platform = {w.platform: w for w in result.wheels}
    decisions: list[PlatformDecision] = []
    for plat in wanted:
        w = by_platform.get(plat)
        if w is None:
            decisions.append(PlatformDecision(plat, None, None, None, None, "the release has no wheel for it"))
            continue
        path = release_dir / w.filename
        ident = ArtifactId(kind="wheel", name=w.filename, sha256=w.sha256, path=path)
        reasons: list[str] = []
        chosen: PlatformDecision | None = None
        for rep in w.reports:
            try:
                passed = check_gate(release_dir / rep.name, ident, manifest)
            except DflashError as exc:
                reasons.append(f"{rep.name}: {exc.message}")
                continue
            chosen = PlatformDecision(plat, path, w.sha256, release_dir / rep.name, passed.profile_name, None)
            break
        if chosen is None:
            why = "; ".join(reasons) if reasons else f"no validation report for {w.filename} is attached"
            chosen = PlatformDecision(plat, path, w.sha256, None, None, why)
        decisions.append(chosen)
    files = tuple(release_dir / n for n in sorted(set(result.files) | {layout.SUMS}))
    return PublishPlan(release=result, decisions=tuple(decisions), files=files)


@dataclass(frozen=True)
class ReleasePublished:
    plan: PublishPlan
    index: str  # where the wheels went
    files_dir: Path | None  # where the release's other files went


def publish_release(
    manifest: Manifest,
    release_dir: Path,
    to: str,
    platforms: Sequence[str] | None = None,
    attach_to: Path | None = None,
) -> ReleasePublished:
    """Publish a verified release: every platform's wheel with its passing report (any platform without one refuses
    the whole release), then the release's other files (sums, SBOMs, statements, signatures, notes, reports).

    A local index (directory or file:// URL) gets the wheels in its PEP 503 tree and the release files under
    `releases/<version>/`; an upload URL gets the wheels through twine, and `attach_to` the release files.
    """
    local = _local_dir(to)  # the destination first: before any work
    plan = publish_plan(release_dir, manifest, platforms)
    plan.require_all()
    if local is None and attach_to is None:
        raise PublishRefusedError(
            f"{to} is an upload URL, which carries wheels only, not the release's sums, SBOMs and provenance",
            "pass --attach-to DIR for those files (or publish to a directory index)",
        )
    version = plan.release.wheels[0].version if plan.release.wheels else "unknown"
    files_dir = (local / "releases" / version) if local is not None else attach_to
    assert files_dir is not None
    wheels = [d.wheel for d in plan.decisions if d.wheel is not None]
    if local is not None:
        for wheel in wheels:
            index = publish_wheel_local(wheel, local.resolve())
        destination = index.as_uri()
    else:
        for wheel in wheels:
            publish_wheel_twine(wheel, to)
        destination = to
    for path in plan.files:
        if path.suffix == ".whl":
            continue
        dest = files_dir / path.name
        if dest.exists() and dest.read_bytes() != path.read_bytes():
            raise PublishRefusedError(f"{dest} already exists with different content", "published files are immutable")
        copy_atomic(path, dest)
    return ReleasePublished(plan=plan, index=destination, files_dir=files_dir)
