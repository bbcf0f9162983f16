"""The reference side's own parts, shared by the conformance oracle and the miniature's reference loop (both run in the
dflash reference environment: torch, transformers 5.x, dflash 0.1.0; imported lazily so the host can import this).

- `load_target`: the target as transformers builds the class its config.json names (`Qwen3ForCausalLM`, or for the
  user's hybrid family `Qwen3_5ForConditionalGeneration` with its torch Gated DeltaNet path).
- `linear_state_rollback`: dflash 0.1.0's `dflash_generate` made exact on a hybrid target (see there).

Kept apart from oracle.py so that the miniature's reference-loop cache (mini/host.py REFLOOP_SOURCES) depends on
these lines only, not on the oracle's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def load_target(path: Path) -> Any:
    """The target as transformers builds the class its config.json names (fp32, eval): the oracle recomputes with
    that class's own forward, so a hybrid Qwen3.5/3.6 target runs transformers' torch Gated DeltaNet layers."""
    import torch
    import transformers

    names = json.loads((path / "config.json").read_text()).get("architectures") or []
    cls = getattr(transformers, str(names[0]), None) if len(names) == 1 else None
    if cls is None:
        raise ValueError(f"{path}: config.json names {names!r}, not one transformers class")
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def decoder_layers(target: Any) -> Any:
    """The target's decoder layers: `model.layers`, or the language model's inside a multimodal class."""
    inner = getattr(target.model, "language_model", target.model)
    return inner.layers


def has_linear_layers(target: Any) -> bool:
    """Whether the target has linear-attention (Gated DeltaNet) layers: a hybrid whose recurrent state a cache crop
    cannot roll back (see `linear_state_rollback`)."""
    return "linear_attention" in (getattr(target.config.get_text_config(), "layer_types", None) or ())


@contextmanager
def linear_state_rollback(target: Any) -> Iterator[None]:
    """dflash 0.1.0's `dflash_generate`, made exact on a hybrid target. The loop verifies a block with one target
    forward on its cache, then crops the cache to the accepted tokens (`_crop_to`). transformers' linear-attention
    cache layers (5.15 `cache_utils.LinearAttentionCacheLayerMixin.crop`) crop their recorded conv window, but the
    recurrent state is the one after the whole block (`modeling_qwen3_5` stores only the final state), so after a
    rejection the next step starts from a state that has seen the rejected drafts. Here every verify forward on a
    cache that holds a context is preceded by a copy of that cache, and a crop that removes tokens puts the copy back
    and runs the target over the kept tokens again (a causal model: the same states for them)."""
    import copy

    import dflash.model as dm

    orig_forward, orig_crop = target.forward, dm._crop_to
    saved: dict[int, tuple[Any, Any, Any]] = {}

    def forward(input_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:
            saved[id(cache)] = (copy.deepcopy(cache), input_ids, kwargs.get("position_ids"))
        return orig_forward(input_ids, *args, **kwargs)

    def crop_to(cache: Any, length: int) -> None:
        before = saved.pop(id(cache), None)
        if before is not None and cache.get_seq_length() > length:
            copy_, ids, positions = before
            kept = length - copy_.get_seq_length()
            cache.layers = copy_.layers
            orig_forward(
                input_ids=ids[:, :kept],
                position_ids=None if positions is None else positions[..., :kept],
                past_key_values=cache,
                use_cache=True,
            )
        orig_crop(cache, length)

    target.forward, dm._crop_to = forward, crop_to
    try:
        yield
    finally:
        del target.forward  # the class's own again
        dm._crop_to = orig_crop
