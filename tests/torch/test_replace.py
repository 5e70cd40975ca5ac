"""q4torch.replace_linear on a small model."""

import logging

import pytest
import torch
from q4_reference import inputs
from q4_reference.matmul import rel_err

import q4torch
from q4torch.nn import Linear4bit, Linear8bitLt


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 64, bias=False)
        self.lm_head = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.lm_head(torch.relu(self.down(torch.relu(self.up(x)))))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4", "int8"])
def test_replaces_every_linear_but_skipped(rng, quant_type, caplog):
    torch.manual_seed(0)
    model = Block()
    x = torch.from_numpy(inputs.make(rng, (4, 64), "float32"))
    want = model(x).detach()
    up_bias = model.up.bias.detach().clone()
    with caplog.at_level(logging.INFO, logger="q4torch"):
        out = q4torch.replace_linear(model, quant_type, threshold=6.0)
    assert out is model
    cls = Linear8bitLt if quant_type == "int8" else Linear4bit
    assert isinstance(model.up, cls) and isinstance(model.down, cls)
    assert type(model.lm_head) is torch.nn.Linear
    assert torch.equal(model.up.bias.detach(), up_bias) and model.down.bias is None
    assert "replaced 2 nn.Linear layers (up, down)" in caplog.text
    # quantization error of a two-layer MLP: a few percent for 4 bits, under 1% for int8
    assert rel_err(model(x).detach().numpy(), want.numpy()) < (0.01 if quant_type == "int8" else 0.15)


def test_tied_modules_are_replaced_once(rng):
    model = torch.nn.Module()
    shared = torch.nn.Linear(64, 64)
    model.a, model.b = shared, shared
    q4torch.replace_linear(model, "nf4", skip=())
    assert model.a is model.b and isinstance(model.a, Linear4bit)


def test_glob_skip_and_bad_type():
    model = Block()
    q4torch.replace_linear(model, "nf4", skip=("d*", "lm_head"))
    assert type(model.down) is torch.nn.Linear and isinstance(model.up, Linear4bit)
    with pytest.raises(ValueError, match="quant_type must be one of"):
        q4torch.replace_linear(Block(), "int4")
    with pytest.raises(ValueError, match="got 100"):
        q4torch.replace_linear(Block(), "nf4", blocksize=100)
