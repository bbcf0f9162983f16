"""The DFlash miniature: synthetic corpus, trained tiny target + drafter, and the reference loop's acceptance.

Fast tests: the corpus (stdlib) and vLLM-style pooling; with the dflash reference environment (built once, cached):
the verbatim chat template and the packed training forward against the reference's own forward. Slow tests use the
trained models (`ensure_mini_models`: cached, trained on a miss in about 10 minutes on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash.envs import reference_python
from vllm_dflash.errors import ManifestError
from vllm_dflash.manifest import Manifest, Profile, parse_profile
from vllm_dflash.mini import corpus, host, refloop, train
from vllm_dflash.validate import miniature, smoke
from vllm_dflash.validate.gates import condition_gates
from vllm_dflash.validate.metrics import SpecCounters
from vllm_dflash.validate.smoke import Prompt, first_difference

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ref_python(manifest: Manifest) -> Path:
    return reference_python(manifest)


def _in_ref(ref_python: Path, code: str) -> str:
    out = subprocess.run(
        [str(ref_python), "-c", code],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        text=True,
        capture_output=True,
        check=True,
    )
    return out.stdout


# ---- corpus (stdlib) --------------------------------------------------------------------------------------------


def _training_docs() -> list[str]:
    cfg = train.DEFAULT_CONFIG
    n = cfg["target"]["steps"] * cfg["target"]["batch"] + cfg["drafter"]["sequences"]
    return corpus.training_documents(cfg["seed"], n, cfg["target"]["seq_len"] + 1)


def test_corpus_is_deterministic() -> None:
    assert corpus.training_documents(0, 50, 300) == corpus.training_documents(0, 50, 300)
    assert corpus.held_apart_prompts(0, 20, 48, 160) == corpus.held_apart_prompts(0, 20, 48, 160)
    assert corpus.training_documents(0, 5, 300) != corpus.training_documents(1, 5, 300)
    doc = corpus.training_documents(0, 1, 300)[0]
    assert doc.isascii() and len(doc) >= 300 and doc.endswith("\n")


def test_held_apart_prompts_never_occur_in_training_text() -> None:
    cfg = train.DEFAULT_CONFIG["prompts"]
    docs = _training_docs()
    prompts = corpus.held_apart_prompts(0, cfg["candidates"], cfg["min_len"], cfg["max_len"], docs)
    assert len({p.prompt for p in prompts}) == len(prompts)
    assert all(cfg["min_len"] <= len(p.prompt) <= cfg["max_len"] for p in prompts)
    with pytest.raises(AssertionError, match="occurs in the training text"):
        corpus.assert_disjoint(prompts[:1], ["xx" + prompts[0].prompt + "yy"])


def test_vllm_pooling_counts_steps_like_vllm() -> None:
    # Prefill gives token 1; steps run while fewer than max_tokens exist; the last step's acceptances count in full
    # even beyond max_tokens (vLLM counts before truncation). produced = accepted + 1.
    assert refloop.vllm_pooling([8, 8, 3, 8], max_tokens=10) == [7, 7]
    assert refloop.vllm_pooling([1, 1, 1], max_tokens=3) == [0, 0]
    assert refloop.vllm_pooling([5, 2, 8], max_tokens=1) == []
    with pytest.raises(ValueError):
        refloop.vllm_pooling([2], max_tokens=10)
    stats = refloop.pooled_stats([[7, 0], [3]], k=7)
    assert stats["num_drafts"] == 3 and stats["num_accepted_tokens"] == 10
    assert stats["acceptance_length"] == pytest.approx(1 + 10 / 3)
    assert stats["num_accepted_tokens_per_pos"] == [2, 2, 2, 1, 1, 1, 1]


# ---- serving conditions (no environment) -----------------------------------------------------------------------


def _profile(manifest: Manifest, name: str, **changes: Any) -> Profile:
    table = {**manifest.profiles[name].definition, **changes}
    return parse_profile(name, table)


def test_rounds_repeat_the_prompt_set_and_only_where_the_tool_serves(manifest: Manifest) -> None:
    prompts = [Prompt("a", "mini", "x" * 50), Prompt("b", "mini", "y" * 100)]
    assert [p.id for p in miniature.repeated(prompts, 2)] == ["a", "b", "a#2", "b#2"]
    assert miniature.repeated(prompts, 1) == prompts
    assert _profile(manifest, "mini-cpu-serving").rounds == 2
    with pytest.raises(ManifestError, match="rounds must be >= 1"):
        _profile(manifest, "mini-cpu-serving", rounds=0)
    with pytest.raises(ManifestError, match='only where serve = "cpu-builds"'):
        _profile(manifest, "qwen3-8b", rounds=2)
    assert _profile(manifest, "qwen3-8b", rounds=1).rounds == 1


def test_serving_conditions_name_batch_chunks_prefix_cache_and_tp(manifest: Manifest) -> None:
    # A step schedules at most 128 - (7 - 1) x 8 = 80 tokens: only the 100-token prompt is chunked.
    prompts = [Prompt("a", "mini", "x" * 50), Prompt("b", "mini", "y" * 100)]
    line = miniature.serving_conditions(manifest.profiles["mini-cpu-serving"], prompts)
    assert "8 concurrent requests, max-num-seqs 8" in line
    assert "chunked prefill: 1/2 prompts (longest 100 tokens) longer than a step's 80 tokens" in line
    assert "prefix caching, block 32, prompts sent 2x" in line and "tensor parallel" not in line
    tp2 = miniature.serving_conditions(manifest.profiles["mini-cpu-serving-tp2"], prompts)
    assert "tensor parallel 2 (mp executor)" in tp2
    assert miniature.serving_conditions(manifest.profiles["mini-cpu"], prompts) == ""  # one request at a time


def test_condition_gates_fail_without_hits_or_with_a_real_mismatch(manifest: Manifest) -> None:
    serving, plain = manifest.profiles["mini-cpu-serving"], manifest.profiles["mini-cpu"]
    hit, miss = SpecCounters(prefix_cache_queries=900, prefix_cache_hits=320), SpecCounters(prefix_cache_queries=900)
    assert [(v.gate, v.passed) for v in condition_gates(serving, hit, None)] == [("prefix_cache_hits", True)]
    assert [(v.gate, v.passed) for v in condition_gates(serving, miss, None)] == [("prefix_cache_hits", False)]
    assert condition_gates(plain, miss, None) == []  # prompts sent once: no hits claimed
    ties = [{"id": "a", "near_tie": True}, {"id": "b#2", "near_tie": True}]
    assert [v.passed for v in condition_gates(plain, miss, ties)] == [True]
    (bug,) = condition_gates(plain, miss, [*ties, {"id": "c", "near_tie": False}])
    assert bug.gate == "mismatches_are_near_ties" and not bug.passed and bug.value == 1


def test_mismatches_are_listed_with_their_first_differing_position() -> None:
    assert first_difference("12. copy", "12. cop!") == 7
    assert first_difference("12", "123") == 2 and first_difference("same", "same") == 4
    got = {"a": "abc", "b": "abd", "c": "ab"}
    want = {"a": "abc", "b": "abc", "c": "abc", "d": "x"}
    m = smoke._matching(got, want)
    assert m["matches"] == 1 and m["rate"] == 0.25
    assert m["mismatches"] == [{"id": "b", "position": 2}, {"id": "c", "position": 2}, {"id": "d", "position": 0}]


# ---- with the reference environment (seconds) ---------------------------------------------------------------


def test_chat_template_renders_the_prompt_verbatim(ref_python: Path, tmp_path: Path) -> None:
    code = f"""
