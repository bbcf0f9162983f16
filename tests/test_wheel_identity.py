"""A wheel is what its bytes say (issue 26): the name, version, machine and interpreter of a wheel come from its own
METADATA and WHEEL and must be its file name's; odd members and a missing or foreign provenance are refused; every
member is read bounded. Each bad wheel next to the same wheel made valid, through `publish` (exit 12, one line, the
index byte-identical) and `pipeline/wheelfile.inspect_wheel` itself.
"""

from __future__ import annotations

import base64
import hashlib
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import checkout_requiring, provenance_bytes
from test_gate import cli, error_lines, tree_hash
from test_publish import PROFILE_TABLE, make_report

from vllm_dflash import provenance as prov
from vllm_dflash.errors import PublishRefusedError
from vllm_dflash.fetch import sha256_file
from vllm_dflash.pipeline.wheelfile import inspect_wheel, member_problem

VERSION = "0.20.1+dflash.1"
X86 = "cp38-abi3-manylinux_2_35_x86_64"
ARM = "cp38-abi3-manylinux_2_35_aarch64"
OTHER = "0.20.1+dflash.2"


def _record(members: list[tuple[str, bytes]], dist: str) -> bytes:
    rows = [
        f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
        for n, d in members
    ]
    return ("\n".join([*rows, f"{dist}/RECORD,,"]) + "\n").encode()


