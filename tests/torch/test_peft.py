"""peft over q4torch layers (q4torch.peft.register): LoRA and DoRA training,
adapter save / load, merge / unmerge / merge_and_unload, all without
bitsandbytes. Oracles: merged bytes equal q4's own quantization of the
fp64-merged weight; outputs against an fp64 product with the dequantized
weight (tolerance: the fp32 rounding of the fused kernel and the adapters)."""

from __future__ import annotations

import sys

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

import q4torch
import q4torch.peft as qpeft
from q4torch import functional as F
from q4torch.hf import dequantized_weight
from q4torch.nn import Linear4bit, Linear8bitLt


@pytest.fixture(autouse=True)
def no_bitsandbytes(monkeypatch):
    """Every test here runs with bitsandbytes unimportable."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)


class Net(nn.Module):
    def __init__(self, d=128, h=256):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def quantized_net(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return q4torch.replace_linear(Net(), kind, skip=("head",))


def peft_net(kind: str, **lora):
    cfg = qpeft.register(LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], **lora))
    return get_peft_model(quantized_net(kind), cfg)


def data(n=64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 128, generator=g), torch.randint(0, 4, (n,), generator=g)


def randomise_adapters(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "magnitude" in name else 0.0) * p)


KINDS = ["nf4", "int8"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapters_train_and_only_adapters_do(kind, dora):
    model = peft_net(kind, use_dora=dora)
    wrapped = [m for m in model.modules() if isinstance(m, qpeft.LoraLinear)]
    assert len(wrapped) == 2
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("magnitude" in n for n in trainable) == dora
    before = {n: b.clone() for n, b in model.state_dict().items() if "lora_" not in n}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x, y = data()
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    after = model.state_dict()
    for n, b in before.items():  # the quantized base is untouched
        assert torch.equal(after[n], b), n


def merged_weight(layer, dora: bool, dtype) -> torch.Tensor:
    """The adapted layer's effective weight from the definitions: W + s B A
    (LoRA), or m / ||W + s B A||_rows * (W + s B A) (DoRA), W dequantized."""
    w = dequantized_weight(layer.get_base_layer()).to(dtype)
    a, b = layer.lora_A["default"].weight.detach().to(dtype), layer.lora_B["default"].weight.detach().to(dtype)
    delta = layer.scaling["default"] * (b @ a)
    if not dora:
        return w + delta
    m = layer.lora_magnitude_vector["default"].weight.detach().to(dtype)
    return (m / torch.linalg.norm(w + delta, dim=1)).view(-1, 1) * (w + delta)


def reference_forward(model, x, dora: bool) -> torch.Tensor:
    """The peft model's output in fp64 from the dequantized base weights and the
    adapters, written from the LoRA / DoRA definitions."""
    base = model.get_base_model()
    h = x.double()
    for name in ("up", "down"):
        layer = getattr(base, name)
        h = torch.relu(h @ merged_weight(layer, dora, torch.float64).T + layer.get_base_layer().bias.double())
    return h @ base.head.weight.double().T + base.head.bias.double()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_forward_matches_the_definition(kind, dora):
    model = peft_net(kind, use_dora=dora)
    randomise_adapters(model)
    x, _ = data(16)
    with torch.no_grad():
        got = model(x).double()
    want = reference_forward(model, x, dora)
    # fp32 arithmetic over reductions of 128-256 terms (LLM.int8 also quantizes x: its own error)
    tol = 2e-2 if kind == "int8" else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merge_requantizes_the_merged_weight(kind, dora):
    model = peft_net(kind, use_dora=dora)
    randomise_adapters(model)
    x, _ = data(16)
    layer = model.get_base_model().up
    merged_w = merged_weight(layer, dora, torch.float32)
    old = layer.get_base_layer().weight
    old_bytes = old.data.clone()
    merged = model.merge_and_unload()
    new = merged.up
    assert type(new) is (Linear8bitLt if kind == "int8" else Linear4bit)
    if kind == "int8":
        want_cb, want_scb, _ = F.int8_vectorwise_quant(merged_w.detach().to(torch.float16))
        assert torch.equal(new.weight.data, want_cb) and torch.equal(new.weight.SCB, want_scb)
    else:
        packed, qs = F.quantize_4bit(merged_w.detach(), blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(new.weight.data, packed) and torch.equal(new.weight.quant_state.absmax, qs.absmax)
    # merging makes a new weight: the old Parameter's bytes are untouched (a copy may share it)
    assert torch.equal(old.data, old_bytes)
    with torch.no_grad():
        assert torch.isfinite(merged(x)).all()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_unmerge_requantizes_the_unmerged_weight(dora):
    model = peft_net("nf4", use_dora=dora)
    randomise_adapters(model)
    layer = model.get_base_model().up
    w0 = dequantized_weight(layer.get_base_layer())
    delta = layer.get_delta_weight("default").float().detach()
    layer.merge()
    assert layer.merged
    w_merged = dequantized_weight(layer.get_base_layer())
    layer.unmerge()
    assert not layer.merged
    if dora:  # undo DoRA's rescaling with the norm of the unmerged weight (cached at merge)
        m = layer.lora_magnitude_vector["default"].weight.float().detach()
        want = w_merged / (m / torch.linalg.norm(w0 + delta, dim=1)).view(-1, 1) - delta
    else:
        want = w_merged - delta
    packed, qs = F.quantize_4bit(want, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(layer.get_base_layer().weight.data, packed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merge_and_dequantize_keeps_the_function(kind, dora):
    model = peft_net(kind, use_dora=dora)
    randomise_adapters(model)
    x, _ = data(16)
    want = reference_forward(model, x, dora)
    merged = qpeft.merge_and_dequantize(model)
    assert type(merged.up) is nn.Linear and type(merged.down) is nn.Linear
    with torch.no_grad():
        got = merged(x).double()
    # dense fp32 products with the merged weights: only fp32 rounding (int8: no input quantization now)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_adapter_save_and_load(tmp_path):
    model = peft_net("nf4", use_dora=True)
    randomise_adapters(model)
    x, _ = data(8)
    with torch.no_grad():
        want = model(x)
    model.save_pretrained(tmp_path)
    cfg = qpeft.register(LoraConfig.from_pretrained(tmp_path))
    again = PeftModel.from_pretrained(quantized_net("nf4"), tmp_path, config=cfg)
    assert sum(isinstance(m, qpeft.LoraLinear) for m in again.modules()) == 2
    with torch.no_grad():
        assert torch.equal(again(x), want)


def test_weight_rewriting_inits_are_refused():
    with pytest.raises(ValueError, match="pissa"):
        peft_net("nf4", init_lora_weights="pissa")


def test_register_takes_a_lora_config():
    with pytest.raises(TypeError, match="LoraConfig"):
        qpeft.register({"r": 8})


def test_merge_and_dequantize_after_merge_and_unload_raises():
    """merge_and_unload() already merged the adapters (and quantized the result again):
    merge_and_dequantize on what it left must say so, not return a 4-bit model as if merged."""
    model = peft_net("nf4", use_dora=False)
    randomise_adapters(model)
    model.merge_and_unload()
    with pytest.raises(ValueError, match="no q4 LoRA layer.*before merge_and_unload"):
        qpeft.merge_and_dequantize(model)
