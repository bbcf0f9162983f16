"""The serving conditions a measurement ran under, as the report records them: batch size, concurrency, chunked
prefill and its token budget, prefix caching, tensor parallelism, dtype. A report from a lab setting (one request at
a time, no prefix caching) must not pass for a serving one, so these travel with the numbers.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.manifest import Profile, serve_flag, serve_int
from vllm_dflash.report import canonical_json

DECLARED = "declared by the profile (validate did not start this server)"
LAUNCHED = "the serve args validate launched the server with"
MAX_OBSERVED = 64  # vllm:cache_config_info labels kept; a label value longer than this is no cache setting
MEASURED = "observed_in_metrics"  # the one serving field validate reads off the server, not off the profile


def _switch(args: tuple[str, ...], name: str) -> bool | None:
    """`--name` / `--no-name` (last one wins); None when neither is given (vLLM's default applies)."""
    found = None
    for arg in args:
        if arg == f"--{name}":
            found = True
        elif arg == f"--no-{name}":
            found = False
    return found


def serving_conditions(profile: Profile, mode: str) -> dict[str, Any]:
    """From the profile's serve args (None: not given, vLLM's default applies). For an endpoint, validate did not
    start the server: the conditions are the profile's, as declared, not observed."""
    args = profile.serve_args
    where = f"profile '{profile.name}'"
    tp = serve_int(args, "--tensor-parallel-size", where) or serve_int(args, "-tp", where)
    return {
        "source": DECLARED if mode == "endpoint" else LAUNCHED,
        "num_speculative_tokens": profile.num_speculative_tokens,
        "concurrency": profile.concurrency,
        "max_num_seqs": serve_int(args, "--max-num-seqs", where),
        "max_num_batched_tokens": serve_int(args, "--max-num-batched-tokens", where),
        "chunked_prefill": _switch(args, "enable-chunked-prefill"),
        "prefix_caching": _switch(args, "enable-prefix-caching"),
        "tensor_parallel_size": tp,
        "dtype": serve_flag(args, "--dtype"),
        "max_model_len": serve_int(args, "--max-model-len", where),
    }


def sampling_conditions(profile: Profile) -> dict[str, Any]:
    """How the prompts were sampled, from the profile."""
    return {
        "temperature": profile.temperature,
        "max_tokens": profile.max_tokens,
        "concurrency": profile.concurrency,
        "chat_template_kwargs": profile.template_kwargs,
        "thinking": profile.thinking,
    }


def conditions_difference(serving: Any, sampling: Any, profile: Profile) -> str | None:
    """None when a report's serving and sampling sections are the ones `profile` gives (the same functions validate
    wrote them with, so they cannot drift); else the first field that differs. Only `observed_in_metrics` is read
    off the server: it must be absent or a small mapping of label to text."""
    if not isinstance(serving, dict) or not isinstance(sampling, dict):
        return "its serving or sampling section is not an object"
    if serving.get("source") not in (DECLARED, LAUNCHED):
        return f"its serving source {str(serving.get('source'))[:40]!r} is not one validate writes"
    want = {k: v for k, v in serving_conditions(profile, "launch").items() if k != "source"}
    got = {k: v for k, v in serving.items() if k not in ("source", MEASURED)}
    for name, expect in (("serving", (got, want)), ("sampling", (sampling, sampling_conditions(profile)))):
        have, should = expect
        for key in sorted(set(have) | set(should), key=str):
            # canonical JSON: 3 and "3", 0 and -0.0, 1 and true differ, as they do in the file
            mine = canonical_json(have[key]).decode() if key in have else "absent"
            theirs = canonical_json(should[key]).decode() if key in should else "absent"
            if mine != theirs:
                return f"its {name}.{str(key)[:40]} is {mine[:40]}, not the {theirs[:40]} the profile gives"
    observed = serving.get(MEASURED)
    if observed is not None and (
        not isinstance(observed, dict)
        or len(observed) > MAX_OBSERVED
        or not all(isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_OBSERVED for k, v in observed.items())
    ):
        return f"its serving.{MEASURED} is not a mapping of cache-config label to text"
    return None
