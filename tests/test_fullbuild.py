"""Full CUDA build mode: mode choice on real patch files, the build plan, the toolchain refusal, and vLLM's own
CMake configure of the patched tree run as far as it goes offline (a full CUDA compile is not possible here)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ModuleTmp

from vllm_dflash import provenance as prov
from vllm_dflash.errors import ToolchainError, UnsupportedModeError
from vllm_dflash.fetch import cache_dir, fetch
from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline import fullbuild as fb
from vllm_dflash.pipeline.model import PatchedTree
from vllm_dflash.pipeline.wheelfile import verify_wheel
from vllm_dflash.series import Patch, load_patch, read_queue

PY_PATCH = """\
From 1111111111111111111111111111111111111111 Mon Sep 17 00:00:00 2001
From: Test <test@example.com>
Subject: [PATCH] dflash: tap the output of layer L
Origin: vendor
Forwarded: not-needed

---
 vllm/v1/spec_decode/dflash.py | 2 +-
 1 file changed, 1 insertion(+), 1 deletion(-)

diff --git a/vllm/v1/spec_decode/dflash.py b/vllm/v1/spec_decode/dflash.py
--- a/vllm/v1/spec_decode/dflash.py
+++ b/vllm/v1/spec_decode/dflash.py
@@ -1,3 +1,3 @@
 a
-b
+c
 d
"""

CSRC_PATCH = """\
From 2222222222222222222222222222222222222222 Mon Sep 17 00:00:00 2001
From: Test <test@example.com>
Subject: [PATCH] kernels: fix the attention kernel
Origin: vendor

---
 csrc/attention/attention_kernels.cu | 2 +-
 vllm/attention/ops/paged_attn.py    | 2 +-
 2 files changed, 2 insertions(+), 2 deletions(-)

diff --git a/csrc/attention/attention_kernels.cu b/csrc/attention/attention_kernels.cu
--- a/csrc/attention/attention_kernels.cu
+++ b/csrc/attention/attention_kernels.cu
@@ -1,3 +1,3 @@
 a
-b
+c
 d
diff --git a/vllm/attention/ops/paged_attn.py b/vllm/attention/ops/paged_attn.py
--- a/vllm/attention/ops/paged_attn.py
+++ b/vllm/attention/ops/paged_attn.py
@@ -1,3 +1,3 @@
 a
-b
+c
 d
"""


@pytest.fixture
def queues(tmp_path: Path) -> tuple[list[Patch], list[Patch]]:
    (tmp_path / "0001-py.patch").write_text(PY_PATCH)
    (tmp_path / "0002-csrc.patch").write_text(CSRC_PATCH)
    py = load_patch(tmp_path / "0001-py.patch")
    csrc = load_patch(tmp_path / "0002-csrc.patch")
    assert py.python_only and not csrc.python_only  # parsed by the real patch reader, not constructed here
    return [py], [py, csrc]


# ---------------------------------------------------------------------------------------------------- mode
def test_auto_picks_fast_for_python_only_and_full_for_csrc(queues: tuple[list[Patch], list[Patch]]) -> None:
    python_only, with_csrc = queues
    fast = fb.choose_mode(python_only, True, "auto")
    assert fast.mode == "fast" and "Python-only" in fast.reason
    full = fb.choose_mode(with_csrc, True, "auto")
    assert full.mode == "full"
    assert "0002-csrc.patch" in full.reason and "csrc/attention/attention_kernels.cu" in full.reason
    assert "paged_attn.py" not in full.reason  # only the compiled sources are named as the cause
    # No upstream wheel for this platform: full even for a Python-only queue, and the reason says so.
    nowheel = fb.choose_mode(python_only, False, "auto")
    assert nowheel.mode == "full" and "no upstream wheel" in nowheel.reason


def test_our_queue_is_fast(manifest: Manifest) -> None:
    patches = read_queue(manifest.series_path).patches
    assert fb.choose_mode(patches, True, "auto").mode == "fast"


def test_fast_refuses_csrc_and_full_is_full(queues: tuple[list[Patch], list[Patch]]) -> None:
    python_only, with_csrc = queues
    with pytest.raises(UnsupportedModeError) as exc:
        fb.choose_mode(with_csrc, True, "fast")
    assert "--mode full" in exc.value.one_line() and "0002-csrc.patch" in exc.value.one_line()
    assert exc.value.return_code == 8
    with pytest.raises(UnsupportedModeError, match="no upstream wheel"):
        fb.choose_mode(python_only, False, "fast")
    assert fb.choose_mode(python_only, True, "full").mode == "full"
    with pytest.raises(UnsupportedModeError, match="unknown build mode"):
        fb.choose_mode(python_only, True, "turbo")


# ---------------------------------------------------------------------------------------------------- plan
def test_default_arch_list_is_upstreams_release(manifest: Manifest) -> None:
    """Our default TORCH_CUDA_ARCH_LIST is read off the 0.20.1 sdist's docker/Dockerfile, not guessed."""
    sdist = fetch(manifest.sdist)
    with tarfile.open(sdist) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("/docker/Dockerfile"))
        handle = tf.extractfile(member)
        assert handle is not None
        text = handle.read().decode()
    m = re.search(r"^ARG torch_cuda_arch_list='([^']+)'", text, re.M)
    assert m, "upstream's Dockerfile no longer declares torch_cuda_arch_list"
    assert fb.DEFAULT_CUDA_ARCH_LIST == m.group(1)


