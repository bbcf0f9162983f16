"""Release directories: per-platform wheels with SHA256SUMS, CycloneDX SBOMs, in-toto/SLSA provenance statements,
optional DSSE signatures, release notes and the validation reports that name the wheels.

Plain functions for the CLI and publish (no argument parsing here):
    make_release(manifest, wheels, out_dir, ReleaseOptions(...)) -> Release
    verify(path, VerifyOptions(...)) -> VerifyResult                    (VerifyError, exit 17, one line)
    release_notes(wheels, source, reports, images, signed_by, index_url) -> str
The layout is documented in `layout.py`.
"""

from __future__ import annotations

from vllm_dflash.release.dsse import write_keypair
from vllm_dflash.release.facts import SourceMaterial, WheelFacts, read_facts, source_material
from vllm_dflash.release.make import Release, ReleasedWheel, ReleaseOptions, make_release
from vllm_dflash.release.notes import AttachedReport, ImageRef, release_notes
from vllm_dflash.release.verify import VerifiedReport, VerifiedWheel, VerifyOptions, VerifyResult, verify

__all__ = [
    "AttachedReport",
    "ImageRef",
    "Release",
    "ReleaseOptions",
    "ReleasedWheel",
    "SourceMaterial",
    "VerifiedReport",
    "VerifiedWheel",
    "VerifyOptions",
    "VerifyResult",
    "WheelFacts",
    "make_release",
    "read_facts",
    "release_notes",
    "source_material",
    "verify",
    "write_keypair",
]
