"""``meshd worker`` child processes on loopback ports, for the benchmark and the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from meshd.daemon.commands.worker import free_port
from meshd.native.errors import WorkerUnreachable
from meshd.native.rpc import hello, parse_endpoint

__all__ = ["LoopbackWorkers"]


class LoopbackWorkers:
    """``meshd worker`` child processes on loopback ports (``--threads 1``), for the
    benchmark and the tests: started (each answers a handshake before this returns),
    killed one by one, started again, all ended by :meth:`close`."""

    def __init__(self, n: int, *, start_timeout: float = 60.0) -> None:
        self.start_timeout = start_timeout
        self.addresses = tuple(f"127.0.0.1:{free_port()}" for _ in range(n))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for address in self.addresses:
                self.start(address)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LoopbackWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def first(self, n: int) -> Sequence[str]:
        return self.addresses[:n]

    def start(self, address: str) -> None:
        env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshd.daemon.commands.cli", "worker", "--listen", address,
             "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.procs[address] = proc
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                hello(parse_endpoint(address), timeout=5)
                return
            except WorkerUnreachable:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def kill(self, address: str) -> None:
        proc = self.procs[address]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
