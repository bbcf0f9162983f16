"""Train the hybrid miniature: the miniature of train.py on the user's target family, a tiny Qwen3.5/3.6-shaped
hybrid target (Gated DeltaNet and gated full-attention layers, 3 : 1, `Qwen3_5ForConditionalGeneration` as vLLM
0.20.1 serves Qwen3.6-27B), and a DFlash drafter with z-lab/Qwen3.6-27B-DFlash's layer kinds (4 sliding + 1 full)
whose taps fall on both kinds of target layer.

Runs inside the dflash reference environment:
`python -m vllm_dflash.mini.train_hybrid '{"out": DIR, "config": {...}}'` ("config" overrides HYBRID_CONFIG, which
overrides train.DEFAULT_CONFIG, key by key, one level deep). The host side (`host.ensure_mini_models(...,
kind="hybrid")`) caches DIR under a hash of this file, train.py, corpus.py, the tokenizer code and the config.

Everything but the target's class is train.py's own: the corpus, the target's training loop, the drafter's data, its
packed training with the reference's semantics and the check of that packing, the held-apart prompts, the files
written. `train.build` looks its target trainer up when it runs; here that is `train_target` below, for the duration
of the call, so train.py itself (and with it the Qwen3 miniature's cache key) stays as it is.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_dflash.mini import train

LINEAR = "linear_attention"
FULL_INTERVAL = 4  # every fourth target layer full attention, the others Gated DeltaNet (Qwen3.6-27B: 48 + 16)

# What this miniature changes in train.DEFAULT_CONFIG. The target: 8 layers (GDN x 3, then full; twice). The drafter:
# 4 sliding + 1 full layers tapping target layers 1, 2, 5, 6 (GDN) and 3 (full), with a window (16) well below the
# prompts. Shorter than the Qwen3 miniature, as far as the AL stays meaningful: a GDN training step costs about 4x an
# attention one on CPU (transformers' chunked torch path), and the target's loss at 200 steps (0.55) is the Qwen3
# miniature's at ~500; 1024 drafter sequences and 160 steps (accepted 6.5 of 7 per block, teacher-forced); 32
# held-apart prompts up to 128 tokens (what the profile serves) and 64 tokens generated per prompt. Measured
# 2026-12-06 on 2 cores at load 6-9: 16.5 min wall, 6.3 min of CPU; the reference loop's AL 6.485, 1.318 with vLLM
# 0.20.1's taps and attention emulated in it.
HYBRID_CONFIG: dict[str, Any] = {
    "target": {"layers": 8, "steps": 200, "seq_len": 208},
    "drafter": {
        "layer_types": [train.SLIDING] * 4 + [train.FULL],
        "target_layer_ids": [1, 2, 3, 5, 6],
        "sequences": 1024,
        "steps": 160,
    },
    "prompts": {"count": 32, "candidates": 48, "max_len": 128},
    "max_tokens": 64,
}


def merge_config(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """train.DEFAULT_CONFIG with HYBRID_CONFIG, then `overrides`, applied (unknown keys refused, as train.py does)."""
    cfg = train.merge_config(HYBRID_CONFIG)
    for key, value in (overrides or {}).items():
        if key not in cfg:
            raise KeyError(f"unknown mini config key {key!r}")
        if isinstance(cfg[key], dict):
            unknown = set(value) - set(cfg[key])
            if unknown:
                raise KeyError(f"unknown mini config keys {sorted(unknown)} under {key!r}")
            cfg[key].update(value)
        else:
            cfg[key] = value
    return cfg


def layer_types(n: int) -> list[str]:
    return [train.FULL if (i + 1) % FULL_INTERVAL == 0 else LINEAR for i in range(n)]


def target_config(cfg: dict[str, Any]) -> Any:
    """A Qwen3_5Config: the text model with train.py's dimensions and the 3 : 1 layout (value heads sharing key
    heads, as in Qwen3.6-27B; Qwen3.5's partial interleaved M-RoPE), and a one-block vision tower that text-only
    serving never builds."""
    from transformers import Qwen3_5Config

    m, n = cfg["model"], cfg["target"]["layers"]
    text = {
        "vocab_size": train.VOCAB,
        "hidden_size": m["hidden"],
        "intermediate_size": m["intermediate"],
        "num_hidden_layers": n,
        "layer_types": layer_types(n),
        "full_attention_interval": FULL_INTERVAL,
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"],
        "head_dim": m["head_dim"],
        "linear_num_key_heads": m["kv_heads"],
        "linear_num_value_heads": m["heads"],
        "linear_key_head_dim": m["head_dim"],
        "linear_value_head_dim": m["head_dim"],
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": m["max_positions"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "bos_token_id": train.EOS_TOKEN_ID,
        "eos_token_id": train.EOS_TOKEN_ID,
        "pad_token_id": train.EOS_TOKEN_ID,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": m["hidden"],
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
    }
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=300,
        video_token_id=301,
        vision_start_token_id=302,
        vision_end_token_id=303,
    )


def train_target(cfg: dict[str, Any], docs: list[str], log: list[dict[str, Any]]) -> Any:
    """train.train_target's loop on the hybrid target (its language model; the vision tower takes no gradient)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    t = cfg["target"]
    torch.manual_seed(cfg["seed"])
    model = Qwen3_5ForConditionalGeneration(target_config(cfg)).train()
    params = [p for name, p in model.named_parameters() if ".visual." not in f".{name}"]
    opt = torch.optim.AdamW(params, lr=t["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    batch, seq_len = t["batch"], t["seq_len"]
    t0 = time.perf_counter()
    for step in range(t["steps"]):
        chunk = docs[step * batch : (step + 1) * batch]
        x = torch.tensor([train.encode(d[:seq_len]) for d in chunk])
        for g in opt.param_groups:
            g["lr"] = train.lr_at(step, t["steps"], t["lr"], t["warmup"])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == t["steps"] - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.perf_counter() - t0, 1)})
            print(f"hybrid target step {step}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model.eval()


@contextmanager
def _hybrid_target() -> Iterator[None]:
    saved = train.train_target
    train.train_target = train_target
    try:
        yield
    finally:
        train.train_target = saved


def build(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    with _hybrid_target():
        return train.build(cfg, out)


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"out": model directory to write, "config": overrides of HYBRID_CONFIG}."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    manifest = build(merge_config(job.get("config")), Path(job["out"]))
    f = manifest["figures"]
    print(
        f"hybrid mini models in {job['out']}: target {f['target_s']} s, drafter data {f['drafter_data_s']} s, "
        f"drafter {f['drafter_s']} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
