"""Full CUDA build: choose the build mode, check the toolchain, plan and run vLLM's own build of the patched tree.

The build itself is upstream's (`setup.py bdist_wheel`, the way the csrc-build stage of vLLM's docker/Dockerfile
runs it); this module decides the environment that controls it and refuses early, in one line, when the machine
cannot finish it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash import provenance as prov
from vllm_dflash.errors import ToolchainError, UnsupportedModeError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import ensure_dir
from vllm_dflash.pipeline.model import MODES, ModeChoice, PatchedTree, WheelResult, make_provenance
from vllm_dflash.pipeline.wheelfile import add_files
from vllm_dflash.provenance import BuildInfo
from vllm_dflash.series import Patch

# What upstream's 0.20.1 release image builds for (docker/Dockerfile `ARG torch_cuda_arch_list`, CUDA 13.0).
DEFAULT_CUDA_ARCH_LIST = "7.5 8.0 8.6 8.9 9.0 10.0 11.0 12.0+PTX"
# vLLM 0.20.1's build requirements (requirements/build/cuda.txt, CMakeLists.txt).
TORCH_VERSION = "2.11.0"
TORCH_CUDA_MAJOR = "13"
CMAKE_MIN = (3, 26, 1)
SETUPTOOLS_MIN = (77, 0, 3)
SETUPTOOLS_MAX = (81, 0, 0)  # exclusive
SETUPTOOLS_SCM_MIN = (8,)
# Peak resident memory of one nvcc compile unit, measured here on one vLLM kernel file (2.7 GB for 7 archs).
GB_PER_NVCC_JOB = 3.0
# Free disk the build tree needs: third-party sources in .deps, objects for every arch, the wheel (~0.5 GB).
# An estimate with headroom, not a measurement of a finished build.
DISK_GB_NEEDED = 30.0

# Pre-fetched third-party sources: short name -> the environment variable vLLM 0.20.1's CMake reads.
# (Names are upstream's; only two of them carry the VLLM_ prefix.)
SRC_DIR_ENV = {
    "cutlass": "VLLM_CUTLASS_SRC_DIR",
    "flash_attn": "VLLM_FLASH_ATTN_SRC_DIR",
    "flashmla": "FLASH_MLA_SRC_DIR",
    "deepgemm": "DEEPGEMM_SRC_DIR",
    "qutlass": "QUTLASS_SRC_DIR",
    "triton_kernels": "TRITON_KERNELS_SRC_DIR",
}
_BUILD_TYPES = ("Release", "RelWithDebInfo", "Debug", "MinSizeRel")
_ARCH = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")


# --------------------------------------------------------------------------------------------------- build mode
def choose_mode(patches: Sequence[Patch], base_wheel_available: bool, requested: str) -> ModeChoice:
    """The build mode for this patch queue: `requested` is auto, fast or full (see README "Full build")."""
    if requested not in MODES:
        raise UnsupportedModeError(f"unknown build mode '{requested}'", f"use one of {', '.join(MODES)}")
    compiled = [p for p in patches if not p.python_only]
    if compiled:
        names = ", ".join(f"{p.name} ({', '.join(_non_python(p.files)) or 'non-Python files'})" for p in compiled)
        why_full = f"{len(compiled)} patch(es) change compiled sources: {names}"
    else:
        why_full = ""
    if requested == "full":
        return ModeChoice("full", "full build requested" + (f"; {why_full}" if why_full else ""))
    if requested == "fast":
        if compiled:
            raise UnsupportedModeError(
                f"the fast path reuses upstream's compiled binaries, but {why_full}", "build with --mode full"
            )
        if not base_wheel_available:
            raise UnsupportedModeError(
                f"no upstream wheel of the pinned commit for this platform ({platform.machine()})",
                "build with --mode full",
            )
        return ModeChoice("fast", f"fast path requested; all {len(patches)} patch(es) are Python-only")
    # auto
    if compiled:
        return ModeChoice("full", why_full)
    if not base_wheel_available:
        return ModeChoice("full", f"no upstream wheel of the pinned commit for {platform.machine()}")
    return ModeChoice(
        "fast", f"all {len(patches)} patch(es) are Python-only and the upstream wheel of the pinned commit exists"
    )


def _non_python(files: Sequence[str]) -> list[str]:
    return [f for f in files if not f.endswith(".py")]


# ------------------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class FullBuildOptions:
    """Knobs of the full build. None means: derive from this machine (cores, memory) or upstream's default."""

    max_jobs: int | None = None  # MAX_JOBS: compile units at once (upstream runs MAX_JOBS // NVCC_THREADS nvcc)
    nvcc_threads: int | None = None  # NVCC_THREADS: archs one nvcc compiles in parallel
    torch_cuda_arch_list: str | None = None  # e.g. "9.0" for an H100/H200-only fleet
    cmake_build_type: str = "Release"
    use_sccache: bool = False  # upstream's USE_SCCACHE route: a shared compiler cache in a bucket
    sccache_bucket: str | None = None
    sccache_region: str | None = None
    sccache_endpoint: str | None = None
    ccache_dir: str | None = None  # local compiler cache dir (ccache is used when on PATH and sccache is not)
    src_dirs: Mapping[str, str] = field(default_factory=dict)  # cutlass/flash_attn/... -> pre-fetched source dir
    python: str = sys.executable  # the interpreter with torch 2.11.0 (CUDA) and the build requirements
    cuda_home: str | None = None  # default: $CUDA_HOME, else the toolkit of the nvcc on PATH
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FullBuildOptions:
        """Options from upstream's own build variables (MAX_JOBS, NVCC_THREADS, TORCH_CUDA_ARCH_LIST, ...).

        This is how the Dockerfile's `full` builder and `vllm-dflash wheel --mode full` pass their knobs, so a
        user who knows vLLM's build needs to learn no new names. Empty values mean "default".
        """
        env = os.environ if environ is None else environ

        def num(name: str) -> int | None:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            if not raw.isdigit():
                raise ToolchainError(f"{name}='{raw}' is not a whole number", f"set {name} to e.g. 4 or unset it")
            return int(raw)

        src_dirs = {short: env[var] for short, var in SRC_DIR_ENV.items() if env.get(var, "").strip()}
        return cls(
            max_jobs=num("MAX_JOBS"),
            nvcc_threads=num("NVCC_THREADS"),
            torch_cuda_arch_list=env.get("TORCH_CUDA_ARCH_LIST", "").strip() or None,
            cmake_build_type=env.get("CMAKE_BUILD_TYPE", "").strip() or "Release",
            use_sccache=env.get("USE_SCCACHE", "").strip() == "1",
            sccache_bucket=env.get("SCCACHE_BUCKET", "").strip() or None,
            sccache_region=env.get("SCCACHE_REGION", "").strip() or None,
            sccache_endpoint=env.get("SCCACHE_ENDPOINT", "").strip() or None,
            ccache_dir=env.get("CCACHE_DIR", "").strip() or None,
            src_dirs=src_dirs,
            cuda_home=env.get("CUDA_HOME", "").strip() or None,
        )