import json
from pathlib import Path
from transformers import AutoTokenizer
from vllm_dflash.mini import train
out = Path({str(tmp_path)!r})
train.save_tokenizer(out)
tok = AutoTokenizer.from_pretrained(out)
prompt = "7. spell apple: a-p-p-l-e\\n8. copy q7 -> q7\\n9. "
msgs = [{{"role": "system", "content": "ignored"}}, {{"role": "user", "content": "earlier"}},
        {{"role": "assistant", "content": "reply"}}, {{"role": "user", "content": prompt}}]
text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False)["input_ids"]
print(json.dumps({{"text": text, "ids": ids, "with_specials": tok(text)["input_ids"], "prompt": prompt}}))
"""
    got = json.loads(_in_ref(ref_python, code).strip().splitlines()[-1])
    assert got["text"] == got["prompt"]
    assert got["ids"] == got["with_specials"] == list(got["prompt"].encode())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == train.CHAT_TEMPLATE and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_packed_training_forward_equals_the_reference_forward(ref_python: Path) -> None:
    """Several blocks packed per sequence with explicit per-layer masks compute exactly what the reference computes
    for each block alone; without the masks the full layer would see later context (the leak)."""
    code = """
import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3ForCausalLM
from vllm_dflash.mini import train
torch.set_num_threads(1)
cfg = train.merge_config({})
torch.manual_seed(0)
target = Qwen3ForCausalLM(train.target_config(cfg)).eval()
drafter = DFlashDraftModel(train.drafter_config(cfg)).eval()
seq = torch.randint(0, 256, (90,)).tolist()
print(train.packed_check(drafter, target, seq, 40, cfg["drafter"]["target_layer_ids"], m=5))
"""
    assert float(_in_ref(ref_python, code).strip().splitlines()[-1]) < 1e-5


_EMULATION_CHECK = """
import json
import torch
import dflash.model as dm
from dflash.model import DFlashDraftModel
from transformers import Qwen3ForCausalLM
from vllm_dflash.mini import refloop, train
torch.set_num_threads(1)
cfg = train.merge_config({})
torch.manual_seed(0)
target = Qwen3ForCausalLM(train.target_config(cfg)).eval()
mini = refloop.Mini(target, DFlashDraftModel(train.drafter_config(cfg)).eval())
prompt = torch.randint(0, 256, (40,)).tolist()  # longer than the window (16)

