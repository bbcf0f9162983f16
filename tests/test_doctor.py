"""The drafter doctor (issues 21, 27, 39): every column is its build's own code, run in its own environment (the
session's `doctor` fixture: one process per column), what a field does decides the verdict (2026's fields measured
by building without them), every input gets its class and no traceback, the shipped table comes from public sources
and is the doctor's output, and --prove checks every claim on a served tiny twin. Errors that come before any column
runs (an unreadable checkpoint) stay in the quick tier."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doctor_configs import SIZES
from doctor_issue39 import published_q36

from vllm_dflash.cli import main
from vllm_dflash.conformance import cases as C
from vllm_dflash.doctor import diagnose as D
from vllm_dflash.doctor import fields, prove, table
from vllm_dflash.doctor.checkpoint import Checkpoint, read_checkpoint
from vllm_dflash.errors import CheckpointError
from vllm_dflash.manifest import Manifest

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
S, F = "sliding_attention", "full_attention"

# Every shipped checkpoint and the verdict the table must give it, whatever the fields no public source gives.
EXPECTED = {
    "z-lab--Qwen3.6-27B-DFlash": D.STOCK_MISSERVES,
    "z-lab--Qwen3.5-27B-DFlash": D.STOCK_MISSERVES,
    "z-lab--Qwen3.5-9B-DFlash": D.STOCK_MISSERVES,
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-04": D.STOCK_MISSERVES,
    "z-lab--Qwen3.5-122B-A10B-DFlash-2026-06": D.STOCK_MISSERVES,
    "z-lab--gemma-4-31B-it-DFlash": D.STOCK_MISSERVES,
    "XiaomiMiMo--MiMo-V2.5-Pro-FP4-DFlash": D.NOT_RUNNABLE,
    "z-lab-dflash-tests--dflash2-config": D.NOT_RUNNABLE,
    "incoai--Qwen3.8-27B-DFlash2": D.NOT_RUNNABLE,
}


def entry(key: str) -> table.Entry:
    return next(e for e in table.load_entries() if e.key == key)


def q36() -> dict[str, Any]:
    """The public Qwen3.6-27B-DFlash shape (the table entry's first completion: ids in dflash_config, the window
    dropped by transformers)."""
    copied: dict[str, Any] = json.loads(json.dumps(table.completions(entry("z-lab--Qwen3.6-27B-DFlash"))[0][1].config))
    return copied


def mwl() -> dict[str, Any]:
    """A drafter whose sliding layers come from max_window_layers (no layer_types: transformers fills them)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": 5,
        "use_sliding_window": True,
        "sliding_window": 2048,
        "max_window_layers": 2,
        "num_target_layers": 64,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61], "block_size": 16},
    }


# A transformer part with every size a speculators-format config's SpeculatorsConfig needs (it fills no defaults).
TINY = {**SIZES, "hidden_act": "silu", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def diag(cfg: dict[str, Any], doctor: Any, **kw: Any) -> D.Diagnosis:
    """The diagnosis through every column's own code (the session's `doctor`: one process per column)."""
    diagnosis: D.Diagnosis = doctor.diagnose(Checkpoint("t", cfg, speculators="speculators_model_type" in cfg), **kw)
    return diagnosis


def mine(d: D.Diagnosis, build: str = "this build") -> list[tuple[str, int | None, bool]]:
    return [(r.kind, r.window, r.causal) for r in d.rows if r.build == build]


def write_dir(tmp: Path, cfg: dict[str, Any], *extra: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    for name in extra:
        (tmp / name).write_bytes(b"\0" * 16)
    return tmp


# ---- the must-show diagnoses ---------------------------------------------------------------------------------------


def test_qwen36_27b_shape_stock_misreads_layers_and_windows_in_plain_words(doctor: Any) -> None:
    d = diag(q36(), doctor)
    assert d.verdict_class == D.STOCK_MISSERVES and d.exit_code == 20
    assert [(r.window, r.causal, r.backend_window) for r in d.rows if r.build == "this build"] == [
        (2048, True, (2047, 0))
    ] * 4 + [(None, False, (-1, -1))]
    assert "transformers dropped it" in (next(r for r in d.rows if r.build == "this build").window_from or "")
    assert d.stock_wrong == {"taps": [0, 1, 2, 3, 4], "windows": [0, 1, 2, 3]}
    assert d.taps.ours_aux == [2, 17, 32, 47, 62] and d.taps.stock_aux == [1, 16, 31, 46, 61]
    for up in ("upstream 0.33.0", "upstream 0.34.0"):  # transformers dropped the window: upstream has none
        assert "window size" in d.refusals[up]
    # The reference cannot even build this config (its default taps need num_target_layers); given one, it runs the
    # sliding layers without the window transformers dropped.
    assert "num_target_layers" in d.refusals["reference 0.1.0"]
    ref = diag({**q36(), "num_target_layers": 64}, doctor)
    assert mine(ref, "reference 0.1.0") == [(S, None, True)] * 4 + [(F, None, False)]
    words = d.verdict + " " + " ".join(d.advice)
    assert "outputs of target layers 0, 15, 30, 45, 60 instead of 1, 16, 31, 46, 61" in d.verdict
    assert "drafter layers 0, 1, 2, 3 lose their sliding window" in d.verdict and "last 2048 tokens" in d.verdict
    assert "install this build's wheel" in words and "FLASH_ATTN" in words and "checks that at start-up" in words
    assert " taps" not in words and "aux" not in words  # no unexplained jargon in what an operator reads
    assert "(exit 20)" in D.render_text(d)


def test_sliding_layers_from_max_window_layers_read_as_transformers_fills_them(doctor: Any) -> None:
    """The issue's --prove hole: no layer_types, sliding from max_window_layers on. Every column reads the layers
    transformers fills (two full, three sliding); the control, the same config without use_sliding_window, is all
    full everywhere (transformers drops the window, so it fills no sliding layer)."""
    d = diag(mwl(), doctor)
    assert mine(d) == [(F, None, False)] * 2 + [(S, 2048, True)] * 3
    assert [r.kind_from for r in d.rows if r.build == "this build"] == [
        f"layer_types[{i}], filled by transformers" for i in range(5)
    ]  # attributed as config.json has it: nothing declared there
    assert "declared" not in " ".join(r.causal_from for r in d.rows)
    assert mine(d, "reference 0.1.0") == [(F, None, False)] * 2 + [(S, 2048, True)] * 3
    for up in ("upstream 0.33.0", "upstream 0.34.0"):
        assert mine(d, up) == [(F, None, False)] * 2 + [(S, 2048, True)] * 3
    assert "V2 runner only" in d.upstream_runner["upstream 0.33.0"]
    assert d.verdict_class == D.STOCK_MISSERVES and d.stock_wrong["windows"] == [2, 3, 4]
    control = diag({**mwl(), "use_sliding_window": False}, doctor)
    assert mine(control) == [(F, None, False)] * 5 and "windows" not in control.stock_wrong


# ---- no traceback, the right class for every input -----------------------------------------------------------------


def test_the_issues_tracebacks_are_verdicts(doctor: Any) -> None:
    llama = {**q36(), "model_type": "llama"}
    llama.pop("layer_types")
    d = diag(llama, doctor)  # LlamaConfig: no layer_types, every layer full in vLLM; the reference loads it as Qwen3
    assert d.verdict_class == D.STOCK_MISSERVES and mine(d) == [(F, None, False)] * 5
    short = {**q36(), "layer_types": [S, S, F]}
    d = diag(short, doctor)
    assert d.verdict_class == D.REFUSED and "every vLLM build refuses to load" in d.verdict
    assert "`num_hidden_layers` (5) must be equal to the number of `layer_types` (3)" in d.verdict
    listed = {**q36(), "dflash_config": [1, 2]}
    d = diag(listed, doctor)
    assert d.verdict_class == D.REFUSED and "TypeError" in d.verdict
    odd = {**q36(), "num_hidden_layers": "5"}
    assert diag(odd, doctor).verdict_class == D.REFUSED
    assert diag(q36(), doctor).verdict_class == D.STOCK_MISSERVES  # the valid config


def test_layer_types_longer_than_the_layers_is_refused_with_transformers_reason(doctor: Any) -> None:
    d = diag({**q36(), "layer_types": [S, S, S, S, F, F]}, doctor)
    assert d.verdict_class == D.REFUSED and d.exit_code == 21
    assert "`num_hidden_layers` (5) must be equal to the number of `layer_types` (6)" in d.verdict
    assert "stock 0.20.1" in d.refusals
    assert "fix that field" in " ".join(d.advice)


@pytest.mark.parametrize(
    ("cfg", "what"),
    [
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36}, "a model"),
        (
            {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"num_hidden_layers": 64}},
            "a model",
        ),
        ({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}, "EAGLE-3"),
        ({"architectures": ["Eagle3LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": [1, 2]}, "EAGLE-3"),
        ({"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama"}, "EAGLE drafter"),
        ({"architectures": ["MedusaModel"], "model_type": "medusa"}, "Medusa"),
        ({"architectures": ["DeepSeekMTPModel"], "model_type": "deepseek_mtp"}, "MTP"),
        ({"speculators_model_type": "eagle3", "transformer_layer_config": {}}, "eagle3"),
    ],
)
def test_not_a_dflash_drafter_has_its_own_line_and_exit(cfg: dict[str, Any], what: str, doctor: Any) -> None:
    d = diag(cfg, doctor)
    assert d.verdict_class == D.NOT_DFLASH and d.exit_code == 24 and what in d.verdict, d.verdict


