"""8-bit optimizer step on 16.7 M fp32 parameters (one 4096x4096 tensor; --tensors T: T of
them, a model's step whose state no cache holds), in one process:
q4torch.optim.AdamW8bit, torch.optim.AdamW(fused=True), bitsandbytes' AdamW8bit (its CPU
path), q4jax.optim.adamw_8bit (jitted, params and state donated, the gradient made in the
step as a backward makes it) and optax.adamw (fp32).

    PYTHONPATH=. .venv/bin/python benchmarks/optim8.py [--tensors T] [--loss-curve]

One tensor's step (67 MB of fp32 parameter, 268-470 MB of traffic) runs from the last-level
cache on a processor whose L3 holds it (the 2-core Xeon VMs report 480 MiB): there every
optimizer is bound by its instructions, not by DRAM. --tensors 8 (134 M parameters,
1.3-2.1 GB a step) is the DRAM regime of a real model's step.

Columns: median ms per step over interleaved rounds; bytes moved per step (8-bit Adam:
gradient read, parameter read + written, two uint8 states read + written, absmax:
~16 B/parameter; fp32 Adam: gradient, parameter and two fp32 states, ~28 B/parameter);
that traffic as a share of the copy bandwidth (read + write, STREAM convention) measured
in the same run. --loss-curve adds 200 training steps of a small MLP with AdamW8bit
(q4 and bitsandbytes) against fp32 torch AdamW (a check of the 8-bit states' accuracy,
not a timing). Writes bench-results/optim8.json.
"""

from __future__ import annotations

import argparse
import copy
import sys

import numpy as np
from common import interleaved, print_header, print_table, write_json

N = 4096 * 4096


def copy_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """Read + write bandwidth of a torch copy over all threads (a mix like the optimizer's)."""
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    res = interleaved({"copy": lambda: dst.copy_(src)}, rounds=9)["copy"]
    return 2 * nbytes / (res["min_ms"] * 1e-3) / 1e9


def timings(with_bnb: bool = True, tensors: int = 1) -> dict:
    import bitsandbytes as bnb
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    import q4torch
    from q4jax import optim as joptim

    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(N).astype(np.float32).reshape(4096, 4096)
    g0 = (rng.standard_normal(N).astype(np.float32) * 1e-2).reshape(4096, 4096)

    def torch_opt(make):
        ps = []
        for _ in range(tensors):
            p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
            p.grad = torch.from_numpy(g0.copy())
            ps.append(p)
        opt = make(ps)
        opt.step()  # state allocated and touched before timing
        return opt.step

    fns = {
        "q4torch AdamW8bit": torch_opt(lambda ps: q4torch.optim.AdamW8bit(ps)),
        "torch AdamW(fused=True)": torch_opt(lambda ps: torch.optim.AdamW(ps, fused=True)),
    }

    def jax_step(tx):
        params = {f"w{i}": jnp.asarray(p0) for i in range(tensors)}
        grads = {f"w{i}": jnp.asarray(g0) for i in range(tensors)}
        state = tx.init(params)

        # the gradient is made inside the step (scaled by a traced 1.0), as a train step's
        # backward makes it: an intermediate, whose buffer the 8-bit step's update reuses;
        # a gradient passed in from outside is copied first (about 2x the step here)
        def step(params, state, grads, scale):
            grads = jax.tree.map(lambda g: g * scale, grads)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        step = jax.jit(step, donate_argnums=(0, 1))
        box = [params, state]
        one = jnp.ones((), jnp.float32)

        def run():
            box[0], box[1] = step(box[0], box[1], grads, one)
            jax.block_until_ready(box[0])

        run()
        return run

    fns["q4jax adamw_8bit (optax)"] = jax_step(joptim.adamw_8bit())
    fns["optax.adamw fp32"] = jax_step(optax.adamw(1e-3, weight_decay=1e-2))
    res = interleaved(fns, rounds=9)
    if with_bnb:  # ~0.6 s per step: timed on its own, fewer rounds
        res.update(interleaved({"bitsandbytes AdamW8bit": torch_opt(lambda ps: bnb.optim.AdamW8bit(ps))}, rounds=3))
    return res


