"""The `brisk` command line."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from brisk.engine.sampling_params import SamplingParams
from brisk.engine.settings import engine_kwargs, engine_options

# --max-tokens when neither the command line nor the model's generation config (max_new_tokens) gives one
CLI_MAX_TOKENS = 128


def sampling_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """A request's sampling fields; one left out takes the model's default (--generation-config)."""
    model_default = "default: the model's (--generation-config)"
    opts = [
        click.option("--max-tokens", type=int, default=None,
                     help=f"Tokens to generate (default: the model's max_new_tokens, else {CLI_MAX_TOKENS})."),
        click.option("--temperature", "-t", type=float, default=None, help=f"0 = greedy ({model_default})."),
        click.option("--top-p", type=float, default=None, help=f"Nucleus sampling ({model_default})."),
        click.option("--top-k", type=int, default=None, help=f"0 = disabled ({model_default})."),
        click.option("--min-p", type=float, default=None, help=f"0 = disabled ({model_default})."),
        click.option("--repetition-penalty", type=float, default=None, help=f"1 = off ({model_default})."),
        click.option("--sample-seed", type=int, default=None, help="Per-request sampling seed."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_llm(kw: dict[str, Any]):  # noqa: ANN201 - brisk.engine.llm.LLM, imported late (loads torch kernels)
    """The LLM that a command's engine options describe; says on stderr which sampling defaults are in effect."""
    from brisk.engine.llm import LLM

    llm = LLM(**engine_kwargs(kw))
    if llm.engine.config.execution == "compiled":  # the start-up time compiling adds, on stderr (stdout: the answer)
        click.echo(f"brisk: --compile: the decoder's graphs compiled in {llm.engine.compile_seconds:.1f} s "
                   "(every shape bucket, at start-up)", err=True)
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


class _FriendlyGroup(click.Group):
    """User errors (bad flags, missing model, bad values) print one clear line, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from brisk.model.loader import ModelNotFoundError

        try:
            return super().invoke(ctx)
        except (ValueError, ModelNotFoundError) as e:
            raise click.ClickException(str(e)) from e


@click.group(cls=_FriendlyGroup)
@click.version_option(package_name="brisk")
def main() -> None:
    """brisk: fast, compressed LLM inference."""


@main.command()
@click.argument("prompt")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt as a user message (chat template).")
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--no-stream", is_flag=True, help="Print the answer at the end instead of streaming it.")
@engine_options()
@sampling_options
def generate(prompt: str, as_chat: bool, system: str | None, no_stream: bool, **kw: Any) -> None:
    """Generate a continuation of PROMPT (or a chat answer with --chat)."""
    given = sampling_fields(kw)  # bad sampling values fail before the model loads
    llm = build_llm(kw)
    params = build_params(llm, given)
    tok = llm.get_tokenizer()
    if as_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_in: str | list[int] = tok.encode_chat(messages)
    else:
        prompt_in = prompt
    if no_stream:
        out = llm.generate([prompt_in], params)[0]
        click.echo(out.outputs[0].text)
        return
    for out in llm.stream(prompt_in, params):
        sys.stdout.write(out.outputs[0].text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")


@main.command()
@click.option("--system", default=None, help="System message.")
@engine_options()
@sampling_options
def chat(system: str | None, **kw: Any) -> None:
    """Interactive chat: streams answers and keeps the conversation. Ctrl-D or /exit to quit, /reset to clear."""
    given = sampling_fields(kw)
    llm = build_llm(kw)
    params = build_params(llm, given)
    tok = llm.get_tokenizer()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    click.echo("brisk chat — /reset clears the conversation, /exit or Ctrl-D quits.", err=True)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            click.echo("", err=True)
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system else []
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
        sys.stdout.write("assistant> ")
        answer = ""
        try:
            for out in llm.stream(ids, params):
                sys.stdout.write(out.outputs[0].text_delta)
                sys.stdout.flush()
                answer = out.outputs[0].text
        except KeyboardInterrupt:
            sys.stdout.write(" [interrupted]")
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": answer})


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server to the network (set --api-key then).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", envvar="BRISK_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 routes (also from env BRISK_API_KEY).")
@click.option("--served-model-name", default=None, help="Model name clients use (default: the model's own name).")
@click.option("--max-waiting", type=int, default=128, show_default=True,
              help="Admission cap: at most max-num-seqs + max-waiting sequences (running or queued) are held; "
                   "requests beyond it are refused with 503 + Retry-After.")
@click.option("--cors-origins", default=None,
              help="Comma-separated origins allowed by CORS, or '*' (default: CORS off).")
@click.option("--max-request-bytes", default="1MiB", show_default=True, help="Largest request body accepted.")
@click.option("--lora-modules", multiple=True, metavar="NAME=PATH",
              help="With --enable-lora: a PEFT adapter served as model NAME (repeatable).")
@click.option("--enable-auto-tool-choice", is_flag=True, default=False,
              help="Answer tool_choice 'auto' (the default with tools): the model decides whether to call, and "
                   "its tool calls are parsed into message.tool_calls. 'required' and named tools work without it.")
@click.option("--tool-call-parser", type=click.Choice(["hermes"]), default=None,
              help="The model's tool-call syntax for tool_choice 'auto' (default: hermes, <tool_call>{...}"
                   "</tool_call>, as Hermes, Qwen2.5 and SmolLM2 write it).")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine replicas (each a whole server on its own port and threads // N) behind one router.")
@click.option("--router-policy", type=click.Choice(["prefix", "round-robin"]), default="prefix", show_default=True,
              help="With --data-parallel-size: send a request to the replica holding its longest cached prefix "
                   "(else the least loaded), or round-robin.")
@engine_options()
def serve(host: str, port: int, api_key: str | None, served_model_name: str | None, max_waiting: int,
          cors_origins: str | None, max_request_bytes: str, lora_modules: tuple[str, ...],
          enable_auto_tool_choice: bool, tool_call_parser: str | None, data_parallel_size: int,
          router_policy: str, **kw: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    if data_parallel_size > 1:  # replicas behind a router (serve/router.py)
        from brisk.serve.router import run_router

        argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
        run_router(argv, data_parallel_size, router_policy, host=host, port=port)
        return
    from brisk.serve.app import ServerConfig, run_server

    origins = [o.strip() for o in cors_origins.split(",") if o.strip()] if cors_origins else []
    from brisk.serve.lora import parse_lora_modules

    try:
        loras = parse_lora_modules(lora_modules)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lora-modules") from None
    config = ServerConfig(served_model_name=served_model_name, api_key=api_key, max_waiting=max_waiting,
                          cors_origins=origins, max_request_bytes=max_request_bytes,
                          lora_modules=loras, enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser)  # bad values fail before loading
    llm = build_llm(kw)
    run_server(llm.engine, config, host=host, port=port)


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
