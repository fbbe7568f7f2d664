"""Real Redis topologies for tests: a Redis Cluster (`redis-server --cluster-enabled yes`, joined by
`redis-cli --cluster create`) and a Sentinel-watched primary with one replica (`redis-server
--sentinel`), each on free loopback ports in a temporary directory."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.support import free_port, wait_until

SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000  # how long a silent primary takes to be judged failed (Redis' default: 15 s)


def command(port: int, *args: str, timeout: float = 5.0) -> str:
    """One command through redis-cli, its raw reply as text ("" when the node is unreachable)."""
    result = subprocess.run(
        [CLI, "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True, timeout=timeout
    )
    return result.stdout.strip()


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisNode:
    """One redis-server process with its own directory; `kill` and `start` simulate a crash."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.port = free_port()
        self.dir = directory / str(self.port)
        self.dir.mkdir()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: answers(self.port), 10, f"redis-server on port {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


class LocalCluster:
    """`masters` primaries, each with `replicas` replicas, slots spread evenly by redis-cli."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="rcp-cluster-")
        root = Path(self._tmp.name)
        self.nodes: list[RedisNode] = []
        try:
            for _ in range(masters * (1 + replicas)):
                # The bus port is given: the default, port + 10000, may be taken or past 65535.
                node = RedisNode(
                    root,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                )
                node.start()
                self.nodes.append(node)
            created = subprocess.run(
                [
                    CLI,
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout}{created.stderr}")
            wait_until(lambda: self.healthy(masters * (1 + replicas)), 30, "the cluster to be ok")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """Two seed nodes are enough: the client learns the rest from them."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def alive(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.proc is not None]

    def healthy(self, members: int | None = None) -> bool:
        """Every live node sees the cluster ok and (if given) that many connected members."""
        for node in self.alive():
            info = command(node.port, "CLUSTER", "INFO")
            if "cluster_state:ok" not in info:
                return False
            if members is not None and f"cluster_known_nodes:{members}" not in info:
                return False
        return True

    def primaries(self) -> list[RedisNode]:
        return [n for n in self.alive() if "role:master" in command(n.port, "INFO", "replication")]

    def replicas_synced(self) -> bool:
        """Every replica has finished its first sync with its primary."""
        return all(
            "master_link_status:up" in command(n.port, "INFO", "replication")
            for n in self.alive()
            if n not in self.primaries()
        )

    def primary_of(self, key: str) -> RedisNode:
        slot = int(command(self.nodes[0].port, "CLUSTER", "KEYSLOT", key))
        for node in self.primaries():
            if _owns(node.port, slot):
                return node
        raise LookupError(f"no live primary owns slot {slot}")

    def keys_per_primary(self, pattern: str) -> list[int]:
        return [len(command(n.port, "--scan", "--pattern", pattern).split()) for n in self.primaries()]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        self._tmp.cleanup()


def _owns(port: int, slot: int) -> bool:
    """Whether the node at `port` serves `slot` as its primary (CLUSTER SHARDS would say too)."""
    own_id = command(port, "CLUSTER", "MYID")
    for line in command(port, "CLUSTER", "NODES").splitlines():
        fields = line.split()
        if fields[0] != own_id or "master" not in fields[2]:
            continue
        for span in fields[8:]:
            if span.startswith("["):
                continue  # a slot being migrated
            low, _, high = span.partition("-")
            if int(low) <= slot <= int(high or low):
                return True
    return False


class LocalSentinel:
    """A primary, one replica of it, and one Sentinel watching them as `service`."""

    def __init__(self, service: str = "rcp-primary") -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="rcp-sentinel-")
        root = Path(self._tmp.name)
        self.service = service
        self.nodes: list[RedisNode] = []
        self.sentinel: subprocess.Popen[bytes] | None = None
        try:
            primary = RedisNode(root)
            primary.start()
            replica = RedisNode(root, "--replicaof", "127.0.0.1", str(primary.port))
            replica.start()
            self.nodes = [primary, replica]
            wait_until(
                lambda: "master_link_status:up" in command(replica.port, "INFO", "replication"),
                15,
                "the replica to sync",
            )
            self.sentinel_port = free_port()
            config = root / "sentinel.conf"  # Sentinel rewrites its config file: it must be its own
            config.write_text(
                f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {root}\n"
                f"sentinel monitor {service} 127.0.0.1 {primary.port} 1\n"
                f"sentinel down-after-milliseconds {service} 1000\n"
                f"sentinel failover-timeout {service} 5000\n"
            )
            self.sentinel = subprocess.Popen(
                [SERVER, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            wait_until(lambda: self.replicas_known() >= 1, 20, "the sentinel to learn the replica")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{self.service}/0"

    def primary_port(self) -> int:
        reply = command(self.sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service).split()
        return int(reply[1]) if len(reply) == 2 else 0

    def replicas_known(self) -> int:
        reply = command(self.sentinel_port, "SENTINEL", "REPLICAS", self.service)
        return reply.splitlines().count("port")  # one field name per line, one "port" per replica

    def failover(self) -> int:
        """Promote the replica through Sentinel; the new primary's port once it serves writes."""
        old = self.primary_port()
        # Refused (NOGOODSLAVE) until Sentinel has its own fresh INFO from the replica: ask again.
        wait_until(
            lambda: command(self.sentinel_port, "SENTINEL", "FAILOVER", self.service) == "OK",
            30,
            "sentinel to accept the failover",
        )
        wait_until(lambda: self.primary_port() not in (0, old), 20, "sentinel to name a new primary")
        new = self.primary_port()
        wait_until(lambda: "role:master" in command(new, "INFO", "replication"), 20, "the new primary")
        return new

    def stop(self) -> None:
        if self.sentinel is not None:
            self.sentinel.kill()
            self.sentinel.wait(10)
            self.sentinel = None
        for node in self.nodes:
            node.kill()
        self._tmp.cleanup()
