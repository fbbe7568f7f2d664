"""`${VAR}` and `${VAR:-default}` in NETWORKS_FILE and API_KEYS_FILE string values, from the
environment, so a provider's key or token lives in a secret store and not in a file in git.

As Docker Compose and eRPC read them: `${VAR:-default}` takes the default when VAR is unset or
empty; `$${` is a literal `${`; a `$` not followed by `{` is itself. A variable that is unset with no
default is a configuration error naming the variable and where it is used, never a value. Unlike
Compose, a default is plain text: `${` inside one (`${A:-${B}}`) is a configuration error.

The process environment is read here (and in cli.py) only: the files are read again on SIGHUP and
on a networks reload, with the environment the process has.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from proxy.options import ConfigError

_REFERENCE = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$\{")


def expand_text(text: str, where: str, environ: Mapping[str, str]) -> str:
    """One string with its references replaced (ConfigError for an unset variable or a bad `${`)."""
    if "${" not in text:
        return text

    def one(match: re.Match[str]) -> str:
        whole, name, default = match[0], match[1], match[2]
        if whole == "$${":
            return "${"
        if name is None:
            raise ConfigError(f"{where}: '${{' must start ${{NAME}} or ${{NAME:-default}} (NAME: letters, digits, '_')")
        if default is not None and "${" in default:
            # Read by the regular expression, `${A:-${B}}` would end at the first `}` and leave one
            # behind (`abc}`), or give `${B` as text: refused whether A is set or not.
            raise ConfigError(
                f"{where}: the default of ${{{name}:-...}} holds '${{': a default is plain text "
                "(nested references are not expanded)"
            )
        value = environ.get(name)
        if value:
            return value
        if default is not None:
            return default
        if value is None:
            raise ConfigError(f"{where}: environment variable {name} is not set (or write ${{{name}:-default}})")
        return value  # set and empty, as the shell gives it

    return _REFERENCE.sub(one, text)


def expand(data: Any, name: str, environ: Mapping[str, str] | None = None, *, trace: bool = True) -> Any:
    """Every string value of parsed TOML expanded (table and field names are not). `name`: the file's
    setting; with `trace`, an error adds the path to the value (not for API_KEYS_FILE, whose
    older-form table names are secrets)."""
    return _expand(data, name, "", os.environ if environ is None else environ, trace)


def _expand(data: Any, name: str, path: str, env: Mapping[str, str], trace: bool) -> Any:
    if isinstance(data, str):
        return expand_text(data, f"{name} {path}" if path else name, env)
    if isinstance(data, dict):
        return {k: _expand(v, name, f"{path}.{k}".lstrip(".") if trace else "", env, trace) for k, v in data.items()}
    if isinstance(data, list):
        return [_expand(v, name, f"{path}[{i}]" if trace else "", env, trace) for i, v in enumerate(data)]
    return data
