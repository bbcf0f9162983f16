"""The KV-cache blocks each group held when a request finished, read from a vLLM server log.

Our build's scheduler logs one line per finished request when the server runs with VLLM_DFLASH_LOG_KV_BLOCKS=1
(patch 0005): `KV blocks held at finish: {"request", "prompt_tokens", "output_tokens", "computed_tokens", "groups":
[{"gid", "spec", "window", "block_size", "layers", "drafter_layers", "held"}]}`. A validation report keeps the line of
the longest request, so it says whether the drafter's sliding-window groups kept their window while the full ones
held the whole context. A build without that patch (stock) logs nothing: no entry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

LOG_ENV = "VLLM_DFLASH_LOG_KV_BLOCKS"
MARKER = "KV blocks held at finish: "


def parse(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Every finished request's entry in the log (a line that does not parse is skipped, not guessed at)."""
    out: list[dict[str, Any]] = []
    for line in lines:
        _, sep, payload = line.partition(MARKER)
        if not sep:
            continue
        try:
            entry = json.loads(payload)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("groups"), list):
            out.append(entry)
    return out


def longest(entries: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The entry of the longest prompt (the longest sequence among equal prompts), with each group's
    `context_blocks`: the blocks its computed tokens cover. A group that frees nothing holds at least that many (its
    slots for the drafted tokens too); a sliding-window group that freed blocks holds fewer."""
    best = max(entries, key=lambda e: (int(e["prompt_tokens"]), int(e["computed_tokens"])), default=None)
    if best is None:
        return None
    tokens = int(best["computed_tokens"])
    groups = [{**g, "context_blocks": -(-tokens // int(g["block_size"]))} for g in best["groups"]]
    return {**best, "groups": groups}


def from_log(path: Path | None) -> dict[str, Any] | None:
    """The longest request's entry in a server log (None: no log, or a build that does not log it)."""
    if path is None or not path.is_file():
        return None
    return longest(parse(path.read_text(errors="replace").splitlines()))


def describe(entry: Mapping[str, Any]) -> str:
    """One line: the blocks each group holding drafter layers held, against the blocks its context covers."""
    parts = []
    for g in entry["groups"]:
        if not g.get("drafter_layers"):
            continue
        kind = f"sliding window {g['window']}" if g.get("window") else "full"
        parts.append(f"group {g['gid']} ({kind}, {g['drafter_layers']} drafter layer(s)) {g['held']}")
    blocks = entry["groups"][0]["context_blocks"] if entry["groups"] else 0
    return (
        f"KV blocks held at the end of the longest prompt ({entry['prompt_tokens']} prompt + "
        f"{entry['output_tokens']} output tokens, {blocks} blocks of context): "
        + ("; ".join(parts) or "no group holds drafter layers")
    )
