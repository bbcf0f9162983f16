"""The doctor's columns: what each build did with a drafter config when its own code read it (sides.py runs that code;
vllm_side.py and reference_side.py are the readers), turned into one `Reading` per build.

    from_vllm(build, answer, how) -> Reading       (stock 0.20.1, this build, upstream 0.33.0 / 0.34.0)
    from_reference(answer, how) -> Reading         (dflash 0.1.0)

Nothing here decides what a build does: a layer's window, causality and kind, the taps, what is refused and where,
are the side's answers. This module only names them (and attributes this build's layers with patch 0002's own
per-layer record of which field said so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
STOCK, OURS, REFERENCE = "stock 0.20.1", "this build", "reference 0.1.0"
UPSTREAM_RELEASES = ("0.33.0", "0.34.0")


def upstream_build(version: str) -> str:
    return f"upstream {version}"


UPSTREAM_V1_LAST = upstream_build("0.33.0")  # the last release with Model Runner V1
UPSTREAM = upstream_build("0.34.0")  # the newest release (V2 only)
BUILDS = (STOCK, OURS, UPSTREAM_V1_LAST, UPSTREAM, REFERENCE)
VLLM_BUILDS = (STOCK, OURS, UPSTREAM_V1_LAST, UPSTREAM)

# What a CPU machine cannot build whatever the config says (a quantized layer's GPU kernel; a V2 speculator whose
# imports need triton-cpu): said as "not built here", never as the build refusing the drafter.
NOT_BUILT_HERE = ("Failed to find a kernel", "not built here")
SRC_LOAD = "vllm serve's config loading (EngineArgs.create_engine_config: get_config, ModelConfig, SpeculativeConfig)"
SRC_BUILD = "the drafter built on the meta device (the loader's initialize_model)"
SRC_TAPS = "the model runner's load_model (its aux layers from the drafter's config)"
SRC_REFERENCE = "dflash 0.1.0 (config_class.from_pretrained, the model built on the meta device)"


@dataclass(frozen=True)
class Layer:
    kind: str
    window: int | None
    causal: bool
    kind_from: str
    window_from: str | None
    causal_from: str

    @property
    def backend_window(self) -> tuple[int, int]:
        """FlashAttention's (left, right) for this layer (-1 unbounded), as FA aligns windows to the key end."""
        left = -1 if self.window is None else self.window - 1
        return (left, 0 if self.causal else left)


@dataclass(frozen=True)
class Refusal:
    """The build does not serve this drafter: the line it raised, and where."""

    line: str
    source: str
    # "load" (config loading) | "class" (no model for the architecture) | "model" (building it) | "here" (this CPU
    # machine cannot build a layer, e.g. an NVFP4 kernel: no statement about the build) | "unavailable"
    stage: str = "load"


@dataclass(frozen=True)
class Loaded:
    """The config object the build's loader made (its attention-relevant attributes; absent ones missing)."""

    attrs: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.attrs


@dataclass(frozen=True)
class Reading:
    """What one build did with one config: per layer attention (or a refusal), the taps, what the model carries."""

    build: str
    layers: tuple[Layer, ...] | None
    refusal: Refusal | None
    taps: list[Any] | None  # vLLM: aux indices (input of layer k); reference: output-of-layer ids, as concatenated
    taps_from: str = ""
    loaded: Loaded = field(default_factory=Loaded)
    runner: str = ""  # upstream: which model runner serves it
    model: str = ""  # the model class built
    recorded: list[int] | None = None  # vLLM: the aux indices the target records, in its forward's order
    fc_in: int | None = None  # the drafter's fc input width
    target_hidden: int | None = None
    layer_facts: tuple[Mapping[str, Any], ...] = ()  # per layer: rope, sinks, value scale, projections, KV spec
    model_facts: Mapping[str, Any] = field(default_factory=dict)  # logit scale, lm_head, aux hidden state, fc
    kv: Mapping[str, Any] | None = None  # the KV-cache specs the built target and drafter report
    target: Mapping[str, Any] = field(default_factory=dict)  # the target built beside it: class, eagle3, error
    how: str = ""  # which code in which environment (the column's description)
    version: str = ""


_ABSENT = "<absent>"


def _loaded(attrs: Mapping[str, Any] | None) -> Loaded:
    return Loaded({k: v for k, v in (attrs or {}).items() if v != _ABSENT})


def _layers_vllm(rec: Mapping[str, Any]) -> tuple[Layer, ...]:
    resolution = list(rec.get("resolution") or [])
    out = []
    for i, x in enumerate(rec.get("layers") or []):
        where = str(x.get("read_from") or "the built layer")
        r = resolution[i] if i < len(resolution) else None
        window = x.get("window")
        out.append(
            Layer(
                str(x["kind"]),
                window,
                bool(x["causal"]),
                str(r["kind_from"]) if r else where,
                (str(r["window_from"]) if r and r.get("window_from") else where) if window is not None else None,
                str(r["causal_from"]) if r else where,
            )
        )
    return tuple(out)


