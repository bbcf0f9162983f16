"""Tiny random target + DFlash drafter models for the conformance cases, saved the way vLLM 0.20.1 loads them.

Runs inside the dflash reference environment (torch 2.13.0, transformers 5.15.0, dflash 0.1.0):
`python -m vllm_dflash.conformance.tiny '{"out": DIR, "cases": [CASE, ...]}'`. The host side (compare.py) calls it
through `build_cases`, which caches each case directory under a hash of its spec (cases.CaseSpec.digest).

The drafter is instantiated from the reference package's own `DFlashDraftModel`, so its parameter names and config
keys are by construction the ones the reference reads; vLLM reads the same config.json through its EAGLE config path
(`architectures: ["DFlashDraftModel"]`, `dflash_config.target_layer_ids` / `mask_token_id`). The case's
`window_spelling` / `ids_spelling` then decide how config.json spells the window and the ids; a speculators-format
drafter keeps the plain config the reference loads in `reference_config.json` next to it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_dflash.conformance import cases as C
from vllm_dflash.paths import built_dir

CASE_FILE = "case.json"
REFERENCE_CONFIG = "reference_config.json"  # speculators-format drafters: the plain config the reference loads
# Larger than HF's default 0.02 so logits are O(1): wrong semantics then move logits by O(1), far above 1e-4.
INIT_STD = 0.1


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for the bytes 0..255, in byte order (GPT-2 convention)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def build_tokenizer(out: Path) -> None:
    """A byte-level tokenizer with exactly VOCAB ids, built locally (no hub): bytes 0..255, then special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|mask|>", *(f"<|reserved_{i}|>" for i in range(C.VOCAB - 258))]
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == C.VOCAB and tok.token_to_id("<|mask|>") == C.MASK_TOKEN_ID
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    # Name the plain fast class explicitly so any transformers (4.56+ in the vLLM env, 5.x here) loads it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=1))


def _common_config() -> dict[str, Any]:
    return {
        "vocab_size": C.VOCAB,
        "hidden_size": C.HIDDEN,
        "intermediate_size": 2 * C.HIDDEN,
        "num_attention_heads": 4,
        "num_key_value_heads": C.TARGET_KV_HEADS,
        "head_dim": C.HEAD_DIM,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": C.EOS_TOKEN_ID,
        "eos_token_id": C.EOS_TOKEN_ID,
        "pad_token_id": C.EOS_TOKEN_ID,
        "dtype": "float32",
    }


def _randomize_norms(model: Any, gen: Any) -> None:
    """RMSNorm weights start at 1; perturb them so a norm applied with the wrong weight cannot go unnoticed."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


def build_target(spec: C.CaseSpec, out: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if spec.hybrid_target:
        if spec.identity_target_layers or spec.zero_lm_head:
            raise ValueError(f"{spec.name}: identity layers and a zeroed lm_head are built for Qwen3 targets only")
        build_hybrid_target(out, spec.seed, spec.target_layer_types, C.HIDDEN)
        return

    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed + 1)
    config = Qwen3Config(**_common_config(), num_hidden_layers=spec.target_layers, architectures=["Qwen3ForCausalLM"])
    model = Qwen3ForCausalLM(config).eval()
    _randomize_norms(model, gen)
    with torch.no_grad():
        for i in spec.identity_target_layers:
            # A layer whose attention and MLP add nothing: its output equals its input, so "input of layer i"
            # and "output of layer i" are the same tensor and only the drafter's attention can differ.
            layer = model.model.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if spec.zero_lm_head:
            model.lm_head.weight.zero_()
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)


def build_hybrid_target(
    out: Path,
    seed: int,
    layer_types: Sequence[str],
    hidden: int = 128,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    head_dim: int = 32,
    conv_kernel: int = 4,
) -> None:
    """A tiny random Qwen3_5ForConditionalGeneration (the architecture vLLM 0.20.1 serves Qwen3.6-27B as) with its
    tokenizer in `out`: `layer_types` of Gated DeltaNet ("linear_attention") and gated full attention, a one-block
    vision tower that text-only serving never builds, norms perturbed (zero-centred in Qwen3.5: 1 + weight, so noise
    is added, not set around 1 as `_randomize_norms` does). The target of hybrid.py's target conformance and of the
    cases with `hybrid_target` (bump cases.HYBRID_GENERATOR_VERSION when what it writes changes)."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    text = {
        "vocab_size": C.VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_key_heads,
        "linear_num_value_heads": linear_value_heads,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": conv_kernel,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,  # logits O(1), as the other tiny models
        "tie_word_embeddings": False,
        # Qwen3.5's partial interleaved M-RoPE; text-only positions are the same on its three axes.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        "bos_token_id": 256,
        "eos_token_id": 256,
        "pad_token_id": 256,
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
    }
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=300,
        video_token_id=301,
        vision_start_token_id=302,
        vision_end_token_id=303,
    )
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at 1 (or 0): perturb them so a wrong norm weight shows
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)


