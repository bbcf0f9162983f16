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
from conftest import ModuleTmp
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
    after = {**zero, "num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 20, "generation_tokens": 30}
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
def quoting_repo(module_tmp: ModuleTmp) -> Path:
    import subprocess

    repo = module_tmp("quoting")
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


# --- what a server answers, and the URL that names it (issue 26): one line, its class, never a traceback ----------

import test_gate  # noqa: E402
from test_gate import PROFILE, Fake, cli, error_lines  # noqa: E402

from vllm_dflash.errors import MeasurementError  # noqa: E402
from vllm_dflash.validate import metrics as vm  # noqa: E402
from vllm_dflash.validate.server import check_url  # noqa: E402

_FAMILIES = [vm.DRAFTS, vm.DRAFT_TOKENS, vm.ACCEPTED, vm.ACCEPTED_PER_POS, vm.GENERATION_TOKENS, "vllm:other"]
_VALUES = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["+Inf", "-Inf", "NaN", "1e400", "0x10", "", "1_0", "9" * 400, "40.0", "1e-8"]),
)
_LABEL_VALUES = st.one_of(
    st.integers(0, 40).map(str),
    st.sampled_from(["0" * 5000, "9" * 5000, "01", "-1", "one", "", "٣", "1.5", '\\"', "\\n"]),
    st.text(max_size=12),
)


@st.composite
def metrics_text(draw: st.DrawFn) -> str:
    """Prometheus text in vLLM's shape, with the kinds of damage a broken or hostile server sends: odd values,
    position labels of thousands of digits, missing or repeated TYPE lines, cut lines, junk."""
    lines: list[str] = []
    for _ in range(draw(st.integers(0, 8))):
        family = draw(st.sampled_from(_FAMILIES))
        if draw(st.booleans()):
            lines.append(f"# TYPE {family}_total {draw(st.sampled_from(['counter', 'gauge', 'histogram', 'x']))}")
        labels = [f'engine="{draw(st.integers(0, 2))}"']
        if family == vm.ACCEPTED_PER_POS or draw(st.booleans()):
            labels.append(f'position="{draw(_LABEL_VALUES)}"')
        suffix = draw(st.sampled_from(["_total", "_created", "", "_bucket"]))
        line = f"{family}{suffix}{{{','.join(labels)}}} {draw(_VALUES)}"
        lines.append(line[: draw(st.integers(0, len(line)))] if draw(st.integers(0, 9)) == 0 else line)
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=30)))
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n\n"]))


def _one_measurement_line(exc: MeasurementError) -> None:
    line = exc.one_line()
    assert line.startswith("error: ") and "\n" not in line and len(line) < 2000, line[:300]
    assert exc.return_code == MeasurementError.return_code


@SETTINGS
@given(text=st.one_of(metrics_text(), st.text(max_size=300)))
def test_metrics_text(text: str) -> None:
    try:
        got = vm.parse_spec_counters(text)
    except MeasurementError as exc:
        _one_measurement_line(exc)
        return
    assert all(0 <= p < 10**6 for p in got.per_position)  # a parsed position is a draft position


_BASE = metrics_text()


@settings(max_examples=30, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(after=metrics_text())
def test_validate_against_a_server_exporting_anything(
    fake: tuple[str, Fake], root: Path, tmp_path: Path, after: str
) -> None:
    """Through the CLI against the fake server: exit 0, 1 or 2; exactly one `error:` line when 2, none otherwise;
    never a traceback; the report strict JSON either way."""
    url, state = fake
    state.scrapes, state.before, state.after = 0, "", after
    report = tmp_path / "r.json"
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--report", report, "--quiet",
              "--num-prompts", "1")  # fmt: skip
    assert run.returncode in (0, 1, 2) and "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = error_lines(run)
    assert len(lines) == (1 if run.returncode == 2 else 0), run.stderr[-2000:]
    assert all(len(line) < 2000 for line in lines)
    reports.loads_strict(report.read_bytes())


SECRET = "pw-s3cret"
fake = test_gate.fake  # the fake OpenAI-compatible server whose /metrics says what a test wants
root = test_gate.root  # a checkout with its profile


