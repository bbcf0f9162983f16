"""proc.call: a child that runs out of disk is reported as a full disk, whatever the caller guessed (issue 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_dflash import proc
from vllm_dflash.errors import DISK_FULL_HINT, ConformanceError, StorageError

# dd prints its ENOSPC line first and three lines of counts after it, so the line falls out of the kept tail.
FILL = ("dd", "if=/dev/zero", "of=/dev/full", "bs=1k", "count=1")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("capture", [True, False])
def test_a_child_out_of_disk_is_a_storage_error(capture: bool) -> None:
    with pytest.raises(StorageError) as info:
        proc.call(*FILL, capture=capture, error=ConformanceError, hint="check the network to PyPI", quiet=True)
    assert "No space left on device" in info.value.message
    assert info.value.hint == DISK_FULL_HINT
    assert info.value.return_code == StorageError.return_code != ConformanceError.return_code


@pytest.mark.parametrize("capture", [True, False])
def test_any_other_failure_keeps_the_callers_class_and_hint(capture: bool, tmp_path: Path) -> None:
    # The negative control: the same tool failing for another reason is not called a full disk.
    missing = tmp_path / "missing"
    with pytest.raises(ConformanceError) as info:
        proc.call("dd", f"if={missing}", "of=/dev/null", capture=capture, error=ConformanceError, hint="h", quiet=True)
    assert not isinstance(info.value, StorageError)
    assert "No such file" in info.value.message and info.value.hint == "h"


CHAINED = """
import sys
print("\\x1b[31mERROR\\x1b[0m  uploading failed", file=sys.stderr, flush=True)
def inner():
    raise ConnectionRefusedError(111, "Connection refused")
try:
    inner()
except OSError as exc:
    raise RuntimeError("Max retries exceeded with url: /legacy/") from exc
"""


@pytest.mark.parametrize("capture", [True, False])
def test_a_childs_traceback_becomes_its_reason(capture: bool) -> None:
    # A real Python child with a chained exception (twine's shape when its URL is unreachable, issue 42): the one-line
    # error keeps what it said and the exception that ended it, never a frame, a colour code or the chain before it.
    import sys

    with pytest.raises(ConformanceError) as info:
        proc.call(sys.executable, "-c", CHAINED, capture=capture, error=ConformanceError, hint="h", quiet=True)
    message = info.value.message.split(" exited 1: ", 1)[1]  # the command itself quotes the script
    assert message.endswith("ERROR  uploading failed; RuntimeError: Max retries exceeded with url: /legacy/"), message
    for gone in ('File "', "raise ", "Traceback", "ConnectionRefusedError", "\x1b["):
        assert gone not in message, (gone, message)


def test_output_without_a_traceback_is_kept_as_it_came() -> None:
    # the control: indented lines of a child that printed no trace are its words, not frames
    lines = ["step 1", "  detail a", "  detail b", "failed: x"]
    assert proc.tail_text(lines) == "detail a; detail b; failed: x"
