"""Fuzz target: quantized model folders through both PyTorch loaders.

An input is a model folder packed as a sequence of files (one byte: the name's
length, the name, a little-endian u32 size, the content); names outside the
five a folder holds here (config.json, model.safetensors, its index and two
shards) are dropped. The seeds (tests/fuzz/corpus/model_folder/, written by
``python tests/fuzz/fuzz_model_folder.py --write-corpus``) are a tiny BERT
quantized by q4's own convert path: NF4 nested, FP4 plain, int8, and NF4 in
two shards with an index.

The property, check(data): the folder goes through transformers'
``AutoModel.from_pretrained`` (q4torch.hf imported, bitsandbytes absent) and
through ``q4torch.load_quantized`` into the seed's float model. Each either
loads or raises an exception with a message; while config.json is one of the
seeds' (only the index and the shards are mutated), the exception must not be
one that names nothing (IndexError, AttributeError, NotImplementedError,
ZeroDivisionError, AssertionError, NameError: the kinds earlier findings
showed). A config asking for a dimension past 4096 is not loaded (building
such a model takes longer than the time bound). A folder that loads must compute: a forward on a fixed batch runs
and, where both loaders loaded it, the two models hold the same quantized
bytes and give identical outputs (a wrong answer otherwise). No crash, no
hang (scripts/fuzz.sh bounds each input).

The mutator knows the layout: it picks one file and edits it as JSON
(fuzz_checkpoint's hostile values, keys dropped) or, for a shard, with
fuzz_checkpoint's safetensors mutator; or it drops, duplicates or renames a
file. tests/fuzz/test_fuzz_regressions.py replays the corpus and saved crash
inputs through check() without atheris.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus" / "model_folder"
NAMES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
)
# exception types that name nothing: a loader must not end with one of these on a folder whose config is sound
_UNNAMED = (IndexError, AttributeError, NotImplementedError, ZeroDivisionError, AssertionError, NameError)
_STATE: dict = {}


# ---------------------------------------------------------------- the archive


def pack(files: dict[str, bytes]) -> bytes:
    out = bytearray()
    for name, content in files.items():
        raw = name.encode()
        out += bytes([len(raw)]) + raw + struct.pack("<I", len(content)) + content
    return bytes(out)


def unpack(data: bytes) -> dict[str, bytes]:
    """The files of an input (a truncated last file keeps what is there)."""
    files: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        n = data[pos]
        name = data[pos + 1 : pos + 1 + n].decode("utf-8", "replace")
        pos += 1 + n
        if pos + 4 > len(data):
            break
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        content = data[pos : pos + size]
        pos += size
        if name in NAMES:
            files[name] = content
    return files


# ------------------------------------------------------------------ the seeds


def _config():
    from transformers import BertConfig

    return BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, type_vocab_size=2,
    )  # fmt: skip


def _float_folder(root: Path) -> Path:
    import torch
    from transformers import BertModel

    torch.manual_seed(0)
    path = root / "float"
    BertModel(_config()).save_pretrained(path)
    return path


def seeds() -> dict[str, bytes]:
    """Seed name -> packed folder (deterministic)."""
    from q4._src import checkpoint
    from q4._src.convert import Options, quantize_checkpoint

    out: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = _float_folder(root)
        for name, opts in (
            ("nf4-nested", Options("nf4", 32, True)),
            ("fp4-plain", Options("fp4", 64, False)),
            ("int8", Options("int8")),
        ):
            quantize_checkpoint(src, root / name, opts)
            out[name] = pack({n: (root / name / n).read_bytes() for n in NAMES if (root / name / n).is_file()})
        # NF4 in two shards with an index (the float model split in two, then quantized)
        split = root / "split"
        split.mkdir()
        shutil.copy(src / "config.json", split / "config.json")
        tensors = checkpoint.load_file(src / "model.safetensors")
        keys = sorted(tensors)
        halves = {NAMES[3]: keys[: len(keys) // 2], NAMES[4]: keys[len(keys) // 2 :]}
        for shard, names in halves.items():
            checkpoint.save_file({k: tensors[k] for k in names}, split / shard)
        index = {"metadata": {}, "weight_map": {k: s for s, names in halves.items() for k in names}}
        (split / NAMES[2]).write_text(json.dumps(index))
        quantize_checkpoint(split, root / "sharded", Options("nf4", 64, True))
        out["nf4-sharded"] = pack(
            {n: (root / "sharded" / n).read_bytes() for n in NAMES if (root / "sharded" / n).is_file()}
        )
    return out


# ------------------------------------------------------------------- property


def _setup() -> dict:
    if not _STATE:
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]  # q4 serves bitsandbytes' configs
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch

        import q4torch.hf  # noqa: F401  (registers q4 with transformers)

        torch.manual_seed(0)
        base = os.environ.get("Q4_FUZZ_SCRATCH") or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        root = Path(tempfile.mkdtemp(prefix="q4-fuzz-folder-", dir=base))
        atexit.register(shutil.rmtree, root, True)
        from transformers import BertModel

        _STATE.update(
            root=root,
            float_model=BertModel(_config()).eval(),
            batch={
                "input_ids": torch.tensor([[1, 5, 9, 2], [3, 3, 7, 0]]),
                "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
            },
            configs={unpack(s).get("config.json") for s in _seed_inputs()},
        )
    return _STATE


def _too_big(config: bytes | None) -> bool:
    """Whether a config asks for a model too large to build within the time
    bound (a dimension past 4096): such folders are not loaded."""
    try:
        doc = json.loads(config or b"{}")
    except (ValueError, RecursionError):
        return False
    values = doc.values() if isinstance(doc, dict) else ()
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > 4096 for v in values)


def _seed_inputs() -> list[bytes]:
    return [p.read_bytes() for p in sorted(CORPUS.glob("*")) if p.is_file()] if CORPUS.is_dir() else []


def _bits(t):
    import torch

    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _q4_state(model) -> dict:
    from q4torch.nn import Linear4bit, Linear8bitLt

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (Linear4bit, Linear8bitLt)):
            for k, v in m.state_dict().items():
                out[f"{name}.{k}"] = v.detach().contiguous().view(-1).view(__import__("torch").uint8).clone()
    return out


def _q4_dirs() -> tuple[str, ...]:
    """The directories of q4's own packages (q4/, q4torch/), as imported: a checkout's
    path may hold a folder named q4 above everything (the virtualenv included)."""
    import q4
    import q4torch

    return tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (q4, q4torch))


def _in_q4(e: BaseException) -> bool:
    """Whether the exception passed through q4's code (q4/, q4torch/)."""
    dirs = _q4_dirs()
    tb = e.__traceback__
    while tb is not None:
        if str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(dirs):
            return True
        tb = tb.tb_next
    return False


