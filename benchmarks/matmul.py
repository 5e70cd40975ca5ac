"""The main benchmark: a 4096x4096 4-bit linear layer (NF4, block 64, nested
absmax) in one process, q4 beside every peer at its best CPU path.

    Q4_LIBRARY=build/<dir>/libq4.so PYTHONPATH=. .venv/bin/python benchmarks/run.py matmul

Forward, batches 1/8/32/128/512, fp32 and bf16 inputs, two weight regimes:
"L3" (the same layer every call: its 8.25 MiB packed weight stays in the
32 MiB L3) and "DRAM" (distinct layers cycled, together at least 4x the L3:
16 layers, 132 MiB of packed weight, on a 32 MiB L3; every call streams its
weight from memory). Contestants:

- q4torch.functional.matmul_4bit, and q4torch.nn.Linear4bit (eval) forward;
- q4jax: jax.jit of q4jax.matmul_4bit;
- bitsandbytes 0.50.2 Linear4bit in eval() under torch.inference_mode(), its
  best CPU path: on AVX512-BF16 CPUs the first such forward repacks the weight
  in place and every later one runs a fused bf16 kernel (activations, absmax
  and arithmetic in bf16 even for fp32 inputs). It is built from q4's exact
  packed bytes (the formats are byte-identical; checked below);
- torch dense F.linear with the dequantized weight, in the input dtype;
- torch's int4 CPU path (what torchao's int4 weight-only uses on CPU):
  aten._weight_int4pack_mm_for_cpu on a weight packed by
  aten._convert_weight_to_int4pack_for_cpu, group 64, asymmetric uint4 with
  bf16 scales/zeros quantized from the same float weight; its vectorised
  kernel takes bf16 activations only, so fp32 inputs are cast to bf16 and
  back (as torchao requires a bf16 model);
- XLA dense: jax.jit of x @ W^T with W^T stored [K, N] (bf16: the dot
  accumulates in fp32, preferred_element_type, XLA:CPU's fast bf16 path);
- qwix 0.1.8 weight-only PTQ (nf4 and int4, tile 64) of an nnx.Linear in
  the input dtype, jitted as a pure function of the quantized state.

Errors: ||y - y_ref|| / ||y_ref|| against an fp64 product of the (dtype-
rounded) input with each contestant's own dequantized weight (NF4 for q4,
bitsandbytes and the dense peers; its int4 weight for torch int4; qwix's
own dequantized weight for qwix). Then the input gradient (a training step
with a frozen weight): forward + backward to the input at batches 32 and 512.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import numpy as np
from common import (
    dram_layers,
    dram_layers_note,
    dram_read_gbs,
    interleaved,
    load_line,
    nested_4bit_bytes,
    others_busy_cores,
    print_header,
    print_table,
    settled,
    write_json,
)

N = K = 4096
BLOCKSIZE = 64
BATCHES = (1, 8, 32, 128, 512)
DTYPES = ("float32", "bfloat16")
# cycled in the DRAM regime; per layer the benchmark keeps the fp32 weight, its decode, dense fp32 + bf16 copies
# for torch and XLA, and the 4-bit peers: ~44x the packed bytes
DRAM_LAYERS = dram_layers(nested_4bit_bytes(N, K, BLOCKSIZE), 44 * nested_4bit_bytes(N, K, BLOCKSIZE))
GRAD_BATCHES = (32, 512)
INT4_GROUP = 64
QWIX_QTYPES = ("nf4", "int4")


def rounds_for(m: int) -> int:
    return 11 if m <= 32 else 9 if m <= 128 else 5


@dataclass
class Contestant:
    name: str
    short: str  # column name in the summary
    calls: dict  # dtype -> list over layers of make(x_torch, x_jax) -> zero-arg synchronised call
    ref: str  # which dequantized weight the error is measured against
    weight_bytes: int
    note: str = ""
    unavailable: str = ""  # why it cannot run here (printed instead of timings)


@dataclass
class Setup:
    contestants: list[Contestant] = field(default_factory=list)
    ref_weights: dict = field(default_factory=dict)  # name -> fp64 torch [N, K] of layer 0
    notes: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    floor: Contestant | None = None  # a plain read of the weight's bytes, timed beside the batch-1 contestants
    extra: dict = field(default_factory=dict)  # objects the input-gradient part reuses


# ------------------------------------------------------------------ building the contestants


def _float_weights(rng) -> list[np.ndarray]:
    return [(rng.standard_normal((N, K), dtype=np.float32) * 0.02) for _ in range(DRAM_LAYERS)]


def _q4_layers(ws):
    import torch

    import q4torch

    layers = []
    for w in ws:
        layer = q4torch.nn.Linear4bit(K, N, bias=False, compress_statistics=True, quant_type="nf4")
        layer.weight = q4torch.nn.Params4bit(
            torch.from_numpy(w), requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=BLOCKSIZE
        )
        layers.append(layer.to("cpu").eval())
    return layers


def _bnb_layer(sd, dtype, packed_ref):
    """bitsandbytes' Linear4bit holding q4's packed weight and quant state (from_prequantized)."""
    import bitsandbytes as bnb
    import torch

    layer = bnb.nn.Linear4bit(
        K, N, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4", device="meta"
    )
    stats = {k[len("weight.") :]: v.clone() for k, v in sd.items() if k.startswith("weight.")}
    layer.weight = bnb.nn.Params4bit.from_prequantized(
        sd["weight"].clone(), stats, requires_grad=False, device="cpu", module=layer
    )
    if not torch.equal(layer.weight.data.view(torch.uint8).reshape(-1), packed_ref.view(torch.uint8).reshape(-1)):
        raise RuntimeError("bitsandbytes layer does not hold q4's packed bytes")
    return layer


def _int4_pack(w: np.ndarray, with_reference: bool = False):
    """torchao's int4 weight-only recipe (tinygemm convention): per group of 64
    along K, scale = (max - min) / 15, zero = min + 8 * scale, q = round((w - min) / scale)
    in [0, 15], dequantized as (q - 8) * scale + zero; scales/zeros in bf16.
    Returns (packed, scales_and_zeros [K/64, N, 2] bf16, dequantized fp64 [N, K] or None)."""
    import torch

    wt = torch.from_numpy(w).reshape(N, K // INT4_GROUP, INT4_GROUP)
    lo, hi = wt.amin(-1, keepdim=True), wt.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = ((wt - (zero - 8 * scale)) / scale).round().clamp(0, 15).to(torch.int32)
    deq = ((q.double() - 8) * scale.double() + zero.double()).reshape(N, K) if with_reference else None
    sz = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/64, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K), 8)
    return packed, sz, deq


def build(ws, rng) -> Setup:
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as tF

    import q4jax
    import q4torch.functional as F

    su = Setup()
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

    # ---- q4torch (the packed bytes everything NF4 is built from)
    q4l = _q4_layers(ws)
    packs = [layer.packed_weight() for layer in q4l]
    sds = [layer.state_dict() for layer in q4l]
    p0, s0 = packs[0]
    q4_bytes = p0.numel() + s0.absmax.numel() * s0.absmax.element_size() + 4 * s0.state2.absmax.numel() + 4
    deq = [F.dequantize_4bit(p, s) for p, s in packs]  # fp32 [N, K]; exact decode of the NF4 weight
    su.ref_weights["nf4"] = deq[0].double()
    su.info["nf4_weight_rel_err"] = float(
        (deq[0].double() - torch.from_numpy(ws[0]).double()).norm() / np.linalg.norm(ws[0])
    )

    def q4_functional(p, s):
        return lambda x, xj: lambda: F.matmul_4bit(x, p, s)

    def q4_module(layer):
        return lambda x, xj: lambda: layer(x)

    # the read floor for streaming a weight: torch.sum (all threads) over 8 buffers of the packed weight's size
    stream = torch.ones(DRAM_LAYERS, q4_bytes // 4)
    su.floor = Contestant(
        "read floor: torch.sum over as many bytes",
        "read floor",
        {d: [_reader(stream[i]) for i in range(DRAM_LAYERS)] for d in DTYPES},
        "",
        stream[0].numel() * 4,
    )

    su.contestants.append(
        Contestant(
            "q4torch functional.matmul_4bit",
            "q4torch",
            {d: [q4_functional(p, s) for p, s in packs] for d in DTYPES},
            "nf4",
            q4_bytes,
        )
    )
    su.contestants.append(
        Contestant(
            "q4torch nn.Linear4bit (eval)",
            "q4 Linear4bit",
            {d: [q4_module(m) for m in q4l] for d in DTYPES},
            "nf4",
            q4_bytes,
        )
    )

    # ---- q4jax on the same bytes
    jpacks = [
        (jnp.asarray(p.view(torch.uint8).reshape(-1).numpy()), q4jax.QuantState.from_numpy(s.to_numpy()))
        for p, s in packs
    ]
    q4j = jax.jit(lambda x, p, s: q4jax.matmul_4bit(x, p, s))

    def q4jax_call(p, s):
        return lambda x, xj: lambda: q4j(xj, p, s).block_until_ready()

    su.contestants.append(
        Contestant(
            "q4jax matmul_4bit (jit)",
            "q4jax",
            {d: [q4jax_call(p, s) for p, s in jpacks] for d in DTYPES},
            "nf4",
            q4_bytes,
        )
    )

    # ---- bitsandbytes, eval + inference_mode (fused AVX512-BF16 kernel on this CPU)
    import bitsandbytes as bnb
    import bitsandbytes.backends.cpu.ops as bnb_cpu_ops

    bnb_layers = {d: [_bnb_layer(sd, tdt[d], p) for sd, (p, _) in zip(sds, packs, strict=True)] for d in DTYPES}
    first = bnb_layers[DTYPES[0]][0].weight  # not yet repacked: bitsandbytes' own layout = q4's
    bnb_deq = bnb.functional.dequantize_4bit(first.data, first.quant_state).float()
    if not torch.equal(bnb_deq, deq[0]):
        raise RuntimeError("bitsandbytes dequantizes q4's packed weight to other values")
    fused = []
    with torch.inference_mode():
        for d in DTYPES:
            for layer in bnb_layers[d]:
                layer.eval()
                layer(torch.zeros(1, K, dtype=tdt[d]))  # the first eval forward repacks the weight in place
                fused.append(bool(getattr(layer.weight.quant_state, "packing_format_for_cpu", False)))
    hub = getattr(bnb_cpu_ops, "gemm_4bit_forward_kernel", None)
    bnb_path = (
        ("kernels-community hub kernel" if hub is not None else "bundled gemv_4bit_inference_cpu_nf4_bf16")
        if all(fused)
        else "NOT fused (dequantize + matmul): this CPU lacks AVX512-BF16"
    )
    su.info["bitsandbytes_path"] = bnb_path
    su.notes.append(
        f"bitsandbytes: Linear4bit(compute_dtype=input dtype) built from q4's packed bytes (checked equal, and its "
        f"dequantize equals q4's), eval() + inference_mode: {bnb_path}; bf16 compute for fp32 inputs too. "
        + (
            ""
            if hub is not None
            else "Its optional hub kernel (kernels-community/quantization-bitsandbytes via the `kernels` package) "
            "is not loadable here (no package / no network)."
        )
    )
    q = bnb_layers["bfloat16"][0].weight
    bnb_bytes = q.data.numel() * q.data.element_size() + q.quant_state.absmax.numel() * 2

    def bnb_call(layer):
        return lambda x, xj: lambda: layer(x)

    su.contestants.append(
        Contestant(
            "bitsandbytes Linear4bit (eval, inference_mode)",
            "bnb",
            {d: [bnb_call(m) for m in bnb_layers[d]] for d in DTYPES},
            "nf4",
            bnb_bytes,
            note="bf16 compute",
        )
    )

    # ---- torch dense, the dequantized weight in the input dtype
    dense_w = {d: [w.to(tdt[d]).contiguous() for w in deq] for d in DTYPES}

    def dense_call(w):
        return lambda x, xj: lambda: tF.linear(x, w)

    su.contestants.append(
        Contestant(
            "torch dense F.linear",
            "dense torch",
            {d: [dense_call(w) for w in dense_w[d]] for d in DTYPES},
            "nf4",
            0,  # per dtype, see weight_bytes_for
        )
    )

    # ---- torch int4 (torchao's int4 weight-only CPU kernel)
    try:
        int4 = [_int4_pack(w, with_reference=i == 0) for i, w in enumerate(ws)]
        su.ref_weights["int4"] = int4[0][2]
        su.info["int4_weight_rel_err"] = float(
            (int4[0][2] - torch.from_numpy(ws[0]).double()).norm() / np.linalg.norm(ws[0])
        )
        op = torch.ops.aten._weight_int4pack_mm_for_cpu

        def int4_call(p, sz, d):
            if d == "bfloat16":
                return lambda x, xj: lambda: op(x, p, INT4_GROUP, sz)
            return lambda x, xj: lambda: op(x.to(torch.bfloat16), p, INT4_GROUP, sz).to(torch.float32)

        p, sz, _ = int4[0]
        su.contestants.append(
            Contestant(
                "torch int4 _weight_int4pack_mm_for_cpu (g64)",
                "torch int4",
                {d: [int4_call(p, sz, d) for p, sz, _ in int4] for d in DTYPES},
                "int4",
                p.numel() * p.element_size() + sz.numel() * 2,
                note="bf16 compute",
            )
        )
        x1 = torch.randn(1, K)
        direct = interleaved({"f": lambda: op(x1, p, INT4_GROUP, sz.float())}, rounds=3, warmup=1)["f"]["median_ms"]
        su.info["int4_fp32_direct_batch1_ms"] = direct
        su.notes.append(
            "torch int4: _convert_weight_to_int4pack_for_cpu(q [N,K] int32, innerKTiles=8) + "
            "_weight_int4pack_mm_for_cpu(x, packed, 64, scales_and_zeros bf16 [K/64, N, 2]); its AVX-512 kernel is "
            f"bf16-only: called directly with fp32 activations it runs a scalar loop ({direct:.1f} ms at batch 1), so "
            "fp32 rows cast x to bf16 and back. Its own int4 weight (quantized from the same float weight) is the "
            "error reference."
        )
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        su.contestants.append(
            Contestant("torch int4 _weight_int4pack_mm_for_cpu (g64)", "torch int4", {}, "int4", 0, unavailable=str(e))
        )

    # ---- XLA dense, W^T laid out [K, N]
    xla_w = {d: [jnp.asarray(w.t().contiguous().numpy()).astype(jdt[d]) for w in deq] for d in DTYPES}
    xla_f32 = jax.jit(lambda x, w: x @ w)
    xla_bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))

    def xla_call(w, d):
        f = xla_f32 if d == "float32" else xla_bf16
        return lambda x, xj: lambda: f(xj, w).block_until_ready()

    su.contestants.append(
        Contestant(
            "XLA dense (jit x @ W^T, W^T [K,N])",
            "XLA dense",
            {d: [xla_call(w, d) for w in xla_w[d]] for d in DTYPES},
            "nf4",
            0,
        )
    )
    su.notes.append(
        "XLA dense bf16: jnp.dot(x, W^T, preferred_element_type=float32).astype(bfloat16); a plain bf16 `x @ W^T` "
        "takes XLA:CPU's slow bf16 dot (6x slower at batch 32 here). XLA runs with default flags."
    )

    # ---- qwix weight-only PTQ
    try:
        import qwix
        from flax import nnx

        for qt in QWIX_QTYPES:
            calls, qbytes = {}, 0
            for d in DTYPES:
                graph, states = _qwix_states(qwix, nnx, qt, jdt[d], ws)
                calls[d] = [_qwix_call(graph, st) for st in states]
                qa = nnx.merge(graph, states[0]).kernel.array  # its weight as this dtype's model holds it
                wq = np.asarray(qwix.dequantize(qa).astype(jnp.float32)).T
                su.ref_weights[f"qwix-{qt}-{d}"] = torch.from_numpy(np.ascontiguousarray(wq)).double()
                qbytes = max(qbytes, N * K // 2 + qa.scale.nbytes)
            ref = su.ref_weights[f"qwix-{qt}-float32"]
            su.info[f"qwix_{qt}_weight_rel_err"] = float(
                (ref - torch.from_numpy(ws[0]).double()).norm() / np.linalg.norm(ws[0])
            )
            su.contestants.append(
                Contestant(
                    f"qwix 0.1.8 {qt} weight-only (PTQ, tile 64)", f"qwix {qt}", calls, f"qwix-{qt}-{{dtype}}", qbytes
                )
            )
        su.notes.append(
            "qwix: qwix.quantize_model(nnx.Linear(dtype=input dtype), PtqProvider([QtRule(weight_qtype=nf4|int4, "
            "tile_size=64)])) then jax.jit(lambda state, x: nnx.merge(graph, state)(x)); for float activations qwix "
            "dequantizes the weight inside the jitted dot (its documented path for weight-only), XLA fuses what it "
            "can. Error reference: qwix.dequantize of its own weight (fp32 scales; bf16 models keep bf16 scales)."
        )
    except ImportError as e:
        for qt in QWIX_QTYPES:
            su.contestants.append(
                Contestant(
                    f"qwix 0.1.8 {qt} weight-only (PTQ, tile 64)",
                    f"qwix {qt}",
                    {},
                    f"qwix-{qt}-{{dtype}}",
                    0,
                    unavailable=f"{e} (pip install qwix==0.1.8)",
                )
            )
    su.info["dense_bytes"] = {"float32": N * K * 4, "bfloat16": N * K * 2}
    su.info["q4_weight_bytes"] = q4_bytes
    su.info["bnb_weight_bytes"] = bnb_bytes
    su.extra = {"q4_layers": q4l, "packs": packs, "jpacks": jpacks, "sds": sds, "dense_w": dense_w, "xla_w": xla_w}
    return su


def _reader(buf):
    return lambda x, xj: lambda: buf.sum()


def _qwix_states(qwix, nnx, qt, dtype, ws):
    """qwix PTQ of nnx.Linear(dtype) for each weight: quantize_model on the first
    layer (the abstract quantized model), qwix.quantize_params (jitted) for the
    others; for the first layer quantize_params gives quantize_model's exact
    qvalue and scale (checked by hand when this was written)."""
    import jax
    import jax.numpy as jnp

    w0 = jnp.asarray(ws[0].T)
    lin = nnx.Linear(
        K,
        N,
        use_bias=False,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=lambda key, shape, dt: w0,
        rngs=nnx.Rngs(0),
    )
    rule = qwix.QtRule(module_path=".*", weight_qtype=qt, tile_size=BLOCKSIZE)
    qm = qwix.quantize_model(lin, qwix.PtqProvider([rule]), jnp.ones((1, K), dtype))
    graph, state0 = nnx.split(qm)
    quantize = jax.jit(lambda w: qwix.quantize_params({"kernel": w}, qm))
    states = [state0]
    for w in ws[1:]:
        st = jax.tree.map(lambda a: a, state0)
        nnx.replace_by_pure_dict(st, quantize(jnp.asarray(w.T).astype(dtype)))
        states.append(st)
    return graph, states


def _qwix_call(graph, state):
    """A jitted pure function of qwix's quantized state (no nnx.jit graph traversal per call)."""
    import jax
    from flax import nnx

    fn = jax.jit(lambda st, x: nnx.merge(graph, st)(x))
    return lambda x, xj: lambda: fn(state, xj).block_until_ready()


