"""bitsandbytes.cextension: the platform flags bitsandbytes' tests read (a CPU build)."""

HIP_ENVIRONMENT = False
ROCM_WARP_SIZE_64 = False
