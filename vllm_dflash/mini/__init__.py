"""The DFlash miniature: a tiny Qwen3 target and a DFlash drafter trained here on CPU, on which vLLM 0.20.1's two
DFlash bugs (context taps one layer early; sliding-window drafter layers run as full, non-causal attention) show up
as acceptance-length numbers.

- corpus.py (stdlib): the synthetic corpus and the held-apart prompts.
- train.py (reference env): trains target then drafter with the reference's semantics; writes the model directory.
- refloop.py (reference env): the reference's own `dflash_generate` loop, AL pooled the way vLLM pools, with
  vLLM 0.20.1's semantics emulated on demand; checks losslessness.
- host.py (tool venv): `ensure_mini_models` (cached by a hash of the training code) and `run_refloop`.
"""
