"""Mutation testing of the proof's decision lines: do the tests fail when a decision is wrong?

    python benchmarks/mutate.py FILE [--only FUNC,...] [--json OUT] [-- PYTEST ARGS...]
    python benchmarks/mutate.py --plan proof [--json OUT] [--files NAME,...]

It reads FILE with `ast`, finds its decision points and makes one mutant per change:

- `flip`: a comparison replaced by its complement (`<` -> `>=`, `==` -> `!=`, `in` -> `not in`, `is` -> `is not`);
- `boundary`: `<` <-> `<=`, `>` <-> `>=` (the off-by-one of a threshold);
- `const`: a number compared against moved (an int by +-1, a float doubled and halved, 0.0 to +-1.0);
- `boolop`: `and` <-> `or`;
- `negate`: the condition of an `if`/`elif`/`while`, a conditional expression or a comprehension filter, and a
  returned boolean, wrapped in `not (...)`;
- `drop`: a statement that appends, extends or `+=` (how a failure reason is usually recorded) replaced by `pass`.

Which tests judge a mutant is measured, not guessed: the candidate selection (default: the quick tier's test
files minus EXCLUDED; or PYTEST ARGS) runs once, unmutated, in a private copy of the checkout with every Python
process tracing the files to mutate (mutate_trace.py: pytest and the `python -m vllm_dflash` subprocesses tests
start); it must pass. Then each mutant is written into the copy (never into the checkout) and only the tests that
executed its lines run against it, fastest first, with `-x`: killed (a test failed, or it ran past 3x their time),
or survived (they all passed; also when no test executes the line at all). `--plan proof` runs the six files of
the proof (PROOF) after one traced run and prints one summary row per file and the survivors' lines.

A measurement tool, not a test: tests/test_mutate.py proves the harness itself (its operators, and that a weak test
lets a mutant survive which a strong one kills).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (file, functions to mutate (empty: the whole file)): the decision code the issue names.
PROOF: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vllm_dflash/report.py", ()),
    ("vllm_dflash/validate/gates.py", ()),
    ("vllm_dflash/validate/metrics.py", ()),
    (
        "vllm_dflash/conformance/compare.py",
        (
            "judge",
            "serving_problems",
            "judge_refusal",
            "judge_unproven",
            "run_verdict",
            "_unverified",
            # the eviction proof's judges (issue 38)
            "_evicted",
            "kv_problems",
            "kv_geometry_problems",
            "_held_bytes",
            "kv_claim_problems",
            "judge_kv_claims",
        ),
    ),
    ("tests/conformance_plugin/vllm_dflash_conformance_plugin/recorder.py", ()),
    ("vllm_dflash/publish.py", ()),
)
# Quick test files the candidate selection leaves out: minutes of subprocesses each (test_inputs), the lint of the
# checkout (a mutant is not formatted as ruff would: every one would be "killed"), this harness's own test.
EXCLUDED = frozenset({"test_inputs.py", "test_lint.py", "test_mutate.py"})

_COMPLEMENT: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BOUNDARY: dict[type[ast.cmpop], type[ast.cmpop]] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_RECORDING_CALLS = frozenset({"append", "extend"})
_BOOLEAN_CALLS = frozenset({"all", "any", "isinstance", "bool", "callable", "hasattr"})


@dataclass(frozen=True)
class Mutation:
    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str
    kind: str
    function: str  # the innermost enclosing function ("" at module level)
    original: str

    @property
    def description(self) -> str:
        def short(s: str) -> str:
            s = " ".join(s.split())
            return s if len(s) <= 70 else s[:67] + "..."

        return f"L{self.line} {self.kind}: `{short(self.original)}` -> `{short(self.replacement)}`"


@dataclass
class Result:
    mutation: Mutation
    status: str  # killed | survived | timeout
    seconds: float
    tests: int  # how many tests executed the mutated lines (and so were run against it)


@dataclass
class FileReport:
    file: str
    only: tuple[str, ...]
    selection: list[str]
    started_s: float  # seconds into the run when this file's mutants began (after the traced baseline)
    results: list[Result] = field(default_factory=list)

    @property
    def survivors(self) -> list[Result]:
        return [r for r in self.results if r.status == "survived"]

    def summary(self) -> str:
        n, s = len(self.results), len(self.survivors)
        scope = f" ({', '.join(self.only)})" if self.only else ""
        return f"{self.file}{scope}: {n} mutants, {n - s} killed, {s} survived"


# ---------------------------------------------------------------------------------------------------------------
# Finding the mutations


def _segment(lines: Sequence[str], node: ast.AST) -> str:
    text = "".join(lines[node.lineno - 1 : node.end_lineno])  # type: ignore[attr-defined]
    start = node.col_offset  # type: ignore[attr-defined]
    end_in_last = node.end_col_offset  # type: ignore[attr-defined]
    last_start = len(text) - len(lines[node.end_lineno - 1])  # type: ignore[attr-defined]
    return text[start : last_start + end_in_last]


def _is_boolean(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Compare | ast.BoolOp):
        return True
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return True
    if isinstance(expr, ast.Constant) and isinstance(expr.value, bool):
        return True
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in _BOOLEAN_CALLS


def _moved(value: int | float) -> list[int | float]:
    if isinstance(value, int):
        return [value + 1, value - 1]
    return [value * 2, value / 2] if value else [1.0, -1.0]


class _Finder(ast.NodeVisitor):
    def __init__(self, source: str, only: Sequence[str]) -> None:
        self.lines = source.splitlines(keepends=True)
        self.only = set(only)
        self.stack: list[str] = []
        self.found: list[Mutation] = []

    def _in_scope(self) -> bool:
        return not self.only or bool(self.only & set(self.stack))

    def _add(self, node: ast.AST, replacement: str, kind: str) -> None:
        if not self._in_scope():
            return
        self.found.append(
            Mutation(
                line=node.lineno,  # type: ignore[attr-defined]
                col=node.col_offset,  # type: ignore[attr-defined]
                end_line=node.end_lineno,  # type: ignore[attr-defined]
                end_col=node.end_col_offset,  # type: ignore[attr-defined]
                replacement=replacement,
                kind=kind,
                function=self.stack[-1] if self.stack else "",
                original=_segment(self.lines, node),
            )
        )

    def _negate(self, expr: ast.expr) -> None:
        self._add(expr, f"(not ({_segment(self.lines, expr)}))", "negate")

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            for table, kind in ((_COMPLEMENT, "flip"), (_BOUNDARY, "boundary")):
                new_op = table.get(type(op))
                if new_op is None:
                    continue
                mutant = copy.deepcopy(node)
                mutant.ops[i] = new_op()
                self._add(node, f"({ast.unparse(mutant)})", kind)
        for i, operand in enumerate([node.left, *node.comparators]):
            value = operand.value if isinstance(operand, ast.Constant) else None
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            for moved in _moved(value):
                mutant = copy.deepcopy(node)
                const = ast.Constant(moved)
                if i == 0:
                    mutant.left = const
                else:
                    mutant.comparators[i - 1] = const
                self._add(node, f"({ast.unparse(mutant)})", "const")
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        mutant = copy.deepcopy(node)
        mutant.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._add(node, f"({ast.unparse(mutant)})", "boolop")
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._negate(node.test)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        for cond in node.ifs:
            self._negate(cond)
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and _is_boolean(node.value):
            self._negate(node.value)
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in _RECORDING_CALLS:
            self._add(node, "pass", "drop")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.op, ast.Add):
            self._add(node, "pass", "drop")
        self.generic_visit(node)


def find_mutations(source: str, only: Sequence[str] = ()) -> list[Mutation]:
    """Every mutation of `source`'s decision points (within the functions named in `only`, if any), each of which
    still compiles, in source order, without duplicates."""
    finder = _Finder(source, only)
    finder.visit(ast.parse(source))
    out: list[Mutation] = []
    seen: set[str] = set()
    for m in sorted(finder.found, key=lambda m: (m.line, m.col, m.kind, m.replacement)):
        text = apply(source, m)
        if text in seen or text == source:
            continue
        try:
            compile(text, "<mutant>", "exec")
        except SyntaxError:
            continue
        seen.add(text)
        out.append(m)
    return out


def apply(source: str, m: Mutation) -> str:
    lines = source.splitlines(keepends=True)
    start = sum(len(x) for x in lines[: m.line - 1]) + m.col
    end = sum(len(x) for x in lines[: m.end_line - 1]) + m.end_col
    return source[:start] + m.replacement + source[end:]


# ---------------------------------------------------------------------------------------------------------------
# Running the selection against each mutant


def _project_files(root: Path) -> list[Path]:
    """What a copy of the checkout holds: git's tracked and unignored files, or (no git) everything but caches."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "-co", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
        return [Path(p) for p in out.decode().split("\0") if p]
    except (subprocess.CalledProcessError, FileNotFoundError):
        skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
        return [p.relative_to(root) for p in root.rglob("*") if p.is_file() and not skip & set(p.parts)]