@pytest.mark.parametrize(
    ("cores", "mem_gb", "expected"),
    [(2, 24.0, (2, 1)), (64, 256.0, (64, 2)), (64, 16.0, (5, 1)), (1, 2.0, (1, 1)), (16, 64.0, (16, 2))],
)
def test_default_jobs(cores: int, mem_gb: float, expected: tuple[int, int]) -> None:
    assert fb.default_jobs(cores, mem_gb) == expected


def test_plan_defaults(manifest: Manifest, tmp_path: Path) -> None:
    plan = fb.plan_full_build(manifest, tmp_path, fb.FullBuildOptions(python="/opt/py/bin/python"))
    env = plan.env
    assert plan.command == (
        "/opt/py/bin/python",
        "setup.py",
        "bdist_wheel",
        f"--dist-dir={tmp_path.resolve() / 'dist'}",
        "--py-limited-api=cp38",
    )
    assert plan.cwd == tmp_path.resolve()
    assert env["TORCH_CUDA_ARCH_LIST"] == fb.DEFAULT_CUDA_ARCH_LIST
    assert env["VLLM_VERSION_OVERRIDE"] == manifest.version
    assert env["VLLM_TARGET_DEVICE"] == "cuda" and env["CMAKE_BUILD_TYPE"] == "Release"
    assert env["VLLM_USE_PRECOMPILED"] == "" and env["VLLM_PRECOMPILED_WHEEL_LOCATION"] == ""
    cores = os.cpu_count() or 1
    assert int(env["MAX_JOBS"]) == plan.max_jobs <= cores
    assert plan.ninja_jobs == max(1, plan.max_jobs // plan.nvcc_threads)
    assert "USE_SCCACHE" not in env
    assert plan.compiler_cache == (
        "sccache" if shutil.which("sccache") else "ccache" if shutil.which("ccache") else "none"
    )
    assert "MAX_JOBS=" in plan.shell() and "setup.py bdist_wheel" in plan.shell()


def test_plan_h200_fleet_sccache_and_offline_sources(manifest: Manifest, tmp_path: Path) -> None:
    cutlass = tmp_path / "cutlass"
    fa = tmp_path / "flash-attention"
    opts = fb.FullBuildOptions(
        max_jobs=16,
        nvcc_threads=4,
        torch_cuda_arch_list="9.0",
        cmake_build_type="RelWithDebInfo",
        use_sccache=True,
        sccache_bucket="acme-vllm-cache",
        sccache_region="eu-west-1",
        src_dirs={"cutlass": str(cutlass), "flash_attn": str(fa), "DEEPGEMM_SRC_DIR": str(tmp_path / "dg")},
    )
    plan = fb.plan_full_build(manifest, tmp_path / "tree", opts)
    env = plan.env
    assert (env["MAX_JOBS"], env["NVCC_THREADS"], plan.ninja_jobs) == ("16", "4", 4)
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0" and env["CMAKE_BUILD_TYPE"] == "RelWithDebInfo"
    assert env["USE_SCCACHE"] == "1" and env["SCCACHE_BUCKET"] == "acme-vllm-cache"
    assert env["SCCACHE_REGION"] == "eu-west-1" and plan.compiler_cache == "sccache"
    assert env["VLLM_CUTLASS_SRC_DIR"] == str(cutlass.resolve())
    assert env["VLLM_FLASH_ATTN_SRC_DIR"] == str(fa.resolve())
    assert env["DEEPGEMM_SRC_DIR"] == str((tmp_path / "dg").resolve())


def test_options_from_upstream_env_names(manifest: Manifest, tmp_path: Path) -> None:
    opts = fb.FullBuildOptions.from_env(
        {"MAX_JOBS": "6", "NVCC_THREADS": "", "TORCH_CUDA_ARCH_LIST": "8.0 9.0+PTX", "VLLM_CUTLASS_SRC_DIR": "/c"}
    )
    assert (opts.max_jobs, opts.nvcc_threads, opts.torch_cuda_arch_list) == (6, None, "8.0 9.0+PTX")
    assert dict(opts.src_dirs) == {"cutlass": "/c"}
    plan = fb.plan_full_build(manifest, tmp_path, opts)
    assert plan.env["MAX_JOBS"] == "6" and plan.env["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0+PTX"
    with pytest.raises(ToolchainError, match="MAX_JOBS='lots'"):
        fb.FullBuildOptions.from_env({"MAX_JOBS": "lots"})


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (fb.FullBuildOptions(torch_cuda_arch_list="hopper"), "not a list of compute capabilities"),
        (fb.FullBuildOptions(torch_cuda_arch_list=" "), "not a list of compute capabilities"),
        (fb.FullBuildOptions(cmake_build_type="Fast"), "CMAKE_BUILD_TYPE 'Fast'"),
        (fb.FullBuildOptions(max_jobs=0), "max_jobs must be at least 1"),
        (fb.FullBuildOptions(use_sccache=True), "without a bucket"),
        (fb.FullBuildOptions(src_dirs={"cutlas": "/x"}), "unknown third-party source"),
    ],
)
def test_plan_refusals(manifest: Manifest, tmp_path: Path, opts: fb.FullBuildOptions, message: str) -> None:
    with pytest.raises(ToolchainError, match=message) as exc:
        fb.plan_full_build(manifest, tmp_path, opts)
    assert exc.value.return_code == 10 and " -- " in exc.value.one_line()


