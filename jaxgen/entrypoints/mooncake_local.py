"""A Mooncake Store on this machine's loopback, for trying the shared KV tier and for the tests
and benchmarks that need one: `mooncake_master` (with its HTTP metadata server) and a storage
process (`mooncake_client`) that lends the store `segment_bytes` of memory, so blocks outlive
the engines that wrote them. Both binaries come with the `mooncake` extra.

    with LocalMooncake(segment_bytes=1 << 30) as store:
        llm = LLM(kv_mooncake=store.config())

A real deployment runs the same two programs on its storage hosts and gives every engine the
same `master_server_address` and `metadata_server`.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from jaxgen.cache.mooncake import INSTALL_HINT, MooncakeUnavailable

MIN_SEGMENT_BYTES = 16 << 20  # mooncake_client refuses smaller segments


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_CHOSEN_PORT = 10000


def ephemeral_ports() -> range:
    """The ports this kernel hands out to outgoing connections and to `bind(port 0)`."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(x) for x in f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)  # Linux's default


def free_port() -> int:
    """A TCP port free on loopback now, for a server that binds it a few seconds later.

    Chosen below the kernel's ephemeral range, so an outgoing connection (which takes any
    ephemeral port) cannot take it in between: a port from `bind(port 0)` was taken so by a
    client of another test once, and the server started seconds later failed with EADDRINUSE.
    """
    low = ephemeral_ports().start
    rng = random.SystemRandom()
    if low > LOWEST_CHOSEN_PORT:
        for _ in range(64):
            port = rng.randrange(LOWEST_CHOSEN_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped by a signal (state T in /proc)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        except FileNotFoundError:  # the thread exited
            continue
    return all(state in "Tt" for state in states)


def _binary(name: str) -> str:
    """The program next to this interpreter (a venv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    path = here if os.access(here, os.X_OK) else shutil.which(name)
    if path is None:
        raise MooncakeUnavailable(f"{name} not found: {INSTALL_HINT}")
    return path


class LocalMooncake:
    """Starts a master and (with `segment_bytes` > 0) a storage process on free loopback ports;
    `stop()` (or leaving the `with` block) ends both. `config()` is the client configuration
    an engine's `kv_mooncake=` takes."""

    def __init__(self, segment_bytes: int = 256 << 20, *, log_dir: str | None = None,
                 start_timeout_s: float = 30.0):  # fmt: skip
        if segment_bytes and segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"Mooncake segments hold at least {MIN_SEGMENT_BYTES} bytes (16 MiB), "
                             f"got segment_bytes={segment_bytes}")  # fmt: skip
        self.segment_bytes = int(segment_bytes)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="jaxgen-mooncake-")
        self.start_timeout_s = start_timeout_s
        self.host = "127.0.0.1"
        self.master: subprocess.Popen | None = None
        self.storage: subprocess.Popen | None = None

    def __enter__(self) -> LocalMooncake:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def config(self, global_segment_size: int = 0, **extra) -> dict:
        """Mooncake's client configuration for an engine using this store (by default it lends
        no memory of its own: the storage process holds the blocks)."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": self.host,
            "global_segment_size": global_segment_size,
            "protocol": "tcp",
            **extra,
        }

    def start(self) -> None:
        self.start_master()
        if self.segment_bytes > 0:
            self.storage = self._spawn(
                "storage",
                [
                    _binary("mooncake_client"),
                    f"-global_segment_size={self.segment_bytes}",
                    f"-host={self.host}",
                    f"-port={free_port()}",
                    f"-master_server_address={self.master_address}",
                    f"-metadata_server={self.metadata_server}",
                    "-protocol=tcp",
                ],
            )
            self._wait(lambda: self.capacity_bytes() >= self.segment_bytes, "the storage segment")

    def start_master(self) -> None:
        """Starts (or, after `kill_master`, restarts) the master on fresh ports."""
        self.rpc_port, self.http_port, self.metrics_port = (free_port() for _ in range(3))
        self.master = self._spawn(
            "master",
            [
                _binary("mooncake_master"),
                f"-rpc_port={self.rpc_port}",
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_host={self.host}",
                f"-http_metadata_server_port={self.http_port}",
                f"-metrics_port={self.metrics_port}",
            ],
        )
        self._wait(lambda: self.metrics() is not None, "mooncake_master")

    def _spawn(self, what: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{what}.log"), "ab")
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for proc in (self.master, self.storage):
                if proc is not None and proc.poll() is not None:
                    self.stop()
                    raise MooncakeUnavailable(
                        f"{what} exited with code {proc.returncode} (logs in {self.log_dir}; "
                        "a missing libibverbs.so.1 needs Debian's libibverbs1)"
                    )
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        raise MooncakeUnavailable(f"{what} not ready after {self.start_timeout_s:g} s "
                                  f"(logs in {self.log_dir})")  # fmt: skip

    def metrics(self) -> str | None:
        """The master's Prometheus text (None while it does not answer)."""
        try:
            url = f"http://{self.host}:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return r.read().decode()
        except OSError:
            return None

    def _metric(self, name: str) -> int:
        match = re.search(rf"^{name} (\S+)$", self.metrics() or "", re.MULTILINE)
        return int(float(match.group(1))) if match else 0

    def capacity_bytes(self) -> int:
        """Memory the store's segments lend it."""
        return self._metric("master_total_capacity_bytes")

    def allocated_bytes(self) -> int:
        """Memory its stored objects take now."""
        return self._metric("master_allocated_bytes")

    def kill_master(self) -> None:
        """Kills the master at once (a fault test): clients' calls fail until it is back."""
        if self.master is not None:
            self.master.kill()
            self.master.wait()

    def pause_master(self, paused: bool = True) -> None:
        """Stops (SIGSTOP) or resumes the master: clients' calls hang until they time out.

        Returns once every thread of the master is stopped (or running again): a signal is
        only queued when `kill` returns, and on a loaded machine a thread may run on for a
        while before it takes it."""
        if self.master is None:
            return
        self.master.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)
        deadline = time.monotonic() + self.start_timeout_s
        while _stopped(self.master.pid) != paused:
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master did not {'stop' if paused else 'resume'}")
            time.sleep(0.01)

    def stop(self) -> None:
        for proc in (self.storage, self.master):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.storage = self.master = None
