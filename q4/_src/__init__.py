"""q4's internal API: the framework-neutral pieces that q4, q4torch and q4jax
share -- formats, quant_state, weights, kernels, native; the checkpoint files
in layers: atomic (publishing through a temporary), container (the safetensors
Reader / Writer, a checkpoint's shard files), schema (the quantized layers'
keys, their checks, the load plans and entry writers both front ends use) and
checkpoint (the file functions that join them).

Names without a leading underscore in these modules are what the front ends
may import (e.g. quant_state.JSON_KEY_PREFIX, formats.check_quant_type);
they are internal to the q4 distribution, not a public API, and may change
between releases. Nothing in q4/ imports a front end, lazily or not: the
front-end code a command needs (each front end's `q4 parity` adapter, in its
own _src/parity.py; the GPTQ calibration pass) is named by string and loaded
on first use (plugins.py), and the import graph has no circle
(tests/test_layering.py, tests/cli/test_layering.py).
"""