def loss_curves(steps: int = 200) -> dict:
    """A small MLP (64 -> 256 -> 256 -> 10, teacher-generated labels) trained with fp32 AdamW,
    q4torch AdamW8bit and bitsandbytes AdamW8bit from the same initialisation and batches."""
    import bitsandbytes as bnb
    import torch

    import q4torch

    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    xs = torch.randn(steps, 64, 64)
    ys = teacher(xs).argmax(-1).detach()
    init = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    makers = {
        "torch AdamW fp32": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-2),
        "q4torch AdamW8bit": lambda ps: q4torch.optim.AdamW8bit(ps, lr=1e-3, weight_decay=1e-2),
        "bitsandbytes AdamW8bit": lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3, weight_decay=1e-2),
    }
    curves = {}
    for name, make in makers.items():
        model = copy.deepcopy(init)
        opt = make(model.parameters())
        losses = []
        for i in range(steps):
            loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = losses
    return curves


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loss-curve", action="store_true", help="also train a small MLP 200 steps per optimizer")
    ap.add_argument("--no-bnb", action="store_true", help="skip bitsandbytes' (slow) CPU step")
    ap.add_argument("--tensors", type=int, default=1, help="4096x4096 parameters stepped together (default 1)")
    args = ap.parse_args(argv)
    if args.tensors < 1:
        ap.error(f"--tensors must be at least 1, got {args.tensors}")
    n_params = args.tensors * N
    head = print_header(f"optim8: AdamW step on {n_params / 1e6:.1f} M fp32 parameters ({args.tensors} x 4096x4096)")
    bw = copy_bandwidth_gbs()
    res = timings(with_bnb=not args.no_bnb, tensors=args.tensors)
    moved = {
        "q4torch AdamW8bit": 16,
        "torch AdamW(fused=True)": 28,
        "bitsandbytes AdamW8bit": 16,
        "q4jax adamw_8bit (optax)": 16,
        "optax.adamw fp32": 28,
    }
    q4_ms = res["q4torch AdamW8bit"]["median_ms"]
    rows = []
    for name, r in res.items():
        gbytes = moved[name] * n_params / 1e9
        rows.append([name, r["median_ms"], r["min_ms"], r["median_ms"] / q4_ms, gbytes / (r["median_ms"] * 1e-3) / bw])
    print(f"copy bandwidth (read + write, 256 MiB, torch, all threads): {bw:.1f} GB/s")
    print_table(
        f"AdamW step, {args.tensors} x 4096x4096 fp32 parameters ({moved['torch AdamW(fused=True)'] * n_params / 1e9:.2f} GB "
        f"of fp32 Adam traffic, {16 * n_params / 1e9:.2f} GB of 8-bit)",
        ["optimizer", "median ms", "best ms", "x q4torch", "share of copy bandwidth (its own bytes)"],
        rows,
    )
    ratios = {
        "q4torch / torch fused": q4_ms / res["torch AdamW(fused=True)"]["median_ms"],
        "q4jax / q4torch": res["q4jax adamw_8bit (optax)"]["median_ms"] / q4_ms,
    }
    if "bitsandbytes AdamW8bit" in res:
        ratios["bitsandbytes / q4torch"] = res["bitsandbytes AdamW8bit"]["median_ms"] / q4_ms
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    record = {**head, "tensors": args.tensors, "copy_gbs": bw, "results": res, "ratios": ratios}
    if args.loss_curve:
        curves = loss_curves()
        base = np.array(curves["torch AdamW fp32"])
        rows = []
        for name, c in curves.items():
            c = np.array(c)
            rows.append([name, c[0], c[49], c[99], c[-1], float(np.abs(c - base).max()), float(c[-20:].mean())])
        print_table(
            "loss curve: 200 steps of a 64-256-256-10 MLP (cross entropy), same init and batches",
            ["optimizer", "step 1", "step 50", "step 100", "step 200", "max |loss - fp32|", "mean last 20"],
            rows,
        )
        record["loss_curves"] = curves
    path = write_json("optim8" if args.tensors == 1 else f"optim8-{args.tensors}t", record)
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
