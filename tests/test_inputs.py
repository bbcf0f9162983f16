"""Nothing of the user's is touched, and every label means what it says (issue 19), through the real CLI.

Every refusal is checked the same way: ONE `error:` line, its exit code, no traceback, and a fixture tree of the
user's -- files named like temporaries (`.thesis.999999.tmp`, a folder `.photos.888888.part`), device nodes made
with mknod (null, zero, full), a FIFO, a socket and an `/etc`-like directory -- byte-identical afterwards. Each
refusal has a twin: the same command made valid gets past the check (it then fails later, for a reason that proves
it got there: the dead package index of these tests, exit 5, after the first stage began).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Checkout, make_checkout

from vllm_dflash.errors import (
    DirtyTreeError,
    ManifestError,
    MeasurementError,
    NetworkError,
    PatchError,
    PublishRefusedError,
    StorageError,
    ToolchainError,
    VerifyError,
)
from vllm_dflash.manifest import Manifest

DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port: a NetworkError at the first fetch
DEAD_ENDPOINT = "http://127.0.0.1:9"
# validate against nothing: a MeasurementError once the checks passed (after 1 s, not the endpoint default's 30 s)
DEAD = ("--endpoint", DEAD_ENDPOINT, "--health-timeout", "1")
SDIST_STAGE = "1/3 source"


# ---------------------------------------------------------------------------------------------------------------
# The fixture tree and how it is compared


def tree_state(root: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `root` (hidden ones too): type and mode, device numbers, bytes' sha256, link targets."""
    state: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            st = p.lstat()
            entry: tuple[object, ...] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
            if stat.S_ISREG(st.st_mode):
                entry += (hashlib.sha256(p.read_bytes()).hexdigest(),)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                entry += (st.st_rdev,)
            elif stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(p),)
            state[str(p.relative_to(root))] = entry
    return state


