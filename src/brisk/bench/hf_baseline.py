"""The baseline: Hugging Face transformers `generate` on the same model, prompts and token counts.

transformers is an optional dependency (`pip install 'brisk[hf]'`); nothing here imports it at module load.
Both engines decode greedily with no end-of-sequence stop, so both produce exactly the requested number of
tokens and, in float32, the same tokens (a cheap check that the two did the same work).
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

import torch

from brisk.bench.latency import LatencyResult, record_run
from brisk.bench.throughput import ThroughputResult
from brisk.console import Advance


class TransformersMissingError(RuntimeError):
    """`--baseline hf` was asked for but transformers is not installed."""


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise TransformersMissingError(
            "--baseline hf needs Hugging Face transformers, which is not installed; install it with "
            "`pip install 'brisk[hf]'` (or `pip install transformers`), or run without --baseline") from e
    return transformers


def load_hf_model(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own load of a brisk model path: a GGUF file (transformers dequantizes it) or a folder."""
    transformers = require_transformers()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = Path(path)
    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        # transformers' GGUF reader draws its own tqdm bar on stderr, which would tear brisk's rich output
        with contextlib.redirect_stderr(io.StringIO()):
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                      dtype=dtype)
    return model.eval().requires_grad_(False)


def _generation_config(model: torch.nn.Module, num_new_tokens: int, pad_token_id: int) -> Any:
    transformers = require_transformers()
    # A fresh config, not the model's: no sampling knobs, and eos_token_id=None so generation never stops
    # early (brisk's ignore_eos) and the EOS logit is left alone (min_new_tokens would mask it, which
    # brisk's ignore_eos does not do; with no EOS id it has nothing to mask).
    return transformers.GenerationConfig(
        do_sample=False, max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens, eos_token_id=None,
        pad_token_id=pad_token_id, use_cache=True)


def _timing_streamer(times: list[float]) -> Any:
    """A streamer that records when each piece arrives. generate() puts the prompt first, then each token."""
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return TimingStreamer()


def hf_latency(model: torch.nn.Module, prompt_ids: list[int], output_len: int, runs: int = 3, warmup: int = 1,
               advance: Advance | None = None) -> LatencyResult:
    """Batch-1 `generate` timed per token by a streamer: the same clock `run_latency` uses for brisk."""
    input_ids = torch.tensor([prompt_ids])  # [1, input_len]
    config = _generation_config(model, output_len, pad_token_id=0)
    result = LatencyResult(input_len=len(prompt_ids), output_len=output_len)
    for i in range(warmup + runs):
        times: list[float] = []
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config, streamer=_timing_streamer(times))
        new_ids = out[0, len(prompt_ids):].tolist()
        if i >= warmup:
            record_run(result, start, times[1:], new_ids)  # times[0] is the prompt being put
        if advance:
            advance(output_len)
    return result


def hf_throughput(model: torch.nn.Module, prompts: list[list[int]], output_len: int, batch_size: int,
                  pad_token_id: int, advance: Advance | None = None) -> ThroughputResult:
    """Static batches of `batch_size` prompts in the given order, left-padded: transformers' offline path.

    Every batch runs until its last row has `output_len` new tokens; rows of a batch share its longest prompt
    length (padding), and a finished batch's slot waits for the whole batch: the costs paging and
    continuous batching remove.
    """
    if batch_size < 1:
        raise ValueError(f"hf batch size must be at least 1, got {batch_size}")
    config = _generation_config(model, output_len, pad_token_id)
    result = ThroughputResult(num_prompts=len(prompts), output_len=output_len,
                              prompt_tokens=sum(len(p) for p in prompts), output_tokens=0, elapsed_s=0.0)
    with torch.inference_mode():  # untimed warm-up, as brisk gets one
        warm = torch.tensor([prompts[0][:8]])  # [1, <= 8]
        model.generate(warm, attention_mask=torch.ones_like(warm),
                       generation_config=_generation_config(model, 2, pad_token_id))
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # [B, width]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):  # left padding: every row's last prompt token sits at column width-1
            input_ids[row, width - len(p):] = torch.tensor(p)
            attention_mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
        num_new = out.shape[1] - width  # [B, width + new]
        assert num_new == output_len, f"generate returned {num_new} new tokens per row, expected {output_len}"
        result.output_tokens += len(batch) * num_new
        if advance:
            advance(len(batch))
    result.elapsed_s = time.perf_counter() - start
    return result
