"""Tiny random Hugging Face model folders for tests (transformers is a test-only dependency).

`make_tiny_hf_model(path, arch=...)` writes what a real hub checkpoint folder holds:

    config.json                      (transformers' own, via save_pretrained)
    model.safetensors                or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    generation_config.json           eos ids
    tokenizer.json                   a real byte-level BPE trained here on a few paragraphs of Emma
    tokenizer_config.json            special tokens, ChatML chat_template, add_bos_token

and returns the transformers model (float32, eval mode) so a test can compare brisk against it.

Typical use::

    ref = make_tiny_hf_model(tmp_path / "m", arch="llama", num_kv_heads=2, tie_word_embeddings=False, seed=0)
    ckpt = load_hf_folder(tmp_path / "m")
    ids = ckpt.tokenizer.encode("Emma Woodhouse, handsome, clever")
    ref_logits = ref(torch.tensor([ids])).logits[0]

The vocabulary is ids 0..2 = <|endoftext|>, <|im_start|>, <|im_end|>, then the 256 byte-level symbols,
then BPE merges up to `vocab_size`. Weights use initializer_range=0.2 so logits are far from uniform and
greedy decoding is not decided by float noise.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# The start of Jane Austen's "Emma" (public domain; Project Gutenberg text, see src/brisk/data/README.md),
# embedded so that building the tiny tokenizer reads no file.
TRAINING_TEXT = """\
Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite
some of the best blessings of existence; and had lived nearly twenty-one years in the world with very
little to distress or vex her.

She was the youngest of the two daughters of a most affectionate, indulgent father; and had, in
consequence of her sister's marriage, been mistress of his house from a very early period. Her mother had
died too long ago for her to have more than an indistinct remembrance of her caresses; and her place had
been supplied by an excellent woman as governess, who had fallen little short of a mother in affection.

Sixteen years had Miss Taylor been in Mr. Woodhouse's family, less as a governess than a friend, very fond
of both daughters, but particularly of Emma. Between _them_ it was more the intimacy of sisters. Even
before Miss Taylor had ceased to hold the nominal office of governess, the mildness of her temper had
hardly allowed her to impose any restraint; and the shadow of authority being now long passed away, they
had been living together as friend and friend very mutually attached, and Emma doing just what she liked;
highly esteeming Miss Taylor's judgment, but directed chiefly by her own.

The real evils, indeed, of Emma's situation were the power of having rather too much her own way, and a
disposition to think a little too well of herself; these were the disadvantages which threatened alloy to
her many enjoyments. The danger, however, was at present so unperceived, that they did not by any means
rank as misfortunes with her.

Sorrow came--a gentle sorrow--but not at all in the shape of any disagreeable consciousness.--Miss Taylor
married. It was Miss Taylor's loss which first brought grief. It was on the wedding-day of this beloved
friend that Emma first sat in mournful thought of any continuance. The wedding over, and the bride-people
gone, her father and herself were left to dine together, with no prospect of a third to cheer a long
evening. Her father composed himself to sleep after dinner, as usual, and she had then only to sit and
think of what she had lost.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The ChatML template as Qwen2 / SmolLM2 ship it (system prompt optional, generation prompt on request).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3")


@lru_cache(maxsize=8)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE (GPT-2 / Qwen2 / SmolLM2 style) once per vocab size; return its JSON."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any UTF-8 text encodes
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    assert tok.get_vocab_size() == vocab_size, (
        f"BPE training reached {tok.get_vocab_size()} tokens, not {vocab_size}; use a smaller vocab_size"
    )
    return tok.to_str()


