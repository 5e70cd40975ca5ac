"""What every benchmark shares: the machine description and the roofline
figures measured in the same process (DRAM and L3 read bandwidth, fp32 and
bf16 matmul peaks), interleaved median timing, printed tables and a JSON
record under $Q4_BENCH_DIR (default ./bench-results).

Benchmarks report; they never assert on time. On a shared machine every
figure moves with the load of other processes: contestants are timed in
interleaved rounds (each round times every contestant once), so a burst of
load hits all of them alike, and the table shows the median over rounds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

# ------------------------------------------------------------------ timing


def median_ms(fn: Callable[[], object], repeat: int = 15, warmup: int = 2) -> float:
    """Median wall time of one call of fn, in ms."""
    return interleaved({"fn": fn}, rounds=repeat, warmup=warmup)["fn"]["median_ms"]


SETTLE_S = 5e-3
WARM_S = 5e-3


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int = 9,
    warmup: int = 2,
    min_sample_s: float = 5e-3,
) -> dict[str, dict]:
    """Time several callables in interleaved rounds.

    Each sample of a callable is `calls` back-to-back calls (enough to last
    about `min_sample_s`, so that sub-millisecond calls are not dominated by
    the timer; and long enough that a VM's wake-up jitter averages out),
    reported per call. Before each sample: a 5 ms pause, then untimed calls
    for 5 ms (at least one). The pause lets the previous contestant's thread
    pool stop spinning (PyTorch's OpenMP team and XLA's pool both spin-wait
    after an op, and would otherwise steal cores from whoever runs next); the
    untimed calls wake this contestant's own pool -- and, in a VM, the vCPU
    the host took back during the pause: with one untimed call, 2 ms samples
    of a 0.6 ms call measured up to 1.8x its back-to-back time -- and bring
    its operands back into cache after the other contestants evicted them.
    The order is a fresh permutation each round (seeded, so runs repeat it),
    so no contestant always runs first or after the same neighbour (a
    rotation would keep the cyclic order: each contestant would nearly always
    follow the same one, e.g. one whose thread pool or cache footprint slows
    whoever comes next).
    Returns, per name: median_ms, min_ms, calls (per sample), rounds.
    """
    calls = {}
    for name, fn in fns.items():
        for _ in range(max(warmup, 1)):
            fn()
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        calls[name] = max(1, math.ceil(min_sample_s / max(one, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    order = random.Random(0)
    for _ in range(rounds):
        # a new order each round: no contestant always runs right after the same neighbour
        order.shuffle(names)
        for name in list(names):
            fn, n = fns[name], calls[name]
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            fn()
            while time.perf_counter() - t0 < WARM_S:
                fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[name].append((time.perf_counter() - t0) / n)
    return {
        name: {
            "median_ms": 1e3 * statistics.median(s),
            "min_ms": 1e3 * min(s),
            "calls": calls[name],
            "rounds": rounds,
        }
        for name, s in samples.items()
    }


def dispersion(res: dict[str, dict]) -> float:
    """The largest median / fastest-sample ratio over the contestants of one interleaved() result."""
    return max(r["median_ms"] / r["min_ms"] for r in res.values())


def settled(
    fns: dict[str, Callable[[], object]],
    rounds: int = 9,
    warmup: int = 2,
    max_dispersion: float = 2.0,
    attempts: int = 3,
) -> dict[str, dict]:
    """interleaved(), re-run (all contestants together, up to `attempts` times)
    while some contestant's median is more than `max_dispersion` times its
    fastest sample: on a quiet machine medians sit within ~1.3x of the best
    sample, and a burst of other processes' work (or the scheduler parking a
    thread of a 2-thread team for a 4 ms tick) shows up as a far larger spread.
    Keeps the least dispersed attempt; each entry records `attempts` and
    `dispersion`."""
    best, best_d, tried = None, math.inf, 0
    while tried < attempts and best_d > max_dispersion:
        res = interleaved(fns, rounds=rounds, warmup=warmup)
        tried += 1
        d = dispersion(res)
        if d < best_d:
            best, best_d = res, d
    for r in best.values():
        r["attempts"], r["dispersion"] = tried, best_d
    return best


# ------------------------------------------------------------------ machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def l3_bytes() -> int:
    """The last-level cache's size in bytes as cpu0 reports it (32 MiB when
    sysfs does not say)."""
    size = _cache_sizes().get("L3", "32768K")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (ValueError, IndexError):
        return 32 << 20


def nested_4bit_bytes(n: int, k: int, blocksize: int) -> int:
    """Bytes of an [n, k] 4-bit weight with nested absmax: the packed codes,
    one uint8 absmax code per block, one fp32 absmax per 256 blocks."""
    blocks = -(-n * k // blocksize)
    return -(-n * k // 2) + blocks + 4 * -(-blocks // 256)


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (8 GiB when it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 << 30


def dram_layers(weight_bytes: int, host_bytes_per_layer: int = 0) -> int:
    """How many distinct layers of weight_bytes each to cycle so that every
    call reads its weight from memory: together >= 4x the L3, whatever its
    replacement policy (on a 32 MiB L3, 16 layers of 8.25 MiB). With 8 such
    layers (66 MiB) part of each weight still came from the L3: torch.sum
    over them ran at 1.3-1.4x the 1 GiB DRAM read rate, over 16 or 24 at
    0.8-0.9x (the rest is each call's cold start).

    host_bytes_per_layer: what the caller keeps per layer in all (its peers'
    copies too); the count is capped so that they take at most half of the
    available memory (a VM that reports its host's 480 MiB L3 would
    otherwise ask for 233 layers of 4096^2 and be killed). dram_layers_note()
    says when the cap applied."""
    want = max(8, -(-4 * l3_bytes() // weight_bytes))
    if host_bytes_per_layer <= 0:
        return want
    return max(8, min(want, mem_available_bytes() // 2 // host_bytes_per_layer))


def dram_layers_note(weight_bytes: int, layers: int) -> str:
    """'' when `layers` reach 4x the L3, else a line saying they do not."""
    if layers * weight_bytes >= 4 * l3_bytes():
        return ""
    return (
        f"note: {layers} layers ({layers * weight_bytes / 2**20:.0f} MiB) cycled, {layers * weight_bytes / l3_bytes():.1f}x "
        f"the L3 this CPU reports ({l3_bytes() / 2**20:.0f} MiB), capped by the available memory: part of each "
        "'DRAM' call may still come from the L3; compare with the read floor measured beside it"
    )


def _cache_sizes() -> dict[str, str]:
    """L1d/L2/L3 sizes as the kernel reports them (cpu0's view)."""
    out = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if kind in ("Data", "Unified"):
            out[f"L{level}"] = size
    return out


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "jax", "jaxlib", "flax", "bitsandbytes", "qwix", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def machine() -> dict:
    """CPU, cores, caches, q4's detected features and kernel chains, thread
    counts, library versions and the load average (a shared machine's noise)."""
    import torch

    import q4

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "caches": _cache_sizes(),
        "q4_library": str(q4.library_path()),
        "q4_cpu_features": q4.cpu_features(),
        "threads": {
            "q4": q4.num_threads(),
            "torch": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "unset"),
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "unset"),
        },
        "versions": _versions(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


# ------------------------------------------------------------------ roofline

DRAM_BYTES = 1 << 30  # > any L3 here (32 MiB)
L3_BYTES = 12 << 20  # fits the 32 MiB L3, larger than the 2 x 1 MiB L2
PEAK_N = 2048


def best_ms(fn: Callable[[], object], repeat: int, min_sample_s: float = 2e-3) -> float:
    """Fastest sample (ms per call): for capability figures (bandwidth, peak
    FLOP/s) the best run is the one least disturbed by other processes."""
    return interleaved({"fn": fn}, rounds=repeat, warmup=1, min_sample_s=min_sample_s)["fn"]["min_ms"]


def dram_read_gbs() -> float:
    """Read bandwidth of torch.sum over 1 GiB fp32 on all threads, best of 7."""
    import torch

    big = torch.ones(DRAM_BYTES // 4, dtype=torch.float32)  # written once: pages are touched before timing
    return DRAM_BYTES / (best_ms(big.sum, repeat=7) * 1e-3) / 1e9


@functools.cache
def roofline() -> dict:
    """Figures measured in this process (cached: one measurement per run),
    each the best of several samples.

    dram_read_gbs: torch.sum over a 1 GiB fp32 buffer on all threads (read only).
    l3_read_gbs: torch.sum over a 12 MiB buffer, read repeatedly (L3-resident).
    fp32_gflops / bf16_gflops: torch.mm of 2048^3 into a preallocated output
    (MKL / oneDNN): a practical peak, not the instruction peak.
    """
    import torch

    dram = dram_read_gbs()
    small = torch.ones(L3_BYTES // 4, dtype=torch.float32)
    l3 = L3_BYTES / (best_ms(small.sum, repeat=25, min_sample_s=5e-3) * 1e-3) / 1e9
    flops = 2 * PEAK_N**3
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(PEAK_N, PEAK_N).to(dtype)
        b = torch.randn(PEAK_N, PEAK_N).to(dtype)
        c = torch.empty(PEAK_N, PEAK_N, dtype=dtype)
        peaks[name] = flops / (best_ms(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeat=9) * 1e-3) / 1e9
    xla = _xla_peaks()
    return {
        "dram_read_gbs": dram,
        "l3_read_gbs": l3,
        "fp32_gflops": peaks["fp32"],
        "bf16_gflops": peaks["bf16"],
        "xla_fp32_gflops": xla.get("fp32"),
        "xla_bf16_gflops": xla.get("bf16"),
        "method": {
            "xla_fp32_gflops": "jax.jit(jnp.dot) 2048^3 fp32, best of 9 (XLA's own GEMM, for comparison)",
            "xla_bf16_gflops": "jax.jit(jnp.dot, preferred_element_type=fp32) 2048^3 bf16, best of 9",
            "dram_read_gbs": "torch.sum over 1 GiB fp32, all threads, best of 7",
            "l3_read_gbs": "torch.sum over 12 MiB fp32, repeated (>= 5 ms a sample), all threads, best of 25",
            "fp32_gflops": "torch.mm 2048^3 fp32 (out= preallocated), best of 9",
            "bf16_gflops": "torch.mm 2048^3 bf16 (out= preallocated), best of 9",
        },
    }


def _xla_peaks() -> dict:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return {}
    out = {}
    for name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16)):
        a = jnp.asarray(np.random.default_rng(0).standard_normal((PEAK_N, PEAK_N), dtype=np.float32)).astype(dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
        out[name] = 2 * PEAK_N**3 / (best_ms(lambda a=a, f=f: f(a, a).block_until_ready(), repeat=9) * 1e-3) / 1e9
    return out


def others_busy_cores(window_s: float = 0.5) -> float | None:
    """Cores' worth of CPU time that other processes used over a short window
    while this process sleeps (from /proc/stat): the noise the timings face."""

    def busy_total():
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        time.sleep(0.1)  # our own pools stop spinning
        b0, t0 = busy_total()
        time.sleep(window_s)
        b1, t1 = busy_total()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def load_line() -> str:
    if not hasattr(os, "getloadavg"):
        return ""
    la = os.getloadavg()
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores"


def print_header(title: str) -> dict:
    """Print the machine block every benchmark starts with; return machine() + roofline()."""
    roof = roofline()
    info = machine()
    feats = info["q4_cpu_features"]
    detected = ", ".join(k for k, v in feats.get("features", {}).items() if v) or "none"
    missing = ", ".join(k for k, v in feats.get("features", {}).items() if not v) or "none"
    print(f"=== {title}")
    print(f"cpu: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable); caches {info['caches']}")
    print(f"q4 library: {info['q4_library']}")
    print(f"q4 cpu features: detected {detected}; absent {missing}")
    print(
        f"q4 ISA level: active {feats.get('isa')} (best available {feats.get('best_isa')}); "
        f"L1D the kernels block for: {feats.get('l1d_bytes')} bytes"
    )
    for op, chain in feats.get("kernels", {}).items():
        print(f"q4 kernel chain {op}: {' -> '.join(chain)}")
    th = info["threads"]
    print(
        f"threads: q4 {th['q4']}, torch {th['torch']} (OMP_NUM_THREADS={th['OMP_NUM_THREADS']}); "
        f"XLA_FLAGS={th['XLA_FLAGS']}"
    )
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(
        f"measured now: DRAM read {roof['dram_read_gbs']:.1f} GB/s (1 GiB), L3 read {roof['l3_read_gbs']:.1f} GB/s "
        f"(12 MiB), fp32 matmul {roof['fp32_gflops']:.0f} GFLOP/s, bf16 matmul {roof['bf16_gflops']:.0f} GFLOP/s "
        f"(torch.mm 2048^3); best of several samples each"
    )
    if roof.get("xla_fp32_gflops"):
        print(
            f"measured now, XLA's GEMM for comparison: fp32 {roof['xla_fp32_gflops']:.0f} GFLOP/s, "
            f"bf16 {roof['xla_bf16_gflops']:.0f} GFLOP/s (jnp.dot 2048^3)"
        )
    others = others_busy_cores()
    info["others_busy_cores"] = others
    if others is not None:
        print(
            f"other processes used {others:.2f} of {info['cores']} cores just before this benchmark; {load_line()} "
            "(figures are medians over interleaved rounds)"
        )
        if others > 0.25:
            print(
                "WARNING: the machine is busy: multithreaded timings (OpenMP above all) include waits for cores "
                "that other processes hold; rerun on an idle machine before publishing figures"
            )
    sys.stdout.flush()
    return {"machine": info, "roofline": roof}


# ------------------------------------------------------------------ output


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


def fmt(c) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        if math.isnan(c):
            return "-"
        a = abs(c)
        if a == 0:
            return "0"
        if a < 1e-2:
            return f"{c:.1e}"
        if a < 10:
            return f"{c:.3f}" if a < 1 else f"{c:.2f}"
        return f"{c:.1f}" if a < 1000 else f"{c:.0f}"
    return str(c)


def bench_dir() -> Path:
    return Path(os.environ.get("Q4_BENCH_DIR", "bench-results"))


def write_json(name: str, record: dict) -> Path:
    out = bench_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=_json_default))
    return path


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