def test_speculators_format_with_its_default_architecture(doctor: Any) -> None:
    """The speculators library writes architectures ["DFlashSpeculator"]; vLLM 0.20.1's update_dflash maps it to
    DFlashDraftModel, and both builds tap its vLLM-indexed ids right (patch 0001 stores them shifted by -1)."""
    cfg = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_config": {"algorithm": "dflash"},
        "aux_hidden_state_layer_ids": [2, 10],
        "mask_token_id": 7,
        "transformer_layer_config": {"model_type": "qwen3", "num_hidden_layers": 2, "num_target_layers": 12, **TINY},
    }
    d = diag(cfg, doctor)
    assert d.taps.dflash_ids == [1, 9] and d.taps.ours_aux == d.taps.stock_aux == [2, 10]
    assert d.verdict_class == D.SERVED and d.exit_code == 0


# ---- what a field does decides the verdict -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "value", "blocks"),
    [
        ("dflash_config.attention_sink_bias", True, True),  # `True in (False, None, 0, 1.0)` is True in Python
        ("dflash_config.attention_sink_bias", 1, True),
        ("dflash_config.attention_sink_bias", "yes", True),
        ("dflash_config.attention_sink_bias", False, False),
        ("dflash_config.attention_sink_bias", 0, False),
        ("add_swa_attention_sink_bias", True, True),
        ("add_swa_attention_sink_bias", False, False),
        ("dflash_config.attention_value_scale", 0.5, True),
        ("dflash_config.attention_value_scale", 1.0, False),
        ("dflash_config.input_embedding_scale", 2.0, True),
        ("dflash_config.output_multiplier", 0.2, True),
        ("final_logit_softcapping", 20.0, True),
        ("final_logit_softcapping", 0, False),
        ("is_neox_style", False, True),
        ("is_neox_style", True, False),
        ("dflash_config.selector_top_k", 16, True),
    ],
)
def test_an_ignored_field_that_changes_the_computation_is_never_served(
    where: str, value: Any, blocks: bool, doctor: Any
) -> None:
    cfg = q36()
    table._set(cfg, where, value)
    d = diag(cfg, doctor)
    if blocks:
        assert d.verdict_class == D.NOT_RUNNABLE and d.exit_code == 22
        assert where in d.verdict and ("vLLM 0.33.0" in d.verdict or "dflash 0.1.0" in d.verdict)
    else:
        assert d.verdict_class == D.STOCK_MISSERVES and any(where in x for x in d.ignored)


def test_sink_flag_overridden_by_dflash_config_decides_nothing(doctor: Any) -> None:
    cfg = {**q36(), "add_swa_attention_sink_bias": True}
    cfg["dflash_config"] = {**cfg["dflash_config"], "attention_sink_bias": False}
    assert diag(cfg, doctor).verdict_class == D.STOCK_MISSERVES
    cfg["dflash_config"]["attention_sink_bias"] = True
    assert diag(cfg, doctor).verdict_class == D.NOT_RUNNABLE


def test_fields_no_build_reads_get_their_own_exit(doctor: Any) -> None:
    cfg = {**q36(), "has_embed_tokens": False}
    cfg["dflash_config"] = {**cfg["dflash_config"], "mystery_knob": 3}
    d = diag(cfg, doctor)
    assert d.verdict_class == D.UNREAD and d.exit_code == 23
    assert "has_embed_tokens, dflash_config.mystery_knob" in d.verdict and "stock mis-serves it" in d.verdict
    assert diag(q36(), doctor).exit_code == 20  # the control
    assert set(fields.READ_TOP).isdisjoint(fields.HARMLESS_TOP) and set(fields.FEATURES_TOP).isdisjoint(fields.READ_TOP)


