"""The serving conditions a measurement ran under, as the report records them: batch size, concurrency, chunked
prefill and its token budget, prefix caching, tensor parallelism, dtype. A report from a lab setting (one request at
a time, no prefix caching) must not pass for a serving one, so these travel with the numbers.
"""

from __future__ import annotations

from typing import Any

from vllm_dflash.manifest import Profile, serve_flag, serve_int


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
        "source": "declared by the profile (validate did not start this server)"
        if mode == "endpoint"
        else "the serve args validate launched the server with",
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
