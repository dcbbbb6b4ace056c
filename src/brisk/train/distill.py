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
from pathlib import Path

import torch

from brisk.console import stderr_console
from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import LoadedModel, build_model
from brisk.model.save import model_tensors
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


def teacher_generations(teacher: str | Path, text: str, num_prompts: int, max_tokens: int, batch: int = 64,
                        progress: bool = True) -> list[list[int]]:
    """The teacher's greedy answers to `num_prompts` chat prompts cut from `text` (`brisk bench spec`'s own prompts
    left out), each returned whole: chat-template prompt + answer (+ end of sequence where the answer ended on
    one). A draft distilled on them learns the target's own continuations in the chat format it will draft in
    (self-distillation, as DistillSpec and Medusa-2 do), not only the text's. Run in the engine (continuous
    batching, `batch` requests in flight) on a fresh copy of the teacher, which leaves the training copy as it is."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from brisk.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.sampling_params import SamplingParams
    from brisk.spec.medusa import evaluation_prompts, training_prompts

    if num_prompts < 1 or max_tokens < 1:
        raise DistillError(f"teacher generations need at least 1 prompt and 1 token, got {num_prompts} prompts of "
                           f"{max_tokens} tokens")
    conversations = training_prompts(text, num_prompts, evaluation_prompts())
    engine = LLMEngine(EngineConfig(model=str(teacher), max_model_len=4096,
                                    scheduler=SchedulerConfig(max_model_len=4096, max_num_seqs=batch),
                                    cache=CacheConfig(kv_cache_memory="1GiB")))
    try:
        tok = engine.tokenizer
        eos = list(tok.eos_token_ids)
        prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in conversations]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        order = [engine.add_request(None, p, params) for p in prompts]
        done: dict[str, list[int]] = {}
        with Progress(TextColumn("teacher answers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=stderr_console(), transient=True, disable=not progress) as bar:
            task = bar.add_task("answers", total=len(prompts))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        answer = out.outputs[0]
                        ids = list(out.prompt_token_ids) + list(answer.token_ids)
                        if answer.finish_reason == "stop" and eos and ids[-1] not in eos:
                            # ended on an end-of-sequence token the output leaves out: the draft learns it too
                            ids.append(answer.stop_reason if isinstance(answer.stop_reason, int) else eos[0])
                        done[out.request_id] = ids
                        bar.advance(task)
    finally:
        engine.shutdown()
    return [done[r] for r in order]


GENERATIONS_FILE = "teacher_generations.json"


def cached_generations(out: Path, teacher: LoadedModel, text_path: str | Path, num_prompts: int, max_tokens: int,
                       progress: bool = True) -> list[list[int]]:
    """`teacher_generations`, read from OUT/teacher_generations.json when it holds these settings' answers (a
    resumed or repeated run trains on the same data without generating it again), else made and written there."""
    import json

    key = {"teacher": teacher.name, "text": Path(text_path).name, "prompts": num_prompts, "max_tokens": max_tokens}
    path = Path(out) / GENERATIONS_FILE
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                return [list(map(int, a)) for a in saved["answers"]]
        except (ValueError, KeyError, TypeError) as e:

            stderr_console().print(f"{path} cannot be read ({e}): generating the teacher's answers again")
    answers = teacher_generations(teacher.path, Path(text_path).read_text(encoding="utf-8"), num_prompts,
                                  max_tokens, progress=progress)
    Path(out).mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "answers": answers}) + "\n")
    return answers


def draft_vocabulary(text_windows: list[torch.Tensor], answers: list[list[int]], vocab_size: int, size: int,
                     always: list[int]) -> torch.Tensor:
    """The `size` tokens a draft distilled on this data should propose: ranked by frequency in the text plus
    frequency in the teacher's answers (each normalized, so the answers weigh as much as a longer text), with
    the end-of-sequence tokens always in."""
    from brisk.spec.vocab import most_frequent, token_counts

    score = token_counts(text_windows, vocab_size)
    score /= score.sum().clamp_min(1)
    if answers:
        gen = token_counts((torch.tensor(a, dtype=torch.int64) for a in answers), vocab_size)
        score += gen / gen.sum().clamp_min(1)
    return most_frequent(score, size, always)
