"""RELEASE-NOTES.md: what upstream, which patches, which components the wheels require, how they were validated,
and how to install them by hash or digest. Every fact comes from the wheels, the reports and the source material;
nothing is dated, so the same inputs give the same text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_dflash.oci import repository_problem
from vllm_dflash.release import layout
from vllm_dflash.release.facts import Requirement, SourceMaterial, WheelFacts
from vllm_dflash.report import ValidationReport
from vllm_dflash.validate.verdict import Rejudged

# Shown first, when the wheel requires them: what decides whether it runs on a given GPU stack.
KEY_COMPONENTS = (
    "torch",
    "torchvision",
    "torchaudio",
    "transformers",
    "tokenizers",
    "flashinfer-python",
    "flashinfer-cubin",
    "xformers",
    "triton",
    "xgrammar",
    "compressed-tensors",
    "numba",
    "apache-tvm-ffi",
    "nvidia-cutlass-dsl",
    "nvidia-cudnn-frontend",
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ImageRef:
    """A container image of this release, by repository and registry digest (`docker pull repo@digest`)."""

    repository: str  # e.g. registry.example.com/ml/vllm-dflash
    digest: str  # sha256:<64 hex>
    platform: str | None = None  # None: a multi-platform index

    def __post_init__(self) -> None:
        if not _DIGEST.match(self.digest):
            raise ValueError(f"image digest {self.digest!r} is not sha256:<64 hex>")
        problem = repository_problem(self.repository)
        if problem is not None:  # what a container tool pushes and pulls: never an option, a space or a digest
            raise ValueError(f"image repository {self.repository[:120]!r} {problem}")


@dataclass(frozen=True)
class AttachedReport:
    name: str  # file name in the release
    wheel: str
    report: ValidationReport
    judged: Rejudged  # what its evidence gives under the manifest's profile: the notes print this, not its words


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def _requirement_text(r: Requirement) -> str:
    return f"`{r.name}{'[' + ','.join(r.extras) + ']' if r.extras else ''}{r.specifier or ' (any)'}`"


def _components(wheels: Sequence[WheelFacts]) -> list[str]:
    lines: list[str] = ["## Components the wheel requires", ""]
    first = wheels[0]
    same = all([r.line for r in w.requirements] == [r.line for r in first.requirements] for w in wheels)
    groups: list[tuple[str, WheelFacts]] = [("", first)] if same else [(f" ({w.platform})", w) for w in wheels]
    lines.append(
        "From the wheel's own METADATA (`Requires-Dist`), as ranges or pins exactly as written; "
        "`pip install --no-deps` installs none of them, so your environment must satisfy them."
    )
    lines.append("")
    for label, w in groups:
        base = [r for r in w.requirements if not r.for_extra]
        by_name = {r.canonical: r for r in base}
        key = [by_name[n] for n in KEY_COMPONENTS if n in by_name]
        if w.requires_python:
            lines.append(f"- Python{label}: `{w.requires_python}`")
        for r in key:
            marker = f" (when {r.marker})" if r.marker else ""
            lines.append(f"- {_requirement_text(r)}{label}{marker}")
        lines.append("")
        lines.append(f"<details><summary>All {len(w.requirements)} Requires-Dist lines{label}</summary>")
        lines.append("")
        lines.append("```")
        lines.extend(r.line for r in w.requirements)
        lines.append("```")
        lines.append("")
        lines.append("</details>")
        lines.append("")
    return lines


def _gates(judged: Rejudged) -> str:
    parts = []
    for g in judged.gates:
        value = f"{g.value:.2f}" if g.value is not None else "?"
        threshold = f"{g.threshold:.2f}" if g.threshold is not None else "?"
        parts.append(f"{g.gate}: {value} vs {threshold} {'pass' if g.passed else 'FAIL'}")
    return "; ".join(parts) or "-"


def _prompts(rep: ValidationReport) -> str:
    p = rep.prompts
    return f"{p.get('set')} x {p.get('count')}" if p else "?"


def release_notes(
    wheels: Sequence[WheelFacts],
    source: SourceMaterial,
    reports: Sequence[AttachedReport] = (),
    images: Sequence[ImageRef] = (),
    signed_by: str | None = None,
    index_url: str | None = None,
) -> str:
    """The release notes (Markdown). `wheels` share one version, upstream and patch queue (make_release checks)."""
    wheels = sorted(wheels, key=lambda w: w.platform)
    first = wheels[0]
    p = first.provenance
    up = p.upstream
    out: list[str] = [f"# {first.name} {first.version} (vllm-dflash)", ""]
    out.append(
        f"vLLM {up.version} (tag `{up.tag}`, commit `{up.commit}`) with the vllm-dflash patch queue "
        f"({len(p.patches)} patch{'es' if len(p.patches) != 1 else ''}), built by {p.build.tool} "
        f"{p.build.tool_version} ({p.build.mode} build: {_cell(p.build.mode_reason)}), for "
        f"{', '.join(w.platform for w in wheels)}."
    )
    out += ["", "## Files", "", "| platform | wheel | sha256 | size |", "| --- | --- | --- | --- |"]
    for w in wheels:
        out.append(f"| {w.platform} | `{w.filename}` | `{w.sha256}` | {w.size / 1e6:.1f} MB |")
    out += [
        "",
        f"Each wheel comes with `<wheel>{layout.SBOM_SUFFIX}` (CycloneDX 1.6 SBOM) and "
        f"`<wheel>{layout.STATEMENT_SUFFIX}` (in-toto Statement v1 with SLSA provenance v1). "
        f"`{layout.SUMS}` lists the sha256 of every file (`sha256sum -c {layout.SUMS}`).",
    ]
    if signed_by:
        out.append(
            f"Signed with Ed25519 key `{signed_by}` (sha256 of the DER public key, `{layout.PUBLIC_KEY}`): "
            f"DSSE envelopes `<wheel>{layout.ENVELOPE_SUFFIX}` over each statement and `{layout.SUMS_ENVELOPE}` "
            f"over `{layout.SUMS}`. Get the public key from the publisher, not from the release, to authenticate it."
        )
    else:
        out.append("Not signed.")
    out += ["", "Check everything with `vllm-dflash verify <release dir> [--key <public key>]`.", ""]

    out += ["## Upstream", ""]
    out.append(f"- vLLM {up.version}, tag `{up.tag}`, commit `{up.commit}` ({up.git_url})")
    if source.kind == "sdist":
        out.append(f"- source: PyPI sdist `{source.filename}`, sha256 `{source.sha256}`")
    else:
        out.append(f"- source: git `{source.git_url}` at `{source.commit}`")
    for w in wheels:
        b = w.provenance.build
        if b.base_wheel:
            out.append(f"- {w.platform} base wheel: `{b.base_wheel}`, sha256 `{b.base_wheel_sha256}`")
    out.append("")

    out += ["## Patches", ""]
    if p.patches:
        out += ["| # | patch | description | drop when | sha256 |", "| --- | --- | --- | --- | --- |"]
        for i, rec in enumerate(p.patches, 1):
            description = rec.description or rec.subject  # DEP-3: Description's first line, or Subject
            out.append(f"| {i} | `{rec.name}` | {_cell(description)} | {_cell(rec.drop_when)} | `{rec.sha256[:16]}…` |")
    else:
        out.append("None: this is upstream vLLM under our version.")
    out.append("")

    out += _components(wheels)

    out += ["## Validation", ""]
    if reports:
        out += [
            "| platform | profile | AL | gates | prompts | binding | verdict | report |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        platform_of = {w.filename: w.platform for w in wheels}
        for a in sorted(reports, key=lambda a: (platform_of[a.wheel], a.name)):
            al = a.judged.acceptance_length
            out.append(
                f"| {platform_of[a.wheel]} | {_cell(a.report.profile_name)} | {f'{al:.2f}' if al is not None else '?'} "
                f"| {_cell(_gates(a.judged))} | {_cell(_prompts(a.report))} | {_cell(a.report.binding)} "
                f"| {a.judged.verdict} | `{a.name}` |"
            )
        missing = [w.platform for w in wheels if not any(a.wheel == w.filename for a in reports)]
        if missing:
            out += ["", f"Not validated: {', '.join(missing)} (publishing refuses these)."]
    else:
        out.append("No validation report is attached: this release is not validated and `publish` refuses it.")
    out.append("")

    out += ["## Install", ""]
    out.append(
        "Over the vLLM it replaces (same upstream version, its dependencies already installed), verified by hash:"
    )
    out += ["", "```bash", f"sha256sum -c {layout.SUMS}   # in the release directory"]
    for w in wheels:
        out.append(f"pip install --no-deps ./{w.filename}   # {w.platform}")
    out += ["```", "", "From an index, hash-checked (pip picks the wheel for the machine):", "", "```bash"]
    hashes = " \\\n    ".join(f"--hash=sha256:{w.sha256}" for w in wheels)
    out.append(f"cat > vllm-dflash-requirements.txt <<'EOF'\n{first.name}=={first.version} \\\n    {hashes}\nEOF")
    out.append(
        f"pip install --no-deps --require-hashes --index-url {index_url or '<your index>/simple'} "
        "-r vllm-dflash-requirements.txt"
    )
    out.append("```")
    out.append("")
    if images:
        out += ["Container image, by digest:", "", "```bash"]
        for img in sorted(images, key=lambda i: (i.platform or "", i.repository)):
            out.append(f"docker pull {img.repository}@{img.digest}   # {img.platform or 'all platforms'}")
        img = sorted(images, key=lambda i: (i.platform or "", i.repository))[0]
        out.append(f"docker run --gpus all -p 8000:8000 {img.repository}@{img.digest} <model> [vllm serve options]")
        out += ["```", ""]
    else:
        out += ["No container image is part of this release.", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def sha256s_named(text: str) -> set[str]:
    """Every 64-hex string in the notes (verify checks each wheel's sha256 is among them)."""
    return set(re.findall(r"\b[0-9a-f]{64}\b", text))
