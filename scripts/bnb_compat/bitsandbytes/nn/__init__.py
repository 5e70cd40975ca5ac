"""bitsandbytes.nn -> q4torch.nn."""

from q4torch.nn import *  # noqa: F401,F403
