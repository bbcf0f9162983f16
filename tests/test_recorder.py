"""The conformance recorder (tests/conformance_plugin), on stand-ins of the four vLLM methods it wraps: it stores
what propose() returned -- also when that is not the argmax of the logits it recorded -- split per request block,
records only inside propose(), returns what each wrapped method returns, and writes nothing off rank 0 or without
its file. (vLLM itself proposing ids other than its argmax is test_conformance's recorder test, a real run.)"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "conformance_plugin"))

from vllm_dflash_conformance_plugin import recorder

K, VOCAB = 2, 5
MASK = 4


def _logits(argmax: list[int]) -> list[list[float]]:
    return [[10.0 if v == a else float(v) for v in range(VOCAB)] for a in argmax]


class Drafter:
    """The drafter model: forward over the stacked blocks, logits for the mask rows."""

    def forward(self, input_ids: list[int], positions: list[int]) -> str:
        return "hidden"

    def compute_logits(self, hidden: str) -> list[list[float]]:
        return _logits(self.argmax)

    argmax: ClassVar[list[int]] = []


class Proposer:
    """propose(): runs the drafter over every request's [bonus, mask x k] block and returns `self.returns`."""

    def __init__(self, drafter: Drafter, blocks: list[tuple[int, int]], returns: list[list[int]]) -> None:
        self.drafter, self.blocks, self.returns = drafter, blocks, returns

    def propose(self) -> list[list[int]]:
        ids = [t for bonus, _ in self.blocks for t in [bonus] + [MASK] * K]
        pos = [p for _, start in self.blocks for p in range(start, start + K + 1)]
        self.drafter.compute_logits(self.drafter.forward(ids, pos))
        return self.returns


class Runner:
    def __init__(self, proposer: Proposer, prompts: dict[str, list[int]]) -> None:
        self.proposer = proposer
        self.input_batch = SimpleNamespace(req_ids=list(prompts))
        self.requests = {rid: SimpleNamespace(prompt_token_ids=p) for rid, p in prompts.items()}

    def propose_draft_token_ids(self) -> list[list[int]]:
        return self.proposer.propose()


@pytest.fixture
def classes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Any, Any, Any, Path]]:
    """Fresh stand-in classes wrapped once, and the record file."""
    d = type("D", (Drafter,), {"argmax": [1, 2, 3, 0]})
    p = type("P", (Proposer,), {})
    r = type("R", (Runner,), {})
    recorder.wrap(d, p, r)
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv(recorder.RECORD_FILE_VAR, str(path))
    monkeypatch.delenv(recorder.PERTURB_VAR, raising=False)
    monkeypatch.setattr(recorder, "_tp_rank", lambda: 0)
    recorder._state.update(call=0, runner=None, active=False, block=None, logits=None)
    yield d, p, r, path


def _all_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _lines(path: Path) -> list[dict[str, Any]]:
    """The proposal lines (the layout line, what the loaded drafter attends with, is apart)."""
    return [line for line in _all_lines(path) if "layout" not in line]


def test_it_stores_what_propose_returned_not_the_argmax(classes: tuple[Any, Any, Any, Path]) -> None:
    d, p, r, path = classes
    proposed = [[0, 0], [4, 4]]  # neither block's argmax ([1, 2] and [3, 0])
    runner = r(p(d(), [(7, 10), (8, 20)], proposed), {"a": [1, 2], "b": [3]})
    assert runner.propose_draft_token_ids() == proposed  # returned unchanged
    a, b = _lines(path)
    assert (a["draft_ids"], b["draft_ids"]) == (proposed[0], proposed[1])
    assert [row.index(max(row)) for row in a["logits"]] == [1, 2] and len(b["logits"]) == K
    assert a["block_input_ids"] == [7, MASK, MASK] and b["block_positions"] == [20, 21, 22]
    assert (a["req_id"], a["prompt_len"], a["prompt_sha"]) == ("a", 2, recorder.prompt_sha([1, 2]))
    assert (a["call"], a["index"], b["index"], a["batch"]) == (1, 0, 1, 2)
    runner.propose_draft_token_ids()
    assert _lines(path)[-1]["call"] == 2  # each proposal step its own call number
    layouts = [line["layout"] for line in _all_lines(path) if "layout" in line]
    assert layouts == [{"windows": [], "aux_layers": None, "fed": None}], "one layout line per record file, first"
    assert "layout" in _all_lines(path)[0]


