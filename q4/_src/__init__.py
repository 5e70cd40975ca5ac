"""q4's internal API: the framework-neutral pieces (formats, quant_state,
checkpoint, weights, kernels, native) that q4, q4torch and q4jax share.

Names without a leading underscore in these modules are what the front ends
may import (e.g. quant_state.JSON_KEY_PREFIX, formats.check_quant_type);
they are internal to the q4 distribution, not a public API, and may change
between releases. Nothing in q4/_src imports a front end; q4/parity.py (the
`q4 parity` adapters) still imports them lazily inside its adapters, which
are to move into q4torch/_src and q4jax/_src.
"""
