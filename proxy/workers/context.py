"""What a worker process knows of its place among WORKERS (supervisor.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker process knows of its place: its number, the run directory it shares and its
    deployment's Via pseudonym (via.py: the workers answer on one port, so they share one)."""

    index: int
    run_dir: str
    via: str = ""
