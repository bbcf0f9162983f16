"""The DFlash miniatures: a tiny target and a DFlash drafter trained here on CPU, on which vLLM 0.20.1's two DFlash
bugs (context taps one layer early; sliding-window drafter layers run as full, non-causal attention) show up as
acceptance-length numbers. Two targets: a Qwen3 (every layer full attention), and the user's hybrid family
(Qwen3.5/3.6: Gated DeltaNet + gated full attention, 3 : 1).

- corpus.py (stdlib): the synthetic corpus and the held-apart prompts.
- train.py (reference env): trains target then drafter with the reference's semantics; writes the model directory.
- train_hybrid.py (reference env): the same on the hybrid target (train.py's code, its own target class).
- refloop.py (reference env): the reference's own `dflash_generate` loop, AL pooled the way vLLM pools, with
  vLLM 0.20.1's semantics emulated on demand; checks losslessness.
- host.py (tool venv): `ensure_mini_models` (cached by a hash of the training code, per kind) and `run_refloop`.
"""
