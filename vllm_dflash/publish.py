"""Publish only what a passing validation report names: one artifact (`publish ARTIFACT --to URL --report FILE`)
or a whole release directory (`publish RELEASE_DIR --to DIR`), where every platform's wheel needs its own report.

The gate has no override. It demands a report that (1) verifies against its seal (and HMAC when
$VLLM_DFLASH_REPORT_KEY is set) and carries only numbers a measurement can give, (2) comes from a profile the
manifest lists in [publish].required_profiles, its profile section the manifest's field by field, (3) passes when
judged again under that profile (validate/verdict.py: k, gates and thresholds the manifest's, every number and gate
recomputed from the counters; a recorded verdict is never read), (4) names this exact artifact -- the wheel file's
sha256 or the image's content ID --, (5) measured that profile's own prompt set, all of it (not an exploratory run),
and (6) binds the served code to the artifact by `installed` or `image`; a `declared` binding (an endpoint) passes
only with the explicit flag, which the index records. A wheel must then be what its bytes say and a build of ours
(pipeline/wheelfile.inspect_wheel). Wheels are published under the name and version of their own METADATA, to a
local index (a directory or file:// URL; one publish at a time under its lock) or an upload URL via twine; images
are tagged by their validated ID and pushed with the container tool. Every check happens before the first byte is
written: a refused publish leaves the destination as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from vllm_dflash import proc
from vllm_dflash import report as reports
from vllm_dflash.errors import ContainerError, DflashError, NetworkError, PublishRefusedError, ToolchainError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest, Profile
from vllm_dflash.paths import bare_name, storage_error, sweep_stale, temp_sibling
from vllm_dflash.pipeline.wheelfile import inspect_wheel, normalize
from vllm_dflash.release import layout
from vllm_dflash.release.verify import VerifyOptions, VerifyResult, verify
from vllm_dflash.report import ValidationReport
from vllm_dflash.simple_index import LocalIndex, PlannedWheel, copy_hashed, read_wheel_meta, real_dir
from vllm_dflash.validate import verdict

__all__ = ["normalize"]  # re-exported (the name rule lives with the wheel reader)

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
    gated: Gated
    pushed_digest: str | None = None  # an image: the digest the registry stores it under

    @property
    def report(self) -> Path:
        return self.gated.report.path

    @property
    def profile(self) -> str:
        return self.gated.report.profile_name


def identify(artifact: str, container_tool: str = "docker") -> ArtifactId:
    """A wheel file (by its sha256) or a container image reference (by its image ID)."""
    path = Path(artifact)
    if artifact.endswith(".whl"):
        if not path.exists():
            raise PublishRefusedError(f"{artifact} does not exist", "pass the wheel file that was validated")
        if not path.is_file():
            raise PublishRefusedError(
                f"{artifact} is not a regular file (a directory, FIFO or device)",
                "pass the wheel file that was validated",
            )
        return ArtifactId(kind="wheel", name=path.name, sha256=sha256_file(path), path=path)
    from vllm_dflash.validate.server import image_id

    try:
        digest = image_id(container_tool, artifact)
    except Exception as exc:  # MeasurementError or a missing tool: either way, nothing to publish
        raise PublishRefusedError(f"{artifact} is neither a wheel file nor a local image: {exc}", "") from None
    return ArtifactId(kind="image", name=artifact, sha256=digest)


@dataclass(frozen=True)
class Gated:
    """A report that lets an artifact in, with what its counters give under the manifest's profile (what the index
    records: the recomputed AL, never the report's own figure)."""

    report: ValidationReport
    judged: verdict.Rejudged


