"""Release directories, end to end on real wheels: both platforms' wheels built from one x86_64 host with the real
patch queue (fast path, on the hash-pinned upstream wheels), checked entry by entry against upstream's, installed
for aarch64 with pip's --platform, released (signed and unsigned), verified, altered file by file, and checked
against the CycloneDX and in-toto schemas; two runs give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ModuleTmp, checkout_requiring, clone_tree
from packaging.specifiers import SpecifierSet
from test_publish import PROFILE, PROFILE_TABLE, make_report

from vllm_dflash.errors import ProvenanceError, PublishRefusedError, StorageError, VerifyError
from vllm_dflash.fetch import fetch
from vllm_dflash.manifest import Manifest, load_manifest, parse_profile
from vllm_dflash.pipeline.model import PatchedTree, WheelResult
from vllm_dflash.pipeline.patches import apply_series
from vllm_dflash.pipeline.wheel import VERSION_PY, build_fast_wheel
from vllm_dflash.provenance import PATH as PROVENANCE_PATH
from vllm_dflash.publish import publish_plan
from vllm_dflash.release import (
    ImageRef,
    Release,
    ReleaseOptions,
    VerifyOptions,
    layout,
    make_release,
    read_facts,
    sbom,
    statement,
    verify,
    write_keypair,
)
from vllm_dflash.release.dsse import INTOTO_PAYLOAD_TYPE, open_envelope
from vllm_dflash.series import read_queue

PLATFORMS = ("x86_64", "aarch64")
ISOLATED_PIP = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
# The checkout's test profile as verify judges the attached reports under it (the manifest's own profiles).
PROFILES = {PROFILE: parse_profile(PROFILE, PROFILE_TABLE)}

pytestmark = [pytest.mark.network, pytest.mark.slow]


# ---------------------------------------------------------------------------------------------------------------
# Fixtures: the real queue on the real 0.20.1 tree, both platforms' wheels, keys, reports, a checkout


@pytest.fixture(scope="module")
def patched(sdist_tree, manifest: Manifest, module_tmp: ModuleTmp) -> PatchedTree:  # type: ignore[no-untyped-def]
    tree = clone_tree(sdist_tree, module_tmp("reltree") / "vllm")
    return apply_series(tree, read_queue(manifest.series_path).patches, manifest.fork_branch)


@pytest.fixture(scope="module")
def built(manifest: Manifest, patched: PatchedTree, module_tmp: ModuleTmp) -> dict[str, WheelResult]:
    """Both platforms' wheels, built on this (x86_64) host from the pinned upstream wheels (aarch64: ~236 MB)."""
    out = module_tmp("dist")
    return {plat: build_fast_wheel(manifest, patched, fetch(manifest.wheels[plat]), out) for plat in PLATFORMS}


@pytest.fixture(scope="module")
def keys(module_tmp: ModuleTmp) -> dict[str, Path]:
    d = module_tmp("keys")
    write_keypair(d / "release-key.pem", d / "release-key.pub")
    write_keypair(d / "other-key.pem", d / "other-key.pub")
    return {"private": d / "release-key.pem", "public": d / "release-key.pub", "other": d / "other-key.pub"}


@pytest.fixture(scope="module")
def checkout(repo_root: Path, module_tmp: ModuleTmp) -> Path:
    """This repo's dist.toml and VERSION, plus a test profile that publishing requires (reports are made with it)."""
    return checkout_requiring(module_tmp("checkout"), {PROFILE: PROFILE_TABLE})


@pytest.fixture(scope="module")
def reports(checkout: Path, built: dict[str, WheelResult], module_tmp: ModuleTmp) -> dict[str, Path]:
    d = module_tmp("reports")
    return {plat: make_report(checkout, w.sha256, d / f"validation-{plat}.json") for plat, w in built.items()}


@pytest.fixture(scope="module")
def signed(
    checkout: Path,
    built: dict[str, WheelResult],
    keys: dict[str, Path],
    reports: dict[str, Path],
    module_tmp: ModuleTmp,
) -> Release:
    options = ReleaseOptions(
        sign_key=keys["private"],
        reports=tuple(reports.values()),
        images=(ImageRef("registry.example.com/ml/vllm-dflash", "sha256:" + "ab" * 32),),
    )
    wheels = [w.path for w in built.values()]
    return make_release(load_manifest(checkout), wheels, module_tmp("rel") / "signed", options)