# ----------------------------------------------------------------------------------------------- toolchain
@pytest.fixture(scope="module")
def bare_python(module_tmp: ModuleTmp) -> Path:
    """A fresh venv with nothing installed: the toolchain check must name every missing Python piece."""
    venv = module_tmp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def test_toolchain_lists_every_missing_piece(bare_python: Path, tmp_path: Path) -> None:
    empty_cuda = tmp_path / "no-cuda"
    empty_cuda.mkdir()
    opts = fb.FullBuildOptions(python=str(bare_python), max_jobs=100000, src_dirs={"cutlass": str(tmp_path / "nope")})
    report = fb.check_toolchain(opts, build_dir=tmp_path)
    assert not report.ok
    missing = {c.name for c in report.missing}
    assert {"torch", "setuptools", "setuptools-scm", "memory", "VLLM_CUTLASS_SRC_DIR"} <= missing
    assert "torch import" not in {c.name for c in report.checks}  # torch is never imported when cheaper checks fail
    with pytest.raises(ToolchainError) as exc:
        report.raise_if_missing()
    line = exc.value.one_line()
    assert "\n" not in line
    for piece in (
        "torch: need 2.11.0 CUDA 13.x build, found missing",
        "setuptools-scm",
        "memory",
        "VLLM_CUTLASS_SRC_DIR",
    ):
        assert piece in line
    if shutil.which("cmake") is None or fb._version_tuple(fb._tool_version("cmake", r"(\d+\.\d+\.\d+)") or "0") < (
        3,
        26,
        1,
    ):
        assert "cmake: need >= 3.26.1" in line


def test_wheel_full_refuses_with_missing_pieces(manifest: Manifest, tmp_path: Path) -> None:
    """`vllm-dflash wheel --mode full` on a machine without the CUDA toolchain: one line, exit code 10."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dflash",
            "--root",
            str(manifest.root),
            "wheel",
            "--mode",
            "full",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.monotonic() - t0
    print(f"`wheel --mode full` refused in {seconds:.2f} s (including interpreter start)")
    assert res.returncode == ToolchainError.return_code, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "the full CUDA build cannot run here" in errors[0]
    assert "torch: need 2.11.0" in errors[0] and "setuptools-scm" in errors[0]
    assert "+ git" not in res.stderr  # refused before any source or patch work
    assert not out.exists() or not any(out.iterdir())  # nothing half-written


# ------------------------------------------------------------------------------------- offline CMake configure


@contextlib.contextmanager
def _patched_tree(manifest: Manifest) -> Iterator[PatchedTree]:
    """Our queue applied to the cached source tree, held under the pipeline's tree lock while it is read."""
    from vllm_dflash.pipeline.patches import apply_series
    from vllm_dflash.pipeline.source import prepare_source, trees_lock

    with trees_lock():
        yield apply_series(
            prepare_source(manifest, "auto"), read_queue(manifest.series_path).patches, manifest.fork_branch
        )


