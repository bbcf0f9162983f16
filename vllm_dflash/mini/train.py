"""Train the miniature: a tiny Qwen3 target on the synthetic corpus, then a DFlash drafter against it.

Runs inside the dflash reference environment (torch 2.13.0, transformers 5.15.0, dflash 0.1.0):
`python -m vllm_dflash.mini.train '{"out": DIR, "config": {...}}'` ("config" overrides DEFAULT_CONFIG key by key,
one level deep). The host side (`vllm_dflash.mini.host.ensure_mini_models`) caches DIR under a hash of this file,
corpus.py, the tokenizer code and the config.

Written (atomically: built in a sibling temp dir, then renamed):
  target/       Qwen3ForCausalLM (fp32 safetensors) + the byte-level tokenizer with a verbatim chat template
  drafter/      the reference's own DFlashDraftModel (fp32), config laid out as vLLM 0.20.1 reads it
  prompts.jsonl held-apart prompts, {"id", "prompt"} per line
  mini.json     config, seeds, training figures (steps, losses, seconds), file hashes

The drafter is trained with the reference's semantics (what `dflash_generate` computes at inference): context
features are the target's `hidden_states[L + 1]` (via the reference's `extract_context_feature`); a block is the
anchor token plus block_size - 1 mask tokens at positions a..a+bs-1, predicting the target's greedy tokens a+1..;
it sees the context strictly before the anchor; sliding layers are causal with window W (key visible when
0 <= q - k < W), the full layer is non-causal. Several blocks are packed per sequence, each with its own explicit
mask (the reference builds no mask for a full non-causal layer, so without it a block would see later context and
other blocks: the loss then collapses by leaking). `packed_check` proves the packed forward equals the reference's
own forward on single blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from vllm_dflash.mini import corpus

SLIDING = "sliding_attention"
FULL = "full_attention"
EOS_TOKEN_ID = 256
MASK_TOKEN_ID = 257
VOCAB = 512

# Verbatim: the last user message's content and nothing else (no role tags, no generation prompt), so a chat
# completion of a prompt feeds the target exactly the prompt's bytes.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(text='') -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.text = m['content'] -%}{%- endif -%}"
    "{%- endfor -%}{{- ns.text -}}"
)

DEFAULT_CONFIG: dict[str, Any] = {
    "seed": 0,
    "threads": 1,  # one thread: deterministic and, on a busy 2-core machine, faster than two
    "model": {"hidden": 128, "intermediate": 384, "heads": 4, "kv_heads": 2, "head_dim": 32, "max_positions": 512},
    "target": {"layers": 6, "steps": 600, "batch": 8, "seq_len": 272, "lr": 4e-3, "warmup": 20},
    "drafter": {
        "layer_types": [SLIDING, SLIDING, FULL],
        "window": 16,
        "block_size": 8,
        "target_layer_ids": [1, 2, 3],
        "sequences": 1536,  # target greedy continuations of training-document prefixes
        "group": 64,  # sequences generated together (one prefix length per group)
        "batch": 16,  # sequences per drafter step (a slice of one group)
        "continuation": 112,
        "anchors": 12,  # blocks packed per sequence
        "steps": 300,
        "lr": 3e-3,
        "warmup": 20,
        "loss_decay": 4.0,  # DFlash's position weights exp(-(i - 1) / gamma); the paper uses 4 for block size 8
    },
    # Held-apart prompts: candidates whose target greedy continuation (max_tokens + block_size tokens) has a
    # top-2 logit gap below min_gap somewhere are dropped (about 1 in 8), so fp32 kernels that differ from HF's
    # (vLLM's; ~1e-5 here) cannot flip a greedy token; the choice looks only at the target, never at the drafter.
    "prompts": {"count": 128, "candidates": 192, "min_len": 48, "max_len": 160, "min_gap": 1e-3},
    "max_tokens": 96,
}


def merge_config(overrides: dict[str, Any] | None) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(json.dumps(DEFAULT_CONFIG))
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


def encode(text: str) -> list[int]:
    """Byte-level tokenizer without merges: token id == byte value (ASCII corpus)."""
    return list(text.encode())


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode(errors="replace")


# --------------------------------------------------------------------------------------------------------------------
# Models and tokenizer
# --------------------------------------------------------------------------------------------------------------------


def _common(cfg: dict[str, Any]) -> dict[str, Any]:
    m = cfg["model"]
    return {
        "vocab_size": VOCAB,
        "hidden_size": m["hidden"],
        "intermediate_size": m["intermediate"],
        "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"],
        "head_dim": m["head_dim"],
        "max_position_embeddings": m["max_positions"],
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": EOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": EOS_TOKEN_ID,
        "dtype": "float32",
    }


def target_config(cfg: dict[str, Any]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(cfg), num_hidden_layers=cfg["target"]["layers"], architectures=["Qwen3ForCausalLM"])


def drafter_config(cfg: dict[str, Any]) -> Any:
    """Mirrors conformance/tiny.py `drafter_config`: the keys the reference and vLLM 0.20.1 both read."""
    from transformers import Qwen3Config

    d = cfg["drafter"]
    return Qwen3Config(
        **_common(cfg),
        num_hidden_layers=len(d["layer_types"]),
        layer_types=list(d["layer_types"]),
        # transformers drops sliding_window unless use_sliding_window is set; the reference reads it from here.
        use_sliding_window=True,
        sliding_window=d["window"],
        max_window_layers=0,
        architectures=["DFlashDraftModel"],
        num_target_layers=cfg["target"]["layers"],
        block_size=d["block_size"],
        dflash_config={"target_layer_ids": list(d["target_layer_ids"]), "mask_token_id": MASK_TOKEN_ID},
    )


def save_tokenizer(out: Path) -> None:
    from vllm_dflash.conformance import cases
    from vllm_dflash.conformance.tiny import build_tokenizer

    if (cases.VOCAB, cases.MASK_TOKEN_ID, cases.EOS_TOKEN_ID) != (VOCAB, MASK_TOKEN_ID, EOS_TOKEN_ID):
        raise RuntimeError("the conformance tokenizer's special ids moved; update train.py's constants")
    build_tokenizer(out)  # the conformance cases' 512-id byte-level tokenizer (id == byte for 0..255)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    # In tokenizer_config.json: every transformers version that vLLM may bring reads it there.
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg["add_bos_token"] = False
    tok_cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(tok_cfg, indent=1))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    probe = "12. copy ab3 -> ab3\n13. "
    text = tok.apply_chat_template(
        [{"role": "system", "content": "x"}, {"role": "user", "content": probe}],
        tokenize=False,
        add_generation_prompt=True,
    )
    if text != probe or tok(probe, add_special_tokens=True)["input_ids"] != encode(probe):
        raise RuntimeError("the mini tokenizer's chat template or encoding is not verbatim")


# --------------------------------------------------------------------------------------------------------------------
# Training helpers
# --------------------------------------------------------------------------------------------------------------------


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_target(cfg: dict[str, Any], docs: list[str], log: list[dict[str, Any]]) -> Any:
    import torch
    from transformers import Qwen3ForCausalLM

    t = cfg["target"]
    torch.manual_seed(cfg["seed"])
    model = Qwen3ForCausalLM(target_config(cfg)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    batch, seq_len = t["batch"], t["seq_len"]
    t0 = time.perf_counter()
    for step in range(t["steps"]):
        chunk = docs[step * batch : (step + 1) * batch]
        x = torch.tensor([encode(d[:seq_len]) for d in chunk])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t["steps"], t["lr"], t["warmup"])
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == t["steps"] - 1:
            log.append({"step": step, "loss": round(loss.item(), 4), "s": round(time.perf_counter() - t0, 1)})
            print(f"target step {step}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model.eval()


def greedy_continuations(target: Any, prefixes: list[list[int]], n: int) -> tuple[list[list[int]], list[float]]:
    """The target's greedy continuations (n tokens, KV cache) of equally long prefixes, batched, and each row's
    smallest top-2 logit gap along the way."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor(prefixes)
        out = target(ids, use_cache=True)
        past = out.past_key_values
        new: list[Any] = []
        gap = torch.full((len(prefixes),), float("inf"))
        for _ in range(n):
            logits = out.logits[:, -1]
            top = torch.topk(logits, 2, dim=-1).values
            gap = torch.minimum(gap, top[:, 0] - top[:, 1])
            nxt = logits.argmax(-1)
            new.append(nxt)
            out = target(nxt[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
        return [row.tolist() for row in torch.stack(new, dim=1)], gap.tolist()


def drafter_sequences(cfg: dict[str, Any], target: Any, docs: list[str]) -> list[tuple[int, list[list[int]]]]:
    """Groups of (prefix length, token sequences): a training-document prefix, then the target's greedy tokens."""
    d, p = cfg["drafter"], cfg["prompts"]
    rng = random.Random(f"vllm-dflash-mini/{cfg['seed']}/drafter-prefixes")
    groups: list[tuple[int, list[list[int]]]] = []
    for g in range(d["sequences"] // d["group"]):
        plen = rng.randint(p["min_len"], p["max_len"])
        prefixes = [encode(doc[:plen]) for doc in docs[g * d["group"] : (g + 1) * d["group"]]]
        conts, _ = greedy_continuations(target, prefixes, d["continuation"])
        seqs = [a + b for a, b in zip(prefixes, conts, strict=True)]
        # Drafter batches are slices of a group (equal lengths, no padding).
        groups += [(plen, seqs[i : i + d["batch"]]) for i in range(0, len(seqs), d["batch"])]
    # Interleave prefix lengths across steps instead of running one group's batches back to back.
    order = list(range(len(groups)))
    rng.shuffle(order)
    return [groups[i] for i in order]


def select_prompts(cfg: dict[str, Any], target: Any, seen: list[str]) -> tuple[list[corpus.Prompt], dict[str, float]]:
    """The first `count` held-apart candidates whose greedy continuation has no near-tie (see DEFAULT_CONFIG)."""
    p = cfg["prompts"]
    n = cfg["max_tokens"] + cfg["drafter"]["block_size"]
    candidates = corpus.held_apart_prompts(cfg["seed"], p["candidates"], p["min_len"], p["max_len"], seen)
    chosen: list[corpus.Prompt] = []
    gaps: dict[str, float] = {}
    for c in candidates:
        _, (gap,) = greedy_continuations(target, [encode(c.prompt)], n)
        gaps[c.id] = round(gap, 4)
        if gap >= p["min_gap"]:
            chosen.append(c)
            if len(chosen) == p["count"]:
                return chosen, gaps
    raise RuntimeError(f"only {len(chosen)} of {p['candidates']} candidate prompts have no near-tie; raise candidates")


def taps(hidden_states: Any, layer_ids: list[int], offset: int = 1) -> Any:
    """Context features. offset 1 is the reference (`extract_context_feature`: hidden_states[L + 1], the output of
    layer L); offset 0 is vLLM 0.20.1's input of layer L."""
    from dflash.model import extract_context_feature

    states = list(hidden_states)
    if offset == 0:
        states = [None, *states[:-1]]
    return extract_context_feature(states, layer_ids)


def packed_masks(anchors: Any, ctx_len: int, block_size: int, window: int, layer_types: list[str]) -> dict[str, Any]:
    """Boolean [B, 1, Q, K] masks for blocks packed after the whole context, per layer kind, with the reference's
    semantics. Keys: context positions 0..ctx_len-1, then every block's tokens; queries: every block's tokens.
    A query at position a + i of the block anchored at a sees context p < a (sliding: also a + i - p < W) and its
    own block's tokens (sliding: causal, j <= i; full: all of them), never another block's."""
    import torch

    bsz, m = anchors.shape
    q = m * block_size
    i = torch.arange(block_size)
    q_pos = (anchors[:, :, None] + i).reshape(bsz, q)  # absolute position of each query
    q_anchor = anchors[:, :, None].expand(bsz, m, block_size).reshape(bsz, q)
    p = torch.arange(ctx_len)
    ctx_vis = p[None, None, :] < q_anchor[:, :, None]
    blk = torch.arange(m).repeat_interleave(block_size)
    same_block = blk[:, None] == blk[None, :]
    j = i.repeat(m)
    masks: dict[str, Any] = {}
    for kind in set(layer_types):
        if kind == SLIDING:
            ctx = ctx_vis & (q_pos[:, :, None] - p[None, None, :] < window)
            noise = same_block & (j[None, :] <= j[:, None]) & (j[:, None] - j[None, :] < window)
        else:
            ctx = ctx_vis
            noise = same_block
        masks[kind] = torch.cat([ctx, noise[None].expand(bsz, q, q)], dim=-1)[:, None]
    return masks


def packed_forward(drafter: Any, target: Any, feats: Any, ids: Any, anchors: Any, layer_types: list[str]) -> Any:
    """Drafter logits [B, m * block_size, vocab] for every packed block (the reference model's own modules)."""
    import torch
    from dflash.model import _draft_value, _raw_input_embeddings

    bs = drafter.block_size
    bsz, m = anchors.shape
    ctx_len = feats.shape[1]
    block_ids = torch.full((bsz, m, bs), int(drafter.mask_token_id))
    block_ids[:, :, 0] = ids.gather(1, anchors)
    scale = float(_draft_value(drafter.config, "input_embedding_scale", 1.0))
    noise = _raw_input_embeddings(target, block_ids.reshape(bsz, m * bs), scale)
    positions = torch.cat(
        [torch.arange(ctx_len).expand(bsz, ctx_len), (anchors[:, :, None] + torch.arange(bs)).reshape(bsz, m * bs)],
        dim=1,
    )
    masks = packed_masks(anchors, ctx_len, bs, int(drafter.config.sliding_window), layer_types)
    # DFlashDraftModel.forward, with a per-layer mask instead of one shared mask.
    target_hidden = drafter.hidden_norm(drafter.fc(feats))
    position_embeddings = drafter.rotary_emb(noise, positions)
    h = noise
    for layer, kind in zip(drafter.layers, layer_types, strict=True):
        h = layer(
            hidden_states=h,
            target_hidden=target_hidden,
            attention_mask=masks[kind],
            position_ids=positions,
            position_embeddings=position_embeddings,
        )
    return drafter.compute_logits(drafter.norm(h), target.lm_head)


def sample_anchors(gen: Any, bsz: int, lo: int, hi: int, m: int) -> Any:
    """m distinct anchors per row in [lo, hi], sorted (blocks may overlap; each is its own query set)."""
    import torch

    rows = [torch.randperm(hi - lo + 1, generator=gen)[:m].sort().values + lo for _ in range(bsz)]
    return torch.stack(rows)


def train_drafter(
    cfg: dict[str, Any], target: Any, groups: list[tuple[int, list[list[int]]]], log: list[dict[str, Any]]
) -> Any:
    import torch
    from dflash.model import DFlashDraftModel

    d = cfg["drafter"]
    torch.manual_seed(cfg["seed"] + 1)
    gen = torch.Generator().manual_seed(cfg["seed"] + 2)
    drafter = DFlashDraftModel(drafter_config(cfg)).train()
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=d["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    bs = d["block_size"]
    weights = torch.tensor([math.exp(-(i - 1) / d["loss_decay"]) for i in range(1, bs)])
    t0 = time.perf_counter()
    for step in range(d["steps"]):
        plen, seqs = groups[step % len(groups)]
        ids = torch.tensor(seqs)
        with torch.no_grad():
            hs = target(ids, output_hidden_states=True).hidden_states
            feats = taps(hs, list(d["target_layer_ids"]))
        # Anchors in the generated part: there the next tokens are exactly the target's greedy continuation.
        anchors = sample_anchors(gen, ids.shape[0], plen, ids.shape[1] - bs, d["anchors"])
        for g in opt.param_groups:
            g["lr"] = lr_at(step, d["steps"], d["lr"], d["warmup"])
        logits = packed_forward(drafter, target, feats, ids, anchors, list(d["layer_types"]))
        logits = logits.view(ids.shape[0], -1, bs, logits.shape[-1])[:, :, 1:]
        labels = ids.gather(1, (anchors[:, :, None] + torch.arange(1, bs)).flatten(1)).view(logits.shape[:-1])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        loss = (ce.view(labels.shape) * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == d["steps"] - 1:
            with torch.no_grad():
                hit = (logits.argmax(-1) == labels).float()
                acc = [round(float(v), 3) for v in hit.mean(dim=(0, 1))]
                run = float(hit.cumprod(-1).sum(-1).mean())  # accepted drafts per block, teacher-forced
            log.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "acc_by_pos": acc,
                    "accepted": round(run, 3),
                    "s": round(time.perf_counter() - t0, 1),
                }
            )
            print(
                f"drafter step {step}: loss {loss.item():.4f}, accepted/block {run:.2f} "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    return drafter.eval()


def packed_check(drafter: Any, target: Any, seq: list[int], plen: int, layer_ids: list[int], m: int = 4) -> float:
    """max |Δlogit| between the packed training forward and the reference's own forward, one block at a time."""
    import torch
    from dflash.model import _raw_input_embeddings

    bs = drafter.block_size
    layer_types = list(drafter.config.layer_types)
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = taps(target(ids, output_hidden_states=True).hidden_states, layer_ids)
        anchors = torch.linspace(plen, len(seq) - bs, m).long()[None]
        packed = packed_forward(drafter, target, feats, ids, anchors, layer_types)[0]
        worst = 0.0
        for b, a in enumerate(anchors[0].tolist()):
            block = torch.tensor([[seq[a]] + [int(drafter.mask_token_id)] * (bs - 1)])
            noise = _raw_input_embeddings(target, block)
            out = drafter(target_hidden=feats[:, :a], noise_embedding=noise, position_ids=torch.arange(a + bs)[None])
            ref = drafter.compute_logits(out, target.lm_head)[0]
            worst = max(worst, float((packed[b * bs : (b + 1) * bs] - ref).abs().max()))
    return worst


# --------------------------------------------------------------------------------------------------------------------
# Job
# --------------------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    t, d, p = cfg["target"], cfg["drafter"], cfg["prompts"]
    torch.set_num_threads(int(cfg["threads"]))
    torch.use_deterministic_algorithms(True)
    n_target_docs = t["steps"] * t["batch"]
    docs = corpus.training_documents(cfg["seed"], n_target_docs + d["sequences"], t["seq_len"] + 1)
    figures: dict[str, Any] = {"target_log": [], "drafter_log": []}
    t0 = time.perf_counter()
    target = train_target(cfg, docs[:n_target_docs], figures["target_log"])
    figures["target_s"] = round(time.perf_counter() - t0, 1)
    t1 = time.perf_counter()
    groups = drafter_sequences(cfg, target, docs[n_target_docs:])
    figures["drafter_data_s"] = round(time.perf_counter() - t1, 1)
    # Prompts depend on the target only; chosen before the drafter trains so a shortfall fails early. Every text
    # either model trains on goes into the disjointness assertion.
    seen = [*docs, *(decode(s) for _, g in groups for s in g)]
    t3 = time.perf_counter()
    prompts, gaps = select_prompts(cfg, target, seen)
    figures["prompt_selection_s"] = round(time.perf_counter() - t3, 1)
    figures["prompt_candidates_dropped"] = sorted(k for k, g in gaps.items() if g < p["min_gap"])
    t2 = time.perf_counter()
    drafter = train_drafter(cfg, target, groups, figures["drafter_log"])
    figures["drafter_s"] = round(time.perf_counter() - t2, 1)
    plen, seqs = groups[-1]
    figures["packed_vs_reference_max_abs"] = packed_check(drafter, target, seqs[0], plen, list(d["target_layer_ids"]))
    if figures["packed_vs_reference_max_abs"] > 1e-4:
        raise RuntimeError(f"packed training forward != reference forward: {figures['packed_vs_reference_max_abs']}")

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        target.save_pretrained(tmp / "target", safe_serialization=True)
        save_tokenizer(tmp / "target")
        drafter.save_pretrained(tmp / "drafter", safe_serialization=True)
        dcfg = json.loads((tmp / "drafter" / "config.json").read_text())
        got = (dcfg.get("architectures"), dcfg.get("layer_types"), dcfg.get("sliding_window"), dcfg.get("block_size"))
        if got != (["DFlashDraftModel"], d["layer_types"], d["window"], d["block_size"]):
            raise RuntimeError(f"drafter config.json lost a field on save: {got}")
        if any(k.startswith(("embed_tokens", "lm_head")) for k in load_file(tmp / "drafter" / "model.safetensors")):
            raise RuntimeError("the drafter must share the target's embedding and head, not carry its own")
        with (tmp / "prompts.jsonl").open("w") as fh:
            for pr in prompts:
                fh.write(json.dumps({"id": pr.id, "prompt": pr.prompt}) + "\n")
        manifest = {
            "config": cfg,
            "seeds": {"target": cfg["seed"], "drafter": cfg["seed"] + 1, "anchors": cfg["seed"] + 2},
            "max_tokens": cfg["max_tokens"],
            "num_speculative_tokens": d["block_size"] - 1,
            "parameters": {
                "target": sum(x.numel() for x in target.parameters()),
                "drafter": sum(x.numel() for x in drafter.parameters()),
            },
            "figures": figures,
            "prompt_min_top2_gap": {pr.id: gaps[pr.id] for pr in prompts},
            "torch": torch.__version__,
            "files": {
                str(f.relative_to(tmp)): {"sha256": _sha256(f), "bytes": f.stat().st_size}
                for f in sorted(tmp.rglob("*.safetensors"))
            },
        }
        (tmp / "mini.json").write_text(json.dumps(manifest, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """One JSON argument: {"out": model directory to write, "config": overrides of DEFAULT_CONFIG}."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = merge_config(job.get("config"))
    manifest = build(cfg, Path(job["out"]))
    f = manifest["figures"]
    print(
        f"mini models in {job['out']}: target {f['target_s']} s, drafter data {f['drafter_data_s']} s, "
        f"drafter {f['drafter_s']} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