def _route(load, strict: bool, what: str, all_q4: bool):
    """load() -> (model, None) or (None, exception). With ``strict`` (the
    folder's config is a seed's) an exception of a kind that names nothing
    fails where q4 is involved: raised through q4's code, anywhere in a route
    that is all q4's (``all_q4``), or a torch kernel missing for a dtype
    (NotImplementedError: a q4 layer initialised as a float one). transformers'
    own parsing of a mutated index (its hub code) is not q4's to name."""
    try:
        return load(), None
    except Exception as e:  # noqa: BLE001 (the property classifies it)
        assert str(e).strip(), f"{what}: {type(e).__name__} without a message"
        ours = all_q4 or _in_q4(e) or isinstance(e, NotImplementedError)
        if strict and isinstance(e, _UNNAMED) and ours:
            raise AssertionError(f"{what}: {type(e).__name__} names nothing: {e}") from e
        return None, e


def check(data: bytes) -> None:
    """Raise AssertionError (or whatever escaped) if ``data``'s folder breaks the property (module docstring)."""
    load(data)


def load(data: bytes) -> dict:
    """check()'s work: {"from_pretrained": exception or None, "load_quantized": exception or None}."""
    import torch
    from transformers import AutoModel

    import q4torch

    state = _setup()
    files = unpack(data)
    folder = state["root"] / "folder"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    strict = files.get("config.json") in state["configs"]
    if _too_big(files.get("config.json")):
        return {"from_pretrained": None, "load_quantized": None}  # (a huge model is slow to build, not wrong)

    hf_model, hf_error = _route(lambda: AutoModel.from_pretrained(folder).eval(), strict, "from_pretrained", False)
    q4_model, q4_error = _route(
        lambda: q4torch.load_quantized(copy.deepcopy(state["float_model"]), folder), strict, "load_quantized", True
    )
    outputs = {}
    for what, model in (("from_pretrained", hf_model), ("load_quantized", q4_model)):
        if model is None or not strict:
            continue
        with torch.no_grad():
            outputs[what] = model(**state["batch"]).last_hidden_state  # a loaded folder must compute
    if hf_model is not None and q4_model is not None and strict:
        a, b = _q4_state(hf_model), _q4_state(q4_model)
        for key in sorted(set(a) & set(b)):
            assert torch.equal(a[key], b[key]), f"{key}: the two loaders hold different bytes"
        if set(a) == set(b):
            # (bit for bit: a NaN weight gives NaN outputs in both, which torch.equal calls different)
            same = torch.equal(_bits(outputs["from_pretrained"]), _bits(outputs["load_quantized"]))
            if not same and os.environ.get("Q4_FUZZ_DUMP"):
                Path(os.environ["Q4_FUZZ_DUMP"]).write_bytes(data)
            assert same, "the two loaders disagree"
    return {"from_pretrained": hf_error, "load_quantized": q4_error}


