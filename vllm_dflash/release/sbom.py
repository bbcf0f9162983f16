"""CycloneDX 1.6 JSON SBOM of one wheel, made with cyclonedx-python-lib and checked with its strict JSON validator.

- metadata.component: the wheel (purl pkg:pypi/<name>@<version>, SHA-256 of the file, license, platform);
  its pedigree names the upstream base wheel and the upstream sdist (or git commit) as ancestors with their
  SHA-256, the fork commits, and the patches (each patch's sha256 is a `vllm-dflash:patch` property).
- components: one per Requires-Dist line of the wheel's METADATA. A requirement is a range, not a version, so
  `version` is set only for an exact pin (`==X`); the PEP 508 line is kept verbatim in `vllm-dflash:requires-dist`
  and its specifier in `vllm-dflash:version-specifier`. Lines that only an extra of the wheel pulls in have
  scope `optional` (and `vllm-dflash:extra`), the others `required`.
- reproducible: bom-refs are fixed names, metadata.timestamp is omitted unless a time is given, and the
  serialNumber is a UUID derived from the document's own content (same content, same serial).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from vllm_dflash import __version__ as TOOL_VERSION
from vllm_dflash.errors import VerifyError
from vllm_dflash.release.facts import SourceMaterial, WheelFacts

SPEC_VERSION = "1.6"
NS = "vllm-dflash"
_SERIAL_NAMESPACE = uuid.UUID("5b4b1c1e-5d0a-4c55-9f43-6a0d1c8e2f17")  # ours: serials derive from content
_PLACEHOLDER_SERIAL = uuid.UUID(int=0)
_HINT = "restore the release's own SBOM (or make the release again)"


def _purl(name: str, version: str | None, file_name: str | None = None) -> Any:
    from packageurl import PackageURL
    from packaging.utils import canonicalize_name

    qualifiers = {"file_name": file_name} if file_name else None
    return PackageURL(type="pypi", name=str(canonicalize_name(name)), version=version, qualifiers=qualifiers)


def _sha256(hexdigest: str) -> Any:
    from cyclonedx.model import HashAlgorithm, HashType

    return HashType(alg=HashAlgorithm.SHA_256, content=hexdigest)


def _prop(name: str, value: str) -> Any:
    from cyclonedx.model import Property

    return Property(name=f"{NS}:{name}", value=value)


def _ancestors(facts: WheelFacts, source: SourceMaterial) -> list[Any]:
    from cyclonedx.model import ExternalReference, ExternalReferenceType, XsUri
    from cyclonedx.model.component import Component, ComponentType

    build = facts.provenance.build
    out: list[Any] = []
    if build.base_wheel and build.base_wheel_sha256:
        out.append(
            Component(
                bom_ref="upstream-wheel",
                type=ComponentType.LIBRARY,
                name=facts.name,
                version=source.version,
                purl=_purl(facts.name, source.version, build.base_wheel),
                hashes=[_sha256(build.base_wheel_sha256)],
                description="the upstream wheel our Python files were overlaid onto",
            )
        )
    if source.kind == "sdist" and source.filename and source.sha256:
        out.append(
            Component(
                bom_ref="upstream-sdist",
                type=ComponentType.LIBRARY,
                name=facts.name,
                version=source.version,
                purl=_purl(facts.name, source.version, source.filename),
                hashes=[_sha256(source.sha256)],
                description="the upstream source the patch queue was applied to",
                properties=[_prop("git-commit", source.commit)],
            )
        )
    else:
        out.append(
            Component(
                bom_ref="upstream-git",
                type=ComponentType.LIBRARY,
                name=facts.name,
                version=source.version,
                description="the upstream source the patch queue was applied to",
                external_references=[ExternalReference(type=ExternalReferenceType.VCS, url=XsUri(source.git_url))],
                properties=[_prop("git-commit", source.commit)],
            )
        )
    return out


def _requirement_component(i: int, req: Any) -> Any:
    from cyclonedx.model.component import Component, ComponentScope, ComponentType

    props = [_prop("requires-dist", req.line)]
    if req.specifier:
        props.append(_prop("version-specifier", req.specifier))
    if req.marker:
        props.append(_prop("marker", req.marker))
    if req.for_extra:
        props.append(_prop("extra", req.for_extra))
    exact = req.exact_version
    return Component(
        bom_ref=f"requires-dist-{i:03d}-{req.canonical}",
        type=ComponentType.LIBRARY,
        name=req.name,
        version=exact,
        purl=_purl(req.name, exact),
        scope=ComponentScope.OPTIONAL if req.for_extra else ComponentScope.REQUIRED,
        properties=props,
    )


def _canonical(doc: Any) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _content_serial(doc: Mapping[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "serialNumber"}
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    return f"urn:uuid:{uuid.uuid5(_SERIAL_NAMESPACE, digest)}"


def build_sbom(facts: WheelFacts, source: SourceMaterial, timestamp: datetime | None = None) -> bytes:
    """The SBOM's bytes (JSON, sorted keys): the same wheel, source and tool versions give the same bytes."""
    from cyclonedx.model.bom import Bom
    from cyclonedx.model.component import Commit, Component, ComponentType, Diff, Patch, PatchClassification, Pedigree
    from cyclonedx.model.license import LicenseExpression
    from cyclonedx.output.json import JsonV1Dot6

    p = facts.provenance
    props = [
        _prop("wheel-file", facts.filename),
        _prop("platform", facts.platform),
        _prop("build-mode", p.build.mode),
        _prop("upstream-version", p.upstream.version),
        *(_prop("patch", f"{rec.sha256}  {rec.name}") for rec in p.patches),
    ]
    main = Component(
        bom_ref="wheel",
        type=ComponentType.LIBRARY,
        name=facts.name,
        version=facts.version,
        description=facts.summary or None,
        purl=_purl(facts.name, facts.version),
        hashes=[_sha256(facts.sha256)],
        licenses=[LicenseExpression(facts.license_expression)] if facts.license_expression else None,
        properties=props,
        pedigree=Pedigree(
            ancestors=_ancestors(facts, source),
            commits=[Commit(uid=rec.commit, message=f"{rec.name}: {rec.subject}") for rec in p.patches],
            patches=[
                Patch(type=PatchClassification.UNOFFICIAL, diff=Diff(url=_xs(f"patches/{rec.name}")))
                for rec in p.patches
            ],
            notes=f"upstream {p.upstream.tag} ({p.upstream.commit}) with the {len(p.patches)}-patch vllm-dflash queue, "
            f"{p.build.mode} build",
        ),
    )
    deps = [_requirement_component(i, r) for i, r in enumerate(facts.requirements)]
    bom = Bom(serial_number=_PLACEHOLDER_SERIAL)
    bom.metadata.component = main
    if timestamp is not None:
        bom.metadata.timestamp = timestamp
    bom.metadata.tools.components.add(Component(type=ComponentType.APPLICATION, name=NS, version=TOOL_VERSION))
    bom.metadata.tools.components.add(
        Component(
            type=ComponentType.LIBRARY,
            name="cyclonedx-python-lib",
            version=importlib.metadata.version("cyclonedx-python-lib"),
        )
    )
    for dep in deps:
        bom.components.add(dep)
    bom.register_dependency(main, deps)
    doc = json.loads(JsonV1Dot6(bom).output_as_string())
    if timestamp is None:
        # The library always stamps "now"; a time that is no input would make every run differ.
        doc["metadata"].pop("timestamp", None)
    doc["serialNumber"] = _content_serial(doc)
    raw = _canonical(doc)
    problem = schema_problem(raw)
    if problem is not None:
        raise VerifyError(f"the SBOM made for {facts.filename} fails the CycloneDX schema: {problem}", "report this")
    return raw