def test_published_config_with_auto_map_is_served_by_this_build(doctor: Any) -> None:
    """Every published z-lab config.json carries auto_map (transformers' remote-code pointer, which AutoConfig reads
    and vLLM's loading leaves unused): the verdict is the drafter's, not "read by no build"."""
    d = diag(published_q36(), doctor)
    assert d.exit_code == 20 and d.verdict_class == D.STOCK_MISSERVES, d.verdict
    assert not d.unknown_fields and "auto_map" not in D.render_text(d)
    # transformers' other base-config keys are the loader's too; a key no table names still gets exit 23.
    assert diag({**published_q36(), "id2label": {"0": "a"}, "problem_type": None}, doctor).exit_code == 20
    odd = diag({**published_q36(), "dflash_remote_knob": 1}, doctor)
    assert odd.exit_code == 23 and "dflash_remote_knob" in odd.verdict


def test_extra_weights_and_sink_weights_are_named(tmp_path: Path, doctor: Any) -> None:
    clean = read_checkpoint(write_dir(tmp_path / "clean", q36()))
    assert doctor.diagnose(clean).verdict_class == D.STOCK_MISSERVES
    mimo = read_checkpoint(write_dir(tmp_path / "mimo", q36(), "mask_embedding.pt"))
    d = doctor.diagnose(mimo)
    assert d.verdict_class == D.NOT_RUNNABLE and "mask_embedding.pt" in d.verdict and "vLLM 0.33.0" in d.verdict
    sink = write_dir(tmp_path / "sink", q36())
    header = json.dumps(
        {"layers.0.self_attn.attention_sink_bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    )
    (sink / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 8)
    d = doctor.diagnose(read_checkpoint(sink))
    assert d.verdict_class == D.NOT_RUNNABLE and "attention sinks" in d.verdict


def test_top_level_ids_refused_with_the_patch_line(doctor: Any) -> None:
    cfg = q36()
    cfg["target_layer_ids"] = cfg["dflash_config"].pop("target_layer_ids")
    d = diag(cfg, doctor)
    assert d.verdict_class == D.REFUSED and d.exit_code == 21
    assert "target_layer_ids is given only at the top level" in d.verdict
    assert diag(q36(), doctor).verdict_class == D.STOCK_MISSERVES


def test_sliding_without_window_refused(doctor: Any) -> None:
    cfg = q36()
    del cfg["sliding_window"]
    d = diag(cfg, doctor)
    assert d.verdict_class == D.REFUSED and "has no positive window" in d.verdict
    cfg["dflash_config"]["swa_window_size"] = 1024
    d = diag(cfg, doctor)
    assert d.verdict_class == D.STOCK_MISSERVES
    assert {r.window_from for r in d.rows if r.build == "this build" and r.window} == {"dflash_config.swa_window_size"}


# ---- the command line ---------------------------------------------------------------------------------------------


def test_cli_verdict_and_json_carry_the_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doctor_servers: None
) -> None:
    repo = tmp_path / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    write_dir(repo / "snapshots" / "abc123", q36())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    js = tmp_path / "d.json"
    assert main(["--root", str(REPO), "doctor", str(repo), "--json", str(js)]) == 20
    assert "(exit 20)" in capsys.readouterr().out and json.loads(js.read_text())["exit_code"] == 20
    target = write_dir(tmp_path / "target", {"text_config": {"num_hidden_layers": 48}})
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target), "--json", str(js)]) == 18
    out, err = capsys.readouterr()
    assert "verdict: does not fit this target" in out and "(exit 18)" in out and "served as trained" not in out
    assert "outside the target's 48 layers" in err and json.loads(js.read_text())["exit_code"] == 18
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"num_hidden_layers": 64}}
    target.joinpath("config.json").write_text(json.dumps(cfg))
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target)]) == 20
    assert "target: 64 layers (text_config.num_hidden_layers" in capsys.readouterr().out
    target.joinpath("config.json").write_text(json.dumps({**cfg, "architectures": ["NemotronHForCausalLM"]}))
    assert main(["--root", str(REPO), "doctor", str(repo), "--target", str(target)]) == 22
    assert "records no auxiliary hidden states in vLLM 0.20.1" in capsys.readouterr().out


def test_two_doctor_runs_at_once_both_finish(tmp_path: Path, doctor_servers: None) -> None:
    """Two `vllm-dflash doctor` processes started together on configs no column has answered yet share the warm
    column servers: both finish with their verdict (a server that served one client at a time made the second wait for
    the first's whole batch, and past its bound on a long one; tests/test_doctor_sides.py shows the ordering)."""
    import random

    runs = []
    for i in range(2):
        cfg = {**q36(), "max_position_embeddings": 1 << 20 | random.randrange(1 << 19)}  # a digest no cache holds
        d = write_dir(tmp_path / f"d{i}", cfg)
        js = tmp_path / f"d{i}.json"
        cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "doctor", str(d), "--json", str(js)]
        runs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), js))
    for proc, js in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 20, err[-2000:]
        assert "(exit 20)" in out and json.loads(js.read_text())["exit_code"] == 20


def test_the_drafters_own_num_target_layers_is_a_note(doctor: Any) -> None:
    """--help: only --target decides a mismatch; num_target_layers in the drafter's config is a note."""
    d = diag({**q36(), "num_target_layers": 48}, doctor)
    assert d.exit_code == 20 and any("note:" in p and "beyond" in p for p in d.taps.problems)
    assert diag(q36(), doctor, target_layers=48).exit_code == 18


def test_cli_reads_a_shipped_table_entry_as_the_table_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doctor_servers: None
) -> None:
    """An entry read back gives the table's verdict (the issue: it dropped the entry's unknown fields and said 0),
    and an entry whose verdict its unknown fields decide is refused with one line (18)."""
    for key, klass in EXPECTED.items():
        assert (
            main(["--root", str(REPO), "doctor", str(table.checkpoints_dir() / f"{key}.json")]) == (D.EXIT_CODES[klass])
        )
    capsys.readouterr()
    data = json.loads((table.checkpoints_dir() / "z-lab--Qwen3.6-27B-DFlash.json").read_text())
    data["unknown"]["dflash_config.attention_sink_bias"] = {"candidates": [True, False], "why": "https://example.org"}
    (tmp_path / "e.json").write_text(json.dumps(data))
    assert main(["--root", str(REPO), "doctor", str(tmp_path / "e.json")]) == 18
    err = capsys.readouterr().err
    # One error line; a cold cache may print the environments' progress before it ("doctor: environments ready").
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert "depends on dflash_config.attention_sink_bias" in errors[0]


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


# ---- the shipped table ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_every_shipped_checkpoint_gets_its_verdict_from_public_sources(key: str, doctor: Any) -> None:
    e = entry(key)
    assert table.verdict(e, doctor) == EXPECTED[key]
    assert table.unsourced(e) == [], "every field of an entry names a public source"
    text = json.dumps(json.loads((table.checkpoints_dir() / f"{key}.json").read_text()))
    assert "/work" not in text and "upstream-facts" not in text and "/home/" not in text


