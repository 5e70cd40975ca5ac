"""Replays the fuzz corpus and every saved crash input through the fuzz
targets' properties, as part of the normal test run (no atheris needed):
tests/fuzz/corpus/checkpoint/* and tests/fuzz/regressions/checkpoint/*
through fuzz_checkpoint.check, the model-folder corpus and regressions
through fuzz_model_folder.check (transformers and load_quantized). A crash
input that scripts/fuzz.sh saved fails here until the bug is fixed. (The C
ABI corpus is replayed by tests/kernels/test_sizes.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from q4_testing.fuzz import fuzz_target

HERE = Path(__file__).resolve().parent


def _inputs(name: str) -> list[Path]:
    return sorted(
        p
        for d in (HERE / "corpus" / name, HERE / "regressions" / name)
        if d.is_dir()
        for p in d.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.name != "README.md"
    )


CHECKPOINT_INPUTS = _inputs("checkpoint")


def test_the_corpus_is_there():
    """The seeds make_corpus.py writes (a replay of nothing would pass vacuously)."""
    names = {p.name for p in CHECKPOINT_INPUTS}
    for seed in ("nf4-plain", "nf4-nested", "int8", "model-00001-of-00002", "model-00002-of-00002"):
        assert f"{seed}.safetensors" in names, seed
    assert "model.safetensors.index.json" in names
    corpus = HERE / "corpus" / "checkpoint"
    assert sum(p.stat().st_size for p in corpus.iterdir()) < 1 << 20


def test_seeds_are_valid_checkpoints():
    """The seeds load cleanly, so the campaign starts from deep inside the loader."""
    from q4 import checkpoint

    for p in CHECKPOINT_INPUTS:
        if p.parent.name == "checkpoint" and p.parent.parent.name == "corpus" and p.suffix == ".safetensors":
            checkpoint.inspect_file(p)


@pytest.mark.parametrize("path", CHECKPOINT_INPUTS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_replay_checkpoint(path):
    fuzz_target("checkpoint").check(path.read_bytes())


MODEL_FOLDER_INPUTS = _inputs("model_folder")


def test_the_model_folder_seeds_are_there_and_load():
    """Every seed folder loads through both loaders (a replay of folders that all
    fail early would pass vacuously)."""
    target = fuzz_target("model_folder")
    names = {p.name for p in MODEL_FOLDER_INPUTS}
    assert {"nf4-nested", "fp4-plain", "int8", "nf4-sharded"} <= names
    for p in MODEL_FOLDER_INPUTS:
        if p.parent.parent.name == "corpus":
            assert target.load(p.read_bytes()) == {"from_pretrained": None, "load_quantized": None}, p.name


@pytest.mark.parametrize(
    "path",
    [p for p in MODEL_FOLDER_INPUTS if p.parent.parent.name == "regressions"],
    ids=lambda p: p.name,
)
def test_replay_model_folder(path):
    fuzz_target("model_folder").check(path.read_bytes())
