"""The code's shape (issue 11): data flows one way, the CLI sits outside the stages, one parser per file format.

Computed from the source with `ast`, so the tests fail the moment a change breaks the rule.
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "vllm_dflash"
TOML_OWNERS = ("manifest", "upstream/evidence", "upstream/rebase")


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> Iterator[str]:
    """Every vllm_dflash module `path` imports, anywhere in the file (function-level imports included: they are
    how cycles usually hide)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            # `from pkg import mod` imports the submodule when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                yield t


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: set(_imports(path, name, known)) for name, path in mods.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 30 and graph["vllm_dflash.cli"], "the graph must see the package"
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_cycle_detector_can_fail() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_arrow_back_up() -> None:
    """Stages never import the CLI, and earlier stages never import later ones."""
    graph = import_graph()
    # conformance builds wheels (pipeline); the doctor reads a checkpoint, runs patch code and, for --prove, the
    # conformance comparison, and nothing later reads the doctor.
    order = ["pipeline", "conformance", "doctor", "validate", "release", "publish"]
    for name, deps in graph.items():
        if not name.startswith(("vllm_dflash.cli", "vllm_dflash.__main__")):
            assert not [d for d in deps if d.startswith("vllm_dflash.cli")], f"{name} imports the CLI"
        for i, stage in enumerate(order):
            if name.startswith(f"vllm_dflash.{stage}"):
                later = [d for d in deps for s in order[i + 1 :] if d.startswith(f"vllm_dflash.{s}")]
                assert not later, f"{name} (stage {stage}) imports a later stage: {later}"


STAGES = ("pipeline", "conformance", "doctor", "validate", "release", "publish", "upstream", "mini", "cli")
# The documents every stage reads: below all of them, so they import no stage (issue 26: the report's plausibility
# rules were in validate/metrics.py, and report.py imported them back up the house).
DOCUMENTS = ("vllm_dflash.report", "vllm_dflash.manifest", "vllm_dflash.provenance", "vllm_dflash.series")


def _stage_imports(graph: dict[str, set[str]], name: str) -> list[str]:
    return sorted(d for d in graph.get(name, ()) for s in STAGES if d.startswith(f"vllm_dflash.{s}"))


def test_documents_import_no_stage() -> None:
    graph = import_graph()
    assert all(d in graph for d in DOCUMENTS), "the graph must see every document module"
    offenders = {d: _stage_imports(graph, d) for d in DOCUMENTS if _stage_imports(graph, d)}
    assert offenders == {}


def test_stage_import_detector_can_fail() -> None:
    graph = {"vllm_dflash.report": {"vllm_dflash.validate.metrics", "vllm_dflash.paths"}}
    assert _stage_imports(graph, "vllm_dflash.report") == ["vllm_dflash.validate.metrics"]
    assert _stage_imports({"vllm_dflash.report": {"vllm_dflash.paths"}}, "vllm_dflash.report") == []


def test_only_the_cli_knows_argparse() -> None:
    offenders = []
    for name, path in _modules().items():
        if name.startswith("vllm_dflash.cli"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] == "argparse" for n in names):
                offenders.append(name)
    assert offenders == []


@pytest.mark.parametrize(
    ("what", "pattern", "owner"),
    [
        (
            "dist.toml",
            r"tomllib\.loads\|tomlkit\.parse",
            {"vllm_dflash/manifest.py", "vllm_dflash/upstream/evidence.py", "vllm_dflash/upstream/rebase.py"},
        ),
        ("series", r"def parse_series\|\.split(\"#\", 1)", {"vllm_dflash/series.py"}),
        ("unified diff", r"^@@ \|\"@@\|'@@", {"vllm_dflash/diff.py"}),
        ("report", r"def seal_problem\|validation-report/", {"vllm_dflash/report.py"}),
        ("provenance", r"dflash_build\.json", {"vllm_dflash/provenance.py"}),
        ("wheel METADATA and WHEEL", r"BytesParser", {"vllm_dflash/pipeline/wheelfile.py"}),
    ],
)
def test_one_parser_per_format(what: str, pattern: str, owner: set[str]) -> None:
    """`git grep` finds the parsing code of each format in its owner module only."""
    out = subprocess.run(
        ["git", "grep", "-l", "-e", pattern, "--", "vllm_dflash/*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert out and set(out) <= owner, f"{what}: parsed in {sorted(set(out) - owner)}"
