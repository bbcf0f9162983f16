"""Errors a user can cause. Each class has its own exit code and a hint that says what to do."""

from __future__ import annotations

DISK_FULL_HINT = "free disk space there (or move the cache with VLLM_DFLASH_CACHE) and run again"


class DflashError(Exception):
    """Base class: `message` says what is wrong, `hint` what to do about it, both on one line. `detail` is optional
    context of several lines (a server's log tail) that the CLI shows above that line."""

    return_code = 1

    def __init__(self, message: str, hint: str = "", detail: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.detail = detail

    def one_line(self) -> str:
        line = f"error: {self.message}" + (f" -- {self.hint}" if self.hint else "")
        return " ".join(line.split())  # whatever a message quotes, the error stays one line


class ManifestError(DflashError):
    """dist.toml, VERSION or patches/series is malformed or inconsistent."""

    return_code = 3


class HashMismatchError(DflashError):
    """A downloaded or cached artifact does not have the sha256 (or size) kept in the repo."""

    return_code = 4


class NetworkError(DflashError):
    """A download or git fetch could not reach its server."""

    return_code = 5


class PatchError(DflashError):
    """A patch conflicts, is already applied, needs fuzz, or escapes the source tree."""

    return_code = 6


class DirtyTreeError(DflashError):
    """A work tree that should be pristine has local changes."""

    return_code = 7


class UnsupportedModeError(DflashError):
    """The requested build mode cannot build this patch queue (e.g. a csrc patch on the fast path)."""

    return_code = 8


class PinMismatchError(DflashError):
    """The source checked out or downloaded is not the pinned commit."""

    return_code = 9


class ToolchainError(DflashError):
    """A tool the full CUDA build or the image build needs is missing or the wrong version."""

    return_code = 10


class ContainerError(DflashError):
    """The container tool failed to build or run the image."""

    return_code = 11


class PublishRefusedError(DflashError):
    """The publish gate refused: no passing validation report names this exact artifact."""

    return_code = 12


class ConformanceError(DflashError):
    """The conformance environments could not be created or a case could not run at all."""

    return_code = 13


class UpstreamError(DflashError):
    """An upstream ref or release could not be resolved, or a rebase stopped on a conflict."""

    return_code = 14


class MeasurementError(DflashError):
    """`validate` could not measure acceptance: the server did not come up, died, or drafted nothing.

    Exit 2 is the validator's documented "could not measure" code (0 pass, 1 gate failed).
    """

    return_code = 2


class StorageError(DflashError):
    """A file or directory could not be read or written (full disk, read-only, permissions, not a directory)."""

    return_code = 15


class ProvenanceError(DflashError):
    """A wheel carries no (or a malformed) build provenance document."""

    return_code = 16


class VerifyError(DflashError):
    """A release does not verify: a checksum, the SBOM, the provenance statement, a signature or a report binding."""

    return_code = 17


class CheckpointError(DflashError):
    """`doctor`: the drafter (or target) checkpoint cannot be read offline: no config.json, not JSON, not a drafter."""

    return_code = 18


class SigningKeyError(DflashError):
    """`release --sign-key`: the key cannot be read, is not PEM, is encrypted without (or with the wrong) password,
    or is not Ed25519. Its own class: a bad key is neither a failed gate (1) nor a release that does not verify."""

    return_code = 25  # 20-24 are doctor verdicts


class CacheError(DflashError):
    """`cache prune`: the cache directory is not one the tool tagged (VLLM_DFLASH_CACHE points elsewhere), so
    nothing in it is judged ours."""

    return_code = 26


class V1RemovedError(DflashError):
    """`upstream --against X` / `rebase --to X` / `upstream-watch`: release X has no Model Runner V1, which every patch
    of the queue is written for. Not a conflict to refresh: one verdict, "V1 removed in X; your drafter is served by
    V2 from Y". `upstream` prints it as its report and exits with this code; `rebase` stops with it."""

    return_code = 27


class ReplicaDownError(MeasurementError):
    """`validate --endpoint ROUTER --metrics REPLICA ...`: a replica behind the router does not answer its /metrics,
    so the drafts the router sent it cannot be counted. Never a pass on the other replicas' counters alone, and not
    the generic "could not measure": the fix is the fleet (bring the replica back, or take it out of the router and
    drop its --metrics)."""

    return_code = 28
