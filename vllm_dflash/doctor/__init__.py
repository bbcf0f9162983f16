"""The drafter doctor: what stock vLLM 0.20.1, this build, upstream vLLM 0.33 and the dflash 0.1.0 reference do with
one DFlash drafter checkpoint's config, read offline; `--prove` runs a shape-preserving tiny twin through conformance.

    checkpoint.read_checkpoint(path) -> Checkpoint        (config.json, weight names, extra files; never downloads)
    diagnose.diagnose(checkpoint, our, target) -> Diagnosis  (per build, per layer; taps; ignored fields; verdict)
    table.render_table(...)                               (the README's compatibility table, from checkpoints/*.json)
    prove.prove(...)                                      (the tiny twin through conformance.compare)

This build's resolution is patch 0002's own code (ours.py extracts it with `ast`); the other builds are rules with
their source files named (rules.py).
"""