@pytest.fixture(scope="module")
def unsigned(manifest: Manifest, built: dict[str, WheelResult], module_tmp: ModuleTmp) -> Release:
    return make_release(manifest, [w.path for w in built.values()], module_tmp("rel") / "unsigned")


def copy_release(release: Path, dest: Path) -> Path:
    """A private copy to alter: wheels hard-linked (alterations replace files, never write into them)."""
    dest.mkdir()
    for p in release.iterdir():
        if p.suffix == ".whl":
            os.link(p, dest / p.name)
        else:
            shutil.copyfile(p, dest / p.name)
    return dest


def replace_bytes(path: Path, change: Callable[[bytes], bytes]) -> None:
    new = path.with_name(f".{path.name}.new")
    new.write_bytes(change(path.read_bytes()))
    os.replace(new, path)  # a new inode: the hard-linked original stays intact


def flip_middle_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def refused(target: Path, options: VerifyOptions | None = None) -> str:
    with pytest.raises(VerifyError) as info:
        verify(target, options or VerifyOptions(profiles=PROFILES))
    line = info.value.one_line()
    assert info.value.return_code == 17
    assert "\n" not in line, line
    return line


# ---------------------------------------------------------------------------------------------------------------
# The wheels: per platform, byte-identical to upstream's except our Python files and metadata


def _raw_entries(path: Path) -> dict[str, tuple[zipfile.ZipInfo, str]]:
    """name -> (info, sha256 of the entry's compressed bytes as stored), read straight from the archive."""
    header = struct.Struct("<4sHHHHHIIIHH")
    out: dict[str, tuple[zipfile.ZipInfo, str]] = {}
    with zipfile.ZipFile(path) as zf, path.open("rb") as fh:
        for info in zf.infolist():
            fh.seek(info.header_offset)
            fields = header.unpack(fh.read(header.size))
            fh.seek(info.header_offset + header.size + fields[9] + fields[10])
            out[info.filename] = (info, hashlib.sha256(fh.read(info.compress_size)).hexdigest())
    return out


@pytest.mark.parametrize("plat", PLATFORMS)
def test_wheel_is_upstream_but_our_python_files_and_metadata(
    plat: str, built: dict[str, WheelResult], manifest: Manifest, patched: PatchedTree
) -> None:
    ours_path, up_path = built[plat].path, fetch(manifest.wheels[plat])
    assert ours_path.name == f"vllm-0.20.1+dflash.1-cp38-abi3-manylinux_2_35_{plat}.whl"
    facts = read_facts(ours_path)
    assert facts.platform == plat and facts.provenance.build.base_wheel_sha256 == manifest.wheels[plat].sha256
    changed = set(facts.provenance.changed_files)
    assert changed and all(p.startswith("vllm/") and p.endswith(".py") for p in changed)

    def key(name: str) -> str:  # the dist-info directory is renamed with the version
        top, _, rest = name.partition("/")
        return f"<dist-info>/{rest}" if top.endswith(".dist-info") else name

    up = {key(n): v for n, v in _raw_entries(up_path).items()}
    ours = {key(n): v for n, v in _raw_entries(ours_path).items()}
    ours_only = {PROVENANCE_PATH}
    rewritten = changed | {VERSION_PY, "<dist-info>/METADATA", "<dist-info>/RECORD"}
    assert set(ours) == set(up) | ours_only
    same = set(up) - rewritten
    assert len(same) > 3000
    for name in sorted(same):
        (a, a_raw), (b, b_raw) = up[name], ours[name]
        assert (a.CRC, a.file_size, a.compress_size, a.compress_type, a_raw) == (
            b.CRC,
            b.file_size,
            b.compress_size,
            b.compress_type,
            b_raw,
        ), name
    with zipfile.ZipFile(ours_path) as zo, zipfile.ZipFile(up_path) as zu:
        for name in changed:  # our Python files are exactly the fork branch's
            assert (
                zo.read(name)
                == subprocess.run(
                    ["git", "show", f"{patched.head}:{name}"], cwd=patched.path, capture_output=True, check=True
                ).stdout
            )
            assert zo.read(name) != zu.read(name)
        meta_o = zo.read("vllm-0.20.1+dflash.1.dist-info/METADATA").decode().splitlines()
        meta_u = zu.read("vllm-0.20.1.dist-info/METADATA").decode().splitlines()
        assert [(a, b) for a, b in zip(meta_u, meta_o, strict=True) if a != b] == [
            ("Version: 0.20.1", "Version: 0.20.1+dflash.1")
        ]


