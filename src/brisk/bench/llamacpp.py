"""llama.cpp as a baseline, through llama-cpp-python's low-level C API (an optional extra: `brisk[llamacpp]`).

The high-level `llama_cpp.Llama` keeps one sequence per context; batched decode needs the C API's
`llama_batch` with one sequence id per request, which is what llama.cpp's own `llama-batched` does. Each
measurement starts from an empty KV memory and times only what it names:

- prefill: one prompt decoded in `n_batch`-token chunks, logits for its last token only;
- decode:  B prompts prefilled (untimed, one sequence id each), then B tokens per `llama_decode`, greedy
           (argmax of each sequence's logits row), for `output_len` steps; tokens/s = B * steps / time;
- static batches (`bench serve --baseline llamacpp`): a whole workload, B prompts at a time, prefill and
           decode both timed, as the transformers baseline runs it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


class LlamaCppMissingError(RuntimeError):
    pass


def require_llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppMissingError(
            "this benchmark runs llama.cpp through llama-cpp-python, which is not installed; install it with "
            "CMAKE_ARGS='-DGGML_NATIVE=ON' pip install --no-cache-dir 'llama-cpp-python>=0.3' (it builds llama.cpp "
            "for this CPU, about 10 minutes on 2 cores; --no-cache-dir keeps that -march=native wheel out of pip's "
            "cache, from where another machine with a different CPU would reuse it and die of an illegal "
            "instruction)") from e
    return llama_cpp


def cpu_has_amx() -> bool:
    """Whether the CPU reports AMX tiles. llama.cpp's extra buffer types (its AMX copies of Q4/Q8 weights, and its
    repacked CPU layouts) are then left off by default: llama-cpp-python 0.3.36 built with GGML_NATIVE on such a
    CPU segfaults in `ggml_backend_amx_mul_mat` on the first multi-token batch (prefill, batched decode). F32 and
    F16 weights never use them; Q8_0 / Q4_1 then run on ggml's AVX-512 dot products, as on a CPU without AMX."""
    from brisk.ops.isa import cpu_flags

    return bool({"amx_int8", "amx_tile"} & cpu_flags())


_silenced = False


def _silence_logs(lib: Any) -> None:
    """llama.cpp logs every load and context to stderr; keep the benchmark's table readable."""
    global _silenced
    if _silenced:
        return
    callback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_: None)
    lib.llama_log_set(callback, ctypes.c_void_p())
    _silence_logs.callback = callback  # type: ignore[attr-defined]  # the C side keeps the pointer: keep it alive
    _silenced = True


class LlamaCppModel:
    """One GGUF file loaded by llama.cpp with a context for up to `n_seq_max` sequences of `seq_len` tokens."""

    def __init__(self, path: str | Path, seq_len: int, n_seq_max: int = 1, threads: int = 2,
                 n_batch: int = 512, extra_buffers: bool | None = None) -> None:
        lib = require_llama_cpp()
        self.lib = lib
        _silence_logs(lib)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        if extra_buffers is None:
            extra_buffers = not cpu_has_amx()
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = extra_buffers
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = seq_len * n_seq_max
        cparams.n_batch = max(n_batch, n_seq_max)
        cparams.n_ubatch = max(n_batch, n_seq_max)
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not create a context of {seq_len * n_seq_max} tokens for {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(max(n_batch, n_seq_max), 0, n_seq_max)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self) -> LlamaCppModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """tokens: (token id, position, sequence id, wants logits)."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (KV memory full or bad batch)")

    def _prefill(self, prompt: list[int], seq: int) -> None:
        for start in range(0, len(prompt), self.n_batch):
            chunk = prompt[start:start + self.n_batch]
            last = start + len(chunk) == len(prompt)
            self._decode([(t, start + i, seq, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])

    def _argmax(self, row: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """Logits [T, vocab] (float32) at every position of `prompt`, from one fresh sequence (at most n_batch
        tokens: one batch)."""
        if not 0 < len(prompt) <= self.n_batch:
            raise ValueError(f"prompt_logits takes 1 to {self.n_batch} tokens, got {len(prompt)}")
        self._clear()
        self._decode([(t, i, 0, True) for i, t in enumerate(prompt)])
        return np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                         for i in range(len(prompt))]).astype(np.float32)

    def prefill_seconds(self, prompt: list[int]) -> float:
        """Seconds to run `prompt` through the model from an empty cache (time to first token, sampling aside)."""
        self._clear()
        start = time.perf_counter()
        self._prefill(prompt, 0)
        return time.perf_counter() - start

    def _generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[int]]:
        """Prefill `prompts` (one sequence id each, from an empty KV memory), then greedy-decode them together
        to `output_len` tokens each. Returns (seconds of the decode steps, tokens of sequence 0)."""
        if len(prompts) > self.n_seq_max:
            raise ValueError(f"{len(prompts)} sequences but the context holds {self.n_seq_max}")
        self._clear()
        nxt = []
        for seq, p in enumerate(prompts):
            self._prefill(p, seq)
            nxt.append(self._argmax(-1))
        out0 = [nxt[0]]
        lens = [len(p) for p in prompts]
        start = time.perf_counter()
        for step in range(output_len - 1):
            self._decode([(t, lens[s] + step, s, True) for s, t in enumerate(nxt)])
            nxt = [self._argmax(s) for s in range(len(prompts))]
            out0.append(nxt[0])
        return time.perf_counter() - start, out0

    def decode_rate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[int]]:
        """Greedy decode of len(prompts) sequences together; (decode tok/s, prefill excluded; tokens of seq 0)."""
        elapsed, out0 = self._generate(prompts, output_len)
        return len(prompts) * (output_len - 1) / elapsed, out0

    def static_batches(self, prompts: list[list[int]], output_len: int, batch_size: int,
                       advance: Callable[[int], None] | None = None) -> tuple[float, int]:
        """The whole workload in static batches of `batch_size` prompts in the given order, as the HF baseline
        runs it: each batch's prompts prefilled one after another, then decoded together until every one has
        `output_len` tokens; the next batch starts when the whole batch is done. Returns (seconds, output
        tokens); prefill included."""
        if batch_size > self.n_seq_max:
            raise ValueError(f"batches of {batch_size} but the context holds {self.n_seq_max} sequences")
        start = time.perf_counter()
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b:b + batch_size]
            self._generate(batch, output_len)
            if advance:
                advance(len(batch))
        return time.perf_counter() - start, len(prompts) * output_len
