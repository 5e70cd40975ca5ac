"""8-bit optimizers with bitsandbytes' names, arguments, defaults and state format.

The 8-bit step is one fused native kernel per parameter (kernels/include/q4/optim8.h):
per block of 256 elements it decodes the uint8 states, updates the parameter and
the states in fp32 and re-quantizes the states. The state is bitsandbytes 0.50.2's:
``state1`` / ``state2`` uint8 codes shaped like the parameter, ``qmap1`` (signed
dynamic map) / ``qmap2`` (unsigned, Adam only), ``absmax1`` / ``absmax2`` fp32 per
block, ``step``; so an optimizer state_dict saved by bitsandbytes loads here and one
saved here loads into bitsandbytes, and after the same steps on the same gradients
the state bytes are identical (the parameters too, except that Adam's and RMSprop's
square root is correctly rounded here and PyTorch's is not always: those can differ
in the last place).

Parameters with fewer than ``min_8bit_size`` elements, and optimizers built with
``optim_bits=32`` (or overridden per parameter through GlobalOptimManager), keep fp32
states updated with PyTorch ops in bitsandbytes' CPU order.

A block whose gradient holds a NaN or an infinity is not updated (parameter and
8-bit state unchanged: a non-finite gradient never reaches the state; with fp32
state the whole parameter is left unchanged); after the step, ``step()`` raises
FloatingPointError naming each such parameter and its block count. (bitsandbytes quantizes the NaN into its state, which then decodes
as a large negative value at the next step.)
"""

from __future__ import annotations

import math
from collections import abc as container_abcs
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from q4._src import optim8
from q4torch._src import ops

_QUANT_KEYS = ("qmap1", "qmap2", "state1", "state2", "absmax1", "absmax2", "gnorm_vec", "unorm_vec")
# bitsandbytes' state_dict keeps its quantization tensors under this key
_WRAPPED = "__bnb_optimizer_quant_state__"


class GlobalOptimManager:
    """Per-parameter overrides of the optimizer config (bitsandbytes' API).

    ``GlobalOptimManager.get_instance().override_config(model.fc1.weight, "optim_bits", 32)``
    keeps that parameter's state in fp32; any config key (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ``optim_bits``, ``min_8bit_size``, ``percentile_clipping``) can be
    overridden. ``register_module_override(module, "weight", config)`` does the same for a
    module's parameter (StableEmbedding registers ``{"optim_bits": 32}`` for its weight).
    """

    _instance: GlobalOptimManager | None = None

    def __init__(self) -> None:
        raise RuntimeError("Call get_instance() instead")

    def initialize(self) -> None:
        self.pid2config: dict[int, dict] = {}
        self.index2config: dict[tuple[int, int], dict] = {}
        self.optimizer = None
        self.uses_config_override = False
        self.module_weight_config_triple: list[tuple[torch.nn.Module, str, dict]] = []

    @classmethod
    def get_instance(cls) -> GlobalOptimManager:
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params) -> None:
        param_groups = list(params)
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        for group_index, group in enumerate(param_groups):
            for p_index, p in enumerate(group["params"]):
                if id(p) in self.pid2config:
                    self.index2config[(group_index, p_index)] = self.pid2config[id(p)]

    def override_config(self, parameters, key=None, value=None, key_value_dict=None) -> None:
        self.uses_config_override = True
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if key is not None and value is not None:
            if key_value_dict is not None:
                raise ValueError("pass either key and value or key_value_dict, not both")
            key_value_dict = {key: value}
        if key_value_dict is not None:
            for p in parameters:
                self.pid2config.setdefault(id(p), {}).update(key_value_dict)

    def register_module_override(self, module, param_name: str, config: dict) -> None:
        self.module_weight_config_triple.append((module, param_name, config))


