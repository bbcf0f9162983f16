"""The conformance cases: tiny target + drafter shapes, what each case proves, and what each build must do on it.

Stdlib only: this module is imported on the host, in the dflash reference environment and (through case.json) read by
the vLLM side, so it must not pull in torch or rich.

Every case uses a 4-layer Qwen3 target (hidden 128, vocab 512) and a drafter with block size 4 (k = 3 drafted
tokens per step). Numbers are chosen so that each bug shows up: a sliding window (8) far shorter than the context
(prompts of 37 and 45 tokens plus 24 generated), taps that differ between "input of layer L" (vLLM 0.20.1) and
"output of layer L" (the reference).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Literal

FULL = "full_attention"
SLIDING = "sliding_attention"

TARGET_LAYERS = 4
HIDDEN = 128
VOCAB = 512
BLOCK_SIZE = 4  # bonus token + k mask tokens
NUM_SPEC_TOKENS = BLOCK_SIZE - 1
WINDOW = 8
MASK_TOKEN_ID = 257
EOS_TOKEN_ID = 256
MAX_TOKENS = 24
PROMPT_LENGTHS = (37, 45)  # deliberately not multiples of 32 (the CPU kernel quirk must not hide anything)

# What a build must do on a case: pass, fail (a negative control), or either (the case cannot tell the builds apart).
Expect = Literal["pass", "fail", "any"]

# Negative-control oracles (see oracle.py): each must DISAGREE with the patched build on the cases that list it.
NEG_TAP_INPUT = "tap-input"  # hidden_states[L] instead of [L+1]: vLLM 0.20.1's tap
NEG_FULL_ATTN = "full-attention"  # sliding layers run full, non-causal: vLLM 0.20.1's drafter attention
NEG_WINDOW_MINUS = "window-1"
NEG_WINDOW_PLUS = "window+1"
NEG_POSTNORM_LAST = "postnorm-last-tap"  # the reference package's literal last-layer tap (after the final norm)
# Informational: the oracle that models stock 0.20.1 exactly (input taps + full attention). Not asserted.
STOCK_MODEL = "stock-semantics"


@dataclass(frozen=True)
class CaseSpec:
    """One conformance case. Everything that shapes the saved models is in here (and so in `digest`)."""

    name: str
    summary: str  # one line: what this case proves
    layer_types: tuple[str, ...]
    target_layer_ids: tuple[int, ...]
    sliding_window: int | None = None
    identity_target_layers: tuple[int, ...] = ()  # target layers zeroed to identities (o_proj, down_proj = 0)
    zero_lm_head: bool = False  # target and drafter lm_head zeroed: all logits 0, every draft accepted
    expect_stock: Expect = "fail"
    negatives: tuple[str, ...] = ()
    seed: int = 0
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    max_tokens: int = MAX_TOKENS

    @property
    def num_speculative_tokens(self) -> int:
        return NUM_SPEC_TOKENS

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.layer_types

    def digest(self) -> str:
        """Hash of everything that determines the saved models (plus the generator version)."""
        blob = json.dumps({"spec": asdict(self), "generator": GENERATOR_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


# Bump when tiny.py changes what it writes for the same spec, so cached case directories are rebuilt.
GENERATOR_VERSION = 1

_WINDOW_NEGS = (NEG_FULL_ATTN, NEG_WINDOW_MINUS, NEG_WINDOW_PLUS)

CASES: tuple[CaseSpec, ...] = (
    CaseSpec(
        name="full",
        summary="full-attention drafter: only the tap (+1) matters",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        negatives=(NEG_TAP_INPUT,),
    ),
    CaseSpec(
        name="sliding",
        summary="all-sliding drafter, window 8 << context",
        layer_types=(SLIDING, SLIDING),
        target_layer_ids=(1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_TAP_INPUT, *_WINDOW_NEGS),
    ),
    CaseSpec(
        name="mixed",
        summary="sliding, sliding, full (the Qwen3.6-27B-DFlash shape)",
        layer_types=(SLIDING, SLIDING, FULL),
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_TAP_INPUT, *_WINDOW_NEGS),
    ),
    CaseSpec(
        name="last-tap",
        summary="a tap on the last target layer (pre-norm residual, see oracle.py)",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, TARGET_LAYERS - 1),
        negatives=(NEG_TAP_INPUT, NEG_POSTNORM_LAST),
    ),
    CaseSpec(
        name="window-only",
        summary="tapped target layer is an identity: stock can fail only by the window",
        layer_types=(SLIDING, SLIDING),
        target_layer_ids=(1,),
        sliding_window=WINDOW,
        identity_target_layers=(1,),
        negatives=_WINDOW_NEGS,
    ),
    CaseSpec(
        name="zero-lm-head",
        summary="zeroed lm_head: every draft accepted, acceptance length exactly 1 + k",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        zero_lm_head=True,
        expect_stock="any",  # all logits are 0 whatever the taps: the case cannot tell builds apart
    ),
)

CASE_NAMES: tuple[str, ...] = tuple(c.name for c in CASES)


def get_cases(names: tuple[str, ...] | list[str] | None = None) -> tuple[CaseSpec, ...]:
    """The named cases in table order (all when `names` is empty). Unknown names raise ValueError."""
    if not names:
        return CASES
    unknown = sorted(set(names) - set(CASE_NAMES))
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASE_NAMES)}")
    return tuple(c for c in CASES if c.name in names)


@dataclass(frozen=True)
class Tolerance:
    """How close the vLLM drafter's logits must be to the oracle's, per device."""

    device: str
    dtype: str
    max_abs_logit: float  # max |Δlogit| over every step, position and vocab entry
    # Argmax must agree wherever the oracle's top-1/top-2 gap exceeds this (a near-tie may flip under bf16).
    tie_margin: float
    negative_min: float  # a negative-control oracle "disagrees" when max |Δlogit| exceeds this
    exact_lossless: bool  # generated ids must equal the oracle target's greedy ids exactly


TOLERANCES: dict[str, Tolerance] = {
    # fp32 on CPU: vLLM's kernels vs HF's eager/SDPA differ by ~1e-6; research saw 1.4-9 for wrong semantics.
    "cpu": Tolerance(
        device="cpu", dtype="float32", max_abs_logit=1e-4, tie_margin=0.0, negative_min=1e-2, exact_lossless=True
    ),
    # bf16 on GPU (users' GPU CI): bf16 keeps ~3 significant digits; tiny-model logits are O(1), so 5e-2 leaves
    # room for rounding while staying well below the >1 differences the negative controls produce. Greedy
    # continuations may legitimately diverge at near-ties under bf16, so lossless is compared up to the first tie.
    "cuda": Tolerance(
        device="cuda", dtype="bfloat16", max_abs_logit=5e-2, tie_margin=1e-1, negative_min=2.5e-1, exact_lossless=False
    ),
}


@dataclass(frozen=True)
class CaseFile:
    """case.json: what the vLLM side needs to run a case (paths relative to the case directory)."""

    name: str
    prompts: list[list[int]]
    num_speculative_tokens: int
    max_tokens: int
    target: str = "target"
    drafter: str = "drafter"
    ignore_eos: bool = True
    max_model_len: int = 256
    seed: int = 0
    dtype: str = "float32"
    digest: str = ""
    layer_types: list[str] = field(default_factory=list)
    target_layer_ids: list[int] = field(default_factory=list)
    sliding_window: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CaseFile:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
