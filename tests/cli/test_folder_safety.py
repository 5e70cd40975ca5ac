"""Issue 52: what `q4 quantize` copies out of a model folder (regular files
only: no link out of the folder, no special file), where it puts each tensor
(aligned to its element size), in what order it publishes a folder (the
config that describes the quantized shards first; signals held until the
publication ends), and `q4 inspect`'s check of a folder's config.json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from q4 import checkpoint
from q4._src import convert
from q4.cli import main

REPO = Path(__file__).resolve().parents[2]
_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def _model(path: Path, config: dict | None = None) -> Path:
    """A float model folder: odd-sized tensors of every width (the layout a
    writer in arrival order misaligns), a config and a tokenizer file."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    path.mkdir()
    checkpoint.save_file(
        {
            "a.weight": rng.standard_normal((64, 64)).astype(np.float32),
            "a.bias": rng.standard_normal(3).astype(np.float16),
            "b.weight": rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16),
            "b.bias": rng.standard_normal(5).astype(np.float32),
            "ids": np.arange(3, dtype=np.int64),
            "mask": np.ones(7, np.bool_),
            "norm.weight": rng.standard_normal(7).astype(np.float64),
        },
        path / "model.safetensors",
    )
    (path / "config.json").write_text(json.dumps(config or {"model_type": "toy"}))
    (path / "tokenizer.json").write_text("{}")
    return path


def _offsets(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def _misaligned(path: Path) -> list[str]:
    start, header = _offsets(path)
    return [
        f"{k} ({v['dtype']} at {start + v['data_offsets'][0]})"
        for k, v in header.items()
        if (start + v["data_offsets"][0]) % _ITEMSIZE[v["dtype"]]
    ]


# ------------------------------------------------------------- links, special files


def test_a_link_out_of_the_folder_is_refused_not_copied(tmp_path, capsys):
    src = _model(tmp_path / "model")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN=hunter2")
    (src / "notes.txt").symlink_to(secret)
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert "'notes.txt'" in err and "outside the model folder" in err and "--skip-unsafe-files" in err
    assert not out.exists() or not any(out.iterdir())  # refused before any output

    assert main(["quantize", str(src), str(out), "--skip-unsafe-files"]) == 0
    assert "q4: warning: left out 'notes.txt'" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_the_environment_is_never_copied(tmp_path, capsys):
    src = _model(tmp_path / "model")
    (src / "env.txt").symlink_to("/proc/self/environ")
    assert main(["quantize", str(src), str(tmp_path / "out")]) == 1
    assert "'env.txt' is a symbolic link to /proc/" in capsys.readouterr().err


def test_a_link_inside_the_folder_is_copied_as_a_regular_file(tmp_path, capsys):
    src = _model(tmp_path / "model")
    (src / "sub").mkdir()
    (src / "sub" / "vocab.txt").write_text("a\nb\n")
    (src / "vocab.txt").symlink_to("sub/vocab.txt")
    (src / "alias").symlink_to("sub")  # a link to a folder inside: its file is copied once, where it is
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 0
    copied = out / "vocab.txt"
    assert not copied.is_symlink() and copied.read_text() == "a\nb\n"
    assert (out / "sub" / "vocab.txt").read_text() == "a\nb\n" and not (out / "alias").exists()


def test_special_files_are_refused_without_being_opened(tmp_path, capsys):
    src = _model(tmp_path / "model")
    os.mkfifo(src / "pipe")  # opening it for reading would wait for a writer forever
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out)]) == 1
    assert "'pipe' is not a regular file (a FIFO)" in capsys.readouterr().err
    assert main(["quantize", str(src), str(out), "--skip-unsafe-files"]) == 0
    assert "left out 'pipe'" in capsys.readouterr().err and not (out / "pipe").exists()


def test_a_fifo_named_as_a_shard_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    os.mkfifo(src / "model-1.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a.weight": "model-1.safetensors"}}))
    code = f"import sys; from q4.cli import main; sys.exit(main(['inspect', {str(src)!r}]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr


# ------------------------------------------------------------------------ alignment


@pytest.mark.parametrize("args", [[], ["--no-nested"], ["--type", "int8"], ["--skip", "a"]])
def test_every_tensor_is_aligned_to_its_element_size(tmp_path, args):
    src = _model(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), *args]) == 0
    path = out / "model.safetensors"
    start, header = _offsets(path)
    assert start % 64 == 0
    assert _misaligned(path) == []
    # still plain safetensors (contiguous data, covered exactly), read by safetensors itself
    want = checkpoint.load_file(path)
    got = safetensors.numpy.load_file(str(path))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_save_file_aligns_every_tensor(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {
        "z": np.arange(3, dtype=np.uint8),
        "y": rng.standard_normal(5).astype(np.float32),
        "x": rng.standard_normal(3).astype(np.float16),
        "w": np.arange(3, dtype=np.int64),
        "v": np.ones((), np.float32),
        "e": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "t.safetensors"
    checkpoint.save_file(tensors, path)
    assert _misaligned(path) == []
    got = safetensors.numpy.load_file(str(path))
    assert all(np.array_equal(got[k], v) and got[k].dtype == v.dtype for k, v in tensors.items())


def test_a_writer_plan_that_does_not_match_is_an_error(tmp_path):
    w = checkpoint.Writer(tmp_path / "t.safetensors", 256, {4: 8})
    w.add("a", np.zeros(1, np.float32))
    with pytest.raises(checkpoint.CheckpointError, match="4 bytes of 4-byte tensors were planned"):
        w.finish()
    w.abort()
    with checkpoint.Writer(tmp_path / "t.safetensors", 256, {4: 4}) as w:
        with pytest.raises(checkpoint.CheckpointError, match="'b'"):
            w.add("b", np.zeros(2, np.float32))
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------- publication, config


def test_the_config_is_published_before_the_shards(tmp_path, monkeypatch):
    from q4._src import atomic

    src, out = _model(tmp_path / "model"), tmp_path / "out"
    events = []
    real = atomic.rename_into_place

    def recording(tmp, path):
        events.append(Path(path).name)
        real(tmp, path)

    monkeypatch.setattr(atomic, "rename_into_place", recording)
    assert main(["quantize", str(src), str(out), "--type", "int8"]) == 0
    # a kill after the shards are in never leaves them beside a config without quantization_config
    assert events.index("config.json") < events.index("model.safetensors")


def test_signals_during_publication_wait_until_it_ends(tmp_path, monkeypatch):
    """SIGTERM (here: to a handler of the test's own) sent while the first
    shard is published arrives after the index is written."""
    from q4._src import atomic

    src = tmp_path / "model"
    src.mkdir()
    weight_map = {}
    for i in range(2):
        name = f"model-{i + 1}.safetensors"
        checkpoint.save_file({f"s{i}.weight": np.ones((64, 64), np.float32)}, src / name)
        weight_map[f"s{i}.weight"] = name
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    out = tmp_path / "out"
    index = out / "model.safetensors.index.json"

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped(index.exists())

    real = atomic.rename_into_place

    def signalled(tmp, path):
        if Path(path).name == "model-1.safetensors":
            os.kill(os.getpid(), signal.SIGTERM)
        real(tmp, path)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        monkeypatch.setattr(atomic, "rename_into_place", signalled)
        with pytest.raises(Stopped) as info:
            convert.quantize_checkpoint(src, out, convert.Options())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.args == (True,)  # the handler ran once the index was in place
    assert checkpoint.load_checkpoint(out).keys() >= {"s0.weight", "s1.weight"}


def test_inspect_checks_the_folder_config(tmp_path, capsys):
    src = _model(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["quantize", str(src), str(out), "--type", "int8"]) == 0
    assert main(["inspect", str(out)]) == 0
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())

    config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 1
    err = capsys.readouterr().err
    assert "no quantization_config" in err and "'a'" in err and "as float weights" in err

    qc = {**config["quantization_config"], "load_in_8bit": False, "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    config_path.write_text(json.dumps({**config, "quantization_config": qc}))
    assert main(["inspect", str(out)]) == 1
    assert "does not describe layer 'a' (Linear8bitLt): it needs load_in_8bit: true" in capsys.readouterr().err
