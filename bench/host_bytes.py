"""Benchmark: what the host-wide memory bounds cost with WORKERS > 1, against one process.

    .venv/bin/python -m bench.host_bytes [--calls 1000000]

Times, in one process, (1) the checks and counts an answer of an API key goes through in the fast
server (proxy/http/answer_bytes.py): one `room` look before it is made and one `charge` per change of
its bytes (a keyed answer has several: made, written, taken), with the whole per-key bound (one
process) and with a worker's share of it (key_share: 2 and 16 workers), and (2) a body's admission
and release (BodyBudget in proxy/http/endpoint.py, taken only by a body that does not arrive in the
read that began it): in one process, and with this worker's row of a host table of 2 and 16 workers
(proxy/workers/host_bytes.py, an flock per admission).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.http.answer_bytes import AnswerBytes, key_share  # noqa: E402
from proxy.http.endpoint import BodyBudget  # noqa: E402
from proxy.workers.host_bytes import HostBytes  # noqa: E402

PER_KEY = 64 << 20
BODY = 1 << 20


def admit(bodies: BodyBudget) -> None:
    bodies.take(BODY)
    bodies.give(BODY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    calls = parser.parse_args().calls
    run_dir = tempfile.mkdtemp(prefix="bench-host-bytes-")
    for label, workers in (("one process", 1), ("WORKERS=2", 2), ("WORKERS=16", 16)):
        budget = AnswerBytes(8 << 20, key_share(PER_KEY, workers), 256 << 20)
        budget.charge("bench-key", 1000)
        room = timeit.timeit(lambda b=budget: b.room("bench-key", 1000, 65536, 65536), number=calls)
        charge = timeit.timeit(lambda b=budget: b.charge("bench-key", 0), number=calls)
        bodies = BodyBudget(128 << 20, HostBytes(run_dir, 0, workers) if workers > 1 else None)
        body = timeit.timeit(lambda b=bodies: admit(b), number=calls)
        print(
            f"{label:12} answer: room {room / calls * 1e9:5.0f} ns   charge {charge / calls * 1e9:5.0f} ns"
            f"   body: take+give {body / calls * 1e9:6.0f} ns"
        )


if __name__ == "__main__":
    main()
