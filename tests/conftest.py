"""Shared fixtures. Downloads are real (PyPI) and cached in $VLLM_DFLASH_CACHE (default ~/.cache/vllm-dflash).

The pipeline fixtures (engineer H1) prepare the real vLLM 0.20.1 sdist tree once per session; tests that change a
tree work on a cheap `git clone --shared` of it. Patches used by the tests are written with real git
(`git format-patch`) against that tree.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from vllm_dflash.manifest import Manifest, load_manifest

REPO = Path(__file__).resolve().parents[1]

# The quick tier (scripts/test quick) leaves out every test marked `heavy`. A test is heavy when it is marked so, or
# when it uses (directly or through other fixtures) one of these: they need the real vLLM sources or wheels, a side
# environment, or a container store.
HEAVY_FIXTURES = frozenset(
    {
        "sdist_tree",
        "real_cache",
        "ref_python",
        "cpu_python",
        "cpu",
        "podman_store",
        "both_wheels",
        "dflash_wheel",
        "base_wheel",
        "built",
        "tree_0220",
        "doctor",
        "doctor_servers",
    }
)


# Tests that build or run container images (podman, buildah, debootstrap, runc): marker `containers`, the ones
# `VLLM_DFLASH_SKIP_CONTAINER_TESTS=1 scripts/test` leaves out where those tools cannot be installed.
CONTAINER_FIXTURES = frozenset({"podman_store", "emulated_store"})
# Tests that build or run the other platform's image under qemu (marker `emulation`, also `containers`): what
# `VLLM_DFLASH_SKIP_EMULATION_TESTS=1 scripts/test` leaves out where no binfmt_misc handler can be registered.
EMULATION_FIXTURES = frozenset({"emulated_store"})


# Tests that need the trained miniature (marker `miniature`): when one is selected, it is trained in the background
# from the start of the run (tests/train_ahead.py).
MINIATURE_FIXTURES = frozenset({"mini_models"})


# Each test file's seconds in the last measured full tier (benchmarks/bench_tier.py --ingest LOG --save-order).
FILE_SECONDS = REPO / "tests" / "file_seconds.json"


def longest_files_first(items: list[pytest.Item], seconds: Mapping[str, float]) -> list[pytest.Item]:
    """`items` with whole files reordered, the longest (by `seconds`, keyed like "tests/test_x.py") first; within a
    file, and among files with no figure (after the measured ones), the collection order stays. `--dist loadfile`
    hands files to the workers in this order: a long file collected late would end the run alone (the cold tier of
    2026-12-06 collected tests/test_pins.py, 949 s, about 1,860 s in)."""

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    first = {file_of(item): i for i, item in reversed(list(enumerate(items)))}
    return sorted(items, key=lambda item: (-seconds.get(file_of(item), -1.0), first[file_of(item)]))


def _file_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(FILE_SECONDS.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # no figures (or unreadable): collection order


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = longest_files_first(items, _file_seconds())
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if uses & MINIATURE_FIXTURES:
            item.add_marker(pytest.mark.miniature)
        if uses & EMULATION_FIXTURES:
            item.add_marker(pytest.mark.emulation)
        if uses & CONTAINER_FIXTURES:
            item.add_marker(pytest.mark.containers)
        if uses & HEAVY_FIXTURES or item.get_closest_marker("containers") is not None:
            item.add_marker(pytest.mark.heavy)


@contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on 127.0.0.1 (a free port) in a thread; yields the base URL, shuts the server down after."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def write_wheel(dest: Path, name: str, version: str, files: Mapping[str, bytes], tag: str = "py3-none-any") -> Path:
    """A minimal but complete wheel pip installs: `files` plus METADATA, WHEEL and a RECORD with every hash."""
    dist = f"{name}-{version}.dist-info"
    members = {
        **files,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
    }
    rows = [
        f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for p, d in members.items()
    ]
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for p, d in members.items():
            zf.writestr(p, d)
        zf.writestr(f"{dist}/RECORD", "\n".join([*rows, f"{dist}/RECORD,,"]) + "\n")
    return wheel


def provenance_bytes(name: str, version: str, tag: str = "py3-none-any", mode: str = "fast") -> bytes:
    """A provenance document naming this build (vllm/dflash_build.json) for a test wheel of `name` `version` and
    `tag`: a fast build over the base wheel of the same project, upstream version (the public part) and tag."""
    from packaging.version import Version

    from vllm_dflash import provenance as prov

    upstream = Version(version).public
    base = f"{name}-{upstream}-{tag}.whl"
    doc = prov.Provenance(
        version=version,
        upstream=prov.UpstreamRef(upstream, f"v{upstream}", "https://github.com/vllm-project/vllm.git", "f98b2747f",
                                  "f98b2747f", "sdist", "vllm-0.20.1.tar.gz", "ab" * 32),
        fork=prov.ForkRef("dflash/v0.20.1", "a" * 40, "b" * 40),
        patches=(),
        build=prov.BuildInfo("vllm-dflash", "0.1.0", mode, "test", base if mode == "fast" else None, "d" * 64),
        changed_files=("vllm/__init__.py",),
    )  # fmt: skip
    return doc.dumps()


def checkout_requiring(root: Path, profiles: Mapping[str, Mapping[str, object]]) -> Path:
    """`root` made a checkout with this repo's VERSION and dist.toml plus `profiles`, all of them required for
    publishing (reports are made with them)."""
    import tomlkit

    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "VERSION", root / "VERSION")
    doc = tomlkit.parse((REPO / "dist.toml").read_text())
    for name, table in profiles.items():
        doc["profiles"][name] = dict(table)
    doc["publish"]["required_profiles"] = list(profiles)
    (root / "dist.toml").write_text(tomlkit.dumps(doc))
    return root


_AHEAD: list[subprocess.Popen[bytes]] = []
AHEAD_PID = "train-ahead.pid"  # in the cache's logs/: which process trains, for the run that started it to stop


def _worker_id(config: pytest.Config) -> str | None:
    """This process's pytest-xdist worker id (gw0, gw1, ...), or None in the controller or a run without xdist."""
    worker_input = getattr(config, "workerinput", None)
    return None if worker_input is None else str(worker_input["workerid"])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start training the miniature now if a selected test needs it (a cached one is found at once): the training is
    single-threaded and overlaps the tests before the miniature's. Under pytest-xdist every worker collects every
    test; only the first starts the training, and the run's controller stops it (pytest_sessionfinish)."""
    if session.config.option.collectonly or not any(i.get_closest_marker("miniature") for i in session.items):
        return
    if _worker_id(session.config) not in (None, "gw0"):
        return
    from vllm_dflash.fetch import cache_dir

    log = cache_dir() / "logs" / "train-ahead.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(REPO / "tests" / "train_ahead.py")]
    print(f"\n+ {' '.join(argv)} &  (the miniature, in the background; log: {log})", flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if _worker_id(session.config) is None:
        _AHEAD.append(proc)
    else:  # a worker ends when it runs out of files, maybe before the miniature's tests on another worker do
        (log.parent / AHEAD_PID).write_text(f"{proc.pid} {_start_time(proc.pid)}")


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks (/proc/PID/stat field 22): with the pid, it names one process, never a
    later one that reused the pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run that ends before the miniature's tests (-x, Ctrl-C) stops the training (it leaves nothing half-written:
    train.py renames its output into place only when complete). Under pytest-xdist the controller does it, once every
    worker has finished."""
    for p in _AHEAD:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait()
    if not _xdist_controller(session.config):
        return
    from vllm_dflash.fetch import cache_dir

    record = cache_dir() / "logs" / AHEAD_PID
    try:
        pid, started = record.read_text().split()
    except (OSError, ValueError):
        return
    record.unlink(missing_ok=True)
    if _start_time(int(pid)) == started:  # still the training this run started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid), signal.SIGTERM)


_IS_WORKER: list[bool] = []  # set once per process by pytest_configure


def pytest_configure(config: pytest.Config) -> None:
    _IS_WORKER.append(_worker_id(config) is not None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With VLLM_DFLASH_TEST_TIMELINE=FILE, one JSON line per test phase (setup, call, teardown): the worker that ran
    it and its wall-clock start and stop. `benchmarks/bench_tier.py --timeline FILE` reads it: what each worker ran
    when, and which set-ups waited on another worker's work. Written by the controller (or the only process)."""
    path = os.environ.get("VLLM_DFLASH_TEST_TIMELINE")
    if not path or any(_IS_WORKER):  # a worker's reports reach the controller, which writes them
        return
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    line = {
        "worker": str(getattr(gateway, "id", "main")),
        "test": report.nodeid,
        "when": report.when,
        "start": round(report.start, 3),
        "stop": round(report.stop, 3),
        "outcome": report.outcome,
    }
    with open(path, "a") as out:  # one write per line: appends from one process never interleave
        out.write(json.dumps(line) + "\n")


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist controller (it hands out the tests and runs none itself)."""
    return config.pluginmanager.hasplugin("dsession")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def manifest() -> Manifest:
    return load_manifest(REPO)


@pytest.fixture(scope="session")
def doctor(manifest: Manifest) -> Iterator[Any]:
    """The doctor reading through every column's own code: the column servers the CLI uses (one process per column
    for the session and the CLI runs in it alike: their imports are most of a column's cost), answers cached by
    digest like the CLI's."""
    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns, server_idle
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    with Sides(columns(manifest, queues), idle=max(server_idle(), 600.0)) as sides:
        yield Doctor(sides)