def test_pip_installs_the_aarch64_wheel_for_aarch64_only(built: dict[str, WheelResult], tmp_path: Path) -> None:
    def pip_install(wheel: Path, target: Path) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--platform"]
        cmd += ["manylinux_2_35_aarch64", "--only-binary=:all:", "--target", str(target), str(wheel)]
        return subprocess.run(cmd, capture_output=True, text=True, env=ISOLATED_PIP, timeout=600)

    ok = pip_install(built["aarch64"].path, tmp_path / "arm")
    assert ok.returncode == 0, ok.stderr
    installed = tmp_path / "arm" / "vllm"
    assert json.loads((installed / "dflash_build.json").read_text())["version"] == "0.20.1+dflash.1"
    assert (tmp_path / "arm" / "vllm-0.20.1+dflash.1.dist-info" / "RECORD").is_file()
    no = pip_install(built["x86_64"].path, tmp_path / "x86")
    assert no.returncode != 0 and "is not a supported wheel on this platform" in no.stderr


# ---------------------------------------------------------------------------------------------------------------
# Making and verifying


def test_signed_release_layout_and_verify(
    signed: Release, keys: dict[str, Path], built: dict[str, WheelResult]
) -> None:
    d = signed.directory
    names = sorted(p.name for p in d.iterdir())
    assert names == list(signed.files)
    per_wheel = {".cdx.json", ".intoto.json", ".intoto.dsse.json", ".validation-gate-test.json"}
    expected = {layout.SUMS, layout.SUMS_ENVELOPE, layout.NOTES, layout.PUBLIC_KEY, layout.IMAGES}  # it names an image
    expected |= set(layout.DEPLOY_NAMES)  # and so carries the deployment manifests that pull it
    for w in built.values():
        expected |= {w.path.name} | {w.path.name + s for s in per_wheel}
    assert set(names) == expected
    assert [w.platform for w in signed.wheels] == ["aarch64", "x86_64"]
    for rw in signed.wheels:  # hard links, not copies, on one file system
        assert os.path.samefile(rw.path, built[rw.platform].path)
    # GNU sha256sum agrees with SHA256SUMS.
    check = subprocess.run(["sha256sum", "--strict", "-c", layout.SUMS], cwd=d, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == len(names) - 2

    result = verify(d, VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],)))
    assert result.signed and result.authenticated and result.key_id == signed.key_id and not result.partial
    assert set(result.files) == set(names)
    assert {(w.platform, w.sha256, tuple(r.profile for r in w.reports)) for w in result.wheels} == {
        (p, built[p].sha256, (PROFILE,)) for p in PLATFORMS
    }
    own = verify(
        d, VerifyOptions(profiles=PROFILES)
    )  # without a key: the release's own key, which proves integrity only
    assert own.signed and not own.authenticated
    line = refused(d, VerifyOptions(profiles=PROFILES, public_keys=(keys["other"],)))
    assert line.startswith(f"error: {layout.PUBLIC_KEY}: the release is signed with key {signed.key_id}")
    # One artifact of the release: its wheel's files and the shared ones.
    wheel = d / built["aarch64"].path.name
    part = verify(wheel, VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],)))
    assert part.partial and [w.platform for w in part.wheels] == ["aarch64"]
    assert verify(d / layout.sbom_name(wheel.name), VerifyOptions(profiles=PROFILES)).wheels == part.wheels