def worst(mode, old_cache=False):
    calls = []
    hook = mini.drafter.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append((kwargs["target_hidden"], kwargs["noise_embedding"], out.clone())),
        with_kwargs=True)
    with mini.semantics(mode):
        if old_cache:
            dm._make_cache = ORIG  # the reference's own cache (sliding layers keep W - 1 tokens); restored after
        try:
            mini.generate(prompt, 24)
        finally:
            hook.remove()
        # The same drafts from scratch: all the context features at once, no cache, each layer's own mask.
        err, ctx = 0.0, []
        for hidden, noise, out in calls:
            ctx.append(hidden)
            whole = torch.cat(ctx, dim=1)
            pos = torch.arange(whole.shape[1] + noise.shape[1])[None]
            with torch.inference_mode():
                again = mini.drafter(target_hidden=whole, noise_embedding=noise, position_ids=pos)
            err = max(err, float((again - out).abs().max()))
    return {"steps": len(calls), "context": int(torch.cat(ctx, dim=1).shape[1]), "err": err}

ORIG = dm._make_cache
print(json.dumps({"reference": worst("reference"), "full-attention": worst("full-attention"),
                  "old full-attention": worst("full-attention", old_cache=True), "stock": worst("stock")}))
"""


def test_full_attention_emulation_sees_the_whole_context(ref_python: Path) -> None:
    """Every emulated semantics computes, step by step in the reference's cached loop, what a from-scratch drafter
    forward over the whole context computes: the full-attention emulation (0.20.1's) sees every context token.
    Negative control: with the reference's own sliding cache (the emulation before issue 18) it does not."""
    got = json.loads(_in_ref(ref_python, _EMULATION_CHECK).strip().splitlines()[-1])
    for mode in ("reference", "full-attention", "stock"):
        assert got[mode]["steps"] >= 10 and got[mode]["context"] > 3 * 16, got
        assert got[mode]["err"] < 1e-4, (mode, got)
    assert got["old full-attention"]["err"] > 1e-2, got


def test_each_miniature_is_keyed_by_what_trains_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrid miniature trains with train.py's code plus train_hybrid.py: a change to train_hybrid.py retrains it
    alone, a change to train.py or corpus.py both (the Qwen3 miniature's key never hashes train_hybrid.py)."""
    ref = tmp_path / "envs" / "dflash-ref-abc" / "bin" / "python"
    copies = {}
    for src in (*host.TRAINING_SOURCES, host.KINDS["hybrid"][1][0]):
        copies[src.name] = tmp_path / src.name
        copies[src.name].write_bytes(src.read_bytes())
    monkeypatch.setattr(host, "TRAINING_SOURCES", (copies["train.py"], copies["corpus.py"]))
    monkeypatch.setitem(host.KINDS, "hybrid", (host.KINDS["hybrid"][0], (copies["train_hybrid.py"],)))
    keys = {kind: host.mini_key(ref, kind=kind) for kind in host.KINDS}
    assert keys["qwen3"] != keys["hybrid"]
    for name, moves in (
        ("train_hybrid.py", {"hybrid"}),
        ("train.py", {"qwen3", "hybrid"}),
        ("corpus.py", {"qwen3", "hybrid"}),
    ):
        before = copies[name].read_bytes()
        copies[name].write_bytes(before + b"\n# changed\n")
        now = {kind: host.mini_key(ref, kind=kind) for kind in host.KINDS}
        assert {k for k in keys if now[k] != keys[k]} == moves, name
        copies[name].write_bytes(before)
    assert {kind: host.mini_key(ref, kind=kind) for kind in host.KINDS} == keys


def test_a_cpu_builds_profile_names_a_miniature_by_its_prompts(manifest: Manifest) -> None:
    """`@mini` serves the Qwen3 miniature, `@mini-hybrid` the hybrid one, each with its own target and drafter
    placeholders; any other prompt set is refused in one line."""
    assert miniature.MINIATURES == {"@mini": "qwen3", "@mini-hybrid": "hybrid"}
    assert set(miniature.MINIATURES.values()) == set(host.KINDS)
    hybrid = manifest.profiles["mini-cpu-hybrid"]
    assert miniature.miniature_of(hybrid) == "@mini-hybrid"
    miniature._check_profile(hybrid, {"num_speculative_tokens": 7})
    with pytest.raises(ManifestError, match="its target must be '@mini-hybrid/target'"):
        miniature._check_profile(replace(hybrid, target="@mini/target"), {"num_speculative_tokens": 7})
    with pytest.raises(ManifestError, match="its prompts must name a miniature, not 'mixed'"):
        miniature.miniature_of(replace(hybrid, prompts="mixed"))


def test_reference_loop_cache_key_covers_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = []
    for src in host.REFLOOP_SOURCES:
        copy = tmp_path / src.name
        copy.write_bytes(src.read_bytes())
        sources.append(copy)
    monkeypatch.setattr(host, "REFLOOP_SOURCES", tuple(sources))
    assert {s.name for s in sources} == {"refloop.py", "reference.py", "host.py"}  # the loop, its loading, its job
    models, job = tmp_path / "abc123", {"semantics": ["reference"], "prompts": 32, "max_tokens": 96}
    key = host.refloop_key(models, job)
    assert host.refloop_key(models, dict(job)) == key  # the same inputs: the same key (the cache is reused)
    assert host.refloop_key(tmp_path / "def456", job) != key  # other models
    assert host.refloop_key(models, {**job, "prompts": 33}) != key  # another job
    for src in sources:  # a change to any source that shapes the result (e.g. the loop's pooling)
        before = src.read_bytes()
        src.write_bytes(before + b"\n# changed\n")
        assert host.refloop_key(models, job) != key, src.name
        src.write_bytes(before)
    assert host.refloop_key(models, job) == key


_NEAR_TIES = """
import json, sys
from pathlib import Path
import torch
from dflash.model import DFlashDraftModel
from transformers import Qwen3ForCausalLM
from vllm_dflash.mini import refloop, train
torch.set_num_threads(1)
out = Path(sys.argv[1])
cfg = train.merge_config({})
torch.manual_seed(0)
Qwen3ForCausalLM(train.target_config(cfg)).eval().save_pretrained(out / "target")
DFlashDraftModel(train.drafter_config(cfg)).eval().save_pretrained(out / "drafter")
(out / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "12. copy ab3 -> ab3\\n13. spell "}) + "\\n")
mini = refloop.Mini.load(out)
ids, _ = mini.greedy(list("12. copy ab3 -> ab3\\n13. spell ".encode()), 8)
logits = mini.target(torch.tensor([list("12. copy ab3 -> ab3\\n13. spell ".encode()) + ids[:3]])).logits[0, -1]
worst = int(torch.argmin(logits))
job = {"models": str(out), "mismatches": [
    {"id": "p0", "position": 3, "reference_ids": ids, "got_token": ids[3]},
    {"id": "p0", "position": 3, "reference_ids": ids, "got_token": worst},
    {"id": "p0", "position": 3, "reference_ids": ids, "got_token": None}]}
print(json.dumps(refloop.near_ties(job)))
"""


def test_near_ties_tells_a_flip_from_a_bug(ref_python: Path, tmp_path: Path) -> None:
    """A differing token is a near-tie only when its logit is within the tolerance of the target's top logit: the
    target's own greedy token (gap 0) is one; its lowest-logit token, or an output that ended early, is a bug."""
    code = _NEAR_TIES.replace("sys.argv[1]", repr(str(tmp_path)))
    same, low, short = json.loads(_in_ref(ref_python, code).strip().splitlines()[-1])
    assert same["near_tie"] is True and same["gap"] == 0.0 and same["target_top_token"] == same["reference_token"]
    assert low["near_tie"] is False and low["gap"] > 1e-3
    assert short["near_tie"] is False and short["gap"] is None


# ---- the trained miniature (slow: trains on a cache miss) ---------------------------------------------------


@pytest.fixture(scope="session")
def mini_models(ref_python: Path) -> Path:
    return host.ensure_mini_models(ref_python)


@pytest.mark.slow
def test_mini_models_have_the_layout_vllm_reads(mini_models: Path) -> None:
    d = json.loads((mini_models / "drafter" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert d["use_sliding_window"] is True and d["sliding_window"] == 16
    assert d["dflash_config"] == {"target_layer_ids": [1, 2, 3], "mask_token_id": train.MASK_TOKEN_ID}
    assert d["block_size"] == 8 and d["num_target_layers"] == 6
    t = json.loads((mini_models / "target" / "config.json").read_text())
    assert t["architectures"] == ["Qwen3ForCausalLM"] and t["num_hidden_layers"] == 6
    assert t["vocab_size"] == d["vocab_size"] == train.VOCAB and t["hidden_size"] == d["hidden_size"]
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (mini_models / "target" / name).is_file()
    meta = host.model_config(mini_models)
    assert meta["num_speculative_tokens"] == 7 and meta["max_tokens"] == 96
    assert meta["figures"]["packed_vs_reference_max_abs"] < 1e-4
    prompts = host.read_prompts(mini_models)
    assert len(prompts) >= 100 and len({p["id"] for p in prompts}) == len(prompts)
    assert set(prompts[0]) == {"id", "prompt"}
    corpus.assert_disjoint([corpus.Prompt(**p) for p in prompts], _training_docs())


@pytest.mark.slow
def test_reference_loop_is_lossless_and_beats_stock_semantics(
    ref_python: Path, mini_models: Path, tmp_path: Path
) -> None:
    result: dict[str, Any] = host.run_refloop(
        ref_python, mini_models, tmp_path / "refloop.json", semantics=["reference", "stock"], prompts=12
    )
    modes = result["modes"]
    for mode in ("reference", "stock"):
        assert modes[mode]["lossless"], f"{mode}: the loop's output must equal the target's plain greedy output"
        assert modes[mode]["literal"]["outputs_equal"]
    ref_al = modes["reference"]["pooled"]["acceptance_length"]
    stock_al = modes["stock"]["pooled"]["acceptance_length"]
    assert ref_al > 4.0, ref_al
    assert stock_al < 0.9 * ref_al, (ref_al, stock_al)
