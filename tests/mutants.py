"""Hand-picked mutants of the decision lines of issue 26's items 1-5 (report rules, the verdict judged again, the
wheel reader, bindings, the index transaction, the publish gate): each flips a comparison, drops a check or returns
early; the quick tests that cover those modules must kill every one.

    python tests/mutants.py [--only SUBSTRING]      (run from the checkout; restores every file it touches)

Each mutant is applied alone, the tests run with -x (a kill stops at the first failure), and the file is put back
whatever happens. Prints killed/total per file and every survivor. A helper of the test suite, not a test itself.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_report_rules.py",
    "tests/test_wheel_identity.py",
    "tests/test_metrics.py",
    "tests/test_bindings.py",
    "tests/test_reseal.py",
    "tests/test_index_concurrency.py",
    "tests/test_publish.py",
    "tests/test_gate.py",
]
# Files whose decisions other quick tests cover: their mutants run those tests instead of TESTS.
TESTS_FOR: dict[str, list[str]] = {
    "vllm_dflash/conformance/compare.py": ["tests/test_conformance.py"],
    "vllm_dflash/doctor/checkpoint.py": ["tests/test_doctor.py"],
    "vllm_dflash/doctor/vllm_side.py": ["tests/test_doctor_sides.py"],
    "vllm_dflash/doctor/sides.py": ["tests/test_doctor_sides.py"],
    "vllm_dflash/doctor/fields.py": ["tests/test_doctor_sides.py"],
    "vllm_dflash/proc.py": ["tests/test_proc.py"],
    "vllm_dflash/upstream/ablation.py": ["tests/test_ablation.py"],
    "vllm_dflash/upstream/matrix.py": ["tests/test_pins.py"],
    "vllm_dflash/conformance/cases.py": ["tests/test_ablation.py", "tests/test_conformance.py"],
}
R, V, W, S, IX, P, M = (
    "vllm_dflash/report.py",
    "vllm_dflash/validate/verdict.py",
    "vllm_dflash/pipeline/wheelfile.py",
    "vllm_dflash/validate/server.py",
    "vllm_dflash/simple_index.py",
    "vllm_dflash/publish.py",
    "vllm_dflash/validate/metrics.py",
)
K = "vllm_dflash/conformance/compare.py"
MUTANTS: list[tuple[str, str, str]] = [
    # report.py: strict JSON and the counts
    (R, "        if key in out:\n", "        if False:\n"),
    (R, "not math.isfinite(value) or value < 0:", "not math.isfinite(value) or value < -1:"),
    (R, "    if value > MAX_COUNT:", "    if value >= MAX_COUNT:"),
    (R, "    if value > MAX_COUNT:", "    if value > MAX_COUNT * 2:"),
    (R, "if isinstance(value, float) and not value.is_integer():", "if False:"),
    (R, "or len(label) > MAX_POSITION_DIGITS:", "or len(label) >= MAX_POSITION_DIGITS:"),
    (R, "or len(label) > MAX_POSITION_DIGITS:", "or False:"),
    (R, 'or (label != "0" and label.startswith("0"))', ""),
    (R, "not (label.isascii() and label.isdigit())", "not label.isdigit()"),
    (R, "    return method in PER_POSITION_METHODS", "    return False"),
    (R, "    if drafts == 0:\n        return", "    if drafts < 0:\n        return"),
    (R, "    if accepted > draft_tokens:", "    if accepted >= draft_tokens:"),
    (R, "    if accepted > draft_tokens:", "    if accepted > draft_tokens + 1:"),
    (R, "    if draft_tokens > drafts * k:", "    if draft_tokens >= drafts * k:"),
    (R, "    if draft_tokens > drafts * k:", "    if draft_tokens > drafts * k + 1:"),
    (R, "    if require_per_position and not per_position:", "    if False:"),
    (R, "if not 0 <= p < k]", "if not 0 <= p <= k]"),
    (R, "if not 0 <= p < k]", "if not p < k]"),
    (R, "            if count > drafts:", "            if count >= drafts:"),
    (R, "            if p and count > ordered[p - 1]:", "            if p and count >= ordered[p - 1]:"),
    (R, "            if p and count > ordered[p - 1]:", "            if p > 1 and count > ordered[p - 1]:"),
    (R, "        if sum(ordered) != accepted:", "        if False:"),
    (R, "    if set(found) != names:", "    if False:"),
    (R, "        if pos is None:\n", "        if pos is None and False:\n"),
    (R, '        problem = count_value_problem(f"{where}.{PER_POSITION}[{label}]", value)', "        problem = None"),
    (
        R,
        '        if a < b:\n            return f"{_DOWN} {name}',
        '        if False:\n            return f"{_DOWN} {name}',
    ),
    (R, "        if a - b != d:", "        if False:"),
    (R, "    if set(delta.per_position) != positions:", "    if False:"),
    (R, "        if a - b != delta.per_position[p]:", "        if False:"),
    (R, "not isinstance(k, int) or k < 1:", "not isinstance(k, int) or k < 0:"),
    (R, 'if data.get("verdict") not in ("pass", "fail"):\n        return None', "if False:\n        return None"),
    (R, "not isinstance(al, int | float) or al != want:", "not isinstance(al, int | float):"),
    (R, 'g.get("gate") == "min_acceptance_length" and g.get("value") != al:', "False:"),
    (R, "    problem = measurement_problem(data)\n    if problem is not None:", "    problem = None\n    if problem:"),
    # validate/metrics.py: the scrape
    (M, "            if new < old:", "            if False:"),
    (
        M,
        "            if problem is not None:\n                raise MeasurementError(",
        "            if False:\n                raise MeasurementError(",
    ),
    (M, "                if found is None:", "                if False:"),
    (M, "rules.per_position_required(method),\n    )\n    if problem", "False,\n    )\n    if problem"),
    # validate/verdict.py: the verdict judged again
    (V, "        if mine != theirs:", "        if False:"),
    (V, "    if total != count:", "    if False:"),
    (V, "    if isinstance(rate, bool) or rate != want:", "    if isinstance(rate, bool):"),
    (V, "or matches < 0 or", "or matches < -1 or"),
    (V, "    return min(rates) if rates else None", "    return max(rates) if rates else None"),
    (
        V,
        '    if isinstance(al, bool) or al != want:\n        return f"its reference AL',
        '    if False:\n        return f"its reference AL',
    ),
    (
        V,
        '    if not isinstance(counters, Mapping):\n        return "its reference',
        '    if False:\n        return "its reference',
    ),
    (V, "    if len(rows) != want:", "    if False:"),
    (V, 'if not all(isinstance(r.get("near_tie"), bool) for r in rows):', "if False:"),
    (V, "        return None if want == 0 else", "        return None if True else"),
    (V, '    if data.get("acceptance") != acc.as_dict():', "    if False:"),
    (V, "    if written != want:", "    if False:"),
    (V, "    if recorded != verdict:", "    if False:"),
    (V, "    if profile is None:\n        raise error(", "    if False:\n        raise error("),
    (
        V,
        '    problem = profile_difference(data.get("profile"), profile)\n    if problem is not None:',
        "    problem = None\n    if problem:",
    ),
    # pipeline/wheelfile.py: the wheel is what its bytes say
    (
        W,
        '                if problem is not None:\n                    raise error(f"{shown}: member',
        '                if False:\n                    raise error(f"{shown}: member',
    ),
    (W, "                if info.filename in seen:", "                if False:"),
    (W, "            if len(tops) != 1:", "            if False:"),
    (W, "    if normalize(name) != normalize(str(file_name)) or not same_version:", "    if False:"),
    (W, "    if machine != file_machine:", "    if False:"),
    (W, "    if kinds != file_kinds:", "    if False:"),
    (
        W,
        '    if not same:\n        raise error(f"{shown}: its {prov.PATH} is of version',
        '    if False:\n        raise error(f"{shown}: its {prov.PATH} is of version',
    ),
    (W, "b_version != upstream or b_machine != machine:", "b_version != upstream:"),
    (W, "if normalize(str(b_name)) != project or", "if"),
    (
        W,
        "raw_prov = member(prov.PATH, PROVENANCE_LIMIT) if prov.PATH in by_name or require_provenance else None",
        "raw_prov = member(prov.PATH, PROVENANCE_LIMIT) if prov.PATH in by_name else None",
    ),
    ("vllm_dflash/paths.py", "    if info.flag_bits & 0x1:", "    if False:"),
    (
        "vllm_dflash/paths.py",
        "    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):",
        "    if False:",
    ),
    ("vllm_dflash/paths.py", "    if info.file_size > limit:", "    if info.file_size > limit * 1024:"),
    # validate/server.py: bindings
    (S, "            if want != digest:", "            if False:"),
    (S, "            if sha256_file(disk) != h.hexdigest():", "            if False:"),
    (S, "            if disk.is_symlink() or not disk.is_file():", "            if False:"),
    (S, "    if installed.version != got.version:", "    if False:"),
    (S, '    by_id = ContainerOptions(**{**opts.__dict__, "image": digest})', "    by_id = opts"),
    (S, "        elif not same_version(version, declared):", "        elif False:"),
    (S, "        if version is None or declared is None:", "        if False:"),
    # simple_index.py: the transaction and the records
    (IX, "                fcntl.flock(fd, fcntl.LOCK_EX)", "                pass"),
    (IX, "            if same:\n                break", "            if True:\n                break"),
    (
        IX,
        "                if made_lock:\n                    lock_path.unlink()",
        "                if False:\n                    lock_path.unlink()",
    ),
    (IX, "                records = [*p.earlier, dict(p.record)]", "                records = [dict(p.record)]"),
    # publish.py: the gate
    (P, "    if profile not in required:", "    if False:"),
    (P, '    if judged.verdict != "pass":', "    if False:"),
    (P, "    if rep.artifact_sha256 != artifact.sha256:", "    if False:"),
    (P, "        inspect_wheel(ident.path, PublishRefusedError, require_provenance=True)", "        pass"),
    (
        P,
        "    if binding in (BINDING_INSTALLED, BINDING_IMAGE):",
        "    if binding in (BINDING_INSTALLED, BINDING_IMAGE, BINDING_DECLARED):",
    ),
    (P, "        if accept_declared:\n            return", "        if True:\n            return"),
    # conformance/compare.py: kv_problems, the eviction proof's judge (issue 38)
    (K, '    return int(row[2 + g["gid"]]) < -(-int(row[1])', '    return int(row[2 + g["gid"]]) <= -(-int(row[1])'),
    (
        K,
        '    if not layout or not blocks:\n        return ["no KV-cache block',
        '    if False:\n        return ["no KV-cache block',
    ),
    (
        K,
        "        out = [f\"{C.FULL_KV}: drafter layers in sliding-window group {g['gid']}\" for g in sliding]",
        "        out = []",
    ),
    (K, '            short = [g["gid"] for g in groups if _evicted(rows[-1], g)]', "            short = []"),
    (K, "    if not sliding:\n        return [", "    if False:\n        return ["),
    (K, "            if not _evicted(rows[-1], g):", "            if False:"),
    (K, '            cap = (int(g["window"]) - 1 + 2 * k) // int(g["block_size"]) + 2', "            cap = 10**9"),
    (K, "    if spec.min_prefill_chunks and not any(", "    if False and not any("),
    (K, "    if spec.prefix_caching and not any(", "    if False and not any("),
    # conformance/compare.py: the KV-cache groups' geometry and the memory claims, patched vs full-kv (issue 38)
    (K, "    reasons += kv_geometry_problems(spec, build, metrics)\n", ""),
    (K, "    if drafter != target:\n        out = [", "    if False:\n        out = ["),
    (K, '            if block and int(g["block_size"]) != block', "            if False"),
    (
        K,
        '    alone = [g for g in groups if not g.get("window") and int(g["layers"]) == int(g["drafter_layers"])]',
        "    alone = []",
    ),
    (K, '    if int(full.get("kv_reused", 0)) != 0:', "    if False:"),
    (K, '    if spec.kv_cache_bytes and int(windowed.get("kv_reused", 0)) <= 0:', "    if False:"),
    (K, '        if peak > int(layout["bytes_per_request"]):', "        if False:"),
    (K, "        if theirs and _held_bytes(rows[-1], lw) >= _held_bytes(theirs[-1], lf):", "        if False:"),
    (K, '    if int(lw["bytes_per_request"]) >= int(lf["bytes_per_request"]):', "    if False:"),
    (K, '    if float(lw["max_concurrency"]) <= float(lf["max_concurrency"]):', "    if False:"),
    (K, "        if found:\n            out[out.index(mine)]", "        if False:\n            out[out.index(mine)]"),
    # conformance/compare.py: a new run never prunes a run another process holds (found by a CI run losing its traces)
    (K, "        if not _in_use(stale):\n", "        if True:\n"),
    # conformance/compare.py: prefix_problems, patch 0006's judge (issue 40)
    (K, "        want = int(bound) if keeps else max(int(bound) - block, 0)", "        want = int(bound)"),
    (K, "    keeps = build in PASSING_BUILDS and C.FIX_PREFIX_BLOCK in fixed", "    keeps = build in PASSING_BUILDS"),
    (K, "    if not any(int(b) >= 2 * block for b in bounds.values()):", "    if False:"),
    # issue 40: "needed" by ablation -- the run of the queue without the patch decides, cached by its inputs
    (
        "vllm_dflash/upstream/ablation.py",
        "    if failed:\n        return NEEDED",
        "    if False:\n        return NEEDED",
    ),
    ("vllm_dflash/upstream/ablation.py", "    if any(o.unproven for o in outcomes):", "    if False:"),
    ("vllm_dflash/upstream/ablation.py", "        if result.is_file():", "        if False:"),
    ("vllm_dflash/upstream/ablation.py", '        "fixes": sorted(fixed),\n', ""),
    (
        "vllm_dflash/upstream/matrix.py",
        "        if ab.verdict == NEEDED:",
        "        if ab.verdict in (NEEDED, NOT_NEEDED):",
    ),
    ("vllm_dflash/upstream/matrix.py", "        if ab is None:", "        if False:"),
    ("vllm_dflash/conformance/cases.py", "    if judges_prefix_block(spec):", "    if spec.prefix_caching:"),
    (
        "vllm_dflash/conformance/cases.py",
        "            best = min(having, key=lambda s: len(exercises(s)))",
        "            best = having[-1]",
    ),
    # issue 42: the doctor's last tracebacks and a child's trace inside a one-line error
    (
        "vllm_dflash/doctor/checkpoint.py",
        "        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):",
        "        if False:",
    ),
    # issue 39: a column server serves two doctor runs at once (one client at a time made the second wait for the
    # first's whole batch), and a field is measured by building without it (a build that refuses either way is no
    # reading of the field)
    (
        "vllm_dflash/doctor/vllm_side.py",
        "            threading.Thread(target=serve, args=(conn,), daemon=True).start()",
        "            serve(conn)",  # one client at a time again: a second doctor run waits for the first's batch
    ),
    ("vllm_dflash/doctor/sides.py", "            if not self._connectable():", "            if True:"),
    ("vllm_dflash/doctor/fields.py", "    if not changes and either:", "    if False:"),
    (
        "vllm_dflash/doctor/fields.py",
        '    if here:\n        return "not computed',
        '    if False:\n        return "not computed',
    ),
    ("vllm_dflash/proc.py", "    if not any(line.startswith(_TRACE_HEADS) for line in plain):", "    if True:"),
    ("vllm_dflash/proc.py", "    return said + ends[-1:]", "    return said + ends"),
    # issue 42, found by the report fuzzer: timings bounded, serving and sampling the profile's
    (
        R,
        "            if isinstance(secs, bool) or not isinstance(secs, int | float) or not 0 <= secs <= MAX_WALL_S:",
        "            if False:",
    ),
    ("vllm_dflash/validate/serving.py", "            if mine != theirs:", "            if False:"),
    ("vllm_dflash/validate/serving.py", '    if serving.get("source") not in (DECLARED, LAUNCHED):', "    if False:"),
    (
        V,
        '    if recorded in ("pass", "fail"):\n        problem = conditions_difference',
        "    if False:\n        problem = conditions_difference",
    ),
    # issue 41: replicas behind a router -- their counters added up, each request accounted for once, re-checked
    (R, "    return replicas_problem(data, got)", "    return None"),
    (R, "        if sums[name] != delta.values[name]:", "        if False:"),
    (R, "            sums[name] += got.values[name]", "            sums[name] = got.values[name]"),
    (R, "        if per_pos.get(pos, 0.0) != delta.per_position.get(pos, 0.0):", "        if False:"),
    (M, "    out = SpecCounters(finished_requests=0.0)", "    out = SpecCounters()"),
    (
        M,
        "per_position={p: self.per_position.get(p, 0.0) + other.per_position.get(p, 0.0) for p in positions},",
        "per_position={**other.per_position, **self.per_position},",
    ),
    (M, "    if any(c is None for c in counts):", "    if False:"),
    (M, "    if finished == sent:", "    if finished >= sent:"),
    (M, "    if finished < sent:", "    if finished > sent:"),
    (M, "delta.finished_requests >= sent:", "delta.finished_requests >= 0:"),
    (M, "and self.started != before.started:", "and False:"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run only mutants whose file contains this")
    ap.add_argument("--check", action="store_true", help="only check that every mutant still applies")
    args = ap.parse_args()
    if args.check:
        stale = [(p, o) for p, o, _ in MUTANTS if (REPO / p).read_text().count(o) != 1]
        print(f"{len(MUTANTS)} mutants, {len(stale)} stale: {stale}")
        return 1 if stale else 0
    killed: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    survivors: list[str] = []
    t0 = time.monotonic()
    for path, old, new in MUTANTS:
        if args.only not in path:
            continue
        target = REPO / path
        original = target.read_text()
        if original.count(old) != 1:
            print(f"STALE mutant ({original.count(old)} matches) in {path}: {old!r}", flush=True)
            return 2
        total[path] += 1
        try:
            target.write_text(original.replace(old, new))
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "-m",
                    "not heavy",
                    *TESTS_FOR.get(path, TESTS),
                ],
                cwd=REPO,
                capture_output=True,
                text=True,
                check=False,
            )
        finally:
            target.write_text(original)
        if run.returncode != 0:
            killed[path] += 1
            print(f"killed   {path}: {old.strip()[:70]!r}", flush=True)
        else:
            survivors.append(f"{path}: {old.strip()[:90]!r} -> {new.strip()[:40]!r}")
            print(f"SURVIVED {path}: {old.strip()[:70]!r}", flush=True)
    print(f"\n{sum(killed.values())} of {sum(total.values())} mutants killed in {time.monotonic() - t0:.0f} s")
    for path in sorted(total):
        print(f"  {path}: {killed[path]}/{total[path]}")
    for s in survivors:
        print(f"  survivor: {s}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