@pytest.fixture
def doctor_servers(manifest: Manifest) -> Iterator[None]:
    """The CLI's column servers started (and answering) before a test that times or fuzzes `vllm-dflash doctor`:
    what a warm doctor run is. Per test: a server idle past its timeout since the last test is started again here,
    not inside the timed run."""
    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns, server_idle
    from vllm_dflash.series import read_queues

    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    q36 = json.loads((REPO / "vllm_dflash/doctor/checkpoints/z-lab--Qwen3.6-27B-DFlash.json").read_text())["config"]
    with Sides(columns(manifest, queues), cache=False, idle=max(server_idle(), 600.0)) as sides:
        Doctor(sides).read([q36])
    yield


# ---------------------------------------------------------------------------------------------------------------
# Pipeline fixtures: real source trees, real patches, a real local package index, the CLI in a subprocess


def git(cwd: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    """Run git in a test (setup only; the code under test runs its own)."""
    full_env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@localhost",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@localhost",
        **(env or {}),
    }
    out = subprocess.run(["git", *args], cwd=cwd, env=full_env, check=True, capture_output=True, text=True)
    return out.stdout


@pytest.fixture(scope="session")
def real_cache() -> Path:
    """The download cache the tests share with users of this machine (downloads happen once)."""
    from vllm_dflash.fetch import cache_dir

    return cache_dir()


