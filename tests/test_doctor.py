"""The drafter doctor (issue 21): this build's resolution is patch 0002's code, every shipped public checkpoint gets
its verdict, the README table is the doctor's output, and --prove runs tiny twins through conformance (heavy)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash.cli import main
from vllm_dflash.conformance import cases as C
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import ours, prove, table
from vllm_dflash.doctor.checkpoint import Checkpoint, read_checkpoint
from vllm_dflash.errors import CheckpointError, PatchError
from vllm_dflash.manifest import Manifest

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"

# Every shipped checkpoint and the verdict the doctor must give it (the table's claims, one by one).
EXPECTED = {
    "z-lab--Qwen3.6-27B-DFlash": D.STOCK_MISSERVES,
    "z-lab--Qwen3.6-35B-A3B-DFlash": D.STOCK_MISSERVES,
    "z-lab--Qwen3.5-27B-DFlash": "undetermined",
    "z-lab--Qwen3.5-9B-DFlash": "undetermined",
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-04": D.SERVED,
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-06": D.STOCK_MISSERVES,
    "z-lab--Qwen3-8B-DFlash-b16": D.STOCK_MISSERVES,
    "z-lab--gemma-4-31B-it-DFlash": "undetermined",
    "XiaomiMiMo--MiMo-V2.5-Pro-FP4-DFlash": D.NOT_RUNNABLE,
    "nemotron-dflash": "undetermined",
    "z-lab-dflash-tests--dflash2-config": D.NOT_RUNNABLE,
    "incoai--Qwen3.8-27B-DFlash2": D.NOT_RUNNABLE,
}


@pytest.fixture(scope="module")
def code() -> ours.OurCode:
    return ours.from_patches(PATCHES)


def entry(key: str) -> table.Entry:
    return next(e for e in table.load_entries() if e.key == key)


def q36() -> dict[str, Any]:
    return json.loads(json.dumps(entry("z-lab--Qwen3.6-27B-DFlash").checkpoint.config))


def write_dir(tmp: Path, cfg: dict[str, Any], *extra: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    for name in extra:
        (tmp / name).write_bytes(b"\0" * 16)
    return tmp


# ---- this build's resolution is the patch's own code --------------------------------------------------------------


def test_resolution_runs_from_the_patch_text(code: ours.OurCode) -> None:
    assert code.resolve.__code__.co_filename == "patches/0002-dflash-sliding-window-layers.patch"
    assert code.exact_window_backends == ("FLASH_ATTN", "CPU_ATTN")
    assert code.taps({"target_layer_ids": [1, 16]}) == [2, 17]  # patch 0001's expression


def test_an_edited_patch_changes_the_doctor(tmp_path: Path, code: ours.OurCode) -> None:
    """Negative control for "no second copy": change the patch text and the doctor's reading changes with it."""
    shutil.copytree(PATCHES, tmp_path / "patches")
    p = tmp_path / "patches" / ours.WINDOWS_PATCH
    text = p.read_text()
    assert 'window = dflash_config["swa_window_size"]' in text
    p.write_text(
        text.replace('window = dflash_config["swa_window_size"]', 'window = dflash_config["swa_window_size"] + 1')
    )
    cfg = {**q36(), "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61], "swa_window_size": 512}}
    ck = Checkpoint("t", cfg)
    edited = D.diagnose(ck, ours.from_patches(tmp_path / "patches"))
    plain = D.diagnose(ck, code)
    windows = lambda d: {r.window for r in d.rows if r.build == "this build"}  # noqa: E731
    assert windows(plain) == {512, None} and windows(edited) == {513, None}
    p.write_text(text.replace("def resolve_dflash_layer_attention(", "def resolve_renamed("))
    with pytest.raises(PatchError, match="resolve_dflash_layer_attention"):
        ours.from_patches(tmp_path / "patches")


def test_patch_and_patched_tree_give_the_same_code(work_tree, code: ours.OurCode) -> None:  # type: ignore[no-untyped-def]
    """The code extracted from the patch's added lines is the code of the patched 0.20.1 tree, and the unpatched
    tree has none (negative control)."""
    model = work_tree.path / ours.MODEL_FILE
    with pytest.raises(PatchError):
        ours.from_model_file(model)
    for name in ("0001-dflash-target-layer-taps.patch", ours.WINDOWS_PATCH):
        subprocess.run(["git", "-C", str(work_tree.path), "apply", str(PATCHES / name)], check=True)
    from_tree = ours.from_model_file(model)
    assert from_tree.fingerprint() == code.fingerprint()
    assert from_tree.taps({"target_layer_ids": [1, 61]}) == [2, 62]
    d1 = D.diagnose(entry("z-lab--Qwen3.6-27B-DFlash").checkpoint, code)
    d2 = D.diagnose(entry("z-lab--Qwen3.6-27B-DFlash").checkpoint, from_tree)
    assert [r for r in d1.rows if r.build == "this build"] == [r for r in d2.rows if r.build == "this build"]


# ---- the must-show diagnoses ---------------------------------------------------------------------------------------


def test_qwen36_27b_ours_as_trained_stock_taps_and_four_windows(code: ours.OurCode) -> None:
    d = table.diagnose_entry(entry("z-lab--Qwen3.6-27B-DFlash"), code)
    assert d.verdict_class == D.STOCK_MISSERVES and d.exit_code == 20
    mine = [r for r in d.rows if r.build == "this build"]
    assert [(r.window, r.causal, r.backend_window) for r in mine] == [(2048, True, (2047, 0))] * 4 + [
        (None, False, (-1, -1))
    ]
    assert "transformers dropped it" in (mine[0].window_from or "")
    assert d.stock_wrong == {"taps": [0, 1, 2, 3, 4], "windows": [0, 1, 2, 3]}
    assert d.taps.ours_aux == [2, 17, 32, 47, 62] and d.taps.stock_aux == [1, 16, 31, 46, 61]
    assert "upstream 0.33" in d.refusals and "window size" in d.refusals["upstream 0.33"]
    ref = [r for r in d.rows if r.build == "reference 0.1.0"]
    assert [r.window for r in ref] == [None] * 5  # the reference runs the dropped window unwindowed
    text = D.render_text(d)
    assert "verdict: served as trained by this build; stock mis-serves it: taps (5 of 5" in text


def test_dflash2_is_not_runnable_and_says_who_can(code: ours.OurCode) -> None:
    d = table.diagnose_entry(entry("z-lab-dflash-tests--dflash2-config"), code)
    assert d.verdict_class == D.NOT_RUNNABLE and d.exit_code == 22
    assert "DFlash2DraftModel is not registered in vLLM 0.20.1" in d.verdict and "#52816" in d.verdict
    assert any("selector_top_k" in x for x in d.ignored) and "stock 0.20.1" in d.refusals
    # the same config as a plain DFlashDraftModel without DFlash2's fields: runnable (the reason was the features)
    cfg = dict(entry("z-lab-dflash-tests--dflash2-config").checkpoint.config)
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dflash_config"] = {
        k: v for k, v in cfg["dflash_config"].items() if k in ("block_size", "mask_token_id", "target_layer_ids")
    }
    d2 = D.diagnose(Checkpoint("plain", cfg), code)
    assert d2.verdict_class == D.STOCK_MISSERVES
    assert {(r.window, r.causal) for r in d2.rows if r.build == "this build"} == {(2048, False)}  # is_causal: false