def test_perturbing_returns_and_records_ids_other_than_the_argmax(
    classes: tuple[Any, Any, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, p, r, path = classes
    monkeypatch.setenv(recorder.PERTURB_VAR, "1")
    argmax = [[1, 2], [3, 0]]
    runner = r(p(d(), [(7, 10), (8, 20)], argmax), {"a": [1], "b": [2]})
    got = runner.propose_draft_token_ids()
    assert got == [[2, 2], [4, 0]]  # the first id of each request moved one up: what vLLM then verifies
    assert [line["draft_ids"] for line in _lines(path)] == got
    assert recorder.perturbed([[VOCAB - 1, 1]], VOCAB) == [[0, 1]]


def test_only_a_proposal_step_is_recorded_and_only_where_asked(
    classes: tuple[Any, Any, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    d, p, r, path = classes
    drafter = d()
    assert drafter.forward([1], [0]) == "hidden" and drafter.compute_logits("h") == _logits([1, 2, 3, 0])
    assert recorder._state["block"] is None and recorder._state["logits"] is None  # outside propose(): nothing
    proposer = p(drafter, [(7, 10)], [[1, 2]])
    monkeypatch.setattr(recorder, "_tp_rank", lambda: 1)
    proposer.propose()
    assert not path.exists(), "a rank other than 0 recorded"
    monkeypatch.setattr(recorder, "_tp_rank", lambda: 0)
    monkeypatch.delenv(recorder.RECORD_FILE_VAR)
    proposer.propose()
    assert not path.exists(), "recorded without a record file"
    monkeypatch.setenv(recorder.RECORD_FILE_VAR, str(path))
    proposer.propose()  # no runner called it: the requests are unknown, the line says so
    (line,) = _lines(path)
    assert (line["req_id"], line["prompt_sha"], line["draft_ids"]) == (None, None, [1, 2])
    assert recorder._state["runner"] is None and not recorder._state["active"]
    before = (d.forward, p.propose)
    recorder.wrap(d, p, r)  # once per class
    assert (d.forward, p.propose) == before


def test_a_step_with_fewer_rows_than_drafts_is_refused() -> None:
    lines = recorder.block_lines([[1, 2]], [7, MASK, MASK], [0, 1, 2], _logits([1, 2]), [{"req_id": "a"}], 1, 9)
    assert len(lines) == 1 and lines[0]["logits"] == _logits([1, 2])
    with pytest.raises(RuntimeError, match="2 request"):
        recorder.block_lines([[1, 2], [3, 4]], [7, MASK, MASK] * 2, [0, 1, 2] * 2, _logits([1, 2, 3]), [{}] * 2, 1, 9)
    with pytest.raises(RuntimeError, match="5 block tokens"):
        recorder.block_lines([[1, 2], [3, 4]], [7, MASK, MASK, 8, MASK], [0] * 5, _logits([1, 2, 3, 4]), [{}] * 2, 1, 9)
    assert recorder.requests_of(object(), 2) == [{"req_id": None, "prompt_len": None, "prompt_sha": None}] * 2
    empty = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["x"]), requests={})
    assert recorder.requests_of(empty, 1) == [{"req_id": "x", "prompt_len": 0, "prompt_sha": None}]


def test_install_wraps_vllms_classes_only_with_a_record_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """install() finds the drafter model, the proposer and the runner where vLLM 0.20.1 keeps them (stand-in modules
    here; the conformance runs use the real ones) and wraps them only when a record file is named."""
    import types

    d: Any = type("D", (Drafter,), {"argmax": [1, 2]})
    p: Any = type("P", (Proposer,), {})
    r: Any = type("R", (Runner,), {})

    class Manager:  # the KV recorder's classes: allocate_slots / free / the scheduler's __init__
        def allocate_slots(self, *args: object, **kwargs: object) -> None: ...
        def free(self, request: object) -> None: ...

    class Scheduler:
        def __init__(self) -> None: ...

    where = {
        "vllm.model_executor.models.qwen3_dflash": ("DFlashQwen3ForCausalLM", d),
        "vllm.v1.spec_decode.dflash": ("DFlashProposer", p),
        "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", r),
        "vllm.v1.core.kv_cache_manager": ("KVCacheManager", Manager),
        "vllm.v1.core.sched.scheduler": ("Scheduler", Scheduler),
    }
    for name, (attr, cls) in where.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = sys.modules.get(".".join(parts[:i])) or types.ModuleType(".".join(parts[:i]))
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), mod)
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], mod)
        setattr(sys.modules[name], attr, cls)
    monkeypatch.delenv(recorder.RECORD_FILE_VAR, raising=False)
    recorder.install()
    assert not getattr(d, "_vllm_dflash_recorder", False), "wrapped without a record file"
    monkeypatch.setenv(recorder.RECORD_FILE_VAR, str(tmp_path / "r.jsonl"))
    recorder.install()
    assert (
        d._vllm_dflash_recorder
        and d.forward is not Drafter.forward
        and d.compute_logits is not (Drafter.compute_logits)
    )
    assert p.propose is not Proposer.propose and r.propose_draft_token_ids is not Runner.propose_draft_token_ids
    assert all(getattr(f, "__wrapped__", None) for f in (Manager.allocate_slots, Manager.free, Scheduler.__init__))


