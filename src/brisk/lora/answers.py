"""Before and after an adapter: the base model's answers and the adapted model's, side by side.

    python -m brisk.lora.answers ADAPTER_DIR --data task/eval.jsonl [--model default] [--count 5] [--max-tokens 48]

Each chat of the data file (docs/lora.md's format) is answered twice, greedily, in one batch: by the base model
and through the adapter; the table also shows the reference answer (the chat's own assistant turn). Prints a
Markdown table (BENCHMARKS.md's "before/after" one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def compare_answers(adapter: str | Path, data: str | Path, model: str = "default", count: int = 5,
                    max_tokens: int = 48, **engine_args: object) -> list[dict[str, str]]:
    """[{prompt, reference, base, adapted}] for the first `count` chats of `data` (`engine_args`: more LLM
    settings, e.g. kv_cache_memory)."""
    from brisk import LLM, LoRARequest, SamplingParams

    chats = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not chats:
        raise ValueError(f"{data}: no chats (one JSON object with 'messages' per line)")
    chats = chats[:count]
    questions = [[m for m in c["messages"] if m["role"] != "assistant"] for c in chats]
    references = [next((m["content"] for m in c["messages"] if m["role"] == "assistant"), "") for c in chats]
    llm = LLM(model, enable_lora=True, max_loras=1, max_lora_rank=64, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    lora = LoRARequest("adapter", 1, str(adapter))
    outs = llm.chat(questions + questions, params, lora_request=[None] * len(chats) + [lora] * len(chats))
    texts = [o.outputs[0].text.strip() for o in outs]
    return [{"prompt": q[-1]["content"], "reference": ref, "base": texts[i], "adapted": texts[len(chats) + i]}
            for i, (q, ref) in enumerate(zip(questions, references, strict=True))]


def markdown_table(rows: list[dict[str, str]]) -> str:
    def cell(s: str) -> str:
        return " ".join(s.split()).replace("|", "\\|")

    lines = ["| prompt (last user turn) | reference | base model | with the adapter |", "|---|---|---|---|"]
    lines += [f"| {cell(r['prompt'])} | {cell(r['reference'])} | {cell(r['base'])} | {cell(r['adapted'])} |"
              for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("adapter", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    print(markdown_table(compare_answers(a.adapter, a.data, a.model, a.count, a.max_tokens)))


if __name__ == "__main__":
    main()