def test_top_level_ids_refused_with_the_patch_line(tmp_path: Path, code: ours.OurCode) -> None:
    cfg = q36()
    cfg["target_layer_ids"] = cfg["dflash_config"].pop("target_layer_ids")
    d = D.diagnose(Checkpoint("top", cfg), code)
    assert d.verdict_class == D.REFUSED and d.exit_code == 21
    assert "target_layer_ids is given only at the top level" in d.verdict
    # valid twin: the same ids in dflash_config
    assert D.diagnose(Checkpoint("ok", q36()), code).verdict_class == D.STOCK_MISSERVES


def test_sliding_without_window_refused(code: ours.OurCode) -> None:
    cfg = q36()
    del cfg["sliding_window"]
    d = D.diagnose(Checkpoint("nowin", cfg), code)
    assert d.verdict_class == D.REFUSED and "has no positive window" in d.verdict
    cfg["dflash_config"]["swa_window_size"] = 1024
    d = D.diagnose(Checkpoint("win", cfg), code)
    assert d.verdict_class == D.STOCK_MISSERVES
    assert {r.window_from for r in d.rows if r.build == "this build" and r.window} == {"dflash_config.swa_window_size"}


def test_stock_serves_a_speculators_checkpoint(tmp_path: Path, code: ours.OurCode) -> None:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [2, 10],
        "mask_token_id": 7,
        "transformer_layer_config": {"model_type": "qwen3", "num_hidden_layers": 2, "num_target_layers": 12},
    }
    d = D.diagnose(read_checkpoint(write_dir(tmp_path / "s", cfg)), code)
    assert d.taps.dflash_ids == [1, 9] and d.taps.ours_aux == d.taps.stock_aux == [2, 10]
    assert d.verdict_class == D.SERVED and d.exit_code == 0


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_every_shipped_checkpoint_gets_its_verdict(key: str, code: ours.OurCode) -> None:
    e = entry(key)
    d = table.diagnose_entry(e, code)
    got = "undetermined" if table.undetermined(e, d) else d.verdict_class
    assert got == EXPECTED[key], d.verdict
    assert e.sources, "every entry names its sources"


