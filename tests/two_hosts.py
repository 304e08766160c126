"""Two hosts on one machine, for tests: two network namespaces joined by a veth pair, each with its own address,
hostname and /etc/hosts, and commands started inside them as the hosts would run them.

    with TwoHosts(tmp_path) as hosts:
        a = hosts.start(hosts.a, ["docker/torchrun-multinode.sh", ...], env, tmp_path / "a.log")
        hosts.cut()          # host B's link down (a partition); hosts.restore() brings it back

Each host's /etc/hosts is Debian's and Ubuntu's default shape, its own hostname on 127.0.0.1, the setup on
which torchrun's guesses from the hostname go wrong (#66). The folders of the machine are shared, as a run
folder on a shared filesystem would be. Needs root and iproute2's `ip` (CI runs as root on this machine
kind); `unshare --uts --mount` gives each command its hostname and /etc/hosts. Everything is removed on
exit: the processes started (by process group), then the namespaces (which take the veth pair with them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SUBNET = "10.99"


@dataclass
class Host:
    name: str  # hostname
    netns: str
    ifname: str
    addr: str


def can_make_hosts() -> str | None:
    """None when this machine can make the hosts, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (Debian: iproute2, util-linux)"
    return None


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class TwoHosts:
    def __init__(self, tmp: Path):
        tag = f"{os.getpid() % 100000}"  # unique per test process; interface names are at most 15 bytes
        third = os.getpid() % 250 + 1  # a /24 of its own, so two test processes never share addresses
        self.tmp = tmp
        self.a = Host("host-a", f"gpa{tag}", f"gva{tag}", f"{SUBNET}.{third}.1")
        self.b = Host("host-b", f"gpb{tag}", f"gvb{tag}", f"{SUBNET}.{third}.2")
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoHosts:
        why = can_make_hosts()
        if why:
            pytest.fail(f"the two-host tests {why}")
        self.close()  # a namespace left by a killed earlier run of this pid
        try:
            for h in (self.a, self.b):
                sh("ip", "netns", "add", h.netns)
            sh("ip", "link", "add", self.a.ifname, "type", "veth", "peer", "name", self.b.ifname)
            for h in (self.a, self.b):
                sh("ip", "link", "set", h.ifname, "netns", h.netns)
                sh("ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
                sh("ip", "-n", h.netns, "link", "set", h.ifname, "up")
                sh("ip", "-n", h.netns, "link", "set", "lo", "up")
                (self.tmp / f"hosts-{h.name}").write_text(f"127.0.0.1 localhost {h.name}\n")
        except Exception:
            self.close()
            raise
        return self

    def start(self, host: Host, cmd: list[str], env: dict, log: Path,
              binds: tuple[tuple[Path, Path], ...] = ()) -> subprocess.Popen:
        """`cmd` on `host`, in a process group of its own (the pid is the command's: ip, unshare and sh exec).
        `binds`: (source, target) folders mounted on this host only (a folder the hosts do not share)."""
        mounts = "".join(f"mount --bind {src} {dst} && " for src, dst in binds)
        inner = (f'hostname {host.name} && mount --bind {self.tmp / f"hosts-{host.name}"} /etc/hosts && '
                 f'{mounts}exec "$@"')
        p = subprocess.Popen(["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "sh", "-c", inner,
                              "sh", *cmd], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def cut(self) -> None:
        sh("ip", "-n", self.b.netns, "link", "set", self.b.ifname, "down")

    def restore(self) -> None:
        sh("ip", "-n", self.b.netns, "link", "set", self.b.ifname, "up")

    def close(self) -> None:
        import psutil

        # torchrun starts its workers in sessions of their own: the whole tree, by pid, then the groups
        tree = []
        for p in self.procs:
            try:
                tree += psutil.Process(p.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for q in tree:
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for h in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=30)
        deadline = time.monotonic() + 10  # the veth pair goes with the namespaces, asynchronously
        while time.monotonic() < deadline and subprocess.run(
                ["ip", "link", "show", self.a.ifname], capture_output=True).returncode == 0:
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self.close()
