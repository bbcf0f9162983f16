"""The drafter doctor: what stock vLLM 0.20.1, this build, upstream vLLM 0.33.0 and 0.34.0 and the dflash 0.1.0
reference do with one DFlash drafter checkpoint, each computed by running that build's own code in its own environment;
`--prove` runs a shape-preserving tiny twin through conformance and checks every claim on it.

    checkpoint.read_checkpoint(path) -> Checkpoint        (config.json, weight names, extra files; never downloads)
    sides.columns(manifest, queues) -> columns            (each build's environment, built once)
    reader.Doctor(Sides(columns)).read(configs) -> Read   (vllm_side.py / reference_side.py in each environment:
                                                           the config loaded as `vllm serve` loads it, the drafter
                                                           built on the meta device, its layers, taps and fc read)
    columns.readings(answers) -> {build: Reading}
    fields.classify(raw, files, tensors, measured)        (what each field does; 2026's fields measured by building
                                                           the drafter without them)
    diagnose.diagnose(checkpoint, readings, ...) -> Diagnosis
    table.render_table(doctor)                            (the table in docs/doctor.md, from checkpoints/*.json)
    prove.prove(...)                                      (the tiny twin through conformance, every claim checked)
    kvcache.per_sequence(...)                             (--context: the KV-cache specs the built models report)
"""