def test_table_has_the_required_checkpoints() -> None:
    keys = {e.key for e in table.load_entries()}
    assert keys == set(EXPECTED) and len(keys) >= 10


def test_readme_table_is_the_doctors_output(code: ours.OurCode) -> None:
    readme = (REPO / "README.md").read_text()
    generated = table.render_table(code)
    assert table.replace_table(readme, generated) == readme, "README table is stale: run vllm-dflash doctor --table"
    # negative control: a hand edit of one cell is caught
    edited = readme.replace("| z-lab/Qwen3.6-27B-DFlash | mis-serves", "| z-lab/Qwen3.6-27B-DFlash | serves", 1)
    assert edited != readme and table.replace_table(edited, generated) != edited


# ---- reading checkpoints offline -----------------------------------------------------------------------------------


def test_extra_weights_and_sinks_are_named(tmp_path: Path, code: ours.OurCode) -> None:
    cfg = {**q36(), "dflash_config": {**q36()["dflash_config"], "has_embed_tokens": False}}
    clean = read_checkpoint(write_dir(tmp_path / "clean", cfg))
    d = D.diagnose(clean, code)
    assert d.verdict_class == D.STOCK_MISSERVES and any("has_embed_tokens" in x for x in d.ignored)
    mimo = read_checkpoint(write_dir(tmp_path / "mimo", cfg, "mask_embedding.pt"))
    d = D.diagnose(mimo, code)
    assert d.verdict_class == D.NOT_RUNNABLE and "mask_embedding.pt" in d.verdict
    sink = write_dir(tmp_path / "sink", cfg)
    header = json.dumps(
        {"layers.0.self_attn.attention_sink_bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    )
    (sink / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 8)
    d = D.diagnose(read_checkpoint(sink), code)
    assert d.verdict_class == D.NOT_RUNNABLE and "attention sinks" in d.verdict


def test_cli_reads_an_hf_cache_snapshot_and_exits_per_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    write_dir(repo / "snapshots" / "abc123", q36())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    assert main(["--root", str(REPO), "doctor", str(repo), "--json", str(tmp_path / "d.json")]) == 20
    out = capsys.readouterr().out
    assert "verdict: served as trained by this build; stock mis-serves it" in out
    assert json.loads((tmp_path / "d.json").read_text())["exit_code"] == 20
    target = write_dir(tmp_path / "target", {"text_config": {"num_hidden_layers": 48}})
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target)]) == 18  # id 61 >= 48 layers
    assert "outside the target's 48 layers" in capsys.readouterr().err
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"num_hidden_layers": 64}}
    target.joinpath("config.json").write_text(json.dumps(cfg))
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target)]) == 20
    assert "target: 64 layers (text_config.num_hidden_layers" in capsys.readouterr().out
    # a target whose 0.20.1 model records no aux hidden states (Nemotron-H): not runnable, whatever the drafter
    target.joinpath("config.json").write_text(json.dumps({**cfg, "architectures": ["NemotronHForCausalLM"]}))
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target)]) == 22
    assert "records no auxiliary hidden states in vLLM 0.20.1" in capsys.readouterr().out