def test_unsigned_release(unsigned: Release, keys: dict[str, Path]) -> None:
    names = {p.name for p in unsigned.directory.iterdir()}
    assert not names & {layout.SUMS_ENVELOPE, layout.PUBLIC_KEY}
    assert not [n for n in names if n.endswith((layout.ENVELOPE_SUFFIX, ".json")) and layout.REPORT_INFIX in n]
    result = verify(unsigned.directory, VerifyOptions(profiles=PROFILES))
    assert not result.signed and result.key_id is None and len(result.wheels) == 2
    assert "not signed" in refused(unsigned.directory, VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],)))
    assert "not signed" in refused(unsigned.directory, VerifyOptions(profiles=PROFILES, require_signature=True))
    notes = (unsigned.directory / layout.NOTES).read_text()
    assert "No validation report is attached" in notes and "Not signed." in notes


# Every kind of file, altered by one bit, in a signed release; the message names the file that reveals it.
KINDS: dict[str, Callable[[dict[str, str]], str]] = {
    "wheel-x86_64": lambda w: w["x86_64"],
    "wheel-aarch64": lambda w: w["aarch64"],
    "sbom": lambda w: layout.sbom_name(w["x86_64"]),
    "statement": lambda w: layout.statement_name(w["aarch64"]),
    "envelope": lambda w: layout.envelope_name(w["x86_64"]),
    "report": lambda w: layout.report_name(w["aarch64"], PROFILE),
    "notes": lambda w: layout.NOTES,
    "public-key": lambda w: layout.PUBLIC_KEY,
    "sums": lambda w: layout.SUMS,
    "sums-envelope": lambda w: layout.SUMS_ENVELOPE,
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_any_altered_file_fails_verify(
    kind: str, signed: Release, keys: dict[str, Path], built: dict[str, WheelResult], tmp_path: Path
) -> None:
    names = {p: w.path.name for p, w in built.items()}
    target = KINDS[kind](names)
    d = copy_release(signed.directory, tmp_path / "rel")
    replace_bytes(d / target, flip_middle_byte)
    for options in (VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],)), VerifyOptions(profiles=PROFILES)):
        line = refused(d, options)
        if kind == "sums":  # malformed, or no longer what the envelope signs: either way SHA256SUMS is named
            assert line.startswith(f"error: {layout.SUMS}"), line
        elif kind == "public-key" and not options.public_keys:
            # The flipped byte gives either no key at all or another key (the keys are random): either is named.
            assert line.startswith((f"error: {layout.SUMS_ENVELOPE}: ", f"error: {layout.PUBLIC_KEY}: ")), line
        else:
            assert line.startswith(f"error: {target}: "), line


@pytest.mark.parametrize("kind", ["wheel-x86_64", "sbom", "statement", "notes", "sums"])
def test_any_altered_file_fails_verify_unsigned(
    kind: str, unsigned: Release, built: dict[str, WheelResult], tmp_path: Path
) -> None:
    target = KINDS[kind]({p: w.path.name for p, w in built.items()})
    d = copy_release(unsigned.directory, tmp_path / "rel")
    replace_bytes(d / target, flip_middle_byte)
    line = refused(d)
    assert line.startswith("error: ") and ("sha256" in line or "SHA256SUMS" in line), line


def _resum(d: Path) -> None:
    """Recompute SHA256SUMS after an alteration, as an attacker without the signing key could."""
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir() if p.name != layout.SUMS}
    digests.pop(layout.SUMS_ENVELOPE, None)
    (d / layout.SUMS).write_bytes(layout.format_sums(digests))


