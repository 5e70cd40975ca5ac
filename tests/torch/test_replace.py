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


class _OwnLinear(torch.nn.Linear):
    pass


class _Zoo(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.lin = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 96)
        self.embed = torch.nn.Embedding(96, 64)
        self.conv1d = Conv1D(64, 64)  # GPT-2's linear, weight [in, out]
        self.own = _OwnLinear(64, 64)
        self.odd = torch.nn.Linear(96, 64)  # in_features not a multiple of 64: no W4A8
        self.raw = torch.nn.Parameter(torch.randn(64, 32))
        self.norm = torch.nn.LayerNorm(64)


def test_replace_linear_reports_what_it_left_float(caplog):
    """Every weight-bearing module or float matrix left float is named, with why; the
    reasons nobody asked for are WARNINGs; strict=True raises on exactly those."""
    with caplog.at_level(logging.INFO, logger="q4torch"):
        model, report = q4torch.replace_linear(_Zoo(), "nf4", activation_quant="int8", return_report=True)
    assert [r.path for r in report.quantized] == ["lin"] and isinstance(model.lin, Linear4bit)
    rows = {r.path: r.detail for r in report.left_float}
    assert rows["lm_head"] == "skip rule" and rows["embed"] == "embeddings=False"
    assert rows["own"].startswith("a subclass of nn.Linear")
    assert rows["odd"].startswith("activation_quant='int8'") and type(model.odd) is torch.nn.Linear
    assert rows["conv1d.weight"].startswith("a float parameter (64, 64) of Conv1D")
    assert rows["raw"].startswith("a float parameter (64, 32) of _Zoo")
    assert set(rows) == {"lm_head", "embed", "own", "odd", "conv1d.weight", "raw"}
    warned = {
        r.getMessage().split(" float: ")[0].rsplit(" ", 1)[-1] for r in caplog.records if r.levelno >= logging.WARNING
    }
    assert warned == {"own", "odd", "conv1d.weight", "raw"}
    with pytest.raises(ValueError, match=r"strict=True.*own \(_OwnLinear.*conv1d\.weight") as e:
        q4torch.replace_linear(_Zoo(), "nf4", strict=True)
    assert "lm_head" not in str(e.value)
    model = q4torch.replace_linear(
        _Zoo(), "int8", strict=True, skip=("lm_head", "conv1d", "own", "raw"), embeddings=True
    )
    assert type(model.lin).__name__ == "Linear8bitLt"
