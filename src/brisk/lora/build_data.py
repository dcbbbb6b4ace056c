"""Build the fine-tuning task of docs/lora.md from brisk's public-domain novels: "continue the passage".

Each example is a chat: the user gives two consecutive sentences of a novel and asks for the next one; the
assistant answers with the sentence that follows in the book. Training data comes from Emma, held-out data from
Sense and Sensibility (another novel, the same task), so the held-out loss measures the learned task, not
memorised text.

    python -m brisk.lora.build_data OUT_DIR [--train 400] [--eval 64]
    -> OUT_DIR/train.jsonl, OUT_DIR/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from brisk.data import calibration_text_path, evaluation_text_path

PROMPT = "Continue this passage from a novel with its next sentence:\n\n{passage}"


def sentences(text: str) -> list[str]:
    """The text's sentences of 6-40 words, in order (chapter headings and short fragments dropped)."""
    flat = re.sub(r"\s+", " ", text.replace("_", ""))
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'])", flat)
    return [p.strip() for p in parts if 6 <= len(p.split()) <= 40 and "CHAPTER" not in p]


def examples(text: str, count: int, seed: int) -> list[dict]:
    sents = sentences(text)
    rng = random.Random(seed)
    starts = rng.sample(range(len(sents) - 2), min(count, len(sents) - 2))
    return [{"messages": [{"role": "user", "content": PROMPT.format(passage=f"{sents[i]} {sents[i + 1]}")},
                          {"role": "assistant", "content": sents[i + 2]}]} for i in starts]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=400)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(a.out / "train.jsonl", examples(calibration_text_path().read_text(encoding="utf-8"), a.train, a.seed))
    write_jsonl(a.out / "eval.jsonl", examples(evaluation_text_path().read_text(encoding="utf-8"), a.eval, a.seed))
    print(f"wrote {a.out / 'train.jsonl'} ({a.train} from Emma) and {a.out / 'eval.jsonl'} ({a.eval} from Sense and "
          "Sensibility)")


if __name__ == "__main__":
    main()
