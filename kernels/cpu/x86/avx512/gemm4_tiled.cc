// AVX-512 fp32 tiled forward (m > 1) and input gradient of the fused 4-bit
// matmuls. (Placeholder: serves nothing yet, so the AVX2 kernels run.)
#include "../../dispatch.h"

namespace q4 {
namespace cpu {
namespace avx512 {

bool gemm4_tiled(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool grad4(const Gemm4bitGradInputParams&, const gemm4::Scales&) { return false; }

}  // namespace avx512
}  // namespace cpu
}  // namespace q4