def test_coordinated_alterations_fail(
    unsigned: Release,
    signed: Release,
    built: dict[str, WheelResult],
    keys: dict[str, Path],
    checkout: Path,
    tmp_path: Path,
) -> None:
    x86 = built["x86_64"].path.name
    # SBOM content changed and SHA256SUMS recomputed: the SBOM no longer describes the wheel.
    d = copy_release(unsigned.directory, tmp_path / "a")
    replace_bytes(d / layout.sbom_name(x86), lambda b: b.replace(b'"torch==2.11.0"', b'"torch==2.12.0"'))
    _resum(d)
    assert refused(d).startswith(f"error: {layout.sbom_name(x86)}: ")
    # The statement's subject pointed at another digest (and its SHA256SUMS line updated).
    d = copy_release(unsigned.directory, tmp_path / "b")
    replace_bytes(d / layout.statement_name(x86), lambda b: b.replace(built["x86_64"].sha256.encode(), b"0" * 64))
    _resum(d)
    assert "its subject is" in refused(d)
    # A removed file, an extra file, a file of the other wheel swapped in.
    d = copy_release(unsigned.directory, tmp_path / "c")
    (d / layout.NOTES).unlink()
    assert refused(d) == f"error: {layout.NOTES}: listed in {layout.SUMS} but missing -- " + refused(d).split(" -- ")[1]
    d = copy_release(unsigned.directory, tmp_path / "d")
    (d / "install.sh").write_text("curl | sh\n")
    assert refused(d).startswith("error: install.sh: in the release directory but not in SHA256SUMS")
    d = copy_release(unsigned.directory, tmp_path / "e")
    arm = built["aarch64"].path.name
    shutil.copyfile(d / layout.sbom_name(arm), d / layout.sbom_name(x86))
    _resum(d)
    assert "names SHA-256" in refused(d)
    # A signed release altered and re-summed: SHA256SUMS's signature no longer holds, with or without the key.
    d = copy_release(signed.directory, tmp_path / "f")
    replace_bytes(d / layout.NOTES, lambda b: b + b"\nInstall from http://elsewhere.example\n")
    _resum(d)
    for options in (VerifyOptions(profiles=PROFILES), VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],))):
        assert refused(d, options).startswith(f"error: {layout.SUMS_ENVELOPE}: signs another")
    # Stripping every signature file makes it an unsigned release: that passes only when no signature is asked for.
    d = copy_release(signed.directory, tmp_path / "g")
    for p in d.iterdir():
        if p.name in (layout.PUBLIC_KEY, layout.SUMS_ENVELOPE) or p.name.endswith(layout.ENVELOPE_SUFFIX):
            p.unlink()
    _resum(d)
    assert "not signed" in refused(d, VerifyOptions(profiles=PROFILES, public_keys=(keys["public"],)))
    # A deployment manifest's serve argument edited (signatures stripped, SHA256SUMS recomputed): the manifests are
    # checked against dist.toml's deployment profile; one removed is missing; one naming another image is refused.
    h = copy_release(signed.directory, tmp_path / "h")
    for p in h.iterdir():
        if p.name in (layout.PUBLIC_KEY, layout.SUMS_ENVELOPE) or p.name.endswith(layout.ENVELOPE_SUFFIX):
            p.unlink()
    runtime = layout.DEPLOY_NAMES[1]
    replace_bytes(h / runtime, lambda b: b.replace(b"--max-model-len 16384", b"--max-model-len 131072"))
    _resum(h)
    real = {**PROFILES, **load_manifest(checkout).profiles}
    assert refused(h, VerifyOptions(profiles=real)).startswith(f"error: {runtime}: not what dist.toml's")
    replace_bytes(h / runtime, lambda b: b.replace(b"sha256:" + b"ab" * 32, b"sha256:" + b"cd" * 32))
    _resum(h)
    assert refused(h).startswith(f"error: {runtime}: does not pull")
    (h / runtime).unlink()
    _resum(h)
    assert refused(h).startswith(f"error: {runtime}: missing")
    assert "not signed" in refused(d, VerifyOptions(profiles=PROFILES, require_signature=True))
    assert not verify(d, VerifyOptions(profiles=PROFILES)).signed


# ---------------------------------------------------------------------------------------------------------------
# Schemas


