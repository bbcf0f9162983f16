"""The end of the V1 line: a release whose own source no longer has Model Runner V1 gets ONE verdict, never per-hunk
conflicts about files that are gone.

    removal(read) -> evidence (empty while V1 is there)
    line_end(manifest, version, read, drafter=None) -> LineEnd  ("V1 removed in X; your drafter is served by V2 from Y")

Both halves are computed from release code: the removal from the target tree itself (the V1 runner and the V1
spec-decode proposers are absent, or its platform code raises for V1), and Y from the sources of every release this
checkout pins (dist.toml [releases] and the pins, each sdist hash-verified), read by the probes below: the first
release whose V2 model runner serves the drafter's kind. The kind of a given drafter config is the doctor's upstream
column for it (vLLM 0.34.0's own code building the drafter, doctor/sides.py), the one `vllm-dflash doctor` prints.
"""

from __future__ import annotations

import ast
import tarfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

from vllm_dflash.doctor.columns import FULL as FULL_LAYER
from vllm_dflash.doctor.columns import SLIDING as SLIDING_LAYER
from vllm_dflash.errors import PinMismatchError
from vllm_dflash.manifest import Manifest, Release

Reader = Callable[[str], "str | None"]

# What Model Runner V1 is made of (paths in the sdist), and the words a release without it raises with.
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
V1_PROPOSERS = ("vllm/v1/spec_decode/dflash.py", "vllm/v1/spec_decode/eagle.py")
PLATFORM = "vllm/platforms/interface.py"
V1_REMOVED_WORDS = "Model Runner V1 has been removed"
# What the V2 model runner is made of, and the files that say what it does for a DFlash drafter.
V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
V2_DFLASH = "vllm/v1/worker/gpu/spec_decode/dflash/utils.py"
V2_DFLASH_LM_HEAD = "get_target_lm_head"  # the target's lm_head found for multimodal targets too (0.24/0.25 lack it)
DRAFTER_MODEL = "vllm/model_executor/models/qwen3_dflash.py"
DRAFTER_WINDOW = "per_layer_sliding_window="  # each drafter layer built with its own window
MIXED_REFUSED = "does not yet support mixed sliding/full attention"  # 0.25: refused on every runner
CONFIG = "vllm/config/vllm.py"
V2_ALLOW_LIST = "_is_default_v2_model_runner_model"  # V2 the default only for listed models
PROBED = (V1_RUNNER, *V1_PROPOSERS, PLATFORM, V2_RUNNER, V2_DFLASH, DRAFTER_MODEL, CONFIG)

FULL = "full-attention"
SLIDING = "all-sliding"
MIXED = "mixed sliding+full"
KINDS = (FULL, SLIDING, MIXED)
FLAG = "VLLM_USE_V2_MODEL_RUNNER=1"


def removal(read: Reader) -> tuple[str, ...]:
    """Why this tree has no Model Runner V1 (each fact as read), or () when it has one (or is no runner tree at all).

    Gone means: the V1 runner module is absent while the V2 runner is there, and either every V1 spec-decode
    proposer is absent too or the platform code raises for V1."""
    if read(V1_RUNNER) is not None or read(V2_RUNNER) is None:
        return ()
    gone = [p for p in V1_PROPOSERS if read(p) is None]
    says = V1_REMOVED_WORDS in (read(PLATFORM) or "")
    if not says and len(gone) < len(V1_PROPOSERS):
        return ()
    facts = [f"{V1_RUNNER} absent", *(f"{p} absent" for p in gone)]
    if says:
        facts.append(f"{PLATFORM} raises '{V1_REMOVED_WORDS}'")
    return tuple(facts)


def _strings(source: str | None) -> list[str]:
    """Every string constant of a Python source (implicit concatenations joined, as Python joins them)."""
    if not source:
        return []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _v2_default(config: str | None) -> bool:
    """VllmConfig.use_v2_model_runner ends in V2 for any model (no per-model allow-list decides it)."""
    if not config:
        return False
    try:
        tree = ast.parse(config)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "use_v2_model_runner":
            names = {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)}
            last = node.body[-1]
            returns_v2 = isinstance(last, ast.Return) and isinstance(last.value, ast.Constant) and last.value.value
            return bool(returns_v2) and V2_ALLOW_LIST not in names
    return False