def check_gate(
    report_path: Path | None, artifact: ArtifactId, manifest: Manifest, accept_declared: bool = False
) -> Gated:
    """The report, when it allows publishing `artifact`; PublishRefusedError (one line each) otherwise."""
    if report_path is None:
        raise PublishRefusedError(f"no validation report given for {artifact.name}", _REFUSE_HINT)
    rep = reports.load(report_path, reports.key_from_env(), PublishRefusedError, _REFUSE_HINT)
    profile = rep.profile_name
    required = manifest.publish.required_profiles
    if profile not in required:
        raise PublishRefusedError(
            f"report profile '{profile[:64]}' is not one the manifest requires for publishing {list(required)}",
            "validate with a required profile",
        )
    current = manifest.profiles[profile]
    # k, the gates and their thresholds are the manifest's, and the verdict is the one the report's counters give.
    judged = verdict.check(rep, manifest.profiles, PublishRefusedError, "validate again with the manifest's profile")
    if judged.verdict != "pass":
        raise PublishRefusedError(f"report {report_path} did not pass (verdict {judged.verdict}, {judged.reason})", "")
    if rep.artifact_sha256 != artifact.sha256:
        raise PublishRefusedError(
            f"report {report_path} is for another artifact ({rep.artifact_sha256 or 'none named'}), "
            f"not {artifact.name} ({artifact.sha256})",
            "validate this exact artifact (validate --wheel FILE or --image REF)",
        )
    _check_prompts(rep, current, report_path)
    _check_kind(rep, report_path, artifact)
    _check_binding(rep, report_path, accept_declared)
    return Gated(rep, judged)


def _check_prompts(rep: ValidationReport, profile: Profile, report_path: Path) -> None:
    """The report measured the profile's own prompt set, all of it (its gate is defined on that set)."""
    from vllm_dflash.validate.promptsets import own_prompt_set, profile_prompts, prompts_digest

    hint = f"validate again with profile '{profile.name}' as it stands (no --prompts, no --num-prompts)"
    if rep.exploratory:
        raise PublishRefusedError(f"report {report_path} is exploratory, not publishable: {rep.exploratory}", hint)
    sent = rep.prompts
    own = own_prompt_set(profile)
    if sent.get("set") != own:
        raise PublishRefusedError(
            f"report {report_path} measured prompt set {sent.get('set')!r}, not the profile's {own!r}", hint
        )
    try:
        want = profile_prompts(profile)
    except DflashError as exc:
        raise PublishRefusedError(
            f"cannot read the prompt set of profile '{profile.name}': {exc.message}", exc.hint
        ) from None
    minimum = profile.min_prompts if profile.min_prompts is not None else (len(want) if want is not None else None)
    count = sent.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or (minimum is not None and count < minimum):
        raise PublishRefusedError(
            f"report {report_path} measured {count!r} prompts; the profile's gate is defined on {minimum}", hint
        )
    if want is not None and sent.get("sha256") != prompts_digest(want[:count]):
        raise PublishRefusedError(
            f"report {report_path}'s prompts (sha256 {str(sent.get('sha256'))[:16]}…) are not the first {count} of "
            f"the profile's set {own!r}",
            hint,
        )


def _check_kind(rep: ValidationReport, report_path: Path, artifact: ArtifactId) -> None:
    """The report's artifact kind and binding fit the artifact: a wheel is served installed (or declared), an image
    from its container (or declared); a wheel's report claiming an image, or the reverse, measured something else."""
    from vllm_dflash.validate.server import BINDING_DECLARED, BINDING_IMAGE, BINDING_INSTALLED

    fits = {"wheel": (BINDING_INSTALLED, BINDING_DECLARED), "image": (BINDING_IMAGE, BINDING_DECLARED)}
    kind, binding = rep.artifact.get("kind"), rep.binding
    if kind != artifact.kind or binding not in fits.get(artifact.kind, ()):
        raise PublishRefusedError(
            f"report {report_path} has artifact kind {str(kind)[:16]!r} and binding {binding[:16]!r}, which do not "
            f"fit the {artifact.kind} {artifact.name} (a wheel takes installed or declared, an image takes image)",
            "validate this artifact as what it is (validate --wheel FILE or --image REF)",
        )


def _check_binding(rep: ValidationReport, report_path: Path, accept_declared: bool) -> None:
    from vllm_dflash.validate.server import BINDING_DECLARED, BINDING_IMAGE, BINDING_INSTALLED

    binding = rep.binding
    if binding in (BINDING_INSTALLED, BINDING_IMAGE):
        return
    if binding == BINDING_DECLARED:
        if accept_declared:
            return
        raise PublishRefusedError(
            f"report {report_path} binds the artifact only by what its endpoint declared (binding 'declared': "
            "validate did not start that server, it only saw the wheel's version at /version)",
            "validate with --python or --image so validate launches the server itself, or pass "
            "--accept-declared-binding (recorded in the index)",
        )
    raise PublishRefusedError(
        f"report {report_path} has binding {binding!r}, which ties no served code to the artifact",
        "validate with --python/--wheel or --image",
    )


