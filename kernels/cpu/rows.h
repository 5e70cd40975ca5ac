// Runtime row count -> compile-time template argument, for the register-
// blocked CPU kernels. CALL is a function-like macro taking R; the switch
// calls it directly (not through a lambda, which inside a target("avx2")
// function would lose the attribute).
#pragma once

// CALL(R) for R = rows in 1..4 (anything below 2 runs R = 1).
#define Q4_ROWS_SWITCH_4(rows, CALL) \
  switch (rows) {                    \
    case 4:                          \
      CALL(4);                       \
      break;                         \
    case 3:                          \
      CALL(3);                       \
      break;                         \
    case 2:                          \
      CALL(2);                       \
      break;                         \
    default:                         \
      CALL(1);                       \
      break;                         \
  }

// CALL(R) for R = rows in 1..6.
#define Q4_ROWS_SWITCH_6(rows, CALL) \
  switch (rows) {                    \
    case 6:                          \
      CALL(6);                       \
      break;                         \
    case 5:                          \
      CALL(5);                       \
      break;                         \
    default:                         \
      Q4_ROWS_SWITCH_4(rows, CALL)   \
  }
