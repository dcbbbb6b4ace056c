"""Medusa heads (Cai et al., 2024): K extra decoding heads over the target's last hidden state, verified as a tree.

Head k (k = 1..K) reads the final-normed hidden state h_t of the row that produced token x_{t+1} and predicts
x_{t+1+k}:   logits_k = lm_head(SiLU(W_k h_t + b_k) + h_t),   the target's own lm_head, shared and frozen
(W_k starts at zero, so an untrained head repeats the target's next-token guess). The proposer takes each head's
top candidates and lays them out as the static tree of engine/token_tree.py (`static_tree`, from the per-rank accuracy
measured on held-out data at training time); the engine verifies the tree in one forward.

Training (`train_medusa`, `brisk spec train-medusa`) is self-distillation on the target's own greedy outputs:
the target answers chat prompts cut from real text (plain greedy decoding in the engine), and the hidden state of
every generated row is kept as it is computed. Head k's label at row t is the token the target itself generated
k steps later (the argmax it would verify), so the heads learn the target's greedy continuation, never the text's.
The target is never backpropagated through: only the heads' W_k, b_k train, over the cached hidden states.

Stored as OUT/medusa.safetensors (the heads) + OUT/medusa.json (shape, per-rank accuracy, training record).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from brisk.engine.token_tree import static_tree, tree_parents
from brisk.spec import recipe
from brisk.spec.proposer import Draft, Proposer
from brisk.spec.vocab import head_matrix
from brisk.train.progress import CountProgress

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.request import Request
    from brisk.model.loader import LoadedModel

WEIGHTS_FILE = "medusa.safetensors"
CONFIG_FILE = "medusa.json"
MAX_RANK = 8  # candidates per head the accuracy table (and so the tree) considers
MIN_SENTENCES = 64  # distinct sentences a text must give before prompts reuse them under other templates
ROW_CHUNK = 4096  # hidden-state rows per preallocated chunk while collecting self-distillation data
GENERATION_BATCH = 128  # requests in flight while the target generates data (bfloat16 answers/s level off here)
DATA_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class MedusaHeads(nn.Module):
    """K residual blocks over the hidden state: [..., H] -> [..., K, H], each to be fed to the shared lm_head."""

    def __init__(self, num_heads: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # [K, H_out, H_in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))

    @property
    def num_heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("...i,koi->...ko", h, self.weight) + self.bias  # [..., K, H]
        return F.silu(z) + h.unsqueeze(-2)


def default_heads_dir(model_path: str | Path) -> Path:
    """Where `--speculative medusa` looks without a path: inside a model folder, or next to a .gguf file."""
    p = Path(model_path)
    return p / "medusa" if p.is_dir() else p.with_name(p.name + ".medusa")


def save_heads(heads: MedusaHeads, out: Path, info: dict[str, Any], draft_vocab: torch.Tensor | None = None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {"weight": heads.weight.detach().contiguous(), "bias": heads.bias.detach().contiguous()}
    if draft_vocab is not None:
        tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(info, indent=1) + "\n")


def load_heads(path: str | Path, hidden_size: int) -> tuple[MedusaHeads, dict[str, Any], torch.Tensor | None]:
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no Medusa heads in {path} ({WEIGHTS_FILE} + {CONFIG_FILE}); train them with "
                                f"`brisk spec train-medusa MODEL {path}` or pass --speculative medusa:PATH")
    info = json.loads((path / CONFIG_FILE).read_text())
    tensors = load_file(str(path / WEIGHTS_FILE))
    k, h, _ = tensors["weight"].shape
    if h != hidden_size:
        raise ValueError(f"the Medusa heads in {path} are for hidden size {h}, the model has {hidden_size}: "
                         "train heads for this model")
    heads = MedusaHeads(k, h)
    heads.load_state_dict({"weight": tensors["weight"].float(), "bias": tensors["bias"].float()})
    heads.requires_grad_(False)
    return heads, info, tensors.get("draft_vocab")


class MedusaProposer(Proposer):
    """Drafts a static token tree from the heads' top candidates (greedy and sampled requests: engine/token_tree.py
    verifies both exactly), or the heads' top-1 chain for grammar-constrained requests (verified by speculative
    sampling with point-mass drafts under the grammar's mask)."""

    name = "medusa"
    tree = True

    def __init__(self, heads: MedusaHeads, lm_head_weight: torch.Tensor, accuracy: Sequence[Sequence[float]],
                 tree_size: int, draft_vocab: torch.Tensor | None = None, draft_cost: float = 0.1) -> None:
        from brisk.spec.vocab import int8_rows

        self.heads = heads
        k, h, _ = heads.weight.shape
        # every head's W_k as one int8 layer [K * H, H] on the engine's kernels (spec/vocab.py int8_rows): drafting
        # reads the heads' bytes at every step, a quarter of float32's
        self.blocks = int8_rows(heads.weight.detach().reshape(k * h, h).float(), "int8",
                                heads.bias.detach().reshape(-1))
        # the heads draft from the target's most frequent tokens only (draft_vocab): a [Vd, H] product per head
        # instead of the whole lm_head, whose weight read would cost a good part of a target step; int8 rows too
        self.vocab = draft_vocab
        self.lm_sub = int8_rows((lm_head_weight if draft_vocab is None
                                 else lm_head_weight.index_select(0, draft_vocab)).float())
        self.draft_cost = draft_cost
        table = [list(a)[:MAX_RANK] for a in accuracy[:heads.num_heads]]
        self.paths = static_tree(table, tree_size)
        self.parents = tree_parents(self.paths)
        self.max_rank = 1 + max((c for p in self.paths for c in p), default=0)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        out = [Draft([]) for _ in requests]
        ready = [j for j, r in enumerate(requests)
                 if r.spec_hidden is not None and r.spec_hidden_index == r.num_tokens - 1]
        if not ready:
            return out
        h = torch.stack([requests[j].spec_hidden[-1] for j in ready]).float()  # [B, H]
        k = self.heads.num_heads
        z = F.silu(self.blocks(h).view(len(ready), k, -1)) + h.unsqueeze(1)  # [B, K, H], as MedusaHeads.forward
        logits = self.lm_sub(z.reshape(-1, z.shape[-1]))  # [B * K, Vd]
        conf, top = torch.softmax(logits, dim=-1).topk(self.max_rank, dim=-1)  # [B * K, rank]
        if self.vocab is not None:
            top = self.vocab[top]
        top = top.view(len(ready), k, -1).tolist()
        conf = conf.view(len(ready), k, -1).tolist()
        for b, j in enumerate(ready):
            req = requests[j]
            cands = top[b]  # [K][rank]
            if req.structured is None:
                out[j] = self._tree(cands, conf[b], min(num_drafts[j], len(self.paths)))
            else:
                out[j] = Draft([cands[d][0] for d in range(min(num_drafts[j], k))])
        return out

    def _tree(self, cands: list[list[int]], conf: list[list[float]], n: int) -> Draft:
        """The static tree's first n paths with this step's candidates, reordered by the heads' own confidence in
        each path (the product of the heads' probabilities of its candidates; a child never above its parent, so
        any first nodes of the new order still form a tree): the speculator keeps the most confident nodes."""
        value: list[float] = []
        for p, parent in zip(self.paths[:n], self.parents[:n], strict=True):
            value.append(conf[len(p) - 1][p[-1]] * (value[parent] if parent >= 0 else 1.0))
        order = sorted(range(n), key=lambda i: -value[i])  # stable: a parent of equal value stays first
        where = {old: new for new, old in enumerate(order)}
        return Draft([cands[len(self.paths[i]) - 1][self.paths[i][-1]] for i in order],
                     parents=[-1 if self.parents[i] < 0 else where[self.parents[i]] for i in order],
                     node_probs=[value[i] for i in order])


