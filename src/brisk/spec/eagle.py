"""EAGLE (Li et al., 2024): a one-layer autoregressive draft over the target's features, drafting a token tree.

The head is one decoder layer (RMSNorm, grouped-query attention with RoPE, SiLU-gated MLP, the target's shapes)
over fc(concat(f_t, E[x_{t+1}])): the feature f_t of the row that produced token x_{t+1} (the target's final
hidden state, the same rows Medusa reads) and that token's embedding (the target's, frozen). Its output is its
guess of f_{t+1}, and the target's frozen lm_head turns that into a guess of x_{t+2}. Drafting is autoregressive
on the head's own features: each tree node's feature feeds its children.

Training (`train_eagle`, `brisk spec train-eagle`): the same self-distillation data as Medusa (the target's
greedy answers to chat prompts cut from real text, every generated row's hidden state kept). On windows of
consecutive rows the head is fitted with smooth-L1 to the next feature plus 0.1 x cross-entropy of lm_head(its
feature) to the target's own next token; the target is never backpropagated through.

Inference (`EagleProposer`): per request the head keeps its own small K/V over the features of all tokens since
the request started decoding with it (fed with every step's emitted tokens and the rows that produced them).
Each step it expands a tree best-first by path probability (EAGLE-2's confidence): `depth` rounds, each one
forward of the head over the `width` most probable frontier nodes (tree-masked over its cache) and `top_k`
children each from the lm_head restricted to the `draft_vocab` most frequent target tokens (stored with the
head; the full 49k-row lm_head per node would cost more than the target step it saves). The N most probable
nodes form the draft (a prefix-closed set, parents first), verified by the target as any token tree.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from brisk.spec import recipe
from brisk.spec.proposer import Draft, Proposer

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.request import Request
    from brisk.model.loader import LoadedModel
    from brisk.spec.medusa import SelfDistillData

WEIGHTS_FILE = "eagle.safetensors"
CONFIG_FILE = "eagle.json"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class EagleHead(nn.Module):
    """fc(concat(feature, embedding)) -> one decoder layer -> the next feature. Batched over [B, T] rows."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int,
                 eps: float = 1e-5, rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.shape = {"hidden": hidden, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "intermediate": intermediate, "eps": eps, "rope_theta": rope_theta}
        self.h, self.kvh, self.d, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.fc = nn.Linear(2 * hidden, hidden)
        self.input_norm = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.post_norm = nn.Parameter(torch.ones(hidden))
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        inv = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, d], pos [T] -> rotate-half RoPE at those positions."""
        ang = pos.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos, sin = ang.cos(), ang.sin()
        half = self.d // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, feat: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None = None, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """feat, emb [B, T, H]; pos [T]; past K/V [B, kvh, L, d]; mask [T, L + T] bool (None: causal, no past).
        Returns (next features [B, T, H], this call's K and V [B, kvh, T, d])."""
        b, t, _ = feat.shape
        x = self.fc(torch.cat([feat, emb], dim=-1))
        y = _rms(x, self.input_norm, self.eps)
        q = self._rope(self.q_proj(y).view(b, t, self.h, self.d).transpose(1, 2), pos)
        k = self._rope(self.k_proj(y).view(b, t, self.kvh, self.d).transpose(1, 2), pos)
        v = self.v_proj(y).view(b, t, self.kvh, self.d).transpose(1, 2)
        ks, vs = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        if mask is None:
            o = F.scaled_dot_product_attention(q, ks, vs, is_causal=True, enable_gqa=self.h != self.kvh)
        else:
            o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, enable_gqa=self.h != self.kvh)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.d))
        y = _rms(x, self.post_norm, self.eps)
        x = x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))
        return x, k, v


LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_head(head: EagleHead) -> EagleHead:
    """A copy of `head` for drafting: its linears rounded to int8 per row on the engine's int8 kernels (spec/vocab.py
    `int8_rows`), a sixth of float32's time per call at the few rows a draft round has. The head is small and each
    draft round reads all of it, so its bytes are the round's cost."""
    from brisk.spec.vocab import int8_rows

    fast = copy.deepcopy(head)
    for name in LINEARS:
        lin = getattr(head, name)
        setattr(fast, name, int8_rows(lin.weight.detach().float(), "int8", lin.bias))
    return fast.requires_grad_(False)


