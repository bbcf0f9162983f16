"""images.json: the container images a release names, by digest, each per-platform image bound to the wheel of its
platform that it was built from (by file name and sha256). SHA256SUMS covers it, so a signature covers it too.

    {"schema": "vllm-dflash/release-images/v1",
     "images": [{"repository": ..., "digest": "sha256:...", "platform": "aarch64",
                 "wheel": "<wheel file name>", "wheel_sha256": "<64 hex>"},
                {"repository": ..., "digest": "sha256:...", "platform": null}]}   # an image index over all

Sorted by platform (the index, platform null, first), then repository; one image per platform at most, and one
index at most. The notes name every image as `<repository>@<digest>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_dflash.errors import VerifyError
from vllm_dflash.manifest import MACHINES
from vllm_dflash.release.facts import WheelFacts, machine_of
from vllm_dflash.release.notes import ImageRef

SCHEMA = "vllm-dflash/release-images/v1"


def _key(image: ImageRef) -> tuple[str, str]:
    return (image.platform or "", image.repository)


def _check_set(images: Sequence[ImageRef], platforms: Mapping[str, str], where: str, hint: str) -> None:
    """Each image's platform is one of ours with a wheel here; no platform (nor the index) named twice."""
    seen: dict[str, ImageRef] = {}
    for image in images:
        plat = image.platform or ""
        if plat and plat not in MACHINES:
            raise VerifyError(f"{where}: image {image.repository}@{image.digest} is for unknown platform {plat}", hint)
        if plat and plat not in platforms:
            raise VerifyError(
                f"{where}: image {image.repository}@{image.digest} is for {plat}, and the release has no {plat} wheel",
                hint,
            )
        if plat in seen:
            what = f"the {plat} platform" if plat else "all platforms (an image index)"
            raise VerifyError(f"{where}: two images for {what}: {seen[plat].digest} and {image.digest}", hint)
        seen[plat] = image


def build_images(facts: Sequence[WheelFacts], images: Sequence[ImageRef]) -> bytes:
    """The images.json of a release of `facts` naming `images`; refuses images that do not fit the wheels."""
    by_platform = {f.platform: f for f in facts}
    _check_set(
        images,
        {p: f.filename for p, f in by_platform.items()},
        "--image",
        "name one image per platform, "
        "each for a platform whose wheel is in the release (REPO@sha256:HEX=PLATFORM; no =PLATFORM: the index)",
    )
    entries: list[dict[str, Any]] = []
    for image in sorted(images, key=_key):
        entry: dict[str, Any] = {"repository": image.repository, "digest": image.digest, "platform": image.platform}
        if image.platform:
            wheel = by_platform[image.platform]
            entry |= {"wheel": wheel.filename, "wheel_sha256": wheel.sha256}
        entries.append(entry)
    return (json.dumps({"schema": SCHEMA, "images": entries}, indent=2, sort_keys=True) + "\n").encode()


def wheel_machine(filename: str) -> str:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        _, _, _, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename as exc:
        raise VerifyError(f"{filename}: not a wheel file name ({exc})", "restore the release's own files") from None
    return machine_of(tuple(sorted({t.platform for t in tags})), filename)


def check_images(raw: bytes, wheels: Mapping[str, str], notes: str, where: str, hint: str) -> list[ImageRef]:
    """The images an images.json names, checked against the release: `wheels` (file name -> sha256, from
    SHA256SUMS) holds the wheel each per-platform image names, with that sha256 and of that platform, and the
    notes name every image by `<repository>@<digest>`."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("images"), list):
            raise ValueError(f"not a {SCHEMA} document")
        images: list[ImageRef] = []
        bound: dict[str, tuple[str, str]] = {}
        for entry in doc["images"]:
            if not isinstance(entry, dict):
                raise ValueError("an image entry is not an object")
            allowed = {"repository", "digest", "platform"} | (
                {"wheel", "wheel_sha256"} if entry.get("platform") else set()
            )
            if set(entry) != allowed:
                raise ValueError(f"image entry keys {sorted(entry)}, not {sorted(allowed)}")
            image = ImageRef(str(entry["repository"]), str(entry["digest"]), entry["platform"] or None)
            images.append(image)
            if image.platform:
                bound[image.platform] = (str(entry["wheel"]), str(entry["wheel_sha256"]))
    except (UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise VerifyError(f"{where}: {exc}", hint) from None
    if [_key(i) for i in images] != sorted(_key(i) for i in images):
        raise VerifyError(f"{where}: images are not in canonical order", hint)
    platforms = {wheel_machine(name): name for name in wheels}
    _check_set(images, platforms, where, hint)
    for image in images:
        if image.platform:
            wheel, sha = bound[image.platform]
            if wheels.get(wheel) != sha or wheel != platforms[image.platform]:
                raise VerifyError(
                    f"{where}: the {image.platform} image {image.digest} names wheel {wheel} ({sha[:12]}…), "
                    f"not this release's {image.platform} wheel {platforms[image.platform]}",
                    hint,
                )
        if f"{image.repository}@{image.digest}" not in notes:
            raise VerifyError(f"{where}: the release notes do not name {image.repository}@{image.digest}", hint)
    return images
