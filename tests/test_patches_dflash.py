"""The DFlash patch queue itself: real `git format-patch` files with DEP-3 headers that apply exactly to the real
vLLM 0.20.1 sdist tree, Python-only, and whose upstream status is what their headers claim (the tap fix
is judged already upstream on 0.22.0 (by content + Drop-When); the sliding-window patches are not).

What the patches DO is proven by the CPU conformance test (tests/test_conformance.py) against the authors'
reference, with stock 0.20.1 as the negative control.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.patches import PatchState, check_patch, check_series
from vllm_dflash.series import Patch, read_queue

REQUIRED_DEP3 = ("Description", "Origin", "Forwarded", "Applied-Upstream", "Bug", "Last-Update", "Drop-When")
TAP = "0001-dflash-target-layer-taps.patch"
SWA = "0002-dflash-sliding-window-layers.patch"
CPU = "0003-cpu-attn-causal-window.patch"


@pytest.fixture(scope="module")
def queue(manifest: Manifest) -> dict[str, Patch]:
    return {p.name: p for p in read_queue(manifest.series_path, missing_ok=False).patches}


@pytest.fixture(scope="module")
def tree_0220(manifest: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real vLLM 0.22.0 sdist tree (hash-pinned in dist.toml [releases]), as a git repo."""
    from vllm_dflash.pipeline.source import release_tree

    rel = manifest.releases["0.22.0"]
    return release_tree("0.22.0", rel.sdist, rel.commit, tmp_path_factory.mktemp("rel") / "vllm-0.22.0").path


def test_series_order_and_files(queue: dict[str, Patch]) -> None:
    assert list(queue) == [TAP, SWA, CPU]
    assert set(queue[TAP].files) == {
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/transformers_utils/configs/speculators/algos.py",
    }
    assert set(queue[SWA].files) == {"vllm/model_executor/models/qwen3_dflash.py"}
    assert set(queue[CPU].files) == {
        "vllm/v1/attention/backends/cpu_attn.py",
        "vllm/model_executor/models/qwen3_dflash.py",
    }


@pytest.mark.parametrize("name", [TAP, SWA, CPU])
def test_patch_is_format_patch_with_dep3_headers(queue: dict[str, Patch], name: str) -> None:
    patch = queue[name]
    text = patch.path.read_text()
    assert re.match(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001\n", text), "not `git format-patch` output"
    assert re.search(r"^Subject: \[PATCH\] ", text, re.M)
    missing = [k for k in REQUIRED_DEP3 if not patch.headers.get(k)]
    assert not missing, f"{name} lacks DEP-3 headers {missing}"
    assert patch.headers["Description"] == patch.subject
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", patch.headers["Last-Update"])
    assert patch.python_only
    assert all(f.startswith("vllm/") and f.endswith(".py") for f in patch.files)


def test_headers_record_upstream_status(queue: dict[str, Patch]) -> None:
    tap, swa = queue[TAP].headers, queue[SWA].headers
    assert "#40727" in tap["Drop-When"] and "0.22.0" in tap["Drop-When"]
    assert "0.22.0" in tap["Applied-Upstream"]
    # #40898 was never merged; upstream: all-sliding from 0.25.0 (#46104), mixed on the V2 runner from 0.26.0 (#47914).
    assert "40898" in swa["Bug"] and "unmerged" in swa["Applied-Upstream"]
    for needle in ("#46104", "0.25.0", "#47914", "0.26.0"):
        assert needle in swa["Applied-Upstream"] + swa["Drop-When"], needle
    assert "0.24.0" in queue[CPU].headers["Drop-When"]


@pytest.mark.slow
def test_queue_applies_exactly_on_0201_sdist(sdist_tree, queue: dict[str, Patch]) -> None:  # type: ignore[no-untyped-def]
    checks = check_series(sdist_tree.path, list(queue.values()), ref=sdist_tree.base)
    assert [c.state for c in checks] == [PatchState.APPLIES] * 3, [(c.patch.name, c.failures) for c in checks]


@pytest.mark.slow
def test_each_patch_detected_as_applied_on_its_own_result(work_tree, queue: dict[str, Patch]) -> None:  # type: ignore[no-untyped-def]
    """Negative control for the 0.22.0 check: on a tree that already has the queue, every patch reads 'already
    upstream', so 'applies' on 0.20.1 and 'already upstream' on 0.22.0 are real distinctions."""
    root = str(work_tree.path)
    for p in queue.values():  # in series order; later patches touch lines near earlier ones
        assert check_patch(work_tree.path, p).state is PatchState.APPLIES, p.name
        subprocess.run(["git", "-C", root, "apply", "--whitespace=nowarn", str(p.path)], check=True)
        subprocess.run(["git", "-C", root, "add", "-A"], check=True)
        subprocess.run(
            ["git", "-C", root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", p.name], check=True
        )
        assert check_patch(work_tree.path, p).state is PatchState.ALREADY_UPSTREAM, p.name


@pytest.mark.slow
def test_tap_patch_is_upstream_in_0220(manifest: Manifest, tree_0220: Path, queue: dict[str, Patch]) -> None:
    from vllm_dflash.upstream import Status, analyse, release_target

    # Upstream's comment above the runner change differs from ours, so a reverse-apply alone cannot see the fix;
    # the upstream stage finds it by content (our code lines present, the replaced ones gone) plus Drop-When.
    assert check_patch(tree_0220, queue[TAP]).state is PatchState.CONFLICTS
    verdicts = {v.patch: v for v in analyse(manifest, release_target(manifest, "0.22.0")).verdicts}
    assert verdicts[TAP].status is Status.UPSTREAM, verdicts[TAP]
    assert "content" in verdicts[TAP].evidence and "Drop-When v0.22.0" in verdicts[TAP].evidence
    assert verdicts[SWA].status is Status.CONFLICTS, verdicts[SWA]
    # The sliding-window patches are not upstream in 0.22.0 (and no longer apply there).
    for name in (SWA, CPU):
        assert check_patch(tree_0220, queue[name]).state is PatchState.CONFLICTS, name


@pytest.mark.slow
def test_patched_sources_compile_and_carry_the_fix(work_tree, queue: dict[str, Patch]) -> None:  # type: ignore[no-untyped-def]
    """The patched files are valid Python, and the changes are where the patches say (not just any diff)."""
    import py_compile

    root = work_tree.path
    runner = (root / "vllm/v1/worker/gpu_model_runner.py").read_text()
    assert "i + 1 for i in" not in runner  # negative control: stock 0.20.1 taps the input of layer L
    for p in queue.values():
        subprocess.run(["git", "-C", str(root), "apply", "--whitespace=nowarn", str(p.path)], check=True)
    for f in {f for p in queue.values() for f in p.files}:
        py_compile.compile(str(root / f), doraise=True)
    runner = (root / "vllm/v1/worker/gpu_model_runner.py").read_text()
    assert 'i + 1 for i in (dflash_config.get("target_layer_ids") or [])' in runner
    algos = (root / "vllm/transformers_utils/configs/speculators/algos.py").read_text()
    assert '"target_layer_ids": [i - 1 for i in aux_layer_ids]' in algos
    model = (root / "vllm/model_executor/models/qwen3_dflash.py").read_text()
    assert "per_layer_sliding_window=sliding_window" in model
    assert "self.attn.sliding_window = None" in model  # KV spec stays full: one KV-cache group
    assert '_DFLASH_SWA_WRONG_BACKENDS = {"FLEX_ATTENTION"}' in model
    cpu = (root / "vllm/v1/attention/backends/cpu_attn.py").read_text()
    assert "causal = True" in cpu and "_window_is_causal" in cpu
