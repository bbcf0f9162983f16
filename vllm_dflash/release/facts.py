"""What a release says about a wheel, read from the wheel itself: its file hash, METADATA, WHEEL tags and the
build provenance document it carries. Nothing here looks at the checkout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import provenance as prov
from vllm_dflash.errors import DflashError, VerifyError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline import wheelfile


@dataclass(frozen=True)
class Requirement:
    """One Requires-Dist line of the wheel's METADATA, kept verbatim, with its parts for display."""

    line: str  # exactly as METADATA has it
    name: str  # as written
    canonical: str  # PEP 503 normalised (what purls use)
    specifier: str  # PEP 440 specifier set, '' when unconstrained ("torch==2.11.0" -> "==2.11.0")
    marker: str  # PEP 508 environment marker, '' when none
    extras: tuple[str, ...]  # extras requested of the dependency ("fastapi[standard]" -> ("standard",))
    for_extra: str  # the wheel's own extra this line belongs to ('' for a base requirement)

    @property
    def exact_version(self) -> str | None:
        """The version when the specifier is a single exact pin (`==X`, no wildcard), else None: a range."""
        m = re.fullmatch(r"==\s*([^*,;\s]+)", self.specifier)
        return m.group(1) if m else None


@dataclass(frozen=True)
class WheelFacts:
    path: Path
    filename: str
    sha256: str
    size: int
    name: str  # METADATA Name
    version: str  # METADATA Version
    summary: str
    license_expression: str | None
    requires_python: str | None
    requirements: tuple[Requirement, ...]
    platform: str  # machine from the platform tag: x86_64, aarch64, or "any"
    platform_tags: tuple[str, ...]  # as the file name has them
    provenance: prov.Provenance


def _fail(error: type[DflashError], where: str, what: str) -> DflashError:
    return error(f"{where}: {what}", "use a wheel built by `vllm-dflash build`")


def parse_requirement(line: str) -> Requirement:
    from packaging.requirements import InvalidRequirement
    from packaging.requirements import Requirement as Pep508
    from packaging.utils import canonicalize_name

    try:
        req = Pep508(line)
    except InvalidRequirement as exc:
        raise ValueError(f"Requires-Dist {line!r} is not PEP 508: {exc}") from None
    marker = str(req.marker) if req.marker is not None else ""
    extra = re.search(r"""\bextra\s*==\s*["']([^"']+)["']""", marker)
    return Requirement(
        line=line,
        name=req.name,
        canonical=str(canonicalize_name(req.name)),
        specifier=str(req.specifier),
        marker=marker,
        extras=tuple(sorted(req.extras)),
        for_extra=extra.group(1) if extra else "",
    )


def machine_of(tags: tuple[str, ...], where: str, error: type[DflashError] = VerifyError) -> str:
    """The one machine a set of platform tags names ("any" for pure wheels)."""
    return wheelfile.machine_of(tags, where, error)


def read_facts(wheel: Path, error: type[DflashError] = VerifyError, sha256: str | None = None) -> WheelFacts:
    """Everything the release says about `wheel`, from the wheel (wheelfile.inspect_wheel: name, version, machine and
    interpreter from its own METADATA and WHEEL, its provenance naming this build). Any problem is one `error` line."""
    from packaging.utils import parse_wheel_filename

    where = wheel.name
    got = wheelfile.inspect_wheel(wheel, error, require_provenance=True)
    assert got.provenance is not None  # required
    file_tags = tuple(sorted({t.platform for t in parse_wheel_filename(wheel.name)[3]}))
    meta = got.headers
    try:
        requirements = tuple(parse_requirement(str(r)) for r in meta.get_all("Requires-Dist") or [])
    except ValueError as exc:
        raise _fail(error, where, str(exc)) from None
    lic = meta.get("License-Expression")
    return WheelFacts(
        path=wheel,
        filename=wheel.name,
        sha256=sha256 or sha256_file(wheel),
        size=wheel.stat().st_size,
        name=got.name,
        version=got.version,
        summary=str(meta.get("Summary") or ""),
        license_expression=str(lic) if lic else None,
        requires_python=got.requires_python,
        requirements=requirements,
        platform=got.machine,
        platform_tags=file_tags,
        provenance=got.provenance,
    )


@dataclass(frozen=True)
class SourceMaterial:
    """The upstream source a wheel was built from: the hash-pinned sdist, or a git commit."""

    kind: str  # "sdist" | "git"
    version: str
    git_url: str
    commit: str
    filename: str | None = None  # sdist only
    sha256: str | None = None  # sdist only


def source_material(manifest: Manifest, facts: WheelFacts, error: type[DflashError] = VerifyError) -> SourceMaterial:
    """The upstream source of `facts`' wheel, from its provenance document (sdist name and hash included).

    Wheels from before the document recorded the sdist get its hash from the manifest's pin, and only when the
    wheel's provenance says it was built from exactly that pin.
    """
    up = facts.provenance.upstream
    if up.source_kind == "sdist" and up.sdist_filename and up.sdist_sha256:
        return SourceMaterial("sdist", up.version, up.git_url, up.commit, up.sdist_filename, up.sdist_sha256)
    pin = manifest.upstream
    if (up.version, up.tag, up.commit_pinned) != (pin.version, pin.tag, pin.commit):
        raise error(
            f"{facts.filename} was built from upstream {up.tag} ({up.commit_pinned}), dist.toml pins {pin.tag} "
            f"({pin.commit})",
            f"make the release from the checkout that built the wheel, with --pin {up.version} for another pin",
        )
    if up.source_kind == "sdist":
        return SourceMaterial(
            "sdist", up.version, up.git_url, up.commit, manifest.sdist.filename, manifest.sdist.sha256
        )
    if up.source_kind == "git":
        return SourceMaterial("git", up.version, up.git_url, up.commit)
    raise error(f"{facts.filename}: unknown upstream source kind {up.source_kind!r}", "rebuild the wheel")
