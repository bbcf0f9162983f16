"""Hash-pinned downloads into a cache outside the repo. Nothing unverified is ever left under its final name."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from vllm_dflash.errors import DflashError, HashMismatchError, NetworkError, StorageError
from vllm_dflash.manifest import Artifact
from vllm_dflash.paths import confine, ensure_dir, open_regular, storage_error, sweep_stale, temp_sibling

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20


# The Cache Directory Tagging Specification (https://bford.info/cachedir/): backup tools skip a tagged directory, and
# `vllm-dflash cache prune` prunes only a directory this tool tagged (a VLLM_DFLASH_CACHE pointed at $HOME by mistake
# is refused, never pruned).
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_TAG_TEXT = f"{CACHEDIR_SIGNATURE}\n# This file is a cache directory tag created by vllm-dflash (VLLM_DFLASH_CACHE).\n"


def cache_root() -> Path:
    """$VLLM_DFLASH_CACHE or ~/.cache/vllm-dflash, neither created nor tagged (what `vllm-dflash cache` inspects)."""
    env = os.environ.get("VLLM_DFLASH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vllm-dflash"


def cache_dir() -> Path:
    """Where downloads and work trees are cached: $VLLM_DFLASH_CACHE or ~/.cache/vllm-dflash, created and tagged."""
    path = ensure_dir(cache_root(), "cache directory ($VLLM_DFLASH_CACHE)")
    tag = path / CACHEDIR_TAG
    if not tag.exists():
        try:
            os.close(os.open(tmp := temp_sibling(tag), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            tmp.write_text(_TAG_TEXT)
            os.replace(tmp, tag)
        except OSError as exc:
            raise storage_error(exc, tag, "tag the cache directory") from None
    return path


def index_url() -> str:
    """The PEP 691 (JSON simple API) index to resolve file names on; $VLLM_DFLASH_INDEX_URL overrides."""
    return os.environ.get("VLLM_DFLASH_INDEX_URL", DEFAULT_INDEX).rstrip("/")


def sha256_file(path: Path, error: type[DflashError] = StorageError) -> str:
    """sha256 of a regular file (a device or FIFO, also behind a link, is refused with `error`: it would never end)."""
    digest = hashlib.sha256()
    with os.fdopen(open_regular(path, "file", error), "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _open(url: str, accept: str | None = None):  # type: ignore[no-untyped-def]
    try:
        req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        return urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as exc:
        raise NetworkError(f"{url}: HTTP {exc.code} {exc.reason}", "check the name and the index URL") from None
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NetworkError(f"cannot reach {url}: {reason}", "check the network or set VLLM_DFLASH_INDEX_URL") from None
    except ValueError as exc:  # not a URL urllib can open (a bad VLLM_DFLASH_INDEX_URL): unknown type, bad IPv6
        from vllm_dflash.urls import redact

        raise NetworkError(f"{redact(url)[:200]} is not a URL ({exc})", "fix VLLM_DFLASH_INDEX_URL") from None


def project_files(project: str) -> dict[str, dict[str, object]]:
    """filename -> file entry (url, hashes, size) of `project` on the index."""
    with _open(f"{index_url()}/{project}/", "application/vnd.pypi.simple.v1+json") as resp:
        try:
            data = json.load(resp)
        except (ValueError, RecursionError):
            data = None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files
    ):
        raise NetworkError(
            f"{index_url()}/{project}/ did not answer with PEP 691 JSON", "point VLLM_DFLASH_INDEX_URL at one"
        )
    return {f["filename"]: f for f in files}


def resolve(artifact: Artifact) -> tuple[str, int | None]:
    """URL and expected size of `artifact` on the index."""
    entry = project_files(artifact.project).get(artifact.filename)
    if entry is None:
        raise NetworkError(
            f"{artifact.filename} is not on {index_url()}/{artifact.project}/", "check the file name in dist.toml"
        )
    url = urllib.parse.urldefrag(str(entry["url"])).url
    if url.startswith("/"):
        url = index_url().split("/simple")[0] + url
    size = entry.get("size")
    return url, size if isinstance(size, int) else None


def _download(url: str, dest: Path, expected_size: int | None, label: str) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with _open(url) as resp:
        total = expected_size or int(resp.headers.get("Content-Length") or 0) or None
        print(f"+ download {url}", flush=True)
        with (
            dest.open("wb") as out,
            Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                transient=True,
            ) as progress,
        ):
            task = progress.add_task(label, total=total)
            while True:
                try:
                    chunk = resp.read(_CHUNK)
                except OSError as exc:
                    raise NetworkError(f"download of {label} broke off: {exc}", "run the command again") from None
                if not chunk:
                    break
                out.write(chunk)
                progress.advance(task, len(chunk))
            # urllib returns a short body without error when the server hangs up early; say so, not "hash mismatch".
            announced = int(resp.headers.get("Content-Length") or 0)
            if announced and out.tell() != announced:
                raise HashMismatchError(
                    f"{label}: truncated download ({out.tell()} of {announced} bytes)", "run the command again"
                )


def verify(path: Path, artifact: Artifact, expected_size: int | None = None) -> None:
    """Raise HashMismatchError unless `path` has the artifact's sha256 (and size, when known)."""
    size = path.stat().st_size
    if expected_size is not None and size != expected_size:
        raise HashMismatchError(
            f"{artifact.filename}: truncated or oversized download ({size} of {expected_size} bytes)",
            "run the command again to download it afresh",
        )
    got = sha256_file(path)
    if got != artifact.sha256:
        raise HashMismatchError(
            f"{artifact.filename}: sha256 {got} does not match the pinned {artifact.sha256}",
            "the file on the index changed or the pin in dist.toml is wrong; do not edit the hash to make it pass",
        )


def fetch(artifact: Artifact, dest_dir: Path | None = None) -> Path:
    """Return a verified local copy of `artifact`, downloading it into the cache when needed.

    A cached copy whose hash no longer matches is removed and downloaded again; a fresh download that does not
    match raises HashMismatchError and is deleted, so no unverified file keeps the artifact's name.
    """
    dest_dir = ensure_dir(dest_dir or cache_dir() / "downloads")
    sweep_stale(dest_dir)  # half-downloaded files of killed runs
    # The file name comes from dist.toml or an index answer: it must stay inside the downloads directory, or a
    # cached "copy" failing its hash would make us delete a file elsewhere.
    final = confine(dest_dir, artifact.filename, "artifact file name")
    if final.is_file():
        try:
            verify(final, artifact)
            return final
        except HashMismatchError:
            print(f"cached {final} fails its hash; downloading it again", flush=True)
            final.unlink()
    url, size = resolve(artifact)
    part = temp_sibling(final, ".part")
    try:
        _download(url, part, size, artifact.filename)
        verify(part, artifact, size)
        os.replace(part, final)
    except OSError as exc:  # the cache's disk, not the network (network faults are NetworkError already)
        raise storage_error(exc, dest_dir, "download into") from None
    finally:
        part.unlink(missing_ok=True)
    return final