def build_medusa_proposer(path: str | None, engine: LLMEngine, tree_size: int) -> MedusaProposer:
    model = engine.loaded.model
    check_tree_engine(engine, "medusa")
    heads, info, vocab = load_heads(path or default_heads_dir(engine.loaded.path), model.config.hidden_size)
    engine.keep_hidden_states()
    return MedusaProposer(heads, head_matrix(engine.loaded.model), info["accuracy"], tree_size, vocab)


def check_tree_engine(engine: LLMEngine, method: str) -> None:
    """Token trees need the float paged cache, full attention and one process (what tree verification covers)."""
    cache = engine.config.cache
    problems = []
    if cache.kv_cache_dtype not in ("auto", "bfloat16"):
        problems.append(f"--kv-cache-dtype {cache.kv_cache_dtype} (use auto or bfloat16)")
    if cache.kv_policy not in (None, "full", "none"):
        problems.append(f"--kv-policy {cache.kv_policy} (tree attention sees the whole cache)")
    if engine.model_config.sliding_window is not None:
        problems.append("a sliding-window model")
    rope = engine.loaded.model.rope
    if rope is not None and rope.length_dependent:
        problems.append("length-dependent RoPE scaling")
    if engine.config.tensor_parallel_size * engine.config.pipeline_parallel_size > 1:
        problems.append("tensor/pipeline parallelism")
    if problems:
        raise ValueError(f"--speculative {method} verifies token trees, which do not support " + ", ".join(problems))