def _xs(url: str) -> Any:
    from cyclonedx.model import XsUri

    return XsUri(url)


def schema_problem(raw: bytes) -> str | None:
    """None when `raw` validates against the CycloneDX 1.6 JSON schema (strict), else the first error, one line."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    try:
        error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"not JSON ({exc})"
    if error is None:
        return None
    data = getattr(error, "data", None)
    message = getattr(data, "message", None) or str(error)
    path = "/".join(str(p) for p in getattr(data, "absolute_path", ()) or ())
    return (f"at /{path}: " if path else "") + " ".join(str(message).split())[:300]


def _props(component: Mapping[str, Any], name: str) -> list[str]:
    return sorted(
        str(p.get("value"))
        for p in component.get("properties") or []
        if isinstance(p, Mapping) and p.get("name") == f"{NS}:{name}"
    )


def check_sbom(raw: bytes, facts: WheelFacts, where: str) -> None:
    """The SBOM validates against the schema and describes this very wheel; one VerifyError line otherwise."""
    problem = schema_problem(raw)
    if problem is not None:
        raise VerifyError(f"{where}: fails the CycloneDX {SPEC_VERSION} schema: {problem}", _HINT)
    doc = json.loads(raw)
    if doc.get("specVersion") != SPEC_VERSION:
        raise VerifyError(f"{where}: specVersion {doc.get('specVersion')!r}, expected {SPEC_VERSION}", _HINT)
    if doc.get("serialNumber") != _content_serial(doc):
        raise VerifyError(f"{where}: its serialNumber does not derive from its content (edited)", _HINT)
    main = (doc.get("metadata") or {}).get("component") or {}
    hashes = {h.get("alg"): h.get("content") for h in main.get("hashes") or []}
    if hashes.get("SHA-256") != facts.sha256:
        raise VerifyError(
            f"{where}: names SHA-256 {hashes.get('SHA-256')}, but {facts.filename} has {facts.sha256}", _HINT
        )
    expected_purl = _purl(facts.name, facts.version).to_string()
    if (main.get("name"), main.get("version"), main.get("purl")) != (facts.name, facts.version, expected_purl):
        raise VerifyError(f"{where}: its main component is not {facts.name} {facts.version} ({expected_purl})", _HINT)
    if _props(main, "wheel-file") != [facts.filename]:
        raise VerifyError(f"{where}: describes another wheel file than {facts.filename}", _HINT)
    lines = sorted(v for c in doc.get("components") or [] if isinstance(c, Mapping) for v in _props(c, "requires-dist"))
    if lines != sorted(r.line for r in facts.requirements):
        raise VerifyError(f"{where}: its components are not the Requires-Dist lines of {facts.filename}", _HINT)
    patches = sorted(f"{r.sha256}  {r.name}" for r in facts.provenance.patches)
    if _props(main, "patch") != patches:
        raise VerifyError(f"{where}: its patches are not the ones {facts.filename}'s provenance records", _HINT)
    base = facts.provenance.build.base_wheel_sha256
    ancestors = ((main.get("pedigree") or {}).get("ancestors")) or []
    ancestor_hashes = {h.get("content") for a in ancestors for h in a.get("hashes") or []}
    if base and base not in ancestor_hashes:
        raise VerifyError(f"{where}: does not name the upstream base wheel {base} as an ancestor", _HINT)