def test_the_pool_divisor_is_called_as_each_release_defines_it() -> None:
    """vLLM's `_pool_bytes_per_block` took the groups alone in 0.20.1 and the config too from 0.25: the recorder
    calls each release's signature (every 0.25.1 case was refused with a TypeError when it called one form), and
    records None where a release has no such function."""
    groups, config = ["g0", "g1"], SimpleNamespace(packed=True)

    def old(kv_cache_groups: list[str]) -> int:
        return 100 * len(kv_cache_groups)

    def new(vllm_config: SimpleNamespace, kv_cache_groups: list[str]) -> int:
        return 7 * len(kv_cache_groups) + (1 if vllm_config.packed else 0)

    assert recorder._pool_bytes_per_block(SimpleNamespace(_pool_bytes_per_block=old), config, groups) == 200
    assert recorder._pool_bytes_per_block(SimpleNamespace(_pool_bytes_per_block=new), config, groups) == 15
    assert recorder._pool_bytes_per_block(SimpleNamespace(), config, groups) is None


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id, self.is_null = block_id, False


class _Manager:
    """A KV-cache manager with one group: what `_record_alloc` reads of vLLM's."""

    def __init__(self) -> None:
        self.group = SimpleNamespace(req_to_blocks={})
        self.coordinator = SimpleNamespace(single_type_managers=[self.group])

    def hold(self, rid: str, ids: list[int]) -> None:
        self.group.req_to_blocks[rid] = [_Block(i) for i in ids]
        recorder._record_alloc(self, SimpleNamespace(request_id=rid, num_computed_tokens=0), 1, 0, 0)


def test_a_new_kv_manager_at_a_freed_ones_address_starts_with_nothing_evicted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One process runs engine after engine: a manager made where a freed one lived must not count the blocks that one
    evicted as handed out again (a full-KV run once read 8 "reused" blocks that way)."""
    monkeypatch.setenv(recorder.RECORD_FILE_VAR, str(tmp_path / "trace"))
    # Every object gets one id() in the recorder, as a manager made at a freed one's address does: state kept in a
    # table keyed by id(manager) is inherited then. (Waiting for CPython to hand the freed address out again was
    # not deterministic: a warm tier's worker once made 10,000 managers elsewhere.)
    monkeypatch.setattr(recorder, "id", lambda _obj: 1, raising=False)
    first = _Manager()
    first.hold("a", [1, 2, 3])
    first.hold("a", [3, 4])  # 1 and 2 fall out of a window while "a" runs
    first.hold("b", [1])  # ... and come back for another request: that is a reuse
    del first
    second = _Manager()
    second.hold("c", [2, 5])  # a whole-context run: nothing freed mid-request
    second.hold("c", [2, 5, 6])
    lines = [json.loads(line) for line in (tmp_path / ("trace" + recorder.KV_SUFFIX)).read_text().splitlines()]
    assert [rec["alloc"]["reused"] for rec in lines] == [0, 0, 1, 0, 0]
