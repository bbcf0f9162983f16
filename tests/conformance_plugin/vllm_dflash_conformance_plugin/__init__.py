"""TEST-ONLY vLLM plugin for vllm-dflash's conformance test (see README.md): the drafter-logit recorder. Inert unless
VLLM_DFLASH_TEST_PLUGIN=1."""

from __future__ import annotations

import os

ENABLE_VAR = "VLLM_DFLASH_TEST_PLUGIN"
_done = False


def register() -> None:
    """vLLM `general_plugins` entry point; runs in every vLLM process, so it is idempotent."""
    global _done
    if _done or os.environ.get(ENABLE_VAR) != "1":
        return
    _done = True
    from . import recorder

    recorder.install()