def test_the_april_122b_drafter_is_mis_served_by_stock(doctor: Any) -> None:
    """The issue's wrong row: z-lab/dflash#152 gives the April drafter SWA 2048 and 6 extraction layers, so stock
    reads those layers one too early (and loses the windows) whatever the fields no source gives."""
    e = entry("z-lab--Qwen3.5-122B-A10B-DFlash-2026-04")
    ds = table.diagnose_entry(e, doctor)
    assert len(ds) > 1 and {d.verdict_class for d in ds} == {D.STOCK_MISSERVES}
    assert all(d.stock_wrong["taps"] == list(range(6)) and d.stock_wrong.get("windows") for d in ds)


def test_unsourced_and_undetermined_are_caught(doctor: Any) -> None:
    """Negative controls: a machine path as a source, a field without one, and an unknown that changes the verdict."""
    e = entry("z-lab--Qwen3.6-27B-DFlash")
    bad = table.Entry(e.key, e.name, e.target, e.checkpoint, None, {**e.sources, "layer_types": "my notes"}, e.unknown)
    assert table.unsourced(bad) == ["layer_types"]
    ck = Checkpoint(e.name, {**e.checkpoint.config, "is_causal": False})
    assert "is_causal" in table.unsourced(table.Entry(e.key, e.name, e.target, ck, None, e.sources, e.unknown))
    sinks = {**e.unknown, "dflash_config.attention_sink_bias": table.Unknown((True, False), "https://example.org")}
    flaky = table.Entry(e.key, e.name, e.target, e.checkpoint, None, e.sources, sinks)
    assert table.verdict(flaky, doctor) == "undetermined"
    assert "undetermined (depends on dflash_config.attention_sink_bias)" in table.render_table(doctor, [flaky])


def test_docs_table_is_the_doctors_output(doctor: Any) -> None:
    page = (REPO / "docs" / "doctor.md").read_text()
    generated = table.render_table(doctor)
    assert table.replace_table(page, generated) == page, "docs/doctor.md is stale: run vllm-dflash doctor --table"
    edited = page.replace("| z-lab/Qwen3.6-27B-DFlash | mis-serves", "| z-lab/Qwen3.6-27B-DFlash | serves", 1)
    assert edited != page and table.replace_table(edited, generated) != edited
    assert "no published drafter taps the last layer" not in page


# ---- --prove: the tiny twin and its claims -------------------------------------------------------------------------


def test_twin_keeps_the_shape(doctor: Any) -> None:
    d = diag(q36(), doctor, target_layers=64)
    spec, _ = prove.twin_spec(Checkpoint("q36", q36()), d)
    assert spec.layer_types == (S,) * 4 + (F,) and spec.layer_types_spelling == "explicit"
    assert spec.window_spelling == "dropped" and spec.sliding_window == 24 and min(spec.prompt_lengths) > 24
    assert spec.target_layer_ids == (1, 16, 31, 46, 61) and spec.target_layers == 64 and spec.block_size == 16
    assert spec.expect_stock == "fail" and C.NEG_FULL_ATTN in spec.negatives and C.NEG_TAP_INPUT in spec.negatives
    assert spec.attention == ((24, True),) * 4 + ((None, False),)
    d2 = diag(mwl(), doctor, target_layers=64)
    spec2, kept = prove.twin_spec(Checkpoint("mwl", mwl()), d2)
    assert spec2.layer_types == (F, F, S, S, S) and spec2.layer_types_spelling == "filled"
    assert spec2.max_window_layers == 2 and spec2.window_spelling == "sliding_window"
    assert spec2.attention == ((None, False),) * 2 + ((24, True),) * 3
    assert "layer_types left to transformers (sliding from layer 2)" in kept
    assert spec2.digest() != C.CaseSpec(**{**spec2.__dict__, "layer_types_spelling": "explicit"}).digest()
    with pytest.raises(Exception, match="cannot be proven"):
        dd = table.diagnose_entry(entry("z-lab-dflash-tests--dflash2-config"), doctor)[0]
        prove.twin_spec(Checkpoint("dflash2", {}), dd)


def _served(d: D.Diagnosis, spec: C.CaseSpec) -> dict[str, dict[str, Any]]:
    """Trace summaries as a twin served exactly as `d` claims (what the recorder and the start-up line report)."""
    rows = prove._expected_rows(d, "this build", spec.sliding_window)
    line = "DFlash drafter attention: " + "; ".join(
        f"layer {i}: {k} (x), " + (f"window {w} (y)" if w else "no window") + f", {'causal' if c else 'non-causal'} (z)"
        f" -> window ({(w or 0) - 1}, {0 if c else (w or 0) - 1})"
        for i, (k, w, c) in enumerate(rows)
    )
    ours_taps = [i + 1 for i in spec.target_layer_ids]
    stock_taps = [t - 1 if k in d.stock_wrong.get("taps", []) else t for k, t in enumerate(ours_taps)]
    return {
        "patched": {
            "attention_line": line,
            "layout": {"windows": prove._backend(rows), "aux_layers": ours_taps, "fed": d.taps.ours_recorded},
        },
        "stock": {
            "layout": {
                "windows": prove._backend(prove._expected_rows(d, "stock 0.20.1", None)),
                "aux_layers": stock_taps,
            }
        },
    }


def test_claims_hold_only_for_a_twin_served_as_claimed(doctor: Any) -> None:
    """The claim checker (the heavy tests run it on real traces): every claim holds on a twin served as claimed; a
    layer served with another window, the start-up line saying full, the target layers read one off, or a twin of
    another shape each fail a named claim."""
    for cfg in (q36(), mwl()):
        d = diag(cfg, doctor, target_layers=64)
        spec, _ = prove.twin_spec(Checkpoint("t", cfg), d)
        served = _served(d, spec)
        assert [c.what for c in prove.claims(d, spec, served, d) if not c.holds] == []
        bad = json.loads(json.dumps(served))
        bad["patched"]["layout"]["windows"][-1] = [5, 0]
        failed = [c.what for c in prove.claims(d, spec, bad, d) if not c.holds]
        assert failed[0] == "this build: backend window of each layer (recorded from the loaded drafter)"
        bad = json.loads(json.dumps(served))
        bad["patched"]["attention_line"] = bad["patched"]["attention_line"].replace(
            "sliding_attention", "full_attention"
        )
        assert not prove.claims(d, spec, bad, d)[1].holds
        bad = json.loads(json.dumps(served))
        bad["stock"]["layout"]["aux_layers"] = bad["patched"]["layout"]["aux_layers"]
        assert {c.what for c in prove.claims(d, spec, bad, d) if not c.holds} == {
            "stock 0.20.1: target layers recorded (aux indices)",
            "stock 0.20.1: which target layers it reads wrong (positions)",
        }
        bad = json.loads(json.dumps(served))  # the fc fed the taps in another order than the doctor says
        bad["patched"]["layout"]["fed"] = bad["patched"]["layout"]["fed"][::-1]
        assert [c.what for c in prove.claims(d, spec, bad, d) if not c.holds] == [
            "this build: the target layers the drafter's fc receives, in the order it receives them"
        ]
        bad["patched"]["layout"].pop("fed")  # nothing recorded: the claim is named as not run, never as held
        fed = next(c for c in prove.claims(d, spec, bad, d) if "fc receives" in c.what)
        assert not fed.ran and not fed.holds
        other = diag({**cfg, "is_causal": False}, doctor, target_layers=64)
        assert [c.what for c in prove.claims(d, spec, served, other) if not c.holds] == [
            "the twin's reading has the user's shape (per layer kind, window spelling, causality; taps; verdict)"
        ]