@dataclass(frozen=True)
class Serving:
    """What one release's code does for a DFlash drafter, each fact probed in its source."""

    version: str
    v1: bool  # Model Runner V1 is there
    v2_dflash: bool  # the V2 runner drafts DFlash with the target's lm_head found
    windows: bool  # drafter layers get their own sliding window
    mixed: bool  # sliding and full layers in one drafter are not refused on every runner
    v2_default: bool  # V2 is the runner without any flag

    def serves(self, kind: str) -> bool:
        """The V2 runner of this release serves a drafter of `kind`."""
        if not self.v2_dflash:
            return False
        if kind == FULL:
            return True
        if kind == SLIDING:
            return self.windows
        return self.windows and self.mixed


def serving(version: str, read: Reader) -> Serving:
    model = read(DRAFTER_MODEL)
    v1 = not removal(read)
    return Serving(
        version=version,
        v1=v1,
        v2_dflash=read(V2_RUNNER) is not None and V2_DFLASH_LM_HEAD in (read(V2_DFLASH) or ""),
        windows=DRAFTER_WINDOW in (model or ""),
        mixed=not any(MIXED_REFUSED in s for s in _strings(model)),
        v2_default=(not v1) or _v2_default(read(CONFIG)),
    )


def drafter_kind(kinds_per_layer: Iterable[str] | None) -> str | None:
    """The kind of a drafter from the kinds of the layers the doctor's upstream column built (None: not built)."""
    if kinds_per_layer is None:
        return None
    kinds = set(kinds_per_layer)
    if kinds == {FULL_LAYER}:
        return FULL
    return SLIDING if kinds == {SLIDING_LAYER} else MIXED


@dataclass(frozen=True)
class Way:
    """How a drafter kind leaves the patches: the first release whose V2 runner serves it, and with which flag."""

    kind: str
    since: str | None  # None: no release this checkout pins serves it
    default_from: str | None  # from this release on without a flag

    def text(self) -> str:
        if self.since is None:
            return f"{self.kind} drafter: no release pinned in dist.toml serves it on V2"
        if self.default_from is not None and Version(self.default_from) <= Version(self.since):
            return f"{self.kind} drafter: V2 from {self.since} (V2 the default there, no flag)"
        tail = f"; from {self.default_from} V2 is the default (no flag)" if self.default_from else ""
        return f"{self.kind} drafter: V2 from {self.since} with {FLAG}{tail}"


@dataclass(frozen=True)
class LineEnd:
    version: str  # the release without V1
    evidence: tuple[str, ...]  # why: facts read from its tree
    ways: tuple[Way, ...]
    scanned: tuple[str, ...]  # the releases whose sources decided
    drafter: str | None = None  # the user's drafter kind, when a config was given

    @property
    def since(self) -> str | None:
        """Y: from this release the V2 runner serves the user's drafter (every kind, when none was given)."""
        ways = [w for w in self.ways if self.drafter is None or w.kind == self.drafter]
        if any(w.since is None for w in ways) or not ways:
            return None
        return str(max(Version(w.since) for w in ways if w.since is not None))

    def verdict(self) -> str:
        what = f"your drafter ({self.drafter})" if self.drafter else "your drafter"
        y = self.since
        served = f"is served by V2 from {y}" if y else "is served by no V2 release pinned in dist.toml"
        return f"V1 removed in {self.version}; {what} {served}"

    def stay(self) -> str:
        """Where a user may stay: a pin older than the release without V1 (a git ref names no release)."""
        return f"before {self.version}" if self.version[:1].isdigit() else "of a release that still has V1"

    def lines(self) -> list[str]:
        out = [self.verdict(), f"  V1 gone: {'; '.join(self.evidence)}"]
        out += [f"  {w.text()}" for w in self.ways if self.drafter is None or w.kind == self.drafter]
        out.append(f"  from the sources of {', '.join(self.scanned)} (dist.toml [releases] and pins)")
        out.append(
            f"  our patches are for Model Runner V1: stay on a pin {self.stay()}, or leave them (docs/upstream.md, "
            "'Leaving the patches')"
        )
        return out

    def as_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict(),
            "version": self.version,
            "since": self.since,
            "drafter": self.drafter,
            "evidence": list(self.evidence),
            "ways": [{"kind": w.kind, "since": w.since, "default_from": w.default_from} for w in self.ways],
            "scanned": list(self.scanned),
        }