# ---------------------------------------------------------------------------------------------- training data

PROMPT_TEMPLATES = [
    "Continue this story in your own words: \"{s}\"",
    "What is happening in this sentence from a novel? \"{s}\"",
    "Rewrite this sentence in modern English: \"{s}\"",
    "Write a short paragraph that begins with: \"{s}\"",
    "Give me a few thoughts on this line: \"{s}\"",
    "Explain this to a child: \"{s}\"",
    "Write a short poem inspired by this line: \"{s}\"",
    "Describe the scene in this sentence in a short paragraph: \"{s}\"",
    "What advice would you give the people in this sentence? Give a few tips. \"{s}\"",
    "Answer in a few paragraphs: what does this sentence tell us about friendship or family? \"{s}\"",
]


def training_prompts(text: str, num: int, exclude: Sequence[str] = ()) -> list[list[dict[str, str]]]:
    """`num` chat prompts, each a template around one sentence of `text`: the distinct sentences found from a grid
    of places three times as fine as `num`, then `num` of them evenly spaced (more prompts than sentences: each
    sentence again under other templates); a sentence found in (or holding) any of the `exclude` texts (evaluation
    prompts) is left out."""
    flat = " ".join(text.split())
    banned = [" ".join(e.split()) for e in exclude]
    found: list[str] = []
    used: set[str] = set()
    slots = 3 * num + 16 + len(banned)
    for i in range(slots):
        at = flat.find(". ", (i + 1) * len(flat) // (slots + 1)) + 2
        end = flat.find(". ", at + 40)
        sentence = flat[at:end + 1 if end > 0 else at + 200][:300]
        if at < 2 or len(sentence) < 20 or sentence in used or any(sentence[:60] in b or b[:60] in sentence
                                                                   for b in banned):
            continue
        used.add(sentence)
        found.append(sentence)
    if len(found) < min(num, MIN_SENTENCES):
        raise ValueError(f"the text gave only {len(found)} distinct sentences for {num} training prompts; use a "
                         "longer text")
    if num <= len(found):  # evenly spaced sentences, the templates in turn
        return [[{"role": "user", "content": PROMPT_TEMPLATES[i % len(PROMPT_TEMPLATES)].format(s=found[
            i * len(found) // num])}] for i in range(num)]
    # more prompts than sentences: every sentence again, each pass under the next template
    return [[{"role": "user", "content": PROMPT_TEMPLATES[(i + i // len(found)) % len(PROMPT_TEMPLATES)].format(
        s=found[i % len(found)])}] for i in range(num)]


# model-written prompts: the target itself writes user requests about a word of the text (self-instruct), so the
# training data also covers open questions and tasks, not only prompts built around a sentence of a novel
REQUEST_TEMPLATES = [
    "Write one question that a curious person might ask an AI assistant about {w}. Reply with the question only.",
    "Write one short request that a user might send to an AI assistant, asking for a poem, a story, some tips, an "
    "explanation or advice about {w}. Reply with the request only.",
]


def topic_words(text: str, num: int) -> list[str]:
    """`num` distinct lowercase words of 6+ letters from evenly spaced places of `text` (names, being capitalised,
    are left out)."""
    words = list(dict.fromkeys(w for w in (t.strip(".,;:!?\"'()-_") for t in text.split())
                               if len(w) >= 6 and w.isalpha() and w.islower()))
    if not words:
        raise ValueError("the text has no lowercase words of 6+ letters to write prompts about")
    return [words[i * len(words) // num] for i in range(num)] if num <= len(words) else \
        [words[i % len(words)] for i in range(num)]


def data_dtype(loaded: LoadedModel, choice: str = "auto") -> torch.dtype:
    """The precision the target generates self-distillation data in. "auto": bfloat16 where the CPU computes it
    natively (it reports avx512_bf16 or amx_bf16; 2.2x float32's rows per second on a Xeon with AMX, BENCHMARKS)
    and the target is loaded in float32, else the loaded precision. The heads still train in float32 on float32
    copies of the hidden states."""
    if choice == "auto":
        from brisk.ops.linear import native_bf16_gemm

        return torch.bfloat16 if native_bf16_gemm() and loaded.dtype == torch.float32 else loaded.dtype
    if choice not in DATA_DTYPES:
        raise ValueError(f"data dtype must be auto, {' or '.join(DATA_DTYPES)}; got {choice!r}")
    return DATA_DTYPES[choice]


def generation_model(loaded: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    """`loaded` itself where it is in `dtype`, else a second copy of its weights in `dtype` for generating data."""
    if dtype == loaded.dtype:
        return loaded
    if loaded.dummy_shape is not None:
        raise ValueError(f"random-weight models generate data in their loaded precision ({loaded.dtype}) only")
    from brisk.model.loader import load_model

    return load_model(loaded.path, dtype=dtype, show_progress=False)


def generation_engine(loaded: LoadedModel, max_len: int, batch: int) -> LLMEngine:
    """An engine on the already loaded target for batch generation: `batch` requests in flight, `max_len` tokens
    each (the self-distillation answers, the prompts the target writes), KV memory for all of them at once."""
    from brisk.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from brisk.engine.llm_engine import LLMEngine

    need = batch * max_len * loaded.config.kv_bytes_per_token(loaded.dtype.itemsize)
    kv_memory = f"{need * 5 // 4 // 2**20 + 64}MiB"  # + a margin for partly filled blocks
    return LLMEngine(EngineConfig(model=str(loaded.path), max_model_len=max_len,
                                  scheduler=SchedulerConfig(max_model_len=max_len, max_num_seqs=batch),
                                  cache=CacheConfig(kv_cache_memory=kv_memory)), loaded)


def model_written_prompts(loaded: LoadedModel, text: str, num: int, exclude: Sequence[str] = (), seed: int = 0,
                          batch: int = GENERATION_BATCH, log: Callable[[str], None] = print,
                          progress: bool = False) -> list[list[dict[str, str]]]:
    """`num` user prompts written by the target (sampled at temperature 0.8, seeded per request) about words of
    `text` (`topic_words`, the REQUEST_TEMPLATES in turn): the first line of each answer (its quoted part, if it
    quotes), kept when it is a question or a quote of 4-60 words, new, and not one of the `exclude` texts
    (evaluation prompts). Asks for three times `num` and may return fewer."""
    from brisk.engine.sampling_params import SamplingParams

    tok = loaded.tokenizer
    asks = [tok.encode_chat([{"role": "user", "content": REQUEST_TEMPLATES[i % len(REQUEST_TEMPLATES)].format(w=w)}],
                            add_generation_prompt=True) for i, w in enumerate(topic_words(text, 3 * num))]
    max_len = max(len(a) for a in asks) + 56
    engine = generation_engine(loaded, max_len, batch)
    order = [engine.add_request(None, a, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48,
                                                        seed=seed * 1_000_003 + i))
             for i, a in enumerate(asks)]
    texts: dict[str, str] = {}
    t0 = time.perf_counter()
    with CountProgress("candidate prompts", len(asks), enabled=progress) as bar:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    texts[o.request_id] = o.outputs[0].text
                    bar.advance()
                    if len(texts) % 1024 == 0:
                        log(f"the target wrote {len(texts)}/{len(asks)} candidate prompts in "
                            f"{time.perf_counter() - t0:.0f} s")
    banned = {" ".join(e.split()).lower() for e in exclude}
    out: list[list[dict[str, str]]] = []
    seen: set[str] = set()
    for rid in order:
        lines = texts.get(rid, "").strip().splitlines()
        line = " ".join(lines[0].split()) if lines else ""
        quoted = line.partition('"')[2].partition('"')[0] if line.count('"') else ""
        line = (quoted or line).strip("\"' ")
        key = line.lower()
        # a question or a quoted request; the small model often answers the instruction instead of writing one
        is_request = bool(quoted) or line.endswith("?")
        if not is_request or not 4 <= len(line.split()) <= 60 or key in seen or key in banned:
            continue
        seen.add(key)
        out.append([{"role": "user", "content": line}])
        if len(out) == num:
            break
    log(f"the target wrote {len(out)} prompts in {time.perf_counter() - t0:.0f} s")
    return out


def evaluation_prompts() -> list[str]:
    """The contents of `brisk bench spec`'s prompt sets, kept out of the training prompts."""
    from brisk.spec.bench import prompt_sets

    return [m["content"] for convs in prompt_sets(8).values() for c in convs for m in c]


@dataclass
class SelfDistillData:
    hidden: torch.Tensor  # [N, H] final hidden state of each generated row
    labels: torch.Tensor  # [N, K] the target's token k + 1 steps after that row's own (-1: past the end)
    num_prompts: int
    generate_seconds: float
    # per answer: (hidden [L, H], tokens [L]) of consecutive rows, hidden[i] the row that produced tokens[i]
    sequences: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)
    dtype: str = "float32"  # the precision the target generated in (the rows are kept in float32)


def collect_self_distill(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int, num_heads: int,
                         batch: int = GENERATION_BATCH, log: Callable[[str], None] = print,
                         progress: bool = False) -> SelfDistillData:
    """Greedy answers of the target to `prompts` (the engine, plain decoding, `batch` requests in flight), keeping
    each generated row's hidden state as computed: row t's hidden state produced token t + 1; head k's label is
    token t + 1 + k. Keeping the hidden state costs the engine nothing (the executor's last rows, any path)."""
    from brisk.engine.sampling_params import SamplingParams

    max_len = max(len(p) for p in prompts) + max_tokens + 8
    engine = generation_engine(loaded, max_len, batch)
    engine.keep_hidden_states()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # the rows go into preallocated chunks: a small tensor per row, interleaved with each step's large temporaries,
    # kept the allocator from ever returning memory (about 200 KB held per 2 KB row kept)
    hidden_size = loaded.model.config.hidden_size
    chunks: list[torch.Tensor] = []
    num_rows = 0
    rows: dict[str, dict[int, int]] = {}  # request -> token index -> its row in the chunks
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for p in prompts:
        rid = engine.add_request(None, p, params)
        rows[rid] = {}

    def keep() -> None:
        nonlocal num_rows
        for req in engine.scheduler.running:
            by_index = rows[req.request_id]
            if req.spec_hidden is None or req.spec_hidden_index in by_index:
                continue
            if num_rows % ROW_CHUNK == 0:
                chunks.append(torch.empty(ROW_CHUNK, hidden_size))
            chunks[-1][num_rows % ROW_CHUNK].copy_(req.spec_hidden[-1])
            by_index[req.spec_hidden_index] = num_rows
            num_rows += 1

    with CountProgress("answers", len(prompts), enabled=progress) as bar:
        while engine.has_unfinished_requests():
            outs = engine.step()
            keep()  # (a request that finished in this step has left `running`: its last row has nothing to learn)
            for o in outs:
                if o.finished:
                    tokens[o.request_id] = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                    bar.advance()
                    if len(tokens) % 1024 == 0:
                        log(f"generated {len(tokens)}/{len(prompts)} answers in {time.perf_counter() - t0:.0f} s")
    seconds = time.perf_counter() - t0
    store = torch.cat(chunks)[:num_rows] if chunks else torch.empty(0, hidden_size)
    order, labels, spans = [], [], []
    for rid, by_index in rows.items():
        seq = tokens[rid]
        ordered = sorted(by_index.items())
        first = ordered[0][0] if ordered else 0
        run = next((i for i, (idx, _) in enumerate(ordered) if idx != first + i), len(ordered))  # consecutive rows
        if run:
            spans.append((len(order), run, seq[first:first + run]))
        for idx, row in ordered:
            # the row produced seq[idx]; head k predicts seq[idx + k]
            labels.append([seq[idx + k] if idx + k < len(seq) else -1 for k in range(1, num_heads + 1)])
            order.append(row)
    hidden = store.index_select(0, torch.tensor(order, dtype=torch.int64)) if order else store
    del store
    chunks.clear()
    # each answer's consecutive rows are views of `hidden` (no second copy; torch.save keeps them shared)
    sequences = [(hidden[at:at + n], toks) for at, n, toks in spans]
    return SelfDistillData(hidden, torch.tensor(labels, dtype=torch.int64), len(prompts), seconds, sequences,
                           str(loaded.dtype).removeprefix("torch."))


# ---------------------------------------------------------------------------------------------- training


def head_losses(heads: MedusaHeads, lm_head_weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor
                ) -> torch.Tensor:
    """Cross-entropy of each head to its labels (the target's own later tokens, as rows of `lm_head_weight`, which
    may be the draft vocabulary's rows only; labels < 0 are ignored): [K]."""
    z = heads(hidden)  # [B, K, H]
    losses = []
    for k in range(heads.num_heads):
        logits = z[:, k] @ lm_head_weight.t()  # [B, V]
        losses.append(F.cross_entropy(logits.float(), labels[:, k].clamp_min(-1), ignore_index=-1))
    return torch.stack(losses)


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, lm_head_weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
                  max_rank: int = MAX_RANK, batch: int = 512) -> list[list[float]]:
    """accuracy[k][c]: fraction of rows whose head-k label is that head's rank-c candidate (label -1: past the end
    of the answer, not counted; -2: outside the draft vocabulary, a miss)."""
    hits = torch.zeros(heads.num_heads, max_rank)
    counts = torch.zeros(heads.num_heads)
    for i in range(0, hidden.shape[0], batch):
        z = heads(hidden[i:i + batch])
        lab = labels[i:i + batch]
        for k in range(heads.num_heads):
            top = (z[:, k] @ lm_head_weight.t()).topk(max_rank, dim=-1).indices  # [B, R]
            valid = lab[:, k] != -1
            hits[k] += (top[valid] == lab[valid, k:k + 1]).float().sum(0)
            counts[k] += valid.sum()
    return (hits / counts.clamp_min(1).unsqueeze(1)).tolist()


def fit_heads(heads: MedusaHeads, lm_head_weight: torch.Tensor,
              train: SelfDistillData | tuple[torch.Tensor, torch.Tensor], steps: int, batch_size: int = 128,
              lr: float = 1e-3, seed: int = 0, log: Callable[[str], None] | None = None,
              progress: bool = False) -> list[float]:
    """The heads' mean cross-entropy over random rows, fitted by spec/head_train.py's loop (the heads only)."""
    from brisk.spec.head_train import fit_head

    hidden, labels = (train.hidden, train.labels) if isinstance(train, SelfDistillData) else train

    def loss_fn(idx: torch.Tensor, _: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        losses = head_losses(heads, lm_head_weight, hidden[idx], labels[idx])
        return losses.mean(), {f"head {k + 1}": v for k, v in enumerate(losses.tolist())}

    return fit_head(heads, loss_fn, hidden.shape[0], steps, batch_size, lr, seed, log=log, progress=progress)


def self_distill_data(loaded: LoadedModel, text: str, num_prompts: int, max_tokens: int, num_heads: int,
                      cache: Path | None = None, log: Callable[[str], None] = print,
                      num_written: int = 0, dtype: str = "auto", progress: bool = False) -> SelfDistillData:
    """The target's greedy answers to `num_prompts` chat prompts cut from `text` and `num_written` prompts it wrote
    itself (`model_written_prompts`), with their hidden states, generated in `dtype` (`data_dtype`); read from
    `cache` when it holds data of these settings, else collected (and written there)."""
    gen_dtype = data_dtype(loaded, dtype)
    key = {"model": loaded.name, "prompts": num_prompts, "max_tokens": max_tokens, "text_chars": len(text),
           "templates": len(PROMPT_TEMPLATES), "exclude": "bench spec", "written": num_written,
           "dtype": str(gen_dtype).removeprefix("torch.")}
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved["key"] == key and saved["labels"].shape[1] >= num_heads:
            log(f"self-distillation data from {cache}")
            return SelfDistillData(saved["hidden"], saved["labels"][:, :num_heads], saved["num_prompts"],
                                   saved["generate_seconds"], list(zip(saved["seq_hidden"], saved["seq_tokens"],
                                                                       strict=True)), key["dtype"])
        log(f"{cache} holds data of other settings: collecting again")
    gen = generation_model(loaded, gen_dtype)
    if gen is not loaded:
        log(f"generating in {key['dtype']} on a second copy of the target (the heads train in float32)")
    tok = loaded.tokenizer
    conversations = training_prompts(text, num_prompts, evaluation_prompts())
    if num_written:
        conversations += model_written_prompts(gen, text, num_written, evaluation_prompts(), log=log,
                                               progress=progress)
    prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in conversations]
    log(f"generating {len(prompts)} greedy answers of up to {max_tokens} tokens with the target")
    data = collect_self_distill(gen, prompts, max_tokens, max(num_heads, 5), log=log, progress=progress)
    del gen
    if cache is not None:
        torch.save({"key": key, "hidden": data.hidden, "labels": data.labels, "num_prompts": data.num_prompts,
                    "generate_seconds": data.generate_seconds, "seq_hidden": [h for h, _ in data.sequences],
                    "seq_tokens": [t for _, t in data.sequences]}, cache)
    data.labels = data.labels[:, :num_heads]
    return data


def train_medusa(loaded: LoadedModel, text: str, out: Path, *, num_heads: int = recipe.MEDUSA_HEADS,
                 num_prompts: int = recipe.DATA_PROMPTS, max_tokens: int = recipe.DATA_MAX_TOKENS,
                 steps: int = recipe.MEDUSA_STEPS, batch_size: int = recipe.MEDUSA_BATCH, lr: float = recipe.MEDUSA_LR,
                 seed: int = 0, text_name: str = "text", log: Callable[[str], None] = print, progress: bool = True,
                 data_cache: Path | None = None, draft_vocab_size: int = recipe.DRAFT_VOCAB,
                 num_written: int = recipe.DATA_WRITTEN,
                 data_dtype: str = "auto") -> dict[str, Any]:
    """Collect self-distillation data, fit the heads, measure per-rank accuracy on held-out rows, save to `out`.

    The heads draft from the draft vocabulary only (the target's most frequent tokens, MedusaProposer), so they are
    trained and scored on its rows of the lm_head (a label outside it is left out of the loss and scored a miss):
    that is the proposer's own computation, and a [Vd, H] product instead of the whole vocabulary's."""
    from brisk.spec.eagle import draft_vocabulary
    from brisk.spec.head_train import to_draft_ids

    data = self_distill_data(loaded, text, num_prompts, max_tokens, num_heads, data_cache, log, num_written,
                             data_dtype, progress)
    n = data.hidden.shape[0]
    log(f"{n} rows of hidden states ({data.generate_seconds:.0f} s to generate)")
    vocab = draft_vocabulary(data, loaded.model.config.vocab_size, draft_vocab_size)
    labels = to_draft_ids(data.labels, vocab, loaded.model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    held = max(1, n // 10)
    test_idx, train_idx = perm[:held], perm[held:]
    weight = head_matrix(loaded.model).index_select(0, vocab).contiguous()  # [Vd, H]
    heads = MedusaHeads(num_heads, data.hidden.shape[1])
    before = rank_accuracy(heads, weight, data.hidden[test_idx], labels[test_idx])
    t0 = time.perf_counter()
    history = fit_heads(heads, weight, (data.hidden[train_idx], labels[train_idx]), steps, batch_size, lr, seed,
                        log=log, progress=progress)
    train_seconds = time.perf_counter() - t0
    accuracy = rank_accuracy(heads, weight, data.hidden[test_idx], labels[test_idx])
    info = {
        "method": "medusa", "num_heads": num_heads, "hidden_size": data.hidden.shape[1],
        "source_model": loaded.name, "accuracy": accuracy, "accuracy_untrained": before,
        "data": {"text": text_name, "prompts": num_prompts, "written_prompts": data.num_prompts - num_prompts,
                 "max_tokens": max_tokens, "rows": n, "held_out": held, "dtype": data.dtype,
                 "labels": "the target's own greedy tokens (self-distillation)",
                 "generate_seconds": round(data.generate_seconds, 1)},
        "training": {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                     "seconds": round(train_seconds, 1), "loss_first": history[0], "loss_last": history[-1]},
        "draft_vocab_size": int(vocab.numel()),
    }
    save_heads(heads, out, info, vocab)
    (out / "train_log.json").write_text(json.dumps({"loss": history}) + "\n")
    from brisk.train.progress import write_loss_curve

    write_loss_curve(out / "loss.png", [{"step": i + 1, "loss": v} for i, v in enumerate(history)])
    return info
