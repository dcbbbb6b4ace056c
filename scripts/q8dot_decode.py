"""Model-level cost and benefit of int8 decode activations (EngineConfig.quant_activations) on a quantized model.

    python scripts/q8dot_decode.py MODEL_DIR [--speed] [--accuracy] [--threads 1,2] [--runs 5] [--tokens 64]

--speed: batch-1 greedy decode through the engine (decode plan included), float vs int8 activations alternated
  run by run in one process (set_quant_activations on the same loaded model); decode tok/s = (tokens - 1) /
  (finish - first token), best of `runs`, wall clock; plus the calling thread's CPU time per token.
  --batch 8 runs 8 requests at once (M = 8 rows per GEMV) and reports their summed decode rate.
--accuracy: token by token through the decode path (M = 1 per GEMV, a paged KV cache):
  1. a 256-token greedy decode with float activations; the same tokens teacher-forced through the int8 path:
     greedy-token agreement (argmax equal), the first position where they differ (= where a free-running int8
     greedy decode leaves the float one), mean |logit difference|;
  2. decode-path perplexity: 512 tokens of sense_and_sensibility.txt teacher-forced one token per step, both modes.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from brisk.ops.attention import AttentionMetadata
from brisk.quant.layers import set_quant_activations

TEXT = "/work/shared/data/sense_and_sensibility.txt"


def decode_logits(loaded, ids: list[int], num_prompt: int, greedy_extra: int = 0) -> tuple[list[int], torch.Tensor]:
    """Feed the tokens one per step (M = 1 through every GEMV): all of ids are forced, then greedy_extra more
    tokens are chosen greedily. Returns (all tokens, logits [steps, V] float32 of positions num_prompt - 1 ..
    the end, row t predicting token num_prompt + t)."""
    c = loaded.config
    total = len(ids) + greedy_extra
    nb = -(-total // 16)
    kv = [torch.zeros(2, nb, 16, c.num_key_value_heads, c.head_dim, dtype=loaded.dtype)
          for _ in range(c.num_hidden_layers)]
    table = torch.arange(nb, dtype=torch.int32)[None]  # [1, nb]
    tokens, out = list(ids), []
    with torch.inference_mode():
        for pos in range(total - 1):
            meta = AttentionMetadata(slot_mapping=torch.tensor([pos]), num_decodes=1,
                                     query_start_loc=torch.tensor([0, 1]), block_tables=table,
                                     context_lens=torch.tensor([pos + 1], dtype=torch.int32))
            logits = loaded.model(torch.tensor([tokens[pos]]), torch.tensor([pos]), meta, kv).float()[-1]
            if pos >= num_prompt - 1:
                out.append(logits)
                if pos + 1 >= len(tokens):
                    tokens.append(int(logits.argmax()))
    return tokens, torch.stack(out)


def accuracy(path: str) -> None:
    from brisk.model.loader import load_model

    loaded = load_model(path)
    tok = loaded.tokenizer
    model = loaded.model
    prompt = tok.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    set_quant_activations(model, "float")
    tokens, lf = decode_logits(loaded, prompt, len(prompt), greedy_extra=256)
    set_quant_activations(model, "int8")
    _, li = decode_logits(loaded, tokens[: len(prompt) + 256], len(prompt))
    li = li[: lf.shape[0]]
    agree = (lf.argmax(-1) == li.argmax(-1)).float()
    first = int((agree == 0).nonzero()[0]) if bool((agree == 0).any()) else len(agree)
    print(f"greedy 256: teacher-forced agreement {agree.mean().item():.4f} ({int(agree.sum())}/{len(agree)}), "
          f"free-running identical for the first {first} tokens, mean |logit diff| "
          f"{(lf - li).abs().mean().item():.4f} (mean |logit| {lf.abs().mean().item():.3f}), "
          f"max {(lf - li).abs().max().item():.3f}", flush=True)
    ids = tok.encode(open(TEXT).read()[:20000])[:513]
    for mode in ("float", "int8"):
        set_quant_activations(model, mode)
        _, logits = decode_logits(loaded, ids, 1)  # [512, V]: row t predicts ids[t + 1]
        nll = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="mean").item()
        print(f"decode-path ppl ({len(ids) - 1} tokens, {mode} activations): {math.exp(nll):.4f}", flush=True)


def speed(path: str, threads: list[int], runs: int, num_tokens: int, batch: int) -> None:
    from brisk import LLM, SamplingParams

    llm = LLM(path, max_model_len=512)
    model = llm.engine.loaded.model
    prompts = [[1] + list(range(100 + 7 * i, 116 + 7 * i)) for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for t in threads:
        torch.set_num_threads(t)
        best = {m: (0.0, float("inf")) for m in ("float", "int8")}
        llm.generate(prompts, params)  # warm-up
        for _ in range(runs):
            for mode in ("float", "int8"):
                set_quant_activations(model, mode)
                llm.engine.runner.executor.rebuild()  # the plan holds each layer's kernel as it was
                c0 = time.thread_time()
                outs = llm.generate(prompts, params)
                cpu = (time.thread_time() - c0) / (num_tokens * batch) * 1e3
                first = max(o.metrics.first_token_time for o in outs)
                done = max(o.metrics.finished_time for o in outs)
                rate = batch * (num_tokens - 1) / (done - first)
                best[mode] = (max(best[mode][0], rate), min(best[mode][1], cpu))
        f, q = best["float"], best["int8"]
        print(f"threads {t} batch {batch}: float {f[0]:.1f} tok/s ({f[1]:.2f} ms CPU/token), int8 {q[0]:.1f} tok/s "
              f"({q[1]:.2f} ms CPU/token): int8/float {q[0] / f[0]:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--accuracy", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    if args.speed:
        speed(args.model, [int(t) for t in args.threads.split(",")], args.runs, args.tokens, args.batch)
    if args.accuracy:
        accuracy(args.model)


if __name__ == "__main__":
    main()
