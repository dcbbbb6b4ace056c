"""The offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from brisk.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.outputs import RequestOutput
from brisk.engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a model once; generate for many prompts with continuous batching.

    >>> llm = LLM()                       # the default model (SmolLM2-135M-Instruct)
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_memory: int | str = "512MiB",
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        device: str = "cpu",
        num_threads: int | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        speculative_config: dict | None = None,
        kv_cache_dtype: str = "auto",
        kv_policy: str = "full",
        kv_budget: int | None = None,
        sink_tokens: int = 4,
        h2o_recent: int | None = None,
        prepack_weights: str = "auto",
        quant_activations: str = "auto",
        compile: bool = False,
        execution: str = "auto",
    ) -> None:
        """speculative: 'ngram' | 'layerskip' | 'draft:PATH' | 'self:int4' (or speculative_config, vLLM's dict:
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}); None = off."""
        from brisk.engine.config import SpecConfig
        from brisk.model.loader import load_model

        if speculative is not None and speculative_config is not None:
            raise ValueError("give either speculative or speculative_config, not both")
        spec = SpecConfig.parse(speculative if speculative is not None else speculative_config,
                                num_speculative_tokens)

        dtype_t = EngineConfig(dtype=dtype, prepack_weights=prepack_weights,  # bad values fail here
                               quant_activations=quant_activations).torch_dtype
        loaded = load_model(model, dtype=dtype_t, device=device, max_model_len=max_model_len)
        max_len = max_model_len or min(loaded.config.max_position_embeddings, 2048)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if enable_chunked_prefill else max(2048, max_len)
        sched = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                max_model_len=max_len, enable_chunked_prefill=enable_chunked_prefill,
                                policy=scheduling_policy)
        cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, num_blocks=num_kv_blocks,
                            enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                            kv_policy=kv_policy, kv_budget=kv_budget, sink_tokens=sink_tokens,
                            h2o_recent=h2o_recent)
        config = EngineConfig(model=model, dtype=dtype, device=device, seed=seed, max_model_len=max_len,
                              cache=cache, scheduler=sched, num_threads=num_threads, spec=spec,
                              prepack_weights=prepack_weights, quant_activations=quant_activations,
                              compile=compile, execution=execution)
        self.engine = LLMEngine(config, loaded)

    def get_tokenizer(self):  # noqa: ANN201 - brisk.model.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A prompt is a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                ids.append(self.engine.add_request(None, prompt, p, priority=priority[i] if priority else 0))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them; the chat template is applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(conv, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after every step that changed this request (text_delta holds the new text).

        Closing the iterator early aborts the request and frees its blocks.
        """
        rid = self.engine.add_request(None, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            progress = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                transient=True)
            task = progress.add_task("gen", total=len(ids))
            progress.start()
        try:
            while len(results) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if progress:
                            progress.advance(task)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            if progress:
                progress.stop()
        return [results[i] for i in ids]