# mktemp for module-scoped fixtures (`module_tmp("name")`): pytest keeps every tmp_path_factory dir until the session
# ends, so the full tier's module fixtures (wheels, registries, releases) piled up past 3 GB of temporary space
# (issue 37). These dirs go when their module ends, unless one of its tests failed (kept for a look).
ModuleTmp = Callable[[str], Path]


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[ModuleTmp]:
    made: list[Path] = []
    failed_before = request.session.testsfailed

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    if request.session.testsfailed == failed_before:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sdist_tree(manifest: Manifest, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The real vLLM 0.20.1 source tree from the hash-pinned sdist. Shared: tests must not change it."""
    from vllm_dflash.pipeline.source import prepare_source

    return prepare_source(manifest, "sdist", tmp_path_factory.mktemp("sdist") / "vllm")


def clone_tree(tree, dest: Path):  # type: ignore[no-untyped-def]
    """A cheap private copy of a prepared SourceTree (objects shared, tags including dflash-base copied)."""
    from vllm_dflash.pipeline.model import SourceTree

    git(dest.parent, "clone", "-q", "--shared", str(tree.path), str(dest))
    git(dest, "checkout", "-q", "--detach", tree.base)
    return SourceTree(path=dest, kind=tree.kind, version=tree.version, commit=tree.commit, base=tree.base)


@pytest.fixture
def work_tree(sdist_tree, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A private, mutable clone of the 0.20.1 sdist tree."""
    return clone_tree(sdist_tree, tmp_path / "work")


DEP3 = {
    "Origin": "vllm-dflash tests",
    "Forwarded": "not-needed",
    "Last-Update": "2026-11-29",
    "Drop-When": "never (test patch)",
}


class PatchFactory:
    """Writes real `git format-patch` files against the 0.20.1 tree (one scratch clone per session)."""

    def __init__(self, tree, scratch: Path, out: Path) -> None:  # type: ignore[no-untyped-def]
        self.base = tree.base
        self.scratch = clone_tree(tree, scratch).path
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def _reset(self, rev: str) -> None:
        git(self.scratch, "checkout", "-q", "-f", "--detach", rev)
        git(self.scratch, "clean", "-qfdx")

    def _edit(self, edits: Mapping[str, Callable[[str], str] | str | None]) -> None:
        for path, edit in edits.items():
            f = self.scratch / path
            if edit is None:
                f.unlink()
                continue
            f.parent.mkdir(parents=True, exist_ok=True)
            old = f.read_text() if f.exists() else ""
            new = edit(old) if callable(edit) else edit
            f.write_text(new)
        git(self.scratch, "add", "-A", "-f", ".")

    def make(
        self,
        name: str,
        edits: Mapping[str, Callable[[str], str] | str | None],
        subject: str = "test change",
        *,
        on_top_of: Mapping[str, Callable[[str], str] | str | None] | None = None,
        already_upstream: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> Path:
        """A patch making `edits` (path -> new text, a function of the old text, or None to delete).

        `on_top_of`: edits committed first (so the patch only applies after a patch making them).
        `already_upstream`: the patch's result is what the base already has (it reverse-applies on the base).
        """
        self._reset(self.base)
        if on_top_of:
            self._edit(on_top_of)
            git(self.scratch, "commit", "-q", "-m", "prerequisite")
        self._edit(edits)
        body = "\n".join(f"{k}: {v}" for k, v in {**DEP3, **(headers or {})}.items())
        git(self.scratch, "commit", "-q", "-m", f"{subject}\n\n{body}\n")
        if already_upstream:
            git(self.scratch, "revert", "--no-edit", "HEAD")
            git(self.scratch, "commit", "-q", "--amend", "-m", f"{subject}\n\n{body}\n")
        text = git(self.scratch, "format-patch", "-1", "--stdout", "HEAD", env={"GIT_AUTHOR_DATE": "2026-11-29T00:00"})
        path = self.out / name
        path.write_text(text)
        return path


@pytest.fixture(scope="session")
def patch_factory(sdist_tree, tmp_path_factory: pytest.TempPathFactory) -> PatchFactory:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("patchfactory")
    return PatchFactory(sdist_tree, root / "scratch", root / "out")


def replace_line(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, f"{old!r} not in file"
        return text.replace(old, new, 1)

    return edit


@dataclass
class Checkout:
    """A throwaway vllm-dflash checkout (dist.toml, VERSION, patches/) for CLI tests, with its own cache."""

    root: Path
    cache: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def dist(self) -> Path:
        return self.root / "dist"

    def set_series(self, *patches: Path) -> None:
        pdir = self.root / "patches"
        pdir.mkdir(exist_ok=True)
        for p in patches:
            shutil.copy(p, pdir / p.name)
        (pdir / "series").write_text("# test queue\n" + "".join(f"{p.name}\n" for p in patches))

    def edit_manifest(self, old: str, new: str) -> None:
        path = self.root / "dist.toml"
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new, 1))

    def cli(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {**os.environ, "VLLM_DFLASH_CACHE": str(self.cache), **self.env, **(env or {})}
        cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(self.root), *args]
        return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)

    def dist_files(self) -> list[str]:
        return sorted(p.name for p in self.dist.rglob("*")) if self.dist.exists() else []


