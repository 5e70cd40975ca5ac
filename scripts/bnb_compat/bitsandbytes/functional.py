"""bitsandbytes.functional -> q4torch.functional."""

from q4torch.functional import *  # noqa: F401,F403
from q4torch.functional import (
    __all__,  # noqa: F401
    _convert_weight_packed_for_cpu,  # noqa: F401
)