def publish_record(gated: Gated, accept_declared: bool) -> dict[str, object]:
    """What the index keeps beside a published wheel: which report let it in, and on what binding."""
    rep = gated.report
    return {
        "report": rep.path.name,
        "report_sha256": hashlib.sha256(rep.raw).hexdigest() if rep.raw else None,
        "profile": rep.profile_name,
        "acceptance_length": gated.judged.acceptance_length,
        "binding": rep.binding,
        "declared_binding_accepted": accept_declared and rep.binding == "declared",
        "prompts": {k: rep.prompts.get(k) for k in ("set", "count", "sha256")},
    }


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


def publish_wheel_local(
    wheel: Path, root: Path, sha256: str | None = None, record: Mapping[str, object] | None = None
) -> Path:
    """Add `wheel` to the local index under `root` (simple_index: PEP 503 + 691 + 658); returns its `simple/` path.

    The copy must hash to `sha256` (default: the file's hash now). Files already published are immutable: the same
    name with other content is refused, as PyPI does. Every check happens before the first byte is written.
    """
    idx = LocalIndex(root)
    want = sha256 or sha256_file(wheel)
    idx.plan(wheel, want, record or {})  # refused here, the index is untouched (not even its lock file made)
    with idx.transaction():  # concurrent publishes to this index run one after another: check again inside
        idx.write(idx.plan(wheel, want, record or {}))
    return idx.simple


def publish_wheel_twine(wheel: Path, url: str, sha256: str | None = None) -> None:
    """Upload with twine (credentials from TWINE_USERNAME / TWINE_PASSWORD, never from the command line)."""
    import importlib.util

    if importlib.util.find_spec("twine") is None:
        raise ToolchainError("twine is not installed", "pip install twine")
    read_wheel_meta(wheel)  # the name and version it is uploaded under are its METADATA's
    want = sha256 or sha256_file(wheel)
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-upload-") as tmp:
        # twine uploads this private copy, whose bytes were hashed as they were copied.
        copy = Path(tmp) / wheel.name
        got = copy_hashed(wheel, copy)
        if got != want:
            raise PublishRefusedError(
                f"{wheel} changed: its bytes have sha256 {got}, not the validated {want}",
                "publish again from an untouched copy of the validated wheel",
            )
        proc.call(
            sys.executable,
            "-m",
            "twine",
            "upload",
            "--non-interactive",
            "--repository-url",
            url,
            copy,
            error=NetworkError,
            hint="twine's reason is above; check the URL and TWINE_USERNAME / TWINE_PASSWORD",
        )


def publish_image(image_id: str, to: str, tool: str) -> str | None:
    """Tag the validated image as `to` -- by the image ID the report names, not by a name that may have moved to
    another image since -- and push it; the digest the registry stores it under (what a release names, REPO@DIGEST)
    when the tool says (podman: --digestfile; docker: the repo digest it records)."""
    proc.call(tool, "tag", image_id, to, error=ContainerError, hint=f"check that image {image_id} still exists")
    with tempfile.TemporaryDirectory(prefix="vllm-dflash-push-") as tmp:
        digestfile = Path(tmp) / "digest"
        extra = ["--digestfile", str(digestfile)] if tool == "podman" else []
        proc.call(tool, "push", *extra, to, error=ContainerError, hint=f"log in to the registry of {to} first")
        if digestfile.is_file():
            return digestfile.read_text().strip() or None
    if tool != "docker":
        return None
    found = proc.call(tool, "image", "inspect", "--format", "{{json .RepoDigests}}", to, capture=True, check=False)
    repo = to.rsplit(":", 1)[0] if ":" in to.rsplit("/", 1)[-1] else to
    with contextlib.suppress(ValueError, TypeError):
        for ref in json.loads(found.stdout):  # no JSON (or no list) is no digest
            if str(ref).startswith(f"{repo}@sha256:"):
                return str(ref).split("@", 1)[1]
    return None


