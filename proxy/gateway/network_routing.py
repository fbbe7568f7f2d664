"""Which network a call goes to: a declared host, a path prefix, a Host's first label, else the method's
family default; and the allow-list of methods, checked before any route is remembered."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.config import Settings
from proxy.host_names import host_name
from proxy.memo import Memo
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import INVALID_REQUEST, METHOD_NOT_FOUND, Call, JsonRpcError
from proxy.rpc.methods import family_of, refusal


def websocket_only() -> JsonRpcError:
    """A WebSocket path (`/ws/v3/<key>`, `/<network>/ws/v3/<key>`) asked with another HTTP method."""
    return JsonRpcError(
        INVALID_REQUEST,
        "method not allowed: this is a WebSocket endpoint (GET with Upgrade: websocket); "
        "send JSON-RPC over HTTP with POST /v3/<API_KEY>",
        http_status=405,
        headers={"Allow": "GET"},
    )


def unknown_network(name: str, websocket: bool = False) -> JsonRpcError:
    """404; `ws` on a JSON-RPC path is the WebSocket path /ws/v3/<key> asked with POST (405), on a
    WebSocket path (/ws/ws/v3/<key>) a network like any other."""
    if name == "ws" and not websocket:
        return websocket_only()
    return JsonRpcError(INVALID_REQUEST, f"unknown network '{name}'", http_status=404)


class Router:
    def __init__(self, settings: Settings, networks: Mapping[str, NetworkRuntime]) -> None:
        self._settings = settings
        self._networks = networks
        self._defaults: Mapping[str, str] = settings.default_network  # family -> network name
        self._by_host = {h: rt for rt in networks.values() for h in rt.config.hosts}
        # Host header -> network, and method -> default network, remembered: a deployment sees a
        # handful of each. Bounded, since both are the client's to choose.
        # A Host header's routes: (the network declaring its name, the network its first label names).
        self.host_routes: Memo[str, tuple[NetworkRuntime | None, NetworkRuntime | None]] = Memo(1024, self._host)
        self.default_routes: Memo[str, NetworkRuntime | None] = Memo(1024, self._default_for)

    def reload(self, defaults: Mapping[str, str]) -> None:
        """The networks changed (a reload of NETWORKS_FILE): forget every remembered route. The memos
        are cleared in place, since the gateway's hot path holds them."""
        self._defaults = defaults
        self._by_host = {h: rt for rt in self._networks.values() for h in rt.config.hosts}
        self.host_routes.clear()
        self.default_routes.clear()

    @property
    def networks(self) -> Mapping[str, NetworkRuntime]:
        """The networks served, by name (a reload changes them in place)."""
        return self._networks

    def current(self, network: NetworkRuntime | None) -> NetworkRuntime | None:
        """The runtime in force for a network a connection named when it opened: a reload may have
        replaced it (its successor) or removed it (the unknown-network error)."""
        if network is None or self._networks.get(network.name) is network:
            return network
        successor = self._networks.get(network.name)
        if successor is None:
            raise unknown_network(network.name)
        return successor

    def network_for(self, host: str | None, path_network: str | None, websocket: bool = False) -> NetworkRuntime | None:
        """A host name declared in a network's `hosts`, then the path's network, then a network named
        by the Host header's first label; None: route by method family. The path is the client's
        explicit choice: a first label is only a guess (any Host may be sent), so it never overrides it."""
        label = None
        if host:
            declared, label = self.host_routes[host]
            if declared is not None:
                return declared
        if path_network is not None:
            chosen = self._networks.get(path_network)
            if chosen is None:
                raise unknown_network(path_network, websocket)
            return chosen
        return label

    def _host(self, host: str) -> tuple[NetworkRuntime | None, NetworkRuntime | None]:
        """The network whose `hosts` declares this Host header's name, and the network its first
        label names (`evm.rpc.example` -> evm), each if any."""
        name = _hostname(host)
        first, dot, _ = name.partition(".")
        return self._by_host.get(name), self._networks.get(first) if dot else None

    def _default_for(self, method: str) -> NetworkRuntime | None:
        name = self._defaults.get(family_of(method))
        return self._networks.get(name) if name is not None else None

    def route(self, call: Call, network: NetworkRuntime | None) -> NetworkRuntime:
        # The envelope checked the name's form; the allow-list comes before the route memo, so the
        # memo only ever holds names this deployment serves.
        refused = refusal(call.method, self._settings.allowed_methods, self._settings.allowed_namespaces)
        if refused is not None:
            raise JsonRpcError(METHOD_NOT_FOUND, refused)
        runtime = self.current(network) or self.default_routes[call.method]
        if runtime is None:
            raise JsonRpcError(METHOD_NOT_FOUND, f"method not found: no {family_of(call.method)} network is configured")
        return runtime

    def route_method(self, method: str, network: NetworkRuntime | None) -> NetworkRuntime:
        """The network a method goes to: the one the connection named, else its family's default."""
        return self.route(Call(method, []), network)


def _hostname(host: str) -> str:
    """A Host header's name as `hosts` holds it (host_names.py), without its port."""
    parts = host_name(host)
    return parts.name if parts is not None else host.lower()
