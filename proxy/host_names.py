"""A host name as a network's `hosts` declares it and as a Host header is routed (network_routing.py):
one normal form for both, so a name matches however it is written, and one rule for what a Host field
may hold (the front's, http/head_limit.py), so no entry is kept that no Host header could match. Pure."""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

# RFC 9110 section 7.2: Host = uri-host [ ":" port ], uri-host from RFC 3986 section 3.2.2 (an IP
# literal in brackets, or a reg-name). A comma is no part of a host name here: Host is a singleton
# field, and "a, b" is two values (RFC 9110 section 5.3), as repeated field lines are.
_HOST = re.compile(r"(?:\[[0-9A-Za-z:.]+\]|[0-9A-Za-z\-._~%!$&'()*+;=]*)(?::[0-9]*)?")


class HostName(NamedTuple):
    name: str  # lower-case, one trailing dot dropped; an IPv6 address bracketed and canonical
    port: str  # as written after the name ("" if none)


def is_host_field(value: str) -> bool:
    """Whether `value` is one host and port as a Host field may hold it: ASCII only (a Unicode name is
    sent as its IDNA A-label), no userinfo, no IPv6 zone id, no whitespace inside."""
    return _HOST.fullmatch(value) is not None


def host_name(host: str) -> HostName | None:
    """`host` (a Host header, a `hosts` entry) split into its normal name and its port; None when it is
    no host: an IPv6 literal that does not parse, an empty name. `RPC.example.` is `rpc.example` (a
    fully qualified name's root dot, RFC 1034 3.1), `[0:0::1]:80` is `[::1]` on port 80 and a bare
    `::1`, which no Host header carries but an operator may write, is `[::1]`; a Unicode name, which no
    Host header carries either, is its IDNA A-label (`bücher.example` is `xn--bcher-kva.example`,
    RFC 5891 section 4, as clients send it)."""
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
    if not name.isascii():
        try:
            name = name.encode("idna").decode("ascii")
        except UnicodeError:  # an empty label, or one too long
            return None
    return HostName(name, port) if name else None


def _ipv6(address: str, port: str) -> HostName | None:
    if "%" in address:  # a zone id (fe80::1%eth0) is local to one machine: no Host field carries it
        return None
    try:
        return HostName(f"[{ipaddress.IPv6Address(address).compressed}]", port)
    except ValueError:
        return None
