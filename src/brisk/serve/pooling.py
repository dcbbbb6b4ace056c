"""Embeddings, rerank and score: /v1/embeddings (OpenAI), /v1/rerank and /rerank (Jina / Cohere), /v1/score (vLLM).

Every input runs through the engine as a prefill-only request (engine/pooling.py), batched with whatever else the
engine is computing; its KV blocks are freed in the step that computes its last token.

    /v1/embeddings        the final-norm hidden states pooled (ServerConfig.pooling: --pooling, else the model's
                          files, else last) and L2-normalised; `dimensions` truncates and renormalises where the
                          model states Matryoshka sizes (config.json matryoshka_dimensions / is_matryoshka)
    /v1/rerank, /v1/score --task embed: the cosine similarity of the query's and each document's embeddings;
                          otherwise yes/no-logit scoring: P(yes) of the model asked whether the document meets the
                          query (the chat template over Qwen3-Reranker's prompt, or --rerank-template)
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from brisk.engine.pooling import PoolingParams, YesNoScorer, cosine, default_pooling
from brisk.engine.sampling_params import SamplingParams
from brisk.model.pooling import POOLING_TYPES, ModelPooling, read_model_pooling
from brisk.serve.async_engine import EngineRequest, RequestStream
from brisk.serve.protocol import ClientError, NonEmptyStr, TokenId, parse_request

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine

TASKS = ("generate", "embed", "rerank")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------------------------------------- requests
class EmbeddingRequest(_Body):
    """OpenAI's embeddings request: a text, texts, token ids, or lists of token ids."""

    model: str | None = None
    input: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Truncate to this many dimensions and renormalise (Matryoshka models only)")
    user: str | None = None


class RerankRequest(_Body):
    """Jina / Cohere rerank: the documents ordered by relevance to the query."""

    model: str | None = None
    query: NonEmptyStr
    documents: Annotated[list[NonEmptyStr], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=1)] | None = Field(None, description="Return only the best top_n documents")
    return_documents: bool | None = True


class ScoreRequest(_Body):
    """vLLM's score: text_1 against each text_2 (one against many, many against one, or pairwise for lists of equal
    length)."""

    model: str | None = None
    text_1: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
    text_2: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]


REQUEST_MODELS: list[type[BaseModel]] = [EmbeddingRequest, RerankRequest, ScoreRequest]


# ---------------------------------------------------------------------------------------------- responses
class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


# ---------------------------------------------------------------------------------------------- the routes
@dataclass
class PoolingSetup:
    """What the routes need of the served model: the task, the pooling, its Matryoshka sizes, the scorer."""

    task: str
    pooling: str
    model: ModelPooling
    scorer: YesNoScorer

    @classmethod
    def build(cls, engine: LLMEngine, task: str, pooling: str | None, rerank_template: str | None) -> PoolingSetup:
        if task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}; got {task!r}")
        if pooling is not None and pooling not in POOLING_TYPES:
            raise ValueError(f"--pooling must be one of {', '.join(POOLING_TYPES)}; got {pooling!r}")
        model = read_model_pooling(engine.loaded.path)
        scorer = YesNoScorer(engine.tokenizer, rerank_template)
        if task == "rerank":
            scorer.params()  # a tokenizer without yes/no tokens cannot rerank by their logits: refuse at start
        return cls(task, pooling or default_pooling(engine.loaded.path), model, scorer)