DECOY_MASK_TOKEN_ID = 258  # a valid special token that is not the mask token


def decoy_target_layer_ids(spec: C.CaseSpec) -> list[int]:
    """Top-level target_layer_ids a build reading the wrong place would tap (ids_spelling "dflash_config")."""
    return [spec.target_layers - 1 - i for i in spec.target_layer_ids]


def drafter_config(spec: C.CaseSpec) -> Any:
    """The drafter's config as the reference package loads it (the "dropped" window is added to config.json later,
    after transformers has dropped it, exactly as a checkpoint written that way behaves)."""
    from transformers import Qwen3Config

    keep_window = spec.window_spelling == "sliding_window" and spec.sliding_window is not None
    dflash: dict[str, Any] = {"target_layer_ids": list(spec.target_layer_ids), "mask_token_id": C.MASK_TOKEN_ID}
    extra: dict[str, Any] = {"block_size": spec.block_size}
    if spec.window_spelling == "swa_window_size":
        dflash["swa_window_size"] = spec.sliding_window
    if spec.use_swa:
        dflash["use_swa"] = True
    if spec.dflash_causal is not None:
        dflash["causal"] = spec.dflash_causal
    if spec.is_causal is not None:
        extra["is_causal"] = spec.is_causal
    if spec.ids_spelling == "top_level":
        extra["target_layer_ids"] = dflash.pop("target_layer_ids")
    if spec.ids_spelling == "dflash_config":
        dflash["block_size"] = spec.block_size
        extra.update(
            block_size=2 * spec.block_size,
            target_layer_ids=decoy_target_layer_ids(spec),
            mask_token_id=DECOY_MASK_TOKEN_ID,
        )
    common = _common_config()
    if spec.drafter_heads is not None:
        common["num_attention_heads"], common["num_key_value_heads"] = spec.drafter_heads
    if spec.drafter_head_dim is not None:
        common["head_dim"] = spec.drafter_head_dim
    filled = spec.layer_types_spelling == "filled"  # transformers fills layer_types from max_window_layers
    return Qwen3Config(
        **common,
        num_hidden_layers=len(spec.layer_types),
        layer_types=None if filled else list(spec.layer_types),
        # transformers drops sliding_window unless use_sliding_window is set; the reference reads it from here.
        use_sliding_window=keep_window,
        sliding_window=spec.sliding_window if keep_window else None,
        max_window_layers=spec.max_window_layers if filled else 0,
        architectures=["DFlashDraftModel"],
        num_target_layers=spec.target_layers,
        dflash_config=dflash,
        **extra,
    )


def _spell_config(spec: C.CaseSpec, out: Path, cfg: dict[str, Any]) -> None:
    """Rewrite the saved config.json into the case's spelling (what a checkpoint written that way contains)."""
    if spec.layer_types_spelling == "filled":
        cfg.pop("layer_types", None)  # saved as transformers filled it: the checkpoint leaves it to transformers
    if spec.window_spelling == "dropped":
        cfg.pop("use_sliding_window", None)
        cfg["sliding_window"] = spec.sliding_window
    if spec.ids_spelling == "speculators":
        (out / REFERENCE_CONFIG).write_text(json.dumps(cfg, indent=1))
        layer = {k: v for k, v in cfg.items() if k not in ("architectures", "dflash_config", "block_size")}
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "speculators",
            "speculators_model_type": "dflash",
            "speculators_version": "0.3.0",
            # vLLM's indexing: hidden state entering layer L + 1 = output of layer L (DFlash id L).
            "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
            "mask_token_id": C.MASK_TOKEN_ID,
            "draft_vocab_size": C.VOCAB,
            "transformer_layer_config": layer,
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "dflash", "speculative_tokens": spec.num_speculative_tokens}],
                "default_proposal_method": "dflash",
                "verifier": {"name_or_path": "../target", "architectures": ["Qwen3ForCausalLM"]},
            },
        }
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def build_drafter(spec: C.CaseSpec, out: Path) -> None:
    import torch
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file, save_file

    torch.manual_seed(spec.seed + 100)
    gen = torch.Generator().manual_seed(spec.seed + 101)
    config = drafter_config(spec)
    model = DFlashDraftModel(config).eval()
    _randomize_norms(model, gen)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    kept = spec.sliding_window if spec.window_spelling == "sliding_window" else None
    got = (cfg.get("architectures"), cfg.get("layer_types"), cfg.get("sliding_window"), cfg.get("dflash_config"))
    want = (["DFlashDraftModel"], list(spec.layer_types), kept, config.dflash_config)
    if got != want or cfg.get("is_causal") != spec.is_causal:
        raise RuntimeError(f"drafter config.json for {spec.name} lost a field on save: {got} != {want}")
    _spell_config(spec, out, cfg)
    if spec.zero_lm_head:
        # The drafter's own lm_head (vLLM uses a drafter lm_head when the checkpoint has one; the reference always
        # uses the target's, which is zeroed too, so both sides compute all-zero logits).
        weights = out / "model.safetensors"
        tensors = load_file(weights)
        tensors["lm_head.weight"] = torch.zeros(C.VOCAB, C.HIDDEN)
        save_file(tensors, weights, metadata={"format": "pt"})


