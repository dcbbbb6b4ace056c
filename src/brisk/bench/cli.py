"""The `brisk bench` group: each command lives in its own module (cli_decode, cli_serve, cli_methods, ab, profile)."""

from __future__ import annotations

from typing import Any

import click

from brisk.bench.ab import ab, ab_kernels
from brisk.bench.hf_baseline import TransformersMissingError
from brisk.bench.profile import profile_command


class _BenchGroup(click.Group):
    """User errors print one clear line, not a traceback (also when this group runs on its own)."""

    def invoke(self, ctx: click.Context) -> Any:
        from brisk.bench.llamacpp import LlamaCppMissingError
        from brisk.bench.onnx_baseline import OnnxRuntimeMissingError
        from brisk.model.loader import ModelNotFoundError

        try:
            return super().invoke(ctx)
        except (ValueError, ModelNotFoundError, TransformersMissingError, LlamaCppMissingError,
                OnnxRuntimeMissingError) as e:
            raise click.ClickException(str(e)) from e


@click.group("bench", cls=_BenchGroup)
def bench() -> None:
    """Measure memory bandwidth, batch-1 latency, offline throughput and a server under load (optionally against
    transformers)."""


def _register_commands() -> None:
    from brisk.bench.cli_decode import latency, membw, throughput
    from brisk.bench.cli_methods import compare, kv, quant, sparse, spec
    from brisk.bench.cli_parallel import parallel
    from brisk.bench.cli_serve import serve
    from brisk.bench.lora import lora
    from brisk.bench.structured import structured

    for command in (membw, latency, throughput, serve, quant, sparse, spec, kv, compare, lora, structured, parallel,
                    ab, ab_kernels, profile_command):  # the last three: same-process A/Bs, a decode-step profile
        bench.add_command(command)


_register_commands()
