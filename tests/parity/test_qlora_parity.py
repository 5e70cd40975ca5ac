"""QLoRA parity: the same NF4 checkpoint, the same adapters, the same batches;
a few SGD steps in PyTorch (peft over q4torch, q4torch.peft.register) and in
JAX (nnx.LoRA over q4jax, q4jax.add_lora) give the same losses and adapter
gradients within the fp32 rounding bound.

The quantized base is the same kernel in both (bit-identical forward and input
gradient); the adapters, the head and the loss are each framework's own fp32
GEMMs and reductions, summed in different orders. Bound per compared tensor:
|torch - jax| <= C * K * u * max|torch|, u = 2^-24, K = 256 (the longest
reduction), C = 16 (the chained operations from input to a gradient, each
adding at most one K-term rounding), normwise over the tensor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from peft import LoraConfig, get_peft_model
from torch import nn

import q4jax
import q4torch
import q4torch.peft as qpeft

D, H, C, R, STEPS, LR = 128, 256, 4, 4, 3, 0.1
BOUND = 16 * 256 * 2.0**-24


def weights():
    rng = np.random.default_rng(11)
    w = {
        "up": (rng.standard_normal((H, D)) / np.sqrt(D), rng.standard_normal(H) * 0.1),
        "down": (rng.standard_normal((D, H)) / np.sqrt(H), rng.standard_normal(D) * 0.1),
        "head": (rng.standard_normal((C, D)) / np.sqrt(D), rng.standard_normal(C) * 0.1),
    }
    adapters = {
        name: (rng.standard_normal((R, fin)) * 0.1, rng.standard_normal((fout, R)) * 0.1)
        for name, (fin, fout) in (("up", (D, H)), ("down", (H, D)))
    }
    batches = [(rng.standard_normal((32, D)), rng.integers(0, C, 32)) for _ in range(STEPS)]
    f32 = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float32) if a.dtype.kind == "f" else a, t)  # noqa: E731
    return f32(w), f32(adapters), f32(batches)


class TorchNet(nn.Module):
    def __init__(self, w):
        super().__init__()
        for name, (weight, bias) in w.items():
            lin = nn.Linear(weight.shape[1], weight.shape[0])
            lin.weight.data = torch.from_numpy(weight.copy())
            lin.bias.data = torch.from_numpy(bias.copy())
            setattr(self, name, lin)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


class JaxNet(nnx.Module):
    def __init__(self, w):
        for name, (weight, bias) in w.items():
            lin = nnx.Linear(weight.shape[1], weight.shape[0], rngs=nnx.Rngs(0))
            lin.kernel.set_value(jnp.asarray(weight.T))
            lin.bias.set_value(jnp.asarray(bias))
            setattr(self, name, lin)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.down(jax.nn.relu(self.up(x)))))


def torch_run(w, adapters, batches):
    model = q4torch.replace_linear(TorchNet(w), "nf4", skip=("head",))
    model = get_peft_model(model, qpeft.register(LoraConfig(r=R, lora_alpha=R, target_modules=["up", "down"])))
    base = model.get_base_model()
    with torch.no_grad():
        for name, (a, b) in adapters.items():
            getattr(base, name).lora_A["default"].weight.copy_(torch.from_numpy(a))
            getattr(base, name).lora_B["default"].weight.copy_(torch.from_numpy(b))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    out = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        grads = {
            (name, ab): getattr(getattr(base, name), f"lora_{ab.upper()}")["default"].weight.grad.numpy().T.copy()
            for name in adapters
            for ab in ("a", "b")
        }
        out.append((loss.item(), grads))
        opt.step()
    return out, base


def jax_run(w, adapters, batches):
    model = q4jax.add_lora(q4jax.quantize_model(JaxNet(w), "nf4", skip=("head",)), R)
    for name, (a, b) in adapters.items():
        getattr(model, name).lora_a.set_value(jnp.asarray(a.T))
        getattr(model, name).lora_b.set_value(jnp.asarray(b.T))
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.LoRAParam)

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    out = []
    for x, y in batches:
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(
            model, jnp.asarray(x), jnp.asarray(y)
        )
        g = {(name, ab): np.asarray(grads[name][f"lora_{ab}"].get_value()) for name in adapters for ab in ("a", "b")}
        out.append((float(loss), g))
        opt.update(model, grads)
    return out, model


def close(t, j, what):
    t, j = np.asarray(t, np.float64), np.asarray(j, np.float64)
    assert t.shape == j.shape, what
    err, scale = np.abs(t - j).max(), np.abs(t).max()
    assert err <= BOUND * scale, f"{what}: |torch - jax| = {err:.3g} > {BOUND * scale:.3g}"


def test_qlora_steps_agree():
    w, adapters, batches = weights()
    t_steps, t_model = torch_run(w, adapters, batches)
    j_steps, j_model = jax_run(w, adapters, batches)
    # the same quantized bytes in both
    for name in ("up", "down"):
        tb = getattr(t_model, name).get_base_layer().weight.data.numpy().reshape(-1)
        jb = np.asarray(getattr(j_model, name).base_module.weight.get_value()).reshape(-1)
        assert tb.tobytes() == jb.tobytes(), name
    losses = []
    for step, ((tl, tg), (jl, jg)) in enumerate(zip(t_steps, j_steps, strict=True)):
        close(tl, jl, f"loss at step {step}")
        for key in tg:
            close(tg[key], jg[key], f"grad {key} at step {step}")
        losses.append(tl)
    assert len(set(losses)) == STEPS  # the adapters moved


@pytest.mark.parametrize("name", ["up", "down"])
def test_adapted_layer_outputs_agree(name):
    w, adapters, batches = weights()
    _, t_model = torch_run(w, adapters, batches[:0])
    _, j_model = jax_run(w, adapters, batches[:0])
    x = batches[0][0] if name == "up" else np.abs(np.random.default_rng(3).standard_normal((32, H))).astype(np.float32)
    with torch.no_grad():
        t = getattr(t_model, name)(torch.from_numpy(x)).numpy()
    close(t, np.asarray(getattr(j_model, name)(jnp.asarray(x))), f"{name} output")
