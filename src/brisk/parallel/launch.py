"""Starting the ranks of a parallel engine and joining them in one torch.distributed process group.

Three ways in, one result (this process's `Group`):

    one machine        brisk starts ranks 1..N-1 itself, each as `python -m brisk.parallel.worker` (parallel/worker.py);
                       this process is rank 0, the driver. Rendezvous on 127.0.0.1 and a free port.
    several machines   every node runs the same brisk command with --nnodes K --node-rank i --master-addr HOST
                       (--master-port P); node i starts its N/K ranks, the first of them being the process itself.
                       Node 0's first rank is the driver; every other node's process is a worker.
    torchrun           `torchrun --nproc-per-node ... -m brisk.cli ...`: RANK, WORLD_SIZE, MASTER_ADDR/PORT come from
                       the environment (env:// rendezvous) and brisk starts nothing.

Workers are processes of brisk's own module, not of the user's program: multiprocessing's spawn would import the
parent's `__main__` again in every worker, which breaks notebooks, `python -c` and scripts read from standard input
(`<stdin>` cannot be run twice). The worker reads its arguments (rank, the rendezvous, the EngineConfig) pickled on
its standard input and reports over a pipe of its own:

    worker                                         driver (this process)
    ("step", "loading the model")                  waits for every worker to reach the process group, watching the
    ("step", "joining the process group")   ---->    processes: a worker that exits is reported at once, with its
    init_process_group  <----------------------->  init_process_group                    own error; one that makes
    ("step", "building its shard")                 builds its own shard                  no progress within the
    ("ready", "")                           ---->  waits for every worker's "ready"      bound is named with the
    monitored barrier, weights gathered     <--->  monitored barrier, weights gathered   step it is stuck in
    executes the driver's steps

The driver joins the group only once every worker has loaded its model, so no rank sits in a collective while
another is still loading (or dead), and the start-up collectives (the barrier, the weights gather) are issued only
once every worker said it built the same engine.

Each rank takes its share of the cores: torch.set_num_threads(threads // ranks on this machine). A rank other than
the driver builds the same engine (the same model load, the same KV pool size), keeps its shard and then only
executes what the driver sends (parallel/runner.py); when that is an inherited process (torchrun, another node's
brisk command), it leaves the process once the driver stops it.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

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
    procs: list[Any] = field(default_factory=list)  # the worker processes this process started (WorkerProcess)
    conns: dict[int, Any] = field(default_factory=dict)  # rank -> read end of its status pipe
    threads: int = 0  # this rank's torch threads (0: left as they are)
    steps: dict[int, str] = field(default_factory=dict)  # rank -> the start-up step it last reported
    errors: dict[int, str] = field(default_factory=dict)  # rank -> the error it reported (read off its pipe)

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


class WorkerProcess:
    """A rank this process started (`python -m brisk.parallel.worker`), with the part of multiprocessing.Process's
    interface the launcher uses (join, is_alive, terminate, kill, exitcode, name, pid)."""

    def __init__(self, rank: int, popen: subprocess.Popen[bytes]) -> None:
        self.rank, self.popen, self.name = rank, popen, f"brisk-rank{rank}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


def describe_exit(code: int) -> str:
    """`exited with code 1`, or the signal that killed it (SIGKILL is most often the kernel's out-of-memory killer)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (the out-of-memory killer, or a kill -9)" if name == "SIGKILL" else ""
    return f"was killed by {name}{hint}"


def spawn_worker(rank: int, world: int, init_method: str, config: EngineConfig, threads: int
                 ) -> tuple[WorkerProcess, multiprocessing.connection.Connection]:
    """Start rank `rank` as `python -m brisk.parallel.worker` (this interpreter, this environment, brisk's own
    package first on its path): its arguments pickled on its standard input, its reports on a pipe of its own."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds brisk/ (a checkout's src/)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        popen = subprocess.Popen([sys.executable, "-m", "brisk.parallel.worker", str(write_fd)], stdin=subprocess.PIPE,
                                 pass_fds=(write_fd,), env=env)
    finally:
        os.close(write_fd)
    conn = multiprocessing.connection.Connection(read_fd, writable=False)
    try:
        assert popen.stdin is not None
        popen.stdin.write(pickle.dumps((rank, world, init_method, config, threads), protocol=pickle.HIGHEST_PROTOCOL))
        popen.stdin.close()
    except OSError:  # it died before reading them: its exit code and error are reported by the start-up wait
        pass
    return WorkerProcess(rank, popen), conn


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
    procs, conns = [], {}
    try:
        for rank in range(first + 1, first + per_node):
            proc, conns[rank] = spawn_worker(rank, world, init_method, config, threads)
            procs.append(proc)
    except BaseException:
        stop_processes(procs)
        raise
    torch.set_num_threads(threads)
    # a placeholder state until the group exists: the start-up wait reads the workers' pipes into it
    group = Group(first, world)
    state = ParallelState(group, config.tensor_parallel_size, config.pipeline_parallel_size, spawned=False,
                          procs=procs, conns=conns, threads=threads)
    try:
        # every worker has loaded its model before anyone joins: a worker that dies while loading is reported at
        # once, not after the rendezvous' timeout (loading may compile the kernels: a bound of its own)
        await_workers(state, "joining the process group", max(float(config.distributed_timeout), LOAD_SECONDS))
        joined = _join(first, world, init_method, config, spawned=False)
    except BaseException:
        stop_processes(procs)
        for conn in conns.values():
            conn.close()
        raise
    joined.procs, joined.conns, joined.threads = procs, conns, threads
    joined.steps, joined.errors = state.steps, state.errors
    _STATE = joined
    return joined


LOAD_SECONDS = 600.0  # the bound on a worker's model load: the first load of a large file, the kernels' first build
NOTICE_SECONDS = 10.0  # after this long waiting on a worker, the driver says once what it waits for


def _read_reports(state: ParallelState, rank: int, want: str | None) -> bool:
    """Take every report rank `rank` has sent so far into state.steps / state.errors; True when `want` (a step
    name, or "ready") was among them or reached before."""
    conn = state.conns[rank]
    try:
        while conn.poll():
            kind, text = conn.recv()
            if kind == "step":
                state.steps[rank] = text
            elif kind == "ready":
                state.steps[rank] = "ready"
            elif kind == "error":
                state.errors[rank] = text
    except (EOFError, OSError):  # the worker closed its pipe: it exited (or is exiting)
        pass
    if want is None:
        return False
    order = WORKER_STEPS
    reached = state.steps.get(rank, "starting")
    return reached in order and order.index(reached) >= order.index(want)


WORKER_STEPS = ("starting", "loading the model", "joining the process group", "building its shard", "ready")


def await_workers(state: ParallelState, want: str, timeout: float) -> None:
    """Wait until every worker this process started has reached start-up step `want` (WORKER_STEPS), watching the
    processes: ParallelError at once, with the worker's own error, when one exits or reports an error; and
    ParallelError naming the rank and the step it is in when one has not got there within `timeout` seconds."""
    procs = {p.rank: p for p in state.procs if isinstance(p, WorkerProcess)}
    pending = set(state.conns)
    started = time.monotonic()
    noticed = False
    while True:
        for rank in list(pending):
            if _read_reports(state, rank, want):
                pending.discard(rank)
            elif rank in state.errors or not procs[rank].is_alive():
                _read_reports(state, rank, None)  # what it sent just before exiting
                step = state.steps.get(rank, "starting")
                why = state.errors.get(rank) or (f"it {describe_exit(procs[rank].exitcode or 0)}"
                                                 if not procs[rank].is_alive() else "it reported an error")
                raise ParallelError(f"a worker failed to start: rank {rank} failed while {step}: {why}")
        if not pending:
            return
        waited = time.monotonic() - started
        if waited > timeout:
            stuck = ", ".join(f"rank {r} is still {state.steps.get(r, 'starting')}" for r in sorted(pending))
            raise ParallelError(f"a worker failed to start: no worker reached '{want}' within {timeout:.0f} s "
                                f"({stuck}); it may be stuck there, see its output above (--distributed-timeout sets "
                                "the bound after loading)")
        if waited > NOTICE_SECONDS and not noticed:
            noticed = True
            logger.warning("brisk: waiting for parallel worker(s) to finish start-up: %s", ", ".join(
                f"rank {r} {state.steps.get(r, 'starting')}" for r in sorted(pending)))
        # a report, or a closed pipe (the worker exited), wakes the wait; exits are checked at least every 0.2 s
        multiprocessing.connection.wait([state.conns[r] for r in pending], timeout=0.2)


def wait_ready(state: ParallelState, timeout: float) -> None:
    """Rank 0 after building its own shard: every worker it started has built its own (watched, as the start-up
    wait), then every rank, those of other nodes too, meets at a monitored barrier (which names the rank that did
    not get there)."""
    await_workers(state, "ready", timeout)
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
    """What the started workers reported before failing, and which of them died (exit codes, signals)."""
    for rank in state.conns:
        _read_reports(state, rank, None)
    lines = [f"rank {rank}: {text}" for rank, text in sorted(state.errors.items())]
    for p in state.procs:
        if p.exitcode not in (None, 0):
            lines.append(f"{p.name} {describe_exit(p.exitcode)}")
    return "; ".join(lines)


def stop_processes(procs: list[Any], grace: float = 5.0) -> None:
    """Join the started workers; terminate, then kill, those still alive after `grace` seconds."""
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
    """A started rank (parallel/worker.py): load the model, join the group, build the engine's shard, execute the
    driver's steps until told to stop; every start-up step reported on `conn` (see the module docstring)."""
    global _STATE
    torch.set_num_threads(threads)
    try:
        from brisk.engine.llm_engine import LLMEngine, load_engine_model

        conn.send(("step", "loading the model"))
        loaded = load_engine_model(config)
        conn.send(("step", "joining the process group"))
        _STATE = _join(rank, world, init_method, config, spawned=True)
        _STATE.threads = threads
        conn.send(("step", "building its shard"))
        engine = LLMEngine(config, loaded)  # its runner is this rank's worker runner (parallel/runner.py)
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
