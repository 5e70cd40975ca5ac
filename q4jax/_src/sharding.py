"""Quantized matmuls over a device mesh (SPMD): column-parallel, row-parallel
and replicated (data-parallel) layouts of 4-bit and 8-bit weights.

The q4 kernels are XLA custom calls with no partitioning rule: given sharded
operands, XLA would all-gather them and run the kernel on the whole weight on
every device. Each op here is a ``jax.shard_map`` over the whole mesh instead,
so every device runs the kernel on its own shard of the packed bytes and
scales, and the only collectives are the ones written below (a psum of
partial outputs for row-parallel; a pmax of row statistics / outlier columns
for 8-bit where LLM.int8 needs a whole-row or whole-batch quantity).

Layouts (W [n, k] = [out_features, in_features], S = size of the tensor axis):

- ``column``: output features split. The flat row-major weight gives each
  device a contiguous run of n/S rows, so the canonical arrays are placed as
  they are: packed [n*k/2, 1], absmax [n_blocks] (and nested_absmax) split on
  axis 0, SCB and bias split. Valid when (n/S)*k is a multiple of blocksize.
  Bit-exact with one device in the forward (each output element is the same
  kernel sum); the input gradient is a psum of S partial sums.
- ``row``: input features split. Packed bytes are viewed as [n, k/2] and
  absmax as [n, k/blocksize] (a reshape of the row-major bytes: the same
  bytes, so ``reshape(-1)`` gives the canonical arrays back) and split on
  axis 1; each device's slice is the packed matrix W[:, shard]. Valid when
  (k/S) is a multiple of blocksize. Partial outputs are computed in fp32,
  psum'd, then the bias is added once and the result rounded to x's dtype.
  The input gradient is bit-exact (the sum over n is not split).
  An int8 weight is stored as [n, S*(k/S + 1)]: each device's slice ends in a
  zero column. The kernel quantizes x row-wise with the row's absmax over
  *all* input features; each device appends that global value (a pmax of the
  local maxima) as an extra input column, so its local quantization equals
  the single-device one and the zero weight column makes the extra input
  contribute exactly nothing.
- ``replicated``: the weight on every device, only the batch split on the
  data axes (data parallelism).

Exactness: an int8 forward is bit-exact with one device in the column and
replicated layouts whatever the batch split (int32 accumulation); a 4-bit one
is when the batch is not split (the 4-bit kernel's blocking of its k-loop
depends on its batch size, so a smaller local batch reorders fp32 sums).
Row-parallel outputs and column-parallel input gradients sum S fp32 partials.

Nested statistics (``compress_statistics``) quantize absmax in groups of 256
consecutive blocks with one fp32 scale per group. A nested state can be split
only on group boundaries: column needs (n/S)*k/blocksize and row needs
(k/S)/blocksize to be multiples of 256. Otherwise ``unnest=True`` decodes the
absmax to fp32 when sharding (the same values the kernel decodes, so results
do not change; 3 more bytes per block); without it the request is an error.

Data axes split the leading dimension of x. LLM.int8 with a threshold picks
outlier columns over the whole batch; the data-parallel 8-bit op takes their
union over the data axes (a pmax) and gives every device a synthetic row that
marks those columns, so each shard zeroes the same columns as one device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from q4._src import formats
from q4jax._src import ffi
from q4jax._src.matmul import check_matmul_4bit
from q4jax._src.quant import QuantState, check_state, state_absmax

MODES = ("column", "row", "replicated")


@dataclasses.dataclass(frozen=True)
class LinearSharding:
    """How a quantized linear layer is split over ``mesh``.

    mode: "column" (output features split over ``axis``), "row" (input
    features split over ``axis``, partial outputs summed) or "replicated" (the
    weight on every device). data_axis: mesh axis name(s) that split the
    leading (batch) dimension of the input; None for none. unnest: allow
    decoding nested 4-bit statistics whose 256-block groups a shard boundary
    would split (see the module docstring). Hashable: a layer keeps it as a
    static attribute.
    """

    mesh: Mesh
    mode: str = "replicated"
    axis: str | None = None
    data_axis: str | tuple[str, ...] | None = None
    unnest: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        names = tuple(self.mesh.axis_names)
        data = self.data_axis
        if data is not None:
            data = (data,) if isinstance(data, str) else tuple(data)
            for a in data:
                if a not in names:
                    raise ValueError(f"unknown data axis {a!r}: the mesh axes are {names}")
            if len(set(data)) != len(data):
                raise ValueError(f"data_axis names a mesh axis twice: {data}")
            object.__setattr__(self, "data_axis", data if data else None)
        if self.mode == "replicated":
            if self.axis is not None:
                raise ValueError(f"a replicated layer has no tensor-parallel axis, got axis={self.axis!r}")
        else:
            if self.axis is None:
                raise ValueError(f"{self.mode}-parallel needs a mesh axis (axis=...), the mesh axes are {names}")
            if self.axis not in names:
                raise ValueError(f"unknown mesh axis {self.axis!r} for {self.mode}-parallel: the mesh axes are {names}")
            if data is not None and self.axis in data:
                raise ValueError(
                    f"mesh axis {self.axis!r} cannot split both the features ({self.mode}-parallel) and the batch "
                    f"(data_axis={data})"
                )
        object.__setattr__(self, "unnest", bool(self.unnest))

    @property
    def layout(self) -> str:
        """The mode the arrays are laid out and run in: a tensor axis of size 1
        splits nothing, so column / row over it are the replicated layout."""
        return self.mode if self.size > 1 else "replicated"

    @property
    def size(self) -> int:
        """Number of feature shards (1 for replicated)."""
        return 1 if self.axis is None else int(self.mesh.shape[self.axis])

    @property
    def data_size(self) -> int:
        """Number of batch shards."""
        return math.prod(int(self.mesh.shape[a]) for a in self.data_axis or ())

    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def _data_entry(self):
        d = self.data_axis
        return None if d is None else (d[0] if len(d) == 1 else d)

    def x_spec(self, ndim: int) -> P:
        """PartitionSpec of an input [..., k]: batch on the data axes, features on
        the tensor axis for row-parallel."""
        last = self.axis if self.layout == "row" else None
        if ndim == 1:
            return P(last)
        return P(self._data_entry(), *([None] * (ndim - 2)), last)

    def y_spec(self, ndim: int) -> P:
        """PartitionSpec of the output [..., n]."""
        last = self.axis if self.layout == "column" else None
        if ndim == 1:
            return P(last)
        return P(self._data_entry(), *([None] * (ndim - 2)), last)

    def bias_spec(self) -> P:
        return P(self.axis) if self.layout == "column" else P()


def _check_sharding(sharding) -> LinearSharding:
    if not isinstance(sharding, LinearSharding):
        raise TypeError(f"sharding must be a q4jax.LinearSharding, got {type(sharding).__name__}")
    return sharding


def check_features(sharding: LinearSharding, n: int, k: int) -> None:
    """out_features n (column-parallel) or in_features k (row-parallel) must
    divide evenly over the tensor axis (ValueError naming the count)."""
    s = sharding.size
    if sharding.layout == "column" and n % s:
        raise ValueError(
            f"out_features {n} is not divisible by {s}, the size of mesh axis {sharding.axis!r} (column-parallel)"
        )
    if sharding.layout == "row" and k % s:
        raise ValueError(
            f"in_features {k} is not divisible by {s}, the size of mesh axis {sharding.axis!r} (row-parallel)"
        )


def check_4bit(sharding: LinearSharding, shape: tuple[int, ...], blocksize: int, nested: bool) -> bool:
    """Validate a 4-bit weight of ``shape`` for ``sharding``; raises ValueError
    naming the offending value. Returns whether nested statistics must be
    decoded to fp32 (only when ``sharding.unnest`` allows it)."""
    _check_sharding(sharding)
    if len(shape) != 2:
        raise ValueError(f"a sharded 4-bit weight must be 2-D (out_features, in_features), got shape {tuple(shape)}")
    n, k = (int(d) for d in shape)
    check_features(sharding, n, k)
    s, nb2 = sharding.size, formats.nested_blocksize()
    if sharding.layout == "column":
        per = (n // s) * k
        what, holder = f"a shard holds {n // s} rows x {k} = {per} elements", "a shard holds"
    elif sharding.layout == "row":
        per = k // s
        what, holder = f"each row's slice holds {k} / {s} = {per} elements", "each row's slice holds"
    else:
        return False
    if per % blocksize:
        raise ValueError(
            f"{sharding.layout}-parallel over {s} shards puts a shard boundary inside a block: {what}, "
            f"not a multiple of blocksize {blocksize}"
        )
    groups_ok = (per // blocksize) % nb2 == 0
    where = f"{holder} {per // blocksize} blocks"
    if not nested or groups_ok:
        return False
    if not sharding.unnest:
        raise ValueError(
            f"nested statistics cannot be split for {sharding.mode}-parallel over {s} shards: {where}, not a "
            f"multiple of the {nb2}-block nested groups; pass unnest=True to decode absmax to fp32 when sharding "
            "(exact, 4 bytes per block instead of 1), or use compress_statistics=False"
        )
    return True


def check_8bit(sharding: LinearSharding, shape: tuple[int, ...]) -> None:
    """Validate an int8 weight of ``shape`` for ``sharding`` (ValueError naming the value)."""
    _check_sharding(sharding)
    if len(shape) != 2:
        raise ValueError(f"a sharded int8 weight must be 2-D (out_features, in_features), got shape {tuple(shape)}")
    check_features(sharding, int(shape[0]), int(shape[1]))


# ------------------------------------------------------------------ placement


def _gathered(a):
    """`a` as an array on at most one device (a sharded array is copied to the host),
    so layout changes never depend on how it was placed before."""
    if a is None:
        return None
    if isinstance(a, jax.Array) and len(a.sharding.device_set) > 1:
        return np.asarray(a)
    return a


def _unplaced(a):
    """A single-device (uncommitted) copy of a possibly sharded array."""
    return None if a is None else jnp.asarray(np.asarray(a))


def _specs_4bit(sharding: LinearSharding) -> tuple[P, P, P, P]:
    """PartitionSpecs of (packed, absmax, nested_absmax, nested_offset) in the layout."""
    if sharding.layout == "column":
        return P(sharding.axis, None), P(sharding.axis), P(sharding.axis), P()
    if sharding.layout == "row":
        return P(None, sharding.axis), P(None, sharding.axis), P(None, sharding.axis), P()
    return P(None, None), P(None), P(None), P()


def _shapes_4bit(sharding: LinearSharding, state: QuantState, nested: bool):
    """Array shapes of (packed, absmax, nested_absmax) in the layout."""
    n, k = state.shape
    nb = formats.num_blocks(n * k, state.blocksize)
    n2 = formats.num_blocks(nb, formats.nested_blocksize()) if nested else None
    if sharding.layout == "row":
        kb = k // state.blocksize
        return (n, k // 2), (n, kb), None if n2 is None else (n, n2 // n)
    return (formats.packed_bytes(n * k), 1), (nb,), None if n2 is None else (n2,)


def shard_4bit(packed: jax.Array, state: QuantState, sharding: LinearSharding) -> tuple[jax.Array, QuantState]:
    """Lay out a canonical 4-bit weight (``quantize_4bit``'s packed bytes and
    state) for ``sharding`` and place it on the mesh. Validates first
    (``check_4bit``); the result is what ``sharded_matmul_4bit`` takes.
    ``unshard_4bit`` gives the canonical arrays back."""
    check_state(packed, state)
    decode = check_4bit(sharding, state.shape, state.blocksize, state.nested)
    state = jax.tree.map(lambda a: jnp.asarray(_gathered(a)), state)
    packed = jnp.reshape(jnp.asarray(_gathered(packed)), (-1, 1))
    if decode:
        state = dataclasses.replace(state, absmax=state_absmax(state), nested_absmax=None, nested_offset=None)
    sp, sa, sn, so = _specs_4bit(sharding)
    shp, sha, shn = _shapes_4bit(sharding, state, state.nested)

    def place(a, shape, spec):
        return jax.device_put(jnp.reshape(a, shape), sharding.named(spec))

    out = QuantState(
        place(state.absmax, sha, sa),
        None if shn is None else place(state.nested_absmax, shn, sn),
        None if shn is None else place(state.nested_offset, (), so),
        state.quant_type,
        state.blocksize,
        tuple(state.shape),
        state.dtype,
    )
    return place(packed, shp, sp), out


def unshard_4bit(packed: jax.Array, state: QuantState) -> tuple[jax.Array, QuantState]:
    """The canonical arrays (packed [n*k/2, 1], flat absmax) of a weight in any
    4-bit layout, on one device. A state decoded by ``unnest`` stays decoded."""
    packed = _unplaced(packed).reshape(-1, 1)
    state = jax.tree.map(lambda a: _unplaced(a).reshape(-1), state)
    if state.nested:
        offset: Any = state.nested_offset
        state = dataclasses.replace(state, nested_offset=offset.reshape(()))
    return packed, state


def _shape_8bit(sharding: LinearSharding, n: int, k: int) -> tuple[int, int]:
    if sharding.layout == "row":
        return n, k + sharding.size
    return n, k


def shard_8bit(weight: jax.Array, scale: jax.Array, sharding: LinearSharding) -> tuple[jax.Array, jax.Array]:
    """Lay out an int8 weight CB [n, k] and its row scales SCB [n] for
    ``sharding`` and place them (row-parallel appends a zero column to each
    device's slice: [n, S*(k/S + 1)]). ``unshard_8bit`` undoes it."""
    if weight.dtype != jnp.int8 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D int8 array (CB), got {weight.dtype} with shape {tuple(weight.shape)}")
    n, k = weight.shape
    if scale.shape != (n,) or scale.dtype != jnp.float32:
        raise ValueError(f"weight_scale must be float32 of shape ({n},), got {scale.dtype} {tuple(scale.shape)}")
    check_8bit(sharding, (n, k))
    w, s = jnp.asarray(_gathered(weight)), jnp.asarray(_gathered(scale))
    if sharding.layout == "column":
        return jax.device_put(w, sharding.named(P(sharding.axis, None))), jax.device_put(
            s, sharding.named(P(sharding.axis))
        )
    if sharding.layout == "row":
        ns = sharding.size
        w = jnp.pad(w.reshape(n, ns, k // ns), ((0, 0), (0, 0), (0, 1))).reshape(n, ns * (k // ns + 1))
        return jax.device_put(w, sharding.named(P(None, sharding.axis))), jax.device_put(s, sharding.named(P()))
    return jax.device_put(w, sharding.named(P())), jax.device_put(s, sharding.named(P()))


def unshard_8bit(weight: jax.Array, scale: jax.Array, sharding: LinearSharding) -> tuple[jax.Array, jax.Array]:
    """The canonical CB [n, k] and SCB [n] on one device."""
    w, s = _unplaced(weight), _unplaced(scale)
    if _check_sharding(sharding).layout == "row":
        ns = sharding.size
        n, kp = w.shape
        w = w.reshape(n, ns, kp // ns)[:, :, :-1].reshape(n, kp - ns)
    return w, s


def place_bias(bias: jax.Array | None, sharding: LinearSharding | None) -> jax.Array | None:
    """The bias placed for ``sharding`` (split for column-parallel, else
    replicated); None: back on one device."""
    if bias is None:
        return None
    if sharding is None:
        return _unplaced(bias)
    check_features(sharding, int(bias.shape[0]), 0)
    return jax.device_put(_gathered(bias), sharding.named(sharding.bias_spec()))


# ------------------------------------------------------------------ ops
#
# Each op is a jax.custom_vjp whose forward and backward are each one
# shard_map over the whole mesh, with their collectives written out: the
# forward psums row-parallel partial outputs; the backward psums
# column-parallel partial input gradients and needs nothing else (the
# row-parallel input gradient and the replicated one are local). Autodiff
# never transposes a shard_map, so no collective is added that the math does
# not need. Bias gradients are plain jnp sums over the (sharded) cotangent,
# partitioned by XLA.


def _check_placed(name: str, a, want: NamedSharding) -> None:
    """A concrete array placed with a NamedSharding must be placed as the layout
    needs (a tracer's placement is jit's business: it reshards)."""
    if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
        return
    have = a.sharding
    if isinstance(have, NamedSharding) and not have.is_equivalent_to(want, a.ndim):
        raise ValueError(
            f"{name} is placed as {have.spec} over mesh axes {dict(have.mesh.shape)}, but this layout needs "
            f"{want.spec} over {dict(want.mesh.shape)}: place it with q4jax.shard_4bit / shard_8bit for this sharding"
        )


def _check_batch(sharding: LinearSharding, x) -> None:
    d = sharding.data_size
    if x.ndim >= 2 and x.shape[0] % d:
        raise ValueError(
            f"the batch dimension of x (shape {tuple(x.shape)}) is {x.shape[0]}, not divisible by {d}, the size of "
            f"data axes {sharding.data_axis}"
        )


def _shard_map(sharding: LinearSharding, body, in_specs, out_spec):
    # check_vma=False: the FFI results carry no varying-axes type. Nothing
    # here is differentiated through shard_map (see above), so the unchecked
    # mode only skips the type check.
    return jax.shard_map(body, mesh=sharding.mesh, in_specs=tuple(in_specs), out_specs=out_spec, check_vma=False)


def _local_shape(sharding: LinearSharding, n: int, k: int) -> tuple[int, int]:
    s = sharding.size
    return {"column": (n // s, k), "row": (n, k // s), "replicated": (n, k)}[sharding.layout]


def _dbias(g, marker):
    if marker is None:
        return None
    return jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - 1))).astype(marker.dtype)


def _conform(a, sharding: LinearSharding, spec: P):
    """On a mesh with Explicit axes, shard_map requires each operand's sharding
    type to equal its in_spec: reshard to it (a no-op when it already is). On
    Auto axes the partitioner reshards by itself."""
    explicit = {
        n for n, t in zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not explicit:
        return a

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n in explicit)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return jax.reshard(a, sharding.named(P(*(keep(e) for e in spec))))


# -- 4-bit


def _weights_4bit(sharding: LinearSharding, packed, state: QuantState):
    """(arrays, PartitionSpecs) of the weight operands in the layout."""
    sp, sa, sn, so = _specs_4bit(sharding)
    if state.nested:
        return [packed, state.absmax, state.nested_absmax, state.nested_offset], [sp, sa, sn, so]
    return [packed, state.absmax], [sp, sa]


def _local_4bit(packed, absmax, *nested):
    """The kernel operands of one device's shard, in canonical flat shapes:
    (packed [bytes, 1], absmax, nested_absmax or None, nested_offset or None)."""
    na, no = nested if nested else (None, None)
    return packed.reshape(-1, 1), absmax.reshape(-1), None if na is None else na.reshape(-1), no


def _forward_4bit(sharding: LinearSharding, x, packed, state: QuantState, bias):
    n, k = state.shape
    local = _local_shape(sharding, n, k)
    weights, specs = _weights_4bit(sharding, packed, state)
    nw, row = len(weights), sharding.layout == "row"
    bs, qt = state.blocksize, state.quant_type

    def body(x, *args):
        p, a, na, no = _local_4bit(*args[:nw])
        b = args[nw] if len(args) > nw else None
        if not row:
            return ffi.gemm_4bit_raw(x, p, a, na, no, b, *local, bs, qt, x.dtype)
        y = ffi.gemm_4bit_raw(x.astype(jnp.float32), p, a, na, no, None, *local, bs, qt, jnp.float32)
        return jax.lax.psum(y, sharding.axis)

    args, in_specs = [x, *weights], [sharding.x_spec(x.ndim), *specs]
    if bias is not None:
        args.append(bias)
        in_specs.append(sharding.bias_spec())
    return _shard_map(sharding, body, in_specs, sharding.y_spec(x.ndim))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sharded_4bit(sharding, x, packed, state, bias):
    return _forward_4bit(sharding, x, packed, state, bias)


def _sharded_4bit_fwd(sharding, x, packed, state, bias):
    """Residuals: the packed shards and their state (never a dequantized
    weight), a bias-is-present marker and x's dtype."""
    y = _forward_4bit(sharding, x, packed, state, bias)
    return y, (packed, state, None if bias is None else jnp.zeros((), bias.dtype), jnp.zeros((), x.dtype))


def _sharded_4bit_bwd(sharding, res, g):
    packed, state, bias_marker, x_marker = res
    n, k = state.shape
    local = _local_shape(sharding, n, k)
    weights, specs = _weights_4bit(sharding, packed, state)
    bs, qt = state.blocksize, state.quant_type
    column = sharding.layout == "column"

    def body(g, *args):
        p, a, na, no = _local_4bit(*args)
        if not column:
            return ffi.gemm_4bit_grad_input_raw(g, p, a, na, no, *local, bs, qt, x_marker.dtype)
        dx = ffi.gemm_4bit_grad_input_raw(g, p, a, na, no, *local, bs, qt, jnp.float32)
        return jax.lax.psum(dx, sharding.axis).astype(x_marker.dtype)

    g = _conform(g, sharding, sharding.y_spec(g.ndim))
    dx = _shard_map(sharding, body, [sharding.y_spec(g.ndim), *specs], sharding.x_spec(g.ndim))(g, *weights)
    return dx, jnp.zeros_like(packed), jax.tree.map(jnp.zeros_like, state), _dbias(g, bias_marker)


_sharded_4bit.defvjp(_sharded_4bit_fwd, _sharded_4bit_bwd)


def _with_bias_f32(y, bias, dtype):
    """Row-parallel epilogue: fp32 partial sums + bias once, rounded to dtype
    (what the kernel does on one device)."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def sharded_matmul_4bit(
    x: jax.Array,
    packed: jax.Array,
    state: QuantState,
    sharding: LinearSharding,
    bias: jax.Array | None = None,
) -> jax.Array:
    """``matmul_4bit`` over a mesh: x . dequantize(W)^T (+ bias) with W's
    arrays in ``sharding``'s layout (``shard_4bit``) and bias placed by
    ``place_bias``.

    Each device runs the fused kernel on its own shard (no all-gather of the
    weight). The input x is split on the data axes (and on features for
    row-parallel); the output is split on the data axes (and on features for
    column-parallel). Gradients flow to x and bias.

    Equal to ``matmul_4bit`` on one device: bit for bit in the forward of
    column-parallel and replicated layers and in the row-parallel input
    gradient, as long as the batch is not split (the kernel's summation order
    depends on its batch size); otherwise within fp32 reordering of sums (the
    S partial outputs of row-parallel, the S partial input gradients of
    column-parallel, the kernel's blocking for a smaller local batch).
    """
    _check_sharding(sharding)
    check_matmul_4bit(x, packed, state, bias)
    if check_4bit(sharding, state.shape, state.blocksize, state.nested):
        raise ValueError(
            f"this nested state is in the canonical layout; {sharding.mode}-parallel needs it decoded: "
            "lay it out with q4jax.shard_4bit first"
        )
    _check_batch(sharding, x)
    shp, sha, shn = _shapes_4bit(sharding, state, state.nested)
    for name, a, want in (
        ("packed", packed, shp),
        ("absmax", state.absmax, sha),
        ("nested_absmax", state.nested_absmax, shn),
    ):
        if a is not None and tuple(a.shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(a.shape)}, the {sharding.layout} layout of a {tuple(state.shape)} weight "
                f"needs {want}: lay it out with q4jax.shard_4bit"
            )
    weights, specs = _weights_4bit(sharding, packed, state)
    for name, a, spec in zip(("packed", "absmax", "nested_absmax", "nested_offset"), weights, specs, strict=False):
        _check_placed(name, a, sharding.named(spec))
    x = _conform(x, sharding, sharding.x_spec(x.ndim))
    if sharding.layout == "row":
        return _with_bias_f32(_sharded_4bit(sharding, x, packed, state, None), bias, x.dtype)
    return _sharded_4bit(sharding, x, packed, state, bias)


# -- 8-bit


def _cut(threshold: float, dtype) -> float:
    """The kernel's outlier cut: threshold rounded to x's dtype (exact in fp32)."""
    return float(np.asarray(threshold, np.float32).astype(jnp.dtype(dtype)).astype(np.float32))


def _specs_8bit(sharding: LinearSharding) -> tuple[P, P]:
    if sharding.layout == "column":
        return P(sharding.axis, None), P(sharding.axis)
    if sharding.layout == "row":
        return P(None, sharding.axis), P()
    return P(), P()


def _forward_8bit(sharding: LinearSharding, threshold: float, x, weight, scale, bias):
    row = sharding.layout == "row"
    cut = _cut(threshold, x.dtype) if threshold > 0 else None
    synth = cut is not None and sharding.data_size > 1 and x.ndim >= 2
    data_axes = sharding.data_axis

    def body(x, w, scb, *rest):
        b = rest[0] if rest else None
        lead, kl = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, kl)
        m = x2.shape[0]
        if synth:
            # one more row holding `cut` in every column that is an outlier
            # column anywhere in the batch, so this shard zeroes those too
            xc = jax.lax.stop_gradient(x2)
            local = jnp.any(jnp.abs(xc) >= jnp.asarray(cut, x.dtype), axis=0).astype(jnp.int32)
            flags = jax.lax.pmax(local, data_axes)
            marker = jnp.where(flags > 0, jnp.asarray(cut, x.dtype), jnp.zeros((), x.dtype))
            x2 = jnp.concatenate([x2, marker[None, :]], axis=0)
        if not row:
            y = ffi.int8_linear_raw(x2, w, scb, b, threshold, x.dtype)
        else:
            # one more column holding the row's absmax over all input
            # features (outlier elements excluded, NaN kept), facing the zero
            # weight column: the kernel's row statistics become global
            x32 = x2.astype(jnp.float32)
            a = jnp.abs(jax.lax.stop_gradient(x32))
            if cut is not None:
                a = jnp.where(a >= cut, 0.0, a)
            stat = jax.lax.pmax(jnp.max(a, axis=1), sharding.axis)
            x32 = jnp.concatenate([x32, stat[:, None]], axis=1)
            y = ffi.int8_linear_raw(x32, w, scb, None, 0.0 if cut is None else cut, jnp.float32)
            y = jax.lax.psum(y, sharding.axis)
        return y[:m].reshape(*lead, y.shape[-1])

    w_spec, s_spec = _specs_8bit(sharding)
    args, in_specs = [x, weight, scale], [sharding.x_spec(x.ndim), w_spec, s_spec]
    if bias is not None:
        args.append(bias)
        in_specs.append(sharding.bias_spec())
    return _shard_map(sharding, body, in_specs, sharding.y_spec(x.ndim))(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sharded_8bit(sharding, threshold, x, weight, scale, bias):
    return _forward_8bit(sharding, threshold, x, weight, scale, bias)


def _sharded_8bit_fwd(sharding, threshold, x, weight, scale, bias):
    """Residuals: the int8 shards and their scales (never a dequantized copy)."""
    y = _forward_8bit(sharding, threshold, x, weight, scale, bias)
    return y, (weight, scale, None if bias is None else jnp.zeros((), bias.dtype), jnp.zeros((), x.dtype))


def _sharded_8bit_bwd(sharding, threshold, res, g):
    weight, scale, bias_marker, x_marker = res
    mode = sharding.layout

    def body(g, w, scb):
        if mode == "replicated":
            return ffi.int8_grad_input_raw(g, w, scb, x_marker.dtype)
        if mode == "row":
            return ffi.int8_grad_input_raw(g, w, scb, x_marker.dtype)[..., :-1]  # drop the statistics column
        dx = ffi.int8_grad_input_raw(g, w, scb, jnp.float32)
        return jax.lax.psum(dx, sharding.axis).astype(x_marker.dtype)

    w_spec, s_spec = _specs_8bit(sharding)
    g = _conform(g, sharding, sharding.y_spec(g.ndim))
    dx = _shard_map(sharding, body, [sharding.y_spec(g.ndim), w_spec, s_spec], sharding.x_spec(g.ndim))(
        g, weight, scale
    )
    return dx, jnp.zeros_like(weight), jnp.zeros_like(scale), _dbias(g, bias_marker)


_sharded_8bit.defvjp(_sharded_8bit_fwd, _sharded_8bit_bwd)


def sharded_matmul_8bit(
    x: jax.Array,
    weight: jax.Array,
    weight_scale: jax.Array,
    sharding: LinearSharding,
    bias: jax.Array | None = None,
    threshold: float = 0.0,
) -> jax.Array:
    """``matmul_8bit`` (LLM.int8) over a mesh, with CB / SCB in ``sharding``'s
    layout (``shard_8bit``) and bias placed by ``place_bias``.

    The input is quantized with each row's absmax over all input features and,
    with ``threshold`` > 0, the outlier columns of the whole batch, as on one
    device: row-parallel takes a pmax of the row statistics over the tensor
    axis; a batch split on data axes takes the union (pmax) of outlier columns
    over them. Column-parallel and replicated are then bit-exact with
    ``matmul_8bit`` in the forward (int32 accumulation, whatever the batch
    split) and so is the row-parallel input gradient; row-parallel outputs and
    column-parallel input gradients sum S fp32 partials. Gradients flow to x
    and bias.
    """
    _check_sharding(sharding)
    if weight.dtype != jnp.int8 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D int8 array (CB), got {weight.dtype} with shape {tuple(weight.shape)}")
    n = weight.shape[0]
    k = x.shape[-1] if x.ndim else 0
    check_8bit(sharding, (n, k))
    want = _shape_8bit(sharding, n, k)
    if tuple(weight.shape) != want:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)}, the {sharding.layout} layout for x with {k} features needs "
            f"{want}: lay it out with q4jax.shard_8bit"
        )
    if weight_scale.shape != (n,) or weight_scale.dtype != jnp.float32:
        raise ValueError(f"weight_scale must be float32 of shape ({n},), got {weight_scale.dtype} {weight_scale.shape}")
    ffi.dtype_name(x.dtype)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    formats.check_threshold(threshold)
    _check_batch(sharding, x)
    w_spec, s_spec = _specs_8bit(sharding)
    _check_placed("weight", weight, sharding.named(w_spec))
    _check_placed("weight_scale", weight_scale, sharding.named(s_spec))
    threshold = float(threshold)
    x = _conform(x, sharding, sharding.x_spec(x.ndim))
    if sharding.layout == "row":
        return _with_bias_f32(_sharded_8bit(sharding, threshold, x, weight, weight_scale, None), bias, x.dtype)
    return _sharded_8bit(sharding, threshold, x, weight, weight_scale, bias)


__all__ = [
    "LinearSharding",
    "check_4bit",
    "check_8bit",
    "check_features",
    "place_bias",
    "shard_4bit",
    "shard_8bit",
    "sharded_matmul_4bit",
    "sharded_matmul_8bit",
    "unshard_4bit",
    "unshard_8bit",
]
