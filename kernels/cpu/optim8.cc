// Blockwise 8-bit optimizer step: the entry point (validation, the maps' bin
// tables, the kernel chain) and the scalar reference kernel, which follows the
// contract of q4/optim8.h element by element.
#include "q4/optim8.h"

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "dispatch.h"
#include "optim8_common.h"
#include "parallel.h"
#include "q4/blockwise8.h"
#include "q4/kernels.h"
#include "q4/quant4.h"

namespace q4 {
namespace cpu {
namespace {

constexpr int64_t kGrainBlocks = 64;  // 16 Ki elements per chunk

struct BinTable {
  std::array<float, 256> book;
  std::unique_ptr<uint8_t[]> v;
};

// Bin tables of the code books seen last (a parameter's maps are the same
// every step): built once, kept for the process (at most kCached books).
std::shared_ptr<const BinTable> bin_table(const float* code) {
  constexpr size_t kCached = 8;
  static std::mutex mu;
  static std::vector<std::shared_ptr<const BinTable>> cache;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& t : cache)
    if (std::memcmp(t->book.data(), code, sizeof(float) * 256) == 0) return t;
  auto t = std::make_shared<BinTable>();
  std::memcpy(t->book.data(), code, sizeof(float) * 256);
  t->v.reset(new uint8_t[blockwise8::kBins + kTablePad]());
  int start = 0;
  for (int j = 0; j < 255; ++j) {
    const int end = std::max(start, blockwise8::first_bin_above(blockwise8::midpoint(code, j)));
    std::memset(t->v.get() + start, j, size_t(end - start));
    start = end;
  }
  std::memset(t->v.get() + start, 255, size_t(blockwise8::kBins - start));
  if (cache.size() == kCached) cache.erase(cache.begin());
  cache.push_back(t);
  return t;
}

// The 8-bit codes and absmax of one block of new state values x[0..len).
void quantize_block(const float* x, int64_t len, const uint8_t* table, uint8_t* codes, float* absmax) {
  float m = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    const float a = std::fabs(x[i]);
    m = a > m ? a : m;
  }
  *absmax = m;
  if (m == 0.0f) {
    std::memset(codes, 0, size_t(len));
    return;
  }
  const float inv = 1.0f / m;
  for (int64_t i = 0; i < len; ++i) codes[i] = table[blockwise8::bin_of(x[i] * inv)];
}

template <int32_t K, typename P, typename G>
int64_t scalar_blocks(const Optim8Call& c, int64_t b0, int64_t b1) {
  const Optim8bitParams& p = *c.p;
  P* param = static_cast<P*>(p.param);
  const G* grad = static_cast<const G*>(p.grad);
  constexpr bool kTwo = K == optim8::kAdam;
  int64_t skipped = 0;
  float m[optim8::kBlock], v[optim8::kBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * optim8::kBlock, len = std::min(optim8::kBlock, p.n - start);
    bool finite = true;
    for (int64_t i = 0; i < len; ++i) finite &= optim8::finite_bits(Elem<G>::load(grad, start + i));
    if (!finite) {
      ++skipped;
      if (p.update) std::memset(p.update + start, 0, sizeof(float) * size_t(len));
      continue;
    }
    const float a1 = p.absmax1[b], a2 = kTwo ? p.absmax2[b] : 0.0f;
    for (int64_t i = 0; i < len; ++i) {
      float w = Elem<P>::load(param, start + i);
      float mm = c.book1[p.state1[start + i]] * a1;
      float vv = kTwo ? c.book2[p.state2[start + i]] * a2 : 0.0f;
      const float before = w;
      optim8::update<K>(c.k, Elem<G>::load(grad, start + i), w, mm, vv);
      if (p.update) {
        P stored[1];
        Elem<P>::store(stored, 0, w);
        p.update[start + i] = optim8::update_to(before, Elem<P>::load(stored, 0));
      } else {
        Elem<P>::store(param, start + i, w);
      }
      m[i] = mm;
      v[i] = vv;
    }
    quantize_block(m, len, c.table1, p.state1 + start, p.absmax1 + b);
    if (kTwo) quantize_block(v, len, c.table2, p.state2 + start, p.absmax2 + b);
  }
  return skipped;
}

#define Q4_OPTIM8_KIND_SWITCH(kind, K, ...)      \
  [&] {                                          \
    switch (kind) {                              \
      case optim8::kAdam: {                      \
        constexpr int32_t K = optim8::kAdam;     \
        return __VA_ARGS__();                    \
      }                                          \
      case optim8::kMomentum: {                  \
        constexpr int32_t K = optim8::kMomentum; \
        return __VA_ARGS__();                    \
      }                                          \
      case optim8::kLion: {                      \
        constexpr int32_t K = optim8::kLion;     \
        return __VA_ARGS__();                    \
      }                                          \
      default: {                                 \
        constexpr int32_t K = optim8::kRmsprop;  \
        return __VA_ARGS__();                    \
      }                                          \
    }                                            \
  }()

}  // namespace