def head_for(config: Any) -> EagleHead:
    """An untrained head of the target model config's shapes."""
    return EagleHead(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                     config.head_dim or config.hidden_size // config.num_attention_heads, config.intermediate_size,
                     config.rms_norm_eps, config.rope_theta)


def default_eagle_dir(model_path: str | Path) -> Path:
    p = Path(model_path)
    return p / "eagle" if p.is_dir() else p.with_name(p.name + ".eagle")


def save_eagle(head: EagleHead, draft_vocab: torch.Tensor, out: Path, info: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    tensors["draft_vocab"] = draft_vocab.to(torch.int64).contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps({**info, "shape": head.shape}, indent=1) + "\n")


def load_eagle(path: str | Path, hidden_size: int) -> tuple[EagleHead, torch.Tensor, dict[str, Any]]:
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no EAGLE head in {path} ({WEIGHTS_FILE} + {CONFIG_FILE}); train one with "
                                f"`brisk spec train-eagle MODEL {path}` or pass --speculative eagle:PATH")
    info = json.loads((path / CONFIG_FILE).read_text())
    if info["shape"]["hidden"] != hidden_size:
        raise ValueError(f"the EAGLE head in {path} is for hidden size {info['shape']['hidden']}, the model has "
                         f"{hidden_size}: train a head for this model")
    tensors = load_file(str(path / WEIGHTS_FILE))
    vocab = tensors.pop("draft_vocab")
    head = EagleHead(**info["shape"])
    head.load_state_dict(tensors)
    head.requires_grad_(False)
    return head, vocab, info


# ---------------------------------------------------------------------------------------------- inference


@dataclass
class _State:
    base: int  # token index whose pair is at the head's position 0
    next_index: int  # token index of the next pair to feed
    k: torch.Tensor  # [1, kvh, L, d]
    v: torch.Tensor


