"""`brisk bench lora`: decode speed of a batch over several adapters against the same batch on the bare base.

The adapters are random (their values do not change the speed), rank --lora-rank on every projection, written in
PEFT's format to a temporary folder. One engine serves both arms; the arms alternate --repeats times and the
medians are compared, so the ratio is taken under the same machine load.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import torch

from brisk.bench.options import build_llm, engine_flags

_WORDS = "cat dog ship tree king river bird lamp door cloud road song".split()


def random_adapters(shapes: dict[str, tuple[int, int]], num: int, rank: int, folder: Path) -> list[Path]:
    from brisk.lora.adapter import LoRAAdapter

    out = []
    for i in range(num):
        g = torch.Generator().manual_seed(i)
        a = {m: torch.randn(rank, k, generator=g) * 0.01 for m, (n, k) in shapes.items()}
        b = {m: torch.randn(n, rank, generator=g) * 0.01 for m, (n, k) in shapes.items()}
        ad = LoRAAdapter(r=rank, lora_alpha=2.0 * rank, target_modules=sorted({m.rsplit(".", 1)[1] for m in a}),
                         lora_a=a, lora_b=b)
        out.append(ad.save(folder / f"adapter{i}"))
    return out


@click.command("lora")
@click.option("--num-requests", type=int, default=8, show_default=True, help="Concurrent requests in the batch.")
@click.option("--num-adapters", type=int, default=4, show_default=True, help="Adapters the requests spread over.")
@click.option("--lora-rank", type=int, default=8, show_default=True)
@click.option("--max-tokens", type=int, default=48, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Alternations of the two arms.")
@engine_flags(defaults={"enable_lora": True})
def lora(num_requests: int, num_adapters: int, lora_rank: int, max_tokens: int, repeats: int,
         json_path: str | None, **kw: Any) -> None:
    """Tokens/s of NUM_REQUESTS requests over NUM_ADAPTERS adapters against the same requests on the base."""
    from brisk.engine.sampling_params import SamplingParams
    from brisk.lora.request import LoRARequest

    kw["enable_lora"] = True
    kw["max_loras"] = max(kw.get("max_loras") or 1, num_adapters)
    kw["max_lora_rank"] = max(kw.get("max_lora_rank") or 1, lora_rank)
    llm = build_llm(kw)
    manager = llm.engine.lora_manager
    prompts = [f"Tell me a short story about a {_WORDS[i % len(_WORDS)]}." for i in range(num_requests)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = random_adapters(manager.shapes, num_adapters, lora_rank, Path(tmp))
        reqs = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        loras = [reqs[i % num_adapters] for i in range(num_requests)]
        arms: dict[str, list[float]] = {"base": [], "lora": []}
        for rep in range(repeats + 1):  # the first round warms both arms up and is not counted
            for arm in ("base", "lora"):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, lora_request=loras if arm == "lora" else None)
                tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
                if rep:
                    arms[arm].append(tps)
    base, with_lora = statistics.median(arms["base"]), statistics.median(arms["lora"])
    click.echo(f"{num_requests} requests x {max_tokens} tokens, executor {llm.engine.runner.executor.path}")
    click.echo(f"  base model        {base:8.1f} tok/s")
    click.echo(f"  {num_adapters} adapters (r={lora_rank}) {with_lora:8.1f} tok/s   {with_lora / base:.3f}x the base")
    if json_path:
        Path(json_path).write_text(json.dumps({"base_tok_s": arms["base"], "lora_tok_s": arms["lora"],
                                               "ratio": with_lora / base, "num_requests": num_requests,
                                               "num_adapters": num_adapters, "lora_rank": lora_rank,
                                               "max_tokens": max_tokens}, indent=2) + "\n")
