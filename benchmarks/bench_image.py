"""Benchmark: the other platform's fast image (aarch64 on x86_64) built under qemu, cold and warm.

    python benchmarks/bench_image.py [--wheel AARCH64_WHEEL] [--base-tarball ROOTFS.tar.gz] [--platform aarch64]

Cold: make the other platform's Debian bookworm minbase (python3, pip) exactly as the test tier does
(tests/test_image.py `_base_tarball`: debootstrap's first stage, the packages unpacked natively, python3 proven under
qemu; debootstrap's full second stage under qemu took 1186 s on this project's loaded 2-core machine), in a fresh
cache, import it into a fresh podman store and build the fast image from the wheel (`vllm-dflash image --platform
aarch64`). Warm: the same build again with the base in the store (the test tier's case once the base tarball is
cached). Prints each phase's wall time and the ratios to the goals: the cold total should add little to the full
tier's 60-minute cold budget (goal here: 10 min), a warm build 5 min. Never fails on time; needs root, podman,
debootstrap and a qemu binfmt_misc handler with flag F (scripts/test registers one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
COLD_GOAL_S = 600.0
WARM_GOAL_S = 300.0
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def _timed(cmd: list[str], **kw: object) -> tuple[float, subprocess.CompletedProcess[str]]:
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, text=True, check=False, **kw)  # type: ignore[call-overload]
    if res.returncode != 0:
        sys.exit(f"error: {cmd[0]} failed (exit {res.returncode}) -- see its output above")
    return time.perf_counter() - t0, res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", default="aarch64", choices=sorted(DEBIAN_ARCH))
    ap.add_argument("--wheel", type=Path, default=None, help="that platform's wheel (default: build it)")
    ap.add_argument("--base-tarball", type=Path, default=None, help="a debootstrapped rootfs tarball (skip cold)")
    args = ap.parse_args()
    cli = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO)]
    work = Path(tempfile.mkdtemp(prefix="bench-image-", dir="/var/tmp"))
    times: dict[str, float] = {}
    try:
        wheel = args.wheel
        if wheel is None:
            times["wheel_build_s"], _ = _timed(
                [*cli, "build", "--platform", args.platform, "--out", str(work / "dist")]
            )
            wheel = next((work / "dist").glob("vllm-*.whl"))
        tarball = args.base_tarball
        if tarball is None:
            os.environ["VLLM_DFLASH_CACHE"] = str(work / "cache")  # cold: no cached base
            from test_image import _base_tarball

            t0 = time.perf_counter()
            tarball = _base_tarball(DEBIAN_ARCH[args.platform])
            times["base_s"] = time.perf_counter() - t0
        store = work / "store"
        podman = ["podman", "--root", str(store / "root"), "--runroot", str(store / "run"), "--storage-driver", "vfs"]
        base = f"localhost/bench-base:{args.platform}"
        imp = [*podman, "import", "--arch", DEBIAN_ARCH[args.platform], str(tarball), base]
        times["import_s"], _ = _timed(imp, capture_output=True)
        image = [*cli, "image", "--platform", args.platform, "--wheel", str(wheel), "--tool", "podman"]
        image += ["--storage-root", str(store), "--storage-driver", "vfs", "--isolation", "chroot"]
        image += ["--base-image", base, "--tag", "localhost/bench-image"]
        times["image_cold_s"], _ = _timed(image, stdout=subprocess.DEVNULL)
        times["image_warm_s"], _ = _timed(image, stdout=subprocess.DEVNULL)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    cold = sum(v for k, v in times.items() if k in ("base_s", "import_s", "image_cold_s"))
    print(json.dumps({k: round(v, 1) for k, v in times.items()}, indent=2))
    if "base_s" in times:
        print(
            f"cold {args.platform} base + image: {cold:.0f} s, ratio to the {COLD_GOAL_S:.0f} s goal "
            f"{cold / COLD_GOAL_S:.2f}"
        )
    warm = times["image_warm_s"]
    print(
        f"warm {args.platform} image build: {warm:.0f} s, "
        f"ratio to the {WARM_GOAL_S:.0f} s goal {warm / WARM_GOAL_S:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