class EagleProposer(Proposer):
    name = "eagle"
    tree = True

    def __init__(self, head: EagleHead, embed: nn.Module, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor,
                 tree_size: int, depth: int = 6, width: int = 4, top_k: int = 4, draft_cost: float = 0.3,
                 context: int | None = None) -> None:
        """`context`: the most earlier (feature, token) pairs the head attends to, the training window's length
        less one (it never saw longer contexts; None: all since the request started drafting)."""
        from brisk.spec.vocab import int8_rows

        self.head = int8_head(head)
        self.embed = embed
        self.vocab = draft_vocab
        self.lm_sub = int8_rows(lm_head_weight.index_select(0, draft_vocab).float())  # [H] -> [Vd]
        self.tree_size, self.depth, self.width, self.top_k = tree_size, depth, width, top_k
        self.context = context
        self.draft_cost = draft_cost
        self.states: dict[str, _State] = {}

    def free(self, req_ids: Any) -> None:
        for r in req_ids:
            self.states.pop(r, None)

    def live_ids(self) -> set[str]:
        return set(self.states)

    def _emb(self, ids: list[int]) -> torch.Tensor:
        return self.embed(torch.tensor(ids)).float()

    def _feed(self, req: Request) -> torch.Tensor | None:
        """Feed the last step's (feature, token) pairs to the head's cache; the last pair's output feature."""
        if req.spec_hidden is None or req.spec_hidden_index != req.num_tokens - 1:
            return None
        n = req.spec_hidden.shape[0]
        first = req.spec_hidden_index - n + 1
        st = self.states.get(req.request_id)
        if st is None or st.next_index != first:  # new, or a gap (preemption, forced tokens): start over here
            kvh, d = self.head.kvh, self.head.d
            st = _State(first, first, torch.zeros(1, kvh, 0, d), torch.zeros(1, kvh, 0, d))
            self.states[req.request_id] = st
        feat = req.spec_hidden.float().unsqueeze(0)  # [1, n, H]
        emb = self._emb(req.all_token_ids[first:first + n]).unsqueeze(0)
        past_len = st.k.shape[2]
        pos = torch.arange(first - st.base, first - st.base + n)
        mask = torch.ones(n, past_len + n, dtype=torch.bool)
        mask[:, past_len:] = torch.ones(n, n, dtype=torch.bool).tril()
        out, k, v = self.head(feat, emb, pos, (st.k, st.v), mask)
        st.k, st.v = torch.cat([st.k, k], 2), torch.cat([st.v, v], 2)
        if self.context is not None and st.k.shape[2] > self.context:  # keys keep their RoPE positions
            st.k, st.v = st.k[:, :, -self.context:].contiguous(), st.v[:, :, -self.context:].contiguous()
        st.next_index = first + n
        return out[0, -1]

    def _top(self, feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(self.lm_sub(feats), dim=-1)  # [n, Vd]
        val, idx = logp.topk(k, dim=-1)
        return val, self.vocab[idx]

    def _tree(self, req: Request, f_root: torch.Tensor, size: int) -> Draft:
        st = self.states[req.request_id]
        root_pos = req.num_tokens - 1 - st.base
        # nodes: (cumulative logp, depth, token, parent); parent -1 = root
        nodes: list[tuple[float, int, int, int]] = []
        val, tok = self._top(f_root.unsqueeze(0), self.top_k)
        for lp, t in zip(val[0].tolist(), tok[0].tolist(), strict=True):
            nodes.append((lp, 1, t, -1))
        frontier = list(range(len(nodes)))
        feat_of: dict[int, torch.Tensor] = {-1: f_root}
        kv_rows: dict[int, int] = {}  # node -> its row in the tree K/V
        tk = torch.zeros(1, self.head.kvh, 0, self.head.d)
        tv = torch.zeros_like(tk)
        past = st.k.shape[2]
        for depth in range(1, self.depth):
            frontier = sorted(frontier, key=lambda i: -nodes[i][0])[:self.width]
            if len(nodes) >= size:
                # a child is never more probable than its parent: a frontier node no more probable than the
                # size-th best node so far cannot bring a node into the draft (EAGLE-2's pruning, exact here)
                bar = sorted((n[0] for n in nodes), reverse=True)[size - 1]
                frontier = [i for i in frontier if nodes[i][0] > bar]
            if not frontier:
                break
            feats = torch.stack([feat_of[nodes[i][3]] for i in frontier]).unsqueeze(0)
            emb = self._emb([nodes[i][2] for i in frontier]).unsqueeze(0)
            n_old = tk.shape[2]
            m = len(frontier)
            mask = torch.zeros(m, past + n_old + m, dtype=torch.bool)
            mask[:, :past] = True
            for r, i in enumerate(frontier):
                a = nodes[i][3]
                while a >= 0:
                    mask[r, past + kv_rows[a]] = True
                    a = nodes[a][3]
                mask[r, past + n_old + r] = True
            pos = torch.full((m,), root_pos + depth)
            out, k, v = self.head(feats, emb, pos, (torch.cat([st.k, tk], 2), torch.cat([st.v, tv], 2)), mask)
            tk, tv = torch.cat([tk, k], 2), torch.cat([tv, v], 2)
            val, tok = self._top(out[0], self.top_k)
            new = []
            for r, i in enumerate(frontier):
                kv_rows[i] = n_old + r
                feat_of[i] = out[0, r]
                for lp, t in zip(val[r].tolist(), tok[r].tolist(), strict=True):
                    nodes.append((nodes[i][0] + lp, depth + 1, t, i))
                    new.append(len(nodes) - 1)
            frontier = new
        # the `size` most probable nodes: prefix-closed (a child is never more probable than its parent)
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1]))[:size]
        keep = {i: j for j, i in enumerate(sorted(order, key=lambda i: (-nodes[i][0], nodes[i][1])))}
        tokens, parents, probs = [], [], []
        for i in sorted(keep, key=keep.get):
            p = nodes[i][3]
            assert p < 0 or p in keep, "a kept node's parent was dropped"
            tokens.append(nodes[i][2])
            parents.append(-1 if p < 0 else keep[p])
            probs.append(math.exp(nodes[i][0]))
        return Draft(tokens, parents=parents, node_probs=probs)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        out = []
        for req, k in zip(requests, num_drafts, strict=True):
            f = self._feed(req)
            if f is None:
                out.append(Draft([]))
            elif req.structured is None:  # greedy or sampled: engine/token_tree.py verifies both exactly
                out.append(self._tree(req, f, k))
            else:  # the head's greedy chain, verified by speculative sampling under the grammar's mask
                out.append(self._chain(req, f, min(k, self.depth)))
        return out

    def _chain(self, req: Request, f: torch.Tensor, k: int) -> Draft:
        st = self.states[req.request_id]
        pos0 = req.num_tokens - 1 - st.base
        tokens: list[int] = []
        ks, vs = st.k, st.v
        for d in range(k):
            tok = int(self._top(f.unsqueeze(0), 1)[1][0, 0])
            tokens.append(tok)
            if d == k - 1:
                break
            out, kk, vv = self.head(f.view(1, 1, -1), self._emb([tok]).unsqueeze(0), torch.tensor([pos0 + d + 1]),
                                    (ks, vs), torch.ones(1, ks.shape[2] + 1, dtype=torch.bool))
            ks, vs = torch.cat([ks, kk], 2), torch.cat([vs, vv], 2)
            f = out[0, 0]
        return Draft(tokens)


