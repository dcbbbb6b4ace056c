"""The collectives and messages brisk's parallel engine uses, over torch.distributed (gloo on CPUs, NCCL for CUDA).

Two kinds of traffic:
  * inside the forward, tensors: the all-reduce after each row-parallel layer and the logits gather (tensor
    parallel), hidden states from stage to stage (pipeline parallel);
  * from the driver (rank 0) to the workers, one plain-data message a step: the SchedulerOutput, pickled into a
    uint8 tensor behind an int64 length (point-to-point, so a pipeline stage that is still busy with the previous
    micro-batch never holds the driver up), and None to stop.

Every call runs under the process group's timeout (gloo's `timeout`), so a dead worker (connection closed) or a
hung one (no answer within the timeout) surfaces as an exception on the driver, which the runner turns into a
ParallelError and a shutdown (parallel/runner.py), never a hang.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class ParallelError(RuntimeError):
    """A worker died, hung past the timeout or failed to start; the parallel engine has been shut down."""

    fatal = True  # the engine cannot take another step: a server stops (serve/async_engine.py), not retries


@dataclass
class Group:
    """This process's place in the parallel engine: its rank among `size`, the process groups it talks over."""

    rank: int
    size: int
    device_group: Any = None  # the forward's tensors (NCCL on CUDA, else gloo); None = the default group
    cpu_group: Any = None  # the driver's messages (always gloo, CPU tensors); None = the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place in x."""
        dist.all_reduce(x, group=self.device_group)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (equal shapes), on rank 0 in rank order; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, group=self.device_group, group_dst=0)  # the group's rank 0 (a subgroup's too)
        return parts

    def _isend(self, x: torch.Tensor, dst: int, group: Any) -> None:
        """A send that does not wait for the peer to post its receive (gloo's send would: two pipeline stages each
        sending to the other would deadlock); the tensor is kept alive until the transfer completes."""
        self._pending = [(w, t) for w, t in getattr(self, "_pending", []) if not w.is_completed()]
        self._pending.append((dist.isend(x, dst, group=group), x))

    def wait_sends(self) -> None:
        for work, _ in getattr(self, "_pending", []):
            work.wait()
        self._pending = []

    def send(self, x: torch.Tensor, dst: int) -> None:
        self._isend(x.contiguous(), dst, self.device_group)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(x, src, group=self.device_group)
        return x

    def send_object(self, obj: Any, dst: int) -> None:
        """A picklable plain-data message to rank `dst` (the SchedulerOutput, or None to stop)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._isend(torch.tensor([len(payload)], dtype=torch.int64), dst, self.cpu_group)
        self._isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, self.cpu_group)

    def recv_object(self, src: int = 0) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.cpu_group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())  # noqa: S301 - from our own rank 0 over the job's own group