def publish(
    manifest: Manifest,
    artifact: str,
    to: str,
    report: Path | None,
    container_tool: str = "docker",
    accept_declared: bool = False,
) -> PublishResult:
    """Gate, then publish. Nothing is written anywhere unless the gate passes."""
    local = None if not artifact.endswith(".whl") else _local_dir(to)  # the destination first: before any work
    ident = identify(artifact, container_tool)
    gated = check_gate(report, ident, manifest, accept_declared)
    pushed: str | None = None
    if ident.path is not None:  # what the wheel is comes from its bytes, and it must be a build of ours
        inspect_wheel(ident.path, PublishRefusedError, require_provenance=True)
    if ident.kind == "wheel":
        assert ident.path is not None
        if local is not None:
            record = {**publish_record(gated, accept_declared), "sha256": ident.sha256}
            index = publish_wheel_local(ident.path, local.resolve(), ident.sha256, record)
            destination = index.as_uri()
        else:
            publish_wheel_twine(ident.path, to, ident.sha256)
            destination = to
    else:
        pushed = publish_image(ident.sha256, to, container_tool)
        destination = to
    return PublishResult(artifact=ident, destination=destination, gated=gated, pushed_digest=pushed)


# ---------------------------------------------------------------------------------------------------------------
# A whole release: what may be published, per platform