def test_start_up_line_parsed_as_the_patch_writes_it(doctor: Any) -> None:
    """prove's parser reads this build's start-up line as patch 0002 writes it (`layer i: kind (from), window W (from),
    causal (from) -> window (l, r)`), built here from the doctor's own rows of a mixed drafter."""
    d = diag({**q36(), "use_sliding_window": True, "sliding_window": 24}, doctor)
    rows = [r for r in d.rows if r.build == "this build"]
    line = "INFO x [qwen3_dflash.py:1] DFlash drafter attention: " + "; ".join(
        f"layer {r.layer}: {r.kind} ({r.kind_from}), "
        + (f"window {r.window} ({r.window_from})" if r.window else "no window")
        + f", {'causal' if r.causal else 'non-causal'} ({r.causal_from}) -> window {r.backend_window}"
        for r in rows
    )
    assert prove.parse_attention_line(line) == [(S, 24, True, (23, 0))] * 4 + [(F, None, False, (-1, -1))]


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


def _prove_run(manifest: Manifest, doctor: Any, cfg: dict[str, Any], spec: C.CaseSpec | None = None) -> Any:
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    ck = Checkpoint("shape", cfg)
    d = doctor.diagnose(ck, 64, "the twin's target")
    result = prove.prove(manifest, queues, ck, d, doctor, spec)
    prove.render_prove(result)
    return result


@pytest.mark.heavy
@pytest.mark.parametrize("shape", ["qwen3.6-27b", "max-window-layers"])
def test_prove_claim_by_claim(shape: str, manifest: Manifest, doctor: Any) -> None:
    """The twin through conformance: every claim as predicted, this build passes, stock fails where the doctor says.
    The public Qwen3.6-27B-DFlash shape (windows dropped by transformers, read back by this build) and a drafter
    whose sliding layers come from max_window_layers (the twin spells them the same way: the issue's hole)."""
    cfg = q36() if shape == "qwen3.6-27b" else mwl()
    result = _prove_run(manifest, doctor, cfg)
    assert [c.what for c in result.failed] == [] and len(result.claims) >= 7
    by = {o.build: o for o in result.conformance.outcomes}
    assert by["patched"].status == "pass" and by["stock"].status == "fail" and result.ok and result.exit_code == 0


@pytest.mark.heavy
def test_prove_a_twin_of_the_wrong_shape_exits_1(manifest: Manifest, doctor: Any) -> None:
    """Negative control: the max_window_layers drafter's twin written with all-full layer_types (what --prove did
    before): conformance of that twin passes, but the claims name what differs, and --prove exits 1."""
    d = diag(mwl(), doctor, target_layers=64)
    spec, _ = prove.twin_spec(Checkpoint("mwl", mwl()), d)
    from dataclasses import replace

    wrong = replace(
        spec,
        name="prove-wrong-shape",
        layer_types=(F,) * 5,
        layer_types_spelling="explicit",
        max_window_layers=0,
        negatives=(C.NEG_TAP_INPUT,),
    )
    result = _prove_run(manifest, doctor, mwl(), wrong)
    failed = {c.what for c in result.failed}
    assert "this build: backend window of each layer (recorded from the loaded drafter)" in failed
    assert "this build: kind, window, causality of each layer (its start-up line)" in failed
    assert any(w.startswith("the twin's reading has the user's shape") for w in failed)
    assert result.exit_code == 1


# ---- --context: the drafter's KV cache per sequence, with vLLM's own KV-cache specs ------------------------------

# A Qwen3.6-27B-shaped target (the shape public copies of its config give): 48 linear-attention (Gated DeltaNet) and
# 16 full-attention layers, every fourth, with 4 KV heads of 256.
Q36_TARGET = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "num_hidden_layers": 64,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        # Gated DeltaNet layers (Qwen/Qwen3.6-27B config.json)
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
    },
}


def test_context_reads_the_drafter_and_target_shapes(doctor: Any) -> None:
    from vllm_dflash.doctor import kvcache

    e = entry("z-lab--Qwen3.6-27B-DFlash")
    (_, ck), *_ = table.completions(e)
    d = table.diagnose_entry(e, doctor)[0]
    layers = kvcache.drafter_layers(ck, d)
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