def _runner_words(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """Which model runner serves it, from the runs the side made (V2 and V1 where the release has both)."""
    v2, v1 = runs.get("v2"), runs.get("v1")
    if v2 is None:
        return ""
    ok2 = not (v2.get("load_error") or v2.get("model_error"))
    if v1 is None:
        return "V2 runner (V1 removed)" if ok2 else ""
    ok1 = not (v1.get("load_error") or v1.get("model_error"))
    if ok2 and ok1:
        return "V1 or V2 runner"
    if ok2:
        why = v1.get("load_error") or v1.get("model_error")
        return f"V2 runner only (V1 refuses: {why})"
    if ok1:
        return "V1 runner only"
    return ""


def from_vllm(build: str, answer: Mapping[str, Any], how: str = "") -> Reading:
    """A vLLM column: the run of the runner its release serves DFlash with (V2 where it has both: the default on
    GPUs since 0.29), the V1 run beside it for the runner words."""
    runs: Mapping[str, Mapping[str, Any]] = answer.get("runners") or {}
    rec = runs.get("v2") or runs.get("default") or next(iter(runs.values()), {})
    version = str(answer.get("vllm_version", ""))
    base: dict[str, Any] = {"how": how, "version": version}
    if "side_error" in answer or "side_error" in rec:
        line = str(answer.get("side_error") or rec.get("side_error"))
        return Reading(build, None, Refusal(f"the side failed: {line}", how, "load"), None, **base)
    taps = rec.get("taps")
    common: dict[str, Any] = {
        **base,
        "taps_from": str(rec.get("taps_from") or ""),
        "loaded": _loaded(rec.get("loaded")),
        "runner": _runner_words(runs),
        "model": str(rec.get("model_class") or ""),
        "recorded": rec.get("recorded"),
        "target": {
            k: rec[k]
            for k in (
                "target_class",
                "target_supports_eagle3",
                "target_error",
                "target_stand_in",
                "target_load_error",
                "target_registry",
            )
            if k in rec
        },
    }
    if rec.get("load_error"):
        line = str(rec["load_error"])
        stage = "class" if _unregistered(line) else "load"
        line = line.split(" Supported architectures:", 1)[0]  # vLLM lists every architecture it has after it
        return Reading(build, None, Refusal(line, f"vLLM {version}: {SRC_LOAD}", stage), None, **common)
    if rec.get("model_error"):
        line = str(rec["model_error"])
        here = any(m in line for m in NOT_BUILT_HERE)
        refusal = Refusal(
            f"not built on this CPU machine: {line}" if here else line,
            f"vLLM {version}: {SRC_BUILD}",
            "here" if here else "model",
        )
        return Reading(build, None, refusal, taps, **common)
    if rec.get("taps_error"):
        # the runner's own aux-layer function raised: `vllm serve` calls it in load_model, so the drafter built on
        # the meta device is never served (dflash_config.target_layer_ids as strings: `i + 1` on a str)
        line = f"the model runner's aux layers from the drafter's config: {rec['taps_error']}"
        return Reading(build, None, Refusal(line, f"vLLM {version}: {SRC_TAPS}", "model"), None, **common)
    return Reading(
        build,
        _layers_vllm(rec),
        None,
        taps,
        fc_in=rec.get("fc_in"),
        target_hidden=rec.get("target_hidden"),
        layer_facts=tuple(rec.get("layers") or ()),
        model_facts=dict(rec.get("model") or {}),
        kv=rec.get("kv"),
        **common,
    )


def _unregistered(line: str) -> bool:
    """vLLM's words for an architecture its registry has no model for."""
    return "are not supported for now" in line or ("not supported" in line and "architecture" in line.lower())


def from_reference(answer: Mapping[str, Any], how: str = "") -> Reading:
    version = f"dflash {answer.get('dflash_version', '0.1.0')}"
    base: dict[str, Any] = {"how": how, "version": version, "loaded": _loaded(answer.get("loaded"))}
    for key, stage in (
        ("side_error", "load"),
        ("load_error", "load"),
        ("class_error", "class"),
        ("init_error", "model"),
    ):
        if answer.get(key):
            line = str(answer[key])
            if stage == "model":
                line = f"the reference cannot build this drafter: {line}"
            return Reading(REFERENCE, None, Refusal(line, SRC_REFERENCE, stage), None, **base)
    types = answer.get("loaded", {}).get("layer_types")
    layers = []
    for i, (kind, window, causal) in enumerate(answer.get("layers") or []):
        sliding = kind == SLIDING
        layers.append(
            Layer(
                str(kind),
                window,
                bool(causal),
                f"layer_types[{i}]" if isinstance(types, list) else "no layer_types",
                ("sliding_window" if window is not None else "none: transformers dropped sliding_window")
                if sliding
                else None,
                "self_attn.is_causal",
            )
        )
    return Reading(
        REFERENCE,
        tuple(layers),
        None,
        answer.get("target_layer_ids"),
        "target_layer_ids (dflash_config first, then the top level)",
        model=str(answer.get("model_class") or ""),
        fc_in=answer.get("fc_in"),
        target_hidden=answer.get("hidden_size"),
        model_facts={k: answer.get(k) for k in ("block_size", "mask_token_id")},
        **base,
    )


def readings(answers: Mapping[str, Mapping[str, Any]], how: Mapping[str, str] | None = None) -> dict[str, Reading]:
    """Each build's Reading from its side's answer to one config."""
    how = how or {}
    out: dict[str, Reading] = {}
    for build, answer in answers.items():
        if build == REFERENCE:
            out[build] = from_reference(answer, how.get(build, ""))
        else:
            out[build] = from_vllm(build, answer, how.get(build, ""))
    return out


def unavailable(build: str, why: str) -> Reading:
    """A column this machine could not compute: said in its place, never guessed."""
    return Reading(build, None, Refusal(f"not computed here: {why}", "", "unavailable"), None, how=why)