@dataclass(frozen=True)
class PlatformDecision:
    platform: str
    wheel: Path | None
    sha256: str | None
    gated: Gated | None  # the report that passed the gate, as it was read and judged
    refusal: str | None  # why not, when refused

    @property
    def publishable(self) -> bool:
        return self.refusal is None

    @property
    def report(self) -> Path | None:
        return self.gated.report.path if self.gated is not None else None

    @property
    def profile(self) -> str | None:
        return self.gated.report.profile_name if self.gated is not None else None


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
    accept_declared: bool = False,
) -> PublishPlan:
    """Verify the release (VerifyError, exit 17, when it does not), then decide per platform.

    `options` default: no signature required, reports checked with $VLLM_DFLASH_REPORT_KEY when set (as publish).
    """
    result = verify(
        release_dir, options or VerifyOptions(report_key=reports.key_from_env(), profiles=manifest.profiles)
    )
    if result.partial:
        raise PublishRefusedError(f"{release_dir} is one artifact, not a release directory", "pass the directory")
    wanted = tuple(platforms) if platforms is not None else tuple(sorted(manifest.wheels))
    by_platform = {w.platform: w for w in result.wheels}
    decisions: list[PlatformDecision] = []
    for plat in wanted:
        w = by_platform.get(plat)
        if w is None:
            decisions.append(PlatformDecision(plat, None, None, None, "the release has no wheel for it"))
            continue
        path = release_dir / w.filename
        ident = ArtifactId(kind="wheel", name=w.filename, sha256=w.sha256, path=path)
        reasons: list[str] = []
        chosen: PlatformDecision | None = None
        for rep in w.reports:
            try:
                passed = check_gate(release_dir / rep.name, ident, manifest, accept_declared)
            except DflashError as exc:
                reasons.append(f"{rep.name}: {exc.message}")
                continue
            chosen = PlatformDecision(plat, path, w.sha256, passed, None)
            break
        if chosen is None:
            why = "; ".join(reasons) if reasons else f"no validation report for {w.filename} is attached"
            chosen = PlatformDecision(plat, path, w.sha256, None, why)
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
    accept_declared: bool = False,
) -> ReleasePublished:
    """Publish a verified release: every platform's wheel with its passing report (any platform without one refuses
    the whole release), then the release's other files (sums, SBOMs, statements, signatures, notes, reports).

    A local index (directory or file:// URL) gets the wheels in its PEP 503 tree and the release files under
    `releases/<version>/`; an upload URL gets the wheels through twine, and `attach_to` the release files.
    """
    local = _local_dir(to)  # the destination first: before any work
    plan = publish_plan(release_dir, manifest, platforms, accept_declared=accept_declared)
    plan.require_all()
    if local is None and attach_to is None:
        raise PublishRefusedError(
            f"{to} is an upload URL, which carries wheels only, not the release's sums, SBOMs and provenance",
            "pass --attach-to DIR for those files (or publish to a directory index)",
        )
    version = plan.release.wheels[0].version if plan.release.wheels else "unknown"
    bare_name(version, "release version", PublishRefusedError)
    root = local.resolve() if local is not None else None
    files_dir = (root / "releases" / version) if root is not None else attach_to
    assert files_dir is not None
    digests = plan.release.digests

    idx = LocalIndex(root) if root is not None else None
    others = [p for p in plan.files if p.suffix != ".whl"]
    chosen = [d for d in plan.decisions if d.wheel is not None]

    def check() -> list[PlannedWheel]:
        """Every check before the first byte is written; the index's wheels planned."""
        if root is not None:
            real_dir(root / "releases", "index directory")
        real_dir(files_dir, "release files directory")
        for path in others:
            dest = files_dir / path.name
            if dest.is_symlink() or (dest.exists() and not dest.is_file()):
                raise PublishRefusedError(f"{dest} is not a regular file", f"remove {dest}")
            if dest.exists() and sha256_file(dest) != digests.get(path.name):
                raise PublishRefusedError(
                    f"{dest} already exists with different content", "published files are immutable"
                )
        planned = []
        if idx is not None:
            for d in chosen:
                assert d.wheel is not None and d.sha256 is not None and d.gated is not None
                # The report as the gate read and judged it, not read again: what was judged is what is recorded.
                record = {**publish_record(d.gated, accept_declared), "sha256": d.sha256}
                planned.append(idx.plan(d.wheel, d.sha256, record))
        else:
            for d in chosen:
                assert d.wheel is not None
                read_wheel_meta(d.wheel)
        return planned

    check()  # refused here, nothing is touched (not even the index's lock file)
    # A local index: the whole write is one transaction on it (its lock held from the checks, made again, to the
    # last rename), so a concurrent publish neither interleaves with it nor sees it half done.
    with idx.transaction() if idx is not None else contextlib.nullcontext():
        planned = check()

        # Writing: every copy (wheels and release files) staged and hashed first, then all renamed into place.
        staged = (idx, idx.stage(*planned)) if idx is not None else None  # the index and its staged wheels
        parts: list[tuple[Path, Path]] = []
        made_dirs = [p for p in (files_dir.parent, files_dir) if not p.exists()]
        try:
            for new_dir in made_dirs:
                new_dir.mkdir(exist_ok=True)
            for path in others:
                dest = files_dir / path.name
                if not (dest.is_file() and sha256_file(dest) == digests.get(path.name)):
                    parts.append((_stage_release_file(path, dest, digests[path.name]), dest))
        except BaseException as exc:
            for part, _ in parts:
                part.unlink(missing_ok=True)
            for new_dir in reversed(made_dirs):
                with contextlib.suppress(OSError):
                    new_dir.rmdir()
            if staged is not None:
                staged[0].abort(staged[1])
            if isinstance(exc, OSError):
                raise storage_error(exc, files_dir, "write") from None
            raise
        if staged is not None:
            staged[0].commit(staged[1])
            destination = staged[0].simple.as_uri()
        else:
            for d in chosen:
                assert d.wheel is not None
                publish_wheel_twine(d.wheel, to, d.sha256)
            destination = to
        try:
            sweep_stale(files_dir)
            for part, dest in parts:
                os.replace(part, dest)
        except OSError as exc:
            raise storage_error(exc, files_dir, "write") from None
    return ReleasePublished(plan=plan, index=destination, files_dir=files_dir)


def _stage_release_file(src: Path, dest: Path, sha256: str) -> Path:
    """Copy to a hidden part beside `dest`, hashing the bytes written; they must be the ones SHA256SUMS lists."""
    tmp = temp_sibling(dest, ".part")
    try:
        if copy_hashed(src, tmp) != sha256:
            raise PublishRefusedError(
                f"{src} changed after it was verified: its bytes are not the ones SHA256SUMS lists",
                "verify and publish the release again",
            )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp
