"""Run `brisk serve` in a child process on 127.0.0.1 and wait until it is healthy (tests, `brisk bench serve`).

    with ServerProcess(["--model", path, "--max-model-len", "256"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it; a race with another process is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time; the message carries its log tail."""


class ServerProcess:
    def __init__(self, args: list[str], *, port: int | None = None, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 120.0, log_path: str | Path | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.args = list(args)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        if log_path is None:  # a log of our own: removed when this object goes (or at exit), read until then
            fd, name = tempfile.mkstemp(prefix="brisk-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
            weakref.finalize(self, self.log_path.unlink, missing_ok=True)
        else:
            self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "brisk.cli", "serve", "--host", self.host, "--port", str(self.port), *self.args]
        # the log goes to a file, not a pipe: a pipe nobody drains would block the server once it fills
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"brisk serve exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.is_healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(f"brisk serve was not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-num_lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful: uvicorn drains, the engine loop stops), then SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
