// What every ISA unit (x86/<level>/*.cc) opens and closes its code with. A
// unit includes every header it shares with other units first, then opens
// its level:
//
//   Q4_UNIT_BEGIN(avx512_bf16)
//   #include "level-only headers"  (compiled for the level)
//   namespace q4::cpu::<level> { ... }
//   Q4_UNIT_END
//
// Q4_UNIT_BEGIN sets `#pragma GCC target` to the level's features, so a
// unit's own code never runs on a processor that lacks them, and silences
// -W(maybe-)uninitialized, which GCC 12's own AVX-512 intrinsic headers trip
// (they pass _mm512_undefined_*() as the merge source; GCC bug 105593, fixed
// in GCC 13). Everything included before it is compiled for
// the baseline target: no inline function of a shared header is ever emitted
// with wider instructions (and picked by the linker for the scalar path).
// The units are compiled only on x86 (CMakeLists.txt, BUILD).
#pragma once

#if !defined(__x86_64__) && !defined(__i386__)
#error "x86 ISA units are compiled only on x86 (CMakeLists.txt and BUILD select them)"
#endif

// Target features of each level; each includes the levels below it.
#define Q4_FEATURES_avx2 "avx2,fma,f16c"
#define Q4_FEATURES_avx512 "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
#define Q4_FEATURES_avx512_bf16 "avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma,f16c"
#define Q4_FEATURES_amx "avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma,f16c,amx-tile,amx-bf16,amx-int8"

#define Q4_UNIT_PRAGMA(x) _Pragma(#x)
#define Q4_UNIT_TARGET(features) Q4_UNIT_PRAGMA(GCC target(features))
#define Q4_UNIT_BEGIN(level)                                     \
  Q4_UNIT_TARGET(Q4_FEATURES_##level)                            \
  Q4_UNIT_PRAGMA(GCC diagnostic push)                            \
  Q4_UNIT_PRAGMA(GCC diagnostic ignored "-Wmaybe-uninitialized") \
  Q4_UNIT_PRAGMA(GCC diagnostic ignored "-Wuninitialized")
#define Q4_UNIT_END Q4_UNIT_PRAGMA(GCC diagnostic pop)
