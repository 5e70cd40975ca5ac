// AVX512_BF16 kernels of the fused 4-bit matmuls: bf16 compute for bf16
// inputs. (Placeholder: serves nothing yet, so the fp32 kernels run.)
#include "../../dispatch.h"

namespace q4 {
namespace cpu {
namespace avx512_bf16 {

bool gemm4(const Gemm4bitParams&, const gemm4::Scales&) { return false; }
bool grad4(const Gemm4bitGradInputParams&, const gemm4::Scales&) { return false; }

}  // namespace avx512_bf16
}  // namespace cpu
}  // namespace q4
