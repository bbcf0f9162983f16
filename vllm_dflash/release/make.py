"""make_release: wheels in, a release directory out (layout in `layout.py`).

Every document is computed in memory from the wheels (and the manifest's sdist pin, see facts.source_material)
before anything is written; SHA256SUMS and its envelope are written last, so an interrupted run leaves a
directory that does not verify rather than one that verifies wrongly.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from vllm_dflash import report as reports
from vllm_dflash.errors import ProvenanceError, StorageError, VerifyError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest, Profile
from vllm_dflash.paths import copy_atomic, ensure_dir, storage_error, temp_sibling, temporary_pid, write_bytes_atomic
from vllm_dflash.release import deploy, dsse, layout
from vllm_dflash.release.facts import SourceMaterial, WheelFacts, read_facts, source_material
from vllm_dflash.release.images import build_images
from vllm_dflash.release.notes import AttachedReport, ImageRef, release_notes
from vllm_dflash.release.sbom import build_sbom
from vllm_dflash.release.statement import DEFAULT_BUILDER_ID, build_statement
from vllm_dflash.validate import verdict

_NEW_DIR_HINT = "use an empty (or new) release directory, or one that holds only an earlier release of these wheels"


@dataclass(frozen=True)
class ReleaseOptions:
    sign_key: Path | None = None  # PEM Ed25519 private key: sign the statements and SHA256SUMS (DSSE)
    sign_key_password: bytes | None = None  # for an encrypted PEM
    reports: tuple[Path, ...] = ()  # sealed validation reports, each naming one of the wheels' sha256
    report_key: bytes | None = None  # $VLLM_DFLASH_REPORT_KEY: reports must then carry a valid HMAC
    images: tuple[ImageRef, ...] = ()  # container images to name (by digest) in the notes and images.json
    builder_id: str = DEFAULT_BUILDER_ID  # SLSA runDetails.builder.id (a CI system sets its own identity)
    timestamp: datetime | None = None  # CycloneDX metadata.timestamp; None omits it (reproducible)
    index_url: str | None = None  # the index the notes' `pip install --index-url` names
    link: bool = True  # hard-link the wheels into the release when on the same file system (else copy)


@dataclass(frozen=True)
class ReleasedWheel:
    platform: str
    path: Path
    sha256: str
    sbom: Path
    statement: Path
    envelope: Path | None
    reports: tuple[Path, ...]


@dataclass(frozen=True)
class Release:
    directory: Path
    version: str
    wheels: tuple[ReleasedWheel, ...]  # sorted by platform
    files: tuple[str, ...]  # every file of the release, SHA256SUMS and its envelope included
    notes: Path
    sums: Path
    key_id: str | None  # the signing key's id when signed


def _check_one_release(facts: Sequence[WheelFacts]) -> None:
    """The wheels are one release: same distribution, version, upstream, queue and builder; one per platform."""
    first = facts[0]
    seen: dict[str, str] = {}
    for f in facts:
        if f.platform in seen:
            raise VerifyError(
                f"{f.filename} and {seen[f.platform]} are both {f.platform} wheels", "pass one wheel per platform"
            )
        seen[f.platform] = f.filename
        a, b = f.provenance, first.provenance
        differs = [
            what
            for what, x, y in (
                ("name", f.name, first.name),
                ("version", f.version, first.version),
                ("upstream", a.upstream.commit_pinned, b.upstream.commit_pinned),
                ("variant", a.variant, b.variant),
                ("patch queue", [(p.name, p.sha256) for p in a.patches], [(p.name, p.sha256) for p in b.patches]),
                ("tool version", a.build.tool_version, b.build.tool_version),
            )
            if x != y
        ]
        if differs:
            raise VerifyError(
                f"{f.filename} and {first.filename} differ in {', '.join(differs)}: they are not one release",
                "build every platform's wheel from the same checkout and queue",
            )


def _attach_reports(
    facts: Sequence[WheelFacts], paths: Sequence[Path], key: bytes | None, profiles: Mapping[str, Profile]
) -> tuple[list[AttachedReport], dict[str, bytes]]:
    by_sha = {f.sha256: f for f in facts}
    attached: list[AttachedReport] = []
    contents: dict[str, bytes] = {}
    for path in paths:
        rep = reports.load(path, key, VerifyError, "pass the report `vllm-dflash validate` wrote")
        judged = verdict.check(rep, profiles, VerifyError, "attach the report `vllm-dflash validate` wrote")
        if judged.verdict != "pass":
            raise VerifyError(f"report {path} did not pass ({judged.reason})", "attach passing reports only")
        wheel = by_sha.get(rep.artifact_sha256 or "")
        if wheel is None:
            raise VerifyError(
                f"report {path} names artifact {rep.artifact_sha256 or 'none'}, which is none of the wheels",
                "attach the report made with --wheel for one of these wheels",
            )
        name = layout.report_name(wheel.filename, rep.profile_name)
        if name in contents:
            raise VerifyError(f"two reports of profile {rep.profile_name} for {wheel.filename}", "attach one")
        contents[name] = rep.raw  # the very bytes that were checked
        attached.append(AttachedReport(name=name, wheel=wheel.filename, report=rep, judged=judged))
    return attached, contents


def _place_wheel(src: Path, dest: Path, sha256: str, link: bool) -> None:
    """Put the wheel at `dest` (atomic rename of a hard link or a verified copy)."""
    with contextlib.suppress(OSError):
        if dest.exists() and os.path.samefile(src, dest):
            return
    if link:
        tmp = temp_sibling(dest)
        try:
            os.link(src, tmp)
            os.replace(tmp, dest)
            return
        except OSError:
            pass  # another file system, or links not allowed: copy instead
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
    copy_atomic(src, dest)
    if sha256_file(dest) != sha256:
        dest.unlink(missing_ok=True)
        raise StorageError(f"copy of {src.name} to {dest.parent} is corrupt", "check the disk and run again")


def make_release(
    manifest: Manifest, wheels: Sequence[Path], out_dir: Path, options: ReleaseOptions = ReleaseOptions()
) -> Release:
    """Write the release of `wheels` (one per platform) into `out_dir`; returns what was written.

    Refuses (one line): wheels without provenance (ProvenanceError), wheels that are not one release, reports
    that are not sealed passing reports of one of the wheels (VerifyError), and an `out_dir` holding anything
    but an earlier release of these wheels (StorageError).
    """
    if not wheels:
        raise VerifyError("no wheel to release", "pass the wheels `vllm-dflash build` wrote")
    for w in wheels:
        if not w.is_file():
            raise StorageError(f"wheel {w} does not exist", "pass the wheels `vllm-dflash build` wrote")
    facts = sorted((read_facts(w, ProvenanceError) for w in wheels), key=lambda f: f.platform)
    _check_one_release(facts)
    sources = {source_material(manifest, f, VerifyError) for f in facts}
    if len(sources) != 1:
        raise VerifyError("the wheels were built from different upstream sources", "build them from one checkout")
    source: SourceMaterial = sources.pop()
    attached, report_bytes = _attach_reports(facts, options.reports, options.report_key, manifest.profiles)
    key: dsse.SigningKey | None = None
    if options.sign_key is not None:
        key = dsse.load_private_key(options.sign_key, options.sign_key_password)

    # Every document, in memory, before anything is written.
    docs: dict[str, bytes] = dict(report_bytes)
    for f in facts:
        docs[layout.sbom_name(f.filename)] = build_sbom(f, source, options.timestamp)
        statement = build_statement(f, source, options.builder_id)
        docs[layout.statement_name(f.filename)] = statement
        if key is not None:
            docs[layout.envelope_name(f.filename)] = dsse.envelope(dsse.INTOTO_PAYLOAD_TYPE, statement, key)
    docs[layout.NOTES] = release_notes(
        facts, source, attached, options.images, key.keyid if key else None, options.index_url
    ).encode()
    if options.images:  # each per-platform image bound to its platform's wheel; refused when none is here
        docs[layout.IMAGES] = build_images(facts, options.images)
        docs |= deploy.manifests(manifest.profiles, deploy.deploy_image(options.images))
    if key is not None:
        docs[layout.PUBLIC_KEY] = dsse.public_pem(key.public)

    # The directory: only an earlier release of these same wheels may be in the way (it is replaced).
    ensure_dir(out_dir, "release directory")  # never swept: it may be the user's; a dead run's temporary is skipped
    ours = set(docs) | {f.filename for f in facts} | {layout.SUMS, layout.SUMS_ENVELOPE}
    stale: list[Path] = []
    for entry in sorted(out_dir.iterdir()):
        if entry.name in ours or temporary_pid(entry.name) is not None:
            continue
        member = layout.classify(entry.name)
        if member is None or member.kind is layout.Kind.WHEEL or not entry.is_file() or entry.is_symlink():
            raise StorageError(f"{entry} is in the release directory but not part of this release", _NEW_DIR_HINT)
        stale.append(entry)
    try:
        for name in (layout.SUMS, layout.SUMS_ENVELOPE):
            (out_dir / name).unlink(missing_ok=True)
        for entry in stale:
            entry.unlink()
    except OSError as exc:
        raise storage_error(exc, out_dir, "clear the earlier release in") from None

    digests: dict[str, str] = {}
    for f in facts:
        _place_wheel(f.path, out_dir / f.filename, f.sha256, options.link)
        digests[f.filename] = f.sha256
    for name, data in sorted(docs.items()):
        write_bytes_atomic(out_dir / name, data)
        digests[name] = hashlib.sha256(data).hexdigest()
    sums = layout.format_sums(digests)
    files = [*digests, layout.SUMS]
    if key is not None:
        write_bytes_atomic(out_dir / layout.SUMS_ENVELOPE, dsse.envelope(dsse.SUMS_PAYLOAD_TYPE, sums, key))
        files.append(layout.SUMS_ENVELOPE)
    write_bytes_atomic(out_dir / layout.SUMS, sums)  # last: its presence means the rest is in place

    released = tuple(
        ReleasedWheel(
            platform=f.platform,
            path=out_dir / f.filename,
            sha256=f.sha256,
            sbom=out_dir / layout.sbom_name(f.filename),
            statement=out_dir / layout.statement_name(f.filename),
            envelope=out_dir / layout.envelope_name(f.filename) if key is not None else None,
            reports=tuple(out_dir / a.name for a in attached if a.wheel == f.filename),
        )
        for f in facts
    )
    return Release(
        directory=out_dir,
        version=facts[0].version,
        wheels=released,
        files=tuple(sorted(files)),
        notes=out_dir / layout.NOTES,
        sums=out_dir / layout.SUMS,
        key_id=key.keyid if key is not None else None,
    )
