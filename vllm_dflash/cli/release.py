"""`release` (checksums, SBOM, provenance, signatures and notes next to the wheels) and `verify`."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

from vllm_dflash import report as reports
from vllm_dflash import urls
from vllm_dflash.cli.common import add_pin_argument, manifest
from vllm_dflash.errors import ManifestError
from vllm_dflash.oci import check_repository
from vllm_dflash.release import ImageRef, ReleaseOptions, VerifyOptions, make_release, verify
from vllm_dflash.release.statement import DEFAULT_BUILDER_ID

SIGN_KEY_PASSWORD_ENV = "VLLM_DFLASH_SIGN_KEY_PASSWORD"


def register(sub: Any) -> None:
    r: argparse.ArgumentParser = sub.add_parser(
        "release",
        help="write a release directory: wheels, SHA256SUMS, SBOMs, in-toto provenance, signatures, notes",
        description="Make a release of built wheels (every fact read from the wheels themselves). The same inputs "
        "give byte-identical files. Exit 16 for a wheel without provenance, 17 for inconsistent inputs.",
    )
    r.add_argument("wheels", nargs="*", type=Path, help="the wheels (default: this version's wheels in dist/)")
    r.add_argument("--out", type=Path, default=None, help="release directory (default: dist/release)")
    r.add_argument("--report", action="append", type=Path, default=[], help="a validation report to attach")
    r.add_argument("--sign-key", type=Path, default=None, help="PEM Ed25519 private key: sign (DSSE) the release")
    r.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="REPO@sha256:HEX[=PLATFORM]",
        help="an image to name: one per platform (=x86_64, =aarch64; `vllm-dflash image` prints the arguments), "
        "and without =PLATFORM the image index",
    )
    r.add_argument("--builder-id", default=DEFAULT_BUILDER_ID, help="SLSA builder id (a CI system sets its own)")
    r.add_argument("--index-url", default=None, help="the index the notes' install command names")
    r.add_argument(
        "--sbom-timestamp",
        default=None,
        metavar="ISO8601",
        help="the SBOMs' metadata.timestamp (default: $SOURCE_DATE_EPOCH when set, else none: reproducible)",
    )
    r.add_argument("--copy", action="store_true", help="copy the wheels instead of hard-linking them")
    add_pin_argument(r)
    r.set_defaults(func=run_release)

    v: argparse.ArgumentParser = sub.add_parser(
        "verify",
        help="check a release (or one artifact in it): sums, SBOM, provenance, signature, report binding",
        description="Exit 0 when everything verifies; 17 with one line naming the file when anything does not.",
    )
    v.add_argument("path", type=Path, help="a release directory, or a file in one")
    v.add_argument(
        "--key", action="append", type=Path, default=[], help="PEM Ed25519 public key it must be signed with"
    )
    v.add_argument("--require-signature", action="store_true", help="refuse an unsigned release")
    v.set_defaults(func=run_verify)


def _image(spec: str) -> ImageRef:
    ref, _, plat = spec.partition("=")
    repo, sep, digest = ref.partition("@")
    if not sep:
        raise ManifestError(f"--image {spec[:120]} is not REPO@sha256:HEX[=PLATFORM]", "name the image by its digest")
    check_repository(repo, "--image", ManifestError)  # the repository a container tool pushes and pulls
    try:
        return ImageRef(repo, digest, plat or None)
    except ValueError as exc:
        raise ManifestError(f"--image {spec}: {exc}", "write REPO@sha256:<64 hex>[=x86_64|aarch64]") from None


def _timestamp(given: str | None) -> dt.datetime | None:
    if given is not None:
        try:
            stamp = dt.datetime.fromisoformat(given)
        except ValueError:
            raise ManifestError(
                f"--sbom-timestamp {given!r} is not ISO 8601", "write e.g. 2026-11-30T12:00:00Z"
            ) from None
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        return None
    if not (epoch.isascii() and epoch.isdigit()) or len(epoch) > 12:  # 12 digits: beyond year 30000
        raise ManifestError(f"SOURCE_DATE_EPOCH={epoch[:40]!r} is not a number of seconds", "unset it or fix it")
    try:
        return dt.datetime.fromtimestamp(int(epoch), dt.UTC)
    except (OverflowError, OSError, ValueError):
        raise ManifestError(f"SOURCE_DATE_EPOCH={epoch} is beyond any date", "unset it or fix it") from None


# SLSA's builder.id is a URI: a scheme, then printable ASCII without spaces (urn:..., https://ci.example.com/...).
_BUILDER_ID = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[!-~]{1,2000}")


def _builder_id(value: str) -> str:
    if not _BUILDER_ID.fullmatch(value):
        raise ManifestError(
            f"--builder-id {value[:120]!r} is not a URI (a scheme, then no spaces or control characters)",
            f"write e.g. {DEFAULT_BUILDER_ID} or https://ci.example.com/runners/1",
        )
    return value


def _index_url(value: str | None) -> str | None:
    if value is None:
        return None
    parsed = urls.split(value, "--index-url", ManifestError, "https://pypi.example.com/simple/")
    if parsed.scheme not in ("http", "https", "file") or parsed.password is not None:
        raise ManifestError(
            f"--index-url {urls.redact(value)[:120]} is not an http(s):// or file:// URL without a password",
            "name the index users install from",
        )
    return value


def run_release(args: argparse.Namespace) -> int:
    m = manifest(args)
    wheels = [w.resolve() for w in args.wheels] or sorted(m.dist_dir.glob(f"vllm-{m.version}-*.whl"))
    if not wheels:
        raise ManifestError(f"no wheels of vllm {m.version} in {m.dist_dir}", "run `vllm-dflash build` first")
    for w in wheels:
        if not w.is_file():
            raise ManifestError(f"{w}: no such wheel", "pass wheels built by `vllm-dflash build`")
    password = os.environ.get(SIGN_KEY_PASSWORD_ENV)
    options = ReleaseOptions(
        sign_key=args.sign_key,
        sign_key_password=password.encode() if password else None,
        reports=tuple(args.report),
        report_key=reports.key_from_env(),
        images=tuple(_image(s) for s in args.image),
        builder_id=_builder_id(args.builder_id),
        timestamp=_timestamp(args.sbom_timestamp),
        index_url=_index_url(args.index_url),
        link=not args.copy,
    )
    rel = make_release(m, wheels, (args.out or m.dist_dir / "release").resolve(), options)
    print(f"release {rel.directory}: {len(rel.files)} files for {', '.join(w.platform for w in rel.wheels)}")
    print(rel.directory)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    result = verify(
        args.path.resolve(),
        VerifyOptions(
            public_keys=tuple(args.key),
            require_signature=args.require_signature,
            report_key=reports.key_from_env(),
            profiles=manifest(args).profiles,  # attached reports are judged under the manifest's profiles
        ),
    )
    print(result.summary())
    return 0
