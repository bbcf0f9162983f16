"""Host side of the miniature (stdlib + vllm_dflash only; runs in the tool's venv).

    ref = vllm_dflash.envs.reference_python(manifest)
    models = ensure_mini_models(ref)              # trained once, cached
    result = run_refloop(ref, models, out=...)    # the reference loop's AL, all semantics

The trained models are cached, not committed: under cache_dir()/mini/<key>, where the key hashes the training code
(train.py, corpus.py and the tokenizer functions it reuses from conformance/tiny.py), the config overrides and the
reference environment it ran in. Training is deterministic on one machine (fixed seeds, one thread, deterministic
algorithms), but CPU float kernels differ across CPU types, so committed weights could not be checked against
their script cheaply or portably; the gates compare two loops on the same cached models, so they do not need
bit-identical models across machines. mini.json records the weights' sha256 for comparison.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_dflash import proc
from vllm_dflash.errors import ConformanceError
from vllm_dflash.fetch import cache_dir
from vllm_dflash.paths import ensure_dir

_HERE = Path(__file__).resolve().parent
# The source files whose change may change the trained models.
TRAINING_SOURCES = (_HERE / "train.py", _HERE / "corpus.py")
# The miniatures: a Qwen3 target (train.py), and the user's hybrid family (train_hybrid.py, which trains with
# train.py's own code and adds its file to the key). Kind -> (training module, the sources it adds to the key).
KINDS: dict[str, tuple[str, tuple[Path, ...]]] = {
    "qwen3": ("vllm_dflash.mini.train", ()),
    "hybrid": ("vllm_dflash.mini.train_hybrid", (_HERE / "train_hybrid.py",)),
}
# The placeholder prompt set a cpu-builds profile names, and the miniature it serves (validate/miniature.py): the
# set's held-apart prompts, `<set>/target` and `<set>/drafter`.
PROMPT_SETS = {"@mini": "qwen3", "@mini-hybrid": "hybrid"}
# The source files whose change may change the reference loop's result on given models: the loop itself, how the
# reference side loads a target and runs its loop (conformance/reference.py), and this module (the job it is
# handed, the environment it runs in).
REFLOOP_SOURCES = (_HERE / "refloop.py", _HERE.parent / "conformance" / "reference.py", Path(__file__).resolve())
_BROKEN_ENV_HINT = "the reference environment is broken: delete it under the cache's envs/ and retry"


def _tokenizer_code() -> bytes:
    """What train.py reuses from the conformance package: only these functions and constants, so unrelated edits
    there do not retrain the miniature."""
    import inspect

    from vllm_dflash.conformance import cases, tiny

    parts = [inspect.getsource(tiny.byte_alphabet), inspect.getsource(tiny.build_tokenizer)]
    parts.append(repr((cases.VOCAB, cases.MASK_TOKEN_ID, cases.EOS_TOKEN_ID)))
    return "\n".join(parts).encode()


def mini_key(ref_python: Path, config: Mapping[str, Any] | None = None, kind: str = "qwen3") -> str:
    """Cache key: the training code, the tokenizer code it reuses, the config overrides and the reference env (and
    for the hybrid miniature its own training module)."""
    _, extra = KINDS[kind]
    h = hashlib.sha256()
    for src in (*TRAINING_SOURCES, *extra):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(_tokenizer_code())
    h.update(json.dumps(config or {}, sort_keys=True).encode())
    # The reference env's directory name carries the hash of its spec (torch, transformers versions).
    h.update(Path(ref_python).parents[1].name.encode())
    return h.hexdigest()[:12]


def refloop_key(models: Path, job: Mapping[str, Any]) -> str:
    """Cache key of a reference-loop result: the model directory (its name hashes the training code and the
    reference env), every source that shapes the result (REFLOOP_SOURCES) and the job's parameters."""
    h = hashlib.sha256()
    h.update(Path(models).name.encode())
    for src in REFLOOP_SOURCES:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(json.dumps(dict(job), sort_keys=True).encode())
    h.update(json.dumps(_environ(), sort_keys=True).encode())
    return h.hexdigest()[:12]


def _environ() -> dict[str, str]:
    return {
        "PYTHONPATH": str(_HERE.parents[1]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def ensure_mini_models(ref_python: Path, config: Mapping[str, Any] | None = None, kind: str = "qwen3") -> Path:
    """The cached miniature model directory (target/, drafter/, prompts.jsonl, mini.json), trained on a miss.

    `config` overrides the training module's defaults (tests use it for a quick small build); `kind` is one of KINDS.
    Concurrent callers wait on a lock; the directory appears only when complete (train.py renames it into place).
    """
    module, _ = KINDS[kind]
    base = ensure_dir(cache_dir() / "mini", "miniature cache directory")
    out = base / mini_key(ref_python, config, kind)
    with (base / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "mini.json").is_file():
            return out
        what = "the DFlash miniature" if kind == "qwen3" else f"the {kind} DFlash miniature"
        print(f"training {what} into {out} (a few minutes on 2 cores)", flush=True)
        proc.call(
            ref_python,
            "-m",
            module,
            json.dumps({"out": str(out), "config": dict(config or {})}),
            env=_environ(),
            error=ConformanceError,
            hint=_BROKEN_ENV_HINT,
        )
    return out


def _refloop(ref_python: Path, job: Mapping[str, Any]) -> dict[str, Any]:
    """One refloop.py job in the reference env; its result is the JSON it wrote to job["out"]."""
    proc.call(
        ref_python,
        "-m",
        "vllm_dflash.mini.refloop",
        json.dumps(job),
        env=_environ(),
        error=ConformanceError,
        hint=_BROKEN_ENV_HINT,
    )
    result: dict[str, Any] = json.loads(Path(str(job["out"])).read_text())
    return result


def run_refloop(
    ref_python: Path,
    models: Path,
    out: Path,
    semantics: Sequence[str] | None = None,
    prompts: int | None = None,
    max_tokens: int | None = None,
    literal: bool = True,
    check_lossless: bool = True,
) -> dict[str, Any]:
    """Run refloop.py in the reference env and return its result (also written to `out`)."""
    job: dict[str, Any] = {
        "models": str(models),
        "out": str(out),
        "literal": literal,
        "check_lossless": check_lossless,
    }
    if semantics is not None:
        job["semantics"] = list(semantics)
    if prompts is not None:
        job["prompts"] = prompts
    if max_tokens is not None:
        job["max_tokens"] = max_tokens
    return _refloop(ref_python, job)


def run_near_ties(
    ref_python: Path, models: Path, out: Path, mismatches: Sequence[Mapping[str, Any]], tolerance: float = 1e-5
) -> list[dict[str, Any]]:
    """refloop.near_ties in the reference env: for each mismatch, the target's logit gap at its first difference."""
    job = {"models": str(models), "out": str(out), "mismatches": list(mismatches), "tolerance": tolerance}
    rows: list[dict[str, Any]] = _refloop(ref_python, job)["near_ties"]
    return rows


def read_prompts(models: Path) -> list[dict[str, str]]:
    """The held-apart prompts ({"id", "prompt"}) of a mini model directory."""
    lines = (models / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def model_config(models: Path) -> dict[str, Any]:
    """mini.json of a model directory (config, max_tokens, num_speculative_tokens, training figures)."""
    data: dict[str, Any] = json.loads((models / "mini.json").read_text())
    return data