@pytest.mark.heavy
def test_context_sizes_the_kv_cache_from_the_built_models(tmp_path: Path, doctor_servers: None) -> None:
    """`doctor --context` on Qwen3.6-27B-DFlash's shape (bf16) beside a Qwen3.6-27B-shaped target: every figure is a
    KV-cache spec a built layer reports, held here against the page arithmetic (16-token blocks, 8 KV heads of 128 for
    the drafter, 4 of 256 for the target's 16 attention layers, K and V, 2 bytes): stock keeps 5 full drafter layers,
    this build 1 full layer plus 4 sliding layers of window 2048 + 15 drafted tokens with one 2048-token prefill chunk
    (SlidingWindowSpec's admission bound); the target's 48 Gated DeltaNet layers keep a MambaSpec state each."""
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
    assert [x["spec"] for x in kv["this_build"]] == ["SlidingWindowSpec"] * 4 + ["FullAttentionSpec"]
    assert {x["window"] for x in kv["this_build"][:4]} == {2048 + 15}
    target = kv["target"]
    attention = [x for x in target if x["spec"] == "FullAttentionSpec"]
    state = [x for x in target if x["spec"] == "MambaSpec"]
    assert (len(attention), len(state)) == (16, 48) and len({x["bytes"] for x in state}) == 1
    assert kv["per_sequence_bytes"] == {
        "this_build": full + 4 * sliding,
        "stock": 5 * full,
        "target": 16 * (131072 // 16) * (16 * 4 * 256 * 2 * 2) + sum(x["bytes"] for x in state),
    }
    assert "this build keeps 22.5% of stock's drafter KV cache" in run.stdout
    # vLLM's own grouping (get_kv_cache_groups), each build's in its own environment, of 48 GDN + 16 full target
    # layers and the 5 drafter layers: the attention block is the smallest multiple of 16 whose page (4 KV heads x
    # 256, K and V, bf16) holds one GDN state (conv 3 x (2*16*128 + 48*128) and temporal 48 x 128 x 128, bf16); stock
    # groups 5 layers a group: 10 GDN, 4 target full, 1 drafter group.
    g = kv["groups"]
    gdn_state = (3 * (2 * 16 * 128 + 48 * 128) + 48 * 128 * 128) * 2
    block = 16 * -(-gdn_state // (16 * 4 * 256 * 2 * 2))
    assert (g["attention_block_size"], g["mamba_page_size_unpadded"]) == (block, gdn_state)
    assert g["kv_bytes_per_token"] == {"drafter": 8 * 128 * 2 * 2, "target": 4 * 256 * 2 * 2}
    assert g["stock"]["page_size_bytes"] == [block * 4 * 256 * 2 * 2] and min(g["stock"]["block_sizes"]) == block
    assert g["stock"]["count"] == 10 + 4 + 1 and g["stock"]["vllm_version"].endswith("+stock.1")
    # Issue 38: this build's drafter joins or fills groups, never splits the target's: at most stock's + 2 groups,
    # the target's block and page size unchanged, and less reserved per request (vLLM's own reservation).
    mine = g["this_build"]
    assert mine["vllm_version"].endswith("+dflash.1")
    assert mine["count"] <= g["stock"]["count"] + 2, mine
    assert mine["page_size_bytes"] == g["stock"]["page_size_bytes"] and mine["block_sizes"] == g["stock"]["block_sizes"]
    assert mine["drafter_windows"] == [2048 + 15] * 4 + [None]
    assert mine["bytes_per_request"] < g["stock"]["bytes_per_request"]
    assert "KV-cache groups (each build's own get_kv_cache_groups" in run.stdout
    assert f"this build {mine['count']} (" in run.stdout and f"stock {g['stock']['count']} (" in run.stdout


@pytest.mark.heavy
@pytest.mark.slow
def test_a_drafter_of_other_kv_bytes_keeps_its_whole_context_or_is_refused_in_one_line(manifest: Manifest) -> None:
    """Qwen3.6-27B with the z-lab drafter's layers at 4, 6, 8 and 16 KV heads of 128 (the published one has 8: the
    target's 4 x 256 bytes per token), through each build's own code in its environment (one process per build).
    Where the bytes differ this build keeps every drafter layer's whole context (stock's layout); where vLLM
    could not give the hybrid target and the drafter one page size it refuses in one line naming both sizes, where
    stock fails inside vLLM's page-size unification (an AssertionError without a message, a NotImplementedError)."""
    from vllm_dflash.doctor import kvcache, kvgroups
    from vllm_dflash.series import read_queues

    target = {"attention": kvcache.target_layers(Q36_TARGET)[0], "gdn": kvcache.target_gdn(Q36_TARGET)}
    heads = (8, 4, 6, 16)

    def job(kv: int) -> dict[str, Any]:
        drafter = [{"num_kv_heads": kv, "head_dim": 128, "window": w} for w in (2048,) * 4 + (None,)]
        sizes = {"context": 131072, "max_num_batched_tokens": 2048, "kernel_block_alignment": 16}
        return {"dtype": "bfloat16", "num_speculative_tokens": 15, **sizes, "target": target, "drafter": drafter}

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    jobs = {"jobs": [job(kv) for kv in heads]}
    mine, stock = (dict(zip(heads, kvgroups.side(manifest, queues, v, jobs), strict=True)) for v in ("dflash", "stock"))
    assert mine[8]["count"] <= stock[8]["count"] + 2 and mine[8]["drafter_windows"][0] == 2048 + 15  # the control
    assert mine[4]["drafter_windows"] == [None] * 5 and mine[4]["count"] == stock[4]["count"]  # stock's layout
    for kv in (6, 16):
        line = mine[kv]["error"]
        assert line.startswith("ValueError: DFlash drafter KV cache") and "\n" not in line
        assert f"{kv * 128 * 2 * 2} bytes" in line and f"attention layers {4 * 256 * 2 * 2}" in line
    assert stock[16]["error"] == "AssertionError: " and stock[6]["error"].startswith("NotImplementedError")


# ---- issue 39: classes the rules misread ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("hidden_size", "5120"),
        ("num_attention_heads", 32.0),
        ("vocab_size", None),
        ("rms_norm_eps", 1),
        ("head_dim", "128"),
    ],
)
def test_an_odd_typed_size_field_is_refused_as_transformers_refuses_it(name: str, value: Any, doctor: Any) -> None:
    """transformers 5.15.0 and 5.25.0 (both side environments) raise StrictDataclassFieldValidationError on
    Qwen3Config(**{name: value}) for each of these: every vLLM build refuses the published file so edited."""
    cfg = published_q36()
    cfg[name] = value
    d = diag(cfg, doctor)
    got = "NoneType" if value is None else type(value).__name__
    assert d.exit_code == 21 and f"Field '{name}' expected" in d.verdict and f"got {got}" in d.verdict, d.verdict
    assert diag(published_q36(), doctor).exit_code == 20  # the control: the same file as published


def _speculators_sliding(non_causal: Any) -> dict[str, Any]:
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_config": {"algorithm": "dflash"},
        "aux_hidden_state_layer_ids": [2, 10],
        "mask_token_id": 7,
        "sliding_window_non_causal": non_causal,
        "transformer_layer_config": {
            **TINY,
            "model_type": "qwen3",
            "num_hidden_layers": 2,
            "num_target_layers": 12,
            "layer_types": [S, F],
            "use_sliding_window": True,
            "sliding_window": 64,
        },
    }


def test_speculators_non_causal_sliding_window_is_what_this_build_misreads(doctor: Any) -> None:
    """vLLM 0.33.0's update_dflash sets dflash_config.causal = not sliding_window_non_causal. This build does not read
    the field and runs a declared sliding layer causal: `true` (trained non-causal) is the value it mis-serves,
    `false` the one it agrees with (before issue 39 the rule was the other way round)."""
    d = diag(_speculators_sliding(True), doctor)
    assert d.exit_code == 22 and "sliding_window_non_causal" in d.verdict
    assert [c for _, _, c in mine(d)] == [True, False]  # what this build runs instead: a causal sliding layer
    upstream = [r.causal for r in d.rows if r.build == "upstream 0.34.0"]
    assert upstream == [False, False]  # what the checkpoint asks for (0.33.0's reading)
    d = diag(_speculators_sliding(False), doctor)
    assert d.exit_code == 20 and any("sliding_window_non_causal" in x for x in d.ignored)