def wheel(
    dest: Path,
    tag: str = X86,
    file_tag: str | None = None,
    wheel_tag: str | None = None,
    extra: list[tuple[str, bytes]] | None = None,
    provenance: bytes | None = b"default",
    method: int = zipfile.ZIP_DEFLATED,
    metadata: bytes | None = None,
) -> Path:
    """A vllm wheel shaped as `vllm-dflash build` shapes one (WHEEL's platform is setuptools' linux_<machine>), with
    what a case changes: the file name's tag, WHEEL's tag, extra members (duplicates allowed), the provenance, the
    compression of METADATA, METADATA itself."""
    dist = f"vllm-{VERSION}.dist-info"
    machine_tag = (wheel_tag or tag).replace("manylinux_2_35", "linux")
    doc = provenance_bytes("vllm", VERSION, tag) if provenance == b"default" else provenance
    members: list[tuple[str, bytes]] = [("vllm/__init__.py", b"# ours\n")]
    if doc is not None:
        members.append((prov.PATH, doc))
    members += [
        (f"{dist}/METADATA", metadata or f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n".encode()),
        (
            f"{dist}/WHEEL",
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {machine_tag}\n".encode(),
        ),
        *(extra or []),
    ]
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"vllm-{VERSION}-{file_tag or tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data, method if "METADATA" in name else None)
        zf.writestr(f"{dist}/RECORD", _record(members, dist))
    return path


def patch_member(path: Path, name: str, edit: Callable[[bytearray, int, int], object]) -> None:
    """Edit `name`'s local header (at its offset) and central directory entry in place: edit(buf, local, central)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:
        local = zf.getinfo(name).header_offset
        central = zf.start_dir
    while raw[central + 46 : central + 46 + len(name)] != name.encode():
        central = raw.index(b"PK\x01\x02", central + 4)
    edit(raw, local, central)
    path.write_bytes(bytes(raw))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return checkout_requiring(tmp_path / "checkout", {"gate-test": PROFILE_TABLE})


def publish_refused(root: Path, index: Path, wheel_path: Path, words: str) -> None:
    """Refused although a passing report names this very wheel (its sha256): the wheel itself is what is wrong."""
    before = tree_hash(index)
    report = make_report(root, sha256_file(wheel_path), wheel_path.parent / f"{wheel_path.name}.report.json")
    run = cli(root, "publish", wheel_path, "--report", report, "--to", index)
    lines = error_lines(run)
    assert run.returncode == 12 and len(lines) == 1 and words in lines[0], run.stderr
    assert "Traceback" not in run.stderr and tree_hash(index) == before


def refused(path: Path, words: str) -> None:
    with pytest.raises(PublishRefusedError) as got:
        inspect_wheel(path, PublishRefusedError, require_provenance=True)
    assert words in got.value.one_line() and "\n" not in got.value.one_line(), got.value.one_line()


def test_a_valid_wheel_reads_as_what_it_is(root: Path, tmp_path: Path) -> None:
    """The negative control of every case below: the same wheel, untouched, publishes with the same kind of report."""
    good = wheel(tmp_path)
    report = make_report(root, sha256_file(good), tmp_path / "report.json")
    run = cli(root, "publish", good, "--report", report, "--to", tmp_path / "index")
    assert run.returncode == 0, run.stderr
    got = inspect_wheel(good, PublishRefusedError, require_provenance=True)
    assert (got.project, got.version, got.machine) == ("vllm", VERSION, "x86_64")
    assert got.provenance is not None and got.provenance.version == VERSION
    arm = inspect_wheel(wheel(tmp_path / "arm", tag=ARM), PublishRefusedError, require_provenance=True)
    assert arm.machine == "aarch64"


def test_renamed_platform_wheel_is_refused(root: Path, tmp_path: Path) -> None:
    """An x86_64 wheel renamed ...aarch64.whl (same bytes): `pip download --platform manylinux_2_35_aarch64` would
    hand out x86-64 binaries. Its WHEEL says x86_64, so publish refuses it, the index untouched."""
    index = tmp_path / "index"
    good = wheel(tmp_path / "x86")
    renamed = tmp_path / "renamed" / good.name.replace("x86_64", "aarch64")
    renamed.parent.mkdir()
    renamed.write_bytes(good.read_bytes())
    publish_refused(root, index, renamed, "is named for aarch64, but its WHEEL tags ['cp38-abi3-linux_x86_64']")
    refused(renamed, "say x86_64")
    refused(wheel(tmp_path / "w", wheel_tag="py3-none-linux_x86_64"), "interpreters ['cp'], but its WHEEL tags")
    # The same bytes under their own name read as they are.
    assert inspect_wheel(good, PublishRefusedError).machine == "x86_64"


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("duplicate METADATA", "is in it twice"),
        ("two dist-info directories", "has 2 .dist-info directories, not one"),
        ("dot-dot member", "climbs out with '..'"),
        ("absolute member", "is an absolute path"),
        ("no provenance", "carries no vllm/dflash_build.json"),
        ("provenance of another version", "is of version '0.20.1+dflash.2', the wheel is 0.20.1+dflash.1"),
        ("provenance of another machine", "not a vllm 0.20.1 wheel for x86_64"),
        ("provenance of another project", "not a vllm 0.20.1 wheel for x86_64"),
        ("provenance naming no base wheel", "which is no wheel"),
        ("malformed provenance", "is not JSON"),
        ("METADATA of another version", "but its METADATA says vllm 0.20.1+dflash.9"),
    ],
)
@pytest.mark.filterwarnings("ignore:Duplicate name")  # zipfile warns as it writes the duplicate: the case itself
def test_odd_wheels_are_refused(root: Path, tmp_path: Path, case: str, words: str) -> None:
    dist = f"vllm-{VERSION}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}\n".encode()
    made = {
        "duplicate METADATA": lambda: wheel(tmp_path, extra=[(f"{dist}/METADATA", meta.replace(b"vllm", b"torch"))]),
        "dot-dot member": lambda: wheel(tmp_path, extra=[("vllm/../../evil.pth", b"import os\n")]),
        "two dist-info directories": lambda: wheel(tmp_path, extra=[("torch-2.11.0.dist-info/METADATA", meta)]),
        "absolute member": lambda: wheel(tmp_path, extra=[("/etc/evil.pth", b"import os\n")]),
        "no provenance": lambda: wheel(tmp_path, provenance=None),
        "provenance of another version": lambda: wheel(
            tmp_path, provenance=provenance_bytes("vllm", "0.20.1+dflash.2", X86)
        ),
        "provenance of another machine": lambda: wheel(tmp_path, provenance=provenance_bytes("vllm", VERSION, ARM)),
        "provenance of another project": lambda: wheel(tmp_path, provenance=provenance_bytes("torch", VERSION, X86)),
        "provenance naming no base wheel": lambda: wheel(
            tmp_path, provenance=provenance_bytes("vllm", VERSION, X86).replace(b".whl", b".zip")
        ),
        "malformed provenance": lambda: wheel(tmp_path, provenance=b"{not json"),
        "METADATA of another version": lambda: wheel(tmp_path, metadata=meta.replace(b"dflash.1", b"dflash.9")),
    }
    bad = made[case]()
    refused(bad, words)
    publish_refused(root, tmp_path / "index", bad, words)


def test_member_names_and_their_valid_twins() -> None:
    for name, words in (
        ("/abs", "absolute"),
        ("C:/x", "absolute"),
        ("a\\b", "backslash"),
        ("a\0b", "NUL"),
        ("a/../b", "'..'"),
        ("a//b", "empty or '.'"),
        ("./a", "empty or '.'"),
        ("", "absolute"),
    ):
        got = member_problem(name)
        assert got is not None and words in got, (name, got)
    for fine in ("vllm/__init__.py", "vllm/", "vllm-0.20.1.dist-info/METADATA", "a..b/c"):
        assert member_problem(fine) is None, fine


@pytest.fixture(scope="module")
def bomb_stream() -> tuple[bytes, int, int]:
    """1 GiB of zeros, deflated (raw, as zip stores it): ~4.5 MB, made in ~2 s. (compressed, size, crc)"""
    comp = zlib.compressobj(1, zlib.DEFLATED, -15)
    block, parts, crc = b"\0" * (1 << 24), [], 0
    for _ in range(64):
        parts.append(comp.compress(block))
        crc = zlib.crc32(block, crc)
    parts.append(comp.flush())
    return b"".join(parts), 64 << 24, crc


def _set_sizes(raw: bytearray, local: int, central: int, size: int, crc: int | None = None) -> None:
    struct.pack_into("<I", raw, local + 22, size)
    struct.pack_into("<I", raw, central + 24, size)
    if crc is not None:
        struct.pack_into("<I", raw, local + 14, crc)
        struct.pack_into("<I", raw, central + 16, crc)


def _bomb_wheel(tmp_path: Path, stream: tuple[bytes, int, int], honest: bool) -> Path:
    """METADATA replaced by the 1 GiB bomb: its header states the true size (honest) or 200 bytes (a lie)."""
    data, size, crc = stream
    path = wheel(tmp_path, method=zipfile.ZIP_STORED, metadata=b"M" * len(data))
    name = f"vllm-{VERSION}.dist-info/METADATA"

    def edit(raw: bytearray, local: int, central: int) -> None:
        name_len, extra_len = struct.unpack_from("<HH", raw, local + 26)
        start = local + 30 + name_len + extra_len
        raw[start : start + len(data)] = data  # same length: the stored placeholder's bytes become the stream
        for at in (local + 8, central + 10):
            struct.pack_into("<H", raw, at, zipfile.ZIP_DEFLATED)
        _set_sizes(raw, local, central, size if honest else 200, crc)

    patch_member(path, name, edit)
    return path


@pytest.mark.parametrize("honest", [True, False], ids=["honest-header", "lying-header"])
def test_a_metadata_zip_bomb_is_one_clean_line(
    root: Path, tmp_path: Path, bomb_stream: tuple[bytes, int, int], honest: bool
) -> None:
    bad = _bomb_wheel(tmp_path, bomb_stream, honest)
    words = "is 1073741824 bytes, larger than the 4 MiB limit" if honest else "is corrupt (Bad CRC-32"
    refused(bad, words)
    publish_refused(root, tmp_path / "index", bad, words)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("encrypted", "METADATA' is encrypted -- "),  # our own check, not zipfile's "corrupt" refusal
        ("bzip2", "compressed with zip method 12"),
        ("unknown method 99", "compressed with zip method 99"),
        ("corrupt stream", "is corrupt"),
        ("truncated zip", "is not a readable wheel"),
    ],
)
def test_unreadable_members_are_one_clean_line(root: Path, tmp_path: Path, case: str, words: str) -> None:
    name = f"vllm-{VERSION}.dist-info/METADATA"
    method = zipfile.ZIP_BZIP2 if case == "bzip2" else zipfile.ZIP_DEFLATED
    path = wheel(tmp_path, method=method)
    if case == "encrypted":
        patch_member(path, name, lambda raw, loc, cen: [raw.__setitem__(at, raw[at] | 1) for at in (loc + 6, cen + 8)])
    elif case == "unknown method 99":

        def method_99(raw: bytearray, local: int, central: int) -> None:
            for at in (local + 8, central + 10):
                struct.pack_into("<H", raw, at, 99)

        patch_member(path, name, method_99)
    elif case == "corrupt stream":

        def scramble(raw: bytearray, local: int, central: int) -> None:
            name_len, extra_len = struct.unpack_from("<HH", raw, local + 26)
            start = local + 30 + name_len + extra_len
            raw[start : start + 8] = b"\xff" * 8

        patch_member(path, name, scramble)
    elif case == "truncated zip":
        path.write_bytes(path.read_bytes()[:-30])
    refused(path, words)
    publish_refused(root, tmp_path / "index", path, words)
