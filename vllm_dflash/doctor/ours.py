"""This build's drafter-attention resolution and tap rule: the code the patched vLLM runs, not a copy of it.

The functions come from patch 0002's added lines to `vllm/model_executor/models/qwen3_dflash.py` (or from a patched
`qwen3_dflash.py`, e.g. the installed vLLM of this build), extracted with `ast` and executed in a namespace holding
only the few names they use. The top-level-ids refusal is the patch's own `if` statement, run the same way, and the
tap shift is patch 0001's own expression. A test proves the patch and a patched file give the same code.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dflash.errors import PatchError
from vllm_dflash.series import load_patch

MODEL_FILE = "vllm/model_executor/models/qwen3_dflash.py"
RUNNER_FILE = "vllm/v1/worker/gpu_model_runner.py"
WINDOWS_PATCH = "0002-dflash-sliding-window-layers.patch"
TAPS_PATCH = "0001-dflash-target-layer-taps.patch"
# The module-level definitions the resolution needs, in the order the patch defines them.
NAMES = (
    "_SLIDING",
    "_FULL",
    "_DFLASH_EXACT_WINDOW_BACKENDS",
    "DFlashLayerAttention",
    "_positive_int",
    "resolve_dflash_layer_attention",
)
_IDS_CHECK_MARK = '"target_layer_ids" not in drafter_config'
_TAP_MARK = 'dflash_config.get("target_layer_ids")'


class _PretrainedConfig:
    """Stands in for transformers' PretrainedConfig, which the patch names only in an annotation."""


@dataclass(frozen=True)
class OurCode:
    """The extracted code, compiled, and where it came from."""

    source: str  # e.g. "patches/0002-dflash-sliding-window-layers.patch"
    nodes: tuple[ast.stmt, ...]  # the NAMES definitions, as parsed
    ids_check: ast.stmt  # the patch's `if "target_layer_ids" not in drafter_config ...: raise ValueError(...)`
    tap: ast.stmt | None  # patch 0001's `layer_ids = [i + 1 for i in ...]` (None: a model file without its runner)
    namespace: Mapping[str, Any]

    @property
    def resolve(self) -> Callable[..., list[Any]]:
        fn: Callable[..., list[Any]] = self.namespace["resolve_dflash_layer_attention"]
        return fn

    @property
    def exact_window_backends(self) -> tuple[str, ...]:
        return tuple(self.namespace["_DFLASH_EXACT_WINDOW_BACKENDS"])

    def check_ids(self, config: Any, drafter_config: Mapping[str, Any]) -> str | None:
        """Run the patch's top-level-ids check; the refusal message, or None when it passes."""
        scope: dict[str, Any] = {"self": _Self(config), "drafter_config": dict(drafter_config)}
        try:
            exec(
                compile(ast.Module(body=[self.ids_check], type_ignores=[]), self.source, "exec", dont_inherit=True),
                {},
                scope,
            )
        except ValueError as exc:
            return str(exc)
        return None

    def taps(self, dflash_config: Mapping[str, Any]) -> list[int]:
        """vLLM aux-hidden-state indices this build records for the checkpoint's DFlash ids (patch 0001's code)."""
        if self.tap is None:
            raise PatchError(f"{self.source}: no tap code was read", "read the resolution with its runner file")
        scope: dict[str, Any] = {"dflash_config": dict(dflash_config)}
        exec(compile(ast.Module(body=[self.tap], type_ignores=[]), self.source, "exec", dont_inherit=True), {}, scope)
        return list(scope["layer_ids"])

    def fingerprint(self) -> str:
        """The extracted code normalised by `ast.dump` (what the patch-vs-file test compares)."""
        return "\n".join(ast.dump(n) for n in (*self.nodes, self.ids_check))


@dataclass
class _Self:
    config: Any


