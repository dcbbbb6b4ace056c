"""The `brisk` command line."""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from brisk.engine.sampling_params import SamplingParams
from brisk.engine.settings import SectionedCommand, engine_kwargs, engine_options, section_option

if TYPE_CHECKING:
    from brisk.engine.outputs import RequestOutput
    from brisk.lora.request import LoRARequest

# --max-tokens when neither the command line nor the model's generation config (max_new_tokens) gives one
CLI_MAX_TOKENS = 128


def sampling_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """A request's sampling fields; one left out takes the model's default (--generation-config)."""
    model_default = "default: the model's (--generation-config)"
    opts = [
        section_option("generation", "--max-tokens", type=int, default=None,
                       help=f"Tokens to generate (default: the model's max_new_tokens, else {CLI_MAX_TOKENS})."),
        section_option("generation", "--temperature", "-t", type=float, default=None,
                       help=f"0 = greedy ({model_default})."),
        section_option("generation", "--top-p", type=float, default=None, help=f"Nucleus sampling ({model_default})."),
        section_option("generation", "--top-k", type=int, default=None, help=f"0 = disabled ({model_default})."),
        section_option("generation", "--min-p", type=float, default=None, help=f"0 = disabled ({model_default})."),
        section_option("generation", "--repetition-penalty", type=float, default=None,
                       help=f"1 = off ({model_default})."),
        section_option("generation", "--sample-seed", type=int, default=None, help="Per-request sampling seed."),
        section_option("generation", "--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_llm(kw: dict[str, Any], *, show_defaults: bool = True,
              quiet: bool = False):  # noqa: ANN201 - brisk.engine.llm.LLM, imported late (loads torch kernels)
    """The LLM that a command's engine options describe; says on stderr (unless `quiet`) how long compiling took
    and, with `show_defaults`, which sampling defaults requests get (serve; generate and chat say what they use)."""
    from brisk.engine.llm import LLM

    llm = LLM(**engine_kwargs(kw))
    if llm.engine.config.execution == "compiled" and not quiet:  # stderr: stdout holds the answer
        click.echo(f"brisk: --compile: the decoder's graphs compiled in {llm.engine.compile_seconds:.1f} s "
                   "(every shape bucket, at start-up)", err=True)
    if show_defaults and not quiet:
        click.echo(f"brisk: sampling defaults: {llm.engine.sampling_defaults.describe()}", err=True)
    return llm


def sampling_fields(kw: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields given on the command line (None = left to the model's defaults), checked now so that a
    bad value fails before the model loads."""
    given = dict(max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"],
                 min_p=kw["min_p"], repetition_penalty=kw["repetition_penalty"], seed=kw["sample_seed"],
                 stop=list(kw["stop"]) or None)
    SamplingParams(**{k: v for k, v in given.items() if v is not None})
    return given


def build_params(llm: Any, given: dict[str, Any]) -> SamplingParams:
    """The command line's sampling fields over the engine's defaults."""
    if given["max_tokens"] is None and llm.engine.sampling_defaults.max_tokens is None:
        given = {**given, "max_tokens": CLI_MAX_TOKENS}
    return llm.get_default_sampling_params(**given)


_TRUNCATION = ("top_p", "top_k", "min_p")  # what greedy decoding ignores (SamplingParams resets them)


def describe_sampling(llm: Any, params: SamplingParams, given: dict[str, Any]) -> str:
    """One line: the sampling values a generate / chat request runs with, and where each comes from (the command
    line, the command's own max_tokens, or the engine's sampling defaults)."""
    greedy = params.is_greedy
    shown = ["temperature", *(() if greedy else _TRUNCATION), "repetition_penalty", "max_tokens"]
    defaults = llm.engine.sampling_defaults
    from_cli = [k for k in shown if given.get(k) is not None]
    command_default = given.get("max_tokens") is None and defaults.max_tokens is None
    from_defaults = [k for k in shown if k not in from_cli and not (k == "max_tokens" and command_default)]
    origin = []
    if from_cli:
        origin.append(f"{', '.join(from_cli)} from the command line")
    if command_default:
        origin.append(f"max_tokens the command's default ({CLI_MAX_TOKENS})")
    if from_defaults:
        origin.append(f"{', '.join(from_defaults)} from {defaults.source}")
    values = " ".join(f"{k}={getattr(params, k)}" for k in shown)
    return f"sampling: {'greedy, ' if greedy else ''}{values} ({'; '.join(origin)})"


# ---------------------------------------------------------------------------- LoRA adapters on generate / chat
def lora_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--lora [NAME=]PATH (repeatable) and --lora-name: the adapter generate / chat apply."""
    opts = [
        section_option("model", "--lora", "loras", multiple=True, metavar="[NAME=]PATH",
                       help="A LoRA adapter (a PEFT folder, as written by peft's save_pretrained or brisk finetune) "
                            "to apply; repeatable, NAME=PATH as serve's --lora-modules (a bare PATH is named after "
                            "its folder). The first is applied unless --lora-name picks another. Turns on "
                            "--enable-lora (and raises --max-lora-rank to the adapters' rank)."),
        section_option("model", "--lora-name", default=None, metavar="NAME",
                       help="Which --lora adapter to apply (default: the first); 'none' runs the base model. In "
                            "chat, /lora NAME switches."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def parse_loras(items: tuple[str, ...]) -> dict[str, LoRARequest]:
    """('[NAME=]PATH', ...) -> {name: LoRARequest}, ids 1, 2, ... in order."""
    from brisk.lora.request import LoRARequest

    out: dict[str, LoRARequest] = {}
    for i, item in enumerate(items, 1):
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or "/" in name:  # a bare PATH (which may hold '=' itself)
            path = item.strip()
            name = Path(path).name or f"lora{i}"
        if name in out or name == "none":
            raise click.BadParameter(f"two adapters are named {name!r}; name them apart, NAME=PATH" if name in out
                                     else "'none' means no adapter; give the adapter another NAME", param_hint="--lora")
        out[name] = LoRARequest(name, i, path)
    return out


def choose_lora(loras: dict[str, LoRARequest], name: str | None) -> LoRARequest | None:
    """The adapter --lora-name picks (default: the first given; 'none': the base model)."""
    if name is None:
        return next(iter(loras.values()), None)
    if name == "none":
        return None
    if name not in loras:
        known = ", ".join(loras) or "none given (add --lora [NAME=]PATH)"
        raise click.BadParameter(f"no --lora adapter named {name!r}; the adapters: {known}", param_hint="--lora-name")
    return loras[name]


def prepare_loras(kw: dict[str, Any], loras: dict[str, LoRARequest]) -> None:
    """Read the adapters before the model loads (a bad folder fails now) and turn on the engine's LoRA slots: the
    rank limit is raised to the largest adapter's unless --max-lora-rank was given."""
    if not loras:
        return
    from brisk.lora.adapter import load_adapter

    rank = max(load_adapter(r.lora_path).r for r in loras.values())
    kw["enable_lora"] = True
    ctx = click.get_current_context()
    if ctx.get_parameter_source("max_lora_rank") == click.core.ParameterSource.DEFAULT:
        kw["max_lora_rank"] = max(kw["max_lora_rank"], rank)


def check_loras(llm: Any, loras: dict[str, LoRARequest]) -> None:
    """Each adapter against the loaded model's shapes and the engine's limits (AdapterError says what is wrong)."""
    for request in loras.values():
        llm.engine.lora_manager.check_adapter(request)


# ---------------------------------------------------------------------------- one request, timed
@dataclass
class GenerationStats:
    """What one generate / chat request took (RequestMetrics' times, the speculator's counts)."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    prompt_seconds: float  # arrival to the first token
    output_tokens: int
    decode_seconds: float  # first token to the last
    decode_steps: int  # engine steps that gave this request tokens after its first
    draft_tokens: int | None = None  # None: no speculative decoding
    accepted_tokens: int = 0

    def summary(self) -> str:
        """One line, llama.cpp-style: prompt tokens and their rate, generated tokens and the decode rate, and for
        speculative decoding the share of drafts accepted and the tokens per decode step."""
        computed = self.prompt_tokens - self.cached_tokens
        prompt = f"prompt {self.prompt_tokens} tok" + (f" ({self.cached_tokens} cached)" if self.cached_tokens else "")
        if computed > 0 and self.prompt_seconds > 0:
            prompt += f", {human(computed / self.prompt_seconds)} tok/s"
        parts = [prompt, f"generated {self.output_tokens} tok"]
        if self.output_tokens > 1 and self.decode_seconds > 0:
            parts[-1] += f", {human((self.output_tokens - 1) / self.decode_seconds)} tok/s"
        if self.draft_tokens is not None:
            spec = "speculative: "
            if self.draft_tokens:
                spec += (f"{100 * self.accepted_tokens / self.draft_tokens:.0f}% of {self.draft_tokens} drafts "
                         "accepted")
            else:
                spec += "no drafts"
            if self.decode_steps:
                spec += f", {human((self.output_tokens - 1) / self.decode_steps)} tok/step"
            parts.append(spec)
        return " | ".join(parts)


def human(x: float) -> str:
    """A rate rounded for a person: 3 significant digits (1520, 152, 15.2, 1.52)."""
    if x >= 100:
        return f"{round(x, 2 - math.floor(math.log10(x))):.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def run_request(llm: Any, prompt: str | list[int], params: SamplingParams, lora: LoRARequest | None = None,
                on_text: Callable[[str], None] | None = None) -> tuple[RequestOutput, GenerationStats]:
    """Generate for one prompt, handing each new piece of text to `on_text`; the final output and its timing.
    An interrupted request (Ctrl-C) is aborted and its blocks freed."""
    engine = llm.engine
    spec = engine.speculator.stats if engine.speculator is not None else None
    drafted, accepted = (spec.num_draft_tokens, spec.num_accepted_tokens) if spec is not None else (0, 0)
    final: RequestOutput | None = None
    steps = 0
    with contextlib.closing(llm.stream(prompt, params, lora_request=lora)) as outputs:  # closed early: aborted
        for out in outputs:
            if out.outputs[0].num_new_tokens and len(out.outputs[0].token_ids) > out.outputs[0].num_new_tokens:
                steps += 1  # a step after the one that gave the first token
            if on_text is not None and out.outputs[0].text_delta:
                on_text(out.outputs[0].text_delta)
            if out.finished:
                final = out
    assert final is not None, "the stream ends with the finished output"
    m = final.metrics
    assert m is not None and m.first_token_time is not None and m.finished_time is not None
    stats = GenerationStats(
        prompt_tokens=len(final.prompt_token_ids), cached_tokens=m.num_cached_tokens,
        prompt_seconds=m.first_token_time - m.arrival_time, output_tokens=len(final.outputs[0].token_ids),
        decode_seconds=m.finished_time - m.first_token_time, decode_steps=steps)
    if spec is not None:
        stats.draft_tokens = spec.num_draft_tokens - drafted
        stats.accepted_tokens = spec.num_accepted_tokens - accepted
    return final, stats


def quiet_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return section_option("other", "--quiet", "-q", is_flag=True,
                          help="No start-up or timing lines on stderr (errors still print).")(f)


class _FriendlyGroup(click.Group):
    """User errors (bad flags, missing model, bad values) print one clear line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from brisk.model.loader import ModelNotFoundError

        try:
            return super().invoke(ctx)
        except (ValueError, ModelNotFoundError) as e:
            raise click.ClickException(str(e)) from e

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands, each with its first sentence in full (click's own listing cuts it at the line's end)."""
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is None or cmd.hidden:
                continue
            rows.append((name, first_sentence(cmd.short_help or cmd.help or "")))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line (its period dropped, as click does)."""
    paragraph = " ".join(inspect.cleandoc(text).split("\n\n")[0].split())
    end = paragraph.find(". ")
    return (paragraph if end < 0 else paragraph[:end]).removesuffix(".")


@click.group(cls=_FriendlyGroup)
@click.version_option(package_name="brisk")
def main() -> None:
    """brisk: fast, compressed LLM inference."""


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _keep_and_write(pieces: list[str], text: str) -> None:
    pieces.append(text)
    _write(text)


def _info(message: str, quiet: bool) -> None:
    """A line for the person at the terminal, on stderr (stdout holds the answer)."""
    if not quiet:
        click.echo(f"brisk: {message}", err=True)


@main.command(cls=SectionedCommand, default_section="generation")
@click.argument("prompt")
@section_option("generation", "--chat", "as_chat", is_flag=True,
                help="Wrap the prompt as a user message (chat template).")
@section_option("generation", "--system", default=None, help="System message (with --chat).")
@section_option("generation", "--no-stream", is_flag=True, help="Print the answer at the end instead of streaming it.")
@quiet_option
@engine_options()
@lora_options
@sampling_options
def generate(prompt: str, as_chat: bool, system: str | None, no_stream: bool, loras: tuple[str, ...],
             lora_name: str | None, quiet: bool, **kw: Any) -> None:
    """Generate a continuation of PROMPT (or a chat answer with --chat).

    Prints the text on stdout; on stderr, the sampling values used and, after the answer, one timing line:
    prompt tokens and prompt tok/s, generated tokens and decode tok/s (and with --speculative the share of drafts
    accepted and tokens per step). --quiet drops the stderr lines."""
    given = sampling_fields(kw)  # bad sampling values fail before the model loads
    adapters = parse_loras(loras)
    lora = choose_lora(adapters, lora_name)
    prepare_loras(kw, adapters)
    llm = build_llm(kw, show_defaults=False, quiet=quiet)
    check_loras(llm, adapters)
    params = build_params(llm, given)
    _info(describe_sampling(llm, params, given) + (f"; LoRA adapter {lora.lora_name}" if lora else ""), quiet)
    tok = llm.get_tokenizer()
    if as_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_in: str | list[int] = tok.encode_chat(messages)
    else:
        prompt_in = prompt
    out, stats = run_request(llm, prompt_in, params, lora, None if no_stream else _write)
    if no_stream:
        click.echo(out.outputs[0].text)
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    _info(stats.summary(), quiet)


CHAT_HELP = "/reset clears the conversation, /lora [NAME|none] shows or switches the adapter, /exit or Ctrl-D quits"


@main.command(cls=SectionedCommand, default_section="generation")
@section_option("generation", "--system", default=None, help="System message.")
@quiet_option
@engine_options()
@lora_options
@sampling_options
def chat(system: str | None, loras: tuple[str, ...], lora_name: str | None, quiet: bool, **kw: Any) -> None:
    """Interactive chat: streams answers and keeps the conversation.

    Ctrl-D or /exit quits, /reset clears the conversation (the --system message stays), /lora NAME switches the
    adapter. After each answer one timing line on stderr (see generate); --quiet drops it."""
    given = sampling_fields(kw)
    adapters = parse_loras(loras)
    lora = choose_lora(adapters, lora_name)
    prepare_loras(kw, adapters)
    llm = build_llm(kw, show_defaults=False, quiet=quiet)
    check_loras(llm, adapters)
    params = build_params(llm, given)
    _info(describe_sampling(llm, params, given) + (f"; LoRA adapter {lora.lora_name}" if lora else ""), quiet)
    tok = llm.get_tokenizer()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    click.echo(f"brisk chat — {CHAT_HELP}.", err=True)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            turns = sum(m["role"] == "user" for m in history)
            history = history[:1] if system else []
            click.echo(f"[conversation cleared: {turns} exchange(s) forgotten"
                       + ("; the system message is kept]" if system else "]"), err=True)
            continue
        if line.strip().split()[:1] == ["/lora"]:
            words = line.split()
            if len(words) == 1:
                click.echo(f"[adapter: {lora.lora_name if lora else 'none (the base model)'}; the adapters: "
                           f"{', '.join(adapters) or 'none given (--lora [NAME=]PATH)'}]", err=True)
                continue
            try:
                lora = choose_lora(adapters, words[1])
            except click.BadParameter as e:
                click.echo(f"[{e.message}]", err=True)
                continue
            click.echo(f"[adapter: {lora.lora_name if lora else 'none (the base model)'}]", err=True)
            continue
        if line.strip().startswith("/") and line.strip().split()[0] in ("/help", "/?"):
            click.echo(f"[{CHAT_HELP}]", err=True)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode_chat(history)
        if len(ids) >= llm.engine.max_model_len:
            click.echo(f"[the conversation ({len(ids)} tokens) no longer fits max_model_len="
                       f"{llm.engine.max_model_len}; /reset to start over]", err=True)
            history.pop()
            continue
        _write("assistant> ")
        pieces: list[str] = []
        stats = None
        try:
            _, stats = run_request(llm, ids, params, lora, partial(_keep_and_write, pieces))
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        _write("\n")
        history.append({"role": "assistant", "content": "".join(pieces)})
        if stats is not None:
            _info(stats.summary(), quiet)


@main.command(cls=SectionedCommand, default_section="server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network (set --api-key then). Bound to a "
                   "loopback address, the server answers only requests whose Host is a loopback name (see "
                   "--allowed-hosts).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="BRISK_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 routes (also from env BRISK_API_KEY).")
@click.option("--served-model-name", default=None, help="Model name clients use (default: the model's own name).")
@click.option("--max-waiting", type=int, default=128, show_default=True,
              help="Admission cap: at most max-num-seqs + max-waiting sequences (running or queued) are held; "
                   "requests beyond it are refused with 503 + Retry-After.")
@click.option("--allowed-origins", "--cors-origins", "allowed_origins", default=None, metavar="ORIGINS",
              help="Comma-separated web origins (scheme://host[:port]) whose pages may call the server from a "
                   "browser, CORS answered for them, or '*' for any. A request with another Origin header is refused "
                   "(403). Default: only the server's own origin. --cors-origins is an older name.")
@click.option("--allowed-hosts", default=None, metavar="HOSTS",
              help="Comma-separated Host names the server answers to besides localhost, 127.0.0.1, [::1] and the "
                   "bound address, or '*' for any. Default: on a loopback --host only those (a page re-pointing its "
                   "own domain at 127.0.0.1, DNS rebinding, is refused); on 0.0.0.0 or another address any Host.")
@click.option("--max-request-bytes", default="1MiB", show_default=True, help="Largest request body accepted.")
@section_option("model", "--lora-modules", multiple=True, metavar="NAME=PATH",
                help="With --enable-lora: a PEFT adapter served as model NAME (repeatable).")
@click.option("--enable-auto-tool-choice", is_flag=True, default=False,
              help="Answer tool_choice 'auto' (the default with tools): the model decides whether to call, and "
                   "its tool calls are parsed into message.tool_calls. 'required' and named tools work without it.")
@click.option("--tool-call-parser", default=None,
              type=click.Choice(["auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "phi4_mini",
                                 "gemma"]),
              help="The model's tool-call syntax for tool_choice 'auto' (default: hermes, <tool_call>{...}"
                   "</tool_call>, as Hermes, Qwen2.5 and SmolLM2 write it; auto: the one the chat template names).")
@click.option("--reasoning-parser", type=click.Choice(["deepseek_r1", "qwen3"]), default=None,
              help="A reasoning model's <think>...</think> goes to message.reasoning_content (and .reasoning), not "
                   "content: deepseek_r1 (DeepSeek-R1, QwQ: the text up to </think>) or qwen3 (the same, none with "
                   "chat_template_kwargs {\"enable_thinking\": false}).")
@click.option("--task", type=click.Choice(["generate", "embed", "rerank"]), default="generate", show_default=True,
              help="generate: completions and chat, plus /v1/embeddings and yes/no-logit /v1/rerank, /v1/score. "
                   "embed: embeddings, rerank and score by cosine similarity, no generation. rerank: yes/no-logit "
                   "rerank and score, and embeddings, no generation (docs/serving.md).")
@click.option("--pooling", type=click.Choice(["last", "mean", "cls"]), default=None,
              help="How /v1/embeddings pools the prompt's final hidden states. Default: what the model's files say "
                   "(sentence-transformers 1_Pooling/config.json, GGUF pooling_type), else last.")
@click.option("--rerank-template", default=None, metavar="TEXT",
              help="The prompt of yes/no-logit reranking, with {query} and {document} (and optionally "
                   "{instruction}). Default: the model's chat template over Qwen3-Reranker's prompt.")
@section_option("parallel", "--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
                help="Engine replicas (each a whole server on its own port and threads // N) behind one router.")
@section_option("parallel", "--router-policy", type=click.Choice(["prefix", "round-robin"]), default="prefix",
                show_default=True,
                help="With --data-parallel-size: send a request to the replica holding its longest cached prefix "
                     "(else the least loaded), or round-robin.")
@engine_options()
def serve(host: str, port: int, api_key: str | None, served_model_name: str | None, max_waiting: int,
          allowed_origins: str | None, allowed_hosts: str | None, max_request_bytes: str, lora_modules: tuple[str, ...],
          enable_auto_tool_choice: bool, tool_call_parser: str | None, reasoning_parser: str | None,
          task: str, pooling: str | None, rerank_template: str | None, data_parallel_size: int, router_policy: str,
          **kw: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    if data_parallel_size > 1:  # replicas behind a router (serve/router.py)
        from brisk.serve.router import run_router

        argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
        run_router(argv, data_parallel_size, router_policy, host=host, port=port,
                   access=_access_policy(host, allowed_origins, allowed_hosts))
        return
    from brisk.serve.app import ServerConfig, run_server
    from brisk.serve.lora import parse_lora_modules
    from brisk.serve.security import split_list

    _access_policy(host, allowed_origins, allowed_hosts)  # a bad entry fails before loading

    try:
        loras = parse_lora_modules(lora_modules)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lora-modules") from None
    config = ServerConfig(served_model_name=served_model_name, api_key=api_key, max_waiting=max_waiting,
                          allowed_origins=split_list(allowed_origins), allowed_hosts=split_list(allowed_hosts),
                          host=host, max_request_bytes=max_request_bytes,
                          lora_modules=loras, enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser,
                          reasoning_parser=reasoning_parser, task=task, pooling=pooling,
                          rerank_template=rerank_template)  # bad values fail before loading
    llm = build_llm(kw)
    from brisk.serve.memory import prefault_engine_kv

    prefault_engine_kv(llm.engine)  # the KV pool resident now, not as a soak first reaches its blocks
    run_server(llm.engine, config, host=host, port=port)


def _access_policy(host: str, allowed_origins: str | None, allowed_hosts: str | None) -> Any:
    """serve's browser checks (serve/security.py) from its options; a bad entry is a usage error."""
    from brisk.serve.security import AccessPolicy, split_list

    try:
        return AccessPolicy(host, split_list(allowed_origins), split_list(allowed_hosts))
    except ValueError as e:
        raise click.BadParameter(str(e).removeprefix("--allowed-origins: "), param_hint="--allowed-origins") from None


@main.group("convert")
def convert() -> None:
    """Convert a checkpoint into another ordinary checkpoint."""


@convert.command("gqa")
@click.option("--kv-heads", type=int, required=True,
              help="Key/value heads of the result; must divide the model's (1 = multi-query attention).")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
def convert_gqa_command(kv_heads: int, model: str, out: str) -> None:
    """Mean-pool MODEL's key/value heads into KV_HEADS groups (Ainslie et al., 2023); write a float folder OUT."""
    from brisk.model.gqa import convert_gqa

    folder = convert_gqa(model, out, kv_heads)
    click.echo(f"wrote {folder} with {kv_heads} key/value head(s)")


@convert.command("gguf")
@click.option("--outtype", required=True, type=click.Choice(["f32", "f16", "bf16", "q8_0"]),
              help="Type of every matrix in OUT (vectors stay F32), as llama.cpp's llama-quantize.")
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def convert_gguf_command(outtype: str, model: str, out: str) -> None:
    """Re-type the weights of the GGUF file MODEL into OUT, metadata and tokenizer unchanged."""
    from brisk.model.gguf_convert import retype_gguf

    path = retype_gguf(model, out, outtype)
    click.echo(f"wrote {path} ({outtype.upper()} matrices, {path.stat().st_size / 2**20:.1f} MiB)")


def _register_commands() -> None:
    from brisk.advise.cli import advise_command
    from brisk.bench.cli import bench
    from brisk.bench.report_cmd import report_command
    from brisk.eval.cli import eval_group
    from brisk.lora.cli import finetune
    from brisk.model.cache_cli import cache_group
    from brisk.model.export_cli import export
    from brisk.ops.kernels_cli import kernels_group
    from brisk.prune.cli import prune
    from brisk.quant.cli import quantize
    from brisk.spec.cli import spec_group
    from brisk.train.cli import distill

    for command in (advise_command, bench, cache_group, distill, eval_group, export, finetune, kernels_group, prune,
                    quantize, report_command, spec_group):
        main.add_command(command)


_register_commands()

if __name__ == "__main__":
    main()
