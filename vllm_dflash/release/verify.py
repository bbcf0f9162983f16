"""verify: a release directory (or one artifact in it) is exactly what make_release wrote for its wheels.

Checks, in order, each failure one VerifyError line (exit 17) naming the file and what is wrong:
1. SHA256SUMS is in its canonical form, lists only release files, and every listed file has its sha256;
   for a directory, every file is listed and every listed file is there.
2. Signatures (when the release is signed, or a key or a signature is required): SHA256SUMS.dsse.json signs
   SHA256SUMS and each <wheel>.intoto.dsse.json signs that wheel's statement, with the user's public key (or,
   without one, the release's own signing-key.pub: integrity, not authenticity; the result says which).
3. Per wheel: the SBOM validates against the CycloneDX schema and describes this wheel (sha256, Requires-Dist,
   patches); the statement validates as in-toto Statement v1 / SLSA provenance v1 and its subject is this
   wheel's name and sha256, its materials the base wheel and patches the wheel's provenance records; SBOM and
   statement name the same upstream source; every attached validation report is sealed (HMAC too with a
   report key), passed, and names this wheel's sha256.
4. The release notes name every wheel's sha256.
5. images.json (when the release names images): every per-platform image names this release's wheel of its
   platform by file name and sha256, one image per platform and one index at most, each named in the notes.
6. The deployment manifests (deploy.py): present exactly when images are named, each pulling the deployment image,
   and (with the manifest's profiles) byte for byte what the deployment profile gives.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vllm_dflash import report as reports
from vllm_dflash.errors import VerifyError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Profile
from vllm_dflash.release import deploy, dsse, layout
from vllm_dflash.release.facts import WheelFacts, read_facts
from vllm_dflash.release.images import check_images
from vllm_dflash.release.layout import Kind
from vllm_dflash.release.notes import ImageRef, sha256s_named
from vllm_dflash.release.sbom import check_sbom
from vllm_dflash.release.statement import check_statement
from vllm_dflash.validate import verdict

_RESTORE = "restore the file from the published release (or make the release again)"


@dataclass(frozen=True)
class VerifyOptions:
    public_keys: tuple[Path, ...] = ()  # PEM Ed25519 public keys the release must be signed with (any one)
    require_signature: bool = False  # refuse an unsigned release even without a key
    report_key: bytes | None = None  # $VLLM_DFLASH_REPORT_KEY: attached reports must carry a valid HMAC
    # The manifest's profiles: every attached report is judged again under the one of its name (none: refused).
    profiles: Mapping[str, Profile] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifiedReport:
    name: str
    profile: str
    acceptance_length: float | None


@dataclass(frozen=True)
class VerifiedWheel:
    filename: str
    platform: str
    version: str
    sha256: str
    reports: tuple[VerifiedReport, ...]


@dataclass(frozen=True)
class VerifyResult:
    directory: Path
    wheels: tuple[VerifiedWheel, ...]  # the wheels checked (all, or the one an artifact belongs to)
    files: tuple[str, ...]  # every file whose content was checked
    partial: bool  # an artifact was verified, not the whole directory
    signed: bool
    key_id: str | None
    authenticated: bool  # the signatures were checked with a key the user supplied
    images: tuple[ImageRef, ...] = ()  # the container images images.json names (checked against the wheels)
    digests: Mapping[str, str] = field(default_factory=dict)  # sha256 of every file checked, as verified

    def summary(self) -> str:
        what = "artifact" if self.partial else "release"
        sig = "unsigned"
        if self.signed:
            sig = f"signed by {self.key_id}" + (
                "" if self.authenticated else " (its own key: pass --key to authenticate)"
            )
        wheels = ", ".join(f"{w.platform} {w.sha256[:12]}… ({len(w.reports)} report(s))" for w in self.wheels)
        named = "; images " + ", ".join(f"{i.platform or 'index'} {i.digest[7:19]}…" for i in self.images)
        return f"{what} {self.directory} verified: {len(self.files)} files, {wheels}; {sig}" + (
            named if self.images else ""
        )


RELEASE_DOC_LIMIT = 256 << 20  # a release's documents (SBOM, statements, notes, sums) are KBs; wheels are hashed


def _one_line(exc: VerifyError) -> VerifyError:
    if "\n" not in exc.message and "\n" not in exc.hint:
        return exc
    return VerifyError(" ".join(exc.message.split()), " ".join(exc.hint.split()))


def _read(path: Path) -> bytes:
    from vllm_dflash.paths import read_bounded

    try:
        return read_bounded(path, RELEASE_DOC_LIMIT, path.name, VerifyError, _RESTORE)
    except OSError as exc:
        raise VerifyError(f"{path.name}: cannot read it ({exc.strerror or exc})", _RESTORE) from None


def verify(target: Path, options: VerifyOptions = VerifyOptions()) -> VerifyResult:
    """Verify a release directory, or the wheel (and its files) that an artifact inside one belongs to."""
    try:
        return _verify(Path(target), options)
    except VerifyError as exc:
        raise _one_line(exc) from None


def _verify(target: Path, options: VerifyOptions) -> VerifyResult:
    if target.is_dir():
        directory, focus = target, None
    elif target.is_file():
        directory, focus = target.parent, target.name
    else:
        raise VerifyError(f"{target}: no such file or directory", "pass a release directory or a file in one")
    sums_path = directory / layout.SUMS
    if not sums_path.is_file():
        raise VerifyError(f"{directory}: has no {layout.SUMS}, so it is not a release", "pass a release directory")
    sums_raw = _read(sums_path)
    listed = layout.parse_sums(sums_raw, layout.SUMS)
    members: dict[str, layout.Member] = {}
    for name in listed:
        m = layout.classify(name)
        if m is None or m.kind in (Kind.SUMS, Kind.SUMS_ENVELOPE):
            raise VerifyError(f"{layout.SUMS}: lists {name}, which is no release file", _RESTORE)
        members[name] = m
    all_wheels = layout.wheels_of(listed)
    if not all_wheels:
        raise VerifyError(f"{layout.SUMS}: lists no wheel", _RESTORE)
    for m in members.values():
        if m.wheel is not None and m.wheel not in listed:
            raise VerifyError(f"{layout.SUMS}: lists {m.name}, but not the wheel {m.wheel} it belongs to", _RESTORE)

    # Scope: the whole release, or the wheel an artifact belongs to.
    scope = all_wheels
    if focus is not None:
        fm = layout.classify(focus)
        if fm is None:
            raise VerifyError(f"{focus}: not a release file", "pass a release directory or a file in one")
        if fm.kind not in (Kind.SUMS, Kind.SUMS_ENVELOPE) and focus not in listed:
            raise VerifyError(f"{focus}: not listed in {layout.SUMS}", _RESTORE)
        if fm.wheel is not None:
            scope = [fm.wheel]
    partial = scope != all_wheels
    present = {p.name for p in directory.iterdir()}
    if partial:
        wanted = {n for n, m in members.items() if m.wheel in scope or m.wheel is None}
        strays = {n for n in present - set(listed) if (m := layout.classify(n)) is not None and m.wheel in scope}
    else:
        wanted = set(listed)
        strays = present - set(listed) - {layout.SUMS, layout.SUMS_ENVELOPE}
        if layout.NOTES not in listed:
            raise VerifyError(f"{layout.SUMS}: does not list {layout.NOTES}", _RESTORE)
    if strays:
        raise VerifyError(f"{sorted(strays)[0]}: in the release directory but not in {layout.SUMS}", _RESTORE)
    must = {n for n in wanted if members[n].wheel is not None} if partial else wanted
    for name in sorted(must - present):
        raise VerifyError(f"{name}: listed in {layout.SUMS} but missing", _RESTORE)
    # A release holds its own files: a symlink (to anywhere, inside or out) or a FIFO/device is refused, so what was
    # verified is what publish copies. Hard links are files (make_release links the wheels).
    for name in sorted((wanted & present) | ({layout.SUMS, layout.SUMS_ENVELOPE} & present)):
        path = directory / name
        if path.is_symlink() or not path.is_file():
            kind = "a symbolic link" if path.is_symlink() else "not a regular file"
            raise VerifyError(f"{name}: is {kind}; a release holds its own files", _RESTORE)

    # 1. Signatures, SHA256SUMS's first: it vouches for every other hash.
    signed_files = [n for n, m in members.items() if m.kind in (Kind.ENVELOPE, Kind.PUBLIC_KEY)]
    signed = bool(signed_files) or layout.SUMS_ENVELOPE in present
    key: Ed25519PublicKey | None = None
    authenticated = False
    envelope_raw = b""
    if not signed:
        if options.public_keys or options.require_signature:
            raise VerifyError(f"{directory}: the release is not signed", "ask for a signed release")
    else:
        key, authenticated = _signing_key(directory, listed, options)
        if layout.SUMS_ENVELOPE not in present:
            raise VerifyError(f"{layout.SUMS_ENVELOPE}: missing from a signed release", _RESTORE)
        envelope_raw = _read(directory / layout.SUMS_ENVELOPE)
        _check_envelope(
            directory / layout.SUMS_ENVELOPE, dsse.SUMS_PAYLOAD_TYPE, layout.SUMS, sums_raw, key, envelope_raw
        )

    # 2. Every file's sha256.
    checked: list[str] = [layout.SUMS, *([layout.SUMS_ENVELOPE] if key is not None else [])]
    digests: dict[str, str] = {layout.SUMS: hashlib.sha256(sums_raw).hexdigest()}
    if key is not None:
        digests[layout.SUMS_ENVELOPE] = hashlib.sha256(envelope_raw).hexdigest()
    for name in sorted(wanted & present):
        got = sha256_file(directory / name, VerifyError)
        if got != listed[name]:
            raise VerifyError(
                f"{name}: sha256 {got[:16]}… but {layout.SUMS} lists {listed[name][:16]}… (one of them was altered)",
                _RESTORE,
            )
        checked.append(name)
        digests[name] = got

    # 3. Per wheel.
    verified: list[VerifiedWheel] = []
    for wheel in scope:
        facts = read_facts(directory / wheel, VerifyError, sha256=listed[wheel])
        for needed in (layout.sbom_name(wheel), layout.statement_name(wheel)):
            if needed not in listed:
                raise VerifyError(f"{needed}: missing (every wheel of a release has its SBOM and statement)", _RESTORE)
        sbom_raw = _read(directory / layout.sbom_name(wheel))
        check_sbom(sbom_raw, facts, layout.sbom_name(wheel))
        statement_raw = _read(directory / layout.statement_name(wheel))
        statement = check_statement(statement_raw, facts, layout.statement_name(wheel))
        _same_source(json.loads(sbom_raw), statement, layout.sbom_name(wheel))
        envelope = layout.envelope_name(wheel)
        if key is not None:
            if envelope not in listed:
                raise VerifyError(f"{envelope}: missing from a signed release", _RESTORE)
            _check_envelope(
                directory / envelope, dsse.INTOTO_PAYLOAD_TYPE, layout.statement_name(wheel), statement_raw, key
            )
        verified.append(_wheel_reports(directory, facts, members, options))

    # 4. Notes.
    if layout.NOTES in wanted and layout.NOTES in present:
        named = sha256s_named(_read(directory / layout.NOTES).decode("utf-8", errors="replace"))
        for wheel in scope:
            if listed[wheel] not in named:
                raise VerifyError(f"{layout.NOTES}: does not name {wheel}'s sha256", _RESTORE)
    # 5. Images.
    images: list[ImageRef] = []
    if layout.IMAGES in wanted and layout.IMAGES in present:
        notes = _read(directory / layout.NOTES).decode("utf-8", errors="replace") if layout.NOTES in present else ""
        images = check_images(
            _read(directory / layout.IMAGES), {w: listed[w] for w in all_wheels}, notes, layout.IMAGES, _RESTORE
        )
    # 6. Deployment manifests (a whole release only: they belong to no wheel).
    if not partial:
        deploys = {n: _read(directory / n) for n, m in members.items() if m.kind is Kind.DEPLOY}
        deploy.check(deploys, images, options.profiles)
    return VerifyResult(
        directory=directory,
        wheels=tuple(verified),
        files=tuple(sorted(set(checked))),
        partial=partial,
        signed=signed,
        key_id=dsse.key_id(key) if key is not None else None,
        authenticated=authenticated,
        images=tuple(images),
        digests=digests,
    )


def _signing_key(directory: Path, listed: Mapping[str, str], options: VerifyOptions) -> tuple[Ed25519PublicKey, bool]:
    """The key to check signatures with, and whether the user supplied it."""
    if layout.PUBLIC_KEY not in listed:
        raise VerifyError(f"{layout.SUMS}: a signed release must list {layout.PUBLIC_KEY}", _RESTORE)
    own = dsse.parse_public_key(_read(directory / layout.PUBLIC_KEY), layout.PUBLIC_KEY)
    if not options.public_keys:
        return own, False
    users = [dsse.load_public_key(p) for p in options.public_keys]
    for user in users:
        if dsse.key_id(user) == dsse.key_id(own):
            return user, True
    raise VerifyError(
        f"{layout.PUBLIC_KEY}: the release is signed with key {dsse.key_id(own)}, not with "
        f"{', '.join(dsse.key_id(u) for u in users)}",
        "verify with the publisher's public key; a release re-signed by someone else is not theirs",
    )


def _check_envelope(
    path: Path, payload_type: str, signed: str, expected: bytes, key: Ed25519PublicKey, raw: bytes | None = None
) -> None:
    payload, sigs = dsse.open_envelope(raw if raw is not None else _read(path), path.name, payload_type)
    if payload != expected:
        raise VerifyError(f"{path.name}: signs another {signed} than the one here (one of them was altered)", _RESTORE)
    dsse.check_signature(payload_type, payload, sigs, key, path.name)


def _same_source(sbom: Mapping[str, Any], statement: Mapping[str, Any], where: str) -> None:
    """The SBOM's upstream ancestors carry the same sha256s as the statement's upstream materials."""
    deps = statement["predicate"]["buildDefinition"].get("resolvedDependencies") or []
    material = {
        str((d.get("digest") or {}).get("sha256"))
        for d in deps
        if (d.get("annotations") or {}).get("role") in ("upstream-sdist", "base-wheel")
    }
    main = (sbom.get("metadata") or {}).get("component") or {}
    ancestors = {
        str(h.get("content"))
        for a in (main.get("pedigree") or {}).get("ancestors") or []
        for h in a.get("hashes") or []
        if h.get("alg") == "SHA-256"
    }
    if material != ancestors:
        raise VerifyError(f"{where}: its upstream ancestors differ from the statement's materials", _RESTORE)


def _wheel_reports(
    directory: Path, facts: WheelFacts, members: Mapping[str, layout.Member], options: VerifyOptions
) -> VerifiedWheel:
    found: list[VerifiedReport] = []
    for name, m in sorted(members.items()):
        if m.kind is not Kind.REPORT or m.wheel != facts.filename:
            continue
        rep = reports.load(directory / name, options.report_key, VerifyError, _RESTORE)
        judged = verdict.check(rep, options.profiles, VerifyError, _RESTORE)
        if judged.verdict != "pass":
            raise VerifyError(f"{name}: verdict {judged.verdict} ({judged.reason})", "attach passing reports only")
        if rep.artifact_sha256 != facts.sha256:
            raise VerifyError(
                f"{name}: names artifact {rep.artifact_sha256 or 'none'}, not {facts.filename} ({facts.sha256})",
                "attach the report made for this wheel",
            )
        if rep.profile_name != m.profile:
            raise VerifyError(f"{name}: is a report of profile {rep.profile_name}, not {m.profile}", _RESTORE)
        found.append(VerifiedReport(name=name, profile=rep.profile_name, acceptance_length=judged.acceptance_length))
    return VerifiedWheel(
        filename=facts.filename,
        platform=facts.platform,
        version=facts.version,
        sha256=facts.sha256,
        reports=tuple(found),
    )
