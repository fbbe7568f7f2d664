"""One serving process: the proxy's app on its listener and event loop, until it is stopped."""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.app import create_app
from proxy.config import Settings
from proxy.credits.ledger_storage import LedgerStorageError
from proxy.http import listeners
from proxy.http.listeners import CannotListen
from proxy.workers import event_loop
from proxy.workers.context import WorkerContext

log = logging.getLogger("proxy")


def run_server(settings: Settings, *, on_listening: Callable[[], None], worker: WorkerContext | None = None) -> int:
    """One serving process: the whole proxy (WORKERS=1), or one of the workers."""
    app = create_app(settings, worker=worker)
    try:
        event_loop.run(
            listeners.serve(
                app,
                settings.host,
                settings.port,
                max_connections=settings.max_connections,
                per_ip=settings.max_connections_per_ip,
                shutdown_timeout=settings.shutdown_timeout,
                on_listening=on_listening,
                reuse_port=worker is not None,
                run_dir=worker.run_dir if worker is not None else None,
            ),
            settings.event_loop,
        )
    except CannotListen as exc:  # names the listener that failed: public, metrics or admin
        log.error("%s", exc)
        return 1
    except LedgerStorageError as exc:
        log.error("configuration error: %s", exc)
        return 2
    except Exception:  # a crash is one log line with its traceback inside, like every other line
        log.exception("stopped by an unexpected error")
        return 1
    return 0
