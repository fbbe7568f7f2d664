"""A host name as a network's `hosts` declares it and as a Host header is routed (network_routing.py):
one normal form for both, so a name matches however it is written. Pure."""

from __future__ import annotations

import ipaddress
from typing import NamedTuple


class HostName(NamedTuple):
    name: str  # lower-case, one trailing dot dropped; an IPv6 address bracketed and canonical
    port: str  # as written after the name ("" if none)


def host_name(host: str) -> HostName | None:
    """`host` (a Host header, a `hosts` entry) split into its normal name and its port; None when it is
    no host: an IPv6 literal that does not parse, an empty name. `RPC.example.` is `rpc.example` (a
    fully qualified name's root dot, RFC 1034 3.1), `[0:0::1]:80` is `[::1]` on port 80 and a bare
    `::1`, which no Host header carries but an operator may write, is `[::1]`."""
    host = host.strip().lower()
    if host.startswith("["):
        address, closed, rest = host[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            return None
        return _ipv6(address, rest[1:])
    if host.count(":") > 1:  # an IPv6 address without brackets: no port can follow it
        return _ipv6(host, "")
    name, _, port = host.partition(":")
    name = name.removesuffix(".")
    return HostName(name, port) if name else None


def _ipv6(address: str, port: str) -> HostName | None:
    try:
        return HostName(f"[{ipaddress.IPv6Address(address).compressed}]", port)
    except ValueError:
        return None
