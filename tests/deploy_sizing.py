"""The sizing table of docs/deploy.md, computed: `python tests/deploy_sizing.py [--write]` prints it (or rewrites the
table between its markers in docs/deploy.md); tests/test_deploy.py checks that the docs hold what this computes.

- Weights: the parameters of the target's text model and of the drafter, counted by their own classes
  (transformers' Qwen3_5ForCausalLM, dflash 0.1.0's DFlashDraftModel) built on the meta device in the reference
  environment, times 2 bytes (bf16). The target's shape is Qwen3.6-27B's text model (the public config's fields,
  tests/test_doctor.py's Q36_TARGET, with the sizes below); its vision tower is not counted.
- KV cache per sequence: `vllm-dflash doctor --context N --target ... --profile qwen3.6-27b --json`, i.e. vLLM's own
  KV-cache specs and grouping run by the doctor (its reservation for target + drafter attention over the KV-cache
  groups, this build and stock), plus the Gated DeltaNet state: one page per linear-attention layer (the doctor's
  groups: 48 layers x the page vLLM pads them to).
- Sequences that fit: (GPU memory x 0.9 - weights) / KV per sequence, rounded down: an upper bound, since vLLM
  also keeps activations and CUDA graphs out of the 0.9 (`--gpu-memory-utilization`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
DOCS = REPO / "docs" / "deploy.md"
BEGIN, END = "<!-- sizing:begin -->", "<!-- sizing:end -->"
DRAFTER = REPO / "vllm_dflash" / "doctor" / "checkpoints" / "z-lab--Qwen3.6-27B-DFlash.json"
CONTEXTS = (16384, 131072)  # the qwen3.6-27b profile's --max-model-len, and a long context
GPUS_GIB = (24, 48, 80)
UTILIZATION = 0.9
GIB = 1 << 30
# Qwen3.6-27B's text model beyond Q36_TARGET's attention and Gated DeltaNet fields (the sizes Qwen3.5-27B publishes,
# e.g. THUDM/slime scripts/models/qwen3.5-27B.sh: hidden 5120, FFN 17408, vocab 248320, untied embeddings).
TEXT_SIZES = {"hidden_size": 5120, "intermediate_size": 17408, "vocab_size": 248320, "tie_word_embeddings": False}

_COUNT = r"""
import json, sys
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
from transformers import Qwen3Config
from dflash.model import DFlashDraftModel

job = json.loads(sys.argv[1])
with torch.device("meta"):
    target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**job["target"]))
    drafter = DFlashDraftModel(Qwen3Config(**job["drafter"]))
print(json.dumps({"target": sum(p.numel() for p in target.parameters()),
                  "drafter": sum(p.numel() for p in drafter.parameters())}))
"""


def parameters() -> dict[str, int]:
    """Parameter counts of the target's text model and the drafter, from their own classes (reference env)."""
    from test_doctor import Q36_TARGET

    from vllm_dflash.doctor import table as doctor_table
    from vllm_dflash.envs import reference_python
    from vllm_dflash.manifest import load_manifest

    text = {**Q36_TARGET["text_config"], **TEXT_SIZES}  # type: ignore[dict-item]
    # The drafter as the doctor completes its table entry (attention heads), its MLP at the target's size.
    (_, ck), *_ = doctor_table.completions(doctor_table.load_entry(DRAFTER))
    cfg = {k: v for k, v in ck.config.items() if k not in ("auto_map", "architectures")}
    cfg.update({k: TEXT_SIZES[k] for k in ("intermediate_size", "vocab_size")})
    cfg.setdefault("num_target_layers", text["num_hidden_layers"])
    job = json.dumps({"target": text, "drafter": cfg})
    out = subprocess.run(
        [str(reference_python(load_manifest(REPO))), "-c", _COUNT, job],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return counts


def kv_per_sequence(context: int) -> dict[str, Any]:
    """`vllm-dflash doctor --context` on the public drafter's shape and its target, with the deployment profile's
    serve arguments: its kv_cache document."""
    from test_doctor import Q36_TARGET

    with tempfile.TemporaryDirectory(prefix="sizing-") as tmp:
        target = Path(tmp) / "target.json"
        target.write_text(json.dumps(Q36_TARGET))
        out = Path(tmp) / "doctor.json"
        cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(REPO), "doctor", str(DRAFTER), "--target",
               str(target), "--context", str(context), "--profile", "qwen3.6-27b", "--json", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=False)
        if not out.is_file():
            raise RuntimeError(f"doctor --context failed (exit {done.returncode}): {done.stderr[-2000:]}")
        kv: dict[str, Any] = json.loads(out.read_text())["kv_cache"]
        return kv


def _gdn_state(kv: dict[str, Any], side: str) -> int:
    """Bytes of Gated DeltaNet state per sequence: one page per linear-attention layer, at the page size vLLM's own
    grouping gives every layer of the model (the doctor's groups)."""
    from test_doctor import Q36_TARGET

    layers = list(Q36_TARGET["text_config"]["layer_types"]).count("linear_attention")  # type: ignore[index]
    pages = kv["groups"][side]["page_size_bytes"]
    return int(layers * max(pages))


def table(counts: dict[str, int] | None = None) -> str:
    counts = counts or parameters()
    weights = {k: 2 * v for k, v in counts.items()}  # bf16
    total_weights = weights["target"] + weights["drafter"]
    lines = [
        f"Weights (bf16): target text model {counts['target'] / 1e9:.2f} B parameters = "
        f"{weights['target'] / GIB:.1f} GiB, drafter {counts['drafter'] / 1e9:.2f} B = {weights['drafter'] / GIB:.1f} "
        f"GiB; together {total_weights / GIB:.1f} GiB (one copy per replica; split over TP ranks).",
        "",
        "| context | build | KV per sequence: attention (target + drafter) + GDN state | sequences in "
        + " / ".join(f"{g} GiB" for g in GPUS_GIB)
        + " (bf16, TP 1) | same at TP 2 (per pair of GPUs) |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for context in CONTEXTS:
        kv = kv_per_sequence(context)
        for side, name in (("this_build", "this build"), ("stock", "stock 0.20.1")):
            per_seq = int(kv["reserved_bytes"][side]) + _gdn_state(kv, side)
            fits = []
            for tp in (1, 2):
                row = []
                for gib in GPUS_GIB:
                    free = tp * gib * GIB * UTILIZATION - total_weights
                    row.append(str(max(0, int(free // per_seq))))
                fits.append(" / ".join(row))
            lines.append(
                f"| {context:,} | {name} | {per_seq / GIB:.2f} GiB ({int(kv['reserved_bytes'][side]) / GIB:.2f} + "
                f"{_gdn_state(kv, side) / GIB:.2f}) | {fits[0]} | {fits[1]} |"
            )
    return "\n".join(lines)


def in_docs(text: str) -> str:
    """The table between the markers of docs/deploy.md."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def main(argv: list[str]) -> int:
    made = table()
    if "--write" in argv:
        text = DOCS.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        DOCS.write_text(text[:start] + "\n" + made + "\n" + text[end:])
    print(made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
