"""Container image names as the OCI distribution reference grammar writes them, checked before a container tool
(docker, podman, buildah) or a release document sees them: `name[:tag][@sha256:hex]`, where a name is an optional
registry host[:port] and lowercase path components (`[a-z0-9]+` joined by `.`, `_`, `__` or dashes). Anything
else -- a space, an upper-case path, a value starting with `-` that a tool would read as an option -- is one line."""

from __future__ import annotations

import re

from vllm_dflash.errors import DflashError

MAX_NAME = 255  # the distribution spec's limit on a repository name
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = (
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
)
_DOMAIN = rf"{_HOST}(?::[0-9]{{1,5}})?"
_TAG = re.compile(r"[\w][\w.-]{0,127}", re.ASCII)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_IMAGE_ID = re.compile(r"(?:sha256:)?[0-9a-f]{12,64}")
_EXAMPLE = "registry.example.com/ml/vllm-dflash"


def repository_problem(name: str) -> str | None:
    """None when `name` is a repository name (no tag, no digest); else what is wrong with it."""
    if not name:
        return "is empty"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long (at most {MAX_NAME})"
    parts = name.split("/")
    # The grammar reads the first part as a registry host when it has a dot or a port, or is localhost.
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        if not re.fullmatch(_DOMAIN, parts[0]):
            return f"names registry {parts[0][:80]!r}, which is no host[:port]"
        parts = parts[1:]
    bad = next((p for p in parts if not re.fullmatch(_COMPONENT, p)), None)
    if bad is not None:
        return f"has the part {bad[:80]!r}: a repository's parts are lowercase letters and digits joined by . _ __ or -"
    return None


def check_repository(name: str, flag: str, error: type[DflashError]) -> str:
    problem = repository_problem(name)
    if problem is not None:
        raise error(f"{flag} {name[:120]!r} {problem}", f"write e.g. {_EXAMPLE}")
    return name


def reference_problem(ref: str) -> str | None:
    """None when `ref` is `name[:tag][@sha256:hex]` or an image ID; else what is wrong with it."""
    if _IMAGE_ID.fullmatch(ref):
        return None
    rest, at, digest = ref.partition("@")
    if at and not _DIGEST.fullmatch(digest):
        return f"has digest {digest[:80]!r}, not sha256:<64 hex>"
    name, tag = rest, ""
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:  # a colon after the last slash separates the tag (before it: a registry port)
        name, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.fullmatch(tag):
            return f"has tag {tag[:80]!r}, not [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
    problem = repository_problem(name)
    return None if problem is None else f"(repository {name[:80]!r}) {problem}"


def check_image_ref(ref: str, flag: str, error: type[DflashError]) -> str:
    problem = reference_problem(ref)
    if problem is not None:
        raise error(f"{flag} {ref[:120]!r} {problem}", f"write e.g. {_EXAMPLE}:0.20.1-dflash.1 or an image ID")
    return ref
