"""`cache`: what the download and build cache holds (per kind, each entry's size and what reaches it), and
`cache prune`: remove what no current pin, queue or profile reaches."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_dflash import cache
from vllm_dflash.cli.common import manifest
from vllm_dflash.errors import StorageError
from vllm_dflash.fetch import cache_root


def register(sub: Any) -> None:
    c: argparse.ArgumentParser = sub.add_parser(
        "cache",
        help="show what the cache holds (size, what reaches each entry); `cache prune` removes the unreachable",
        description="Show the cache ($VLLM_DFLASH_CACHE, default ~/.cache/vllm-dflash) grouped by kind: each "
        "entry's size and the pin, queue or profile of dist.toml that reaches it (computed with the key functions "
        "that made it). `cache prune` removes what nothing reaches now; names the tool does not make are shown, "
        "never removed, and an entry whose lock another run holds is skipped. Exit 26 for a cache directory the "
        "tool did not tag.",
    )
    c.set_defaults(func=run_show)
    actions = c.add_subparsers(dest="cache_action", metavar="ACTION")
    p: argparse.ArgumentParser = actions.add_parser(
        "prune", help="remove every entry no current pin, queue or profile reaches (--dry-run: only say so)"
    )
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.set_defaults(func=run_prune)


def _survey(args: argparse.Namespace) -> tuple[Any, list[cache.Entry]]:
    root = cache_root()
    return root, cache.survey(manifest(args), root)


def run_show(args: argparse.Namespace) -> int:
    root, entries = _survey(args)
    if not entries:
        print(f"cache {root}: empty")
        return 0
    print(cache.render(root, entries))
    return 0


def run_prune(args: argparse.Namespace) -> int:
    root, entries = _survey(args)
    result = cache.prune(root, entries, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for e in result.removed:
        print(f"{verb} {e.rel} ({cache.human(e.size)})", flush=True)
    for e in result.skipped:
        print(f"skipped {e.rel}: in use ({e.note or 'its lock is held by another run'})", flush=True)
    kept = sum(1 for e in entries if e.verdict not in (cache.PRUNE, cache.IN_USE))
    print(
        f"{verb} {len(result.removed)} entries ({cache.human(result.freed)}), skipped {len(result.skipped)} in use, "
        f"kept {kept}",
        flush=True,
    )
    if result.failed:
        first = result.failed[0]
        raise StorageError(f"could not remove {len(result.failed)} entries, first {first[0]}: {first[1]}", first[2])
    sys.stdout.flush()
    return 0
