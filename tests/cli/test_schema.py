"""q4/_src/schema.py: the one writer and the one load plan of a quantized
layer's checkpoint entries, framework-free, as the front ends use them."""

from __future__ import annotations

import numpy as np
import pytest

from q4._src import schema
from q4._src.weights import quantize_weight_4bit, quantize_weight_int8


@pytest.fixture
def w():
    return np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)


def test_int8_entries_are_what_validate_reads(w):
    cb, scb = quantize_weight_int8(w)
    entries = schema.int8_entries(cb, scb, prefix="l.")
    assert list(entries) == ["l.weight", "l.SCB", "l.weight_format"]
    code = entries["l.weight_format"]
    assert code.dtype == np.uint8 and code.shape == () and int(code) == schema.FORMAT_ROW
    assert schema.validate(entries) == {"l": {"kind": "Linear8bitLt", "shape": [8, 64]}}
    # a front end's tensor type: the converter gets the 0-d uint8 array
    assert schema.int8_entries(cb, scb, as_tensor=lambda a: ("tensor", a.dtype.name))["weight_format"] == (
        "tensor",
        "uint8",
    )
    errs: list[str] = []
    used: set[str] = set()
    got = schema.plan_int8_load(entries, "l.", (8, 64), "the layer", errs, used)
    assert errs == [] and used == set(entries)
    assert got is not None and got[0] is entries["l.weight"] and got[1] is entries["l.SCB"]


def test_plan_4bit_load_takes_packed_entries_a_float_weight_or_names_the_problem(w):
    packed, state = quantize_weight_4bit(w, 64, "nf4", True)
    entries = schema.quant4_entries(packed, state.to_dict(), prefix="l.")
    errs: list[str] = []
    used: set[str] = set()
    got = schema.plan_4bit_load(entries, "l.", (8, 64), errs, used)
    assert errs == [] and used == set(entries) and got is not None
    assert np.array_equal(got[0], packed.reshape(-1, 1)) and got[1] is not None and got[1].shape == (8, 64)

    got = schema.plan_4bit_load({"l.weight": w}, "l.", (8, 64), errs, set())
    assert errs == [] and got is not None and got[0] is w and got[1] is None

    cases = {
        "does not match this table's (8, 32)": ((8, 32), {"what": "table"}, entries),
        "a float weight of shape (8, 32)": ((8, 32), {}, {"l.weight": w}),
        "but no 'l.weight.quant_state": ((8, 64), {}, {"l.weight": w, "l.weight.absmax": state.absmax}),
        "holds 255 bytes": ((8, 64), {}, {**entries, "l.weight": packed.reshape(-1)[1:]}),
        "'l.weight' sharded: no": ((8, 64), {"check_state": _refuse}, entries),
    }
    for needle, (shape, kwargs, d) in cases.items():
        errs = []
        assert schema.plan_4bit_load(d, "l.", shape, errs, set(), **kwargs) is None
        assert len(errs) == 1 and needle in errs[0], (needle, errs)


def _refuse(state):
    raise ValueError("sharded: no")
