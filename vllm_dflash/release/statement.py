"""in-toto Statement v1 with a SLSA provenance v1 predicate for one wheel.

subject: the wheel's file name and sha256. buildDefinition.resolvedDependencies: the upstream sdist (or git
commit), the upstream base wheel, every patch (sha256) and the tool. runDetails.builder: `builder_id` with the
tool version. No timestamps or invocation ids: the same inputs give the same bytes.

Schema check: in-toto publishes the Statement, ResourceDescriptor and SLSA Provenance v1 schemas as protobuf
definitions (in-toto/attestation, protos/in_toto_attestation/...), whose Python bindings are the
`in-toto-attestation` PyPI package. A statement is parsed into those messages with unknown fields refused,
must pass the package's own `Statement.validate()`, and must round-trip to the same JSON (no aliased or
mistyped field slips through); the SLSA predicate is parsed the same way and its REQUIRED fields checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from vllm_dflash.errors import VerifyError
from vllm_dflash.release.facts import SourceMaterial, WheelFacts

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:vllm-dflash:build-type:wheel:v1"
DEFAULT_BUILDER_ID = "urn:vllm-dflash:builder:local"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_GIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_HINT = "restore the release's own statement (or make the release again)"


def _purl(name: str, version: str, file_name: str | None = None) -> str:
    from packageurl import PackageURL

    return str(
        PackageURL(
            type="pypi", name=name, version=version, qualifiers={"file_name": file_name} if file_name else None
        ).to_string()
    )


def build_statement(facts: WheelFacts, source: SourceMaterial, builder_id: str = DEFAULT_BUILDER_ID) -> bytes:
    p = facts.provenance
    deps: list[dict[str, Any]] = []
    if source.kind == "sdist" and source.filename and source.sha256:
        deps.append(
            {
                "name": source.filename,
                "uri": _purl(facts.name, source.version, source.filename),
                "digest": {"sha256": source.sha256},
                "annotations": {"role": "upstream-sdist", "commit": source.commit},
            }
        )
    else:
        rd: dict[str, Any] = {
            "uri": f"git+{source.git_url}@{source.commit}",
            "annotations": {"role": "upstream-source", "commit": source.commit},
        }
        if _GIT_SHA.match(source.commit):
            rd["digest"] = {"gitCommit": source.commit}
        deps.append(rd)
    if p.build.base_wheel and p.build.base_wheel_sha256:
        deps.append(
            {
                "name": p.build.base_wheel,
                "uri": _purl(facts.name, source.version, p.build.base_wheel),
                "digest": {"sha256": p.build.base_wheel_sha256},
                "annotations": {"role": "base-wheel"},
            }
        )
    for rec in p.patches:
        deps.append(
            {
                "name": f"patches/{rec.name}",
                "digest": {"sha256": rec.sha256},
                "annotations": {
                    "role": "patch",
                    "subject": rec.subject,
                    "dropWhen": rec.drop_when,
                    "forkCommit": rec.commit,
                    "queue": rec.queue,
                },
            }
        )
    deps.append(
        {
            "name": p.build.tool,
            "uri": f"pkg:generic/{p.build.tool}@{p.build.tool_version}",
            "annotations": {"role": "tool", "version": p.build.tool_version},
        }
    )
    internal: dict[str, Any] = {"modeReason": p.build.mode_reason, "sourceKind": p.upstream.source_kind}
    if p.build.mode == "full":
        internal.update({"command": list(p.build.command), "env": dict(p.build.env)})
        if p.build.compiler_cache:
            internal["compilerCache"] = p.build.compiler_cache
    run_details: dict[str, Any] = {"builder": {"id": builder_id, "version": {p.build.tool: p.build.tool_version}}}
    if _GIT_SHA.match(p.fork.head):  # the fork branch head is a byproduct: the commit the wheel's files come from
        run_details["byproducts"] = [
            {
                "name": f"fork branch {p.fork.branch}",
                "digest": {"gitCommit": p.fork.head},
                "annotations": {"base": p.fork.base},
            }
        ]
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": facts.filename, "digest": {"sha256": facts.sha256}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "version": p.version,
                    "variant": p.variant,
                    "mode": p.build.mode,
                    "platform": facts.platform,
                    "upstream": {
                        "version": p.upstream.version,
                        "tag": p.upstream.tag,
                        "gitUrl": p.upstream.git_url,
                        "commit": p.upstream.commit_pinned,
                    },
                    "series": [rec.name for rec in p.patches],
                    "forkBranch": p.fork.branch,
                },
                "internalParameters": internal,
                "resolvedDependencies": deps,
            },
            "runDetails": run_details,
        },
    }
    raw = (json.dumps(statement, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    problem = schema_problem(raw)
    if problem is not None:
        raise VerifyError(f"the statement made for {facts.filename} is invalid: {problem}", "report this")
    return raw


# google.protobuf.Struct fields: kept verbatim by protobuf's JSON form, empty strings included.
_STRUCT_FIELDS = frozenset({"predicate", "annotations", "externalParameters", "internalParameters"})


def _strip_empty(value: Any) -> Any:
    """What protobuf's JSON form keeps of `value`: proto3 drops empty strings, lists and maps, except in Structs."""
    if isinstance(value, Mapping):
        return {
            k: v if k in _STRUCT_FIELDS else _strip_empty(v)
            for k, v in value.items()
            if k in _STRUCT_FIELDS or v not in ("", [], {}, None)
        }
    if isinstance(value, list):
        return [_strip_empty(v) for v in value]
    return value