class Optimizer8bit(torch.optim.Optimizer):
    """Base class: bitsandbytes' Optimizer1State / Optimizer2State on q4's kernel."""

    def __init__(
        self,
        optimizer_name: str,
        params,
        lr: float,
        betas: tuple,
        eps: float,
        weight_decay: float,
        optim_bits: int,
        args=None,
        min_8bit_size: int = 4096,
        percentile_clipping: int = 100,
        block_wise: bool = True,
        max_unorm: float = 0.0,
        skip_zeros: bool = False,
        is_paged: bool = False,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if isinstance(betas, str):  # bitsandbytes accepts '(beta1, beta2)'
            betas = tuple(float(b) for b in betas.replace("(", "").replace(")", "").strip().split(","))
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits!r}")
        if not block_wise:
            raise ValueError(
                "block_wise=False (one absmax per tensor) is not supported: q4's 8-bit states are "
                "blockwise (256 elements per absmax), as bitsandbytes 0.50.2's"
            )
        if not 0 < percentile_clipping <= 100:
            raise ValueError(f"percentile_clipping must be in (0, 100], got {percentile_clipping!r}")
        if max_unorm != 0.0:
            raise ValueError(f"max_unorm (LAMB/LARS update clipping) is not supported, got {max_unorm!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.optimizer_name = optimizer_name
        self.is_paged = is_paged
        self.initialized = False
        self.mng = GlobalOptimManager.get_instance()
        self.non_castable_tensor_keys = set(_QUANT_KEYS)
        if args is None:
            args = dict(
                optim_bits=optim_bits,
                min_8bit_size=min_8bit_size,
                percentile_clipping=percentile_clipping,
                block_wise=block_wise,
                max_unorm=max_unorm,
                skip_zeros=skip_zeros,
            )
        else:
            args = dict(vars(args)) if not isinstance(args, dict) else dict(args)
        self.args = args
        self._qmaps: dict[tuple[str, torch.device], torch.Tensor] = {}

    # ---------------------------------------------------------------- config

    def _qmap(self, signed: bool, device: torch.device) -> torch.Tensor:
        key = ("dynamic" if signed else "udynamic", device)
        if key not in self._qmaps:
            self._qmaps[key] = torch.from_numpy(optim8.qmap(signed).copy()).to(device)
        return self._qmaps[key]

    def check_overrides(self) -> None:
        for module, attr, config in self.mng.module_weight_config_triple:
            target = getattr(module, attr)
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p is target:
                        self.mng.pid2config[id(p)] = config
                        self.mng.index2config[(gindex, pindex)] = config

    def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
        config = dict(
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            lr=group["lr"],
            optim_bits=self.args["optim_bits"],
            min_8bit_size=self.args["min_8bit_size"],
            percentile_clipping=self.args.get("percentile_clipping", 100),
        )
        config.update(self.mng.index2config.get((gindex, pindex), {}))
        config.update(self.mng.pid2config.get(id(self.param_groups[gindex]["params"][pindex]), {}))
        return config

    # ----------------------------------------------------------------- state

    def _two_states(self) -> bool:
        return self.optimizer_name in optim8.TWO_STATE

    @torch.no_grad()
    def init_state(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        config = self.get_config(gindex, pindex, group)
        if config["optim_bits"] not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {config['optim_bits']!r}")
        eight = config["optim_bits"] == 8 and p.numel() >= max(1, config["min_8bit_size"])
        state = self.state[p]
        state["step"] = 0
        names = ("1", "2") if self._two_states() else ("1",)
        for i in names:
            if eight:
                state["state" + i] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                state["qmap" + i] = self._qmap(i == "1", p.device)
                state["absmax" + i] = torch.zeros(optim8.num_blocks(p.numel()), dtype=torch.float32, device=p.device)
            else:
                state["state" + i] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if config["percentile_clipping"] < 100:
            state["gnorm_vec"] = torch.zeros(100, device=p.device)

    def _check_state(self, p: torch.Tensor, state: dict, where: str, maps: bool = True) -> None:
        """A loaded state must have this parameter's shapes, dtypes and (maps) sorted maps."""
        if "state1" not in state:
            raise ValueError(f"{where}: the optimizer state has no 'state1' (keys {sorted(state)})")
        names = ("1", "2") if self._two_states() else ("1",)
        eight = state["state1"].dtype == torch.uint8
        for i in names:
            s = state.get("state" + i)
            want = torch.uint8 if eight else torch.float32
            if not isinstance(s, torch.Tensor) or s.dtype != want or s.shape != p.shape:
                got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else repr(s)
                raise ValueError(
                    f"{where}: state{i} must be {want} of the parameter's shape {tuple(p.shape)}, got {got}"
                )
            if not eight:
                continue
            a, q = state.get("absmax" + i), state.get("qmap" + i)
            blocks = optim8.num_blocks(p.numel())
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or a.numel() != blocks:
                got = f"{a.dtype} {tuple(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)
                raise ValueError(f"{where}: absmax{i} must be float32 with {blocks} blocks of 256, got {got}")
            if not isinstance(q, torch.Tensor) or q.dtype != torch.float32 or q.numel() != 256:
                got = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else repr(q)
                raise ValueError(f"{where}: qmap{i} must be 256 float32 values, got {got}")
            qc = q.detach().cpu() if maps else None
            if qc is not None and not bool((qc[1:] >= qc[:-1]).all()):
                raise ValueError(f"{where}: qmap{i} must be sorted ascending without NaN")
        step = state.get("step")
        if not isinstance(step, int | float) and not (isinstance(step, torch.Tensor) and step.numel() == 1):
            raise ValueError(f"{where}: step must be a number, got {step!r}")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every parameter with a gradient. Raises FloatingPointError
        after the step if a gradient held NaN or inf (those blocks, or for fp32 state
        those parameters, were left unchanged)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.initialized:
            self.check_overrides()
            self.initialized = True
        skipped: list[str] = []
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.init_state(group, p, gindex, pindex)
                n = self.update_step(group, p, gindex, pindex)
                if n:
                    what = "all of it (fp32 state)" if n < 0 else f"{n} of {optim8.num_blocks(p.numel())} blocks"
                    skipped.append(f"group {gindex} parameter {pindex} (shape {tuple(p.shape)}): {what}")
        if skipped:
            raise FloatingPointError(
                "non-finite gradient (NaN or inf): the blocks of 256 elements holding one were left unchanged "
                "(parameter and optimizer state), the rest of the step was applied: " + "; ".join(skipped)
            )
        return loss

    def _gnorm_scale(self, state: dict, grad: torch.Tensor, step: int, percentile: int) -> float:
        """bitsandbytes' percentile clipping: the last 100 squared gradient norms;
        scale the gradient down to the `percentile`-th of their norms."""
        if percentile >= 100:
            return 1.0
        gnorm_vec = state["gnorm_vec"]
        gnorm_vec[step % 100] = grad.float().pow(2).sum()
        current = torch.sqrt(gnorm_vec[step % 100])
        clip = torch.sqrt(torch.sort(gnorm_vec).values[percentile])
        return float(clip / current) if bool(current > clip) else 1.0

    @torch.no_grad()
    def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> int:
        if not p.is_contiguous():
            p.data = p.data.contiguous()
        if p.grad is None:
            raise ValueError(f"group {gindex} parameter {pindex} has no gradient")
        grad = p.grad.contiguous()
        state = self.state[p]
        config = self.get_config(gindex, pindex, group)
        self._check_state(p, state, f"group {gindex} parameter {pindex}", maps=False)
        state["step"] = int(state["step"]) + 1
        step = state["step"]
        if grad.shape != p.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} differs from the parameter's {tuple(p.shape)}")
        betas = config["betas"]
        beta1, beta2 = float(betas[0]), float(betas[1]) if len(betas) > 1 else 0.0
        gnorm_scale = self._gnorm_scale(state, grad, step, config["percentile_clipping"])
        if state["state1"].dtype == torch.float32:
            if not bool(torch.isfinite(grad).all()):  # fp32 state: the whole parameter is left unchanged
                state["step"] = step - 1
                return -1
            _update_32bit(self.optimizer_name, grad, p, state, beta1, beta2, config, step, gnorm_scale)
            return 0
        two = self._two_states()
        skipped = torch.zeros(1, dtype=torch.int32, device=p.device)
        optim8.update_8bit_ptr(
            self.optimizer_name,
            p.data_ptr(),
            ops.dtype_code(p.dtype, "parameter"),
            grad.data_ptr(),
            ops.dtype_code(grad.dtype, "gradient"),
            p.numel(),
            state["state1"].data_ptr(),
            state["absmax1"].data_ptr(),
            state["qmap1"].contiguous().data_ptr(),
            state["state2"].data_ptr() if two else None,
            state["absmax2"].data_ptr() if two else None,
            state["qmap2"].contiguous().data_ptr() if two else None,
            step,
            config["lr"],
            beta1,
            beta2,
            config["eps"],
            config["weight_decay"],
            gnorm_scale,
            skipped.data_ptr(),
            ops._stream(p),
        )
        return int(skipped.item())

    # ------------------------------------------------------------ state_dict

    def state_dict(self) -> dict[str, Any]:
        """bitsandbytes' layout: the quantization tensors of each parameter under
        '__bnb_optimizer_quant_state__' (so FSDP does not gather them)."""
        sd = super().state_dict()
        sd["state"] = {k: dict(v) if isinstance(v, dict) else v for k, v in sd["state"].items()}
        for param_state in sd["state"].values():
            if isinstance(param_state, dict):
                wrapped = {k: param_state.pop(k) for k in list(param_state) if k in self.non_castable_tensor_keys}
                if wrapped:
                    param_state[_WRAPPED] = wrapped
        return sd

    def load_state_dict(self, state_dict: dict, move_to_device: bool = True) -> None:
        """Loads a state_dict of this class or of bitsandbytes' (wrapped or not);
        each parameter's state is checked against the parameter (shape, dtype,
        block count, sorted maps) and an error names the parameter and the key."""
        state_dict = deepcopy(state_dict)
        for param_state in state_dict["state"].values():
            if isinstance(param_state, dict) and _WRAPPED in param_state:
                param_state.update(param_state.pop(_WRAPPED))
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for gi, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict's parameter group {gi} has {len(sg['params'])} parameters, "
                    f"this optimizer's has {len(g['params'])}"
                )
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
                strict=True,
            )
        )
        where = {id(p): f"group {gi} parameter {pi}" for gi, g in enumerate(groups) for pi, p in enumerate(g["params"])}

        def cast(param, value):
            if isinstance(value, torch.Tensor):
                if param.is_floating_point() and value.dtype != torch.uint8:
                    value = value.to(param.dtype)
                return value
            if isinstance(value, dict):
                for k, v in value.items():
                    if k in self.non_castable_tensor_keys:
                        if move_to_device and isinstance(v, torch.Tensor):
                            value[k] = v.to(param.device)
                    elif k in ("state1", "state2") and isinstance(v, torch.Tensor):
                        value[k] = v.to(param.device)  # fp32 states keep fp32
                    else:
                        value[k] = cast(param, v)
                return value
            if isinstance(value, container_abcs.Iterable) and not isinstance(value, str):
                return type(value)(cast(param, v) for v in value)
            return value

        state: defaultdict = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state[param] = cast(param, v)
                self._check_state(param, state[param], where[id(param)])
            else:
                state[k] = v
        param_groups = [{**ng, "params": g["params"]} for g, ng in zip(groups, saved_groups, strict=True)]
        self.__setstate__({"state": state, "param_groups": param_groups})


