"""Every fault a user or the machine can cause ends in ONE line, its own exit code, no traceback, nothing written
(issue 10). Each case runs the real CLI in a subprocess on a throwaway checkout."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Checkout, ModuleTmp, make_checkout

from vllm_dflash.errors import (
    ConformanceError,
    ContainerError,
    DirtyTreeError,
    ManifestError,
    MeasurementError,
    PatchError,
    PinMismatchError,
    PublishRefusedError,
    StorageError,
    UpstreamError,
    VerifyError,
)

DIST_TOML = "dist.toml"
SECRET = "s3cr3t-pw"  # a password in a URL: never echoed
DEAD = ("--endpoint", "http://127.0.0.1:9", "--health-timeout", "1")  # nothing listens on the discard port
FOREIGN = "aarch64" if platform.machine() == "x86_64" else "x86_64"  # its handler hidden (VLLM_DFLASH_BINFMT_DIR)


def one_line_error(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == code, f"exit {r.returncode}, want {code}: {r.stderr[-3000:]}"
    assert len(errors) == 1, r.stderr[-3000:]
    assert " -- " in errors[0] or code == PublishRefusedError.return_code, errors[0]  # what to do, too
    return errors[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _edit(old: str, new: str) -> Callable[[Checkout], None]:
    def edit(co: Checkout) -> None:
        co.edit_manifest(old, new)

    return edit


def _write(rel: str, data: bytes) -> Callable[[Checkout], None]:
    def write(co: Checkout) -> None:
        path = co.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return write


CRLF_PATCH = (
    b"From 0 Mon Sep 17 00:00:00 2001\r\nSubject: [PATCH] x\r\n\r\n---\r\n"
    b"diff --git a/vllm/x.py b/vllm/x.py\r\n--- a/vllm/x.py\r\n+++ b/vllm/x.py\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n"
)

# (name, how to break the checkout, argv, exit code, a phrase the one line must contain)
CASES: list[tuple[str, Callable[[Checkout], object] | None, list[str], int, str]] = [
    ("manifest-undecodable", _write(DIST_TOML, b"\xff\xfe[upstream]\n"), ["build"], 3, "not UTF-8"),
    ("manifest-syntax", _write(DIST_TOML, b"[upstream\n"), ["build"], 3, "not valid TOML"),
    ("manifest-unknown-key", _edit('dist_dir = "dist"', 'dist_dri = "dist"'), ["build"], 3, "did you mean"),
    ("manifest-dotdot", _edit('filename = "vllm-0.20.1.tar.gz"', 'filename = "../x"'), ["build"], 3, "plain file"),
    ("version-missing", lambda co: (co.root / "VERSION").unlink(), ["build"], 3, "VERSION"),
    ("version-garbage", _write("VERSION", b"\x00\x01"), ["build"], 3, "VERSION"),
    ("series-dotdot", _write("patches/series", b"../../etc/passwd\n"), ["build"], 3, "plain file name"),
    ("series-missing-patch", _write("patches/series", b"0001-nope.patch\n"), ["build"], 3, "does not exist"),
    (
        "patch-crlf",
        lambda co: (_write("patches/0001-x.patch", CRLF_PATCH)(co), _write("patches/series", b"0001-x.patch\n")(co)),
        ["build"],
        6,
        "CRLF",
    ),
    ("platform-unknown", None, ["build", "--platform", "sparc"], 2, ""),
    ("out-is-a-file", _write("afile", b"x"), ["build", "--out", "{root}/afile"], 15, "is a file"),
    ("base-wheel-missing", None, ["build", "--base-wheel", "/nonexistent.whl"], 3, "no such file"),
    ("wheel-tree-not-git", None, ["wheel", "--tree", "{root}"], 3, "not a git work tree"),
    ("image-wheel-missing", None, ["image", "--wheel", "/nonexistent.whl"], ContainerError.return_code, "no such"),
    (
        "image-foreign-platform",
        _write("w.whl", b""),
        ["image", "--platform", FOREIGN, "--wheel", "{root}/w.whl"],
        11,
        "binfmt_misc",
    ),
    ("publish-bad-scheme", None, ["publish", "x.whl", "--to", "ftp://h/x"], 12, "unsupported scheme"),
    ("publish-file-host", None, ["publish", "x.whl", "--to", "file://otherhost/srv"], 12, "names host"),
    ("publish-to-a-file", _write("afile", b"x"), ["publish", "x.whl", "--to", "{root}/afile/sub"], 12, "is a file"),
    ("publish-no-wheel", None, ["publish", "{root}/none.whl", "--to", "{root}/idx"], 12, "does not exist"),
    ("validate-bad-endpoint", None, ["validate", "--profile", "qwen3-8b", "--endpoint", "localhost:8000"], 2, "http"),
    ("validate-no-profile", None, ["validate", "--profile", "nope"], 3, "no profile"),
    ("verify-not-a-release", None, ["verify", "{root}"], VerifyError.return_code, ""),
    ("release-no-wheels", None, ["release", "{root}/none.whl"], 3, "no such wheel"),
    (
        "conformance-wheel-missing",
        None,
        ["conformance", "--patched-wheel", "/x.whl"],
        ConformanceError.return_code,
        "no such file",
    ),
    ("rebase-git-ref", None, ["rebase", "--to", "v0.1.0"], UpstreamError.return_code, "already"),
    ("cache-is-a-file", _write("cachefile", b"x"), ["source", "--source", "sdist"], 15, "cache directory"),
    # Issue 26: inputs that ended in a traceback, a mis-poll or an echoed secret; each is one line now.
    *[
        (f"validate-endpoint-{name}", None, ["validate", "--profile", "qwen3-8b", "--endpoint", url], 2, phrase)
        for name, url, phrase in (
            ("ipv6", "http://[::1", "not a URL (Invalid IPv6 URL)"),
            ("space", "http://a b:8000", "holds spaces, control or non-ASCII"),
            ("label", "http://" + "a" * 64 + ".example:8000", "longer than DNS allows"),
            ("query", "http://127.0.0.1:9/?model=x", "has a query or fragment"),
            ("fragment", "http://127.0.0.1:9/#top", "has a query or fragment"),
            ("password", f"http://user:{SECRET}@127.0.0.1:9", "carries credentials"),
        )
    ],
    ("validate-report-proc", None, ["validate", "--profile", "qwen3-8b", *DEAD, "--report", "/proc/r.json"], 15,
     "cannot create --report /proc/r.json"),
    ("validate-report-sys", None, ["validate", "--profile", "qwen3-8b", *DEAD, "--report", "/sys/x/r.json"], 15,
     "cannot create --report /sys/x"),
    ("validate-prompts-nested", _write("deep.jsonl", b"[" * 100_000 + b"\n"),
     ["validate", "--profile", "qwen3-8b", *DEAD, "--prompts", "{root}/deep.jsonl"], 3, "nests deeper"),
    ("validate-prompts-bigint", _write("big.jsonl", b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}\n'),
     ["validate", "--profile", "qwen3-8b", *DEAD, "--prompts", "{root}/big.jsonl"], 3, "not JSON"),
    ("validate-profile-file-nested", _write("p.toml", b"[profiles.x]\na = " + b"[" * 100_000 + b"\n"),
     ["validate", "--profile", "x", "--profile-file", "{root}/p.toml"], 3, "nests arrays or tables deeper"),
    ("validate-image-option", None, ["validate", "--profile", "qwen3-8b", "--image=--privileged"], 2,
     "has the part '--privileged'"),
    ("validate-python-not-python", None, ["validate", "--profile", "qwen3-8b", "--python", "/bin/true"], 2,
     "did not answer the probe"),
    ("publish-to-ipv6", None, ["publish", "x.whl", "--to", "http://[::1"], 12, "not a URL (Invalid IPv6 URL)"),
    ("publish-to-password", None, ["publish", "x.whl", "--to", f"https://u:{SECRET}@upload.example/legacy/"], 12,
     "carries a password"),
    ("publish-image-option", None, ["publish", "--to=--all-tags", "vllm-dflash:1"], 12, "'--all-tags'"),
    ("publish-image-upper", None, ["publish", "Ml/vllm:1", "--to", "registry.example.com/ml/vllm:1"], 12, "'Ml'"),
    ("publish-to-nul", None, ["publish", "x.whl", "--to", "file:///index/%00x"], 12, "NUL byte"),
    ("doctor-config-nested", _write("d/config.json", b"[" * 100_000), ["doctor", "{root}/d"], 18, "nests deeper"),
    ("doctor-config-bigint", _write("d/config.json", b'{"num_hidden_layers": ' + b"9" * 5000 + b"}"),
     ["doctor", "{root}/d"], 18, "not JSON"),
    ("doctor-config-infinite", _write("d/config.json", b'{"num_hidden_layers": 1e999}'), ["doctor", "{root}/d"], 18,
     "out of range"),
    ("image-tag-space", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--tag", "a b"], 11, "'a b'"),
    ("image-tag-option", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--tag=--rm"], 11, "'--rm'"),
    ("image-tag-upper", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--tag", "Ml/x"], 11, "'Ml'"),
    ("image-base-digest", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--base-image", "x@sha256:1"],
     11, "not sha256:<64 hex>"),
    ("image-network-word", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--network", "a;b"], 11,
     "not a value podman or buildah takes"),
    ("image-storage-root-proc", _write("w.whl", b""),
     ["image", "--wheel", "{root}/w.whl", "--storage-root", "/proc/store"], 15, "cannot create --storage-root"),
    ("image-storage-root-file", _write("w.whl", b""), ["image", "--wheel", "{root}/w.whl", "--storage-root",
     "{root}/w.whl"], 15, "is a file, not a directory"),
    ("index-url-ipv6", None, ["build", "--source", "sdist", "--platform", "x86_64"], 5, "not a URL"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "breaker", "argv", "code", "phrase"), CASES, ids=[c[0] for c in CASES])
def test_cli_faults_are_one_line(
    tmp_path: Path,
    name: str,
    breaker: Callable[[Checkout], object] | None,
    argv: list[str],
    code: int,
    phrase: str,
) -> None:
    co = make_checkout(tmp_path, tmp_path / "cache")
    if breaker is not None:
        breaker(co)
    env = {"VLLM_DFLASH_CACHE": str(co.root / "cachefile")} if name == "cache-is-a-file" else None
    if name == "image-foreign-platform":  # hide a qemu handler this machine may have registered
        (tmp_path / "binfmt").mkdir()
        env = {"VLLM_DFLASH_BINFMT_DIR": str(tmp_path / "binfmt")}
    if name == "index-url-ipv6":
        env = {"VLLM_DFLASH_INDEX_URL": "http://[::1/simple"}
    before = snapshot(co.root)
    r = co.cli(*[a.replace("{root}", str(co.root)) for a in argv], env=env)
    if code == 2 and not phrase:  # argparse's own usage error: its exit code and message, still no traceback
        assert r.returncode == 2 and "Traceback" not in r.stderr and "invalid choice" in r.stderr
        return
    line = one_line_error(r, code)
    assert phrase in line, line
    assert SECRET not in r.stdout + r.stderr, "a password was echoed"
    assert snapshot(co.root) == before, "a refused command wrote into the checkout"


def test_every_error_class_has_its_own_code() -> None:
    import vllm_dflash.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.DflashError)]
    codes = [c.return_code for c in classes if c is not errors.DflashError]
    assert len(codes) == len(set(codes)) >= 15
    assert {DirtyTreeError, PinMismatchError, PatchError, MeasurementError, ManifestError} <= set(classes)


# --- the machine: a full disk, a read-only destination ----------------------------------------------------------


@contextlib.contextmanager
def mounted(kind: str, where: Path) -> Iterator[Path]:
    """A tiny tmpfs (full disk) or a read-only bind mount at `where`; skips where this machine cannot mount."""
    where.mkdir(parents=True, exist_ok=True)
    if kind == "full":
        cmd = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        extra: list[list[str]] = []
    else:
        src = where.with_name(where.name + "-src")
        src.mkdir()
        res = subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True, text=True, check=False)
        extra = [["mount", "-o", "remount,bind,ro", str(where)]]
    if res.returncode != 0 or os.geteuid() != 0:
        pytest.skip(f"cannot mount here (needs root): {res.stderr.strip()}")
    try:
        for cmd in extra:
            subprocess.run(cmd, check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


@pytest.mark.parametrize("kind", ["full", "readonly"])
def test_build_into_a_full_or_readonly_disk(checkout: Checkout, tmp_path: Path, kind: str) -> None:
    """ENOSPC mid-write and EROFS: one line naming the place and what to do, exit 15, nothing half-written."""
    with mounted(kind, tmp_path / "out") as out:
        r = checkout.cli("build", "--source", "sdist", "--platform", "x86_64", "--out", str(out))
        line = one_line_error(r, StorageError.return_code)
        assert str(out) in line
        assert ("No space left" in line) if kind == "full" else ("Read-only" in line)
        assert list(out.iterdir()) == []


def test_base_wheel_that_is_not_vllm(checkout: Checkout, tmp_path: Path) -> None:
    other = tmp_path / "other-0.20.1-py3-none-any.whl"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("other/__init__.py", "")
        z.writestr("other-0.20.1.dist-info/RECORD", "other/__init__.py,,\n")
    r = checkout.cli("build", "--source", "sdist", "--base-wheel", str(other))
    line = one_line_error(r, PinMismatchError.return_code)
    assert "not a vLLM wheel" in line
    assert checkout.dist_files() == []


# --- release options (issue 26): each bad value is one line with its class; the same release made valid passes ---

_DIGEST = "sha256:" + "a" * 64
RELEASE_CASES: list[tuple[str, list[str], dict[str, str], int, str]] = [
    ("sign-key-not-pem", ["--sign-key", "{tmp}/bad.pem"], {}, 25, "is not a usable PEM private key"),
    ("sign-key-rsa", ["--sign-key", "{tmp}/rsa.pem"], {}, 25, "not Ed25519"),
    ("sign-key-missing", ["--sign-key", "{tmp}/none.pem"], {}, 25, "does not exist"),
    ("sign-key-public", ["--sign-key", "{tmp}/ok.pub"], {}, 25, "not a usable PEM private key"),
    ("source-date-epoch-digits", [], {"SOURCE_DATE_EPOCH": "9" * 5000}, 3, "is not a number of seconds"),
    ("source-date-epoch-far", [], {"SOURCE_DATE_EPOCH": "999999999999"}, 3, "beyond any date"),
    ("builder-id-empty", ["--builder-id", ""], {}, 3, "is not a URI"),
    ("builder-id-space", ["--builder-id", "urn:a b"], {}, 3, "is not a URI"),
    ("image-upper", ["--image", f"Ml/x@{_DIGEST}=x86_64"], {}, 3, "'Ml'"),
    ("image-option", [f"--image=-x@{_DIGEST}"], {}, 3, "'-x'"),
    ("index-url-ipv6", ["--index-url", "http://[::1"], {}, 3, "not a URL"),
    ("index-url-password", ["--index-url", f"https://u:{SECRET}@pypi.example/simple/"], {}, 3, "without a password"),
]
VALID_RELEASE = (
    ["--sign-key", "{tmp}/ok.pem", "--builder-id", "https://ci.example.com/runners/1", "--image",
     f"registry.example.com:5000/ml/vllm-dflash@{_DIGEST}=x86_64", "--index-url", "https://pypi.example.com/simple/"],
    {"SOURCE_DATE_EPOCH": "1700000000"},
)  # fmt: skip


@pytest.fixture(scope="module")
def release_inputs(module_tmp: ModuleTmp) -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from test_gate import make_vllm_wheel

    from vllm_dflash.release import dsse

    tmp = module_tmp("release-inputs")
    make_vllm_wheel(tmp / "dist")
    dsse.write_keypair(tmp / "ok.pem", tmp / "ok.pub")
    (tmp / "bad.pem").write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (tmp / "rsa.pem").write_bytes(pem)
    return tmp


@pytest.mark.parametrize(("name", "argv", "env", "code", "phrase"), RELEASE_CASES, ids=[c[0] for c in RELEASE_CASES])
def test_release_options_are_one_line(
    tmp_path: Path, release_inputs: Path, name: str, argv: list[str], env: dict[str, str], code: int, phrase: str
) -> None:
    co = make_checkout(tmp_path, tmp_path / "cache")
    (wheel,) = (release_inputs / "dist").glob("*.whl")
    out = tmp_path / "rel"
    r = co.cli("release", str(wheel), "--out", str(out), *[a.replace("{tmp}", str(release_inputs)) for a in argv],
               env=env)  # fmt: skip
    line = one_line_error(r, code)
    assert phrase in line, line
    assert SECRET not in r.stdout + r.stderr
    assert not out.exists(), "a refused release wrote files"


def test_release_options_twin_is_released(tmp_path: Path, release_inputs: Path) -> None:
    """Every option of RELEASE_CASES made valid at once: released and verified (the checks refuse only the bad)."""
    co = make_checkout(tmp_path, tmp_path / "cache")
    (wheel,) = (release_inputs / "dist").glob("*.whl")
    argv, env = VALID_RELEASE
    out = tmp_path / "rel"
    r = co.cli("release", str(wheel), "--out", str(out), *[a.replace("{tmp}", str(release_inputs)) for a in argv],
               env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    v = co.cli("verify", str(out), "--key", str(release_inputs / "ok.pub"), "--require-signature")
    assert v.returncode == 0, v.stderr[-2000:]
    images = (out / "images.json").read_text()
    assert "registry.example.com:5000/ml/vllm-dflash" in images
