"""The disk tier under the prefix cache (kvcache/offload.py): evicted blocks come back from disk bit for bit, survive
a restart, and a bad file, another dtype's entry or an unwritable directory never changes an output."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brisk.engine.llm import LLM
from brisk.engine.sampling_params import SamplingParams
from brisk.kvcache.block_pool import KVBlock
from brisk.kvcache.offload import SUFFIX, DiskKVStore, KVOffload, block_key, namespace_digest
from brisk.kvcache.quant import make_kv_caches

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT_A = list(range(1000, 1150))  # 9 full blocks of 16
PROMPT_B = list(range(2000, 2200))  # with A's blocks, more than the 17-block pool: evicts A's tail
ENGINE = {"max_model_len": 256, "num_kv_blocks": 17}


def _caches(kind: str, num_blocks: int = 6) -> list:
    torch.manual_seed(0)
    caches = make_kv_caches(kind, 2, num_blocks, BS, 2, 8, torch.float32)
    k = torch.randn(num_blocks * BS, 2, 8)
    v = torch.randn(num_blocks * BS, 2, 8)
    for c in caches:
        if isinstance(c, torch.Tensor):
            c.copy_(torch.stack([k, v]).view(c.shape).to(c.dtype))
        else:
            c.write(k, v, torch.arange(num_blocks * BS))
    return caches


def _store(path: Path, namespace: dict | None = None, max_bytes: int = 1 << 30) -> DiskKVStore:
    return DiskKVStore(path, max_bytes, namespace_digest(namespace or {"kv_cache_dtype": "float32"}))


def _evict(offload: KVOffload, block_id: int, block_hash: int) -> None:
    offload.on_evict(KVBlock(block_id, block_hash=block_hash))
    assert offload.store.flush()


def _block(caches: list, block_id: int) -> list[torch.Tensor]:
    from brisk.kvcache.offload import block_views

    return [v.clone() for c in caches for v in block_views(c, block_id, BS)]


@pytest.mark.parametrize("kind", ["auto", "bfloat16", "int8", "int4"])
def test_block_round_trips_bit_for_bit(tmp_path, kind):
    caches = _caches(kind)
    offload = KVOffload(_store(tmp_path), caches, BS)
    _evict(offload, 1, 111)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1 and offload.stats.blocks_written == 1
    # a fresh store over the same directory (a restarted process) serves it into another block
    again = KVOffload(_store(tmp_path), caches, BS)
    assert again.contains(111) and not again.contains(222)
    assert again.load(111, 4)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(_block(caches, 1), _block(caches, 4), strict=True))
    assert again.stats.bytes_read > 0 and again.stats.hits == 1


def test_torn_and_corrupt_files_are_ignored_and_removed(tmp_path, caplog):
    caches = _caches("auto")
    offload = KVOffload(_store(tmp_path), caches, BS)
    _evict(offload, 1, 1)
    _evict(offload, 2, 2)
    before = _block(caches, 5)
    truncated = offload.store.path_of(block_key(offload.store.namespace, 1).hex())
    truncated.write_bytes(truncated.read_bytes()[:-7])  # a writer killed mid-file, renamed by hand
    flipped = offload.store.path_of(block_key(offload.store.namespace, 2).hex())
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x01
    flipped.write_bytes(bytes(data))
    reader = KVOffload(_store(tmp_path), caches, BS)
    with caplog.at_level(logging.WARNING, logger="brisk.kvcache.offload"):
        assert not reader.load(1, 5) and not reader.load(2, 5)
    assert all(torch.equal(a, b) for a, b in zip(before, _block(caches, 5), strict=True))  # block untouched
    assert reader.stats.corrupt == 2 and not truncated.exists() and not flipped.exists()
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 1  # logged once


def test_another_dtype_never_serves_its_entries(tmp_path):
    caches = _caches("auto")
    f32 = KVOffload(_store(tmp_path, {"kv_cache_dtype": "float32"}), caches, BS)
    _evict(f32, 1, 7)
    bf16 = KVOffload(_store(tmp_path, {"kv_cache_dtype": "bfloat16"}), caches, BS)
    assert not bf16.contains(7)  # another key: another file name
    # even under this namespace's name, the header's key gives it away
    theirs = f32.store.path_of(block_key(f32.store.namespace, 7).hex())
    theirs.rename(bf16.store.path_of(block_key(bf16.store.namespace, 7).hex()))
    assert bf16.contains(7) and not bf16.load(7, 3) and bf16.stats.corrupt == 1


def test_bounded_in_bytes_least_recently_used_first(tmp_path):
    caches = _caches("auto")
    probe = KVOffload(_store(tmp_path / "probe"), caches, BS)
    _evict(probe, 0, 0)
    size = probe.stats.disk_bytes
    offload = KVOffload(_store(tmp_path / "lru", max_bytes=2 * size), caches, BS)
    _evict(offload, 1, 1)
    _evict(offload, 2, 2)
    assert offload.load(1, 5)  # 1 is now the most recently used
    _evict(offload, 3, 3)
    assert offload.store.contains(1) and offload.store.contains(3) and not offload.store.contains(2)
    assert offload.stats.disk_bytes == 2 * size
    tiny = KVOffload(_store(tmp_path / "tiny", max_bytes=size // 2), caches, BS)  # "disk full": nothing fits
    _evict(tiny, 1, 1)
    assert tiny.stats.dropped == 1 and not tiny.contains(1)


def test_unwritable_or_removed_directory_logs_once(tmp_path, caplog):
    caches = _caches("auto")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="brisk.kvcache.offload"):
        offload = KVOffload(_store(blocker / "kv"), caches, BS)
        for h in range(3):
            _evict(offload, 1, h)
    assert offload.stats.errors >= 3 and offload.stats.blocks_written == 0 and not offload.contains(0)
    assert len(caplog.records) == 2  # opening, writing: once each
    gone = KVOffload(_store(tmp_path / "gone"), caches, BS)
    _evict(gone, 1, 1)
    for f in (tmp_path / "gone").iterdir():
        f.unlink()
    (tmp_path / "gone").rmdir()
    assert not gone.load(1, 5)  # removed under the index: a miss, not an error
    _evict(gone, 2, 2)  # the directory is made again
    assert gone.contains(2) and gone.load(2, 5)


# ---- the engine, default model ---------------------------------------------------------------------------------


def _run(llm: LLM) -> list[tuple[list[int], int]]:
    """A, then B (evicts A's tail from the 17-block pool), then A again: (tokens, cached tokens) of each."""
    return [(o.outputs[0].token_ids, o.metrics.num_cached_tokens)
            for p in (PROMPT_A, PROMPT_B, PROMPT_A) for o in llm.generate([p], GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain() -> list[tuple[list[int], int]]:
    return _run(LLM(**ENGINE))


_RESTARTED = """
import json, sys
from brisk.engine.llm import LLM
from brisk.engine.sampling_params import SamplingParams
llm = LLM(max_model_len=256, num_kv_blocks=17, kv_offload_dir=sys.argv[1])
out = llm.generate([list(range(1000, 1150))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
print(json.dumps([out.outputs[0].token_ids, out.metrics.num_cached_tokens, llm.engine.stats().kv_offload]))
"""


def test_evicted_prefix_comes_back_from_disk_and_after_a_restart(plain, tmp_path):
    llm = LLM(**ENGINE, kv_offload_dir=str(tmp_path))
    tiered = _run(llm)
    stats = llm.engine.stats().kv_offload
    assert [t for t, _ in tiered] == [t for t, _ in plain]  # greedy output identical with and without the tier
    assert stats is not None and stats["hits"] > 0 and stats["bytes_read"] > 0 and stats["bytes_written"] > 0
    # the third A: its evicted tail came from disk instead of being computed again
    assert tiered[2][1] == (len(PROMPT_A) - 1) // 16 * 16 > plain[2][1]
    llm.engine.shutdown()  # saves what is still cached in RAM too; the engine goes on without the tier
    assert llm.generate([PROMPT_A], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == plain[0][0]
    proc = subprocess.run([sys.executable, "-c", _RESTARTED, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, cached, restarted = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == plain[0][0]
    assert cached == (len(PROMPT_A) - 1) // 16 * 16 and restarted["hits"] == cached // 16


def test_unwritable_directory_generates_as_without(plain, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="brisk.kvcache.offload"):
        llm = LLM(**ENGINE, kv_offload_dir=str(blocker / "kv"))
        assert _run(llm) == plain
    stats = llm.engine.stats().kv_offload
    assert stats is not None and stats["errors"] > 0 and stats["hits"] == 0
    assert len(caplog.records) <= 2  # the directory, the first failed write: once each
    llm.engine.shutdown()  # saving the RAM prefix cache fails quietly too
    assert len(caplog.records) <= 2


def test_two_writers_of_one_directory_never_tear_a_file(tmp_path):
    import threading

    caches = _caches("auto")
    writers = [KVOffload(_store(tmp_path), caches, BS) for _ in range(2)]  # as two processes would
    threads = [threading.Thread(target=lambda w=w: [w.on_evict(KVBlock(h % 6, block_hash=h)) for h in range(12)])
               for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(w.store.flush() for w in writers)
    reader = KVOffload(_store(tmp_path), caches, BS)
    assert all(reader.load(h, h % 6) for h in range(12)) and reader.stats.corrupt == 0
    assert not list(tmp_path.glob(".*.tmp"))