# -------------------------------------------------------------------- mutator


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    """atheris custom mutator (module docstring)."""
    import atheris

    sys.path.insert(0, str(HERE))
    import fuzz_checkpoint

    rnd = random.Random(seed)
    files = unpack(data)
    if not files or rnd.random() < 0.05:
        return atheris.Mutate(data, max_size)
    r = rnd.random()
    name = rnd.choice(sorted(files))
    if r < 0.08:
        del files[name]
    elif r < 0.14:
        files[rnd.choice(NAMES)] = files[name]  # a file under another name (an index beside one file, ...)
    elif name.endswith(".json"):
        try:
            doc = json.loads(files[name])
            if isinstance(doc, dict) and doc and rnd.random() < 0.2:
                doc.pop(rnd.choice(sorted(doc)))
            else:
                doc = fuzz_checkpoint._poke(doc, rnd)
            files[name] = json.dumps(doc).encode()
        except (ValueError, RecursionError, TypeError):
            files[name] = atheris.Mutate(files[name], len(files[name]) + 64)
    else:
        files[name] = fuzz_checkpoint.mutate(files[name], len(files[name]) + 256, rnd.randrange(1 << 30))
    return pack(files)[:max_size]


def write_corpus() -> None:
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, blob in seeds().items():
        (CORPUS / name).write_bytes(blob)
    print(f"{len(list(CORPUS.iterdir()))} seeds in {CORPUS}")


def main() -> None:
    if "--write-corpus" in sys.argv:
        write_corpus()
        return
    import atheris

    sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]
    # (q4's modules must be first imported here: instrument_imports leaves modules already loaded alone)
    assert not any(m == "q4" or m.startswith(("q4.", "q4torch")) for m in sys.modules), "q4 imported too early"
    with atheris.instrument_imports(include=["q4", "q4torch"]):
        import q4._src.checkpoint  # noqa: F401
        import q4torch._src.hf  # noqa: F401
        import q4torch._src.replace  # noqa: F401
    import transformers

    # (the campaign only: a test process replaying the corpus keeps transformers' logging as it was)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    _setup()
    argv = list(sys.argv)
    if not any(a.startswith("-max_len=") for a in argv):
        argv.append(f"-max_len={1 << 18}")
    atheris.Setup(argv, check, custom_mutator=mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