@pytest.mark.parametrize(
    ("ids", "fed"),
    [([61, 46, 31, 16, 1], "1, 16, 31, 46, 61 (5 taps)"), ([1, 16, 16, 46, 61], "1, 16, 46, 61 (4 taps)")],
)
def test_unsorted_or_duplicated_ids_are_not_fed_in_the_listed_order(ids: list[int], fed: str, doctor: Any) -> None:
    """vLLM 0.20.1's EagleModelMixin._maybe_add_hidden_state records `layer_idx in aux_hidden_state_layers` layer by
    layer: in layer order, once each; the reference concatenates target_layer_ids in the listed order."""
    cfg = published_q36()
    cfg["dflash_config"]["target_layer_ids"] = ids
    d = diag(cfg, doctor)
    assert d.exit_code == 22 and f"outputs of target layers {fed}" in d.verdict, d.verdict
    assert diag(published_q36(), doctor).exit_code == 20  # ascending, each once: the control


def test_float_ids_are_worded_as_the_layers_vllm_taps(doctor: Any) -> None:
    """`2.0 in (2,)` is True in Python: vLLM taps layer 2 for an id 2.0, so the words name the ints it matches."""
    cfg = published_q36()
    cfg["dflash_config"]["target_layer_ids"] = [1.0, 16.0, 31.0, 46.0, 61.0]
    d = diag(cfg, doctor)
    assert "outputs of target layers 0, 15, 30, 45, 60 instead of 1, 16, 31, 46, 61" in d.verdict, d.verdict


def test_negative_ids_say_what_each_build_records(doctor: Any) -> None:
    """Id -1 is the embeddings for the reference (dflash 0.1.0 extract_context_feature: hidden_states[-1 + 1]) and
    for this build (aux 0, the input of layer 0); stock's aux -1 is never recorded (`layer_idx in ...`). Id -2 is the
    reference's last hidden state (hidden_states[-1]) but no layer vLLM records: not runnable."""
    cfg = published_q36()
    cfg["dflash_config"]["target_layer_ids"] = [-1, 16, 31, 46, 61]
    d = diag(cfg, doctor)
    assert d.exit_code == 20 and "-2" not in d.verdict, d.verdict
    assert "target layers 15, 30, 45, 60 instead of -1 (the embeddings), 16" in d.verdict
    assert "1 tap never recorded: the fc gets 4 of 5" in d.verdict
    cfg["dflash_config"]["target_layer_ids"] = [-2, 16, 31, 46, 61]
    d = diag(cfg, doctor)
    assert d.exit_code == 22 and "(4 taps) where it was trained on" in d.verdict, d.verdict


@pytest.mark.parametrize("mask", [248320, 999999, "248070", -1])
def test_a_mask_token_outside_the_vocabulary_or_a_string_is_named(mask: Any, doctor: Any) -> None:
    """The proposer fills the masked slots with dflash_config.mask_token_id as written (a rule, named as one)."""
    cfg = published_q36()
    cfg["dflash_config"]["mask_token_id"] = mask
    d = diag(cfg, doctor)
    assert d.exit_code == 22 and f"mask_token_id {mask!r} is no token" in d.verdict and "rule read from" in d.verdict
    cfg["dflash_config"]["mask_token_id"] = 248319  # the last token: the control
    assert diag(cfg, doctor).exit_code == 20


def test_the_last_layer_note_needs_no_target(doctor: Any) -> None:
    """Without --target the drafter's own num_target_layers names the last layer; the note is kept."""
    cfg = published_q36()
    cfg["dflash_config"]["target_layer_ids"] = [1, 16, 31, 46, 63]
    assert any("last target layer (63" in p for p in diag(cfg, doctor).taps.problems)
    assert "last target layer" in D.render_text(diag(cfg, doctor))
    assert not any("last target layer" in p for p in diag(published_q36(), doctor).taps.problems)  # the control


def test_context_takes_the_serve_arguments() -> None:
    from vllm_dflash.doctor import kvcache

    assert kvcache.serve_shape(["--max-model-len", "16384", "--max-num-batched-tokens", "32768"], "x") == {
        "max_model_len": 16384,
        "max_num_batched_tokens": 32768,
    }
    assert kvcache.serve_shape(["--block-size=32", "--gpu-memory-utilization", "0.9"], "x") == {"block_size": 32}
    with pytest.raises(CheckpointError, match="--max-num-batched-tokens 'lots' is no positive number"):
        kvcache.serve_shape(["--max-num-batched-tokens", "lots"], "x")


@pytest.mark.parametrize(
    ("extra", "max_model_len"),
    [([], 131072), (["--max-model-len", "65536"], 65536)],
)
def test_context_wins_over_the_profiles_max_model_len(extra: list[str], max_model_len: int) -> None:
    """`--context 131072 --profile qwen3.6-27b` sizes at 131,072 tokens with the profile's other serve arguments (its
    own --max-model-len 16384 had silently replaced the context); an explicit --max-model-len still wins."""
    from vllm_dflash.cli import build_parser
    from vllm_dflash.cli.doctor import serve_arguments

    args = build_parser().parse_args(
        ["--root", str(REPO), "doctor", "x.json", "--context", "131072", "--profile", "qwen3.6-27b", *extra]
    )
    serve = serve_arguments(args)
    assert serve is not None and serve["max_model_len"] == max_model_len
    assert serve["max_num_batched_tokens"] == 32768  # the profile's


