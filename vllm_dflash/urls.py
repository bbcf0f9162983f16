"""URLs a user gives us (a server to validate, an index to upload to): parsed once, checked before anything runs,
and never echoed with a password in them."""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from vllm_dflash.errors import DflashError

MAX_URL = 2048  # far above any server or index URL; longer is a paste gone wrong
_OPENAI_SUFFIX = "/v1"  # what users paste from an OpenAI client's base_url


_USERINFO = re.compile(r"([^/?#@:]*):([^/?#@]*)@")


def redact(url: str) -> str:
    """`url` with anything that may be a password replaced by `***` (`https://user:***@host/`, also without a
    scheme or with a malformed rest: every `name:secret@`): what messages and logs may show."""
    return _USERINFO.sub(r"\1:***@", url)


def split(url: str, flag: str, error: type[DflashError], example: str) -> SplitResult:
    """`url` parsed, or one `error` line (never ValueError, never the password): printable ASCII without spaces,
    at most MAX_URL characters, a valid port and IPv6 literal, a host name the resolver can encode."""
    shown = redact(url)[:200]
    hint = f"write e.g. {example}"
    if len(url) > MAX_URL:
        raise error(f"{flag} is {len(url)} characters long: not a URL", hint)
    if not url.isascii() or any(not c.isprintable() or c.isspace() for c in url):
        raise error(f"{flag} {shown!r} holds spaces, control or non-ASCII characters", hint)
    try:
        parsed = urlsplit(url)
        parsed.port  # noqa: B018 -- raises on a malformed or out-of-range port
    except ValueError as exc:
        raise error(f"{flag} {shown} is not a URL ({exc})", hint) from None
    host = parsed.hostname or ""
    if any(len(label) > 63 for label in host.split(".")) or len(host) > 253:
        raise error(f"{flag} {shown}: host name {host[:80]!r} is longer than DNS allows", hint)
    return parsed


def endpoint(url: str, flag: str, error: type[DflashError]) -> tuple[str, str | None]:
    """The base URL of an OpenAI-compatible vLLM server, and a note when it was normalised.

    http(s) with a host; no user:password (it would be echoed in every line, and vLLM takes its key as a bearer
    token: VLLM_API_KEY); no query or fragment (the tool appends /health, /metrics, /v1/...: they would be dropped
    or misplaced). A trailing `/v1` (an OpenAI client's base URL) is removed with a note; any other path stays (a
    server behind a path prefix)."""
    example = "http://127.0.0.1:8000"
    parsed = split(url, flag, error, example)
    shown = redact(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise error(f"{flag} {shown} is not an http(s):// URL with a host", f"write e.g. {example}")
    if parsed.username is not None or parsed.password is not None:
        raise error(
            f"{flag} {shown} carries credentials in the URL",
            "drop them from the URL; a vLLM API key goes in VLLM_API_KEY",
        )
    if parsed.query or parsed.fragment or url.endswith(("?", "#")):
        raise error(
            f"{flag} {shown} has a query or fragment, which the tool's requests (/health, /metrics, /v1/...) "
            "cannot carry",
            f"name the server's base URL, e.g. {example}",
        )
    path = parsed.path.rstrip("/")
    note = None
    if path.endswith(_OPENAI_SUFFIX):
        path = path[: -len(_OPENAI_SUFFIX)]
        note = f"{flag}: using the server's base URL (without {_OPENAI_SUFFIX}); the tool appends /v1 itself"
    return f"{parsed.scheme}://{parsed.netloc}{path}", note


def upload(url: str, flag: str, error: type[DflashError]) -> str:
    """An upload URL as it may be shown and handed to twine: no password in it (credentials come from
    TWINE_USERNAME / TWINE_PASSWORD), or one line that does not repeat the password."""
    parsed = split(url, flag, error, "https://upload.example.com/legacy/")
    if parsed.password is not None:
        raise error(
            f"{flag} {redact(url)} carries a password, which would be echoed with every command and kept in logs",
            "drop it from the URL and set TWINE_USERNAME / TWINE_PASSWORD instead",
        )
    return url
