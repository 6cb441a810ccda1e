"""A real DNS server for the multi-host tests and benchmarks: dnsmasq (`scripts/setup.sh`
installs it from apt), answering for names whose addresses the caller sets, as a Kubernetes
headless Service's name lists its ready pods."""

from __future__ import annotations

import getpass
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from serving.launch import free_port


class Dnsmasq:
    """dnsmasq on 127.0.0.1 at a free port, answering from a hosts file of its own only."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
        if not Path(binary).exists():
            raise RuntimeError("no dnsmasq: scripts/setup.sh installs it (apt-get install "
                               "dnsmasq-base)")  # fmt: skip
        # Absolute: dnsmasq runs from / once started, and reads the file again from there.
        self.hosts = (folder / "hosts").resolve()
        self.hosts.write_text("")
        self.port = free_port()
        # --local: it answers for .test itself (no such name), where it would say REFUSED.
        command = [binary, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={self.port}",
                   "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
                   "--local=/test/", f"--addn-hosts={self.hosts}", "--local-ttl=0",
                   f"--user={getpass.getuser()}", "--pid-file="]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dnsmasq did not start: {self.process.stderr.read()!r}")  # type: ignore[union-attr]
            time.sleep(0.05)

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, *addresses: str) -> None:
        """From now on, `name` resolves to `addresses` (none: to nothing)."""
        self.hosts.write_text("".join(f"{address} {name}\n" for address in addresses))
        self.process.send_signal(signal.SIGHUP)  # dnsmasq reads its hosts files again

    def _answers(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