@pytest.fixture
def user(tmp_path: Path) -> Iterator[Path]:
    """The user's files: what no command of ours may delete, replace or write into."""
    root = tmp_path / "user"
    out = root / "out"
    out.mkdir(parents=True)
    (out / ".thesis.999999.tmp").write_text("four years of work\n")
    photos = out / ".photos.888888.part"
    photos.mkdir()
    (photos / "img-0001.jpg").write_bytes(b"\xff\xd8\xff\xe0 a photo")
    (out / ".vllm-dflash.999999.deadbeef.x.tmp").write_text("looks like ours, but this directory is the user's\n")
    dev = root / "dev"
    dev.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mknod of device nodes needs root")
    for name, minor in (("null", 3), ("zero", 5), ("full", 7)):
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    os.mkfifo(dev / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(dev)  # bound by a relative name: a socket's path is limited to 108 bytes, and TMPDIR may be deep
    try:
        sock.bind("sock")
    finally:
        os.chdir(here)
        sock.close()
    etc = root / "etc-like"
    etc.mkdir()
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    before = tree_state(root)
    yield root
    assert tree_state(root) == before, "a command changed the user's files"


@pytest.fixture
def co(tmp_path: Path) -> Checkout:
    """A throwaway checkout (our real queue) with a private, empty cache and a dead package index."""
    c = make_checkout(tmp_path, tmp_path / "cache")
    c.env["VLLM_DFLASH_INDEX_URL"] = DEAD_INDEX
    c.edit_manifest("[profiles.qwen3-8b]", LOCAL_PROFILE + "\n[profiles.qwen3-8b]")
    return c


LOCAL_PROFILE = """[profiles.local]
target = "t"
method = "ngram"
num_speculative_tokens = 2
thinking = false
prompts = "coding"
"""


def one_error(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == code, f"exit {r.returncode}, want {code}: {r.stderr[-3000:]}"
    assert len(lines) == 1, r.stderr[-3000:]
    assert " -- " in lines[0], lines[0]
    return lines[0]


def got_to_first_stage(r: subprocess.CompletedProcess[str]) -> None:
    """The twin of a refusal: past every early check, the build began and stopped at the dead index."""
    one_error(r, NetworkError.return_code)
    assert SDIST_STAGE in r.stderr, r.stderr[-2000:]


def build(co: Checkout, *extra: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return co.cli("build", "--source", "sdist", "--base-wheel", "cpu", "--platform", "x86_64", *extra)


def git_patch(tmp: Path, path: str, name: str = "0001-x.patch") -> Path:
    """A real `git format-patch` changing `path` (made in a scratch repository)."""
    repo = tmp / f"scratch-{hashlib.sha256(path.encode()).hexdigest()[:8]}"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout

    repo.mkdir()
    git("init", "-q")
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text("old\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    (repo / path).write_text("new\n")
    git("commit", "-qam", "change\n\nOrigin: test\nForwarded: not-needed\nDrop-When: never")
    out = tmp / name
    out.write_text(git("format-patch", "-1", "--stdout"))
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. Own only what you made


@pytest.mark.parametrize("node", ["dev/null", "dev/full", "dev/fifo", "dev/sock", "etc-like"])
def test_a_result_is_never_written_over_a_special_file(co: Checkout, user: Path, tmp_path: Path, node: str) -> None:
    target = user / node
    r = co.cli("validate", "--profile", "local", *DEAD, "--report", str(target))
    line = one_error(r, StorageError.return_code)
    assert str(target) in line and "not a regular file" in line, line
    assert "prompt" not in r.stdout.lower()  # refused before any work


def test_a_result_twin_is_written(co: Checkout, tmp_path: Path) -> None:
    """The twin: a new file, or a regular file to replace, passes the check (the dead endpoint stops it later)."""
    (tmp_path / "old.json").write_text("{}")
    for name in ("new.json", "old.json"):
        r = co.cli("validate", "--profile", "local", *DEAD, "--report", str(tmp_path / name))
        one_error(r, MeasurementError.return_code)


def test_conformance_report_over_a_device_is_refused_first(co: Checkout, user: Path) -> None:
    r = co.cli("conformance", "--report", str(user / "dev" / "full"))
    assert "a character device, not a regular file" in one_error(r, StorageError.return_code)


def test_build_out_that_cannot_be_made_is_refused_before_the_first_stage(
    co: Checkout, user: Path, tmp_path: Path
) -> None:
    for bad, phrase in (("/proc/x", "cannot create --out /proc/x"), (str(user / "dev" / "null"), "character device")):
        r = build(co, "--out", bad)
        assert phrase in one_error(r, StorageError.return_code)
        assert SDIST_STAGE not in r.stderr and "\n+ " not in "\n" + r.stderr
    out = tmp_path / "new" / "out"
    got_to_first_stage(build(co, "--out", str(out)))
    assert not out.exists()  # made by this build, empty, removed again


def test_sweep_removes_only_marked_temporaries_of_dead_writers(tmp_path: Path) -> None:
    from vllm_dflash.paths import sweep_stale, temp_sibling, temporary_pid

    d = tmp_path / "owned"
    d.mkdir()
    (d / ".thesis.999999.tmp").write_text("x")
    (d / ".photos.888888.part").mkdir()
    dead = d / ".vllm-dflash.4999999.0123abcd.w.whl.tmp"  # above any pid_max: no such process
    dead.mkdir()
    (dead / "half.whl").write_bytes(b"PK")
    live = temp_sibling(d / "w.whl")
    live.write_text("mine, still writing")
    assert temporary_pid(live.name) == os.getpid() and temp_sibling(d / "w.whl") != live  # a random part too
    assert sweep_stale(d) == [dead]
    assert sorted(p.name for p in d.iterdir()) == sorted([".thesis.999999.tmp", ".photos.888888.part", live.name])


def test_build_into_a_users_out_dir_keeps_everything_there(checkout: Checkout, user: Path) -> None:
    """The sweep used to delete `.thesis.999999.tmp` and `.photos.888888.part/` from --out: now nothing there but
    the new wheel changes (the `user` fixture compares the tree), and `release --out` there refuses, keeping it."""
    out = user / "out"
    before = tree_state(out)
    r = checkout.cli("build", "--source", "sdist", "--base-wheel", "cpu", "--platform", "x86_64", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    after = tree_state(out)
    assert {k: v for k, v in after.items() if k != wheel.name} == before
    r = checkout.cli("release", str(wheel), "--out", str(out))
    assert "not part of this release" in one_error(r, StorageError.return_code)
    assert {k: v for k, v in tree_state(out).items() if k != wheel.name} == before
    wheel.unlink()  # ours; the fixture then checks the user's tree is as it was


# ---------------------------------------------------------------------------------------------------------------
# 2. Names from outside stay inside


def test_profile_name_with_path_parts_is_refused(co: Checkout, user: Path, tmp_path: Path) -> None:
    co.edit_manifest("[profiles.local]", '[profiles."x/../../evilv"]')
    r = co.cli("validate", "--profile", "x/../../evilv", *DEAD)
    assert "profile name 'x/../../evilv' is not a plain name" in one_error(r, ManifestError.return_code)
    assert not (co.root.parent.parent / "evilv").exists() and not list(co.root.glob("validation-*"))

    co.edit_manifest('[profiles."x/../../evilv"]', "[profiles.evilv]")
    r = co.cli("validate", "--profile", "evilv", *DEAD, "--report", str(tmp_path / "r.json"))
    one_error(r, MeasurementError.return_code)


@pytest.mark.parametrize("prompts", ["../outside.jsonl", "/etc/passwd", "prompts/../../outside.jsonl"])
def test_prompts_path_outside_the_checkout_is_refused(co: Checkout, user: Path, prompts: str) -> None:
    co.edit_manifest('prompts = "coding"', f'prompts = "{prompts}"')
    r = co.cli("validate", "--profile", "local", *DEAD)
    assert "not a relative path inside" in one_error(r, ManifestError.return_code)


def test_prompts_path_is_read_from_the_checkout_not_the_cwd(co: Checkout, user: Path, tmp_path: Path) -> None:
    (co.root / "prompts").mkdir()
    (co.root / "prompts" / "p.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "prompts").mkdir(parents=True)
    (elsewhere / "prompts" / "p.jsonl").write_text("not json\n")
    co.edit_manifest('prompts = "coding"', 'prompts = "prompts/p.jsonl"')
    argv = ["validate", "--profile", "local", *DEAD, "--report", str(tmp_path / "r.json")]
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(co.root), *argv]
    env = {**os.environ, "VLLM_DFLASH_CACHE": str(co.cache)}
    r = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    one_error(r, MeasurementError.return_code)  # the checkout's file was read; the cwd's would be "not JSON"
    # The control: the cwd's copy named on the command line (absolute paths are the user's to give) is read.
    argv2 = [*cmd, "--prompts", str(elsewhere / "prompts" / "p.jsonl")]
    r = subprocess.run(argv2, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert "not JSON" in one_error(r, ManifestError.return_code)


def _etc_listing() -> list[tuple[str, int]]:
    return sorted((p.name, p.lstat().st_mode) for p in Path("/etc").iterdir())


@pytest.mark.parametrize(
    ("to", "phrase"),
    [
        ("", "names no directory"),
        ("-", "names no directory"),
        ("file:", "names no directory"),
        ("file://", "names no directory"),
        ("file:///etc", "system directory /etc"),
        ("/etc/vllm-index", "system directory /etc"),
        ("file:///usr/share/idx", "system directory /usr"),
        ("/proc/idx", "system directory /proc"),
        ("/", "system directory /"),
        ("file://{user}/etc-like/{up}etc", "system directory /etc"),  # `..` climbs out (to / from any tmp depth)
        ("{tmp}/etc-link/simple", "system directory /etc"),  # a link into /etc is /etc
        ("{user}/etc-like/passwd/idx", "is a file, not a directory"),
        ("{user}/no/such/idx", "nor its parent"),
    ],
)
def test_publish_destination_is_checked_first(co: Checkout, user: Path, tmp_path: Path, to: str, phrase: str) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not looked at before the destination")
    (tmp_path / "etc-link").symlink_to("/etc", target_is_directory=True)
    etc = _etc_listing()
    up = "../" * len((user / "etc-like").parts)
    to = to.replace("{user}", str(user)).replace("{tmp}", str(tmp_path)).replace("{up}", up)
    r = co.cli("publish", str(wheel), "--to", to)
    assert phrase in one_error(r, PublishRefusedError.return_code)
    assert _etc_listing() == etc


@pytest.mark.parametrize("kind", ["path", "url"])
def test_publish_destination_twin_gets_to_the_gate(co: Checkout, tmp_path: Path, kind: str) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(b"x")
    idx = tmp_path / "idx"
    r = co.cli("publish", str(wheel), "--to", str(idx) if kind == "path" else idx.as_uri())
    assert "no validation report given" in one_error(r, PublishRefusedError.return_code)
    assert not idx.exists()


# ---------------------------------------------------------------------------------------------------------------
# 3. Labels mean what they say


@pytest.mark.parametrize(
    ("version", "phrase"),
    [
        ("0.20.1+dflash.01", "leading zero"),
        ("0.20.1+dflash.00", "leading zero"),
        ("0.20.1+dflash.0", "counts builds from 1"),
        ("0.20.1+dflash.\u0661", "outside printable ASCII"),  # ARABIC-INDIC DIGIT ONE: `\d` took it
        ("0.20.1+dflash.1\u200b", "outside printable ASCII"),
        ("0.20.1+DFlash.1", "is not '<upstream version>+dflash.<N>'"),
        ("0.20.01+dflash.1", "PEP 440 normal form"),
    ],
)
def test_version_label_is_refused_unless_canonical(co: Checkout, user: Path, version: str, phrase: str) -> None:
    (co.root / "VERSION").write_text(version + "\n", encoding="utf-8")
    line = one_error(build(co), ManifestError.return_code)
    assert phrase in line, line


def test_version_twin_builds() -> None:
    from vllm_dflash.manifest import parse_version

    for good in ("0.20.1+dflash.1", "0.20.1+dflash.2", "0.20.1+dflash.10", "0.20.1.post1+dflash.3"):
        base = good.split("+")[0]
        assert parse_version(good + "\n", base) == good


def test_version_twin_through_the_cli(co: Checkout) -> None:
    (co.root / "VERSION").write_text("0.20.1+dflash.2\n")
    got_to_first_stage(build(co))


@pytest.mark.parametrize("series", ["", "# nothing yet\n\n   # still nothing\n"])
def test_an_empty_dflash_queue_builds_only_as_stock(co: Checkout, user: Path, series: str) -> None:
    (co.root / "patches" / "series").write_text(series)
    line = one_error(build(co), ManifestError.return_code)
    assert "the queue is empty" in line and "--stock" in line
    got_to_first_stage(build(co, "--stock"))


# ---------------------------------------------------------------------------------------------------------------
# 4. Refuse early, precisely


def test_c_quoted_dotdot_in_a_patch_is_an_escape(co: Checkout, user: Path, tmp_path: Path) -> None:
    good = git_patch(tmp_path, "vllm/x/y.py")
    bad = tmp_path / "bad" / "0001-x.patch"
    bad.parent.mkdir()
    text = good.read_text()
    for side in "ab":
        text = text.replace(f"{side}/vllm/x/y.py", f'"{side}/vllm/\\056\\056/y.py"')  # git's C quoting of ".."
    bad.write_text(text)
    co.set_series(bad)
    line = one_error(build(co), PatchError.return_code)
    assert "escapes the tree" in line and "vllm/../y.py" in line, line
    co.set_series(good)
    got_to_first_stage(build(co))


def test_a_space_in_a_compiled_source_path_picks_the_full_build(co: Checkout, tmp_path: Path) -> None:
    co.set_series(git_patch(tmp_path, "csrc/a b.cu"))
    r = build(co)
    assert "build mode: full" in r.stdout and "csrc/a b.cu" in r.stdout, r.stdout
    assert r.returncode in (ToolchainError.return_code, NetworkError.return_code)  # no CUDA here, or the dead index
    one_error(r, r.returncode)
    assert "Python-only" not in r.stdout
    co.set_series(git_patch(tmp_path, "vllm/a b.py"))
    r = build(co)
    assert "build mode: fast" in r.stdout, r.stdout
    got_to_first_stage(r)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("cpu", [0.1, 0.2, 0.3, 0.4])
def test_ctrl_c_before_the_first_stage_is_one_line(co: Checkout, cpu: float) -> None:
    """SIGINT once the command has used `cpu` seconds of CPU: past Python's own start-up (site, ~0.05 s of CPU), in
    our imports, parsing or the first stage -- never a traceback, always one line and 130. An index that accepts
    and never answers keeps the command from ending first."""
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(co.root), "build", "--source", "sdist"]
    index = f"http://127.0.0.1:{hang.getsockname()[1]}/simple"
    env = {**os.environ, "VLLM_DFLASH_CACHE": str(co.cache), "VLLM_DFLASH_INDEX_URL": index}
    # SIGINT back to its default in the child: a background job (`.ci/run &`) inherits it ignored, and the command
    # rightly keeps it ignored once its imports are done, so the signal would never arrive.
    p = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 10  # blocked on the silent index, it uses no CPU: signal it there then
        while p.poll() is None and _cpu_seconds(p.pid) < cpu and time.monotonic() < deadline:
            time.sleep(0.005)
        assert p.poll() is None, "the command ended before the signal"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        hang.close()
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    assert "interrupted" in one_error(r, 130)


def test_ctrl_c_traceback_is_what_the_check_sees() -> None:
    """The control: a Python program without our handler does print a KeyboardInterrupt traceback."""
    # SIGINT back to its default in the child (a shell's background job inherits it ignored, and Python then
    # installs no KeyboardInterrupt handler); the signal is sent once the child says it is running.
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert "Traceback" in err and "KeyboardInterrupt" in err


@pytest.mark.parametrize("dest", ["/", "{user}/etc-like", "{user}/out"])
def test_source_dest_never_suggests_deleting_what_the_tool_did_not_make(
    co: Checkout, user: Path, dest: str, real_cache: Path, manifest: Manifest
) -> None:
    # The stage reaches the destination only with the sdist at hand: the shared downloads are linked in.
    from vllm_dflash.fetch import fetch

    fetch(manifest.sdist)
    co.cache.mkdir(parents=True, exist_ok=True)
    (co.cache / "downloads").symlink_to(real_cache / "downloads", target_is_directory=True)
    r = co.cli("source", "--source", "sdist", "--dest", dest.replace("{user}", str(user)))
    line = one_error(r, DirtyTreeError.return_code)
    assert "not a tree prepared by vllm-dflash" in line and "delete" not in line.lower(), line


def test_source_dest_twin_gets_to_the_download(co: Checkout, tmp_path: Path) -> None:
    r = co.cli("source", "--source", "sdist", "--dest", str(tmp_path / "new" / "tree"))
    one_error(r, NetworkError.return_code)
    bad = co.cli("source", "--source", "sdist", "--dest", "/proc/tree")
    assert "cannot create --dest" in one_error(bad, StorageError.return_code)


# ---------------------------------------------------------------------------------------------------------------
# 5. Bounded reads


def test_manifest_over_its_limit_or_not_a_file_is_refused(co: Checkout, user: Path) -> None:
    text = (co.root / "dist.toml").read_text()
    (co.root / "dist.toml").write_text(text + "# padding\n" * 5_000_000)  # 50 MB, valid TOML
    assert "larger than the 1 MiB limit" in one_error(build(co), ManifestError.return_code)
    (co.root / "dist.toml").unlink()
    os.mkfifo(co.root / "dist.toml")  # nobody writes it: a blocking read would hang
    assert "is a FIFO, not a regular file" in one_error(build(co), ManifestError.return_code)
    (co.root / "dist.toml").unlink()
    (co.root / "dist.toml").write_text(text + "# padding\n" * 50_000)  # 500 KB: under the limit
    got_to_first_stage(build(co))


@pytest.mark.parametrize(("name", "phrase"), [("dev/zero", "a character device"), ("dev/fifo", "a FIFO")])
def test_publish_report_from_a_device_is_refused(
    co: Checkout, user: Path, tmp_path: Path, name: str, phrase: str
) -> None:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(b"x")
    link = tmp_path / "report.json"
    link.symlink_to(user / name)  # a link to it, too: the type is checked on what is opened
    for report in (user / name, link):
        r = co.cli("publish", str(wheel), "--to", str(tmp_path / "idx"), "--report", str(report))
        assert phrase in one_error(r, PublishRefusedError.return_code)
    link.unlink()
    link.write_text("{ not json")
    r = co.cli("publish", str(wheel), "--to", str(tmp_path / "idx"), "--report", str(link))
    assert "is not strict JSON" in one_error(r, PublishRefusedError.return_code)


WHEEL = "vllm-0.20.1+dflash.1-cp38-abi3-manylinux_2_28_x86_64.whl"


def _fake_release(d: Path, files: dict[str, bytes], signed: bool = False) -> None:
    from vllm_dflash.release import layout

    d.mkdir()
    digests = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    (d / layout.SUMS).write_bytes(layout.format_sums(digests))
    if signed:
        (d / layout.SUMS_ENVELOPE).write_text("{}")


def test_verify_never_hangs_on_a_link_to_a_device(co: Checkout, user: Path, tmp_path: Path) -> None:
    rel = tmp_path / "rel"
    _fake_release(rel, {WHEEL: b"wheel bytes", "RELEASE-NOTES.md": b"notes\n"})
    (rel / WHEEL).unlink()
    (rel / WHEEL).symlink_to(user / "dev" / "zero")
    r = co.cli("verify", str(rel))
    # Refused at once (a release holds its own files: no link is followed), never read without end.
    assert "is a symbolic link" in one_error(r, VerifyError.return_code)
    (rel / WHEEL).unlink()
    (rel / WHEEL).write_bytes(b"other wheel bytes")
    r = co.cli("verify", str(rel))
    assert "one of them was altered" in one_error(r, VerifyError.return_code)


def test_verify_key_from_a_device_is_refused(co: Checkout, user: Path, tmp_path: Path) -> None:
    from vllm_dflash.release import dsse, layout

    keys = tmp_path / "keys"
    keys.mkdir()
    dsse.write_keypair(keys / "k.pem", keys / "k.pub")
    rel = tmp_path / "rel"
    files = {WHEEL: b"w", layout.NOTES: b"n\n", layout.PUBLIC_KEY: (keys / "k.pub").read_bytes()}
    _fake_release(rel, files, signed=True)
    r = co.cli("verify", str(rel), "--key", str(user / "dev" / "zero"))
    assert "public key" in (line := one_error(r, VerifyError.return_code)) and "character device" in line, line
    (keys / "garbage.pub").write_text("not a key")
    r = co.cli("verify", str(rel), "--key", str(keys / "garbage.pub"))
    assert "not a PEM public key" in one_error(r, VerifyError.return_code)


def test_signing_key_and_patch_reads_are_bounded(user: Path, tmp_path: Path) -> None:
    from vllm_dflash.errors import DflashError
    from vllm_dflash.paths import read_bounded
    from vllm_dflash.release import dsse
    from vllm_dflash.series import load_patch

    with pytest.raises(DflashError, match=r"signing key .* is a character device"):
        dsse.load_private_key(user / "dev" / "zero")
    with pytest.raises(ManifestError, match=r"patch .* is a FIFO"):
        load_patch(user / "dev" / "fifo")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2049)
    with pytest.raises(StorageError, match="larger than the 2 KiB limit"):
        read_bounded(big, 2048, "thing")
    assert read_bounded(big, 4096, "thing") == b"x" * 2049
    assert (REPO / "dist.toml").stat().st_size < 64 * 1024  # the limit is far above what a manifest is


# ---------------------------------------------------------------------------------------------------------------
# 6. No wait without end (issue 26): Ctrl-C stops the prompt run and the launched server; a trickling server
# cannot outlast a deadline. The server is a fake vLLM (the tests are about how we treat a server): it answers
# /health, /v1/models and /metrics, and holds every chat completion for an hour, noting when its client hangs up.

FAKE_VLLM = r"""
import argparse, json, os, select, socket, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=0)
args, _ = ap.parse_known_args()
notes = os.environ["FAKE_VLLM_NOTES"]
trickle = os.environ.get("FAKE_VLLM_TRICKLE") == "1"
lock = threading.Lock()
count = [0]
METRICS = "".join(
    f"# TYPE vllm:spec_decode_{n}_total counter\nvllm:spec_decode_{n}_total 0\n"
    for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
)


def note(name):
    with open(os.path.join(notes, name), "w") as fh:
        fh.write(str(time.time()))


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, body, ctype="application/json"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health" and trickle:  # 200 at once, then a byte every 0.2 s of a 10 kB body
            self.send_response(200)
            self.send_header("Content-Length", "10000")
            self.end_headers()
            try:
                for _ in range(10000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:
                note("health-hung-up")
        elif self.path == "/health":
            self.send(b"")
        elif self.path == "/v1/models":
            self.send(json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode())
        elif self.path == "/metrics":
            self.send(METRICS.encode(), "text/plain; version=0.0.4")
        else:
            self.send_error(404)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with lock:
            count[0] += 1
            n = count[0]
        note(f"inflight-{n}")
        sock = self.connection
        for _ in range(36000):  # an hour, unless the client hangs up
            ready, _, _ = select.select([sock], [], [], 0.1)
            if ready and not sock.recv(1, socket.MSG_PEEK):
                note(f"hung-up-{n}")
                return


server = ThreadingHTTPServer((args.host, args.port), H)
with open(os.path.join(notes, "server"), "w") as fh:
    fh.write(f"{os.getpid()} {server.server_address[1]}")
server.serve_forever()
"""


def _fake_vllm_env(tmp: Path) -> Path:
    """A Python environment whose `vllm` is FAKE_VLLM (what `validate --python` launches): its python."""
    venv = tmp / "fake-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    pkg = site / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (site / "vllm", site / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_VLLM)
    return venv / "bin" / "python"


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


def _server_url(notes: Path) -> str:
    """The fake server's URL from its notes, once the note is whole (it may exist before its line is written)."""
    end = time.monotonic() + 120
    while True:
        path = notes / "server"
        fields = path.read_text().split() if path.exists() else []
        if len(fields) >= 2:
            return f"http://127.0.0.1:{fields[1]}"
        assert time.monotonic() < end, "the fake server never wrote its port"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waits only for its parent to read its status


@pytest.fixture
def gate_root(tmp_path: Path) -> Path:
    from conftest import checkout_requiring
    from test_gate import PROFILE, TABLE

    return checkout_requiring(tmp_path / "gate-checkout", {PROFILE: TABLE})


@pytest.mark.parametrize("mode", ["launched", "endpoint"])
def test_ctrl_c_stops_inflight_requests_and_the_launched_server(gate_root: Path, tmp_path: Path, mode: str) -> None:
    """Ctrl-C while 4 requests are held by the server: the command ends with one line and 130 within seconds (the
    requests' own deadline is 600 s), every in-flight request is hung up on, and a server validate launched is
    stopped; one it did not launch is left running."""
    from test_gate import PROFILE

    notes = tmp_path / "notes"
    notes.mkdir()
    python = _fake_vllm_env(tmp_path)
    env = {**os.environ, "FAKE_VLLM_NOTES": str(notes), "VLLM_DFLASH_CACHE": str(tmp_path / "cache")}
    ours = None
    where = ["--python", str(python)]
    if mode == "endpoint":
        ours = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server"], env=env)
        _wait_for(notes / "server")
        where = ["--endpoint", _server_url(notes)]
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(gate_root), "validate", "--profile", PROFILE, *where,
           "--report", str(tmp_path / "r.json"), "--quiet"]  # fmt: skip
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        for n in range(1, 5):  # the profile's concurrency: 4 requests in flight
            _wait_for(notes / f"inflight-{n}")
        server_pid = int((notes / "server").read_text().split()[0])
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        took = time.monotonic() - t0
        r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
        assert "interrupted" in one_error(r, 130)
        assert took < 30, f"Ctrl-C took {took:.0f} s to end the command"
        assert not (notes / "inflight-5").exists(), "a request was sent after Ctrl-C"
        if mode == "launched":  # stopped (and with it every request it held)
            end = time.monotonic() + 30
            while not _gone(server_pid):
                assert time.monotonic() < end, "the launched server outlived the command"
                time.sleep(0.1)
        else:  # still running, and every request it held was hung up on: stopped, not abandoned
            assert ours is not None and ours.poll() is None, "validate stopped a server it did not launch"
            for n in range(1, 5):
                _wait_for(notes / f"hung-up-{n}", 30)
    finally:
        if p.poll() is None:
            p.kill()
        if ours is not None:
            ours.kill()
            ours.wait()


def test_a_trickled_health_answer_cannot_outlast_the_health_timeout(gate_root: Path, tmp_path: Path) -> None:
    """/health sends 200 and then a byte every 0.2 s: each read succeeds, so a per-read timeout never fires (the
    control: urllib with a 1 s timeout is still reading after 3 s); validate's total deadline ends it."""
    import contextlib
    import http.client
    import threading
    import urllib.request

    from test_gate import PROFILE

    notes = tmp_path / "notes"
    notes.mkdir()
    python = _fake_vllm_env(tmp_path)
    env = {**os.environ, "FAKE_VLLM_NOTES": str(notes), "FAKE_VLLM_TRICKLE": "1"}
    server = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server"], env=env)
    try:
        _wait_for(notes / "server")
        url = _server_url(notes)

        def plain_read() -> None:
            with contextlib.suppress(OSError, http.client.HTTPException):  # the server is killed at the end
                urllib.request.urlopen(url + "/health", timeout=1).read()

        control = threading.Thread(target=plain_read, daemon=True)
        control.start()
        control.join(3)
        assert control.is_alive(), "the trickle did not defeat a per-read timeout: the test shows nothing"
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "vllm_dflash", "--root", str(gate_root), "validate", "--profile", PROFILE,
             "--endpoint", url, "--health-timeout", "2", "--report", str(tmp_path / "r.json")],
            env={**os.environ, "VLLM_DFLASH_CACHE": str(tmp_path / "cache")}, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        took = time.monotonic() - t0
        assert "/health did not answer 200 within 2 s" in one_error(r, MeasurementError.return_code)
        assert took < 30, f"--health-timeout 2 took {took:.0f} s"
    finally:
        server.kill()
        server.wait()


def test_the_client_deadline_is_total_and_its_limit_holds(tmp_path: Path) -> None:
    """client.request on the trickling server: refused at its deadline (1 s) although every read succeeds; an
    endless body is cut at the size limit; a complete answer within both is returned whole (the twin)."""
    from vllm_dflash.validate import client

    notes = tmp_path / "notes"
    notes.mkdir()
    python = _fake_vllm_env(tmp_path)
    env = {**os.environ, "FAKE_VLLM_NOTES": str(notes), "FAKE_VLLM_TRICKLE": "1"}
    server = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server"], env=env)
    try:
        _wait_for(notes / "server")
        url = _server_url(notes)
        t0 = time.monotonic()
        with pytest.raises(client.TransportError, match="no complete answer within 1 s"):
            client.request("GET", url + "/health", 1.0, 1 << 20)
        assert time.monotonic() - t0 < 5
        with pytest.raises(client.TooLarge, match="larger than 3 bytes"):
            client.request("GET", url + "/health", 30.0, 3)
        got = client.request("GET", url + "/metrics", 5.0, 1 << 20)
        assert got.status == 200 and b"spec_decode_num_drafts_total 0" in got.body
        session = client.Session()
        session.abort()
        with pytest.raises(client.TransportError, match="interrupted"):
            session.request("GET", url + "/metrics", 5.0, 1 << 20)
    finally:
        server.kill()
        server.wait()
