"""Training data: a text cut into packed token windows, drawn in a seeded order that is a pure function of the step.

The text is tokenized once with no special tokens (as `brisk eval ppl` does) and cut into consecutive,
non-overlapping windows of `seq_len` tokens (the partial tail dropped). Each epoch visits every window once in
the order of a permutation seeded by (seed, epoch). Sample n of the run is

    epoch = n // num_windows,   window = permutation(seed, epoch)[n % num_windows]

so the batch of any step is known without replaying the steps before it: a resumed run reads exactly the
batches the uninterrupted run would have read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from brisk.model.tokenizer import Tokenizer


class TrainDataError(ValueError):
    """The training text cannot give what the run asks for (missing, or shorter than one window)."""


@dataclass
class TextWindows:
    windows: torch.Tensor  # [num_windows, seq_len] int64
    seed: int
    source: str  # the text's file name, for the training record

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int) -> TextWindows:
        path = Path(path)
        if not path.is_file():
            raise TrainDataError(f"training text {path} does not exist; pass --text with a UTF-8 text file")
        return cls.from_text(path.read_text(encoding="utf-8"), tokenizer, seq_len, seed, source=path.name)

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer, seq_len: int, seed: int, source: str = "<text>"
                  ) -> TextWindows:
        return cls.from_ids(tokenizer.encode(text, add_special_tokens=False), seq_len, seed, source)

    @classmethod
    def from_ids(cls, ids: list[int], seq_len: int, seed: int, source: str) -> TextWindows:
        """Token ids (a text's, or token sequences joined end to end) cut into consecutive windows."""
        if seq_len < 2:
            raise TrainDataError(f"seq_len must be at least 2 tokens, got {seq_len}")
        num_windows = len(ids) // seq_len
        if num_windows == 0:
            raise TrainDataError(f"training text {source} has {len(ids)} tokens, fewer than one window of "
                                 f"{seq_len}; pass a longer text or a shorter --seq-len")
        windows = torch.tensor(ids[:num_windows * seq_len], dtype=torch.long).view(num_windows, seq_len)
        return cls(windows=windows, seed=seed, source=source)

    def joined(self, other: TextWindows) -> TextWindows:
        """Both sources' windows in one pool (same window length), drawn in one seeded order."""
        if other.seq_len != self.seq_len:
            raise TrainDataError(f"cannot pool windows of {self.seq_len} and {other.seq_len} tokens")
        return TextWindows(torch.cat([self.windows, other.windows]), self.seed, f"{self.source} + {other.source}")

    @property
    def num_windows(self) -> int:
        return self.windows.shape[0]

    @property
    def seq_len(self) -> int:
        return self.windows.shape[1]

    def _order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_windows, generator=gen)

    def batch(self, first_sample: int, batch_size: int) -> torch.Tensor:
        """Samples first_sample .. first_sample + batch_size - 1 of the run: [batch_size, seq_len] int64."""
        rows = []
        orders: dict[int, torch.Tensor] = {}
        for n in range(first_sample, first_sample + batch_size):
            epoch, i = divmod(n, self.num_windows)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            rows.append(int(orders[epoch][i]))
        return self.windows[rows]  # [batch_size, seq_len]