@torch.no_grad()
def _update_32bit(name, grad, p, state, beta1, beta2, config, step, gnorm_scale) -> None:
    """fp32 states, in bitsandbytes' CPU order (its optimizer_update_32bit)."""
    lr, eps, wd = config["lr"], config["eps"], config["weight_decay"]
    g = grad.float() * gnorm_scale
    pf = p.data.float()
    s1 = state["state1"]
    if name == "adam":
        s2 = state["state2"]
        s1.mul_(beta1).add_(g, alpha=1.0 - beta1)
        s2.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        correction1 = 1.0 - beta1**step
        correction2 = math.sqrt(1.0 - beta2**step)
        if wd > 0.0:
            pf.mul_(1.0 - lr * wd)
        pf.add_(s1 / (s2.sqrt() + eps * correction2), alpha=-lr * correction2 / correction1)
    elif name == "momentum":
        g_wd = g.add(pf, alpha=wd) if wd > 0.0 else g
        if step == 1:
            s1.copy_(g_wd)
        else:
            s1.mul_(beta1).add_(g_wd)
        pf.add_(s1, alpha=-lr)
    elif name == "lion":
        if wd > 0.0:
            pf.mul_(1.0 - lr * wd)
        pf.add_(s1.mul(beta1).add(g, alpha=1.0 - beta1).sign(), alpha=-lr)
        s1.mul_(beta2).add_(g, alpha=1.0 - beta2)
    else:  # rmsprop
        g_wd = g.add(pf, alpha=wd) if wd > 0.0 else g
        s1.mul_(beta1).addcmul_(g_wd, g_wd, value=1.0 - beta1)
        pf.add_(g_wd / (s1.sqrt() + eps), alpha=-lr)
    p.data.copy_(pf)


