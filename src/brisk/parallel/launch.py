"""Starting the ranks of a parallel engine and joining them in one torch.distributed process group.

Three ways in, one result (this process's `Group`):

    one machine        brisk spawns ranks 1..N-1 itself (torch.multiprocessing, spawn start method); this process
                       is rank 0, the driver. Rendezvous on 127.0.0.1 and a free port.
    several machines   every node runs the same brisk command with --nnodes K --node-rank i --master-addr HOST
                       (--master-port P); node i spawns its N/K ranks, the first of them being the process itself.
                       Node 0's first rank is the driver; every other node's process is a worker.
    torchrun           `torchrun --nproc-per-node ... -m brisk.cli ...`: RANK, WORLD_SIZE, MASTER_ADDR/PORT come from
                       the environment (env:// rendezvous) and brisk spawns nothing.

Each rank takes its share of the cores: torch.set_num_threads(threads // ranks on this machine). A rank other than
the driver builds the same engine (the same model load, the same KV pool size), keeps its shard and then only
executes what the driver sends (parallel/runner.py); when that is an inherited process (torchrun, another node's
brisk command), it leaves the process once the driver stops it.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from brisk.parallel.comm import Group, ParallelError

if TYPE_CHECKING:
    from brisk.engine.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class ParallelState:
    """What this process knows of the parallel job: its group, the ranks it spawned, their status pipes."""

    group: Group
    tensor_parallel_size: int
    pipeline_parallel_size: int
    spawned: bool  # this process was spawned by brisk as a worker (it returns to worker_main when stopped)
    # the tensor-parallel group of this rank's pipeline stage (the whole group without pipeline parallelism);
    # None without tensor parallelism. Global rank g is stage g // tp, tensor rank g % tp (the driver, rank 0:
    # stage 0, tensor rank 0)
    tp_group: Group | None = None
    procs: list[Any] = field(default_factory=list)  # rank -> the worker processes this process spawned
    conns: dict[int, Any] = field(default_factory=dict)  # rank -> read end of its status pipe
    threads: int = 0  # this rank's torch threads (0: left as they are)

    @property
    def is_driver(self) -> bool:
        return self.group.rank == 0

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.group.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        """This rank's place in its stage's tensor-parallel group."""
        return self.group.rank % self.tensor_parallel_size


_STATE: ParallelState | None = None


def current() -> ParallelState | None:
    return _STATE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" and dist.is_nccl_available() else "gloo"


def _join(rank: int, world: int, init_method: str, config: EngineConfig, spawned: bool) -> ParallelState:
    """init_process_group for this rank (the device group), plus a gloo group for messages under NCCL."""
    backend = _backend(config.device)
    timeout = timedelta(seconds=config.distributed_timeout)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    group = Group(rank, world, device_group=None, cpu_group=cpu_group)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    tp_group = group if tp > 1 and pp == 1 else None
    if tp > 1 and pp > 1:  # one tensor-parallel group per stage; every rank creates every group, in one order
        for stage in range(pp):
            ranks = list(range(stage * tp, (stage + 1) * tp))
            sub = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
            if rank in ranks:
                tp_group = Group(rank - stage * tp, tp, device_group=sub, cpu_group=None)
    return ParallelState(group, tp, pp, spawned, tp_group=tp_group)


def _threads(config: EngineConfig, local_world: int) -> int:
    total = config.num_threads or os.cpu_count() or 1
    return max(1, total // local_world)


def start(config: EngineConfig) -> ParallelState:
    """Join (or create) the process group of `config`'s parallel engine; see the module docstring."""
    global _STATE
    if _STATE is not None:  # a spawned worker: worker_main joined already (LLMEngine may have set threads since)
        if _STATE.threads:
            torch.set_num_threads(_STATE.threads)
        return _STATE
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if _torchrun_env():
        rank, env_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if env_world != world:
            raise ValueError(f"torchrun started {env_world} processes but tensor_parallel_size x "
                             f"pipeline_parallel_size is {world}; make them equal")
        torch.set_num_threads(_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        _STATE = _join(rank, world, "env://", config, spawned=False)
        _STATE.threads = torch.get_num_threads()
        return _STATE
    per_node = world // config.nnodes
    port = config.master_port or (_free_port() if config.nnodes == 1 else 29500)
    init_method = f"tcp://{config.master_addr}:{port}"
    first = config.node_rank * per_node
    threads = _threads(config, per_node)
    ctx = mp.get_context("spawn")
    procs, conns = [], {}
    for rank in range(first + 1, first + per_node):
        read, write = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main, args=(rank, world, init_method, config, threads, write),
                        name=f"brisk-rank{rank}", daemon=True)
        p.start()
        write.close()
        procs.append(p)
        conns[rank] = read
    torch.set_num_threads(threads)
    try:
        state = _join(first, world, init_method, config, spawned=False)
    except BaseException:
        stop_processes(procs)
        raise
    state.procs, state.conns, state.threads = procs, conns, threads
    _STATE = state
    return state


