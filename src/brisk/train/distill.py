"""Knowledge distillation: a student learns the teacher's next-token distribution on a text.

loss = alpha * T^2 * KL(teacher || student) at temperature T + (1 - alpha) * cross-entropy on the text
       [+ hidden_weight * normalized MSE between mapped layers' residual streams]

The teacher's logits are computed on the fly for each batch (no gradient). Students:
  - any float checkpoint that shares the teacher's tokenizer: a structured-pruned teacher (recovery), another
    config of the same family;
  - a shallower copy of the teacher, initialised from some of its layers (`teacher_layers_student`, the
    DistilBERT recipe), e.g. to serve as a speculative draft.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import LoadedModel, build_model
from brisk.prune.checkpoint import model_tensors
from brisk.train.forward import causal_lm_forward, head_logits
from brisk.train.losses import head_loss, hidden_state_loss, next_token_labels
from brisk.train.trainer import LossFn


class DistillError(ValueError):
    """The teacher and the student cannot be distilled into each other (tokenizer, vocabulary, hidden size)."""


def check_same_tokenizer(teacher: LoadedModel, student: LoadedModel) -> None:
    """KL between the two distributions only means something when token id i is the same token in both."""
    t, s = teacher.tokenizer, student.tokenizer
    if teacher.config.vocab_size != student.config.vocab_size:
        raise DistillError(f"the student's vocabulary has {student.config.vocab_size} entries and the teacher's "
                           f"{teacher.config.vocab_size}: a student must share the teacher's tokenizer")
    if t.vocab_size != s.vocab_size or t.convert_ids_to_tokens(list(range(t.vocab_size))) != \
            s.convert_ids_to_tokens(list(range(s.vocab_size))):
        raise DistillError(f"the student ({student.name}) has a different tokenizer from the teacher "
                           f"({teacher.name}): the same token id must be the same token in both")


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'every:K' -> teacher layers 0, K, 2K, ...; 'layers:0,4,8' -> those layers (in order, each once)."""
    kind, _, value = spec.partition(":")
    try:
        if kind == "every":
            k = int(value)
            if k < 1:
                raise ValueError
            layers = list(range(0, num_layers, k))
        elif kind == "layers":
            layers = [int(x) for x in value.split(",") if x.strip()]
        else:
            raise ValueError
    except ValueError:
        raise DistillError(f"student layers {spec!r}: expected 'every:K' (K >= 1) or 'layers:I,J,...'") from None
    if not layers or any(not 0 <= i < num_layers for i in layers) or layers != sorted(set(layers)):
        raise DistillError(f"student layers {spec!r}: need increasing, distinct teacher layers in 0..{num_layers - 1}")
    return layers


def teacher_layers_student(teacher: LoadedModel, layers: list[int]) -> LoadedModel:
    """A student with the teacher's embeddings, final norm and head and the given teacher layers, copied (the
    student trains its own weights; the teacher is left untouched)."""
    c = teacher.config
    # per-layer settings follow their layers: gemma3's sliding / global pattern, which layers are MoE
    per_layer: dict = {}
    if c.layer_types is not None:
        per_layer["layer_types"] = [c.layer_types[i] for i in layers]
    if c.is_moe:
        per_layer |= {"decoder_sparse_step": 1,
                      "mlp_only_layers": [j for j, i in enumerate(layers) if not c.is_moe_layer(i)]}
    config = dataclasses.replace(c, num_hidden_layers=len(layers), **per_layer)
    tensors = {}
    for name, value in model_tensors(teacher.model, teacher.config).items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in layers:
                continue
            name = f"model.layers.{layers.index(int(index))}.{rest}"
        tensors[name] = value.clone()
    start = time.perf_counter()
    model = build_model(config, tensors, torch.float32)
    model.init_rope(config.max_position_embeddings)
    return LoadedModel(model, config, teacher.tokenizer, teacher.path, torch.float32, time.perf_counter() - start,
                       generation_config=dict(teacher.generation_config))


def default_layer_map(num_student: int, num_teacher: int, student_layers: list[int] | None) -> list[tuple[int, int]]:
    """Student layer i matches teacher layer student_layers[i] (a layer copy), else the teacher layer at the same
    relative depth: round((i + 1) * num_teacher / num_student) - 1."""
    if student_layers is not None:
        return list(enumerate(student_layers))
    return [(i, round((i + 1) * num_teacher / num_student) - 1) for i in range(num_student)]


def make_distill_loss(teacher: LlamaForCausalLM, alpha: float, temperature: float, hidden_weight: float = 0.0,
                      layer_map: list[tuple[int, int]] | None = None, activation_checkpointing: bool = False
                      ) -> LossFn:
    if not 0 <= alpha <= 1:
        raise DistillError(f"alpha must be in [0, 1], got {alpha}")
    if not temperature > 0:
        raise DistillError(f"temperature must be positive, got {temperature}")
    if hidden_weight < 0:
        raise DistillError(f"hidden weight must be 0 or more, got {hidden_weight}")
    if hidden_weight and not layer_map:
        raise DistillError("hidden-state matching needs a layer map")

    def loss_fn(student: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            t = causal_lm_forward(teacher, ids, output_hidden_states=hidden_weight > 0, head=False)
        s = causal_lm_forward(student, ids, output_hidden_states=hidden_weight > 0,
                              activation_checkpointing=activation_checkpointing, head=False)
        t_rows = t.last_hidden.reshape(-1, t.last_hidden.shape[-1])  # [B*T, hidden]
        loss, ce, kl = head_loss(student.lm_head, s.last_hidden.reshape(-1, s.last_hidden.shape[-1]),
                                 next_token_labels(ids), ce_weight=1 - alpha, kd_weight=alpha,
                                 teacher=lambda a, b: head_logits(teacher, t_rows[a:b]), temperature=temperature,
                                 softcap=student.config.final_logit_softcapping)
        parts = {"kl": float(kl), "ce": float(ce)}
        if hidden_weight:
            assert s.hidden_states is not None and t.hidden_states is not None and layer_map is not None
            hidden = hidden_state_loss(s.hidden_states, t.hidden_states, layer_map)
            loss = loss + hidden_weight * hidden
            parts["hidden"] = float(hidden.detach())
        return loss, parts

    return loss_fn


def make_lm_loss(activation_checkpointing: bool = False) -> LossFn:
    """Plain next-token cross-entropy on the text (fine-tuning with no teacher)."""

    def loss_fn(model: LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return lm_loss(model, ids, activation_checkpointing), {}

    return loss_fn


def lm_loss(model: LlamaForCausalLM, ids: torch.Tensor, activation_checkpointing: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy of [B, T] windows, the head's logits formed a chunk at a time."""
    hidden = causal_lm_forward(model, ids, activation_checkpointing=activation_checkpointing, head=False).last_hidden
    return head_loss(model.lm_head, hidden.reshape(-1, hidden.shape[-1]), next_token_labels(ids),
                     softcap=model.config.final_logit_softcapping)[0]


def check_hidden_sizes(teacher: LoadedModel, student: LoadedModel) -> None:
    if teacher.config.hidden_size != student.config.hidden_size:
        raise DistillError(f"hidden-state matching needs equal hidden sizes (teacher {teacher.config.hidden_size}, "
                           f"student {student.config.hidden_size}); pass --hidden-weight 0")
