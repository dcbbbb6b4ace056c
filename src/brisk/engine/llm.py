"""The offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from brisk.engine.llm_engine import LLMEngine, load_engine_model
from brisk.engine.outputs import RequestOutput
from brisk.engine.pooling import PoolingParams, YesNoScorer, cosine, default_pooling
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.settings import build_engine_config, llm_signature, settings_doc
from brisk.lora.request import LoRARequest

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a model once; generate for many prompts with continuous batching.

    >>> llm = LLM()                       # the default model (SmolLM2-135M-Instruct)
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text

    Engine settings (keywords; the same as the options of `brisk generate`, `chat`, `serve`, `bench`):
    """

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        # The keywords are generated from the config dataclasses' fields (engine/settings.py); see __signature__
        # below and the list that ends this docstring.
        config = build_engine_config(model=model, **settings)  # bad values fail here, before the model loads
        loaded = load_engine_model(config)  # refuses a configuration that cannot fit in memory
        self.engine = LLMEngine(config, loaded)

    def get_default_sampling_params(self, **explicit: Any) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (`generation_config` setting) for every field not
        given in `explicit`; what generate / chat / stream use when no sampling_params are passed. An explicit
        `SamplingParams(...)` keeps its own class defaults (as in vLLM)."""
        return self.engine.sampling_defaults.sampling_params(**explicit)

    def get_tokenizer(self):  # noqa: ANN201 - brisk.model.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of the prompts. A prompt is a string or a list of token ids. `lora_request`: one
        adapter for every prompt, or one (or None) per prompt (needs enable_lora=True)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                ids.append(self.engine.add_request(None, prompt, p, priority=priority[i] if priority else 0,
                                                   lora_request=loras[i]))
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them; the chat template is applied."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode_chat(conv, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput after every step that changed this request (text_delta holds the new text);
        `lora_request`: the adapter it runs with (enable_lora), as in `generate`.

        Closing the iterator early aborts the request and frees its blocks.
        """
        rid = self.engine.add_request(None, prompt, sampling_params, lora_request=lora_request)
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

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None, normalize: bool = True
              ) -> list[list[float]]:
        """One embedding per prompt: the final-norm hidden states pooled over the prompt's rows (last | mean | cls;
        None: what the model's files say, else last), L2-normalised unless normalize=False. The prompts run as
        prefill-only requests batched by the engine's scheduler; their KV blocks are freed as each one ends."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = PoolingParams(pooling or default_pooling(self.engine.loaded.path), normalize)
        return self._pooled(list(prompts), [params] * len(prompts))  # type: ignore[arg-type]

    def score(self, query: str, documents: str | Sequence[str], *, method: str = "yes_no",
              template: str | None = None) -> list[float]:
        """How relevant each document is to `query`, in the documents' order. method yes_no: P(yes) of the model
        asked whether the document meets the query (engine/pooling.py YesNoScorer, Qwen3-Reranker's recipe;
        `template` with {query} and {document} replaces the chat-template prompt); embed: the cosine similarity
        of the query's and the document's embeddings."""
        docs = [documents] if isinstance(documents, str) else list(documents)
        if method == "embed":
            vecs = self.embed([query, *docs])
            return [cosine(vecs[0], v) for v in vecs[1:]]
        if method != "yes_no":
            raise ValueError(f"method must be yes_no or embed; got {method!r}")
        scorer = YesNoScorer(self.engine.tokenizer, template)
        params = scorer.params()
        return [p[0] for p in self._pooled([scorer.prompt_ids(query, d) for d in docs], [params] * len(docs))]

    def _pooled(self, prompts: list[Prompt], params: list[PoolingParams]) -> list[list[float]]:
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.engine.add_request(None, prompt, pooling=p))
        except Exception:
            self.engine.abort_request(ids)
            raise
        outs = self._run(ids, use_tqdm=False)
        return [o.pooled for o in outs]  # type: ignore[misc]

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


# A generated signature rather than one written out: the keywords, their defaults and their documentation are
# the config fields' (engine/config.py), so LLM and the command line cannot drift apart; help(LLM) and
# inspect.signature show them all.
LLM.__init__.__signature__ = llm_signature()  # type: ignore[attr-defined]
LLM.__doc__ = (LLM.__doc__ or "") + settings_doc() + "\n"
