"""Where a decode step's time goes: torch profiler over batch-B decoding of the default model (or a checkpoint).

    python scripts/profile_decode.py [--model PATH] [--dtype float32] [--batch 1] [--prune 0.5]
                                     [--quant-activations auto] [--tokens 48]

The model is loaded (optionally magnitude-pruned per row and converted to the sparse path, as `brisk bench sparse`
does), one warm-up run is made, then a 128-token prompt is decoded under the profiler and the ops' self times are
printed. The prefill of the profiled run is included (its GEMMs appear as aten::mm / mkldnn rows).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from brisk.bench.prompts import make_prompt, text_token_ids
from brisk.bench.quant import decode_rate
from brisk.bench.sparse import _engine, prune_decoder_
from brisk.model.loader import load_model
from brisk.ops.sparse import sparsify_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prune", default=None, help="magnitude-prune the decoder first: 0.5, 2:4, 4:8")
    ap.add_argument("--quant-activations", default="auto", choices=["auto", "float", "int8"])
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype), sparse=False)
    if args.prune:
        prune_decoder_(loaded.model, args.prune)
        sparsify_model(loaded.model)
    engine = _engine(loaded, args.quant_activations)
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, 128)
    decode_rate(engine, prompt, args.batch, 8)
    print(f"decode {decode_rate(engine, prompt, args.batch, args.tokens)[0]:.1f} tok/s without the profiler")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rate = decode_rate(engine, prompt, args.batch, args.tokens)[0]
    print(f"decode {rate:.1f} tok/s under the profiler")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
