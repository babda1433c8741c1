"""A run folder's run.sh started as N nodes would start it, all on this machine.

    nodes = start_nodes(jobs.write("tiny-cpu", nnodes=2, nproc_per_node=1, out=DIR), 2)
    nodes.wait()         # [0, 0]: each node's exit code
    nodes.transport()    # the TCP connections the ranks held: gloo's pairs, the c10d store

Node ranks 0..N-1 meet in torchrun's c10d rendezvous at 127.0.0.1 on a free port, exactly as
separate machines meet at node 0 (kit.run.jobs writes the folder; run.sh reads NNODES, NODE_RANK,
MASTER_ADDR, MASTER_PORT). Each node keeps its own pid, exit_code and log (node_dir): node 0 in
the run folder, where kit.run.launch.Run reads them, node N in logs/node-N/. Kernel side: no torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kit.folder.layout import RunFolder
from kit.run.runs import Run


def node_dir(folder: str | Path, node: int) -> Path:
    """Where run.sh keeps a node's pid, exit_code and terminal log: node 0 in the run folder
    (what kit.run.launch.Run reads), node N in logs/node-N/ (nodes may share the folder)."""
    return RunFolder(folder).node_dir(node)


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel hands out another one next time)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(folder: str | Path, nnodes: int = 2, env: dict | None = None) -> Nodes:
    """Start the folder's run.sh `nnodes` times on this machine, as that many nodes would start
    it: NNODES, NODE_RANK 0..n-1, MASTER_ADDR 127.0.0.1 and a free MASTER_PORT (unless `env`
    sets one); each in a session of its own, its output in its node_dir's run.log. Returns at
    once; `Nodes.wait()` blocks."""
    folder = Path(folder).resolve()
    port = int((env or {}).get("MASTER_PORT") or free_port())
    base = {**os.environ, "NNODES": str(nnodes), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), **{k: str(v) for k, v in (env or {}).items()}}
    procs = []
    run_sh = str(RunFolder(folder).run_sh)
    for node in range(nnodes):
        where = RunFolder(node_dir(folder, node))
        where.path.mkdir(parents=True, exist_ok=True)
        where.exit_code.unlink(missing_ok=True)
        with open(where.log, "wb") as log:
            procs.append(subprocess.Popen(
                ["bash", run_sh], cwd=folder, env={**base, "NODE_RANK": str(node)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))  # fmt: skip
        where.pid.write_text(f"{procs[-1].pid}\n")  # run.sh writes the same
    return Nodes(folder, port, procs, [Run(node_dir(folder, n)) for n in range(nnodes)])


@dataclass
class Nodes:
    """Node processes started by start_nodes: one kit.run.launch.Run per node (on its node_dir)."""

    folder: Path
    port: int
    procs: list
    runs: list
    # (node, pid, role, local (ip, port), remote (ip, port)) of every TCP connection seen, and
    # (pid, port) of every port a process listened on (the server side of its connections)
    seen: set = field(default_factory=set)
    listening: set = field(default_factory=set)

    def wait(self, timeout: float = 600, poll_s: float = 0.2, check: bool = True) -> list[int]:
        """Block until every node has ended, sampling the TCP connections of their processes;
        return each node's exit code. A node that failed raises RunFailed (the run folder's
        failure: every node's torchrun logs are there; check=False returns the codes); past
        `timeout` every node is stopped and TimeoutError raised."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs):
            self._sample()
            if time.monotonic() > deadline:
                for run in self.runs:
                    run.stop(grace_s=2)
                raise TimeoutError(f"{self.folder.name}: nodes stopped after {timeout}s")
            time.sleep(poll_s)
        codes = [run.exit_code if run.exit_code is not None else p.returncode
                 for run, p in zip(self.runs, self.procs, strict=True)]
        if check and any(codes):
            raise self.runs[codes.index(next(c for c in codes if c))].failure()
        return codes

    def _sample(self) -> None:
        for node, run in enumerate(self.runs):
            for p in run.processes():
                try:
                    cmd = " ".join(p.cmdline())
                    role = "agent" if "torch.distributed.run" in cmd else "rank" if (
                        "python" in p.name()) else None
                    for c in p.net_connections(kind="tcp") if role else ():
                        if c.raddr:
                            self.seen.add((node, p.pid, role, _ip(c.laddr), _ip(c.raddr)))
                        elif c.status == psutil.CONN_LISTEN:
                            self.listening.add((p.pid, c.laddr.port))
                except psutil.Error:
                    pass

    def transport(self) -> list[str]:
        """The TCP connections the ranks and agents held, one line per kind, with the addresses'
        interfaces: between ranks (gloo's pairs), to the c10d rendezvous store (node 0's agent,
        MASTER_PORT), to the store an agent hosts for the ranks (the first node to join)."""
        owner = {local: (node, role, pid) for node, pid, role, local, _ in self.seen}
        names = {a.address: name for name, addrs in psutil.net_if_addrs().items() for a in addrs}
        kinds: dict[tuple, set] = {}
        for node, pid, role, local, remote in self.seen:
            peer = owner.get(remote)
            if peer is None or peer[2] == pid or (pid, local[1]) in self.listening:
                continue  # a process's own store, or a server's end (counted from the client's)
            if peer[1] == "rank":
                what = "rank -> rank (gloo's pair)"
            elif remote[1] == self.port:
                what = f"{role} -> node {peer[0]}'s agent, MASTER_PORT (the c10d rendezvous store)"
            else:
                what = (f"{role} -> node {peer[0]}'s agent, port {remote[1]} "
                        "(its store for the ranks)")
            path = (f"{local[0]} ({names.get(local[0], '?')}) -> "
                    f"{remote[0]} ({names.get(remote[0], '?')})")
            between = f"node {node} -> node {peer[0]}"
            kinds.setdefault((what, path), set()).add((pid, local, between))
        lines = []
        for (what, path), conns in sorted(kinds.items()):
            between = ", ".join(sorted({n for *_, n in conns}))
            lines.append(f"{what}: {len(conns)} TCP connection(s), {path}; {between}")
        return lines


def _ip(address) -> tuple[str, int]:
    """(ip, port), an IPv4 address mapped into IPv6 (::ffff:a.b.c.d) written as a.b.c.d."""
    ip = address.ip[7:] if address.ip.startswith("::ffff:") else address.ip
    return ip, address.port
