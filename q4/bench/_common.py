"""Timing helpers shared by the benchmarks: medians over repeats, a printed
table and a JSON record. Benchmarks report; they never assert on time."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def median_ms(fn, repeat: int = 15, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def machine() -> dict:
    import q4

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "q4_isa": q4.cpu_isa(),
        "q4_threads": q4.num_threads(),
        "python": platform.python_version(),
    }


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.2f}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def write_json(name: str, record: dict) -> Path:
    out = Path(os.environ.get("Q4_BENCH_DIR", "bench-results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2))
    return path
