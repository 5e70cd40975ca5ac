"""q4's internal API: the framework-neutral pieces (formats, quant_state,
checkpoint, weights, kernels, native) that q4, q4torch and q4jax share.

Names without a leading underscore in these modules are what the front ends
may import (e.g. quant_state.JSON_KEY_PREFIX, formats.check_quant_type);
they are internal to the q4 distribution, not a public API, and may change
between releases. Nothing in q4/ imports a front end: each front end's
`q4 parity` adapter lives in its own _src/parity.py, found by name
(q4.parity.ADAPTER_MODULES), and the `q4` command imports them lazily
(tests/cli/test_layering.py).
"""
