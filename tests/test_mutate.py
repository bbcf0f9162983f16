"""The mutation harness (benchmarks/mutate.py) measures what it says: its operators find the decision points, a
mutant runs only against the tests that execute its line, a weak test lets a mutant survive and a strong one kills
it, and the checkout it copies is never written."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import mutate  # noqa: E402 -- benchmarks/ is not a package

JUDGE = """\
def verdict(al: float, floor: float, k: int) -> list[str]:
    reasons = []
    if al < floor:
        reasons.append("low")
    if k > 0 and al > k + 1:
        reasons.append("impossible")
    return reasons


def passed(reasons: list[str]) -> bool:
    return not reasons


def unused(x: int) -> bool:
    return x == 3
"""

WEAK = """\
from pkg.judge import passed, verdict


def test_good() -> None:
    assert passed(verdict(3.0, 2.0, 3))
"""

STRONG = """\
from pkg.judge import passed, unused, verdict


def test_good() -> None:
    assert passed(verdict(3.0, 2.0, 3))


def test_bad() -> None:
    assert verdict(1.0, 2.0, 3) == ["low"]
    assert not passed(verdict(1.0, 2.0, 3))
    assert verdict(2.0, 2.0, 3) == []  # the boundary itself passes
    assert verdict(4.5, 2.0, 3) == ["impossible"]
    assert verdict(4.0, 2.0, 3) == []  # AL = k + 1 is possible
    assert verdict(5.0, 2.0, 0) == []  # no k, no bound
    assert verdict(5.0, 2.0, 1) == ["impossible"]


def test_unused() -> None:
    assert unused(3) and not unused(2) and not unused(4)
"""


def test_operators_find_every_kind() -> None:
    found = mutate.find_mutations(JUDGE)
    kinds = {m.kind for m in found}
    assert kinds == {"flip", "boundary", "const", "boolop", "negate", "drop"}, kinds
    text = {m.description for m in found}
    assert "L3 flip: `al < floor` -> `(al >= floor)`" in text
    assert "L3 boundary: `al < floor` -> `(al <= floor)`" in text
    assert "L5 const: `k > 0` -> `(k > 1)`" in text and "L5 const: `k > 0` -> `(k > -1)`" in text
    assert "L5 boolop: `k > 0 and al > k + 1` -> `(k > 0 or al > k + 1)`" in text
    assert "L4 drop: `reasons.append('low')` -> `pass`" in text or 'L4 drop: `reasons.append("low")` -> `pass`' in text
    assert "L11 negate: `not reasons` -> `(not (not reasons))`" in text
    # Every mutant compiles, differs from the source and from every other mutant.
    sources = [mutate.apply(JUDGE, m) for m in found]
    assert len(set(sources)) == len(sources) and JUDGE not in sources
    for s in sources:
        compile(s, "<m>", "exec")
    # --only restricts to the named functions.
    assert {m.function for m in mutate.find_mutations(JUDGE, ["passed"])} == {"passed"}


def _project(tmp: Path, tests: str) -> Path:
    root = tmp / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "judge.py").write_text(JUDGE)
    (root / "tests").mkdir()
    (root / "tests" / "test_judge.py").write_text(tests)
    return root


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("strength", ["weak", "strong"])
def test_weak_tests_let_mutants_survive_and_strong_ones_kill_them(tmp_path: Path, strength: str) -> None:
    root = _project(tmp_path, WEAK if strength == "weak" else STRONG)
    before = _tree(root)
    (rep,) = mutate.run(root, [("pkg/judge.py", ())], ["tests"], show=False)
    assert _tree(root) == before, "the harness wrote into the checkout it measures"
    by = {r.mutation.description: r for r in rep.results}
    assert len(by) == len(mutate.find_mutations(JUDGE))
    unused = [r for r in rep.results if r.mutation.function == "unused"]
    if strength == "weak":
        # `unused` is never executed: its mutants survive without running anything.
        assert unused and all(r.status == "survived" and r.tests == 0 for r in unused)
        survivors = {r.mutation.description for r in rep.survivors}
        assert "L3 boundary: `al < floor` -> `(al <= floor)`" in survivors  # nothing tests the boundary
        assert "L3 flip: `al < floor` -> `(al >= floor)`" not in survivors  # test_good kills this one
        assert any(r.mutation.kind == "drop" for r in rep.survivors)  # no test fails a reason
    else:
        assert rep.survivors == [], [r.mutation.description for r in rep.survivors]
        assert all(r.tests >= 1 for r in rep.results)
        assert {r.status for r in rep.results} == {"killed"}
    assert rep.summary().startswith("pkg/judge.py: ")


def test_a_failing_baseline_is_refused(tmp_path: Path) -> None:
    root = _project(tmp_path, WEAK.replace("assert passed", "assert not passed"))
    with pytest.raises(SystemExit, match="unmutated selection fails"):
        mutate.run(root, [("pkg/judge.py", ())], ["tests"], show=False)


def test_the_proof_plan_names_existing_files_and_functions() -> None:
    import ast

    for rel, only in mutate.PROOF:
        tree = ast.parse((REPO / rel).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert set(only) <= names, (rel, set(only) - names)
        assert mutate.find_mutations((REPO / rel).read_text(), only), rel
    sel = mutate.candidate_selection(REPO)
    assert sel[:2] == ["-m", "not heavy"] and "tests/test_gate.py" in sel
    assert not {Path(s).name for s in sel[2:]} & mutate.EXCLUDED


def test_trace_dumps_of_one_pid_never_overwrite_each_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pids wrap in a long run: two processes with the same pid must leave two trace files, or a test's lines are
    lost and its mutants are counted as survivors no test executes."""
    import mutate_trace as mt

    monkeypatch.setattr(mt, "_out", str(tmp_path))
    monkeypatch.setattr(mt, "_hits", {"t::a": {"f.py": {1}}})
    mt._dump()
    monkeypatch.setattr(mt, "_hits", {"t::b": {"f.py": {2}}})
    mt._dump()  # the same pid again, as a later process that got it would be
    dumps = sorted(tmp_path.glob("*.json"))
    assert len(dumps) == 2 and all(p.name.startswith(f"{os.getpid()}-") for p in dumps)


def test_every_hand_picked_mutant_still_applies() -> None:
    """tests/mutants.py's mutants name exact lines of the code; one that no longer matches (the code moved on) would
    be reported as stale only when someone runs the plan, so "N of N killed" could not be reproduced at HEAD."""
    import subprocess

    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "mutants.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 stale" in run.stdout
