"""`brisk cache info | clear`: the weights cache (model/weights_cache.py), what it holds and how to empty it."""

from __future__ import annotations

import time

import click


@click.group("cache")
def cache_group() -> None:
    """The weights cache: a GGUF file's converted weights (repacked, fused, re-typed) kept on disk after its first
    load, so that later loads map them. BRISK_WEIGHTS_CACHE=0 turns it off, or names its folder."""


@cache_group.command("info")
def info() -> None:
    """Where the cache is, its limits and its entries (most recently used first)."""
    from brisk.model.weights_cache import Settings, entries

    s = Settings.from_env()
    if s.folder is None:
        click.echo("weights cache: off (BRISK_WEIGHTS_CACHE=0)")
        return
    found = entries(s)
    click.echo(f"weights cache: {s.folder}; loads converting >= {s.min_bytes / 2**20:.0f} MiB are cached; "
               f"kept within {s.max_bytes / 2**30:.0f} GiB (least recently used deleted first)")
    for e in found:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        gone = "  (its file is gone or changed: deleted at the next write)" if e.orphaned() else ""
        click.echo(f"  {e.bytes / 2**30:7.2f} GiB  used {used}  {e.file}{gone}")
    click.echo(f"{len(found)} entries, {sum(e.bytes for e in found) / 2**30:.2f} GiB")


@cache_group.command("clear")
def clear() -> None:
    """Delete every entry (the next load of each file converts it again)."""
    from brisk.model import weights_cache

    s = weights_cache.Settings.from_env()
    if s.folder is None:
        click.echo("weights cache: off (BRISK_WEIGHTS_CACHE=0); nothing to clear")
        return
    freed = weights_cache.clear(s)
    click.echo(f"deleted the entries in {s.folder}: {freed / 2**30:.2f} GiB freed")
