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

from proxy.config import ConfigError, Settings, checked_networks
from proxy.config_files import _keys, _networks_from_file
from proxy.gateway.gateway import Gateway

log = logging.getLogger("proxy.reload")


def reload_keys(settings: Settings, gateway: Gateway) -> Settings:
    """The settings in force after a SIGHUP (the same object if nothing was reloaded)."""
    try:
        keys = _keys(settings.keys_source)
    except ConfigError as exc:
        log.error("SIGHUP: keys not reloaded, the ones in force stay: %s", exc)
        return settings
    if (keys is None) != settings.open_mode:
        log.error("SIGHUP: keys not reloaded: a reload cannot switch between open mode and API keys; restart")
        return settings
    settings = dataclasses.replace(settings, api_keys=keys)
    gateway.reload(settings)
    limited = sum(1 for k in (keys or {}).values() if k.lists.any)
    log.info("SIGHUP: %d key(s) reloaded (%d with allow-lists)", len(keys or {}), limited)
    return settings


def as_files_are(settings: Settings) -> Settings:
    """A restarted worker's settings: the keys file and NETWORKS_FILE read as they are now, as a
    SIGHUP or a reload left them (the supervisor's were read at start-up: a key revoked since worked
    again on a restarted worker, and a reloaded network came back as it started). A file that no
    longer loads leaves what the supervisor started with, with an ERROR line."""
    try:
        keys = _keys(settings.keys_source)
        if (keys is None) == settings.open_mode:
            settings = dataclasses.replace(settings, api_keys=keys)
    except ConfigError as exc:
        log.error("worker start: keys as started, the file does not load: %s", exc)
    if settings.networks_file is None:
        return settings
    try:
        fixed = [n for n in settings.networks if n.name in settings.from_environment]
        listed = [*fixed, *_networks_from_file(settings.networks_file)]
        defaults = checked_networks(listed)
    except ConfigError as exc:
        log.error("worker start: networks as started, NETWORKS_FILE does not load: %s", exc)
        return settings
    return dataclasses.replace(settings, networks=tuple(listed), default_network=defaults)