def copy_manifest_and_patches(dest: Path) -> Path:
    """`dest` holding this repo's manifest, VERSION and every pin's patch queue: what the stages that read the
    manifest and the queues (upstream, rebase, the pin matrix) need of a checkout."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("dist.toml", "VERSION"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "patches", dest / "patches")
    return dest


def make_checkout(tmp: Path, cache: Path) -> Checkout:
    root = tmp / "checkout"
    root.mkdir(parents=True)
    for name in ("dist.toml", "VERSION"):
        shutil.copy(REPO / name, root / name)
    # Our real DFlash queue: a DFlash-labelled build of an empty queue is refused (stock code under our label).
    (root / "patches").mkdir()
    series = (REPO / "patches" / "series").read_text()
    for line in series.splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            shutil.copy(REPO / "patches" / name, root / "patches" / name)
    (root / "patches" / "series").write_text(series)
    return Checkout(root=root, cache=cache)


@pytest.fixture
def checkout(tmp_path: Path, real_cache: Path, manifest: Manifest, sdist_tree) -> Checkout:  # type: ignore[no-untyped-def]
    """A checkout whose private cache shares the real downloads and starts with a clone of the session's tree."""
    from vllm_dflash.fetch import fetch
    from vllm_dflash.pipeline.source import default_dest

    fetch(manifest.sdist)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "downloads").symlink_to(real_cache / "downloads", target_is_directory=True)
    dest = cache / "trees" / default_dest(manifest, "sdist").name
    dest.parent.mkdir(parents=True)
    clone_tree(sdist_tree, dest)
    return make_checkout(tmp_path, cache)