@st.composite
def endpoint_url(draw: st.DrawFn) -> str:
    scheme = draw(st.sampled_from(["http://", "https://", "ftp://", "", "http:/", "HTTP://"]))
    user = draw(st.sampled_from(["", "user@", f"user:{SECRET}@", ":@"]))
    host = draw(st.sampled_from(["127.0.0.1", "[::1]", "[::1", "localhost", "", "a b", "x\x01y", "é.example",
                                 "a" * 64 + ".example", "[", "]"]))  # fmt: skip
    port = draw(st.sampled_from(["", ":9", ":99999", ":x", ":", ":-1", ":0"]))
    path = draw(st.sampled_from(["", "/", "/v1", "/v1/", "/x", "//", "/v1/chat/completions", "/%00"]))
    tail = draw(st.sampled_from(["", "?a=1", "#f", "?", "#"]))
    return scheme + user + host + port + path + tail


@SETTINGS
@given(url=st.one_of(endpoint_url(), st.text(max_size=60)))
def test_endpoint_url(url: str) -> None:
    try:
        base, note = check_url(url, "--endpoint")
    except MeasurementError as exc:
        _one_measurement_line(exc)
        assert SECRET not in exc.one_line()
        return
    from urllib.parse import urlsplit

    parts = urlsplit(base)
    assert parts.scheme in ("http", "https") and parts.hostname and "@" not in parts.netloc
    assert not parts.query and not parts.fragment and not base.endswith(("/", "/v1")), base
    assert (note is not None) == url.rstrip("/").endswith("/v1")


@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(url=endpoint_url())
def test_validate_endpoint_url(root: Path, tmp_path: Path, url: str) -> None:
    """Through the CLI: refused with one line (exit 2), or polled where nothing listens (one line, exit 2); no
    traceback, the password never shown."""
    run = cli(root, "validate", "--profile", PROFILE, "--endpoint", url, "--health-timeout", "0.3",
              "--report", tmp_path / "r.json")  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, (url, run.stderr[-2000:])
    assert len(error_lines(run)) == 1, (url, run.stderr)
    assert SECRET not in run.stdout + run.stderr


def test_endpoints_are_normalised_and_passwords_redacted() -> None:
    from vllm_dflash import urls

    assert check_url("http://gpu-7:8000/v1/", "--endpoint") == (
        "http://gpu-7:8000",
        "--endpoint: using the server's base URL (without /v1); the tool appends /v1 itself",
    )
    assert check_url("https://proxy.example/vllm/", "--endpoint") == ("https://proxy.example/vllm", None)
    assert check_url("http://[::1]:8000", "--endpoint") == ("http://[::1]:8000", None)
    assert urls.redact(f"https://me:{SECRET}@pypi.example/legacy/") == "https://me:***@pypi.example/legacy/"
    assert urls.upload("https://me@pypi.example/legacy/", "--to", MeasurementError)  # a user alone is no secret


@pytest.mark.parametrize(
    ("ref", "ok"),
    [
        ("vllm-dflash:0.20.1-dflash.1", True),
        ("registry.example.com:5000/ml/vllm-dflash@sha256:" + "a" * 64, True),
        ("localhost/a__b/c-d.e", True),
        ("sha256:" + "b" * 64, True),  # an image ID
        ("--privileged", False),
        ("ml/Vllm", False),
        ("a b", False),
        ("x:tag with space", False),
        ("x@sha256:123", False),
        ("x" * 300, False),
    ],
)
def test_image_references(ref: str, ok: bool) -> None:
    from vllm_dflash import oci

    assert (oci.reference_problem(ref) is None) == ok, oci.reference_problem(ref)


@SETTINGS
@given(ref=st.text(max_size=80))
def test_an_accepted_image_reference_is_no_option_and_no_words(ref: str) -> None:
    from vllm_dflash import oci

    if oci.reference_problem(ref) is None:
        assert not ref.startswith("-") and ref.isascii() and not any(c.isspace() for c in ref) and ref
