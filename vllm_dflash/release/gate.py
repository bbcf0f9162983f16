"""What `publish` may publish of a release: per platform, the wheel and the report that lets it through.

The release must verify first. Then every platform asked for (default: every platform dist.toml pins an upstream
wheel for) needs a wheel in the release and an attached report that passes publish's own gate for that wheel
(sealed, verdict pass, names the wheel's sha256, a required profile with today's definition). A platform without
one is refused, never silently left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dflash.errors import DflashError, PublishRefusedError
from vllm_dflash.manifest import Manifest
from vllm_dflash.release import layout
from vllm_dflash.release.verify import VerifyOptions, VerifyResult, verify


@dataclass(frozen=True)
class PlatformDecision:
    platform: str
    wheel: Path | None
    sha256: str | None
    report: Path | None  # the report that passed the gate
    profile: str | None
    refusal: str | None  # why not, when refused

    @property
    def publishable(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True)
class PublishPlan:
    release: VerifyResult
    decisions: tuple[PlatformDecision, ...]
    files: tuple[Path, ...]  # every file of the release, to publish together

    @property
    def refused(self) -> tuple[PlatformDecision, ...]:
        return tuple(d for d in self.decisions if not d.publishable)

    def require_all(self) -> None:
        """PublishRefusedError (exit 12, one line) unless every platform has a passing report for its wheel."""
        if self.refused:
            raise PublishRefusedError(
                "; ".join(f"{d.platform}: {d.refusal}" for d in self.refused),
                "validate each platform's wheel on a GPU node of that platform and make the release with its report",
            )


def publish_plan(
    release_dir: Path,
    manifest: Manifest,
    platforms: Sequence[str] | None = None,
    options: VerifyOptions | None = None,
) -> PublishPlan:
    """Verify the release (VerifyError, exit 17, when it does not), then decide per platform.

    `options` default: no signature required, reports checked with $VLLM_DFLASH_REPORT_KEY when set (as publish).
    """
    from vllm_dflash.publish import ArtifactId, check_gate
    from vllm_dflash.report import key_from_env

    result = verify(release_dir, options or VerifyOptions(report_key=key_from_env()))
    if result.partial:
        raise PublishRefusedError(f"{release_dir} is one artifact, not a release directory", "pass the directory")
    wanted = tuple(platforms) if platforms is not None else tuple(sorted(manifest.wheels))
    by_platform = {w.platform: w for w in result.wheels}
    decisions: list[PlatformDecision] = []
    for plat in wanted:
        w = by_platform.get(plat)
        if w is None:
            decisions.append(PlatformDecision(plat, None, None, None, None, "the release has no wheel for it"))
            continue
        path = release_dir / w.filename
        ident = ArtifactId(kind="wheel", name=w.filename, sha256=w.sha256, path=path)
        reasons: list[str] = []
        chosen: PlatformDecision | None = None
        for rep in w.reports:
            try:
                passed = check_gate(release_dir / rep.name, ident, manifest)
            except DflashError as exc:
                reasons.append(f"{rep.name}: {exc.message}")
                continue
            chosen = PlatformDecision(plat, path, w.sha256, release_dir / rep.name, passed.profile_name, None)
            break
        if chosen is None:
            why = "; ".join(reasons) if reasons else f"no validation report for {w.filename} is attached"
            chosen = PlatformDecision(plat, path, w.sha256, None, None, why)
        decisions.append(chosen)
    files = tuple(release_dir / n for n in sorted(set(result.files) | {layout.SUMS}))
    return PublishPlan(release=result, decisions=tuple(decisions), files=files)