def weight_bytes_for(c: Contestant, dtype: str) -> int:
    if c.weight_bytes:
        return c.weight_bytes
    return N * K * (4 if dtype == "float32" else 2)


# ------------------------------------------------------------------ running


def _inputs(rng, m, dtype):
    import jax.numpy as jnp
    import torch

    x32 = rng.standard_normal((m, K), dtype=np.float32)
    xt = torch.from_numpy(x32).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    xj = jnp.asarray(xt.float().numpy()).astype(jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    return xt, xj


def _to64(y):
    import torch

    if isinstance(y, torch.Tensor):
        return y.double()
    return torch.from_numpy(np.asarray(y).astype(np.float32)).double()


def rel_err(y, ref) -> float:
    return float((_to64(y) - ref).norm() / ref.norm())


def run_forward(su: Setup, rng) -> tuple[list[dict], dict, dict]:
    import torch

    import q4

    rows, errors, q4_kernels = [], {}, {}
    runnable = [c for c in su.contestants if not c.unavailable]
    with torch.inference_mode():
        for dtype in DTYPES:
            for m in BATCHES:
                xt, xj = _inputs(rng, m, dtype)
                x64 = xt.double()
                refs = {}  # fp64 products, computed once per weight that some contestant is measured against
                errs = {}
                for c in runnable:
                    y = c.calls[dtype][0](xt, xj)()
                    key = c.ref.format(dtype=dtype)
                    if key not in refs:
                        refs[key] = x64 @ su.ref_weights[key].t()
                    errs[c.name] = rel_err(y, refs[key])
                    if c.short in ("q4torch", "q4jax"):
                        q4_kernels[f"{c.short} {dtype} batch {m}"] = dict(q4.cpu_features()["last_kernel"])
                errors[(dtype, m)] = errs
                timed = runnable + ([su.floor] if m == 1 and su.floor is not None else [])
                for regime in ("L3", "DRAM"):
                    fns = {}
                    for c in timed:
                        per_layer = [make(xt, xj) for make in c.calls[dtype]]
                        fns[c.name] = per_layer[0] if regime == "L3" else _cycle(per_layer)
                    # DRAM: every call (warmup included) moves on to the next layer, so each call reads a weight
                    # that DRAM_LAYERS - 1 other layers' weights (>= 3x the L3) evicted since its last use
                    res = settled(fns, rounds=rounds_for(m), warmup=2 if m <= 128 else 1)
                    for name, r in res.items():
                        rows.append({"dtype": dtype, "batch": m, "regime": regime, "contestant": name, **r})
                    r = next(iter(res.values()))
                    print(
                        f"  timed {dtype} batch {m} {regime}: {r['attempts']} attempt(s), dispersion "
                        f"{r['dispersion']:.2f}",
                        flush=True,
                    )
    return rows, errors, q4_kernels


def _bf16_engine() -> str:
    """What oneDNN's bf16 GEMM runs on here (AMX where the CPU has it)."""
    import q4

    return "AMX" if q4.cpu_features()["features"].get("amx") else "AVX512-BF16"


def _cycle(calls):
    it = itertools.cycle(calls)
    return lambda: next(it)()


def _jax_step(f):
    """jit of (x, g, *weights) -> (y, dX) through jax.vjp, blocked on both: the
    forward output is returned, or XLA would drop the forward (dX of a linear
    map does not need y) and time the backward alone."""
    import jax

    def step(x, g, *weights):
        y, pullback = jax.vjp(lambda x: f(x, *weights), x)
        return y, pullback(g)[0]

    jitted = jax.jit(step)

    def call(x, g, *weights):
        y, dx = jax.block_until_ready(jitted(x, g, *weights))
        return dx

    return call


def run_grad(su: Setup, rng) -> tuple[list[dict], dict]:
    """Forward + backward to the input (frozen weight), batches 32 and 512, layer 0."""
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as tF

    import q4jax

    q4_layer = su.extra["q4_layers"][0].train()
    pj, sj = su.extra["jpacks"][0]
    sd, (p0, _) = su.extra["sds"][0], su.extra["packs"][0]
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    bnb_train = {d: _bnb_layer(sd, tdt[d], p0).train() for d in DTYPES}  # never run in eval: no in-place repack
    q4j = _jax_step(lambda x, p, s: q4jax.matmul_4bit(x, p, s))
    xlaj = _jax_step(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    w64 = su.ref_weights["nf4"]

    def torch_step(module_or_fn, xt, g):
        xg = xt.clone().requires_grad_()
        return lambda: torch.autograd.grad(module_or_fn(xg), xg, g)[0]

    rows, errors = [], {}
    for dtype in DTYPES:
        dense = su.extra["dense_w"][dtype][0]
        xw = su.extra["xla_w"][dtype][0]
        for m in GRAD_BATCHES:
            xt, xj = _inputs(rng, m, dtype)
            gt, gj = _inputs(rng, m, dtype)
            fns = {
                "q4torch Linear4bit (train)": torch_step(q4_layer, xt, gt),
                "q4jax matmul_4bit (jit vjp)": lambda xj=xj, gj=gj: q4j(xj, gj, pj, sj),
                "bitsandbytes Linear4bit (train)": torch_step(bnb_train[dtype], xt, gt),
                "torch dense F.linear": torch_step(lambda x, w=dense: tF.linear(x, w), xt, gt),
                "XLA dense (jit vjp)": lambda xj=xj, gj=gj, xw=xw: xlaj(xj, gj, xw),
            }
            ref = gt.double() @ w64
            errors[(dtype, m)] = {name: rel_err(fn(), ref) for name, fn in fns.items()}
            res = settled(fns, rounds=7 if m <= 32 else 4, warmup=1)
            for name, r in res.items():
                rows.append({"dtype": dtype, "batch": m, "contestant": name, **r})
            r = next(iter(res.values()))
            print(
                f"  timed training step {dtype} batch {m}: {r['attempts']} attempt(s), dispersion "
                f"{r['dispersion']:.2f}",
                flush=True,
            )
    return rows, errors


# ------------------------------------------------------------------ printing


def _ms(rows, dtype, m, regime, name, stat="median_ms"):
    for r in rows:
        if (r["dtype"], r["batch"], r["regime"], r["contestant"]) == (dtype, m, regime, name):
            return r[stat]
    return None


def _ratio(a, b):
    return None if a is None or b is None else a / b


def print_forward(su: Setup, rows, errors, dram_gbs: float) -> None:
    """dram_gbs: the 1 GiB read rate, mean of the run's start and end."""
    byshort = {c.short: c for c in su.contestants}
    peers = {"bnb": byshort["bnb"].name, "dense": byshort["dense torch"].name, "XLA": byshort["XLA dense"].name}
    for dtype in DTYPES:
        for m in BATCHES:
            header = [
                "contestant",
                "L3 ms",
                "DRAM ms",
                "bnb/this L3",
                "bnb/this DRAM",
                "dense/this L3",
                "dense/this DRAM",
                "XLA/this L3",
                "XLA/this DRAM",
                "rel err",
            ]
            floor = {}
            if m == 1:
                header += ["GB/s L3", "GB/s DRAM", "% of read floor DRAM", "% of 1 GiB read"]
                f = su.floor
                for regime in ("L3", "DRAM"):
                    floor[regime] = f.weight_bytes / (_ms(rows, dtype, m, regime, f.name) * 1e-3) / 1e9
            table = []
            for c in su.contestants:
                label = c.name + (f" [{c.note}]" if c.note else "")
                if c.unavailable:
                    table.append([label, "not run: " + c.unavailable[:60]] + ["-"] * (len(header) - 2))
                    continue
                l3, dr = _ms(rows, dtype, m, "L3", c.name), _ms(rows, dtype, m, "DRAM", c.name)
                row = [label, l3, dr]
                for p in ("bnb", "dense", "XLA"):
                    row += [
                        _ratio(_ms(rows, dtype, m, "L3", peers[p]), l3),
                        _ratio(_ms(rows, dtype, m, "DRAM", peers[p]), dr),
                    ]
                row.append(errors[(dtype, m)][c.name])
                if m == 1:
                    gbs = weight_bytes_for(c, dtype) / (dr * 1e-3) / 1e9
                    l3_gbs = weight_bytes_for(c, dtype) / (l3 * 1e-3) / 1e9
                    row += [l3_gbs, gbs, 100 * gbs / floor["DRAM"], 100 * gbs / dram_gbs]
                table.append(row)
            if m == 1:
                f = su.floor
                blank = ["-"] * (len(header) - 7)
                table.append(
                    [f.name, _ms(rows, dtype, m, "L3", f.name), _ms(rows, dtype, m, "DRAM", f.name)]
                    + blank
                    + [floor["L3"], floor["DRAM"], 100.0, 100 * floor["DRAM"] / dram_gbs]
                )
            print_table(
                f"forward, batch {m}, {dtype} input: median ms; ratio = peer ms / this ms (> 1: this is faster); "
                "rel err vs fp64 with the contestant's dequantized weight",
                header,
                table,
            )


def print_summary(su: Setup, rows, stat: str) -> None:
    cols = [c for c in su.contestants if not c.unavailable]
    q4n, bnbn = cols[0].name, next(c.name for c in cols if c.short == "bnb")
    densen = next(c.name for c in cols if c.short == "dense torch")
    xlan = next(c.name for c in cols if c.short == "XLA dense")
    q4jn = next(c.name for c in cols if c.short == "q4jax")
    for dtype in DTYPES:
        header = ["batch, weight"] + [c.short for c in cols] + ["bnb/q4", "dense/q4", "XLA/q4", "XLA/q4jax"]
        table = []
        for m in BATCHES:
            for regime in ("L3", "DRAM"):
                ms = {c.name: _ms(rows, dtype, m, regime, c.name, stat) for c in cols}
                table.append(
                    [f"{m}, {regime}"]
                    + [ms[c.name] for c in cols]
                    + [
                        _ratio(ms[bnbn], ms[q4n]),
                        _ratio(ms[densen], ms[q4n]),
                        _ratio(ms[xlan], ms[q4n]),
                        _ratio(ms[xlan], ms[q4jn]),
                    ]
                )
        what = "median ms" if stat == "median_ms" else "best (fastest sample) ms"
        print_table(
            f"summary, {dtype} input: {what} per 4096x4096 forward (q4 = q4torch functional; ratio > 1: q4 faster)",
            header,
            table,
        )


def print_grad(rows, errors) -> None:
    for dtype in DTYPES:
        names = list(dict.fromkeys(r["contestant"] for r in rows if r["dtype"] == dtype))
        table = []
        for name in names:
            row = [name]
            for m in GRAD_BATCHES:
                ms = next(r["median_ms"] for r in rows if (r["dtype"], r["batch"], r["contestant"]) == (dtype, m, name))
                q4ms = next(
                    r["median_ms"] for r in rows if (r["dtype"], r["batch"], r["contestant"]) == (dtype, m, names[0])
                )
                row += [ms, ms / q4ms, errors[(dtype, m)][name]]
            table.append(row)
        header = ["training step (fwd + dX)"]
        for m in GRAD_BATCHES:
            header += [f"b{m} ms", f"b{m} this/q4torch", f"b{m} dX rel err"]
        print_table(
            f"input gradient, {dtype}: forward + backward to the input, frozen weight, layer in L3; "
            "ratio this/q4torch > 1: q4torch faster",
            header,
            table,
        )


def main() -> dict:
    import time

    import torch

    t0 = time.perf_counter()
    head = print_header("matmul: 4096x4096 NF4 block 64 nested absmax, forward and input gradient")
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    ws = _float_weights(rng)
    su = build(ws, rng)
    del ws
    print(
        f"setup {time.perf_counter() - t0:.0f} s; weight error ||W_q - W|| / ||W||: NF4 {su.info['nf4_weight_rel_err']:.4f}"
        + "".join(
            f", {k.removesuffix('_weight_rel_err')} {v:.4f}"
            for k, v in su.info.items()
            if k.endswith("_weight_rel_err") and not k.startswith("nf4")
        ),
        flush=True,
    )
    rows, errors, q4_kernels = run_forward(su, rng)
    grad_rows, grad_errors = run_grad(su, rng)
    dram_end = dram_read_gbs()
    print(
        f"\nDRAM read bandwidth (1 GiB): {head['roofline']['dram_read_gbs']:.1f} GB/s at the start, "
        f"{dram_end:.1f} GB/s after the timings (it drifts with the host's other tenants, so batch 1 is set against "
        "a read floor timed in the same rounds: torch.sum over 8.25 MiB buffers, one per layer, cycled like the "
        "weights)"
    )
    configs = {(r["dtype"], r["batch"], r["regime"]): r for r in rows}
    retimed = [k for k, r in configs.items() if r["attempts"] > 1]
    noisy = [k for k, r in configs.items() if r["dispersion"] > 2.0]
    print(
        f"timing: {len(configs)} forward configurations, {len(retimed)} re-timed because some contestant's median "
        f"was > 2x its fastest sample; {len(noisy)} still above 2x after 3 attempts"
        + (": " + ", ".join(f"{d} b{m} {g}" for d, m, g in noisy) if noisy else "")
    )
    print_forward(su, rows, errors, (head["roofline"]["dram_read_gbs"] + dram_end) / 2)
    print_summary(su, rows, "median_ms")
    print_summary(su, rows, "min_ms")
    print_grad(grad_rows, grad_errors)
    ran: dict[str, dict[str, list[int]]] = {}
    for k, v in q4_kernels.items():
        who, m = k.split(" batch ")
        ran.setdefault(who, {}).setdefault(v.get("gemm_4bit", "?"), []).append(int(m))
    print(
        "\nq4 kernels that ran (q4.cpu_features()['last_kernel']): "
        + "; ".join(
            f"{who}: " + ", ".join(f"{kern} (batch {'/'.join(map(str, ms))})" for kern, ms in by.items())
            for who, by in ran.items()
        )
    )
    print(
        f"weights: q4 NF4 {su.info['q4_weight_bytes'] / 2**20:.2f} MiB (packed + uint8 absmax codes + nested absmax), "
        f"bitsandbytes after its repack {su.info['bnb_weight_bytes'] / 2**20:.2f} MiB; {DRAM_LAYERS} layers cycled "
        "in the DRAM regime (dense peers too: their 32-64 MiB weights never fit the L3 anyway). "
        "GB/s = weight bytes / time; % of read floor = that over the read floor's GB/s in the same rounds; "
        "% of 1 GiB read = that over the mean of the 1 GiB DRAM read rates measured at the start and the end."
    )
    note = dram_layers_note(nested_4bit_bytes(N, K, BLOCKSIZE), DRAM_LAYERS)
    if note:
        print(note)
    roof = head["roofline"]
    su.notes.append(
        f"torch dense: F.linear (fp32: MKL sgemm, {roof['fp32_gflops']:.0f} GFLOP/s at 2048^3 here; bf16: oneDNN "
        f"{_bf16_engine()}, {roof['bf16_gflops']:.0f} GFLOP/s)"
        + (
            f"; XLA's own GEMM reaches {roof['xla_fp32_gflops']:.0f} / {roof['xla_bf16_gflops']:.0f} GFLOP/s."
            if roof.get("xla_fp32_gflops")
            else "."
        )
    )
    su.notes.append(
        "errors: q4, bitsandbytes and the dense peers against the fp32-decoded NF4 weight (so a bf16 path's "
        "rounding of the weight counts); torch int4 and qwix against their own dequantized weights (other "
        "formats: see the weight errors above), so their figures measure only their arithmetic."
    )
    for note in su.notes:
        print("note: " + note)
    others_end = others_busy_cores()
    print(
        f"total {time.perf_counter() - t0:.0f} s; at the end other processes used "
        f"{others_end if others_end is not None else float('nan'):.2f} cores; {load_line()}"
    )
    record = {
        **head,
        "config": {
            "shape": [N, K],
            "blocksize": BLOCKSIZE,
            "quant_type": "nf4",
            "nested": True,
            "batches": BATCHES,
            "dtypes": DTYPES,
            "dram_layers": DRAM_LAYERS,
        },
        "contestants": {
            c.short: {"name": c.name, "note": c.note, "unavailable": c.unavailable, "error_reference": c.ref}
            for c in su.contestants
        },
        "info": su.info,
        "dram_read_gbs_end": dram_end,
        "notes": su.notes,
        "forward": rows,
        "forward_errors": [{"dtype": d, "batch": m, **e} for (d, m), e in errors.items()],
        "q4_kernels": q4_kernels,
        "input_gradient": grad_rows,
        "input_gradient_errors": [{"dtype": d, "batch": m, **e} for (d, m), e in grad_errors.items()],
        "runtime_s": time.perf_counter() - t0,
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "others_busy_cores_end": others_end,
    }
    print(f"JSON: {write_json('matmul', record)}")
    return record


if __name__ == "__main__":
    main()