# A real PEP 691 JSON index on 127.0.0.1: project -> filename -> (content, declared size or None, bytes to send
# before hanging up or None for all).
IndexFiles = dict[str, dict[str, tuple[bytes, int | None, int | None]]]


def send_simple_page(handler: BaseHTTPRequestHandler, project: str, sizes: Mapping[str, int | None]) -> None:
    """Answer a PEP 691 JSON simple page for `project` listing `sizes` (file name -> size, None: unstated), each
    file at /files/<project>/<name>."""
    doc = {
        "meta": {"api-version": "1.1"},
        "name": project,
        "files": [
            {"filename": fn, "url": f"/files/{project}/{fn}", "hashes": {}, **({"size": size} if size else {})}
            for fn, size in sizes.items()
        ],
    }
    body = json.dumps(doc).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def local_index() -> Iterator[tuple[str, IndexFiles]]:
    files: IndexFiles = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = [p for p in self.path.split("/") if p]
            if len(parts) == 2 and parts[0] == "simple" and parts[1] in files:
                project = parts[1]
                send_simple_page(self, project, {fn: size for fn, (_, size, _) in files[project].items()})
                return
            if len(parts) == 3 and parts[0] == "files" and parts[2] in files.get(parts[1], {}):
                data, size, cut = files[parts[1]][parts[2]]
                self.send_response(200)
                self.send_header("Content-Length", str(size or len(data)))
                self.end_headers()
                self.wfile.write(data if cut is None else data[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.send_error(404)

    with http_server(Handler) as url:
        yield f"{url}/simple", files