def _cmake_venv() -> Path:
    """PyPI cmake (>= 3.26.1; Debian bookworm has 3.25.1) and ninja in a venv cached under cache_dir()."""
    venv = cache_dir() / "tools" / "cmake-venv"
    cmake = venv / "bin" / "cmake"
    if not cmake.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "cmake>=3.26.1", "ninja"], check=True)
    return venv


def _configure(tree: Path, build: Path, python: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    venv = _cmake_venv()
    cmd = [
        str(venv / "bin" / "cmake"),
        "-S",
        str(tree),
        "-B",
        str(build),
        "-G",
        "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={venv / 'bin' / 'ninja'}",
        "-DVLLM_TARGET_DEVICE=cuda",
        f"-DVLLM_PYTHON_EXECUTABLE={python}",
        "-DCMAKE_BUILD_TYPE=Release",
    ]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, **env}, timeout=600)


@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.network
def test_cmake_configure_patched_tree_without_torch(manifest: Manifest, bare_python: Path, tmp_path: Path) -> None:
    """vLLM's CMakeLists on our patched tree: project, compilers, Python with the stable ABI, then the torch probe
    (the first thing that needs the `full` extra) -- exactly what check_toolchain reports missing."""
    with _patched_tree(manifest) as patched:
        res = _configure(Path(patched.path), tmp_path / "build", str(bare_python), {})
        out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "Target device: cuda" in out
    assert "Development.SABIModule" in out  # the cp38-abi3 (limited API) module support was found
    assert "Failed to locate torch path" in out and "No module named 'torch'" in out


def _torch_cuda_python() -> str | None:
    """A Python with PyPI's torch 2.11.0 CUDA build: $VLLM_DFLASH_TORCH_PYTHON or an env the CPU tests made."""
    explicit = os.environ.get("VLLM_DFLASH_TORCH_PYTHON")
    if explicit:
        return explicit
    for dist_info in sorted((cache_dir() / "envs").glob("*/lib/python3*/site-packages/torch-2.11.0*.dist-info")):
        version_py = dist_info.parent / "torch" / "version.py"
        if version_py.is_file() and re.search(r"^cuda.*'13\.", version_py.read_text(), re.M):
            return str(dist_info.parents[3] / "bin" / "python")
    return None


@pytest.mark.heavy
@pytest.mark.slow
def test_cmake_configure_with_torch_and_nvcc_reaches_third_party_fetch(manifest: Manifest, tmp_path: Path) -> None:
    """With torch 2.11.0 (CUDA 13.0) and a CUDA 13 nvcc, configure finds Torch, picks the archs we ask for and
    stops where it needs GitHub (CUTLASS): the part of the full build this machine cannot do."""
    python = _torch_cuda_python()
    nvcc = fb._find_nvcc(None)
    if python is None or nvcc is None:
        pytest.skip(f"needs torch 2.11.0+cu130 (found {python}) and nvcc (found {nvcc}); set VLLM_DFLASH_TORCH_PYTHON")
    report = fb.check_toolchain(fb.FullBuildOptions(python=python), build_dir=tmp_path)
    by_name = {c.name: c for c in report.checks}
    assert by_name["torch"].ok and by_name["nvcc"].ok and by_name["nvcc vs torch CUDA"].ok, report.summary()

    cuda_home = fb.find_cuda_home(None)
    assert cuda_home is not None
    env = {"TORCH_CUDA_ARCH_LIST": "9.0", "CUDA_HOME": cuda_home, "PATH": f"{cuda_home}/bin:{os.environ['PATH']}"}
    with _patched_tree(manifest) as patched:
        res = _configure(Path(patched.path), tmp_path / "build", python, env)
        out = res.stdout + res.stderr
    assert "Found Torch" in out
    assert "CUDA target architectures: 9.0" in out
    assert res.returncode != 0 and "cutlass" in out.lower()  # the GitHub fetch: offline sources needed


EXT_CPP = r"""
#include <torch/extension.h>

torch::Tensor scale_cuda(torch::Tensor x, double factor);

// The CPU path runs here; the CUDA path is compiled and linked (no GPU to run it on).
torch::Tensor scale(torch::Tensor x, double factor) {
  if (x.is_cuda()) return scale_cuda(x, factor);
  return x * factor;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("scale", &scale, "x * factor"); }
"""

