"""8-bit optimizers as optax GradientTransformations over q4's fused kernel.

Each leaf of at least ``min_8bit_size`` elements keeps bitsandbytes' 8-bit state
(uint8 ``state1`` / ``state2`` shaped like the leaf, fp32 ``absmax1`` / ``absmax2``
per block of 256, the maps ``qmap1`` / ``qmap2``): the same bytes as
q4torch.optim and bitsandbytes after the same steps. The step runs in one XLA FFI
call per leaf (q4_optimizer_update_8bit), under jit, with the states updated in
place (aliased). Smaller leaves keep fp32 states, updated with jnp in
bitsandbytes' 32-bit order.

optax applies an update as ``params + updates``; the kernel computes the new
parameter and returns the fp32 ``u`` with ``params + u`` rounding to exactly that
value (``new - params``, corrected by an ulp where needed; written into the fp32
gradient's buffer, the parameter itself is only read):
optax.apply_updates then gives q4torch's and bitsandbytes' parameter bits, except
for an element whose update is larger than its new value (one that crosses zero,
say), where no such fp32 ``u`` may exist: that one lands within an ulp of the update.

A block whose gradient holds a NaN or an infinity is left unchanged (parameter
and state); the count of such blocks in the last step is ``state.skipped_blocks``
(read it outside jit: an error cannot be raised inside).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from q4._src import optim8
from q4jax._src import ffi

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


class Optim8State(NamedTuple):
    """step: steps taken (int32); state1 / absmax1 / state2 / absmax2: pytrees like
    the params (uint8 codes and fp32 absmax for 8-bit leaves, fp32 states and empty
    absmax for small ones; state2 / absmax2 empty arrays for 1-state optimizers);
    qmap1 / qmap2: the signed / unsigned dynamic maps; skipped_blocks: blocks left
    unchanged in the last step because their gradient was not finite."""

    step: jax.Array
    state1: Any
    absmax1: Any
    state2: Any
    absmax2: Any
    qmap1: jax.Array
    qmap2: jax.Array
    skipped_blocks: jax.Array


def _empty(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _step_8bit(p, g, s1, a1, s2, a2, q1, q2, step, lr_scale, *, name, lr, b1, b2, eps, wd):
    two = name in optim8.TWO_STATE
    ffi.register()
    out = (
        jax.ShapeDtypeStruct(p.shape, jnp.float32),
        jax.ShapeDtypeStruct(s1.shape, jnp.uint8),
        jax.ShapeDtypeStruct(a1.shape, jnp.float32),
        jax.ShapeDtypeStruct(s2.shape, jnp.uint8),
        jax.ShapeDtypeStruct(a2.shape, jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    # the states update in place; an fp32 gradient's buffer takes the update (the kernel reads
    # each gradient element before writing its update), so no fresh 4 B/parameter output
    aliases = {2: 1, 3: 2, 4: 3, 5: 4, **({1: 0} if g.dtype == jnp.float32 else {})}
    call = jax.ffi.ffi_call("q4_optimizer_update_8bit", out, input_output_aliases=aliases, vmap_method=None)
    return call(
        p,
        g,
        s1,
        a1,
        s2 if two else _empty(jnp.uint8),
        a2 if two else _empty(jnp.float32),
        q1,
        q2 if two else _empty(jnp.float32),
        jnp.reshape(step, (1,)).astype(jnp.int32),
        jnp.reshape(lr_scale, (1,)).astype(jnp.float32),
        optimizer=np.int64(optim8.optimizer_code(name)),
        lr=np.float64(lr),
        beta1=np.float64(b1),
        beta2=np.float64(b2),
        eps=np.float64(eps),
        weight_decay=np.float64(wd),
        gnorm_scale=np.float64(1.0),
    )


def _update_for(p: jax.Array, new_p: jax.Array) -> jax.Array:
    """An fp32 update u with fp32(p + u) == new_p, what optax.apply_updates computes:
    u = new_p - p, nudged by an ulp (twice at most) where that sum rounds elsewhere.
    Such a u exists unless |new_p - p| is larger than |new_p|; then p + u is within
    an ulp of the update from new_p."""
    p32, n32 = p.astype(jnp.float32), new_p.astype(jnp.float32)
    u = n32 - p32
    for _ in range(2):
        r = p32 + u
        up, down = jnp.nextafter(u, jnp.float32(jnp.inf)), jnp.nextafter(u, jnp.float32(-jnp.inf))
        u = jnp.where(r == n32, u, jnp.where(r < n32, up, down))
    return u


def _leaf_sharding(p, where: str):
    """(mesh, spec) of a concrete leaf sharded along its first axis, None when the leaf is
    not sharded (or is a tracer). The 8-bit state follows such a leaf: its codes sharded
    like it, its absmax along the block axis; every shard must hold whole blocks of 256."""
    sh = getattr(p, "sharding", None)
    if not isinstance(sh, jax.sharding.NamedSharding) or all(a is None for a in tuple(sh.spec)):
        return None
    spec = tuple(sh.spec)
    if any(a is not None for a in spec[1:]):
        raise ValueError(
            f"{where}: 8-bit optimizer state follows a parameter sharded along its first axis only; "
            f"got spec {sh.spec} for shape {p.shape}"
        )
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    shards = math.prod(sh.mesh.shape[a] for a in axes)
    if p.shape[0] % shards or (p.size // shards) % optim8.BLOCKSIZE:
        raise ValueError(
            f"{where}: each of the {shards} shards of a parameter of shape {p.shape} must hold whole blocks "
            f"of {optim8.BLOCKSIZE} elements (got {p.size / shards:g} elements per shard)"
        )
    return sh.mesh, sh.spec


def _sharded_step_8bit(mesh, spec, two: bool, *args, **kw):
    """_step_8bit on each shard (jax.shard_map): blocks never straddle shards, so the step
    is the unsharded one's; the skipped-block count is summed over the shards."""
    P = jax.sharding.PartitionSpec
    axes = spec[0]
    blocks = P(axes)
    rep = P()
    s2, a2 = (spec, blocks) if two else (rep, rep)
    in_specs = (spec, spec, spec, blocks, s2, a2, rep, rep, rep, rep)
    out_specs = (spec, spec, blocks, s2, a2, rep)

    def body(*local):
        out = _step_8bit(*local, **kw)
        return (*out[:5], jax.lax.psum(out[5], axes))

    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def _step_32bit(name, p, g, s1, s2, step, lr, b1, b2, eps, wd):
    """fp32 states in bitsandbytes' 32-bit CPU order (its optimizer_update_32bit)."""
    f32 = jnp.float32
    g = g.astype(f32)
    pf = p.astype(f32)
    stepf = step.astype(f32)
    if name == "adam":
        s1 = s1 * f32(b1) + g * f32(1.0 - b1)
        s2 = s2 * f32(b2) + g * g * f32(1.0 - b2)
        c1 = 1.0 - f32(b1) ** stepf
        c2 = jnp.sqrt(1.0 - f32(b2) ** stepf)
        if wd > 0.0:
            pf = pf * (1.0 - lr * wd)
        pf = pf + (s1 / (jnp.sqrt(s2) + f32(eps) * c2)) * (-lr * c2 / c1)
    elif name == "momentum":
        gw = g + pf * f32(wd) if wd > 0.0 else g
        s1 = jnp.where(step == 1, gw, s1 * f32(b1) + gw)
        pf = pf - lr * s1
    elif name == "lion":
        if wd > 0.0:
            pf = pf * (1.0 - lr * wd)
        pf = pf - lr * jnp.sign(s1 * f32(b1) + g * f32(1.0 - b1))
        s1 = s1 * f32(b2) + g * f32(1.0 - b2)
    else:
        gw = g + pf * f32(wd) if wd > 0.0 else g
        s1 = s1 * f32(b1) + gw * gw * f32(1.0 - b1)
        pf = pf - lr * gw / (jnp.sqrt(s1) + f32(eps))
    return pf.astype(p.dtype), s1, s2


