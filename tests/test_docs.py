"""The README and docs/ as a newcomer meets them (issue 30): a README read in five minutes whose sections come in the
order a user needs them, each linking its page; every page linked and every relative link resolving; no path of a
build machine; and no count the code can compute typed by hand -- each one sits in a `<!-- count:NAME -->N<!-- /count
-->` marker that this file recomputes from the code."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 300
SECTIONS = (
    "What it is",
    "Set up",
    "Deploy",
    "Check your drafter",
    "Validate and publish",
    "Follow upstream",
    "Test",
    "Documentation",
)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COUNT = re.compile(r"<!-- count:([a-z0-9-]+) -->([^<]*)<!-- /count -->")
# A typed count of what the code defines (tests, cases, conformance rows, oracle jobs, traces, mutants, checkpoints):
# outside a count marker, the suite refuses it.
TYPED_COUNT = re.compile(
    r"\b\d[\d,]*\s+(?:(?:build × case|conformance|tiny|serving|evidence)\s+)?"
    r"(?:tests|cases|rows|traces|oracle (?:jobs|recomputations|processes)|mutants|checkpoints)\b"
)
# Absolute paths of a build machine: home and temporary directories, mounts, this project's work tree. Generic
# system paths a user needs (/proc/..., /dev/..., /etc/...) and URL paths (/health, /v1/...) are not among them.
LOCAL_ROOTS = ("root", "home", "tmp", "var/tmp", "work", "Users", "mnt", "srv", "scratch", "private", "data", "opt")
LOCAL_PATH = re.compile(
    r"(?:file://|(?<![\w.~/%$-]))/(?:" + "|".join(re.escape(r) for r in LOCAL_ROOTS) + r")(?=[/\s`'\")\]]|$)"
)


def _mutants() -> int:
    spec = importlib.util.spec_from_file_location("_docs_mutants", REPO / "tests" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return len(module.MUTANTS)


def _cases() -> int:
    from vllm_dflash.conformance.cases import CASES

    return len(CASES)


def _rows() -> int:
    from vllm_dflash.conformance.cases import CASES

    return sum(len(spec.builds) for spec in CASES)


def _checkpoints() -> int:
    from vllm_dflash.doctor.table import load_entries

    return len(load_entries())


# Every count a page may type, and the code that computes it.
COUNTS: dict[str, Callable[[], int]] = {
    "conformance-cases": _cases,
    "conformance-rows": _rows,
    "doctor-checkpoints": _checkpoints,
    "mutants": _mutants,
}


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _outside_fences(text: str) -> str:
    """The text without fenced code blocks (commands there are not prose headings)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def sections(text: str) -> list[tuple[str, str]]:
    """The README's `## ` sections, in order, each with its body."""
    out: list[tuple[str, str]] = []
    for line in _outside_fences(text).splitlines():
        if line.startswith("## "):
            out.append((line[3:].strip(), ""))
        elif out:
            out[-1] = (out[-1][0], out[-1][1] + line + "\n")
    return out


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links of `text` (the file at `path`) that name no existing file."""
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        if not (path.parent / target.split("#", 1)[0]).exists():
            out.append(target)
    return out


def local_paths(text: str) -> list[str]:
    return [m.group(0) + text[m.end() : m.end() + 30].split()[0] if text[m.end() :].split() else m.group(0)
            for m in LOCAL_PATH.finditer(text)]  # fmt: skip


def count_errors(text: str, counts: dict[str, Callable[[], int]] = COUNTS) -> list[str]:
    """Each count marker whose number is not what the code computes, or that names no known count; and each typed
    count outside a marker."""
    out = []
    for name, typed in COUNT.findall(text):
        if name not in counts:
            out.append(f"count:{name} is no count the code computes (known: {', '.join(sorted(counts))})")
        elif typed.strip() != str(counts[name]()):
            out.append(f"count:{name} says {typed.strip()}, the code computes {counts[name]()}")
    for m in TYPED_COUNT.finditer(COUNT.sub("", text)):
        out.append(f"typed count {m.group(0)!r}: put it in a <!-- count:NAME --> marker or drop it")
    return out


# ---- the README ----------------------------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move text to docs/)"


def test_readme_sections_come_in_order_and_each_links_its_page() -> None:
    found = sections(README.read_text())
    assert tuple(name for name, _ in found) == SECTIONS
    for name, body in found:
        assert re.search(r"\]\(docs/[\w.-]+\.md", body), f"README section '{name}' links no docs/ page"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {t.split("#", 1)[0] for t in LINK.findall(README.read_text())}
    missing = [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in linked]
    assert DOCS.is_dir() and not missing, f"pages the README never links: {missing}"


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path, path.read_text()) == []


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_local_paths(path: Path) -> None:
    assert local_paths(path.read_text()) == [], "a build machine's path: use ~, a relative path or a placeholder"


@pytest.mark.parametrize("path", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_typed_counts_are_the_codes(path: Path) -> None:
    assert count_errors(path.read_text()) == []


def test_the_counts_are_used() -> None:
    """Each count the code computes appears in some page (a count nobody types needs no entry)."""
    used = {name for p in pages() for name, _ in COUNT.findall(p.read_text())}
    assert used == set(COUNTS), f"unused: {set(COUNTS) - used}, unknown: {used - set(COUNTS)}"


# ---- the checkers can fail ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<!-- count:conformance-cases -->{cases}<!-- /count --> cases", []),
        ("<!-- count:conformance-cases -->{cases_off}<!-- /count --> cases", ["count:conformance-cases says"]),
        ("<!-- count:conformance-rows -->37<!-- /count --> rows", ["count:conformance-rows says 37"]),
        ("<!-- count:mutants -->{mutants_off}<!-- /count --> mutants", ["count:mutants says"]),
        ("<!-- count:oracle-traces -->34<!-- /count --> traces", ["count:oracle-traces is no count"]),
        ("the conformance section says 36 rows and 32 oracle recomputations", ["typed count '36 rows'", "32 oracle"]),
        ("the quick tier, 334 tests, 5.3 min warm; on the 34 traces of one run", ["'334 tests'", "'34 traces'"]),
        ("2 prompts of 120 and 150 tokens; 6 seeds; 5 trials", []),
    ],
    ids=[
        "right",
        "case-off-by-one",
        "rows-drifted",
        "mutants-off",
        "unknown-count",
        "typed-rows",
        "typed-tests",
        "other-numbers",
    ],
)
def test_count_checker_reports_a_wrong_count(text: str, expected: list[str]) -> None:
    cases, mutants = _cases(), _mutants()
    errors = count_errors(text.format(cases=cases, cases_off=cases + 1, mutants_off=mutants - 1))
    assert len(errors) == len(expected) and all(e in err for e, err in zip(expected, errors, strict=True)), errors


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("cached under `/root/.cache/vllm-dflash/mini`", True),
        ("-v ~/.cache/huggingface:/root/.cache/huggingface", True),
        ("the log in /tmp/f-pip.log", True),
        ("see /work/shared/notes/upstream-facts.md", True),
        ("publish --to /srv/pypi", True),
        ("pip install --index-url file:///srv/pypi/simple vllm", True),
        ("a key in /home/ops/release-key.pem", True),
        ("/Users/me/models", True),
        ("-v ~/.cache/huggingface:/models -e HF_HOME=/models", False),
        ("`/proc/sys/fs/binfmt_misc`, `/health`, `/v1/completions`, `/dev/null`, `/etc`", False),
        ("https://example.org/tmp/x and owner/repo@abc:src/tmp/y.py and ~/.cache/vllm-dflash", False),
        ("dist/vllm-0.20.1+dflash.1.whl, $VLLM_DFLASH_CACHE/tmp and a/home/b", False),
    ],
)
def test_local_path_checker(text: str, found: bool) -> None:
    assert bool(local_paths(text)) == found, local_paths(text)


def test_link_and_section_checkers_fail_on_their_bad_input(tmp_path: Path) -> None:
    page = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# a\n")
    assert broken_links(page, "[a](docs/a.md#x) [u](https://x.org/y) [s](#top)") == []
    assert broken_links(page, "[b](docs/b.md) [a](docs/a.md)") == ["docs/b.md"]
    text = "# t\n## Set up\nsee [a](docs/a.md)\n```\n## not a heading\n```\n## What it is\nno link\n"
    assert [n for n, _ in sections(text)] == ["Set up", "What it is"] != list(SECTIONS[:2])