def _pick(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    found: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        else:
            continue
        if name in NAMES:
            found[name] = node
    return found


def _statement(lines: list[str], mark: str, where: str) -> ast.stmt:
    """The first complete statement in `lines` whose source contains `mark` (lines are one hunk's added lines)."""
    text = textwrap.dedent("\n".join(line for line in lines if not line.lstrip().startswith("#")))
    for node in ast.parse(text).body:
        if mark in (ast.get_source_segment(text, node) or ""):
            return node
    raise PatchError(f"{where}: no statement containing {mark!r}", "the patch changed shape: update vllm_dflash/doctor")


MODEL_FILE_LIMIT = 4 << 20  # vLLM's qwen3_dflash.py is about 30 KB; a larger file is not it


def _parse_source(path: Path) -> tuple[str, ast.Module]:
    """A Python file given by the user (or found installed), read bounded; what is not Python is one line."""
    from vllm_dflash.paths import read_bounded

    hint = "pass a patched qwen3_dflash.py (vllm-dflash source prints the tree that has it)"
    try:
        text = read_bounded(path, MODEL_FILE_LIMIT, "model file", PatchError, hint).decode()
        return text, ast.parse(text, str(path))
    except FileNotFoundError:
        raise PatchError(f"{path}: no such file", hint) from None
    except UnicodeDecodeError:
        raise PatchError(f"{path} is not UTF-8 text", hint) from None
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # ValueError: a NUL byte
        where = f" at line {exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else ""
        raise PatchError(f"{path} is not Python{where}: {exc.__class__.__name__}", hint) from None


def _compile(source: str, nodes: dict[str, ast.stmt]) -> Mapping[str, Any]:
    missing = [n for n in NAMES if n not in nodes]
    if missing:
        raise PatchError(
            f"{source}: does not define {', '.join(missing)}", "the patch changed shape: update vllm_dflash/doctor"
        )
    module = ast.Module(body=[nodes[n] for n in NAMES], type_ignores=[])
    namespace: dict[str, Any] = {
        "__name__": "vllm_dflash.doctor.patch_0002",
        "Any": Any,
        "Callable": Callable,
        "Mapping": Mapping,
        "dataclass": dataclass,
        "PretrainedConfig": _PretrainedConfig,
    }
    try:
        exec(compile(module, source, "exec", dont_inherit=True), namespace)
    except Exception as exc:  # a default argument or decorator that raises while the definitions are made
        raise PatchError(
            f"{source}: defining {', '.join(NAMES)} raised {exc.__class__.__name__}",
            "pass a patched qwen3_dflash.py that imports cleanly",
        ) from None
    return namespace


def from_patches(patches_dir: Path) -> OurCode:
    """The resolution as patch 0002 adds it, and patch 0001's tap shift."""
    patch = load_patch(patches_dir / WINDOWS_PATCH)
    nodes: dict[str, ast.stmt] = {}
    ids_check: ast.stmt | None = None
    for fd in patch.diff:
        if fd.path != MODEL_FILE:
            continue
        for hunk in fd.hunks:
            added = list(hunk.added)
            try:
                nodes.update(_pick(ast.parse("\n".join(added)).body))
            except SyntaxError:
                pass  # a hunk of lines inside a function: not module-level code
            if any(_IDS_CHECK_MARK in line for line in added):
                ids_check = _statement(added, _IDS_CHECK_MARK, patch.name)
    if ids_check is None:
        raise PatchError(f"{patch.name}: no top-level target_layer_ids check", "update vllm_dflash/doctor")
    taps = load_patch(patches_dir / TAPS_PATCH)
    tap: ast.stmt | None = None
    for fd in taps.diff:
        for hunk in fd.hunks if fd.path == RUNNER_FILE else ():
            if any(_TAP_MARK in line for line in hunk.added):
                tap = _statement(list(hunk.added), _TAP_MARK, taps.name)
    if tap is None:
        raise PatchError(f"{taps.name}: no DFlash tap expression", "update vllm_dflash/doctor")
    source = f"patches/{patch.name}"
    return OurCode(source, tuple(nodes[n] for n in NAMES if n in nodes), ids_check, tap, _compile(source, nodes))


def runner_tap(runner: Path) -> ast.stmt:
    """Patch 0001's tap statement as a patched `gpu_model_runner.py` contains it."""
    text, tree = _parse_source(runner)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _TAP_MARK in (ast.get_source_segment(text, node) or ""):
            if "+ 1" in (ast.get_source_segment(text, node) or ""):
                return node
    raise PatchError(f"{runner}: no shifted DFlash tap", "is this a vLLM with vllm-dflash's patch 0001?")


def from_model_file(path: Path, runner: Path | None = None) -> OurCode:
    """The resolution as a patched `qwen3_dflash.py` contains it (the tree `vllm-dflash source` prints, or the
    installed vLLM of this build), with the tap shift from the same tree's `gpu_model_runner.py`."""
    text, tree = _parse_source(path)
    if runner is None and len(path.resolve().parents) > 2:  # vllm/model_executor/models/ -> vllm/v1/worker/
        runner = path.resolve().parents[2] / "v1" / "worker" / "gpu_model_runner.py"
    nodes = _pick(tree.body)
    ids_check: ast.stmt | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _IDS_CHECK_MARK in (ast.get_source_segment(text, node.test) or ""):
            ids_check = node
            break
    if ids_check is None:
        raise PatchError(f"{path}: no top-level target_layer_ids check", "is this a patched qwen3_dflash.py?")
    source = str(path)
    tap = runner_tap(runner) if runner is not None and runner.is_file() else None
    return OurCode(source, tuple(nodes[n] for n in NAMES if n in nodes), ids_check, tap, _compile(source, nodes))


def installed_model_file() -> Path | None:
    """qwen3_dflash.py of the vLLM installed in this environment, when it carries patch 0002 (found without
    importing vLLM)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "qwen3_dflash.py"
    if path.is_file() and "def resolve_dflash_layer_attention" in path.read_text():
        return path
    return None
