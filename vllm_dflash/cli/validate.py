"""`validate`: the acceptance smoke test."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from vllm_dflash.cli.common import add_pin_argument, checkout, manifest
from vllm_dflash.errors import ManifestError, MeasurementError
from vllm_dflash.manifest import Profile, load_profile_file
from vllm_dflash.oci import check_image_ref
from vllm_dflash.paths import check_output_file
from vllm_dflash.validate.server import check_url
from vllm_dflash.validate.smoke import ServerChoice, load_prompts, validate

MAX_PROMPTS = 100_000  # more than any prompt set holds: a larger count is a typo
MAX_HEALTH_TIMEOUT_S = 7 * 86400.0


def count_option(text: str) -> int:
    """An integer 1..MAX_PROMPTS, refused at parse time otherwise (argparse prints the line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= MAX_PROMPTS:
        raise argparse.ArgumentTypeError(f"{value} is not within 1..{MAX_PROMPTS}")
    return value


def seconds_option(text: str) -> float:
    """A finite number of seconds > 0 and at most a week (NaN, inf, negative, absurd: refused at parse time)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 0 < value <= MAX_HEALTH_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds within (0, {MAX_HEALTH_TIMEOUT_S:g}]")
    return value


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "validate",
        help="acceptance smoke test: serve a profile, measure the drafter's acceptance length, write a report",
        description="Exit 0: all gates passed; 1: a gate failed; 2: acceptance could not be measured.",
    )
    p.add_argument("--profile", required=True, help="profile name ([profiles.NAME] in dist.toml)")
    p.add_argument("--profile-file", type=Path, default=None, help="TOML with [profiles.NAME] tables instead")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", default=None, help="use a running server at this URL (never stopped)")
    where.add_argument("--image", default=None, help="launch this container image (docker run --gpus all ...)")
    where.add_argument(
        "--python",
        type=Path,
        default=None,
        help="launch `vllm serve` from this Python's environment (default: the one running vllm-dflash)",
    )
    p.add_argument("--wheel", type=Path, default=None, help="the vLLM wheel being validated (named in the report)")
    p.add_argument("--container-tool", default="docker", help="docker or podman (default: docker)")
    p.add_argument("--gpus", default="all", help="value of --gpus for the container (empty: none)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None, help="also run without spec")
    p.add_argument("--baseline-endpoint", default=None, help="with --endpoint: a no-speculation server to compare")
    p.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="URL",
        help="with --endpoint (a router): one replica behind it (its base URL or its /metrics), once per replica; "
        "their counters are read and added up, and must account for every request sent",
    )
    p.add_argument("--prompts", default=None, help="override the profile's prompt set (name or JSONL path)")
    p.add_argument(
        "--num-prompts",
        type=count_option,
        default=None,
        help="use only the first N prompts (fewer than the profile's minimum: an exploratory, unpublishable report)",
    )
    p.add_argument("--health-timeout", type=seconds_option, default=None, help="seconds to wait for /health")
    p.add_argument("--report", type=Path, default=None, help="report path (default: validation-PROFILE.json)")
    p.add_argument("--log-dir", type=Path, default=None, help="where the launched server's log goes")
    p.add_argument("--quiet", action="store_true", help="no table and progress, only the verdict line")
    add_pin_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.profile_file is not None:
        profiles = load_profile_file(args.profile_file)
    else:
        profiles = dict(manifest(args).profiles)
    if args.profile not in profiles:
        raise ManifestError(f"no profile '{args.profile}'", f"choose one of {sorted(profiles)}")
    profile = profiles[args.profile]
    for attr, flag in (("endpoint", "--endpoint"), ("baseline_endpoint", "--baseline-endpoint")):
        if getattr(args, attr) is not None:
            url, note = check_url(getattr(args, attr), flag)
            if note:
                print(f"note: {note}", file=sys.stderr)
            setattr(args, attr, url)
    args.metrics = _replicas(args)
    if args.image is not None:
        check_image_ref(args.image, "--image", MeasurementError)
    report_path = args.report or Path(f"validation-{profile.name}.json")
    # Before anything runs (the measurement may take an hour): a place the report can be written.
    check_output_file(report_path, "--report", probe=True)
    if args.wheel is not None:
        if not args.wheel.is_file():
            raise MeasurementError(f"--wheel {args.wheel} does not exist", "pass the wheel file the server runs")
        _check_wheel_name(args.wheel)
    if profile.serve == "cpu-builds":
        return _run_cpu_builds(args, profile)
    prompts = load_prompts(args.prompts or profile.prompts, args.num_prompts or profile.num_prompts)
    choice = ServerChoice(
        endpoint=args.endpoint,
        python=args.python,
        image=args.image,
        wheel=args.wheel,
        container_tool=args.container_tool,
        gpus=args.gpus,
        baseline_endpoint=args.baseline_endpoint,
        replicas=tuple(args.metrics),
        health_timeout_s=args.health_timeout,
        log_dir=args.log_dir,
    )
    if args.endpoint and args.baseline and not args.baseline_endpoint:
        print("warning: --baseline with --endpoint needs --baseline-endpoint URL; no baseline run", file=sys.stderr)
    try:
        result = validate(
            profile, choice, report_path, prompts, args.baseline, show=not args.quiet, prompt_set=args.prompts
        )
    except MeasurementError:
        print(f"report: {report_path} (verdict: error)", file=sys.stderr)
        raise
    print(f"verdict: {_verdict(result.report)}; report: {result.report_path}", flush=True)
    return result.exit_code


def _replicas(args: argparse.Namespace) -> list[str]:
    """--metrics: each replica's base URL (a trailing /metrics dropped), checked, each named once; only with
    --endpoint (a server validate starts has no replicas)."""
    if args.metrics and args.endpoint is None:
        raise MeasurementError("--metrics names the replicas behind --endpoint", "pass --endpoint ROUTER_URL too")
    seen: list[str] = []
    for given in args.metrics:
        text = given.rstrip("/")
        url, _ = check_url(text.removesuffix("/metrics") if text.endswith("/metrics") else text, "--metrics")
        if url in seen:
            raise MeasurementError(
                f"--metrics {url} is given twice: its counters would be counted twice", "name each replica once"
            )
        seen.append(url)
    return seen


def _verdict(report: Any) -> str:
    """The closing line's verdict, with the drafts-cut warning and why a report is not publishable."""
    if report.get("drafts_cut"):
        print(f"warning: {report['drafts_cut']}", file=sys.stderr, flush=True)
    said = f"{report['verdict']} (AL {report['acceptance']['mean_acceptance_length']:.3f})"
    if report.get("exploratory"):
        said += f" -- exploratory, not publishable: {report['exploratory']}"
    return said


def _check_wheel_name(wheel: Path) -> None:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        parse_wheel_filename(wheel.name)
    except InvalidWheelFilename:
        raise MeasurementError(f"--wheel {wheel} is not a wheel file name", "pass the .whl the server runs") from None


def _run_cpu_builds(args: argparse.Namespace, profile: Profile) -> int:
    """A profile served from our own CPU builds (the miniature): the tool builds, trains and serves everything."""
    from vllm_dflash.validate import miniature

    for flag, value in (("--image", args.image), ("--python", args.python)):
        if value is not None:
            raise ManifestError(
                f"profile '{profile.name}' serves the tool's own CPU builds; {flag} does not apply",
                "drop it (pass --wheel to validate another CPU build of the pin, --endpoint for one served elsewhere)",
            )
    if args.prompts is not None:
        raise ManifestError(f"profile '{profile.name}' uses the miniature's held-apart prompts", "drop --prompts")
    if args.num_prompts is not None and args.endpoint is None:
        raise ManifestError(
            f"profile '{profile.name}' serves the miniature's whole prompt set from its own builds",
            "drop --num-prompts (it applies to --endpoint: a served miniature checked on fewer prompts)",
        )
    co = checkout(args)
    report_path = args.report or Path(f"validation-{profile.name}.json")
    if args.endpoint is not None:
        return _run_served_miniature(args, profile, co, report_path)
    run = miniature.prepare(co.manifest, co.queues, profile, args.wheel, args.log_dir, args.health_timeout)
    print(f"validating {run.wheel.name} (stock build to compare: {run.stock_wheel.name})", flush=True)
    try:
        result = validate(
            run.profile,
            run.choice,
            report_path,
            run.prompts,
            baseline=args.baseline,  # None: the profile's own choice (a no-speculation run of the validated build)
            show=not args.quiet,
            prompt_set=run.prompt_set,
            comparisons=run.comparisons,
            reference=run.reference,
        )
    except MeasurementError:
        print(f"report: {report_path} (verdict: error)", file=sys.stderr)
        raise
    print(miniature.closing_note(result.report, run.conditions), flush=True)
    for name, path in result.comparison_reports.items():
        wheel = run.stock_wheel if name == "stock" else None
        print(
            f"{name} build's own report (same prompts, same gates): {path}" + (f"; its wheel: {wheel}" if wheel else "")
        )
    print(f"verdict: {_verdict(result.report)}; report: {result.report_path}; validated wheel: {run.wheel}", flush=True)
    return result.exit_code


def _run_served_miniature(args: argparse.Namespace, profile: Profile, co: Any, report_path: Path) -> int:
    """The miniature served elsewhere (e.g. the CPU twin image in a container, or replicas behind a router): the
    same prompts, reference loop and gates as the profile's own run, on what the endpoint serves (its model is the
    profile's served name, `mini`). No stock build is served to compare; with --num-prompts the report is
    exploratory."""
    from vllm_dflash.validate import miniature

    run = miniature.prepare_endpoint(
        co.manifest, profile, args.endpoint, args.wheel, tuple(args.metrics), args.num_prompts, args.health_timeout
    )
    print(f"validating the miniature served at {args.endpoint}", flush=True)
    try:
        result = validate(
            run.profile,
            run.choice,
            report_path,
            run.prompts,
            baseline=False,
            show=not args.quiet,
            prompt_set="@mini",
            reference=run.reference,
            full_count=run.full_count,
        )
    except MeasurementError:
        print(f"report: {report_path} (verdict: error)", file=sys.stderr)
        raise
    print(miniature.closing_note(result.report, run.conditions), flush=True)
    for row in result.report.get("replicas") or []:
        c = row["counters"]
        said = f"{c['num_drafts']:g} drafts, {c['num_accepted_tokens']:g} accepted"
        print(f"replica {row['metrics']}: {said}", flush=True)
    print(f"verdict: {_verdict(result.report)}; report: {result.report_path}", flush=True)
    return result.exit_code
