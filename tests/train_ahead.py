"""Test-only: make the reference environment, train the miniatures (the Qwen3 one, then the hybrid one of profile
mini-cpu-hybrid when its loop is warmed) and run the reference loop on the miniature profiles' prompts (the cache's,
as every test then finds them).

conftest.py starts this in the background when a selected test needs the miniature. Its training runs on one
thread, so on two cores it overlaps the tests that come before the miniature's (downloads, builds, git, images)
instead of adding its ~18 minutes after them. ensure_mini_models holds a file lock while it trains: the test that
needs the models waits on it, and trains itself if this process died.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_dflash.envs import reference_python
from vllm_dflash.manifest import load_manifest
from vllm_dflash.mini import host
from vllm_dflash.validate import miniature


def main() -> int:
    manifest = load_manifest(Path(__file__).resolve().parents[1])
    print(f"miniature ready: {host.ensure_mini_models(reference_python(manifest))}", flush=True)
    # The reference loop's results on the miniature profiles' prompts, cached as their validations look them up: the
    # loop then runs here, beside the other tests, instead of inside the first validation of each profile.
    for profile in manifest.profiles.values():
        if profile.serve == "cpu-builds":
            print(f"reference loop ready for {profile.name}: {miniature.warm_reference(manifest, profile)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
