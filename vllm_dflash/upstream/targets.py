"""What `upstream` and `rebase` compare against: a release (its hash-pinned PyPI sdist, unpacked into a cached tree)
or a git ref (fetched shallowly), and what the package index says about releases (newest, sdist and wheel pins).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import NetworkError, UpstreamError
from vllm_dflash.fetch import cache_dir, index_url, project_files
from vllm_dflash.manifest import MACHINES, MANIFEST_NAME, Artifact, Manifest, Release
from vllm_dflash.pipeline.source import release_tree

RELEASE_REF = re.compile(r"^v?(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)$")
_SDIST_NAME = re.compile(r"^vllm-(?P<v>\d+\.\d+\.\d+(?:\.post\d+)?)\.tar\.gz$")


@dataclass(frozen=True)
class Target:
    ref: str  # as the user gave it
    kind: str  # "release" | "git"
    version: str | None  # release version; None for a git ref
    commit: str
    tree: Path
    rev: str  # commit-ish inside `tree` to check against
    description: str
    release: Release | None = None

    def read(self, path: str) -> str | None:
        res = proc.call("git", "show", f"{self.rev}:{path}", cwd=self.tree, capture=True, check=False, quiet=True)
        return res.stdout if res.returncode == 0 else None


def _sha256_of(entry: Mapping[str, Any], name: str) -> str:
    hashes = entry.get("hashes")
    sha = hashes.get("sha256") if isinstance(hashes, Mapping) else None
    if not isinstance(sha, str):
        raise NetworkError(f"the index gives no sha256 for {name}", "use an index that serves PEP 691 hashes")
    return sha


def latest_release() -> str:
    """The newest final vLLM release that has an sdist on the index."""
    from packaging.version import Version

    versions = [Version(m.group("v")) for n in project_files("vllm") if (m := _SDIST_NAME.match(n))]
    finals = [v for v in versions if not v.is_prerelease and not v.is_devrelease]
    if not finals:
        raise UpstreamError("the index lists no vLLM release sdist", "check VLLM_DFLASH_INDEX_URL")
    return str(max(finals))


def resolve_release(manifest: Manifest, version: str) -> Release:
    """The release's sdist pin: from dist.toml [releases], else file name and sha256 from the index."""
    pinned = manifest.release(version)
    if pinned is not None:
        return pinned

    name = f"vllm-{version}.tar.gz"
    entry = project_files("vllm").get(name)
    if entry is None:
        raise UpstreamError(
            f"release {version} has no sdist {name} on {index_url()}/vllm/",
            "name an existing release (e.g. v0.22.0) or a git ref",
        )
    print(
        f"note: release {version} is not pinned in {MANIFEST_NAME}; taking {name}'s sha256 from the index", flush=True
    )
    return Release(version, f"v{version}", None, Artifact(name, _sha256_of(entry, name)), False)


def release_target(manifest: Manifest, version: str, ref: str | None = None) -> Target:
    rel = resolve_release(manifest, version)
    tree = release_tree(version, rel.sdist, rel.commit, cache_dir() / "trees" / f"vllm-{version}-sdist")
    how = "sha256 pinned in dist.toml" if rel.pinned else "sha256 from the index, not yet pinned"
    return Target(
        ref=ref or rel.tag,
        kind="release",
        version=version,
        commit=tree.commit,
        tree=tree.path,
        rev=tree.base,
        description=f"release {version} (sdist {rel.sdist.filename}, {how}, commit g{tree.commit})",
        release=rel,
    )


def git_target(manifest: Manifest, ref: str) -> Target:
    """Fetch one ref (shallow) from upstream git into a cache repo; NetworkError when unreachable."""
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", manifest.upstream.git_url.rstrip("/").split("://")[-1])
    repo = cache_dir() / "git-refs" / key
    if not (repo / ".git").exists():
        repo.mkdir(parents=True, exist_ok=True)
        proc.call("git", "init", "-q", repo, error=UpstreamError)
    env = {"GIT_TERMINAL_PROMPT": "0", "GIT_HTTP_LOW_SPEED_LIMIT": "1000", "GIT_HTTP_LOW_SPEED_TIME": "15"}
    local = "refs/dflash-upstream/" + re.sub(r"[^A-Za-z0-9._/-]+", "_", ref)
    proc.call(
        "git", "fetch", "--depth=1", "--no-tags", manifest.upstream.git_url, f"+{ref}:{local}",
        cwd=repo, env=env, capture=True, error=NetworkError,
        hint=f"cannot fetch '{ref}' from {manifest.upstream.git_url}; check the network, or use a release (v0.26.0)",
    )  # fmt: skip
    sha = proc.call("git", "rev-parse", f"{local}^{{commit}}", cwd=repo, capture=True, error=UpstreamError)
    commit = sha.stdout.strip()
    return Target(
        ref=ref,
        kind="git",
        version=None,
        commit=commit,
        tree=repo,
        rev=commit,
        description=f"git {ref} at {manifest.upstream.git_url} (commit {commit[:12]})",
    )


def resolve_target(manifest: Manifest, ref: str) -> Target:
    if ref == "latest":
        return release_target(manifest, latest_release(), ref)
    m = RELEASE_REF.match(ref)
    if m:
        return release_target(manifest, m.group("v"), ref)
    return git_target(manifest, ref)


def plain_wheels(files: Mapping[str, Mapping[str, Any]], version: str) -> dict[str, Artifact]:
    """machine -> the plain (no build tag: not a `-1` rebuild) abi3 Linux wheel of exactly `version`."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    found: dict[str, list[str]] = {}
    for name in files:
        if not name.endswith(".whl"):
            continue
        try:
            _, ver, build, tags = parse_wheel_filename(name)
        except InvalidWheelFilename:
            continue
        if build or str(ver) != version:
            continue
        for tag in tags:
            machine = next((m for m in MACHINES if tag.platform.endswith("_" + m)), None)
            if machine and tag.platform.startswith(("manylinux", "linux")) and name not in found.get(machine, []):
                found.setdefault(machine, []).append(name)
    out: dict[str, Artifact] = {}
    for machine, names in found.items():
        if len(names) > 1:
            names = [n for n in names if "-abi3-" in n] or names
        if len(names) > 1:
            raise UpstreamError(
                f"several plain {machine} wheels for {version}: {', '.join(sorted(names))}",
                "pin the wheel by hand in dist.toml",
            )
        out[machine] = Artifact(names[0], _sha256_of(files[names[0]], names[0]))
    return out