def copy_project(root: Path, dest: Path) -> Path:
    """A copy of the checkout's files at `dest`, itself a git work tree with every file added (tests `git grep`)."""
    for rel in _project_files(root):
        src = root / rel
        if not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    for cmd in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", "-C", str(dest), *cmd], check=True, capture_output=True)
    return dest


def candidate_selection(root: Path) -> list[str]:
    """The tests mutants are judged by: the quick tier's test files, minus EXCLUDED."""
    files = [f"tests/{t.name}" for t in sorted((root / "tests").glob("test_*.py")) if t.name not in EXCLUDED]
    return ["-m", "not heavy", *files]


@dataclass(frozen=True)
class Trace:
    """Which candidate test executed which lines (in pytest or in a subprocess it started), and how long it took."""

    hits: dict[str, dict[str, set[int]]]  # test node id -> file (relative) -> lines
    durations: dict[str, float]

    def tests_for(self, rel: str, lines: range) -> list[str]:
        """The tests that ran any of `lines` of `rel`, fastest first; every test when a module body ran them."""
        from mutate_trace import COLLECT

        wanted = set(lines)
        if wanted & self.hits.get(COLLECT, {}).get(rel, set()):
            chosen = [t for t in self.hits if t != COLLECT] + list(self.durations)
        else:
            chosen = [t for t, files in self.hits.items() if t != COLLECT and wanted & files.get(rel, set())]
        return sorted(set(chosen), key=lambda t: (self.durations.get(t, 0.0), t))


