"""Benchmark: what the host-wide memory bounds cost a keyed answer with WORKERS > 1, against one process.

    .venv/bin/python -m bench.host_bytes [--calls 1000000]

Times, in one process, the checks and counts an answer of an API key goes through in the fast
server (proxy/http/answer_bytes.py): one `room` look before it is made and one `charge` per change of
its bytes (a keyed answer has several: made, written, taken), with no host table (one process) and
with this worker's row of a host table of 2 and 16 workers (proxy/workers/host_bytes.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from proxy.http.answer_bytes import AnswerBytes  # noqa: E402
from proxy.workers.host_bytes import HostBytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    calls = parser.parse_args().calls
    run_dir = tempfile.mkdtemp(prefix="bench-host-bytes-")
    for label, host in (
        ("one process", None),
        ("WORKERS=2", HostBytes(run_dir, 0, 2)),
        ("WORKERS=16", HostBytes(run_dir, 0, 16)),
    ):
        budget = AnswerBytes(8 << 20, 64 << 20, 256 << 20, host)
        budget.charge("bench-key", 1000)
        room = timeit.timeit(lambda b=budget: b.room("bench-key", 1000, 65536, 65536), number=calls)
        charge = timeit.timeit(lambda b=budget: b.charge("bench-key", 0), number=calls)
        print(f"{label:12} room {room / calls * 1e9:5.0f} ns   charge {charge / calls * 1e9:5.0f} ns")


if __name__ == "__main__":
    main()