# ---------------------------------------------------------------------------------------------------- toolchain
@dataclass(frozen=True)
class ToolCheck:
    name: str
    ok: bool
    found: str  # what is there ("missing" when nothing)
    need: str  # what the build needs


@dataclass(frozen=True)
class ToolchainReport:
    checks: tuple[ToolCheck, ...]
    nvcc_cuda: str | None
    torch_cuda: str | None
    mem_available_gb: float
    disk_free_gb: float
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def missing(self) -> tuple[ToolCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def summary(self) -> str:
        return "; ".join(f"{c.name}: need {c.need}, found {c.found}" for c in self.missing)

    def raise_if_missing(self) -> None:
        if not self.ok:
            raise ToolchainError(
                f"the full CUDA build cannot run here -- {self.summary()}",
                "install the `full` extra with the CUDA torch (pip install 'vllm-dflash[full]') and CUDA 13 nvcc, "
                "or use --mode fast / the Dockerfile's `full` target (README: Full build)",
            )


def _version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in re.split(r"[.+-]", text):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in v)


def _mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        pass
    return 0.0


def find_cuda_home(explicit: str | None) -> str | None:
    """The CUDA toolkit root: `explicit`, $CUDA_HOME/$CUDA_PATH, the toolkit of the nvcc on PATH, /usr/local/cuda*.

    The nvcc on PATH may be a wrapper script outside the toolkit, so a candidate counts only with its headers.
    """
    candidates: list[Path] = []
    for value in (explicit, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if value:
            candidates.append(Path(value))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    candidates += sorted(Path("/usr/local").glob("cuda-*"), reverse=True)
    for c in candidates:
        if (c / "bin" / "nvcc").is_file() and (c / "include" / "cuda_runtime.h").is_file():
            return str(c)
    return None


def _find_nvcc(cuda_home: str | None) -> str | None:
    home = find_cuda_home(cuda_home)
    if home:
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


# Reads versions without importing torch: torch/version.py is a plain file with `cuda = '13.0'`.
_PROBE = r"""
import json, importlib.metadata as md, importlib.util as iu, re, pathlib
out = {}
for name in ("torch", "setuptools", "setuptools-scm", "ninja", "cmake", "wheel"):
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
spec = iu.find_spec("torch")
cuda = None
if spec and spec.submodule_search_locations:
    vf = pathlib.Path(list(spec.submodule_search_locations)[0]) / "version.py"
    if vf.is_file():
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", vf.read_text(), re.M)
        cuda = m.group(1) if m else None
out["torch_cuda"] = cuda
print(json.dumps(out))
"""


def _probe_here() -> dict[str, str | None]:
    """What _PROBE prints, for this interpreter, in-process (no ~0.1 s interpreter start)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(_PROBE, {})  # the same probe text that runs in another interpreter; it only reads metadata
    data: dict[str, str | None] = json.loads(buf.getvalue())
    return data


def _probe_python(python: str) -> dict[str, str | None]:
    if Path(python).absolute() == Path(sys.executable).absolute():
        return _probe_here()
    res = proc.call(python, "-c", _PROBE, capture=True, check=False, quiet=True)
    if res.returncode != 0:
        return {}
    data: dict[str, str | None] = json.loads(res.stdout.strip().splitlines()[-1])
    return data


def _tool_version(path: str, pattern: str) -> str | None:
    res = proc.call(path, "--version", capture=True, check=False, quiet=True)
    m = re.search(pattern, (res.stdout or "") + (res.stderr or ""))
    return m.group(1) if m else None


def _resolve_units(options: FullBuildOptions, mem_gb: float) -> int:
    """Parallel nvcc compile units: no more than cores, and ~3 GB of available memory each."""
    if options.max_jobs is not None:
        return options.max_jobs
    cores = os.cpu_count() or 1
    by_mem = int(mem_gb // GB_PER_NVCC_JOB)
    return max(1, min(cores, by_mem))


def check_toolchain(options: FullBuildOptions | None = None, build_dir: Path | None = None) -> ToolchainReport:
    """Check everything the full build needs, cheapest first; the report lists every missing piece.

    torch is only imported (in a subprocess, ~seconds) when every cheaper check has passed.
    """
    opts = options or FullBuildOptions()
    start = time.monotonic()
    checks: list[ToolCheck] = []

    nvcc = _find_nvcc(opts.cuda_home)
    nvcc_cuda = _tool_version(nvcc, r"release (\d+\.\d+)") if nvcc else None
    nvcc_ok = nvcc_cuda is not None and nvcc_cuda.split(".")[0] == TORCH_CUDA_MAJOR
    found_nvcc = f"CUDA {nvcc_cuda} ({nvcc})" if nvcc_cuda else "missing"
    checks.append(ToolCheck("nvcc", nvcc_ok, found_nvcc, f"CUDA {TORCH_CUDA_MAJOR}.x"))

    # The build venv's own cmake/ninja (PyPI wheels) come first on the build's PATH; look there first too.
    py_bin = Path(opts.python).parent
    cmake = str(py_bin / "cmake") if (py_bin / "cmake").is_file() else shutil.which("cmake")
    cmake_v = _tool_version(cmake, r"cmake version (\d+\.\d+\.\d+)") if cmake else None
    checks.append(
        ToolCheck(
            "cmake",
            cmake_v is not None and _version_tuple(cmake_v) >= CMAKE_MIN,
            cmake_v or "missing",
            f">= {_fmt(CMAKE_MIN)}",
        )
    )
    ninja = str(py_bin / "ninja") if (py_bin / "ninja").is_file() else shutil.which("ninja")
    checks.append(ToolCheck("ninja", ninja is not None, ninja or "missing", "ninja on PATH"))

    probe = _probe_python(opts.python) if Path(opts.python).exists() else {}
    if not probe:
        checks.append(ToolCheck("python", False, f"{opts.python} not runnable", "a Python 3.10-3.13 interpreter"))
    st = probe.get("setuptools")
    checks.append(
        ToolCheck(
            "setuptools",
            st is not None and SETUPTOOLS_MIN <= _version_tuple(st) < SETUPTOOLS_MAX,
            st or "missing",
            f">={_fmt(SETUPTOOLS_MIN)},<{_fmt(SETUPTOOLS_MAX)}",
        )
    )
    scm = probe.get("setuptools-scm")
    checks.append(
        ToolCheck(
            "setuptools-scm",
            scm is not None and _version_tuple(scm) >= SETUPTOOLS_SCM_MIN,
            scm or "missing",
            f">={_fmt(SETUPTOOLS_SCM_MIN)}",
        )
    )
    torch_v = probe.get("torch")
    torch_cuda = probe.get("torch_cuda")
    torch_ok = torch_v is not None and torch_v.split("+")[0] == TORCH_VERSION and torch_cuda is not None
    if torch_v is None:
        found = "missing"
    elif torch_cuda is None:
        found = f"{torch_v} (CPU-only build)"
    else:
        found = f"{torch_v} (CUDA {torch_cuda})"
    checks.append(ToolCheck("torch", torch_ok, found, f"{TORCH_VERSION} CUDA {TORCH_CUDA_MAJOR}.x build"))
    if nvcc_cuda and torch_cuda:
        same = nvcc_cuda.split(".")[0] == torch_cuda.split(".")[0]
        checks.append(
            ToolCheck("nvcc vs torch CUDA", same, f"nvcc {nvcc_cuda}, torch {torch_cuda}", "the same CUDA major")
        )

    mem = _mem_available_gb()
    units = _resolve_units(opts, mem)
    need_mem = units * GB_PER_NVCC_JOB
    checks.append(
        ToolCheck(
            "memory",
            mem >= need_mem,
            f"{mem:.1f} GB available",
            f"{need_mem:.0f} GB for {units} parallel nvcc job(s) (~{GB_PER_NVCC_JOB:.0f} GB each; lower MAX_JOBS)",
        )
    )
    where = build_dir if build_dir is not None else Path.cwd()
    probe_dir = where
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    disk = shutil.disk_usage(probe_dir).free / 1e9
    checks.append(
        ToolCheck("disk", disk >= DISK_GB_NEEDED, f"{disk:.0f} GB free in {probe_dir}", f"{DISK_GB_NEEDED:.0f} GB")
    )

    for name, src in sorted(opts.src_dirs.items()):
        env_name = SRC_DIR_ENV.get(name, name)
        checks.append(
            ToolCheck(
                env_name,
                Path(src).is_dir(),
                src if Path(src).is_dir() else f"{src} (no such dir)",
                "an existing source directory",
            )
        )

    if all(c.ok for c in checks):
        # Only now pay for importing torch: the CUDA build must really load (libs, ABI), not just be installed.
        res = proc.call(
            opts.python,
            "-c",
            "import torch; print(torch.__version__, torch.version.cuda)",
            capture=True,
            check=False,
            quiet=True,
        )
        loaded = res.stdout.strip() if res.returncode == 0 else ""
        checks.append(ToolCheck("torch import", bool(loaded), loaded or "import failed", "import torch succeeds"))

    return ToolchainReport(
        checks=tuple(checks),
        nvcc_cuda=nvcc_cuda,
        torch_cuda=torch_cuda,
        mem_available_gb=mem,
        disk_free_gb=disk,
        seconds=time.monotonic() - start,
    )


# ------------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class BuildPlan:
    command: tuple[str, ...]
    env: Mapping[str, str]  # added to the caller's environment
    cwd: Path
    dist_dir: Path  # where setup.py writes the wheel (inside the tree)
    max_jobs: int
    nvcc_threads: int
    ninja_jobs: int  # what upstream's setup.py runs at once: MAX_JOBS // NVCC_THREADS
    compiler_cache: str  # "sccache" | "ccache" | "none"
    version: str

    def shell(self) -> str:
        """The plan as one copy-pasteable shell line."""
        import shlex

        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"cd {shlex.quote(str(self.cwd))} && {envs} {shlex.join(self.command)}"


def default_jobs(cores: int, mem_gb: float) -> tuple[int, int]:
    """(MAX_JOBS, NVCC_THREADS) for a machine: compile units bounded by cores and ~3 GB each.

    nvcc threads only pay off once there are enough units that files, not archs, stop being the parallelism
    (the tail of the build has few files left); below 8 units one thread per nvcc keeps all of them busy.
    """
    units = max(1, min(cores, int(mem_gb // GB_PER_NVCC_JOB)))
    threads = 1 if units < 8 else 2
    return units, threads


def _validate_arch_list(arch_list: str) -> str:
    archs = arch_list.replace(";", " ").split()
    bad = [a for a in archs if not _ARCH.match(a)]
    if not archs or bad:
        raise ToolchainError(
            f"TORCH_CUDA_ARCH_LIST '{arch_list}' is not a list of compute capabilities ({', '.join(bad) or 'empty'})",
            "write e.g. '9.0' or '8.0 9.0 10.0+PTX'",
        )
    return " ".join(archs)


def plan_full_build(manifest: Manifest, patched_tree_path: Path, options: FullBuildOptions | None = None) -> BuildPlan:
    """The command and environment for vLLM's own build of the patched tree (nothing is run)."""
    opts = options or FullBuildOptions()
    if opts.cmake_build_type not in _BUILD_TYPES:
        raise ToolchainError(
            f"CMAKE_BUILD_TYPE '{opts.cmake_build_type}' is not one of {', '.join(_BUILD_TYPES)}",
            "pass --cmake-build-type Release (the default)",
        )
    for name, value in (("max_jobs", opts.max_jobs), ("nvcc_threads", opts.nvcc_threads)):
        if value is not None and value < 1:
            raise ToolchainError(
                f"{name} must be at least 1 (got {value})", f"pass --{name.replace('_', '-')} 1 or more"
            )
    unknown = sorted(set(opts.src_dirs) - set(SRC_DIR_ENV) - set(SRC_DIR_ENV.values()))
    if unknown:
        raise ToolchainError(
            f"unknown third-party source(s) {', '.join(unknown)}", f"use names from {', '.join(SRC_DIR_ENV)}"
        )
    if opts.use_sccache and not opts.sccache_bucket:
        raise ToolchainError("sccache was asked for without a bucket", "pass --sccache-bucket NAME (and region)")

    d_jobs, d_threads = default_jobs(os.cpu_count() or 1, _mem_available_gb())
    max_jobs = opts.max_jobs if opts.max_jobs is not None else d_jobs
    nvcc_threads = opts.nvcc_threads if opts.nvcc_threads is not None else min(d_threads, max_jobs)
    arch_list = _validate_arch_list(opts.torch_cuda_arch_list or DEFAULT_CUDA_ARCH_LIST)

    tree = Path(patched_tree_path).resolve()
    env: dict[str, str] = {
        "VLLM_TARGET_DEVICE": "cuda",
        "MAX_JOBS": str(max_jobs),
        "NVCC_THREADS": str(nvcc_threads),
        "TORCH_CUDA_ARCH_LIST": arch_list,
        "VLLM_VERSION_OVERRIDE": manifest.version,
        "CMAKE_BUILD_TYPE": opts.cmake_build_type,
        # Never fall back to downloading upstream's binaries: this mode exists to compile them.
        "VLLM_USE_PRECOMPILED": "",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": "",
    }
    cuda_home = find_cuda_home(opts.cuda_home)
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
    if opts.use_sccache:
        # Upstream's shared-cache route: setup.py puts sccache in front of every compiler when it is on PATH.
        env["USE_SCCACHE"] = "1"
        env["SCCACHE_BUCKET"] = opts.sccache_bucket or ""
        env["SCCACHE_IDLE_TIMEOUT"] = "0"
        if opts.sccache_region:
            env["SCCACHE_REGION"] = opts.sccache_region
        if opts.sccache_endpoint:
            env["SCCACHE_ENDPOINT"] = opts.sccache_endpoint
        cache = "sccache"
    elif shutil.which("sccache"):
        cache = "sccache"  # setup.py prefers it when present, with its local disk cache
    elif shutil.which("ccache"):
        cache = "ccache"
        env["CCACHE_DIR"] = opts.ccache_dir or str(Path.home() / ".cache" / "ccache")
    else:
        cache = "none"
    for name, src in opts.src_dirs.items():
        env[SRC_DIR_ENV.get(name, name)] = str(Path(src).resolve())
    env.update(opts.extra_env)

    dist = tree / "dist"
    command = (opts.python, "setup.py", "bdist_wheel", f"--dist-dir={dist}", "--py-limited-api=cp38")
    return BuildPlan(
        command=command,
        env=env,
        cwd=tree,
        dist_dir=dist,
        max_jobs=max_jobs,
        nvcc_threads=nvcc_threads,
        ninja_jobs=max(1, max_jobs // nvcc_threads),
        compiler_cache=cache,
        version=manifest.version,
    )


# ------------------------------------------------------------------------------------------------------- build
def full_build_info(plan: BuildPlan, mode_reason: str) -> BuildInfo:
    """What controlled a full build: upstream's command and variables, without host paths (same inputs, same bytes)."""
    from vllm_dflash import __version__ as tool_version

    return BuildInfo(
        tool="vllm-dflash",
        tool_version=tool_version,
        mode="full",
        mode_reason=mode_reason,
        base_wheel=None,
        base_wheel_sha256=None,
        command=tuple(plan.command[1:]),  # without the interpreter path
        env={k: v for k, v in sorted(plan.env.items()) if k != "CUDA_HOME" and not k.endswith("_DIR")},
        compiler_cache=plan.compiler_cache,
    )


def build_full_wheel(
    manifest: Manifest,
    patched: PatchedTree,
    out_dir: Path,
    options: FullBuildOptions | None = None,
    mode_reason: str = "full build requested",
) -> WheelResult:
    """Compile the patched tree with vLLM's own build, embed the provenance document in the wheel (as the fast path
    does) and move the wheel to `out_dir` (atomically)."""
    opts = options or FullBuildOptions.from_env()
    tree = Path(patched.path)
    check_toolchain(opts, build_dir=tree).raise_if_missing()
    plan = plan_full_build(manifest, tree, opts)
    print(
        f"full build: MAX_JOBS={plan.max_jobs} NVCC_THREADS={plan.nvcc_threads} ({plan.ninja_jobs} nvcc at once), "
        f"archs '{plan.env['TORCH_CUDA_ARCH_LIST']}', cache {plan.compiler_cache}; expect hours on few cores",
        file=sys.stderr,
    )
    before = set(plan.dist_dir.glob("*.whl")) if plan.dist_dir.is_dir() else set()
    env = dict(plan.env)
    py_bin = str(Path(opts.python).parent)
    env["PATH"] = py_bin + os.pathsep + os.environ.get("PATH", "")
    proc.call(*plan.command, cwd=plan.cwd, env=env, error=ToolchainError, hint="see the build log above")
    new = sorted(set(plan.dist_dir.glob("*.whl")) - before, key=lambda p: p.stat().st_mtime)
    if not new:
        raise ToolchainError(f"the build finished but wrote no wheel to {plan.dist_dir}", "see the build log above")
    return embed_provenance(manifest, patched, new[-1], out_dir, full_build_info(plan, mode_reason))


def embed_provenance(
    manifest: Manifest, patched: PatchedTree, built: Path, out_dir: Path, info: BuildInfo
) -> WheelResult:
    """Copy a wheel upstream's build wrote into `out_dir` with our provenance document inside it."""
    ensure_dir(out_dir, "output directory")
    final = out_dir / built.name
    doc = make_provenance(manifest, patched, info, ())
    add_files(built, {prov.PATH: doc.dumps()}, final)
    return WheelResult(
        path=final,
        sha256=sha256_file(final),
        mode="full",
        base_wheel=None,
        changed=(),
        provenance=doc,
        platform=platform.machine(),
    )


def preflight(mode: str, build_dir: Path | None = None) -> None:
    """Refuse `--mode full` before any source or patch work when the toolchain cannot build (one line, < 1 s)."""
    if mode == "full":
        check_toolchain(FullBuildOptions.from_env(), build_dir=build_dir).raise_if_missing()
