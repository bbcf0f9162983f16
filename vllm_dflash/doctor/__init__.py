"""The drafter doctor: what stock vLLM 0.20.1, this build, upstream vLLM 0.33 and the dflash 0.1.0 reference do with
one DFlash drafter checkpoint's config, read offline; `--prove` runs a shape-preserving tiny twin through conformance
and checks every claim on it.

    checkpoint.read_checkpoint(path) -> Checkpoint        (config.json, weight names, extra files; never downloads)
    loading.loaded(raw, loader) -> Loaded                 (the config object each system's loader makes)
    rules.read(build, raw, code) -> Reading               (per layer attention and taps, per build)
    fields.classify(raw, files, tensors) -> Fields        (what each field does in each build)
    diagnose.diagnose(checkpoint, our, target) -> Diagnosis  (per build, per layer; target layers; verdict; advice)
    table.render_table(...)                               (the table in docs/doctor.md, from checkpoints/*.json)
    prove.prove(...)                                      (the tiny twin through conformance, every claim checked)

This build's resolution is patch 0002's own code (ours.py extracts it with `ast`); loading.py and rules.py are held
against the real code by tests/test_doctor_differential.py.
"""