@pytest.mark.heavy
def test_context_with_the_profiles_serve_arguments(tmp_path: Path, doctor_servers: None) -> None:
    """At 16K context the qwen3.6-27b profile's 32,768-token prefill chunk makes each sliding layer reserve its window
    plus one chunk (capped at the context): more than a full layer, so this build keeps no less than stock. The
    figures are the built layers' own (vLLM's max_memory_usage_bytes at the profile's serve arguments)."""
    ck = REPO / "vllm_dflash" / "doctor" / "checkpoints" / "z-lab--Qwen3.6-27B-DFlash.json"
    figures = {}
    for extra in ([], ["--profile", "qwen3.6-27b"], ["--profile", "qwen3.6-27b", "--max-num-batched-tokens", "2048"]):
        out = tmp_path / f"d{len(extra)}.json"
        args = ["doctor", str(ck), "--context", "16384", "--json", str(out), *extra]
        run = subprocess.run(
            [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), *args],
            capture_output=True,
            text=True,
            check=False,
        )
        assert run.returncode == 20, run.stderr[-2000:]
        kv = json.loads(out.read_text())["kv_cache"]
        figures[len(extra)] = kv["per_sequence_bytes"]
        assert kv["max_num_batched_tokens"] == (32768 if len(extra) == 2 else 2048)
    page = 16 * 8 * 128 * 2 * 2
    full = 16384 // 16 * page
    assert figures[0]["this_build"] < figures[0]["stock"]  # the control: the default 2,048-token chunk
    assert figures[4] == figures[0]  # the command line wins over the profile
    assert figures[2]["this_build"] > figures[2]["stock"] == 5 * full
    # window + chunk exceeds the context: SlidingWindowSpec caps a layer at max_model_len, plus one block
    assert figures[2]["this_build"] == full + 4 * (min(2048 + 15 - 1 + 32768, 16384) // 16 + 1) * page


@pytest.mark.heavy
def test_the_whole_model_reserves_less_than_stock_with_the_profiles_serve_arguments(tmp_path: Path) -> None:
    """Issue 38 on the user's shape and serve arguments: Qwen3.6-27B + the z-lab drafter with the qwen3.6-27b
    profile (16K context, 32,768 batched tokens), grouped by each build's own get_kv_cache_groups. With the group
    size taken from the full-attention kind alone (17), the 4 sliding layers filled a group of 17 pools and each of
    their blocks cost 17 pages: 3,648,716,800 bytes per request against stock's 2,990,080,000. This build must
    reserve less than stock, in no more groups than stock + 2, with the target's block and page size."""
    (tmp_path / "target.json").write_text(json.dumps(Q36_TARGET))
    out = tmp_path / "d.json"
    ck = REPO / "vllm_dflash" / "doctor" / "checkpoints" / "z-lab--Qwen3.6-27B-DFlash.json"
    args = ["doctor", str(ck), "--target", str(tmp_path / "target.json"), "--context", "16384", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), *args, "--profile", "qwen3.6-27b"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 20, run.stderr[-2000:]
    g = json.loads(out.read_text())["kv_cache"]["groups"]
    mine, stock = g["this_build"], g["stock"]
    assert stock["count"] == 15 and mine["count"] <= stock["count"] + 2, (mine, stock)
    assert mine["page_size_bytes"] == stock["page_size_bytes"] and mine["block_sizes"] == stock["block_sizes"]
    assert mine["drafter_windows"] == [2048 + 15] * 4 + [None]
    assert mine["bytes_per_request"] < stock["bytes_per_request"], (mine, stock)
    # No group of the sliding kind is padded past the largest group the layout needs for its other kinds.
    sliding = [n for kind, n, _ in mine["groups"] if kind == "SlidingWindowSpec"]
    assert sliding == [4] and max(n for _, n, _ in mine["groups"]) < 17


BUILDS = ("dflash", "stock")


@pytest.mark.heavy
def test_on_an_all_full_target_the_window_never_reserves_more_than_the_whole_context(manifest: Manifest) -> None:
    """Qwen3.6-27B's 16 attention layers as an all-full-attention target with the z-lab drafter, each build's own
    grouping in its environment (one process per build). Stock puts every layer in one group (no padding). With the
    profile's 16,384 tokens and 32,768 batched, a sliding layer keeps as much as a full one and its own groups pay
    for padding: the windowed layout reserved 1,611,005,952 bytes against stock's 1,409,286,144. This build keeps the
    whole context there (stock's layout, no more reserved), and keeps the windows where they save (131,072 tokens,
    2,048 batched: two groups, less than stock)."""
    from vllm_dflash.doctor import kvcache, kvgroups
    from vllm_dflash.series import read_queues

    target = {"attention": kvcache.target_layers(Q36_TARGET)[0], "gdn": None}
    drafter = [{"num_kv_heads": 8, "head_dim": 128, "window": w} for w in (2048,) * 4 + (None,)]
    shapes = ((16384, 32768), (131072, 2048))
    jobs = {
        "jobs": [
            {"dtype": "bfloat16", "num_speculative_tokens": 15, "context": c, "max_num_batched_tokens": b,
             "kernel_block_alignment": 16, "target": target, "drafter": drafter}
            for c, b in shapes
        ]
    }  # fmt: skip
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    mine, stock = (dict(zip(shapes, kvgroups.side(manifest, queues, v, jobs), strict=True)) for v in BUILDS)
    short, long = shapes
    assert stock[short]["count"] == stock[long]["count"] == 1
    assert mine[short]["bytes_per_request"] <= stock[short]["bytes_per_request"], (mine[short], stock[short])
    assert mine[short]["count"] == 1  # every layer keeps the whole context, one group as stock
    assert mine[long]["count"] == 2 and mine[long]["bytes_per_request"] < stock[long]["bytes_per_request"]
    assert mine[long]["drafter_windows"] == [2048 + 15] * 4 + [None]


@pytest.mark.parametrize("case", ["refs-not-utf8", "refs-huge", "fifo-weights"])
def test_hostile_cache_files_are_one_line_exit_18(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """refs/main is read bounded and typed; a FIFO named *.safetensors is refused before it is opened (no hang)."""
    repo = tmp_path / "hub" / "models--z-lab--Qwen3.6-27B-DFlash"
    snap = write_dir(repo / "snapshots" / "abc123", q36())
    (repo / "refs").mkdir()
    ref = repo / "refs" / "main"
    if case == "refs-not-utf8":
        ref.write_bytes(b"\xff\xfe\x00abc")
    elif case == "refs-huge":
        ref.write_bytes(b"a" * 4096)
    else:
        ref.write_text("abc123\n")
        os.mkfifo(snap / "model.safetensors")
    assert main(["--root", str(REPO), "doctor", str(repo)]) == 18
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    print(err[0])


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("weight-map-int", 18, "weight_map is not an object"),
        ("weight-map-list", 18, "weight_map is not an object"),
    ],
)
def test_hostile_drafter_files_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, code: int, says: str
) -> None:
    """Issue 42's last doctor tracebacks: an index whose weight_map is no mapping is one line with its class's exit
    code, before any column runs."""
    d = write_dir(tmp_path / "drafter", q36())
    args = ["--root", str(REPO), "doctor", str(d)]
    bad: object = 5 if case == "weight-map-int" else ["model.safetensors"]
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": bad}))
    assert main(args) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    print(err[0])


def test_a_string_swa_window_size_is_a_field_no_build_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doctor_servers: None
) -> None:
    # it once ended in a traceback; a string there is as unknown as the field itself: exit 23, no trace
    d = write_dir(tmp_path / "drafter", {**q36(), "swa_window_size": "2048"})
    assert main(["--root", str(REPO), "doctor", str(d)]) == 23
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out and "swa_window_size" in captured.out
