"""DSSE envelopes signed with an Ed25519 key the user supplies (PEM files; nothing online).

Signature = Ed25519 over PAE(payloadType, payload), the DSSE v1 pre-authentication encoding:
    "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body      (LEN: decimal byte count)
Ed25519 signatures are deterministic, so the same key and payload give the same envelope bytes.
keyid = sha256 (hex) of the public key's DER SubjectPublicKeyInfo, i.e.
    openssl pkey -pubin -in signing-key.pub -outform DER | sha256sum
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from vllm_dflash.errors import DflashError, SigningKeyError, VerifyError

INTOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
# Our own type for the checksum list: PAE binds the type, so this signature can never pass as a statement's.
SUMS_PAYLOAD_TYPE = "application/vnd.vllm-dflash.sha256sums"

_KEY_HINT = "pass an Ed25519 key in PEM form (openssl genpkey -algorithm ed25519 -out release-key.pem)"


def pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def key_id(public: Ed25519PublicKey) -> str:
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class SigningKey:
    private: Ed25519PrivateKey

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @property
    def keyid(self) -> str:
        return key_id(self.public)


KEY_LIMIT = 64 * 1024  # an Ed25519 PEM is ~120 bytes; anything near this is no key


def _read_key(path: Path, what: str, error: type[DflashError]) -> bytes:
    from vllm_dflash.paths import read_bounded

    try:
        return read_bounded(path, KEY_LIMIT, what, error, _KEY_HINT)
    except FileNotFoundError:
        raise error(f"cannot read {what} {path}: it does not exist", _KEY_HINT) from None


def load_private_key(
    path: Path, password: bytes | None = None, error: type[DflashError] = SigningKeyError
) -> SigningKey:
    from cryptography.exceptions import UnsupportedAlgorithm

    data = _read_key(path, "signing key", error)
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise error(f"signing key {path} is not a usable PEM private key: {exc}", _KEY_HINT) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise error(f"signing key {path} is a {type(key).__name__}, not Ed25519", _KEY_HINT)
    return SigningKey(key)


def parse_public_key(data: bytes, where: str, error: type[DflashError] = VerifyError) -> Ed25519PublicKey:
    from cryptography.exceptions import UnsupportedAlgorithm

    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise error(f"{where}: not a PEM public key ({str(exc).splitlines()[0]})", _KEY_HINT) from None
    if not isinstance(key, Ed25519PublicKey):
        raise error(f"{where}: a {type(key).__name__}, not an Ed25519 public key", _KEY_HINT)
    return key


def load_public_key(path: Path, error: type[DflashError] = VerifyError) -> Ed25519PublicKey:
    data = _read_key(path, "public key", error)
    return parse_public_key(data, str(path), error)


def write_keypair(private_path: Path, public_path: Path) -> str:
    """A fresh Ed25519 key pair as PEM files (private key unencrypted, mode 0600); returns its keyid."""
    from vllm_dflash.paths import write_bytes_atomic

    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_bytes_atomic(private_path, pem)
    private_path.chmod(0o600)
    write_bytes_atomic(public_path, public_pem(key.public_key()))
    return key_id(key.public_key())


def envelope(payload_type: str, payload: bytes, key: SigningKey) -> bytes:
    """A DSSE envelope (JSON, sorted keys, standard base64) with one signature."""
    sig = key.private.sign(pae(payload_type, payload))
    doc = {
        "payload": base64.b64encode(payload).decode(),
        "payloadType": payload_type,
        "signatures": [{"keyid": key.keyid, "sig": base64.b64encode(sig).decode()}],
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _b64(value: Any, where: str, what: str) -> bytes:
    if not isinstance(value, str):
        raise VerifyError(f"{where}: {what} is not a base64 string", "restore the release's own envelope")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        try:  # DSSE allows URL-safe base64 too
            return base64.urlsafe_b64decode(value)
        except (binascii.Error, ValueError):
            raise VerifyError(f"{where}: {what} is not base64", "restore the release's own envelope") from None


def open_envelope(raw: bytes, where: str, payload_type: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(payload, [(keyid, signature)]) of a DSSE envelope, after checking its shape and payload type."""
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VerifyError(f"{where}: not JSON ({exc})", "restore the release's own envelope") from None
    if not isinstance(doc, Mapping) or set(doc) != {"payload", "payloadType", "signatures"}:
        raise VerifyError(f"{where}: not a DSSE envelope (payload, payloadType, signatures)", "restore it")
    if doc["payloadType"] != payload_type:
        raise VerifyError(f"{where}: payloadType {doc['payloadType']!r}, expected {payload_type!r}", "restore it")
    payload = _b64(doc["payload"], where, "payload")
    sigs = doc["signatures"]
    if not isinstance(sigs, list) or not sigs:
        raise VerifyError(f"{where}: carries no signature", "sign the release again")
    out: list[tuple[str, bytes]] = []
    for i, s in enumerate(sigs):
        if not isinstance(s, Mapping) or not isinstance(s.get("keyid", ""), str):
            raise VerifyError(f"{where}: signatures[{i}] is malformed", "restore the release's own envelope")
        out.append((str(s.get("keyid", "")), _b64(s.get("sig"), where, f"signatures[{i}].sig")))
    return payload, out


def check_signature(
    payload_type: str, payload: bytes, sigs: list[tuple[str, bytes]], key: Ed25519PublicKey, where: str
) -> None:
    """At least one signature by `key` over PAE(payload_type, payload); VerifyError otherwise."""
    kid = key_id(key)
    mine = [sig for k, sig in sigs if k in ("", kid)]
    if not mine:
        raise VerifyError(
            f"{where}: no signature by key {kid[:16]}… (signed by {', '.join(k[:16] + '…' for k, _ in sigs)})",
            "verify with the public key the release was signed with",
        )
    message = pae(payload_type, payload)
    for sig in mine:
        try:
            key.verify(sig, message)
            return
        except InvalidSignature:
            continue
    raise VerifyError(f"{where}: signature does not verify with key {kid[:16]}…", "the file was altered or re-signed")
