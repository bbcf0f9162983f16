"""The release directory: file names, what each file is, and the SHA256SUMS format.

    <wheel>                          each platform's wheel (hard link or copy)
    <wheel>.cdx.json                 CycloneDX 1.6 JSON SBOM of that wheel
    <wheel>.intoto.json              in-toto Statement v1, SLSA provenance v1 predicate, subject = the wheel
    <wheel>.intoto.dsse.json         DSSE envelope over the statement (signed releases)
    <wheel>.validation-<profile>.json  sealed validation reports that name the wheel's sha256 (when given)
    RELEASE-NOTES.md
    images.json                      the container images named (by digest), bound to their wheels (`images.py`)
    deploy-*.yaml                    Kubernetes manifests pulling the image (with images; `deploy.py` names them)
    signing-key.pub                  PEM public key the envelopes verify with (signed releases)
    SHA256SUMS                       `sha256sum -c` format over every file above
    SHA256SUMS.dsse.json             DSSE envelope over SHA256SUMS (signed releases)

SHA256SUMS covers every file but itself and its envelope; the envelope covers SHA256SUMS, so a signature
covers the whole release.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_dflash.errors import VerifyError
from vllm_dflash.paths import bare_name

SUMS = "SHA256SUMS"
SUMS_ENVELOPE = "SHA256SUMS.dsse.json"
NOTES = "RELEASE-NOTES.md"
IMAGES = "images.json"
PUBLIC_KEY = "signing-key.pub"
SBOM_SUFFIX = ".cdx.json"
STATEMENT_SUFFIX = ".intoto.json"
ENVELOPE_SUFFIX = ".intoto.dsse.json"
REPORT_INFIX = ".validation-"
# release/deploy.py's file names (kept here so layout imports nothing of the release's documents).
DEPLOY_NAMES = (
    "deploy-production-stack.values.yaml",
    "deploy-kserve-servingruntime.yaml",
    "deploy-kserve-llminferenceservice.yaml",
)

_SUMS_LINE = re.compile(r"^(?P<sha>[0-9a-f]{64})  (?P<name>[^\n/]+)$")


class Kind(enum.Enum):
    WHEEL = "wheel"
    SBOM = "SBOM"
    STATEMENT = "provenance statement"
    ENVELOPE = "signature envelope"
    REPORT = "validation report"
    NOTES = "release notes"
    IMAGES = "image list"
    DEPLOY = "deployment manifest"
    PUBLIC_KEY = "public key"
    SUMS = "checksum list"
    SUMS_ENVELOPE = "checksum list signature"


@dataclass(frozen=True)
class Member:
    name: str
    kind: Kind
    wheel: str | None  # the wheel a per-wheel file belongs to
    profile: str | None = None  # reports only


def sbom_name(wheel: str) -> str:
    return wheel + SBOM_SUFFIX


def statement_name(wheel: str) -> str:
    return wheel + STATEMENT_SUFFIX


def envelope_name(wheel: str) -> str:
    return wheel + ENVELOPE_SUFFIX


def report_name(wheel: str, profile: str) -> str:
    name = f"{wheel}{REPORT_INFIX}{profile}.json"
    return bare_name(name, "validation report file name", VerifyError)


def classify(name: str) -> Member | None:
    """What `name` is in a release, or None when it is no release file."""
    fixed = {
        SUMS: Kind.SUMS,
        SUMS_ENVELOPE: Kind.SUMS_ENVELOPE,
        NOTES: Kind.NOTES,
        IMAGES: Kind.IMAGES,
        PUBLIC_KEY: Kind.PUBLIC_KEY,
    }
    if name in fixed:
        return Member(name, fixed[name], None)
    if name in DEPLOY_NAMES:
        return Member(name, Kind.DEPLOY, None)
    if name.endswith(".whl"):
        return Member(name, Kind.WHEEL, name)
    wheel, sep, rest = name.partition(".whl.")
    if not sep:
        return None
    wheel += ".whl"
    suffixes = {SBOM_SUFFIX: Kind.SBOM, STATEMENT_SUFFIX: Kind.STATEMENT, ENVELOPE_SUFFIX: Kind.ENVELOPE}
    for suffix, kind in suffixes.items():
        if "." + rest == suffix:
            return Member(name, kind, wheel)
    if ("." + rest).startswith(REPORT_INFIX) and rest.endswith(".json"):
        profile = ("." + rest)[len(REPORT_INFIX) : -len(".json")]
        if profile:
            return Member(name, Kind.REPORT, wheel, profile)
    return None


def format_sums(digests: Mapping[str, str]) -> bytes:
    """`sha256sum` text-mode lines, sorted by name: `sha256sum -c SHA256SUMS` checks them in the directory."""
    return "".join(f"{digests[n]}  {n}\n" for n in sorted(digests)).encode()


def parse_sums(raw: bytes, where: str = SUMS) -> dict[str, str]:
    """name -> sha256. Only the exact form `format_sums` writes is accepted, so any edit of the file shows."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise VerifyError(f"{where}: not UTF-8 text", "restore the release's own SHA256SUMS") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.split("\n")[:-1] if text.endswith("\n") else text.split("\n"), 1):
        m = _SUMS_LINE.match(line)
        if not m:
            raise VerifyError(f"{where}:{n}: not a '<sha256>  <file>' line", "restore the release's own SHA256SUMS")
        name = bare_name(m.group("name"), f"{where}:{n}: file name", VerifyError)
        if name in out:
            raise VerifyError(f"{where}:{n}: {name} is listed twice", "restore the release's own SHA256SUMS")
        out[name] = m.group("sha")
    if not out:
        raise VerifyError(f"{where}: lists no files", "restore the release's own SHA256SUMS")
    if format_sums(out) != raw:
        raise VerifyError(f"{where}: not in canonical form (order, spacing or line ends changed)", "restore it")
    return out


def wheels_of(names: Iterable[str]) -> list[str]:
    return sorted(n for n in names if n.endswith(".whl"))
