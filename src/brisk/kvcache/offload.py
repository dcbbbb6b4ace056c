"""A disk tier under the prefix cache: full cached blocks the pool evicts are kept in a directory and loaded back.

When the block pool hands a cached block to another request (kvcache/block_pool.py `get_new_blocks`), its K/V in
every layer is copied out (a memcpy, on the engine thread, before anyone can write the block) and a background
thread writes it to `kv_offload_dir`. A prefix lookup that runs out of RAM hits asks the directory for the next
blocks of the chain; those found are read into freshly allocated blocks before the step's forward and count as
cached tokens. The stored bytes are the computed bytes, so a disk hit gives the same output as computing the prefix.

Key: sha256(namespace || block hash). The block hash is the manager's sha256 chain over every token up to the
block's end (and the LoRA adapter's weight digest where one is used), never Python's `hash()`; the namespace is a
sha256 over what else decides a block's contents: the model's identity (its file's resolved path, size and
mtime; a folder's files; random weights' shape and seed), the weights and KV dtypes, block size, layers, KV heads,
head dim, the activation setting of quantized linears, the execution path, the file format and brisk's version.
Entries of another model, dtype or version have other names and are never read.

File `<key hex>.kv`:  magic "briskKV1" | key (32 bytes) | payload length (u64) | crc32 of the payload (u32) |
payload = every layer's block tensors (raw bytes, in layer order; a quantized cache's codes and scales).
Written to a temporary name and renamed into place (atomic: readers and other writers see a whole file or none);
a file whose header, length, key or checksum disagrees is removed, never served. The directory is bounded in
bytes, least recently used first (a hit touches the file's mtime, so a restart orders the index by last use).

Faults (unwritable or vanished directory, disk full, a torn file) are logged once each and counted; the engine
then computes prefixes as it would without the tier.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from brisk.kvcache.quant import Int4KVCache, Int8KVCache, QuantizedKVCache

if TYPE_CHECKING:
    from brisk.kvcache.block_pool import KVBlock
    from brisk.kvcache.manager import KVCacheManager

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"briskKV1"
_HEADER = struct.Struct("<8s32sQI")  # magic, key, payload length, crc32
SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 600.0  # a temporary file older than this is a writer's leftover (killed mid-write)


@dataclass
class OffloadStats:
    hits: int = 0  # blocks loaded from the tier into the pool
    hit_tokens: int = 0  # tokens those blocks cover (counted as cached)
    misses: int = 0  # admissions whose prefix ran past RAM hits and was not found on disk either
    blocks_written: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    dropped: int = 0  # evicted blocks not written: the writer's queue was full, or a block exceeds the bound
    errors: int = 0  # failed writes, reads and removals (each kind logged once)
    corrupt: int = 0  # files rejected (torn, truncated, wrong key, bad checksum) and removed
    disk_blocks: int = 0  # files in this process's index
    disk_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def model_identity(path: Path | None, dummy_shape: str | None = None, seed: int = 0) -> dict[str, Any]:
    """What names the weights: a file's resolved path, size and mtime; a folder's files (name, size, mtime); random
    weights' shape and seed."""
    if dummy_shape is not None:
        return {"dummy": dummy_shape, "seed": seed}
    if path is None:
        return {"path": None}
    p = Path(path).expanduser().resolve()
    try:
        if p.is_dir():
            files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())
            return {"dir": str(p), "files": files}
        st = p.stat()
        return {"file": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    except OSError:
        return {"path": str(p)}


def namespace_digest(fields: dict[str, Any]) -> bytes:
    """sha256 over everything besides the tokens that decides a block's contents (see the module docstring)."""
    text = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def block_key(namespace: bytes, block_hash: int) -> bytes:
    """The 32-byte key of a block: its chained token hash within the namespace."""
    return hashlib.sha256(namespace + block_hash.to_bytes(32, "little")).digest()


def block_views(cache: torch.Tensor | QuantizedKVCache, block_id: int, block_size: int) -> list[torch.Tensor]:
    """Views of one block of one layer's cache: all a block holds, and nothing of another block."""
    lo, hi = block_id * block_size, (block_id + 1) * block_size
    if isinstance(cache, Int8KVCache):
        return [cache.codes[:, lo:hi], cache.scales[:, lo:hi]]
    if isinstance(cache, Int4KVCache):
        return [cache.k_codes[block_id], cache.k_scale[block_id], cache.k_min[block_id],
                cache.v_codes[lo:hi], cache.v_scale[lo:hi], cache.v_min[lo:hi]]
    assert isinstance(cache, torch.Tensor), f"no disk tier for a {type(cache).__name__} cache"
    return [cache[:, block_id]]  # [2, block_size, kv_heads, head_dim]


class DiskKVStore:
    """The directory: file format, an LRU index bounded in bytes, and the background writer."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, namespace: bytes,
                 queue_blocks: int = 64) -> None:
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.namespace = namespace
        self.stats = OffloadStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file bytes, least recently used first
        self._pending: dict[str, list[torch.Tensor]] = {}  # queued, not yet written: served from memory
        self._logged: set[str] = set()
        self._queue: queue.Queue[tuple[str, list[torch.Tensor]] | None] = queue.Queue(maxsize=queue_blocks)
        self._scan()
        self._thread = threading.Thread(target=self._run, name="brisk-kv-offload", daemon=True)
        self._thread.start()

    # ---- faults ------------------------------------------------------------------------------------

    def _fault(self, kind: str, exc: BaseException | str) -> None:
        self.stats.errors += 1
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("KV disk tier (%s): %s failed: %s; prefixes are computed as without the tier "
                           "(further %s errors are counted, not logged)", self.directory, kind, exc, kind)

    # ---- index -------------------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        """Build the index from the directory (oldest use first) and drop writers' stale temporary files."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = []
            now = time.time()
            with os.scandir(self.directory) as it:
                for e in it:
                    if e.name.endswith(SUFFIX) and len(e.name) == 64 + len(SUFFIX):
                        st = e.stat()
                        entries.append((st.st_mtime, e.name[:64], st.st_size))
                    elif e.name.endswith(_TMP_SUFFIX) and now - e.stat().st_mtime > _STALE_TMP_SECONDS:
                        os.unlink(e.path)
        except OSError as exc:
            self._fault("open", exc)
            return
        with self._lock:
            for _, key, size in sorted(entries):
                self._index[key] = size
                self.stats.disk_bytes += size
            self.stats.disk_blocks = len(self._index)
        self._trim()

    def contains(self, block_hash: int, touch: bool = False) -> bool:
        """Whether the block is on disk or queued for it (`touch`: and mark it used); another process's file is
        found by its name."""
        key = block_key(self.namespace, block_hash).hex()
        with self._lock:
            if key in self._index:
                if touch:
                    self._index.move_to_end(key)
                return True
            if key in self._pending:
                return True
        try:
            size = self.path_of(key).stat().st_size
        except OSError:
            return False
        self._add(key, size)
        return True

    def _add(self, key: str, size: int) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            self.stats.disk_bytes += size - (old or 0)
            self._index[key] = size
            self.stats.disk_blocks = len(self._index)

    def _forget(self, key: str, remove: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.disk_bytes -= size
            self.stats.disk_blocks = len(self._index)
        if remove:
            try:
                self.path_of(key).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._fault("remove", exc)

    def _trim(self) -> None:
        """Remove least recently used files until the directory's bytes (as this process knows them) fit."""
        while True:
            with self._lock:
                if self.stats.disk_bytes <= self.max_bytes or not self._index:
                    return
                key = next(iter(self._index))
            self._forget(key, remove=True)

    # ---- writing -----------------------------------------------------------------------------------

    def submit(self, block_hash: int, tensors: list[torch.Tensor], wait: bool = False) -> None:
        """Queue a block's tensors (already copied out of the cache) for writing; dropped if the queue is full,
        unless `wait` (then it waits for room: at shutdown, not on the engine's step)."""
        key = block_key(self.namespace, block_hash).hex()
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending[key] = tensors
        try:
            self._queue.put((key, tensors), block=wait, timeout=10.0 if wait else None)
        except queue.Full:
            with self._lock:
                self._pending.pop(key, None)
            self.stats.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, tensors = item
                self._write(key, tensors)
            except Exception as exc:  # the writer must outlive any one bad write
                self._fault("write", exc)
            finally:
                if item is not None:
                    with self._lock:
                        self._pending.pop(item[0], None)
                self._queue.task_done()

    def _write(self, key: str, tensors: list[torch.Tensor]) -> None:
        arrays = [t.contiguous().view(-1).view(torch.uint8).numpy() for t in tensors]
        length = sum(a.nbytes for a in arrays)
        size = _HEADER.size + length
        if size > self.max_bytes:
            self.stats.dropped += 1
            if "size" not in self._logged:
                self._logged.add("size")
                logger.warning("KV disk tier (%s): a block takes %d bytes, more than kv_offload_bytes (%d); "
                               "nothing is written", self.directory, size, self.max_bytes)
            return
        crc = 0
        for a in arrays:
            crc = zlib.crc32(a, crc)
        header = _HEADER.pack(MAGIC, bytes.fromhex(key), length, crc)
        tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        try:
            try:
                f = open(tmp, "wb")  # noqa: SIM115 - closed below, before the rename
            except FileNotFoundError:  # the directory was removed: make it again, once per write
                self.directory.mkdir(parents=True, exist_ok=True)
                f = open(tmp, "wb")  # noqa: SIM115
            with f:
                f.write(header)
                for a in arrays:
                    f.write(a)
            os.replace(tmp, self.path_of(key))
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            self._fault("write", exc)
            return
        self.stats.blocks_written += 1
        self.stats.bytes_written += size
        self._add(key, size)
        self._trim()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (False if `timeout` seconds passed first)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the writer."""
        if not self._thread.is_alive():
            return
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)

    # ---- reading -----------------------------------------------------------------------------------

    def read(self, block_hash: int, expected: int) -> memoryview | list[torch.Tensor] | None:
        """The block's payload (`expected` bytes) if a whole, valid file holds it; queued tensors if it is not
        written yet; None otherwise (a bad file is removed)."""
        key = block_key(self.namespace, block_hash).hex()
        with self._lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending
        path = self.path_of(key)
        data = bytearray(_HEADER.size + expected + 1)  # one byte more: a longer file is caught too
        try:
            with open(path, "rb") as f:
                num_read = f.readinto(data)
        except FileNotFoundError:
            self._forget(key, remove=False)
            return None
        except OSError as exc:
            self._fault("read", exc)
            self._forget(key, remove=False)
            return None
        ok = num_read == _HEADER.size + expected
        if ok:
            magic, stored_key, length, crc = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size:_HEADER.size + expected]
            ok = (magic == MAGIC and stored_key.hex() == key and length == expected
                  and zlib.crc32(payload) == crc)
        if not ok:
            self.stats.corrupt += 1
            if "corrupt" not in self._logged:
                self._logged.add("corrupt")
                logger.warning("KV disk tier (%s): %s is torn or corrupt; removed (further ones are counted)",
                               self.directory, path.name)
            self._forget(key, remove=True)
            return None
        self.stats.bytes_read += num_read
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        try:
            os.utime(path)  # last use, for the LRU order another process (or a restart) rebuilds
        except OSError:
            pass
        return payload


class KVOffload:
    """The disk tier bound to one engine's per-layer caches: snapshots evicted blocks, loads hits back."""

    def __init__(self, store: DiskKVStore, kv_caches: list[Any], block_size: int) -> None:
        self.store = store
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.manager: KVCacheManager | None = None  # set by KVCacheManager.set_offload
        self.block_bytes = sum(v.numel() * v.element_size()
                               for cache in kv_caches for v in block_views(cache, 0, block_size))

    @property
    def stats(self) -> OffloadStats:
        return self.store.stats

    def _views(self, block_id: int) -> list[torch.Tensor]:
        return [v for cache in self.kv_caches for v in block_views(cache, block_id, self.block_size)]

    def on_evict(self, block: KVBlock, wait: bool = False) -> None:
        """The pool is about to reuse a cached block: copy its K/V out now, write it in the background."""
        assert block.block_hash is not None
        for cache in self.kv_caches:  # int4: a block whose keys still sit in the float16 window is not whole
            if isinstance(cache, Int4KVCache) and int(cache.residual_of_block[block.block_id]) >= 0:
                return
        if self.store.contains(block.block_hash, touch=True):  # already there (e.g. it was loaded from disk)
            return
        self.store.submit(block.block_hash, [v.clone() for v in self._views(block.block_id)], wait)

    def contains(self, block_hash: int) -> bool:
        return self.store.contains(block_hash)

    def load(self, block_hash: int, block_id: int) -> bool:
        """Read the block into `block_id` of every layer; False (the block untouched or to be recomputed) if the
        entry is gone or bad."""
        data = self.store.read(block_hash, self.block_bytes)
        if data is None:
            return False
        views = self._views(block_id)
        if isinstance(data, list):  # still queued for writing: the snapshot itself
            if len(data) != len(views):
                return False
            for v, t in zip(views, data, strict=True):
                v.copy_(t)
        else:
            offset = 0
            for v in views:
                n = v.numel() * v.element_size()
                src = torch.frombuffer(data, dtype=torch.uint8, count=n, offset=offset)
                v.copy_(src.view(v.dtype).view(v.shape))
                offset += n
        for cache in self.kv_caches:  # int4: a reused block may still hold a float16 key buffer of its last owner
            if isinstance(cache, Int4KVCache) and int(cache.residual_of_block[block_id]) >= 0:
                cache._release_residual(block_id)
        self.stats.hits += 1
        self.stats.hit_tokens += self.block_size
        return True

    def save_cached(self) -> None:
        """Queue every cached block that no request holds (a held one may be registered but not computed yet),
        so that a restart finds the prefixes still in RAM too."""
        if self.manager is None:
            return
        for block in list(self.manager.block_pool.cached_block_map().values()):
            if block.ref_cnt == 0:
                self.on_evict(block, wait=True)

    def close(self) -> None:
        """Save the RAM prefix cache, write what is queued, stop the writer, and detach from the manager: the
        engine goes on without the tier. Idempotent."""
        if self.manager is not None:
            try:
                self.save_cached()
            finally:
                self.manager.offload = None
                self.manager.block_pool.on_evict = None
                self.manager = None
        self.store.close()


def _close_at_exit(ref: weakref.ReferenceType[KVOffload]) -> None:
    offload = ref()
    if offload is not None:
        offload.close()


def _brisk_version() -> str:
    """brisk's installed version (as pyproject.toml states it; importing `brisk` from here would go up a layer)."""
    try:
        return importlib.metadata.version("brisk")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def make_offload(config: Any, loaded: Any, runner: Any, manager: Any) -> KVOffload | None:
    """The disk tier `config.cache.kv_offload_dir` asks for (an EngineConfig), attached to `manager` (the
    KVCacheManager) over the per-layer caches of `runner` (the ModelRunner) for the weights `loaded` holds; None,
    with a log line, where it cannot apply."""
    cache = config.cache
    if cache.kv_offload_dir is None:
        return None
    why = None
    if not manager.enable_caching:
        why = "prefix caching is off (--no-prefix-caching, or a LongRoPE model past its original context)"
    elif manager.policy.name != "full":
        why = f"kv_policy {manager.policy.name} drops or moves cached entries, so a block is not its prefix's KV"
    elif config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        why = "parallel engines keep their caches in other processes"
    if why is not None:
        logger.warning("--kv-offload-dir %s is ignored: %s", cache.kv_offload_dir, why)
        return None
    mc = loaded.config
    fields = {
        "brisk": _brisk_version(),
        "model": model_identity(loaded.path, loaded.dummy_shape, config.seed),
        "dtype": [config.dtype, str(loaded.dtype)],
        "kv_cache_dtype": cache.kv_cache_dtype if cache.kv_cache_dtype != "auto" else str(loaded.dtype),
        "block_size": cache.block_size,
        "layout": [mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim],
        "kv_policy": manager.policy.name,
        "quant_activations": config.quant_activations,
        "execution": config.execution,
    }
    store = DiskKVStore(cache.kv_offload_dir, cache.kv_offload_max_bytes, namespace_digest(fields))
    offload = KVOffload(store, runner.kv_caches, cache.block_size)
    manager.set_offload(offload)
    atexit.register(_close_at_exit, weakref.ref(offload))  # a process that ends without engine.shutdown()
    logger.info("KV disk tier at %s: %d blocks (%.1f MiB) found, bounded to %.1f GiB, %.1f KiB a block",
                store.directory, store.stats.disk_blocks, store.stats.disk_bytes / 2**20, store.max_bytes / 2**30,
                offload.block_bytes / 2**10)
    return offload
