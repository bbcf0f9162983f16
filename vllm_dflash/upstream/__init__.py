"""Follow upstream: where each patch stands on a newer vLLM (`targets`, `evidence`, `verdicts`) and moving the pin
to it (`rebase`)."""
