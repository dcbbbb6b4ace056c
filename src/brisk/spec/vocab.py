"""Draft vocabularies: a draft proposes only the target's most frequent tokens, so its head is a slice of rows.

A small draft model spends much of its step in the lm_head: on the default model the head is 49,152 x 576, as
many weights as 8 of its 30 decoder layers. Medusa and EAGLE already draft from the ~8k tokens the target
generates most often (FastDraft and EAGLE-2 do the same); a distilled draft model does too when its folder holds
`draft_vocab.safetensors` (one int64 tensor `draft_vocab`, sorted token ids; `brisk distill --draft-vocab N`
writes it, `brisk quantize` carries it over). The draft then computes logits for those rows only and the
proposer scatters them into the full vocabulary with -inf elsewhere:

  - greedy: the draft proposes its argmax within the vocabulary; verification against the target decides, so
    the output is unchanged (a token outside the vocabulary is simply never drafted);
  - sampling: q is zero outside the vocabulary and rejection sampling against the target's p stays exact
    (Leviathan et al.: any q works, only the acceptance rate moves).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

VOCAB_FILE = "draft_vocab.safetensors"


class DraftVocabError(ValueError):
    """A draft vocabulary file that cannot be used with this model."""


def most_frequent(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` token ids with the largest counts (ties and unseen tokens by id), `always` among them (e.g. the
    end-of-sequence tokens, which a draft must be able to propose), sorted: int64 [min(size, vocabulary)]. The
    size is kept exact (8192, not 8193) so the head's rows fill the kernels' 16-row tiles."""
    if size < 1:
        raise DraftVocabError(f"a draft vocabulary needs at least 1 token, got {size}")
    size = min(size, counts.numel())
    forced = torch.tensor(sorted({t for t in always if 0 <= t < counts.numel()}), dtype=torch.int64)[:size]
    score = counts.double().clone()
    score[forced] = float("inf")
    return torch.argsort(-score, stable=True)[:size].sort().values


def token_counts(sequences: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences` (tensors of ids): float64 [vocab_size]."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in sequences:
        flat = seq.reshape(-1).to(torch.int64)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float64))
    return counts


def save_vocab(folder: str | Path, vocab: torch.Tensor) -> Path:
    path = Path(folder) / VOCAB_FILE
    save_file({"draft_vocab": vocab.to(torch.int64).contiguous()}, str(path))
    return path


def load_vocab(folder: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary stored in a model folder (None when it holds none), checked against the model."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    try:
        vocab = load_file(str(path))["draft_vocab"]
    except Exception as e:  # a truncated or foreign file
        raise DraftVocabError(f"{path} is not a draft vocabulary ({e}); delete it to draft over the whole "
                              "vocabulary, or write it again with brisk distill --draft-vocab") from None
    if vocab.dtype != torch.int64 or vocab.dim() != 1 or vocab.numel() == 0:
        raise DraftVocabError(f"{path}: expected a non-empty int64 vector of token ids, got {vocab.dtype} "
                              f"{tuple(vocab.shape)}")
    if bool((vocab < 0).any()) or int(vocab.max()) >= vocab_size or bool((vocab[1:] <= vocab[:-1]).any()):
        raise DraftVocabError(f"{path}: token ids must be sorted, distinct and below the model's vocabulary size "
                              f"{vocab_size}")
    return vocab


def head_matrix(model: nn.Module) -> torch.Tensor:
    """A model's lm_head as a dense float32 [V, H] matrix, whatever its format (float, packed codes, kernels)."""
    lm = model.lm_head
    w = getattr(lm, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point() and w.layout == torch.strided:
        return w.detach().float()
    eye = torch.eye(model.config.hidden_size)
    with torch.inference_mode():
        return lm(eye).t().contiguous().float().clone()  # the head applied to the basis: its columns


def restrict_head(model: nn.Module, vocab: torch.Tensor) -> None:
    """Replace `model.lm_head` by its rows `vocab` (its logits [N, len(vocab)] then stand for those tokens), in
    the head's own format: a quantized head becomes an int8 per-row head of those rows (the checkpoints' head
    setting; an 8-bit head's rows re-round to themselves), a float one a float head. The embedding is untouched,
    so a tied model is untied (the draft reads any input token)."""
    from brisk.ops.layers import FastLinear
    from brisk.quant.layers import QuantLinear

    old = model.lm_head
    weight = head_matrix(model).index_select(0, vocab.to(torch.int64))  # [Vd, H]
    h = weight.shape[1]
    if isinstance(old, QuantLinear):
        head = int8_rows(weight, old.quant_activations)
        if hasattr(old, "auto_activations"):
            head.auto_activations = old.auto_activations
    else:
        dtype = next((p.dtype for p in old.parameters() if p.is_floating_point()), torch.float32)
        head = FastLinear(h, weight.shape[0], bias=False, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(weight.to(dtype))
        head.requires_grad_(False)
    model.lm_head = head
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)


def int8_rows(weight: torch.Tensor, activations: str = "int8", bias: torch.Tensor | None = None) -> nn.Module:
    """A linear layer of `weight` [N, K] rounded to int8 per row (the checkpoints' head format, quant/rtn.py
    HEAD_DEFAULT) on the engine's quantized kernels, tiled: a quarter of float32's bytes to read per call, and with
    `activations` "int8" integer dot products. For the small layers drafting runs at every step (the draft's
    restricted head, EAGLE's layer), whose cost is their weights' bytes."""
    from brisk.quant.checkpoint import quant_linear
    from brisk.quant.layers import tile_quantized_layers
    from brisk.quant.rtn import HEAD_DEFAULT, quantize_layer

    parts = quantize_layer(weight, HEAD_DEFAULT)
    if bias is not None:
        parts["bias"] = bias.detach().float()
    layer = quant_linear([parts], HEAD_DEFAULT, weight.shape[1], torch.float32)
    layer.quant_activations = activations
    tile_quantized_layers(layer)
    layer.requires_grad_(False)
    return layer