EXT_CU = r"""
#include <torch/extension.h>

__global__ void scale_kernel(const float* in, float* out, float factor, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * factor;
}

torch::Tensor scale_cuda(torch::Tensor x, double factor) {
  auto y = torch::empty_like(x);
  int64_t n = x.numel();
  scale_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), (float)factor, n);
  return y;
}
"""

EXT_DRIVER = """
import sys, torch
from torch.utils.cpp_extension import load
m = load(name="dflash_probe_ext", sources=sys.argv[2:4], build_directory=sys.argv[1], verbose=True)
print("RESULT", m.scale(torch.arange(4, dtype=torch.float32), 2.5).tolist())
"""


@pytest.mark.heavy
@pytest.mark.slow
def test_compile_torch_cuda_extension(tmp_path: Path) -> None:
    """A real compile of a small torch extension with a CUDA kernel (nvcc, sm_90, torch 2.11.0 headers, ninja):
    the same compilers and flags the full build drives, on a scale of seconds instead of hours."""
    python = _torch_cuda_python()
    cuda_home = fb.find_cuda_home(None)
    if python is None or cuda_home is None:
        pytest.skip(f"needs torch 2.11.0+cu130 (found {python}) and a CUDA 13 toolkit (found {cuda_home})")
    (tmp_path / "ext.cpp").write_text(EXT_CPP)
    (tmp_path / "ext_kernel.cu").write_text(EXT_CU)
    build = tmp_path / "build"
    build.mkdir()
    env = {
        **os.environ,
        "CUDA_HOME": cuda_home,
        "PATH": f"{cuda_home}/bin:{Path(python).parent}:{os.environ['PATH']}",
        "TORCH_CUDA_ARCH_LIST": "9.0",
        "MAX_JOBS": "2",
    }
    res = subprocess.run(
        [python, "-c", EXT_DRIVER, str(build), str(tmp_path / "ext.cpp"), str(tmp_path / "ext_kernel.cu")],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=1800,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "-gencode=arch=compute_90,code=sm_90" in out  # nvcc compiled the kernel for Hopper
    assert "RESULT [0.0, 2.5, 5.0, 7.5]" in out  # the built module loads and its CPU path computes
    so = build / "dflash_probe_ext.so"
    assert b".nv_fatbin" in so.read_bytes()  # the device code is embedded in the extension


@pytest.mark.heavy
def test_full_build_provenance_records_mode_reason_and_plan(manifest: Manifest, tmp_path: Path) -> None:
    with _patched_tree(manifest) as patched:
        opts = fb.FullBuildOptions(torch_cuda_arch_list="9.0", src_dirs={"cutlass": str(tmp_path)})
        plan = fb.plan_full_build(manifest, patched.path, opts)
        info = fb.full_build_info(plan, "1 patch(es) change compiled sources: x")
        # What upstream's `setup.py bdist_wheel` writes, in miniature: a real wheel with a RECORD.
        built = tmp_path / "built" / "vllm-0.20.1+dflash.1-cp38-abi3-linux_x86_64.whl"
        built.parent.mkdir()
        from wheel.wheelfile import WheelFile

        with WheelFile(built, "w") as wf:
            wf.writestr("vllm/__init__.py", b"# compiled build\n")
            wf.writestr(
                "vllm-0.20.1+dflash.1.dist-info/METADATA",
                b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1+dflash.1\n",
            )
            wf.writestr("vllm-0.20.1+dflash.1.dist-info/WHEEL", b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n")
        result = fb.embed_provenance(manifest, patched, built, tmp_path / "dist", info)
    # The provenance travels inside the wheel on the full path too, and the wheel's RECORD stays valid.
    assert result.path.parent == tmp_path / "dist" and result.mode == "full"
    verify_wheel(result.path, full=True)
    assert prov.read_wheel(result.path) == result.provenance
    doc = result.provenance.as_dict()
    build = doc["build"]
    assert build["mode"] == "full" and build["mode_reason"].startswith("1 patch(es) change compiled sources")
    assert build["base_wheel"] is None and build["env"]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert build["env"]["VLLM_VERSION_OVERRIDE"] == manifest.version
    assert "VLLM_CUTLASS_SRC_DIR" not in build["env"]  # host paths stay out of provenance
    assert [p["name"] for p in doc["patches"]] == [p.name for p, _ in patched.commits]
