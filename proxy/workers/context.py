"""What a worker process knows of its place among WORKERS (supervisor.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a worker process knows of its place: its number and the run directory it shares."""

    index: int
    run_dir: str