def wait_ready(state: ParallelState, timeout: float) -> None:
    """Rank 0 after building its own shard: every rank has built its own (a monitored barrier names the rank that
    did not get there); a spawned worker's own error text is reported where it sent one."""
    try:
        dist.monitored_barrier(group=state.group.cpu_group, timeout=timedelta(seconds=timeout))
    except RuntimeError as e:
        raise ParallelError(f"a worker failed to start: {worker_errors(state) or e}") from e


def gather_weight_bytes(state: ParallelState, nbytes: int) -> list[int] | None:
    """Every rank's weight bytes (parameters and buffers of its shard), on the driver in rank order; None on the
    workers. Every rank calls it once, right after the start-up barrier."""
    parts: list[int] | None = [0] * state.group.size if state.is_driver else None
    dist.gather_object(int(nbytes), parts, dst=0, group=state.group.cpu_group)
    return parts


def worker_errors(state: ParallelState) -> str:
    """What the spawned workers reported before failing, and which of them died (exit codes)."""
    lines = []
    for rank, conn in state.conns.items():
        try:
            while conn.poll():
                kind, text = conn.recv()
                if kind == "error":
                    lines.append(f"rank {rank}: {text}")
        except (EOFError, OSError):
            pass
    for p in state.procs:
        if p.exitcode not in (None, 0):
            lines.append(f"{p.name} exited with code {p.exitcode}")
    return "; ".join(lines)


def stop_processes(procs: list[Any], grace: float = 5.0) -> None:
    """Join the spawned workers; terminate, then kill, those still alive after `grace` seconds."""
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=grace)
        if p.is_alive():
            p.kill()
            p.join()


def shutdown(state: ParallelState | None = None) -> None:
    """Stop this process's spawned workers and leave the process group (idempotent)."""
    global _STATE
    state = state or _STATE
    if state is None:
        return
    stop_processes(state.procs)
    for conn in state.conns.values():
        conn.close()
    state.procs, state.conns = [], {}
    if dist.is_initialized():
        dist.destroy_process_group()
    if state is _STATE:
        _STATE = None


def worker_main(rank: int, world: int, init_method: str, config: EngineConfig, threads: int,
                conn: multiprocessing.connection.Connection) -> None:
    """A spawned rank: join the group, build the engine's shard, execute the driver's steps until told to stop."""
    global _STATE
    torch.set_num_threads(threads)
    try:
        _STATE = _join(rank, world, init_method, config, spawned=True)
        _STATE.threads = threads
        from brisk.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)  # its runner is this rank's worker runner (parallel/runner.py)
        conn.send(("ready", ""))
        dist.monitored_barrier(group=_STATE.group.cpu_group, timeout=timedelta(seconds=config.distributed_timeout))
        gather_weight_bytes(_STATE, engine.runner.weight_bytes)
        engine.runner.serve()
    except BaseException as e:  # the driver reads this before it reports the failure
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
