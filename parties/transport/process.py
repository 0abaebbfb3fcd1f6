"""Start a party service as its own process and wait until it listens (walkthrough, tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from parties.errors import PeerError
from parties.storage.files import open_private_log

__all__ = ["ServiceProcess"]


class ServiceProcess:
    """``python -m <module> <command> ...`` (``serve`` unless given) in a child process, its output in ``log_file``.

    ``prefix``: a command that runs the rest, e.g. ``ip netns exec NAME`` (it must exec it, so the signals
    ``stop`` sends reach the service)."""

    def __init__(
        self, module: str, args: list[str], ready_file: Path, log_file: Path, cwd: Path | None = None,
        prefix: tuple[str, ...] = (), command: str = "serve",
    ) -> None:
        self.module, self.ready_file, self.log_file = module, Path(ready_file), Path(log_file)
        self.ready_file.unlink(missing_ok=True)
        self._log = open_private_log(self.log_file)  # a service's log says what it did: its party's alone
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, command, *args, "--ready-file", str(self.ready_file)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=cwd,
        )
        self.url: str | None = None

    def wait_ready(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.url = str(json.loads(self.ready_file.read_text())["url"])
                return self.url
            if self.proc.poll() is not None:
                raise PeerError(f"{self.module} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        self.stop()
        raise PeerError(f"{self.module} did not start listening in {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self.log_file.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