def ways(servings: Iterable[Serving]) -> tuple[Way, ...]:
    """Per kind: the first release (by version) whose V2 runner serves it, and the first where V2 is the default."""
    ordered = sorted(servings, key=lambda s: Version(s.version))
    default = next((s.version for s in ordered if s.v2_default), None)
    return tuple(Way(k, next((s.version for s in ordered if s.serves(k)), None), default) for k in KINDS)


def sdist_reader(path: Any, release: Release) -> Reader:
    """The probed files of a verified sdist, read in one pass (and its recorded commit checked against the pin)."""
    from vllm_dflash.pipeline.model import commits_match
    from vllm_dflash.pipeline.source import sdist_commit

    recorded = sdist_commit(path)
    if release.commit is not None and not commits_match(recorded, release.commit):
        raise PinMismatchError(
            f"{release.sdist.filename} records commit {recorded}, but dist.toml says {release.commit}",
            "fix the [releases] entry in dist.toml",
        )
    found: dict[str, str] = {}
    wanted = set(PROBED)
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                rel = member.name.split("/", 1)[1] if "/" in member.name else ""
                if rel in wanted and member.isfile():
                    fh = tar.extractfile(member)
                    if fh is not None:
                        found[rel] = fh.read().decode("utf-8", "replace")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PinMismatchError(f"{path} is not a readable sdist: {exc}", "delete it and download it again") from None
    return found.get


def known_releases(manifest: Manifest) -> dict[str, Release]:
    """Every release this checkout pins: dist.toml [releases], the pins and [upstream]."""
    out = dict(manifest.releases)
    for version in (manifest.upstream.version, *manifest.pins):
        rel = manifest.release(version)
        if rel is not None:
            out.setdefault(version, rel)
    return out


def line_end(
    manifest: Manifest,
    version: str | None,
    read: Reader,
    drafter: str | None = None,
    readers: Mapping[str, Reader] | None = None,
) -> LineEnd | None:
    """The verdict for a target tree without V1 (None while V1 is there). `readers` (tests) replaces the pinned
    sdists; otherwise every pinned release older than the target is fetched (hash-verified) and read."""
    evidence = removal(read)
    if not evidence:
        return None
    name = version or "this ref"
    if readers is None:
        from vllm_dflash.fetch import fetch

        older = {v: r for v, r in known_releases(manifest).items() if version is None or Version(v) < Version(version)}
        readers = {v: sdist_reader(fetch(r.sdist), r) for v, r in sorted(older.items(), key=lambda i: Version(i[0]))}
    servings = [serving(v, r) for v, r in readers.items()]
    if version is not None:
        servings.append(serving(version, read))
    scanned = tuple(s.version for s in sorted(servings, key=lambda s: Version(s.version)))
    return LineEnd(name, evidence, ways(servings), scanned, drafter)


def known_line_end(manifest: Manifest, readers: Mapping[str, Reader] | None = None) -> LineEnd | None:
    """The end of the V1 line among the releases this checkout pins (dist.toml [releases], the pins, [upstream]): the
    verdict for the first one whose own tree has no V1, from the older ones' sources (None when every one has V1).
    What the pin matrix prints beside its table. `readers` (tests) replaces the pinned sdists."""
    if readers is None:
        from vllm_dflash.fetch import fetch

        known = sorted(known_releases(manifest).items(), key=lambda i: Version(i[0]))
        readers = {v: sdist_reader(fetch(r.sdist), r) for v, r in known}
    ordered = sorted(readers, key=Version)
    first = next((v for v in ordered if removal(readers[v])), None)
    if first is None:
        return None
    older = {v: readers[v] for v in ordered if Version(v) < Version(first)}
    return line_end(manifest, first, readers[first], readers=older)