int64_t optim8_blocks(const Optim8Call& c, const std::function<int64_t(int64_t, int64_t)>& body) {
  std::atomic<int64_t> skipped{0};
  parallel_for(c.p->absmax_size, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    const int64_t s = body(b0, b1);
    if (s) skipped.fetch_add(s, std::memory_order_relaxed);
  });
  return skipped.load();
}

namespace scalar {
bool optim8(const Optim8Call& c) {
  const int64_t skipped = Q4_OPTIM8_KIND_SWITCH(c.p->optimizer, K, [&] {
    return Q4_DTYPE_SWITCH(c.p->param_dtype, P, [&] {
      return Q4_DTYPE_SWITCH(c.p->grad_dtype, G, [&] {
        return optim8_blocks(c, [&](int64_t b0, int64_t b1) { return scalar_blocks<K, P, G>(c, b0, b1); });
      });
    });
  });
  if (c.p->skipped_blocks) *c.p->skipped_blocks = int32_t(std::min<int64_t>(skipped, INT32_MAX));
  return true;
}
}  // namespace scalar

Status optimizer_update_8bit(const Optim8bitParams& p) {
  Status s = validate(p);
  if (s.ok()) s = validate_code_book(p.qmap1);
  if (s.ok() && optim8::two_states(p.optimizer)) s = validate_code_book(p.qmap2);
  if (!s.ok()) return s;
  Optim8bitParams q = p;
  if (p.step_ptr) q.step = *p.step_ptr;
  if (q.step < 1) return Status::Invalid("step must be >= 1, got " + std::to_string(q.step));
  if (p.lr_scale_ptr) q.lr = p.lr * double(*p.lr_scale_ptr);
  if (!(q.lr >= 0.0 && std::isfinite(q.lr)))
    return Status::Invalid("lr * lr_scale must be finite and >= 0, got " + std::to_string(q.lr));
  ScopedIeeeFloat ieee;
  if (q.update) hint_fresh_output(q.update, q.n * int64_t(sizeof(float)));  // XLA's outputs are often fresh
  Optim8Call c;
  c.p = &q;
  c.k = optim8::make_consts(q.optimizer, q.step, q.lr, q.beta1, q.beta2, q.eps, q.weight_decay, q.gnorm_scale);
  const std::shared_ptr<const BinTable> t1 = bin_table(q.qmap1);
  std::shared_ptr<const BinTable> t2;
  c.book1 = t1->book.data();
  c.table1 = t1->v.get();
  if (optim8::two_states(q.optimizer)) {
    t2 = bin_table(q.qmap2);
    c.book2 = t2->book.data();
    c.table2 = t2->v.get();
  }
  const auto& chain = kernel_table().optim8;
  for (int i = 0; i < chain.size; ++i)
    if (chain.entries[i].fn(c)) {
      record_kernel(Op::kOptim8, chain.entries[i].name);
      return Status::Ok();
    }
  return {kInternal, "optimizer_update_8bit: no kernel served the call"};
}

}  // namespace cpu
}  // namespace q4