def prompts(spec: C.CaseSpec) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1000)
    # Byte tokens only (ids < 256): what a real prompt through the byte-level tokenizer could contain.
    if not spec.shared_prefix:
        return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in spec.prompt_lengths]
    prefix = torch.randint(0, 256, (spec.shared_prefix,), generator=gen).tolist()
    out = [
        prefix + torch.randint(0, 256, (n - spec.shared_prefix,), generator=gen).tolist() for n in spec.prompt_lengths
    ]
    if len({tuple(p) for p in out}) != len(out):
        raise RuntimeError(f"{spec.name}: prompts must differ after the shared prefix (the recorder maps by prompt)")
    return out


def token_budget(spec: C.CaseSpec) -> int:
    """The case's max_num_batched_tokens: its own, else above the longest prompt (no chunked prefill)."""
    if spec.max_num_batched_tokens is not None:
        return spec.max_num_batched_tokens
    return max(64, max(spec.prompt_lengths) + 2 * spec.block_size)


def build_case(spec: C.CaseSpec, out: Path) -> Path:
    """Write the case directory `out` atomically (built in a sibling temp dir, then renamed)."""
    with built_dir(out) as tmp:
        tmp.mkdir()
        build_target(spec, tmp / "target")
        build_drafter(spec, tmp / "drafter")
        case = C.CaseFile(
            name=spec.name,
            prompts=prompts(spec),
            num_speculative_tokens=spec.num_speculative_tokens,
            max_tokens=spec.max_tokens,
            seed=spec.seed,
            digest=spec.digest(),
            layer_types=list(spec.layer_types),
            target_layer_ids=list(spec.target_layer_ids),
            sliding_window=spec.sliding_window,
            attention=[list(a) for a in spec.attention],
            reference_attention=[list(a) for a in spec.reference_attention],
            decoy_target_layer_ids=decoy_target_layer_ids(spec) if spec.ids_spelling == "dflash_config" else [],
            refusal=spec.refusal,
            negatives=list(spec.negatives),
            max_num_batched_tokens=token_budget(spec),
            max_model_len=spec.max_model_len,
            dtype=spec.dtype,
            batched=spec.batched,
            max_num_seqs=spec.max_num_seqs,
            enable_prefix_caching=spec.prefix_caching,
            kv_block_size=spec.kv_block_size,
            rounds=spec.rounds,
            tensor_parallel_size=spec.tensor_parallel_size,
            kv_cache_bytes=spec.kv_cache_bytes,
        )
        (tmp / CASE_FILE).write_text(case.to_json())
    return out


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"out": parent directory (each case goes to OUT/<name>-<digest>), "cases": [names]}."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    out = Path(job["out"])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import torch

    torch.set_num_threads(1)  # tiny models; OpenMP threads only contend on a small machine
    specs = [*C.get_cases(job.get("cases") or []), *(C.spec_from_dict(d) for d in job.get("specs") or [])]
    if job.get("specs") and not job.get("cases"):
        specs = specs[len(C.CASES) :]  # only the given specs (get_cases([]) is every case)
    for spec in specs:
        path = build_case(spec, out / f"{spec.name}-{spec.digest()}")
        print(f"built {spec.name}: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
