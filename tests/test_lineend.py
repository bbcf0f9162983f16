"""The end of the V1 line (vllm_dflash/upstream/lineend.py): a release without Model Runner V1 gets one verdict,
computed from release sources -- synthetic trees here (quick), the real 0.34.0 sdist in the heavy test."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import copy_manifest_and_patches

from vllm_dflash.cli import main
from vllm_dflash.errors import V1RemovedError
from vllm_dflash.upstream import lineend as L

REPO = Path(__file__).resolve().parent.parent

V2_OK = "def get_target_lm_head(model): ...\n"
WINDOWS = "Attention(..., per_layer_sliding_window=w)\n"
MIXED_NO = 'raise NotImplementedError("DFlash does not yet support mixed sliding/full attention")\n'
V2_LISTED = "class VllmConfig:\n    def use_v2_model_runner(self):\n        if _is_default_v2_model_runner_model(m):\n            return True\n        return False\n"  # noqa: E501
V2_ALWAYS = "class VllmConfig:\n    def use_v2_model_runner(self):\n        if env == '0':\n            return False\n        return True\n"  # noqa: E501


def tree(files: Mapping[str, str | None]) -> L.Reader:
    return lambda path: files.get(path)


def v1_tree(**extra: str) -> dict[str, str | None]:
    return {L.V1_RUNNER: "x", L.V1_PROPOSERS[0]: "x", L.V1_PROPOSERS[1]: "x", L.V2_RUNNER: "x", **extra}


def v2_only(**extra: str) -> dict[str, str | None]:
    return {L.V2_RUNNER: "x", L.PLATFORM: f'raise ValueError("{L.V1_REMOVED_WORDS}")', **extra}


def test_removal_is_read_from_the_tree_and_a_v1_tree_is_its_negative_control() -> None:
    facts = L.removal(tree(v2_only()))
    assert f"{L.V1_RUNNER} absent" in facts and any(L.V1_REMOVED_WORDS in f for f in facts)
    assert L.removal(tree(v1_tree())) == ()  # V1 still there: the normal per-patch analysis
    assert L.removal(tree({})) == ()  # no runner tree at all (e.g. a ref of another project): not "removed"
    # The runner file alone gone, proposers and platform still V1: not the end of the line either.
    half = v1_tree()
    del half[L.V1_RUNNER]
    assert L.removal(tree(half)) == ()
    # Both proposers gone without the platform's words is enough.
    gone = {L.V2_RUNNER: "x"}
    assert len(L.removal(tree(gone))) == 3


def releases() -> dict[str, L.Reader]:
    """0.25.1: V2 drafts DFlash without the lm_head helper, mixed refused; 0.26.0: V2 serves every kind (mixed only
    on V2); 0.29.0: V2 the default."""
    return {
        "0.25.1": tree(v1_tree(**{L.DRAFTER_MODEL: WINDOWS + MIXED_NO, L.CONFIG: V2_LISTED})),
        "0.26.0": tree(v1_tree(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS, L.CONFIG: V2_LISTED})),
        "0.29.0": tree(v1_tree(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS, L.CONFIG: V2_ALWAYS})),
    }


def manifest_stub() -> Any:
    from vllm_dflash.manifest import load_manifest

    return load_manifest(REPO)


def test_y_is_the_first_release_whose_v2_runner_serves_the_kind() -> None:
    target = tree(v2_only(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS}))
    end = L.line_end(manifest_stub(), "0.34.0", target, readers=releases())
    assert end is not None
    assert end.verdict() == "V1 removed in 0.34.0; your drafter is served by V2 from 0.26.0"
    ways = {w.kind: w for w in end.ways}
    assert ways[L.MIXED].since == "0.26.0" and ways[L.MIXED].default_from == "0.29.0"
    assert f"with {L.FLAG}; from 0.29.0 V2 is the default" in ways[L.MIXED].text()
    assert end.scanned == ("0.25.1", "0.26.0", "0.29.0", "0.34.0")
    assert "stay on a pin before 0.34.0, or leave them" in end.lines()[-1]  # the line's end, computed too
    # The negative control: the same releases against a tree that still has V1 give no line-end verdict.
    assert L.line_end(manifest_stub(), "0.33.0", tree(v1_tree()), readers=releases()) is None


def test_y_moves_when_the_code_does() -> None:
    # 0.26.0 refusing mixed drafters on every runner: mixed is then first served by 0.29.0, full still by 0.26.0.
    rel = releases()
    rel["0.26.0"] = tree(v1_tree(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS + MIXED_NO, L.CONFIG: V2_LISTED}))
    target = tree(v2_only(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS}))
    mixed = L.line_end(manifest_stub(), "0.34.0", target, L.MIXED, readers=rel)
    full = L.line_end(manifest_stub(), "0.34.0", target, L.FULL, readers=rel)
    assert mixed is not None and full is not None
    assert mixed.since == "0.29.0" and "V2 the default there, no flag" in mixed.lines()[2]
    assert full.since == "0.26.0"
    # No release serves the kind: said so, never a made-up Y.
    none = {"0.25.1": rel["0.25.1"]}
    bare = L.line_end(manifest_stub(), "0.34.0", tree(v2_only()), L.MIXED, readers=none)
    assert bare is not None and bare.since is None and "no V2 release pinned" in bare.verdict()


def test_the_line_end_among_the_known_releases_is_the_first_without_v1() -> None:
    """What the pin matrix prints: the first known release whose own tree has no V1, and the ways out read from the
    older ones; every release still on V1 (the negative control) gives nothing."""
    rel = releases()
    rel["0.34.0"] = tree(v2_only(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS}))
    rel["0.35.0"] = tree(v2_only(**{L.V2_DFLASH: V2_OK, L.DRAFTER_MODEL: WINDOWS}))
    end = L.known_line_end(manifest_stub(), rel)
    assert end is not None and end.version == "0.34.0" and end.scanned == ("0.25.1", "0.26.0", "0.29.0", "0.34.0")
    assert {w.kind: w.since for w in end.ways} == {L.FULL: "0.26.0", L.SLIDING: "0.26.0", L.MIXED: "0.26.0"}
    assert L.known_line_end(manifest_stub(), releases()) is None


S, F = "sliding_attention", "full_attention"


def drafter(**over: Any) -> dict[str, Any]:
    """A drafter of the published Qwen3.6-27B-DFlash shape (its window dropped by transformers unless
    use_sliding_window is true, as in the published file)."""
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
        "head_dim": 128,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "layer_types": [S, S, S, S, F],
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 64,
        "sliding_window": 2048,
        "use_sliding_window": False,
        "vocab_size": 248320,
    }
    return {**raw, **over}


def _kind(doctor: Any, raw: dict[str, Any]) -> str | None:
    from vllm_dflash.doctor.columns import UPSTREAM

    reading = doctor.read([raw])[0].readings[UPSTREAM]
    return L.drafter_kind(None if reading.layers is None else [x.kind for x in reading.layers])


def test_the_drafter_kind_is_the_doctors_upstream_reading(doctor: Any) -> None:
    """The kind is what vLLM 0.34.0's own code built (the doctor's upstream column)."""
    assert _kind(doctor, drafter(use_sliding_window=True)) == L.MIXED
    assert _kind(doctor, drafter(use_sliding_window=True, layer_types=[F] * 5)) == L.FULL
    assert _kind(doctor, drafter(use_sliding_window=True, layer_types=[S] * 5)) == L.SLIDING
    # What the doctor's upstream column refuses has no kind: the published file as it is (use_sliding_window false,
    # so transformers drops the window that upstream's sliding layers require).
    assert _kind(doctor, drafter()) is None


def test_the_kind_of_built_layers() -> None:
    assert L.drafter_kind([S, S, F]) == L.MIXED and L.drafter_kind([F]) == L.FULL and L.drafter_kind([S]) == L.SLIDING
    assert L.drafter_kind(None) is None


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_against_0_34_0_is_one_verdict_not_conflicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = main(["--root", str(REPO), "upstream", "--against", "0.34.0", "--evidence", "none", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == V1RemovedError.return_code == 27, text
    assert "V1 removed in 0.34.0; your drafter is served by V2 from " in text
    assert "conflict" not in text and "hunk" not in text, text
    data = json.loads(out.read_text())
    assert data["v1_removed"]["version"] == "0.34.0" and data["v1_removed"]["since"] is not None


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_upstream_against_0_34_0_for_the_users_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(drafter(use_sliding_window=True)))
    args = ["--root", str(REPO), "upstream", "--against", "0.34.0", "--evidence", "none", "--drafter", str(cfg)]
    assert main(args) == 27
    text = capsys.readouterr().out
    assert "V1 removed in 0.34.0; your drafter (mixed sliding+full) is served by V2 from " in text
    assert "full-attention drafter" not in text  # only the user's kind
    # A drafter upstream does not build (the window dropped by transformers): one line and the checkpoint code.
    cfg.write_text(json.dumps(drafter()))
    assert main(args) == 18
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("+ ")]
    assert len(err) == 1 and "upstream vLLM does not build this drafter" in err[0], err


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.slow
def test_rebase_to_0_34_0_stops_with_the_verdict_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = copy_manifest_and_patches(tmp_path / "repo")
    before = {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert main(["--root", str(root), "rebase", "--to", "0.34.0", "--evidence", "none"]) == 27
    err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("+ ")]  # `+ cmd` log lines aside
    assert len(err) == 1 and "rebase --to 0.34.0 stopped, nothing changed: V1 removed in 0.34.0" in err[0], err
    assert {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} == before