def _env(copy_root: Path, extra: Sequence[Path] = ()) -> dict[str, str]:
    path = [str(copy_root), *map(str, extra), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's .pyc must never be taken for the original's
    return env


def trace(copy_root: Path, rels: Sequence[str], selection: Sequence[str], work: Path) -> Trace:
    """One run of `selection` in the copy with every process tracing `rels`; it must pass (the unmutated baseline)."""
    site, out = work / "site", work / "trace"
    site.mkdir()
    out.mkdir()
    shutil.copy2(Path(__file__).with_name("mutate_trace.py"), site / "mutate_trace.py")
    (site / "sitecustomize.py").write_text("import mutate_trace\n\nmutate_trace.start()\n")
    env = _env(copy_root, [site])
    env.update(MUTATE_TRACE_FILES=os.pathsep.join(str(copy_root / r) for r in rels), MUTATE_TRACE_OUT=str(out))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mutate_trace"]
    cmd += ["-W", "ignore::pytest.PytestAssertRewriteWarning", *selection]  # it is imported by sitecustomize
    r = subprocess.run(cmd, cwd=copy_root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join(r.stdout.splitlines()[-15:])
        raise SystemExit(f"{tail}\nerror: the unmutated selection fails (exit {r.returncode}) -- fix the tests first")
    hits: dict[str, dict[str, set[int]]] = {}
    durations: dict[str, float] = {}
    for part in out.glob("*.json"):
        data = json.loads(part.read_text())
        durations.update(data["durations"])
        for test, files in data["hits"].items():
            for f, lines in files.items():
                rel = str(Path(f).relative_to(copy_root.resolve()))
                hits.setdefault(test, {}).setdefault(rel, set()).update(lines)
    return Trace(hits, durations)


def _run(copy_root: Path, tests: Sequence[str], timeout_s: float, work: Path) -> tuple[str, float]:
    args = work / "tests.args"
    args.write_text("".join(t + "\n" for t in tests))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", f"@{args}"]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=copy_root, env=_env(copy_root), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0
    return ("survived" if r.returncode == 0 else "killed"), time.monotonic() - t0


def _check_copy_is_imported(copy_root: Path, rels: Sequence[str]) -> None:
    """Each file to mutate that lies in a package is imported from the copy, not from an installed checkout (an
    editable install's finder comes after PYTHONPATH, but say so if that ever changes)."""
    for rel in rels:
        parts = Path(rel).with_suffix("").parts
        if not (copy_root / parts[0] / "__init__.py").is_file():
            continue  # not in a package: its tests put it on sys.path themselves
        code = f"import importlib, pathlib; print(pathlib.Path(importlib.import_module({'.'.join(parts)!r}).__file__))"
        r = subprocess.run(
            [sys.executable, "-c", code], cwd=copy_root, env=_env(copy_root), capture_output=True, text=True
        )
        got = Path(r.stdout.strip()).resolve() if r.returncode == 0 else None
        if got != (copy_root / rel).resolve():
            raise SystemExit(f"error: {rel} is not imported from the copy ({got}) -- report this")


def run(
    root: Path,
    jobs: Sequence[tuple[str, tuple[str, ...]]],
    selection: Sequence[str] | None = None,
    show: bool = True,
) -> list[FileReport]:
    """Every mutant of every (file, functions) job against the tests that execute its lines, in a private copy of
    `root`: one traced baseline run of the candidate selection, then one pytest run per mutant."""
    sel = list(selection) if selection else candidate_selection(root)
    sys.path.insert(0, str(Path(__file__).parent))  # mutate_trace, for its COLLECT name
    reports: list[FileReport] = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as td:
        work = Path(td)
        copy_root = copy_project(root, work / "checkout")
        _check_copy_is_imported(copy_root, [r for r, _ in jobs])
        t0 = time.monotonic()
        if show:
            print(f"tracing {', '.join(r for r, _ in jobs)} over: {' '.join(sel)}", flush=True)
        traced = trace(copy_root, [r for r, _ in jobs], sel, work)
        if show:
            print(
                f"traced baseline passed in {time.monotonic() - t0:.0f} s ({len(traced.durations)} tests)", flush=True
            )
        for rel, only in jobs:
            source = (root / rel).read_text()
            mutations = find_mutations(source, only)
            report = FileReport(rel, tuple(only), sel, round(time.monotonic() - t0, 1))
            if show:
                print(f"== {rel}: {len(mutations)} mutants", flush=True)
            target = copy_root / rel
            try:
                for i, m in enumerate(mutations, 1):
                    tests = traced.tests_for(rel, range(m.line, m.end_line + 1))
                    if not tests:
                        status, secs = "survived", 0.0  # no test executes the line: nothing can fail
                    else:
                        target.write_text(apply(source, m))
                        budget = 3 * sum(traced.durations.get(t, 1.0) for t in tests) + 60
                        status, secs = _run(copy_root, tests, budget, work)
                    report.results.append(Result(m, status, round(secs, 1), len(tests)))
                    if show:
                        print(
                            f"  [{i}/{len(mutations)}] {status:8} {secs:5.1f} s {len(tests):4} tests  {m.description}",
                            flush=True,
                        )
            finally:
                target.write_text(source)
            reports.append(report)
    return reports


def _plan(names: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    return [(rel, only) for rel, only in PROOF if not names or any(n in rel for n in names)]


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in args_in:
        i = args_in.index("--")
        args_in, pytest_args = args_in[:i], args_in[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", help="source file, relative to the checkout")
    ap.add_argument("--only", default="", help="comma-separated function names to mutate (default: the whole file)")
    ap.add_argument("--plan", choices=["proof"], default=None, help="the proof's six files (PROOF)")
    ap.add_argument("--files", default="", help="with --plan: only the plan's files whose path contains one of these")
    ap.add_argument("--root", type=Path, default=REPO, help="the checkout (default: this one)")
    ap.add_argument("--json", type=Path, default=None, help="write every result here")
    ap.add_argument("--list", action="store_true", help="only list the mutations")
    args = ap.parse_args(args_in)
    if (args.file is None) == (args.plan is None):
        ap.error("name a FILE or --plan proof")
    jobs = (
        _plan([n for n in args.files.split(",") if n])
        if args.plan
        else [(args.file, tuple(n for n in args.only.split(",") if n))]
    )
    if args.list:
        for rel, only in jobs:
            for m in find_mutations((args.root / rel).read_text(), only):
                print(f"{rel}:{m.description}")
        return 0
    t0 = time.monotonic()
    reports = run(args.root, jobs, pytest_args or None)
    print(f"\nmutation survivors ({time.monotonic() - t0:.0f} s):")
    for rep in reports:
        print(f"  {rep.summary()}")
        for r in rep.survivors:
            print(f"      survived  {r.mutation.description}")
    if args.json is not None:
        data = [
            {**{k: v for k, v in asdict(rep).items() if k != "results"}, "summary": rep.summary(),
             "results": [{**asdict(r.mutation), "description": r.mutation.description, "status": r.status,
                          "seconds": r.seconds} for r in rep.results]}
            for rep in reports
        ]  # fmt: skip
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