def test_sbom_and_statement_validate_against_their_schemas(signed: Release, built: dict[str, WheelResult]) -> None:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    for w in signed.wheels:
        raw = w.sbom.read_bytes()
        assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(raw.decode()) is None
        doc = json.loads(raw)
        main = doc["metadata"]["component"]
        assert main["purl"] == "pkg:pypi/vllm@0.20.1%2Bdflash.1"
        assert main["hashes"] == [{"alg": "SHA-256", "content": w.sha256}]
        assert "timestamp" not in doc["metadata"] and doc["serialNumber"].startswith("urn:uuid:")
        by_line = {
            p["value"]: c
            for c in doc["components"]
            for p in c.get("properties", [])
            if p["name"].endswith("requires-dist")
        }
        torch = by_line["torch==2.11.0"]
        assert (torch["version"], torch["purl"], torch["scope"]) == ("2.11.0", "pkg:pypi/torch@2.11.0", "required")
        transformers = next(c for line, c in by_line.items() if line.startswith("transformers"))
        assert "version" not in transformers and transformers["purl"] == "pkg:pypi/transformers"  # a range
        spec = [p["value"] for p in transformers["properties"] if p["name"] == "vllm-dflash:version-specifier"]
        assert spec and SpecifierSet(spec[0]) == SpecifierSet(
            "!=5.0.*,!=5.1.*,!=5.2.*,!=5.3.*,!=5.4.*,!=5.5.0,>=4.56.0"
        )
        assert by_line['tensorizer==2.10.1; extra == "tensorizer"']["scope"] == "optional"
        assert len(by_line) == len(read_facts(w.path).requirements)
        ancestors = {a["bom-ref"]: a for a in main["pedigree"]["ancestors"]}
        assert set(ancestors) == {"upstream-wheel", "upstream-sdist"}

        st = w.statement.read_bytes()
        assert statement.schema_problem(st) is None
        stmt = json.loads(st)
        assert stmt["_type"] == "https://in-toto.io/Statement/v1"
        assert stmt["predicateType"] == "https://slsa.dev/provenance/v1"
        assert stmt["subject"] == [{"name": w.path.name, "digest": {"sha256": w.sha256}}]
        deps = stmt["predicate"]["buildDefinition"]["resolvedDependencies"]
        with zipfile.ZipFile(w.path) as z:  # one dependency per patch the wheel's own provenance names
            carried = len(json.loads(z.read("vllm/dflash_build.json"))["patches"])
        assert carried >= 1
        roles = ["upstream-sdist", "base-wheel", *["patch"] * carried, "tool"]
        assert [d["annotations"]["role"] for d in deps] == roles
        assert stmt["predicate"]["runDetails"]["builder"]["id"] == statement.DEFAULT_BUILDER_ID
        assert w.envelope is not None
        payload, sigs = open_envelope(w.envelope.read_bytes(), w.envelope.name, INTOTO_PAYLOAD_TYPE)
        assert payload == st and len(sigs) == 1


def test_schema_checks_refuse_malformed_documents(signed: Release) -> None:
    stmt = json.loads(signed.wheels[0].statement.read_bytes())

    def problem(change: Callable[[dict], None]) -> str | None:  # type: ignore[type-arg]
        doc = json.loads(json.dumps(stmt))
        change(doc)
        return statement.schema_problem(json.dumps(doc).encode())

    assert problem(lambda d: None) is None
    assert problem(lambda d: d.__setitem__("predicate_type", d.pop("predicateType")))  # proto name, not JSON name
    assert problem(lambda d: d["subject"][0].pop("digest"))
    assert problem(lambda d: d.__setitem__("_type", "https://in-toto.io/Statement/v0.1"))
    assert problem(lambda d: d.__setitem__("extra", 1))
    assert problem(lambda d: d["predicate"]["runDetails"]["builder"].pop("id"))
    assert problem(lambda d: d["predicate"]["buildDefinition"].__setitem__("resolvedDependencies", "x"))
    raw = json.loads(signed.wheels[0].sbom.read_bytes())
    raw["components"][0]["scope"] = "sometimes"
    assert sbom.schema_problem(json.dumps(raw).encode()) is not None


# ---------------------------------------------------------------------------------------------------------------
# Reproducibility, refusals, publish decisions