# --------------------------------------------------------------- the classes


def _no_amsgrad(cls: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(f"{cls} does not support amsgrad=True")


def _adam_family(name: str, default_wd: float, bits: int | None, paged: bool):
    """Adam / AdamW classes: bits None = take optim_bits (Adam, AdamW); 8 or 32 = fixed."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=default_wd,
        amsgrad=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        is_paged=False,  # as in bitsandbytes: the Paged* classes are paged whatever it says
        *,
        percentile_clipping=100,
        block_wise=True,
    ):
        _no_amsgrad(name, amsgrad)
        if bits == 8 and optim_bits != 32:
            raise ValueError(f"{name} only supports optim_bits=32 (default value for compatibility), got {optim_bits}")
        Optimizer8bit.__init__(
            self,
            "adam",
            params,
            lr,
            betas,
            eps,
            weight_decay,
            optim_bits if bits is None else bits,
            args,
            min_8bit_size,
            percentile_clipping,
            block_wise,
            is_paged=paged or is_paged,
        )

    return type(name, (Optimizer8bit,), {"__init__": __init__, "__doc__": _doc(name, "adam", bits, paged)})


def _doc(name: str, rule: str, bits: int | None, paged: bool) -> str:
    state = {8: "8-bit", 32: "32-bit", None: "optim_bits-bit (32 by default)"}[bits]
    text = f"bitsandbytes.optim.{name}: {rule} with {state} optimizer state (same arguments and defaults)."
    if paged:
        text += (
            " Paged: bitsandbytes keeps large states in CUDA unified memory that pages to the host under "
            "memory pressure; q4 allocates them as ordinary tensors (on the CPU pages are moot), so this is "
            "the same optimizer as the unpaged one."
        )
    return text


Adam = _adam_family("Adam", 0.0, None, False)
Adam8bit = _adam_family("Adam8bit", 0.0, 8, False)
Adam32bit = _adam_family("Adam32bit", 0.0, 32, False)
PagedAdam = _adam_family("PagedAdam", 0.0, None, True)
PagedAdam8bit = _adam_family("PagedAdam8bit", 0.0, 8, True)
PagedAdam32bit = _adam_family("PagedAdam32bit", 0.0, 32, True)
AdamW = _adam_family("AdamW", 1e-2, None, False)
AdamW8bit = _adam_family("AdamW8bit", 1e-2, 8, False)
AdamW32bit = _adam_family("AdamW32bit", 1e-2, 32, False)
PagedAdamW = _adam_family("PagedAdamW", 1e-2, None, True)
PagedAdamW8bit = _adam_family("PagedAdamW8bit", 1e-2, 8, True)
PagedAdamW32bit = _adam_family("PagedAdamW32bit", 1e-2, 32, True)


def _lion_family(name: str, bits: int | None, paged: bool):
    def __init__(
        self,
        params,
        lr=1e-4,
        betas=(0.9, 0.99),
        weight_decay=0,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        is_paged=paged,
        *,
        percentile_clipping=100,
        block_wise=True,
    ):
        Optimizer8bit.__init__(
            self,
            "lion",
            params,
            lr,
            betas,
            0.0,
            weight_decay,
            optim_bits if bits is None else bits,
            args,
            min_8bit_size,
            percentile_clipping,
            block_wise,
            is_paged=is_paged,
        )

    return type(name, (Optimizer8bit,), {"__init__": __init__, "__doc__": _doc(name, "Lion", bits, paged)})


Lion = _lion_family("Lion", None, False)
Lion8bit = _lion_family("Lion8bit", 8, False)
Lion32bit = _lion_family("Lion32bit", 32, False)
PagedLion = _lion_family("PagedLion", None, True)
PagedLion8bit = _lion_family("PagedLion8bit", 8, True)
PagedLion32bit = _lion_family("PagedLion32bit", 32, True)


def _sgd_family(name: str, bits: int | None):
    def __init__(
        self,
        params,
        lr,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        *,
        percentile_clipping=100,
        block_wise=True,
    ):
        if momentum == 0:
            raise NotImplementedError("SGD without momentum is not supported!")
        if nesterov:
            raise NotImplementedError("SGD with nesterov=True is not supported (bitsandbytes ignores it)")
        Optimizer8bit.__init__(
            self,
            "momentum",
            params,
            lr,
            (momentum, dampening),
            0.0,
            weight_decay,
            optim_bits if bits is None else bits,
            args,
            min_8bit_size,
            percentile_clipping,
            block_wise,
        )

    return type(name, (Optimizer8bit,), {"__init__": __init__, "__doc__": _doc(name, "SGD with momentum", bits, False)})


SGD = _sgd_family("SGD", None)
SGD8bit = _sgd_family("SGD8bit", 8)
SGD32bit = _sgd_family("SGD32bit", 32)


def _rmsprop_family(name: str, bits: int | None):
    def __init__(
        self,
        params,
        lr=1e-2,
        alpha=0.99,
        eps=1e-8,
        weight_decay=0,
        momentum=0,
        centered=False,
        optim_bits=32,
        args=None,
        min_8bit_size=4096,
        *,
        percentile_clipping=100,
        block_wise=True,
    ):
        if alpha == 0:
            raise NotImplementedError("RMSprop with alpha==0.0 is not supported!")
        if centered:
            raise NotImplementedError("Centered RMSprop is not supported!")
        Optimizer8bit.__init__(
            self,
            "rmsprop",
            params,
            lr,
            (alpha, momentum),
            eps,
            weight_decay,
            optim_bits if bits is None else bits,
            args,
            min_8bit_size,
            percentile_clipping,
            block_wise,
        )

    return type(name, (Optimizer8bit,), {"__init__": __init__, "__doc__": _doc(name, "RMSprop", bits, False)})


RMSprop = _rmsprop_family("RMSprop", None)
RMSprop8bit = _rmsprop_family("RMSprop8bit", 8)
RMSprop32bit = _rmsprop_family("RMSprop32bit", 32)
