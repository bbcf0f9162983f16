"""vllm-dflash: a patched vLLM distribution whose DFlash drafter computes what its authors' reference computes."""

__version__ = "0.1.0"