def write_tiny_tokenizer(
    path: str | Path,
    vocab_size: int = 384,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    add_bos_token: bool | None = None,
    bos_token: str | None = None,
) -> None:
    """Write tokenizer.json + tokenizer_config.json into `path` (created if needed).

    eos and pad are <|im_end|> and <|endoftext|>. `bos_token` / `add_bos_token` are left out of the config
    when None, which is how SmolLM2 and Qwen2 ship; add_bos_token=True gives a Llama-style tokenizer whose
    post-processor prepends BOS (`bos_token`, default <|endoftext|>).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    if add_bos_token:
        # As Llama-3 folders do it: the post-processor prepends BOS (transformers reads BOS from there, not
        # from tokenizer_config's add_bos_token, whenever a tokenizer.json exists).
        bos = bos_token or SPECIAL_TOKENS[0]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    tok.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    if bos_token is not None:
        config["bos_token"] = bos_token
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


# Llama-2-chat's template: BOS per user turn, strict user/assistant alternation enforced by raise_exception.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


@lru_cache(maxsize=4)
def _sentencepiece_style_json(vocab_size: int) -> str:
    # Train the merges with a throwaway BPE, then rebuild the model with byte fallback (the 256 <0xNN>
    # tokens at ids 3..258, as Llama-2's vocabulary has them) so any text still encodes.
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 259, show_progress=False)
    base.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    trained = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok.to_str()


def write_sentencepiece_style_tokenizer(
    path: str | Path, vocab_size: int = 512, *, chat_template: str | None = LLAMA2_TEMPLATE
) -> None:
    """Write a Llama-2-style tokenizer folder: SentencePiece-like BPE (\u2581 for spaces, byte fallback, a
    decoder that strips the leading space), BOS <s> prepended by the post-processor, eos </s>.

    This is the tokenizer family where decoding a token without left context loses its space, so it is
    what streaming detokenization must be tested on besides byte-level BPE.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_sentencepiece_style_json(vocab_size), encoding="utf-8")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def make_tiny_hf_model(
    path: str | Path,
    arch: str = "llama",
    *,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    shards: int = 1,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int = 384,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    add_bos_token: bool | None = None,
    initializer_range: float = 0.2,
    original_max_position_embeddings: int | None = None,
) -> torch.nn.Module:
    """Build a tiny random `arch` model with transformers, save it as a full HF folder at `path`, return it.

    arch: "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "smollm3" (qwen2 has q/k/v biases, randomized here so
        they are tested; qwen3 has per-head q/k norms; phi3 stores fused qkv_proj and gate_up_proj; smollm3 skips
        RoPE on every 4th layer, and on layer 1 here so that a 2-layer model has one of each).
    original_max_position_embeddings: phi3's pre-training context (longrope switches factors beyond it).
    rope_scaling: an HF rope dict without rope_theta, e.g. {"rope_type": "linear", "factor": 2.0}.
    sliding_window: mistral / qwen2 local attention window (None = full attention).
    shards: 1 -> model.safetensors; n > 1 -> sharded with an index (transformers splits greedily by size,
        so the count is about n, always at least 2).
    add_bos_token: None leaves the flag out of tokenizer_config.json (no BOS, as SmolLM2); True writes
        bos_token="<|endoftext|>" and add_bos_token=true (Llama style).
    """
    import transformers  # test-only dependency: import here so importing this module stays cheap

    transformers.utils.logging.disable_progress_bar()

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {_ARCHS}, got {arch!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    path = Path(path)
    eos_id, pad_id = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=pad_id if add_bos_token else None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(
            **common, head_dim=hidden_size // num_attention_heads, use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window, max_window_layers=num_hidden_layers,
        )
    elif arch == "smollm3":
        no_rope = [int((i + 1) % 4 != 0) for i in range(num_hidden_layers)]
        if num_hidden_layers < 4:
            no_rope[min(1, num_hidden_layers - 1)] = 0
        config = transformers.SmolLM3Config(**common, no_rope_layers=no_rope, use_sliding_window=False)
    elif arch == "phi3":
        original = {} if original_max_position_embeddings is None else {
            "original_max_position_embeddings": original_max_position_embeddings}
        config = transformers.Phi3Config(**common, sliding_window=sliding_window, **original)
    else:
        config = transformers.Qwen2Config(
            **common, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
            max_window_layers=num_hidden_layers,
        )
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}[arch]]

    torch.manual_seed(seed)
    model_cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
                 "phi3": transformers.Phi3ForCausalLM, "smollm3": transformers.SmolLM3ForCausalLM}[arch]
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        # RMSNorm weights start at exactly 1 and biases at 0; randomize them so a loader that skips or
        # swaps a norm or a bias is caught by a logits comparison.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(initializer_range * torch.randn_like(p))

    if shards == 1:
        max_shard_size: int | str = "50GB"
    else:
        total_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        max_shard_size = math.ceil(total_bytes / shards)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    if shards > 1:
        assert (path / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": [eos_id], "pad_token_id": pad_id}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    write_tiny_tokenizer(
        path,
        vocab_size,
        chat_template=chat_template,
        add_bos_token=add_bos_token,
        bos_token="<|endoftext|>" if add_bos_token else None,
    )
    return model


def add_script_tokens(path: Path, script: list[str]) -> list[int]:
    """Add each piece of `script` to the folder's tokenizer as one token and grow config.json's vocab_size to
    match; returns their ids (consecutive, after the base vocabulary)."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    base = tok.get_vocab_size()
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in script])
    tok.save(str(path / "tokenizer.json"))
    ids = [tok.token_to_id(p) for p in script]
    assert ids == list(range(base, base + len(script)))
    config = json.loads((path / "config.json").read_text())
    config["vocab_size"] = base + len(script)
    (path / "config.json").write_text(json.dumps(config))
    return ids


def wire_bigram_chain(path: Path, chain: list[int], num_added: int) -> None:
    """Make the folder's llama a bigram model that, from chain[0] on, writes chain[1:] whatever the sampling: its
    layers add nothing (o_proj and down_proj zero, so the last hidden state is the token's embedding), the chain's
    tokens get orthogonal one-hot embeddings and lm_head maps each to its successor's logit. `num_added`: the
    tokens add_script_tokens appended (their embedding rows are new)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    embed = torch.cat([embed, 0.2 * torch.randn(num_added, hidden)])
    head = torch.zeros(embed.shape[0], hidden)
    for i, (token, successor) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[successor, i] = 10.0
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(w)
        elif name == "model.norm.weight":
            weights[name] = torch.ones_like(w)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
