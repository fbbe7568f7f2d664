"""SIGHUP: the keys file (API_KEYS_FILE, with API_KEYS as started) read again, allow-lists included.

Requests in flight are untouched: the new keys, lists and terms apply from the next request, on open
WebSockets too. An open WebSocket whose key was removed, or whose secret changed, is refused at once:
its subscriptions end with an error notification and it is closed (1008, ws.py). A file that no
longer parses is refused whole, with an ERROR line, and the keys in force stay; so is a reload that
would switch between open mode and keys.
"""

from __future__ import annotations

import dataclasses
import logging

from proxy.config import ConfigError, Settings, file_networks
from proxy.config_files import _keys
from proxy.gateway.gateway import Gateway

log = logging.getLogger("proxy.reload")


def reload_keys(settings: Settings, gateway: Gateway) -> Settings:
    """The settings in force after a SIGHUP (the same object if nothing was reloaded)."""
    reloaded = _with_keys_as_they_are(settings, "SIGHUP: keys not reloaded", ", the ones in force stay")
    if reloaded is settings:
        return settings
    gateway.reload(reloaded)
    keys = reloaded.api_keys or {}
    limited = sum(1 for k in keys.values() if k.lists.any)
    log.info("SIGHUP: %d key(s) reloaded (%d with allow-lists)", len(keys), limited)
    return reloaded


def as_files_are(settings: Settings) -> Settings:
    """A restarted worker's settings: the keys file and NETWORKS_FILE read as they are now, as a
    SIGHUP or a reload left them (the supervisor's were read at start-up: a key revoked since worked
    again on a restarted worker, and a reloaded network came back as it started). A file that no
    longer loads leaves what the supervisor started with, with an ERROR line."""
    settings = _with_keys_as_they_are(settings, "worker start: keys as started", ", the file does not load")
    if settings.networks_file is None:
        return settings
    try:
        listed, defaults = file_networks(settings)
    except ConfigError as exc:
        log.error("worker start: networks as started, NETWORKS_FILE does not load: %s", exc)
        return settings
    return dataclasses.replace(settings, networks=tuple(listed), default_network=defaults)


def _with_keys_as_they_are(settings: Settings, refused: str, unloaded: str) -> Settings:
    """`settings` with the keys read again (the same object when they cannot be: an ERROR line says
    why, `refused` and then `unloaded` for a file that does not load)."""
    try:
        keys = _keys(settings.keys_source)
    except ConfigError as exc:
        log.error("%s%s: %s", refused, unloaded, exc)
        return settings
    if (keys is None) != settings.open_mode:
        log.error("%s: a reload cannot switch between open mode and API keys; restart", refused)
        return settings
    return dataclasses.replace(settings, api_keys=keys)