def test_cli_reads_a_shipped_table_entry_as_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An entry of doctor/checkpoints/ given as the path is diagnosed as the config it reconstructs (not as a config
    without an architecture); the control is the same config written out as a config.json."""
    shipped = table.checkpoints_dir() / "z-lab--Qwen3.6-27B-DFlash.json"
    assert main(["--root", str(REPO), "doctor", str(shipped)]) == 20
    from_entry = capsys.readouterr().out.split("verdict: ", 1)[1]
    plain = tmp_path / "config.json"
    plain.write_text(json.dumps(json.loads(shipped.read_text())["config"]))
    assert main(["--root", str(REPO), "doctor", str(plain)]) == 20
    assert capsys.readouterr().out.split("verdict: ", 1)[1] == from_entry


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"])
def test_cli_unreadable_checkpoint_is_one_line(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_text(content)
    assert main(["--root", str(REPO), "doctor", str(d)]) == 18
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and " -- " in err[0]


# ---- --prove: the tiny twin ----------------------------------------------------------------------------------------


def test_twin_keeps_the_shape(code: ours.OurCode) -> None:
    d = table.diagnose_entry(entry("z-lab--Qwen3.6-27B-DFlash"), code)
    spec, _ = prove.twin_spec(entry("z-lab--Qwen3.6-27B-DFlash").checkpoint, d)
    assert spec.layer_types == (C.SLIDING,) * 4 + (C.FULL,) and spec.block_size == 16
    assert spec.window_spelling == "dropped" and spec.sliding_window == 24 and min(spec.prompt_lengths) > 24
    assert spec.target_layer_ids == (1, 16, 31, 46, 61) and spec.target_layers == 64
    assert spec.expect_stock == "fail" and C.NEG_FULL_ATTN in spec.negatives and C.NEG_TAP_INPUT in spec.negatives
    assert spec.attention == ((24, True),) * 4 + ((None, False),)
    d8 = table.diagnose_entry(entry("z-lab--Qwen3-8B-DFlash-b16"), code)
    spec8, _ = prove.twin_spec(entry("z-lab--Qwen3-8B-DFlash-b16").checkpoint, d8)
    assert spec8.target_layers == 36 and spec8.sliding_window is None and spec8.expect_stock == "fail"
    with pytest.raises(Exception, match="cannot be proven"):
        dd = table.diagnose_entry(entry("z-lab-dflash-tests--dflash2-config"), code)
        prove.twin_spec(entry("z-lab-dflash-tests--dflash2-config").checkpoint, dd)


def test_extra_cases_run_by_spec_not_by_name(tmp_path: Path) -> None:
    """A twin is not a table case: the table refuses its name, and conformance runs it from the spec alone (its
    case.json carries the negatives the oracle needs, so no side process looks it up by name)."""
    from vllm_dflash.conformance import compare

    spec = C.CaseSpec(name="prove-x", summary="x", layer_types=(C.FULL,), target_layer_ids=(1,), negatives=("n",))
    with pytest.raises(ValueError):
        C.get_cases(["prove-x"])
    assert compare.selected_specs(compare.ConformanceOptions(extra_cases=(spec,))) == (spec,)
    mixed = C.get_cases(["mixed"])
    assert compare.selected_specs(compare.ConformanceOptions(cases=("mixed",), extra_cases=(spec,))) == (*mixed, spec)
    assert compare.selected_specs(compare.ConformanceOptions()) == C.CASES


@pytest.mark.heavy
@pytest.mark.parametrize("key", ["z-lab--Qwen3.6-27B-DFlash"])
def test_prove_public_shapes(key: str, manifest: Manifest, code: ours.OurCode) -> None:
    """The twin through conformance: this build passes, stock fails exactly where the table says it mis-serves.
    The product's own drafter here (windows and taps); the other public shape (Qwen3-8B-DFlash-b16, taps only) is
    proven by benchmarks/bench_doctor_prove.py, which also times both."""
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    e = entry(key)
    d = table.diagnose_entry(e, code)
    result = prove.prove(manifest, queues, e.checkpoint, d)
    prove.render_prove(result)
    by = {o.build: o for o in result.conformance.outcomes}
    assert by["patched"].status == "pass" and by["patched"].as_expected
    assert by["stock"].status == "fail" and result.stock_as_predicted and result.ok


def test_aux_target_list_is_the_0201_trees(sdist_tree) -> None:  # type: ignore[no-untyped-def]
    """rules.AUX_TARGETS_0_20_1 is what the 0.20.1 sources say: registry architectures whose class implements
    SupportsEagle3 (derived here independently, from the tree)."""
    import ast as _ast

    from vllm_dflash.doctor import rules

    models = sdist_tree.path / "vllm/model_executor/models"
    bases: dict[str, set[str]] = {}
    for f in models.glob("*.py"):
        for n in _ast.parse(f.read_text()).body:
            if isinstance(n, _ast.ClassDef):
                bases.setdefault(n.name, set()).update(_ast.unparse(b).split(".")[-1].split("[")[0] for b in n.bases)
    eagle = {"SupportsEagle3"}
    while grown := {n for n, bs in bases.items() if n not in eagle and bs & eagle}:
        eagle |= grown
    registry: dict[str, str] = {}
    for node in _ast.walk(_ast.parse((models / "registry.py").read_text())):
        if isinstance(node, _ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, _ast.Constant) and isinstance(v, _ast.Tuple) and len(v.elts) == 2:
                    if all(isinstance(e, _ast.Constant) for e in v.elts):
                        registry[str(k.value)] = str(v.elts[1].value)  # type: ignore[attr-defined]
    supported = {a for a, c in registry.items() if c in eagle}
    assert set(rules.AUX_TARGETS_0_20_1) <= supported
    assert "NemotronHForCausalLM" in registry and "NemotronHForCausalLM" not in supported  # the negative case
    assert {"Qwen3ForCausalLM", "Qwen3_5ForConditionalGeneration", "Gemma4ForConditionalGeneration"} <= supported


# ---- --context: the drafter's KV cache per sequence, with vLLM's own KV-cache specs ------------------------------

# A Qwen3.6-27B-shaped target (the shape public copies of its config give): 48 linear-attention (Gated DeltaNet) and
# 16 full-attention layers, every fourth, with 4 KV heads of 256.
Q36_TARGET = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {
        "num_hidden_layers": 64,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
    },
}


def test_context_reads_the_drafter_and_target_shapes(code: ours.OurCode) -> None:
    from vllm_dflash.doctor import kvcache

    e = entry("z-lab--Qwen3.6-27B-DFlash")
    d = table.diagnose_entry(e, code)
    layers = kvcache.drafter_layers(e.checkpoint, d)
    # this build's windows: patch 0002's resolution, as the doctor's "this build" rows say
    assert layers == [{"num_kv_heads": 8, "head_dim": 128, "window": 2048}] * 4 + [
        {"num_kv_heads": 8, "head_dim": 128, "window": None}
    ]
    target, note = kvcache.target_layers(Q36_TARGET)
    assert target == [{"num_kv_heads": 4, "head_dim": 256, "window": None}] * 16
    assert note.startswith("48 linear_attention layer(s) not counted")
    # a sliding target layer keeps a SlidingWindowSpec; no layer_types: every layer full
    gemma = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512,
             "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
    assert [x["window"] for x in kvcache.target_layers(gemma)[0]] == [512, None]
    assert (
        kvcache.target_layers({"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4})[0]
        == [{"num_kv_heads": 4, "head_dim": 16, "window": None}] * 3
    )
    with pytest.raises(CheckpointError, match="gives no num_key_value_heads / head_dim"):
        kvcache.drafter_layers(Checkpoint("x", {"num_hidden_layers": 2}), d)


def test_context_without_heads_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = q36()
    for key in ("num_key_value_heads", "head_dim", "hidden_size", "num_attention_heads"):
        cfg.pop(key)
    code = main(["--root", str(REPO), "doctor", str(write_dir(tmp_path / "d", cfg)), "--context", "1024"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == CheckpointError.return_code and len(err) == 1 and err[0].startswith("error: the drafter config")


@pytest.mark.heavy
@pytest.mark.slow
def test_context_sizes_the_kv_cache_with_vllms_own_specs(tmp_path: Path) -> None:
    """`doctor --context` on Qwen3.6-27B-DFlash's shape (bf16) and its target: the bytes come from vLLM's spec classes
    in this build's CPU environment; checked here against the page arithmetic (16-token blocks, 8 KV heads of 128, K
    and V, 2 bytes): stock keeps 5 full layers, this build 1 full layer plus 4 sliding layers of window 2048 + 15
    drafted tokens with one 2048-token prefill chunk (SlidingWindowSpec's admission bound), whatever the context."""
    (tmp_path / "target.json").write_text(json.dumps(Q36_TARGET))
    out = tmp_path / "d.json"
    ck = REPO / "vllm_dflash" / "doctor" / "checkpoints" / "z-lab--Qwen3.6-27B-DFlash.json"
    args = ["doctor", str(ck), "--target", str(tmp_path / "target.json"), "--context", "131072", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), *args], capture_output=True, text=True, check=False
    )
    assert run.returncode == 20, run.stderr[-2000:]  # the verdict's exit code, unchanged by --context
    kv = json.loads(out.read_text())["kv_cache"]
    page = 16 * 8 * 128 * 2 * 2
    full = 131072 // 16 * page
    sliding = (-(-(2048 + 15 - 1 + 2048) // 16) + 1) * page
    assert kv["per_sequence_bytes"] == {
        "this_build": full + 4 * sliding,
        "stock": 5 * full,
        "target": 16 * (131072 // 16) * (16 * 4 * 256 * 2 * 2),
    }
    assert [x["spec"] for x in kv["this_build"]] == ["SlidingWindowSpec"] * 4 + ["FullAttentionSpec"]
    assert {x["window"] for x in kv["this_build"][:4]} == {2048 + 15}
    # vLLM's own KV-cache config code over the whole model's groups (no padding for this shape: every page is 64 KiB)
    assert kv["reserved_bytes"] == {
        "this_build": kv["per_sequence_bytes"]["this_build"] + kv["per_sequence_bytes"]["target"],
        "stock": kv["per_sequence_bytes"]["stock"] + kv["per_sequence_bytes"]["target"],
    }
    assert "this build keeps 22.5% of stock's drafter KV cache" in run.stdout
    assert "drafter share, stock 0.20.1: 23.8% of target + drafter" in run.stdout