def test_reproducible(
    checkout: Path,
    built: dict[str, WheelResult],
    keys: dict[str, Path],
    reports: dict[str, Path],
    signed: Release,
    tmp_path: Path,
) -> None:
    manifest = load_manifest(checkout)
    options = ReleaseOptions(
        sign_key=keys["private"],
        reports=tuple(reversed(list(reports.values()))),  # order of inputs does not matter either
        images=(ImageRef("registry.example.com/ml/vllm-dflash", "sha256:" + "ab" * 32),),
        link=False,
    )
    again = make_release(manifest, [w.path for w in reversed(list(built.values()))], tmp_path / "again", options)
    assert again.files == signed.files
    for name in signed.files:
        assert (again.directory / name).read_bytes() == (signed.directory / name).read_bytes(), name
    # Re-running into the same directory replaces it in place, with the same bytes.
    before = {n: (signed.directory / n).read_bytes() for n in signed.files if not n.endswith(".whl")}
    rerun = make_release(manifest, [w.path for w in built.values()], again.directory, options)
    assert {n: (rerun.directory / n).read_bytes() for n in before} == before


def test_make_release_refusals(
    manifest: Manifest, checkout: Path, built: dict[str, WheelResult], tmp_path: Path, unsigned: Release
) -> None:
    wheels = [w.path for w in built.values()]
    with pytest.raises(VerifyError, match="are both x86_64 wheels"):
        make_release(manifest, [built["x86_64"].path, unsigned.wheels[1].path], tmp_path / "r1")
    other = make_report(checkout, "0" * 64, tmp_path / "other.json")
    with pytest.raises(VerifyError, match="which is none of the wheels"):
        make_release(load_manifest(checkout), wheels, tmp_path / "r2", ReleaseOptions(reports=(other,)))
    failed = make_report(checkout, built["x86_64"].sha256, tmp_path / "failed.json", accepted=10)
    with pytest.raises(VerifyError, match="did not pass"):
        make_release(load_manifest(checkout), wheels, tmp_path / "r3", ReleaseOptions(reports=(failed,)))
    (tmp_path / "r4").mkdir()
    (tmp_path / "r4" / "notes.txt").write_text("mine")
    with pytest.raises(StorageError, match="not part of this release"):
        make_release(manifest, wheels, tmp_path / "r4")
    assert [p.name for p in (tmp_path / "r4").iterdir()] == ["notes.txt"]
    with pytest.raises(ProvenanceError, match=r"carries no vllm/dflash_build\.json"):
        make_release(manifest, [fetch(manifest.wheels["x86_64"])], tmp_path / "r5")  # upstream's own wheel


def test_publish_plan(
    checkout: Path, built: dict[str, WheelResult], reports: dict[str, Path], signed: Release, tmp_path: Path
) -> None:
    manifest = load_manifest(checkout)
    plan = publish_plan(signed.directory, manifest)
    assert [(d.platform, d.publishable, d.profile) for d in plan.decisions] == [
        ("aarch64", True, PROFILE),
        ("x86_64", True, PROFILE),
    ]
    plan.require_all()
    assert {p.name for p in plan.files} == set(signed.files)
    # Only x86_64 validated: aarch64 is refused by name, not skipped.
    half = make_release(
        manifest, [w.path for w in built.values()], tmp_path / "half", ReleaseOptions(reports=(reports["x86_64"],))
    )
    plan = publish_plan(half.directory, manifest)
    assert [(d.platform, d.publishable) for d in plan.decisions] == [("aarch64", False), ("x86_64", True)]
    with pytest.raises(PublishRefusedError) as info:
        plan.require_all()
    assert info.value.return_code == 12 and info.value.message.startswith("aarch64: no validation report")
    # A release without the aarch64 wheel at all.
    one = make_release(manifest, [built["x86_64"].path], tmp_path / "one", ReleaseOptions(reports=(reports["x86_64"],)))
    assert publish_plan(one.directory, manifest).refused[0].refusal == "the release has no wheel for it"


