"""QLoRA on all-MiniLM-L6-v2: a frozen NF4 base (every linear layer) with
rank-8 LoRA adapters on every linear, trained to bring the quantized model's
sentence embeddings back to the fp32 model's (loss 1 - cosine), in PyTorch
(q4torch, and bitsandbytes 0.50.2 as the peer) and in JAX (q4jax +
flax.nnx.LoRA + optax), one process.

    .venv/bin/python examples/minilm/qlora.py [--steps N] [--batch B]

Prints, per contestant, training steps per second (median over the timed
steps, after warm-up / compilation) and the mean cosine to the fp32
embeddings before and after the steps (on the training sentences: it shows
the adapters train; a held-out evaluation is not the point here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.minilm import common, flax_model, torch_model  # noqa: E402

RANK, ALPHA, LR = 8, 16.0, 2e-3


def _sentences(batch: int) -> list[str]:
    base = common.SENTENCES
    return [base[i % len(base)] + ("" if i < len(base) else f" ({i // len(base)})") for i in range(batch)]


# ------------------------------------------------------------------ PyTorch


def _torch_lora(model, torch, nn):
    """Every quantized linear of ``model`` wrapped as base(x) + B(A(x)) * ALPHA / RANK
    (A random, B zero: the wrapped model starts as the quantized one)."""

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(RANK, base.in_features) / base.in_features**0.5)
            self.b = nn.Parameter(torch.zeros(base.out_features, RANK))

        def forward(self, x):
            return self.base(x) + (x @ self.a.T) @ self.b.T * (ALPHA / RANK)

    model.requires_grad_(False)
    for name, m in list(model.named_modules()):
        if name.startswith("pooler") or not hasattr(m, "in_features") or isinstance(m, LoRA):
            continue
        if name and type(m).__name__ in ("Linear4bit", "Linear"):
            model.set_submodule(name, LoRA(m))
    return model


def _torch_contestant(model, ids, mask, target, steps, torch):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    tgt = torch.from_numpy(target)
    m = mask_t[..., None].float()

    def embed():
        h = model(ids_t, mask_t)
        e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
        return torch.nn.functional.normalize(e, dim=-1)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = (1 - (embed() * tgt).sum(-1)).mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    model.train()
    with torch.no_grad():
        before = float((embed() * tgt).sum(-1).mean())
    return before, step, lambda: float((embed() * tgt).sum(-1).mean().detach())


# ------------------------------------------------------------------ JAX


def _jax_contestant(tensors, ids, mask, target, steps):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import q4jax
    from q4jax._src.graph import graph_edges, set_child

    model = q4jax.quantize_model(flax_model.load(tensors), "nf4", skip=("pooler",))
    rngs = nnx.Rngs(0)
    for _path, parent, key, child in list(graph_edges(model)):
        if isinstance(child, q4jax.nn.Linear4bit):
            set_child(parent, key, nnx.LoRA(child.in_features, RANK, child.out_features, base_module=child, rngs=rngs))
    for lora in [c for _, _, _, c in graph_edges(model) if isinstance(c, nnx.LoRA)]:
        lora.lora_b.set_value(jnp.zeros_like(lora.lora_b.get_value()))
        # nnx.LoRA computes x @ A @ B without a scale: fold ALPHA / RANK into A
        lora.lora_a.set_value(lora.lora_a.get_value() * (ALPHA / RANK))
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.LoRAParam)
    ids_j, mask_j = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    tgt = jnp.asarray(target)
    mf = mask_j[..., None].astype(jnp.float32)

    def cos(model):
        h = model(ids_j, mask_j)
        e = (h * mf).sum(1) / jnp.maximum(mf.sum(1), 1e-9)
        e = e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
        return (e * tgt).sum(-1).mean()

    @nnx.jit
    def train_step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: 1 - cos(m), argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
        opt.update(model, grads)
        return loss

    cos_jit = nnx.jit(cos)
    before = float(cos_jit(model))
    return before, lambda: float(jax.block_until_ready(train_step(model, opt))), lambda: float(cos_jit(model))


# ------------------------------------------------------------------ main


def run(steps: int = 20, batch: int = 32, peers: bool = True) -> dict:
    import torch
    from torch import nn

    import q4torch

    torch.manual_seed(0)
    tensors = common.load_tensors()
    sentences = _sentences(batch)
    ids, mask, _ = next(common.batches(sentences, batch))
    fp32 = torch_model.load(tensors)
    with torch.inference_mode():
        h = fp32(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    target = common.normalize(common.mean_pool(h, mask)).astype(np.float32)

    contestants = {}
    q4_model = q4torch.replace_linear(torch_model.load(tensors), "nf4", skip=("pooler",))
    contestants["q4torch NF4 + LoRA"] = _torch_contestant(
        _torch_lora(q4_model, torch, nn), ids, mask, target, steps, torch
    )
    if peers:
        bnb_model = torch_model.with_bitsandbytes(torch_model.load(tensors))
        contestants["bitsandbytes NF4 + LoRA"] = _torch_contestant(
            _torch_lora(bnb_model, torch, nn), ids, mask, target, steps, torch
        )
        dense = torch_model.load(tensors)
        contestants["dense fp32 torch + LoRA"] = _torch_contestant(
            _torch_lora(dense, torch, nn), ids, mask, target, steps, torch
        )
    contestants["q4jax NF4 + nnx.LoRA"] = _jax_contestant(tensors, ids, mask, target, steps)

    results = {}
    for name, (before, step, after) in contestants.items():
        for _ in range(3):  # warm-up (JAX compiles here)
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        results[name] = {"steps_per_s": 1.0 / statistics.median(times), "cos_before": before, "cos_after": after()}
    return {"batch": batch, "tokens": int(ids.shape[1]), "steps": steps + 3, "results": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per contestant (after 3 warm-up)")
    parser.add_argument("--batch", type=int, default=32, help="sentences per step")
    args = parser.parse_args(argv)
    out = run(args.steps, args.batch)
    print(
        f"QLoRA on all-MiniLM-L6-v2: NF4 base (block 64, nested), rank-{RANK} adapters on every linear, "
        f"batch {out['batch']} x {out['tokens']} tokens, AdamW lr {LR}, {out['steps']} steps each"
    )
    print(f"{'contestant':28s} {'steps/s':>8s} {'cos before':>11s} {'cos after':>10s}")
    for name, r in out["results"].items():
        print(f"{name:28s} {r['steps_per_s']:8.1f} {r['cos_before']:11.5f} {r['cos_after']:10.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