def schema_problem(raw: bytes) -> str | None:
    """None when `raw` is a valid in-toto Statement v1 whose SLSA provenance v1 predicate is well-formed."""
    import google.protobuf.json_format as pbjson
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement

    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"not JSON ({exc})"
    if not isinstance(doc, dict):
        return "not a JSON object"
    try:
        pb = pbjson.ParseDict(doc, statement_pb2.Statement(), ignore_unknown_fields=False)
        Statement.copy_from_pb(pb).validate()
    except (pbjson.ParseError, ValueError, TypeError) as exc:
        return "not an in-toto Statement v1: " + " ".join(str(exc).split())[:300]
    if pbjson.MessageToDict(pb) != _strip_empty(doc):
        return "not an in-toto Statement v1: fields that are not the schema's own JSON names or types"
    for i, s in enumerate(doc.get("subject") or []):
        for alg, value in (s.get("digest") or {}).items():
            if alg == "sha256" and not (isinstance(value, str) and _HEX64.match(value)):
                return f"subject[{i}].digest.sha256 is not 64 lowercase hex digits"
    if doc.get("predicateType") != PREDICATE_TYPE:
        return None  # another predicate: the statement layer is all we can check
    try:
        pred = pbjson.ParseDict(doc.get("predicate"), provenance_pb2.Provenance(), ignore_unknown_fields=False)
    except (pbjson.ParseError, ValueError, TypeError) as exc:
        return "predicate is not SLSA provenance v1: " + " ".join(str(exc).split())[:300]
    if pbjson.MessageToDict(pred) != _strip_empty(doc.get("predicate")):
        return "predicate is not SLSA provenance v1: fields that are not the schema's own JSON names or types"
    # REQUIRED by the SLSA v1 provenance spec (proto3 cannot say so itself).
    if not pred.build_definition.build_type:
        return "predicate.buildDefinition.buildType is required"
    if not pred.build_definition.HasField("external_parameters"):
        return "predicate.buildDefinition.externalParameters is required"
    if not pred.run_details.builder.id:
        return "predicate.runDetails.builder.id is required"
    for i, rd in enumerate(pred.build_definition.resolved_dependencies):
        if not (rd.name or rd.uri or rd.digest):
            return f"predicate.buildDefinition.resolvedDependencies[{i}] has no name, uri or digest"
    return None


def check_statement(raw: bytes, facts: WheelFacts, where: str) -> Mapping[str, Any]:
    """The statement is valid and its subject and materials are this wheel's; returns the parsed document."""
    problem = schema_problem(raw)
    if problem is not None:
        raise VerifyError(f"{where}: {problem}", _HINT)
    doc: dict[str, Any] = json.loads(raw)
    if doc["predicateType"] != PREDICATE_TYPE:
        raise VerifyError(f"{where}: predicateType {doc['predicateType']!r}, expected {PREDICATE_TYPE}", _HINT)
    subjects = [(s.get("name"), (s.get("digest") or {}).get("sha256")) for s in doc["subject"]]
    if subjects != [(facts.filename, facts.sha256)]:
        raise VerifyError(f"{where}: its subject is {subjects}, not {facts.filename} with sha256 {facts.sha256}", _HINT)
    deps = doc["predicate"]["buildDefinition"].get("resolvedDependencies") or []
    digests = {(d.get("name"), (d.get("digest") or {}).get("sha256")) for d in deps}
    p = facts.provenance
    wanted = {(f"patches/{r.name}", r.sha256) for r in p.patches}
    if p.build.base_wheel and p.build.base_wheel_sha256:
        wanted.add((p.build.base_wheel, p.build.base_wheel_sha256))
    missing = sorted(str(n) for n, _ in wanted - digests)
    if missing:
        raise VerifyError(f"{where}: lacks the material(s) {', '.join(missing)} the wheel's provenance records", _HINT)
    patch_deps = [d.get("name") for d in deps if str(d.get("name", "")).startswith("patches/")]
    if patch_deps != [f"patches/{r.name}" for r in p.patches]:
        raise VerifyError(f"{where}: its patches are not the wheel's queue, in order", _HINT)
    return doc
