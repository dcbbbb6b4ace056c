"""`python -m brisk.parallel.worker FD`: one rank of a parallel engine, started by the driver (parallel/launch.py).

Its arguments (rank, world size, the rendezvous address, the EngineConfig, its thread count) come pickled on
standard input; its start-up steps and any error go to the driver over the pipe whose write end is file descriptor
FD. Being a module of brisk, not the user's program, it works the same whether the driver runs from a script, a
notebook, `python -c` or standard input.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import sys
import threading
import time


def _die_with_parent(interval: float = 1.0) -> None:
    """Leave when the driver's process is gone, however it went (a kill -9 included: this process is then given to
    another parent), so no worker is left waiting on a process group that no longer exists. (Not Linux's
    PR_SET_PDEATHSIG: it fires when the driver's *thread* that started the worker ends, and a server builds its
    engine on a thread that may end before the engine does.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="brisk-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit("usage: python -m brisk.parallel.worker FD  (started by brisk's parallel engine, which "
                         "writes the worker's arguments to its standard input)")
    _die_with_parent()
    conn = multiprocessing.connection.Connection(int(argv[0]), readable=False)
    try:
        rank, world, init_method, config, threads = pickle.load(sys.stdin.buffer)  # noqa: S301 - from our driver
    except Exception as e:  # noqa: BLE001 - whatever broke, the driver must hear it
        conn.send(("error", f"could not read the worker's arguments: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    from brisk.parallel.launch import worker_main

    worker_main(rank, world, init_method, config, threads, conn)


if __name__ == "__main__":
    main()
