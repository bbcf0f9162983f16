"""Property-based tests of every parser that reads a user's file (issue 10): arbitrary bytes and structure-aware
mutations of the real files give a DflashError (one line) or a parsed document, never another exception, and
nothing is written. Bounded and derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dflash import provenance as prov
from vllm_dflash import report as reports
from vllm_dflash.errors import DflashError
from vllm_dflash.manifest import load_manifest, parse_manifest, parse_version
from vllm_dflash.series import parse_patch, read_queue
from vllm_dflash.upstream.evidence import load_watch_rules, parse_drop_when

REPO = Path(__file__).resolve().parents[1]
SETTINGS = settings(
    max_examples=60, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True) or [b""]


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """The real file with a few edits of the kinds people make: lines dropped, duplicated, swapped, truncated,
    a value replaced, junk (or invalid UTF-8) inserted."""
    lines = _lines(base)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        kind = draw(st.sampled_from(["drop", "dup", "swap", "cut", "value", "junk", "bytes"]))
        if kind == "drop" and len(lines) > 1:
            lines.pop(i)
        elif kind == "dup":
            lines.insert(i, lines[i])
        elif kind == "swap":
            j = draw(st.integers(0, max(0, len(lines) - 1)))
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif kind == "value" and b"=" in lines[i]:
            key = lines[i].split(b"=", 1)[0]
            value = draw(
                st.sampled_from([b'""', b"0", b"true", b"[]", b"{}", b'"../x"', b'"a b"', b"-1", b'"\\u0000"'])
            )
            lines[i] = key + b"= " + value + b"\n"
        elif kind == "junk":
            lines.insert(i, draw(st.text(max_size=40)).encode() + b"\n")
        elif kind == "bytes":
            lines.insert(i, draw(st.binary(max_size=20)))
    return b"".join(lines)


def either(parse: Callable[[bytes], object], data: bytes) -> None:
    try:
        parse(data)
    except DflashError as exc:
        assert exc.one_line().startswith("error: ") and "\n" not in exc.one_line()


def _bytes_or_mutation(base: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=400), mutated(base))


def _files(tmp: Path) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


# --- dist.toml and VERSION ---------------------------------------------------------------------------------------

DIST = (REPO / "dist.toml").read_bytes()
VERSION = (REPO / "VERSION").read_text()


@SETTINGS
@given(data=_bytes_or_mutation(DIST))
def test_manifest(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "dist.toml").write_bytes(data)
    (tmp_path / "VERSION").write_text(VERSION)
    before = _files(tmp_path)
    either(lambda _: load_manifest(tmp_path), data)
    assert _files(tmp_path) == before


@SETTINGS
@given(data=st.one_of(st.binary(max_size=60), mutated(VERSION.encode())))
def test_version(data: bytes) -> None:
    either(lambda d: parse_version(d.decode("utf-8", errors="replace"), "0.20.1"), data)


def test_manifest_mutations_reach_the_parser() -> None:
    """Valid TOML with a wrong key or value reaches our parser, which names it (the property tests exercise more
    than tomllib)."""
    base = tomllib.loads(DIST.decode())
    with pytest.raises(DflashError) as info:
        parse_manifest(dict(base, build={"dist_dri": "dist"}), VERSION, REPO)
    assert "did you mean 'dist_dir'" in info.value.one_line()
    with pytest.raises(DflashError, match="must be a non-empty string"):
        parse_manifest(dict(base, upstream=dict(base["upstream"], tag="")), VERSION, REPO)


# --- the patch queue ---------------------------------------------------------------------------------------------

SERIES = (REPO / "patches" / "series").read_bytes()
PATCHES = {p.name: p.read_bytes() for p in sorted((REPO / "patches").glob("*.patch"))}
A_PATCH = next(iter(PATCHES.values()))


@SETTINGS
@given(data=_bytes_or_mutation(SERIES))
def test_series(tmp_path: Path, data: bytes) -> None:
    pdir = tmp_path / "patches"
    pdir.mkdir(exist_ok=True)
    for name, body in PATCHES.items():
        (pdir / name).write_bytes(body)
    (pdir / "series").write_bytes(data)
    before = _files(tmp_path)
    either(lambda _: read_queue(pdir / "series", missing_ok=False), data)
    assert _files(tmp_path) == before


@SETTINGS
@given(data=_bytes_or_mutation(A_PATCH))
def test_patch_file(data: bytes) -> None:
    either(lambda d: parse_patch(Path("0001-x.patch"), d), data)


@SETTINGS
@given(text=st.text(max_size=200))
def test_drop_when_header(text: str) -> None:
    parse_drop_when(text)  # free text: never raises


WATCH = (REPO / "patches" / "watch.toml").read_bytes()


@SETTINGS
@given(data=_bytes_or_mutation(WATCH))
def test_watch_toml(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "watch.toml").write_bytes(data)
    either(lambda _: load_watch_rules(tmp_path), data)


# --- documents inside artifacts and reports ----------------------------------------------------------------------


def _provenance_doc() -> bytes:
    doc = {
        "schema": 1,
        "version": "0.20.1+dflash.1",
        "upstream": {
            "version": "0.20.1",
            "tag": "v0.20.1",
            "git_url": "https://github.com/vllm-project/vllm.git",
            "commit": "f98b2747f",
            "commit_pinned": "f98b2747f",
            "source_kind": "sdist",
            "sdist": {"filename": "vllm-0.20.1.tar.gz", "sha256": "0" * 64},
        },
        "fork": {"branch": "dflash/v0.20.1", "base": "a" * 40, "head": "b" * 40},
        "patches": [{"name": "0001-x.patch", "sha256": "c" * 64, "subject": "x", "commit": "d" * 40, "drop_when": ""}],
        "build": {"tool": "vllm-dflash", "tool_version": "0.1.0", "mode": "fast", "mode_reason": "r"},
        "changed_files": ["vllm/x.py"],
    }
    return json.dumps(doc, indent=2, sort_keys=True).encode()


PROV = _provenance_doc()


def test_provenance_round_trip() -> None:
    doc = prov.loads(PROV)
    assert prov.loads(doc.dumps()) == doc and doc.upstream.sdist_filename == "vllm-0.20.1.tar.gz"


@SETTINGS
@given(data=_bytes_or_mutation(PROV))
def test_provenance(data: bytes) -> None:
    either(prov.loads, data)


def _report() -> bytes:
    zero: dict[str, Any] = {n: 0 for n in reports.COUNTER_NAMES} | {reports.PER_POSITION: {}}
    after = {**zero, "num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 20}
    body = {
        "schema": reports.SCHEMA,
        "profile": {"name": "p", "sha256": "0" * 64, "num_speculative_tokens": 3},
        "server": {"artifact": {"sha256": "1" * 64, "name": "x.whl"}},
        # counts a vLLM drafting k = 3 can produce (load checks them): AL = 1 + 20 / 10 = 3.0
        "counters": {"before": zero, "after": after, "delta": after},  # delta = after - before
        "acceptance": {"mean_acceptance_length": 3.0},
        "gates": [{"gate": "g", "passed": True, "value": 3.0, "threshold": 2.0, "detail": ""}],
        "verdict": "pass",
    }
    return json.dumps(reports.seal(body), indent=2, sort_keys=True).encode()


REPORT = _report()


@SETTINGS
@given(data=_bytes_or_mutation(REPORT))
def test_report(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(data)
    either(lambda _: reports.load(path, None, DflashError), data)


def test_report_mutation_is_caught_by_the_seal(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(REPORT.replace(b'"mean_acceptance_length": 3.0', b'"mean_acceptance_length": 9.0'))
    with pytest.raises(DflashError, match="does not match its seal"):
        reports.load(path, None, DflashError)
    path.write_bytes(REPORT)
    assert reports.load(path, None, DflashError).acceptance_length == 3.0


# --- git's path quoting (issue 19): git itself is the oracle ---------------------------------------------------

_NAME_CHARS = st.sampled_from(["a", "b", ".", " ", "_", "-", '"', "\\", "\t", "é", "\u00a0", "\x01", "z"])


@pytest.fixture(scope="module")
def quoting_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import subprocess

    repo = tmp_path_factory.mktemp("quoting")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    return repo


@SETTINGS
@given(name=st.text(_NAME_CHARS, min_size=1, max_size=12))
def test_diff_reads_paths_as_git_writes_them(quoting_repo: Path, name: str) -> None:
    """Any file name git can diff (spaces, quotes, backslashes, TABs, control and non-ASCII characters) comes back
    from `diff.parse` exactly: a C-quoted `..` is seen as `..`, a space never splits a name."""
    import subprocess

    from vllm_dflash import diff

    if name.strip(".") == "" or name.startswith(" ") or name.endswith(" ") or "/" in name:
        return
    path = f"csrc/{name}"
    (quoting_repo / "csrc").mkdir(exist_ok=True)
    target = quoting_repo / path
    target.write_text("x\n")
    try:
        out = subprocess.run(
            ["git", "-c", "core.quotePath=true", "diff", "--no-index", "/dev/null", path],
            cwd=quoting_repo,
            capture_output=True,
            check=False,
        ).stdout.decode("utf-8", "surrogateescape")
    finally:
        target.unlink()
    (fd,) = diff.parse(out)
    assert fd.new_path == path, (out, fd)


@SETTINGS
@given(data=st.one_of(st.text(max_size=30), st.from_regex(r"0\.20\.1\+dflash\.[0-9]{1,4}", fullmatch=True)))
def test_an_accepted_version_round_trips_through_packaging(data: str) -> None:
    """Whatever VERSION text is accepted is exactly what PEP 440 writes back: one label, one version."""
    from packaging.version import Version

    try:
        version = parse_version(data, "0.20.1")
    except DflashError:
        return
    assert str(Version(version)) == version and version.split("+")[1] == f"dflash.{int(version.split('.')[-1])}"
