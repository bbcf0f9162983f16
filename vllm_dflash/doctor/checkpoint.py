"""One drafter checkpoint, read offline: its config.json, the names of its weights and any files beside them.

Accepts a config.json, a model directory, a Hugging Face cache snapshot directory
(`.../models--org--name/snapshots/<rev>`) or the cache's repo directory (`.../models--org--name`, whose `refs/main`
names the snapshot). Never downloads; reads only safetensors headers, never the tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_dflash.errors import CheckpointError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB
# Files a checkpoint normally carries that hold no weights the drafter would need.
_PLAIN = {
    CONFIG,
    INDEX,
    "generation_config.json",
    "README.md",
    ".gitattributes",
    "LICENSE",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
}
_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".npy", ".npz", ".ckpt")


@dataclass(frozen=True)
class Checkpoint:
    """What the doctor knows of one drafter. `config` is the config.json as written (a speculators-format one too:
    each build's reading of that format is its own, rules.py)."""

    name: str
    config: Mapping[str, Any]
    files: tuple[str, ...] = ()  # weight files beside config.json that no build loads by default
    tensors: tuple[str, ...] | None = None  # weight names (None: not known, e.g. a table entry without weights)
    speculators: bool = False  # speculators format (aux_hidden_state_layer_ids in vLLM's indexing)
    sources: Mapping[str, str] = field(default_factory=dict)  # table entries: where each field comes from
    unknown: tuple[str, ...] = ()  # table entries: attention-relevant fields no public source gives


def _snapshot(path: Path) -> Path:
    """A Hugging Face cache repo directory -> the snapshot refs/main names (or its only snapshot)."""
    snaps = path / "snapshots"
    ref = path / "refs" / "main"
    if ref.exists():
        from vllm_dflash.paths import read_bounded

        hint = "pass the snapshot directory itself (snapshots/<revision>)"
        raw = read_bounded(ref, 256, "refs/main", CheckpointError, hint)  # a revision is 40 hex digits
        try:
            rev = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{ref} is not a revision (not ASCII text)", hint) from None
        if rev and "/" not in rev and rev not in (".", "..") and (snaps / rev).is_dir():
            return snaps / rev
    found = sorted(p for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []
    if len(found) == 1:
        return found[0]
    raise CheckpointError(
        f"{path} is a Hugging Face cache directory with {len(found)} snapshots and no usable refs/main",
        "pass the snapshot directory itself (snapshots/<revision>)",
    )


def resolve_dir(path: Path) -> Path:
    """The directory holding config.json for `path` (a file, a model dir, a snapshot dir or a cache repo dir)."""
    if path.is_file():
        return path.parent
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory", "pass a config.json or the checkpoint directory")
    if (path / CONFIG).is_file():
        return path
    if (path / "snapshots").is_dir():
        return _snapshot(path)
    raise CheckpointError(f"{path} has no {CONFIG}", "pass the checkpoint directory (the one holding config.json)")


CONFIG_LIMIT = 16 << 20  # a config.json or a safetensors index is kilobytes; a 16 MiB one is no config


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _strict_json(raw: bytes) -> Any:
    """JSON with finite numbers only (`1e999`, NaN and Infinity refused: no layer count is infinite)."""
    return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)


def read_json(path: Path, what: str) -> dict[str, Any]:
    from vllm_dflash.paths import read_bounded

    try:
        data = _strict_json(read_bounded(path, CONFIG_LIMIT, f"{what} config", CheckpointError))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist", f"check the {what} path") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}", f"check the {what} path") from None
    except RecursionError:
        raise CheckpointError(f"{path} nests deeper than any config", f"pass the {what}'s config.json") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, a non-finite number, a 5000-digit integer
        raise CheckpointError(f"{path} is not JSON ({exc})", f"pass the {what}'s config.json") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object", f"pass the {what}'s config.json")
    return data


def _safetensors_names(path: Path) -> list[str]:
    import os

    from vllm_dflash.paths import open_regular

    # a FIFO or a device named *.safetensors is refused before any read (a FIFO would wait forever)
    fd = open_regular(path, "weights file", CheckpointError, "pass a checkpoint whose weights are regular files")
    with os.fdopen(fd, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return []
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            return []
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError, RecursionError):  # not a safetensors header: no names to read
            return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []


def _tensor_names(d: Path) -> tuple[str, ...] | None:
    index = d / INDEX
    if index.is_file():
        weight_map = read_json(index, "drafter").get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"{index}: weight_map is not an object of tensor name -> shard file",
                f"regenerate {INDEX} (transformers' save_pretrained writes it) or remove it",
            )
        return tuple(sorted(weight_map))
    shards = sorted(d.glob("*.safetensors"))
    if not shards:
        return None
    return tuple(sorted(n for s in shards for n in _safetensors_names(s)))


def read_checkpoint(path: Path) -> Checkpoint:
    d = resolve_dir(path)
    config_path = path if path.is_file() else d / CONFIG
    raw = read_json(config_path, "drafter")
    files = tuple(sorted(p.name for p in d.iterdir() if p.is_file() or p.is_symlink())) if path.is_dir() else ()
    return Checkpoint(
        name=str(path),
        config=raw,
        files=tuple(extra_weight_files(files)),
        tensors=_tensor_names(d) if path.is_dir() else None,
        speculators="speculators_model_type" in raw,
    )


def extra_weight_files(files: tuple[str, ...]) -> list[str]:
    """Files beside the weights that hold tensors vLLM 0.20.1 never loads (e.g. MiMo's mask_embedding.pt)."""
    out = []
    for name in files:
        if name in _PLAIN or name.endswith((".safetensors", ".py", ".md", ".txt", ".jinja")):
            continue
        if name.startswith("pytorch_model") and name.endswith(".bin"):
            continue
        if name.endswith(_WEIGHT_SUFFIXES):
            out.append(name)
    return out


@dataclass(frozen=True)
class Target:
    layers: int
    architectures: tuple[str, ...]
    source: str


def read_target(path: Path) -> Target:
    """The target model's layer count from its config.json (text_config for multimodal configs: Qwen3.5/3.6,
    Gemma 4)."""
    d = resolve_dir(path)
    config_path = path if path.is_file() else d / CONFIG
    return target_from_config(read_json(config_path, "target"), str(config_path))


def target_from_config(raw: Mapping[str, Any], where: str) -> Target:
    text: Mapping[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    layers = text.get("num_hidden_layers", raw.get("num_hidden_layers"))
    if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
        raise CheckpointError(f"{where} gives no num_hidden_layers", "pass the target model's config.json")
    arch = raw.get("architectures")
    archs = tuple(str(a) for a in arch) if isinstance(arch, list) else ()
    src = "text_config.num_hidden_layers" if text is not raw else "num_hidden_layers"
    return Target(layers, archs, f"{src} in {where}")
