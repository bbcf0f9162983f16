"""The index is a transaction (issue 26): many publishes to one local index at once, as threads and as processes,
never lose or contradict an entry, and every publish of a wheel keeps its own record.

Each trial starts WHEELS publishes of distinct wheels (two projects, so the root pages are contended too) plus
REPUBLISH publishes of the first wheel with other reports, all released together (a barrier for the threads; the
processes are started back to back). Afterwards every wheel must be in its project's HTML and JSON pages (the same
set in both), the root pages must list both projects, the first wheel must carry one record per publish (each
report's sha256 once), and no temporary may be left. The lock itself is shown to be taken: a publish waits while
the test holds it, and goes on when it is released.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import html
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import checkout_requiring
from test_publish import PROFILE, PROFILE_TABLE, make_report, make_wheel

from vllm_dflash.fetch import sha256_file
from vllm_dflash.manifest import load_manifest
from vllm_dflash.paths import TEMP_PREFIX
from vllm_dflash.publish import publish
from vllm_dflash.simple_index import LOCK_NAME

WHEELS = 8  # distinct wheels per trial
REPUBLISH = 3  # extra publishes of the first wheel, each with its own report
THREAD_TRIALS = 5
PROCESS_TRIALS = 3
PROJECTS = ("gatedemo", "gatedemo-two")


@dataclass(frozen=True)
class Job:
    wheel: Path
    report: Path


@dataclass
class Tally:
    trials: int = 0
    publishes: int = 0
    entries: int = 0  # wheel entries checked in the pages, plus records checked


TALLY: dict[str, Tally] = {"threads": Tally(), "processes": Tally()}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return checkout_requiring(tmp_path / "checkout", {PROFILE: PROFILE_TABLE})


def jobs(root: Path, where: Path) -> list[Job]:
    out = []
    for i in range(WHEELS):
        name = PROJECTS[i % 2].replace("-", "_")  # gatedemo_two-1.0.1-...whl is project gatedemo-two
        wheel = make_wheel(where / f"w{i}", name=name, version=f"1.0.{i}", body=f"VALUE = {i}\n")
        out.append(Job(wheel, make_report(root, sha256_file(wheel), where / f"r{i}.json")))
    first = out[0].wheel
    for j in range(REPUBLISH):  # the same wheel again, each time with another (equally valid) report
        report = make_report(root, sha256_file(first), where / f"again{j}.json", timestamps={"started": str(j)})
        out.append(Job(first, report))
    return out


def check_index(index: Path, done: list[Job], kind: str) -> None:
    """Every wheel listed once in HTML and JSON alike, the root pages listing both projects, the republished wheel
    carrying one record per publish, and nothing half-written anywhere."""
    simple = index / "simple"
    tally = TALLY[kind]
    wheels = {j.wheel.name: j.wheel for j in done}
    for project in PROJECTS:
        pdir = simple / project
        want = {n for n, w in wheels.items() if w.name.startswith(project.replace("-", "_") + "-")}
        page = (pdir / "index.html").read_text()
        in_html = {html.unescape(m) for m in re.findall(r">([^<]+\.whl)</a>", page)}
        doc = json.loads((pdir / "index.json").read_text())
        in_json = {f["filename"] for f in doc["files"]}
        on_disk = {p.name for p in pdir.glob("*.whl")}
        assert in_html == in_json == on_disk == want, (project, in_html ^ want, in_json ^ want)
        for f in doc["files"]:
            assert f["hashes"]["sha256"] == sha256_file(wheels[f["filename"]])
        tally.entries += len(in_html) + len(in_json)
    root_doc = json.loads((simple / "index.json").read_text())
    assert [p["name"] for p in root_doc["projects"]] == sorted(PROJECTS)
    assert all(f">{p}<" in (simple / "index.html").read_text() for p in PROJECTS)
    first = done[0].wheel
    records = json.loads((simple / PROJECTS[0] / f"{first.name}.publish.json").read_text())
    reports = [j.report for j in done if j.wheel == first]
    assert sorted(r["report_sha256"] for r in records) == sorted(
        hashlib.sha256(r.read_bytes()).hexdigest() for r in reports
    ), "a publish record was lost or overwritten"
    tally.entries += len(records)
    leftovers = [p for p in index.rglob("*") if p.name.startswith(TEMP_PREFIX) or p.name.endswith(".part")]
    assert leftovers == []
    tally.publishes += len(done)
    tally.trials += 1
    print(
        f"\n{kind}: {len(done)} publishes at once; so far {tally.trials} trials, {tally.publishes} publishes, "
        f"{tally.entries} entries checked"
    )


@pytest.mark.parametrize("trial", range(THREAD_TRIALS))
def test_concurrent_publishes_in_threads(root: Path, tmp_path: Path, trial: int) -> None:
    todo = jobs(root, tmp_path / "jobs")
    manifest = load_manifest(root)
    index = tmp_path / "index"
    start = threading.Barrier(len(todo))
    errors: list[BaseException] = []

    def one(job: Job) -> None:
        start.wait()
        try:
            publish(manifest, str(job.wheel), str(index), job.report)
        except BaseException as exc:  # reported below: a failed publish is a failed trial
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(j,)) for j in todo]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [] and not any(t.is_alive() for t in threads)
    check_index(index, todo, "threads")


@pytest.mark.parametrize("trial", range(PROCESS_TRIALS))
def test_concurrent_publishes_in_processes(root: Path, tmp_path: Path, trial: int) -> None:
    todo = jobs(root, tmp_path / "jobs")
    index = tmp_path / "index"
    cli = [sys.executable, "-m", "vllm_dflash", "--root", str(root), "publish"]
    procs = [
        subprocess.Popen(
            [*cli, str(j.wheel), "--to", str(index), "--report", str(j.report)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j in todo
    ]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    assert [code for _, code in results] == [0] * len(todo), [err for (_, err), _ in results]
    check_index(index, todo, "processes")


def _blocked_on(path: Path, pid: int) -> bool:
    """Whether process `pid` waits for a flock on `path` (the kernel lists waiters as `-> FLOCK ...` lines)."""
    inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields:
            at = fields.index("FLOCK")
            if fields[at + 3] == str(pid) and fields[at + 4].rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def test_a_publish_waits_for_the_lock(root: Path, tmp_path: Path) -> None:
    """While another publish holds the index (here: the test holds its lock), a publish -- a process -- waits on the
    lock (the kernel lists it as a waiter) having written nothing; once the lock is released it publishes."""
    index = tmp_path / "index"
    job = jobs(root, tmp_path / "jobs")[1]
    index.mkdir()
    cli = [sys.executable, "-m", "vllm_dflash", "--root", str(root), "publish"]
    with (index / LOCK_NAME).open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        args = [*cli, str(job.wheel), "--to", str(index), "--report", str(job.report)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and not _blocked_on(index / LOCK_NAME, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        waiting = proc.poll() is None and _blocked_on(index / LOCK_NAME, proc.pid)
        nothing_written = not (index / "simple").exists()
    assert waiting and nothing_written, proc.communicate()
    assert proc.wait(timeout=120) == 0, proc.communicate()  # released by closing the file: it published
    assert (index / "simple" / PROJECTS[1] / job.wheel.name).is_file()


def test_a_publish_refused_inside_the_lock_leaves_nothing(root: Path, tmp_path: Path) -> None:
    """Refused only inside the transaction (the bytes copied are not the ones vouched for): a root the publish
    created is removed again with its lock file; in an existing index, the lock file it found stays and nothing
    else changes."""
    from test_gate import tree_hash

    from vllm_dflash.errors import PublishRefusedError
    from vllm_dflash.publish import publish_wheel_local

    wheel = make_wheel(tmp_path / "w")
    fresh = tmp_path / "fresh"
    with pytest.raises(PublishRefusedError, match="changed"):
        publish_wheel_local(wheel, fresh, sha256="0" * 64)
    assert not fresh.exists()
    index = tmp_path / "index"
    publish_wheel_local(wheel, index)  # negative control: the right sha256 publishes (and makes the lock file)
    other = make_wheel(tmp_path / "w2", version="2.0.0")
    before = tree_hash(index)
    with pytest.raises(PublishRefusedError, match="changed"):
        publish_wheel_local(other, index, sha256="0" * 64)
    assert tree_hash(index) == before and (index / LOCK_NAME).is_file()


def test_a_waiting_publish_takes_the_lock_a_refused_one_left(tmp_path: Path) -> None:
    """The first publish into a new root is refused while a second waits on its lock file: the first removes lock
    and root, so the second must not go on holding a lock on a file that is gone; it takes a new one."""
    from vllm_dflash.simple_index import LocalIndex

    root = tmp_path / "index"
    first_in, let_go = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with contextlib.suppress(RuntimeError), LocalIndex(root).transaction():
            first_in.set()
            let_go.wait(30)
            raise RuntimeError("refused")

    def second() -> None:
        with LocalIndex(root).transaction():
            seen["lock file there"] = (root / LOCK_NAME).is_file()

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(30)
    b = threading.Thread(target=second)
    b.start()
    time.sleep(0.5)  # b opens the lock file and waits on it
    assert b.is_alive()  # it waits while the first holds the index
    let_go.set()
    a.join(30)
    b.join(30)
    assert seen == {"lock file there": True}
