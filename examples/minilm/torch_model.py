"""all-MiniLM-L6-v2 as a small torch.nn.Module whose parameter names are the
checkpoint's keys, so ``load_state_dict`` takes the safetensors file as is,
dense or quantized by q4 (bitsandbytes-format 4-bit or 8-bit layers)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import q4torch

from . import common
from .common import HEADS, HIDDEN, INTERMEDIATE, LAYER_NORM_EPS


def _dense_norm(n_in: int, n_out: int) -> nn.ModuleDict:
    return nn.ModuleDict({"dense": nn.Linear(n_in, n_out), "LayerNorm": nn.LayerNorm(n_out, eps=LAYER_NORM_EPS)})


class Embeddings(nn.Module):
    """Word + token type 0 + absolute position embeddings, then LayerNorm."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(common.VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(common.MAX_POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(common.TYPE_VOCAB, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=LAYER_NORM_EPS)
        self.register_buffer("position_ids", torch.arange(common.MAX_POSITIONS)[None])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.token_type_embeddings.weight[0]
        x = x + self.position_embeddings(self.position_ids[:, : ids.shape[1]])
        return self.LayerNorm(x)


class Layer(nn.Module):
    """One post-LayerNorm BERT block: self-attention, then a GELU feed-forward."""

    def __init__(self):
        super().__init__()
        self.attention = nn.ModuleDict(
            {
                "self": nn.ModuleDict({name: nn.Linear(HIDDEN, HIDDEN) for name in ("query", "key", "value")}),
                "output": _dense_norm(HIDDEN, HIDDEN),
            }
        )
        self.intermediate = nn.ModuleDict({"dense": nn.Linear(HIDDEN, INTERMEDIATE)})
        self.output = _dense_norm(INTERMEDIATE, HIDDEN)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        att = self.attention
        q, k, v = (att["self"][n](x).view(b, t, HEADS, -1).transpose(1, 2) for n in ("query", "key", "value"))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_bias).transpose(1, 2).reshape(b, t, HIDDEN)
        x = att["output"]["LayerNorm"](att["output"]["dense"](ctx) + x)
        h = F.gelu(self.intermediate["dense"](x))
        return self.output["LayerNorm"](self.output["dense"](h) + x)


class MiniLM(nn.Module):
    """The BERT encoder; ``forward(ids, mask)`` returns the last hidden state."""

    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList([Layer() for _ in range(common.LAYERS)])})
        # unused by the sentence embedding; kept so that every checkpoint key has a home
        self.pooler = nn.ModuleDict({"dense": nn.Linear(HIDDEN, HIDDEN)})

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # additive mask: padded keys get the most negative float, so exp() underflows to 0
        mask_bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        x = self.embeddings(ids)
        for layer in self.encoder["layer"]:
            x = layer(x, mask_bias)
        return x


def load(tensors: dict[str, np.ndarray]) -> MiniLM:
    """A MiniLM (eval mode, CPU) holding ``tensors``: the fp32 checkpoint, or
    one whose linear layers q4 / bitsandbytes quantized (each such layer is
    first replaced by q4torch's Linear4bit / Linear8bitLt, then loaded)."""
    model = q4torch.load_quantized(MiniLM(), tensors)
    return model.eval().requires_grad_(False)


def embed(model: MiniLM, sentences, batch_size: int = 32) -> np.ndarray:
    """Unit-norm sentence embeddings float32 [n, 384]."""

    def forward(ids, mask):
        with torch.inference_mode():
            return model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    return common.embed_with(forward, sentences, batch_size)


def with_bitsandbytes(model: MiniLM, quant_type: str = "nf4", blocksize: int = 64, nested: bool = True) -> MiniLM:
    """A copy of ``model`` with every nn.Linear replaced by bitsandbytes'
    Linear4bit (the peer q4 is compared with; fp32 compute)."""
    import copy

    import bitsandbytes as bnb

    model = copy.deepcopy(model)
    for name, lin in list(model.named_modules()):
        if type(lin) is not nn.Linear:
            continue
        layer = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            compute_dtype=torch.float32,
            compress_statistics=nested,
            quant_type=quant_type,
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            lin.weight.detach().clone(),
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=nested,
            quant_type=quant_type,
        )
        layer.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        model.set_submodule(name, layer.to("cpu"))  # quantizes on the move
    return model


def load_into_bitsandbytes(model: MiniLM, tensors: dict[str, np.ndarray]) -> MiniLM:
    """A copy of ``model`` whose quantized layers (those ``tensors`` stores as
    4-bit entries) are bitsandbytes' Linear4bit holding exactly those bytes
    (bitsandbytes' own prequantized loader; fp32 compute)."""
    import copy

    import bitsandbytes as bnb

    model = copy.deepcopy(model)
    for name, lin in list(model.named_modules()):
        key = f"{name}.weight"
        if not any(k.startswith(key + ".quant_state.") for k in tensors):
            continue
        layer = bnb.nn.Linear4bit(lin.in_features, lin.out_features, compute_dtype=torch.float32, device="meta")
        stats = {
            k[len(key) + 1 :]: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k.startswith(key + ".")
        }
        layer.weight = bnb.nn.Params4bit.from_prequantized(
            torch.from_numpy(np.array(tensors[key])), stats, requires_grad=False, device="cpu", module=layer
        )
        layer.bias = nn.Parameter(torch.from_numpy(np.array(tensors[f"{name}.bias"])), requires_grad=False)
        model.set_submodule(name, layer)
    return model.eval()