def _optim8(
    name: str,
    learning_rate: ScalarOrSchedule,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    min_8bit_size: int,
):
    if not callable(learning_rate) and not learning_rate >= 0.0:
        raise ValueError(f"learning_rate must be >= 0 or a schedule, got {learning_rate!r}")
    for what, v in (("b1", b1), ("b2", b2)):
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{what} must be in [0, 1), got {v!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    two = name in optim8.TWO_STATE

    def eight(p) -> bool:
        return p.size >= max(1, min_8bit_size)

    shardings: dict[int, tuple] = {}  # leaf index -> (mesh, spec), recorded by init_fn

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        shardings.clear()
        for i, p in enumerate(leaves):
            placed = _leaf_sharding(p, f"{name}_8bit parameter {i}") if eight(p) else None
            if placed is not None:
                shardings[i] = placed
        ids = {id(p): i for i, p in enumerate(leaves)}

        def put(p, x, blocks: bool):
            placed = shardings.get(ids.get(id(p), -1))
            if placed is None:
                return x
            mesh, spec = placed
            target = jax.sharding.PartitionSpec(spec[0]) if blocks else spec
            return jax.device_put(x, jax.sharding.NamedSharding(mesh, target))

        def s(p):
            return put(p, jnp.zeros(p.shape, jnp.uint8 if eight(p) else jnp.float32), False)

        def a(p):
            return put(p, jnp.zeros((optim8.num_blocks(p.size),) if eight(p) else (0,), jnp.float32), True)

        return Optim8State(
            step=jnp.zeros((), jnp.int32),
            state1=jax.tree.map(s, params),
            absmax1=jax.tree.map(a, params),
            state2=jax.tree.map(s if two else lambda p: _empty(jnp.uint8), params),
            absmax2=jax.tree.map(a if two else lambda p: _empty(jnp.float32), params),
            qmap1=jnp.asarray(optim8.qmap(True)),
            qmap2=jnp.asarray(optim8.qmap(False)),
            skipped_blocks=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(f"{name}_8bit needs params: call tx.update(grads, state, params)")
        step = state.step + 1
        if callable(learning_rate):
            lr, lr_scale = 1.0, jnp.asarray(learning_rate(state.step), jnp.float32)
        else:
            lr, lr_scale = float(learning_rate), jnp.ones((), jnp.float32)
        leaves, treedef = jax.tree.flatten(params)
        grads = treedef.flatten_up_to(updates)
        s1, a1, s2, a2 = (treedef.flatten_up_to(t) for t in (state.state1, state.absmax1, state.state2, state.absmax2))
        new_u, n1, na1, n2, na2 = [], [], [], [], []
        skipped = jnp.zeros((), jnp.int32)
        for i, (p, g) in enumerate(zip(leaves, grads, strict=True)):
            if s1[i].dtype == jnp.uint8:
                args = (p, g, s1[i], a1[i], s2[i], a2[i], state.qmap1, state.qmap2, step, lr_scale)
                kw = dict(name=name, lr=lr, b1=b1, b2=b2, eps=eps, wd=weight_decay)
                if i in shardings:
                    u, x1, y1, x2, y2, sk = _sharded_step_8bit(*shardings[i], two, *args, **kw)
                else:
                    u, x1, y1, x2, y2, sk = _step_8bit(*args, **kw)
                skipped = skipped + sk[0]
                if not two:
                    x2, y2 = s2[i], a2[i]
            else:
                lr_now = lr * lr_scale
                new_p, x1, x2 = _step_32bit(name, p, g, s1[i], s2[i], step, lr_now, b1, b2, eps, weight_decay)
                y1, y2 = a1[i], a2[i]
                u = _update_for(p, new_p)
            new_u.append(u)
            n1.append(x1)
            na1.append(y1)
            n2.append(x2)
            na2.append(y2)
        unflat = treedef.unflatten
        new_state = Optim8State(
            step, unflat(n1), unflat(na1), unflat(n2), unflat(na2), state.qmap1, state.qmap2, skipped
        )
        return unflat(new_u), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    min_8bit_size: int = 4096,
) -> optax.GradientTransformation:
    """AdamW with 8-bit state: bitsandbytes' AdamW8bit (same defaults, same state bytes)."""
    return _optim8("adam", learning_rate, b1, b2, eps, weight_decay, min_8bit_size)


def adam_8bit(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    min_8bit_size: int = 4096,
) -> optax.GradientTransformation:
    """Adam with 8-bit state: bitsandbytes' Adam8bit (weight_decay > 0 decays decoupled, as there)."""
    return _optim8("adam", learning_rate, b1, b2, eps, weight_decay, min_8bit_size)


def lion_8bit(
    learning_rate: ScalarOrSchedule = 1e-4,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    min_8bit_size: int = 4096,
) -> optax.GradientTransformation:
    """Lion with 8-bit state: bitsandbytes' Lion8bit."""
    return _optim8("lion", learning_rate, b1, b2, 0.0, weight_decay, min_8bit_size)


def sgd_8bit(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    min_8bit_size: int = 4096,
) -> optax.GradientTransformation:
    """SGD with 8-bit momentum: bitsandbytes' SGD8bit (momentum > 0; dampening and
    nesterov are not applied, as there)."""
    if momentum == 0:
        raise ValueError("sgd_8bit needs momentum > 0 (bitsandbytes' SGD without momentum is not supported)")
    return _optim8("momentum", learning_rate, momentum, 0.0, 0.0, weight_decay, min_8bit_size)


def rmsprop_8bit(
    learning_rate: ScalarOrSchedule = 1e-2,
    decay: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    min_8bit_size: int = 4096,
) -> optax.GradientTransformation:
    """RMSprop with an 8-bit squared-gradient average: bitsandbytes' RMSprop8bit (``decay``
    is its ``alpha``, with its default 0.99; optax.rmsprop's default is 0.9). As there,
    no momentum and no centered variant; weight decay is added to the gradient."""
    if decay == 0:
        raise ValueError("rmsprop_8bit needs decay > 0 (bitsandbytes' RMSprop with alpha == 0 is not supported)")
    if not 0.0 < decay < 1.0:
        raise ValueError(f"rmsprop_8bit: decay must be in (0, 1), got {decay!r}")
    return _optim8("rmsprop", learning_rate, decay, 0.0, eps, weight_decay, min_8bit_size)