def install_pooling_routes(app: FastAPI, server: Any, dependencies: list[Any], read_json: Any,
                           responses: dict[int | str, Any]) -> None:
    """/v1/embeddings, /v1/rerank (and /rerank), /v1/score on `server` (app._Server)."""
    from brisk.serve.openapi import ok_response, request_body

    setup: PoolingSetup = server.pooling

    def prompt_ids(text_or_ids: str | list[int], param: str) -> list[int]:
        ids = server.tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        server.check_prompt_ids(ids, param)
        if len(ids) > server.max_model_len:
            raise ClientError(f"an input of '{param}' has {len(ids)} tokens, more than this model's context of "
                              f"{server.max_model_len} tokens (max_model_len); shorten it", param=param,
                              code="context_length_exceeded")
        return ids

    async def run(prompts: list[list[int]], params: PoolingParams, task: str, param: str,
                  request: Request) -> list[list[float]]:
        server.check_capacity(len(prompts), param)
        rid = uuid.uuid4().hex
        reqs = [EngineRequest(f"{task}-{rid}-{i}", ids, SamplingParams(max_tokens=1), pooling=params, task=task)
                for i, ids in enumerate(prompts)]
        stream = server.engine.open_stream(reqs, request.receive)
        return await _collect_pooled(stream, len(reqs))

    async def embed(texts: list[str] | list[list[int]], param: str, request: Request, task: str
                    ) -> tuple[list[list[float]], int]:
        prompts = [prompt_ids(t, param) for t in texts]
        vecs = await run(prompts, PoolingParams(setup.pooling), task, param, request)
        return vecs, sum(len(p) for p in prompts)

    async def scores(query: str | list[str], documents: list[str], param: str, request: Request, task: str
                     ) -> tuple[list[float], int]:
        """Relevance of each document to its query (one query for all, or one per document)."""
        queries = [query] * len(documents) if isinstance(query, str) else query
        if setup.task == "embed":
            distinct = list(dict.fromkeys(queries))
            vecs, used = await embed([*distinct, *documents], param, request, task)
            at = {q: vecs[i] for i, q in enumerate(distinct)}
            return [cosine(at[q], v) for q, v in zip(queries, vecs[len(distinct):], strict=True)], used
        try:
            params = setup.scorer.params()
        except ValueError as e:
            raise ClientError(str(e), code="unsupported_model") from None
        prompts = [prompt_ids(setup.scorer.prompt_ids(q, d), param) for q, d in zip(queries, documents, strict=True)]
        out = await run(prompts, params, task, param, request)
        return [p[0] for p in out], sum(len(p) for p in prompts)

    @app.post("/v1/embeddings", dependencies=dependencies, openapi_extra=request_body(EmbeddingRequest),
              responses={**ok_response(EmbeddingResponse, "One embedding per input, in the inputs' order"),
                         **responses})
    async def embeddings(request: Request) -> JSONResponse:
        req = parse_request(EmbeddingRequest, await read_json(request))
        model = server.check_model(req.model)
        inputs: Any = req.input
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if req.dimensions is not None and not setup.model.allows_dimensions(req.dimensions):
            sizes = setup.model.matryoshka_dimensions
            why = "states no Matryoshka sizes" if sizes is None else f"allows only {list(sizes)}"
            raise ClientError(f"'dimensions'={req.dimensions} is not supported: this model {why}",
                              param="dimensions", code="invalid_value")
        if req.dimensions is not None and req.dimensions > server.llm_engine.model_config.hidden_size:
            raise ClientError(f"'dimensions'={req.dimensions} is more than the model's "
                              f"{server.llm_engine.model_config.hidden_size}", param="dimensions", code="invalid_value")
        vecs, used = await embed(inputs, "input", request, "embed")
        data = []
        for i, vec in enumerate(vecs):
            if req.dimensions is not None:
                vec = _renormalised(vec[:req.dimensions])
            emb: list[float] | str = vec
            if req.encoding_format == "base64":
                emb = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append(EmbeddingData(index=i, embedding=emb))
        return JSONResponse(EmbeddingResponse(data=data, model=model,
                                              usage=PoolingUsage(prompt_tokens=used, total_tokens=used)).model_dump())

    async def rerank(request: Request) -> JSONResponse:
        req = parse_request(RerankRequest, await read_json(request))
        model = server.check_model(req.model)
        values, used = await scores(req.query, req.documents, "documents", request, "rerank")
        order = sorted(range(len(values)), key=lambda i: -values[i])[:req.top_n]
        results = [RerankResult(index=i, relevance_score=values[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents is not False
                                else None) for i in order]
        return JSONResponse(RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                                           usage=PoolingUsage(prompt_tokens=used, total_tokens=used)).model_dump())

    rerank_doc = {"openapi_extra": request_body(RerankRequest), "dependencies": dependencies,
                  "responses": {**ok_response(RerankResponse, "The documents by relevance, best first"), **responses}}
    app.post("/v1/rerank", **rerank_doc)(rerank)
    app.post("/rerank", **rerank_doc)(rerank)

    @app.post("/v1/score", dependencies=dependencies, openapi_extra=request_body(ScoreRequest),
              responses={**ok_response(ScoreResponse, "One score per pair, in the pairs' order"), **responses})
    async def score(request: Request) -> JSONResponse:
        req = parse_request(ScoreRequest, await read_json(request))
        model = server.check_model(req.model)
        t1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        t2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if len(t1) == 1:
            t1 = t1 * len(t2)
        elif len(t2) == 1:  # many against one: each text_1 with the one text_2
            t2 = t2 * len(t1)
        if len(t1) != len(t2):
            raise ClientError(f"'text_1' has {len(t1)} texts and 'text_2' {len(t2)}: give one text on either side, "
                              "or lists of the same length", param="text_1", code="invalid_value")
        values, used = await scores(t1, t2, "text_2", request, "score")
        return JSONResponse(ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                                          data=[ScoreData(index=i, score=v) for i, v in enumerate(values)],
                                          usage=PoolingUsage(prompt_tokens=used, total_tokens=used)).model_dump())


def _renormalised(vec: list[float]) -> list[float]:
    norm = sum(x * x for x in vec) ** 0.5
    return [x / norm for x in vec] if norm > 0 else vec


async def _collect_pooled(stream: RequestStream, num: int) -> list[list[float]]:
    """Every input's pooled result, in the inputs' order."""
    final: dict[int, list[float]] = {}
    try:
        async for index, out in stream:
            if out.finished and out.pooled is not None:
                final[index] = out.pooled
    except ValueError as e:  # the engine refused an input the handler let through
        raise ClientError(str(e)) from None
    finally:
        stream.close()
    return [final[i] for i in range(num)]