def test_sbom_timestamp_only_when_given(manifest: Manifest, signed: Release) -> None:
    from datetime import UTC, datetime

    from vllm_dflash.release import source_material

    facts = read_facts(signed.wheels[0].path)
    source = source_material(manifest, facts)
    when = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    stamped = sbom.build_sbom(facts, source, when)
    assert stamped == sbom.build_sbom(facts, source, when)
    assert json.loads(stamped)["metadata"]["timestamp"].startswith("2026-11-29T12:00:00")
    assert sbom.schema_problem(stamped) is None
    assert stamped != signed.wheels[0].sbom.read_bytes()  # and its serial differs: the content does
    sbom.check_sbom(stamped, facts, "stamped")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_signatures_check_out_with_openssl(signed: Release, keys: dict[str, Path], tmp_path: Path) -> None:
    """An independent implementation agrees: DSSE v1 PAE, Ed25519, keyid = sha256 of the DER public key."""
    import base64

    der = subprocess.run(
        ["openssl", "pkey", "-pubin", "-in", str(keys["public"]), "-outform", "DER"], capture_output=True, check=True
    ).stdout
    assert hashlib.sha256(der).hexdigest() == signed.key_id
    for env_path in [w.envelope for w in signed.wheels] + [signed.directory / layout.SUMS_ENVELOPE]:
        assert env_path is not None
        env = json.loads(env_path.read_bytes())
        body, ptype = base64.b64decode(env["payload"]), env["payloadType"].encode()
        (tmp_path / "pae").write_bytes(b"DSSEv1 %d %s %d %s" % (len(ptype), ptype, len(body), body))
        (tmp_path / "sig").write_bytes(base64.b64decode(env["signatures"][0]["sig"]))
        assert env["signatures"][0]["keyid"] == signed.key_id
        cmd = ["openssl", "pkeyutl", "-verify", "-pubin", "-inkey", str(keys["public"]), "-rawin"]
        cmd += ["-in", str(tmp_path / "pae"), "-sigfile", str(tmp_path / "sig")]
        ok = subprocess.run(cmd, capture_output=True, text=True)
        assert ok.returncode == 0 and "Signature Verified Successfully" in ok.stdout, ok.stdout + ok.stderr


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vllm_dflash", "--root", str(root), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)


def test_cli_release_verify_and_publish_the_whole_release(
    checkout: Path, built: dict[str, WheelResult], keys: dict[str, Path], reports: dict[str, Path], tmp_path: Path
) -> None:
    """Through the CLI: `release` writes the directory, `verify` passes it and fails (one line, exit 17) once a file
    is altered, `publish DIR` refuses a release with a platform unvalidated and publishes one with every platform."""
    wheels = [str(w.path) for w in built.values()]
    rel = tmp_path / "rel"
    made = _cli(checkout, "release", *wheels, "--out", str(rel), "--sign-key", str(keys["private"]),
                *(a for r in reports.values() for a in ("--report", str(r))))  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    ok = _cli(checkout, "verify", str(rel), "--key", str(keys["public"]))
    assert ok.returncode == 0 and "verified" in ok.stdout, ok.stderr[-2000:]

    half = tmp_path / "half"
    assert _cli(checkout, "release", *wheels, "--out", str(half), "--report", str(reports["x86_64"])).returncode == 0
    refused = _cli(checkout, "publish", str(half), "--to", str(tmp_path / "index"))
    assert refused.returncode == PublishRefusedError.return_code
    errors = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "aarch64: no validation report" in errors[0], refused.stderr
    assert not (tmp_path / "index").exists()

    done = _cli(checkout, "publish", str(rel), "--to", str(tmp_path / "index"))
    assert done.returncode == 0, done.stderr[-2000:]
    simple = tmp_path / "index" / "simple" / "vllm"
    assert {p.name for p in simple.glob("*.whl")} == {w.path.name for w in built.values()}
    files = tmp_path / "index" / "releases" / next(iter(built.values())).provenance.version
    assert (files / layout.SUMS).is_file() and (files / layout.NOTES).is_file()
    # The published release still verifies where it landed (wheels next to the rest).
    for w in built.values():
        os.link(simple / w.path.name, files / w.path.name)
    assert _cli(checkout, "verify", str(files), "--key", str(keys["public"])).returncode == 0

    sbom = next(rel.glob("*.cdx.json"))
    replace_bytes(sbom, flip_middle_byte)
    bad = _cli(checkout, "verify", str(rel), "--key", str(keys["public"]))
    errors = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert bad.returncode == 17 and len(errors) == 1 and "Traceback" not in bad.stderr, bad.stderr