def build_eagle_proposer(path: str | None, engine: LLMEngine, tree_size: int) -> EagleProposer:
    from brisk.spec.medusa import check_tree_engine
    from brisk.spec.vocab import head_matrix

    check_tree_engine(engine, "eagle")
    model = engine.loaded.model
    head, vocab, info = load_eagle(path or default_eagle_dir(engine.loaded.path), model.config.hidden_size)
    engine.keep_hidden_states()
    window = info.get("training", {}).get("window")
    return EagleProposer(head, model.model.embed_tokens, head_matrix(engine.loaded.model), vocab, tree_size,
                         context=None if window is None else window - 1)


# ---------------------------------------------------------------------------------------------- training


@dataclass
class EagleWindows:
    """Training windows over the answers' hidden rows, gathered per batch (the windows overlap by half: stacking
    them all would hold every row twice more). Window n is rows[first[n]:first[n] + W + 1]: feature i produced
    token i (tokens[n, i]); starts[n] is its first row's place in its answer."""

    rows: torch.Tensor  # [R, H]
    first: torch.Tensor  # [N] int64
    tokens: torch.Tensor  # [N, W + 1]
    starts: torch.Tensor  # [N]

    def __len__(self) -> int:
        return self.first.shape[0]

    def features(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """[len(idx), W + 1, H] (idx None: all windows)."""
        first = self.first if idx is None else self.first[idx]
        return self.rows[first[:, None] + torch.arange(self.tokens.shape[1])]


def _answer_rows(data: SelfDistillData, answers: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """(rows, each answer's first row in them): data.hidden itself where the answers' rows are views of it (as
    collected and as read back from a cache), else their concatenation."""
    base, h = data.hidden, data.hidden.shape[-1]
    seqs = [data.sequences[a][0] for a in answers]
    if base.dim() == 2 and base.is_contiguous() and all(
            s.is_contiguous() and s.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for s in seqs):
        return base, [(s.storage_offset() - base.storage_offset()) // h for s in seqs]
    offsets = [0]
    for s in seqs[:-1]:
        offsets.append(offsets[-1] + s.shape[0])
    return torch.cat(seqs) if seqs else base[:0], offsets


def eagle_windows(data: SelfDistillData, window: int, answers: Sequence[int] | None = None) -> EagleWindows:
    """The windows of `window` + 1 consecutive rows of each answer (`answers`: those answers only), overlapping
    by half."""
    answers = range(len(data.sequences)) if answers is None else answers
    rows, offsets = _answer_rows(data, answers)
    first, toks, starts = [], [], []
    for a, at in zip(answers, offsets, strict=True):
        h, t = data.sequences[a]
        for s in range(0, h.shape[0] - window, window // 2):
            first.append(at + s)
            toks.append(torch.tensor(t[s:s + window + 1]))
            starts.append(s)
    if not first:
        raise ValueError(f"no answer is longer than the window of {window} tokens; generate longer answers")
    return EagleWindows(rows, torch.tensor(first), torch.stack(toks), torch.tensor(starts))


def eagle_loss(head: EagleHead, embed: nn.Module, lm_head_weight: torch.Tensor, feats: torch.Tensor,
               toks: torch.Tensor, start: int = 0, noise: float = 0.0, generator: torch.Generator | None = None,
               targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """feats [B, W + 1, H], toks [B, W + 1]: from pair i = (feature i, token i) predict feature i + 1 (smooth L1)
    and token i + 1 (cross-entropy of the lm_head, weight 0.1). `targets` [B, W + 1]: toks as rows of
    `lm_head_weight` when that is the draft vocabulary's rows only (-2: outside it, left out of the CE)."""
    inp = feats[:, :-1]
    if noise:
        inp = inp + noise * torch.randn(inp.shape, generator=generator) * inp.std()
    with torch.no_grad():
        emb = embed(toks[:, :-1]).float()
    w = inp.shape[1]
    out, _, _ = head(inp, emb, torch.arange(start, start + w))
    reg = F.smooth_l1_loss(out, feats[:, 1:])
    logits = out @ lm_head_weight.t()
    labels = (toks if targets is None else targets)[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).clamp_min(-1),
                         ignore_index=-1)
    acc = (logits.argmax(-1) == labels).float().mean()
    return reg + 0.1 * ce, {"feature": reg.item(), "token CE": ce.item(), "top-1": acc.item()}


def fit_eagle(head: EagleHead, embed: nn.Module, lm_head_weight: torch.Tensor, data: SelfDistillData, steps: int,
              window: int = 32, batch_size: int = 8, lr: float = 1e-3, seed: int = 0, noise: float = 0.05,
              log: Callable[[str], None] | None = None, progress: bool = False,
              answers: Sequence[int] | None = None, draft_vocab: torch.Tensor | None = None) -> list[float]:
    """Fit the head on windows of `answers` (default all) by spec/head_train.py's loop; with `draft_vocab` the
    token CE is over those rows of `lm_head_weight` only (what the proposer drafts from)."""
    from brisk.spec.head_train import fit_head, to_draft_ids

    win = eagle_windows(data, window, answers)
    toks = win.tokens
    weight, targets = lm_head_weight, None
    if draft_vocab is not None:
        weight = lm_head_weight.index_select(0, draft_vocab).contiguous()
        targets = to_draft_ids(toks, draft_vocab, lm_head_weight.shape[0])

    def loss_fn(idx: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        return eagle_loss(head, embed, weight, win.features(idx), toks[idx], noise=noise, generator=g,
                          targets=None if targets is None else targets[idx])

    return fit_head(head, loss_fn, len(win), steps, batch_size, lr, seed, rows_per_item=window, log=log,
                    progress=progress)


@torch.no_grad()
def eagle_accuracy(head: EagleHead, embed: nn.Module, lm_head_weight: torch.Tensor, data: SelfDistillData,
                   answers: Sequence[int], window: int, draft_vocab: torch.Tensor, depth: int = 4,
                   chunk: int = 256) -> list[float]:
    """Held-out top-1 accuracy of the head's chain at draft depth 1..`depth`, as the proposer drafts: at each
    window position the true features and tokens up to there, then the head's own features and greedy tokens
    (from the draft vocabulary). accuracy[d]: fraction of positions whose first d + 1 drafted tokens all equal the
    target's. A token outside the draft vocabulary is a miss."""
    from brisk.spec.head_train import to_draft_ids

    win = eagle_windows(data, window, answers)
    weight = lm_head_weight.index_select(0, draft_vocab)
    targets = to_draft_ids(win.tokens, draft_vocab, lm_head_weight.shape[0])  # [N, W + 1]
    hits = torch.zeros(depth)
    for at in range(0, len(win), chunk):  # a chunk of windows at a time: the head's activations stay small
        idx = torch.arange(at, min(at + chunk, len(win)))
        hits += _chain_hits(head, embed, weight, draft_vocab, win.features(idx), win.tokens[idx], targets[idx],
                            window - depth, depth)
    return (hits / (len(win) * (window - depth))).tolist()


def _chain_hits(head: EagleHead, embed: nn.Module, weight: torch.Tensor, draft_vocab: torch.Tensor,
                feats: torch.Tensor, toks: torch.Tensor, targets: torch.Tensor, w: int, depth: int) -> torch.Tensor:
    """eagle_accuracy over one chunk of windows: [depth] counts of positions whose first d + 1 drafts all hit."""
    n = feats.shape[0]
    emb = embed(toks).float()
    out, k, v = head(feats[:, :w], emb[:, :w], torch.arange(w))  # teacher-forced prefix: [N, w, H]
    f = out  # feature guesses at every position
    alive = torch.ones(n, w, dtype=torch.bool)
    hits = torch.zeros(depth)
    ks, vs = k, v
    for d in range(depth):
        guess = (f @ weight.t()).argmax(-1)  # [N, w] draft-vocabulary rows
        alive &= guess == targets[:, 1 + d:1 + d + w]
        hits[d] = alive.sum()
        if d == depth - 1:
            break
        # the next round: each position's own guess as input, attending to the true prefix and its own chain
        e = embed(draft_vocab[guess]).float()
        pos = torch.arange(w) + d + 1
        mask = torch.zeros(w, ks.shape[2] + w, dtype=torch.bool)
        mask[:, :w] = torch.ones(w, w, dtype=torch.bool).tril()  # the true rows up to each position
        for j in range(1, d + 1):  # the position's own earlier chain rows
            mask[:, w * j:w * (j + 1)] = torch.eye(w, dtype=torch.bool)
        mask[:, ks.shape[2]:] = torch.eye(w, dtype=torch.bool)
        f, k, v = head(f, e, pos, (ks, vs), mask)
        ks, vs = torch.cat([ks, k], 2), torch.cat([vs, v], 2)
    return hits


def draft_vocabulary(data: SelfDistillData, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` tokens the target generated most often (ties and unseen tokens by id): the head drafts only
    these, so each drafted node costs a [size, H] product, not the whole lm_head."""
    from brisk.spec.vocab import most_frequent, token_counts

    return most_frequent(token_counts((torch.tensor(t, dtype=torch.int64) for _, t in data.sequences), vocab_size),
                         size)


def train_eagle(loaded: LoadedModel, text: str, out: Path, *, num_prompts: int = recipe.DATA_PROMPTS,
                max_tokens: int = recipe.DATA_MAX_TOKENS, steps: int = recipe.EAGLE_STEPS,
                window: int = recipe.EAGLE_WINDOW, batch_size: int = recipe.EAGLE_BATCH, lr: float = recipe.EAGLE_LR,
                seed: int = 0, draft_vocab_size: int = recipe.DRAFT_VOCAB, text_name: str = "text",
                log: Callable[[str], None] = print, progress: bool = True, data_cache: Path | None = None,
                num_written: int = recipe.DATA_WRITTEN,
                data_dtype: str = "auto") -> dict[str, Any]:
    """Collect (or read) self-distillation data, fit the head on 90% of the answers, measure its chain's top-1
    accuracy per depth on the other 10% (whole answers held out), save to `out`."""
    from brisk.spec.medusa import self_distill_data
    from brisk.spec.vocab import head_matrix

    data = self_distill_data(loaded, text, num_prompts, max_tokens, 1, data_cache, log, num_written, data_dtype,
                             progress)
    torch.manual_seed(seed)
    order = torch.randperm(len(data.sequences), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, len(order) // 10) if len(order) > 1 else 0
    test, train = sorted(order[:held]), sorted(order[held:])
    head = head_for(loaded.model.config)
    weight = head_matrix(loaded.model)
    embed = loaded.model.model.embed_tokens
    vocab = draft_vocabulary(data, loaded.model.config.vocab_size, draft_vocab_size)
    t0 = time.perf_counter()
    history = fit_eagle(head, embed, weight, data, steps, window, batch_size, lr, seed, log=log, progress=progress,
                        answers=train, draft_vocab=vocab)
    seconds = time.perf_counter() - t0
    accuracy = eagle_accuracy(head, embed, weight, data, test, window, vocab) if test else []
    info = {"method": "eagle", "source_model": loaded.name,
            "data": {"text": text_name, "prompts": num_prompts, "written_prompts": data.num_prompts - num_prompts,
                     "max_tokens": max_tokens,
                     "rows": int(data.hidden.shape[0]), "held_out_answers": held, "dtype": data.dtype,
                     "labels": "the target's own greedy tokens and hidden states (self-distillation)",
                     "generate_seconds": round(data.generate_seconds, 1)},
            "training": {"steps": steps, "window": window, "batch_size": batch_size, "lr": lr, "seed": seed,
                         "seconds": round(seconds, 1), "loss_first": history[0], "loss_last": history[-1]},
            "chain_accuracy": accuracy, "draft_vocab_size": int(vocab.numel())}
    save_eagle(head, vocab, out, info)
    (out / "train_log.json").write_text(json.dumps({"loss": history}) + "\n")
    from brisk.train.progress import write_loss_curve

    write_loss_curve(out / "loss.png", [{"step": i + 1, "loss": v} for i, v in enumerate(history)])
    return info
