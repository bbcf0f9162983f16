"""Write docs/doctor.md's two generated tables from the doctor's own run: the compatibility table of the shipped
checkpoints (`vllm-dflash doctor --table`) and the table of 2026's fields (tests/doctor_issue39.py's cases through every
column). The tests fail when the page differs from this output; this script is how the page is brought up to date.

    python benchmarks/doctor_docs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    from doctor_issue39 import CASES
    from test_doctor_issue39 import fields_table

    from vllm_dflash.doctor import diagnose as D
    from vllm_dflash.doctor import fields as F
    from vllm_dflash.doctor import table
    from vllm_dflash.doctor.checkpoint import Checkpoint
    from vllm_dflash.doctor.reader import Doctor
    from vllm_dflash.doctor.sides import Sides, columns, server_idle
    from vllm_dflash.manifest import load_manifest
    from vllm_dflash.series import read_queues

    manifest = load_manifest(REPO)
    queues = read_queues(manifest.series_path, manifest.cpu_series_path)
    page_path = REPO / "docs" / "doctor.md"
    page = page_path.read_text()
    with Sides(columns(manifest, queues), idle=server_idle()) as sides:
        doc = Doctor(sides)
        page = table.replace_table(page, table.render_table(doc))
        reads = dict(zip([c.name for c in CASES], doc.read([c.config() for c in CASES]), strict=True))
    diagnoses = {}
    for c in CASES:
        cfg = c.config()
        ck = Checkpoint(c.name, cfg, speculators="speculators_model_type" in cfg)
        diagnoses[c.name] = D.diagnose(ck, reads[c.name].readings, measured=reads[c.name].measured)
    start, end = page.find(F.FIELDS_BEGIN), page.find(F.FIELDS_END)
    page = page[:start] + fields_table(reads, diagnoses) + page[end + len(F.FIELDS_END) :]
    page_path.write_text(page)
    print(f"wrote {page_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
