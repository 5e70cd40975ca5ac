#!/usr/bin/env bash
# Runs a slice of the test suite against the AddressSanitizer + UBSan build of
# libq4.so (scripts/asan_run.sh builds it in build/asan). Any sanitizer report
# aborts the test process, so this fails.
#
#   scripts/sanitize.sh [PYTEST ARGS...]
#
# Extra arguments go to pytest. PYTHON as for asan_run.sh (default:
# .venv/bin/python); Q4_SANITIZE_JOBS pytest-xdist workers (default 2 when
# pytest-xdist is installed; 0: one process). The slice is chosen to fit the
# CI budget (the stage and the fuzz stage together about 5.5 minutes on 2
# cores, the build included) while reaching every native entry point from
# every caller:
#   - every C ABI entry point and each ISA level's kernels (tests/kernels, but
#     the AMX split / gradient variants whose scalar and AVX-512 twins run),
#     the numpy oracle comparisons (tests/q4_reference);
#   - the torch custom ops, layers and their OpenMP executor (not under
#     torch.compile: its tracing is slow under ASan and calls the same ops); every XLA FFI
#     handler, batched (vmap, nnx.scan) included, and one test of each Flax
#     projection form;
#   - a representative test of each integration: transformers (a q4 quantize
#     folder loaded without bitsandbytes, so its subprocess too; a Llama
#     generate; quantize on load in another dtype), peft (merge and
#     train), the q4 command and its model-folder handling, the checkpoint
#     format in both frameworks, torch/JAX parity, and the replay of every
#     fuzz corpus (checkpoints, model folders).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$repo"
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

tests=(
  # kernels: every entry point and ISA level (not the two cases whose time is
  # bitsandbytes' scalar reference loop, nor the AMX split / gradient variants
  # whose scalar and AVX-512 twins run)
  tests/kernels
  --deselect "tests/kernels/test_quant4.py::test_dequantize_matches_oracle_and_bitsandbytes[avx2-4096-float32-nf4]"
  --deselect "tests/kernels/test_quant4.py::test_dequantize_matches_oracle_and_bitsandbytes[avx2-4096-float32-fp4]"
  --deselect tests/kernels/test_gemm4_split.py
  --deselect tests/kernels/test_int8_grad_amx.py
  tests/q4_reference
  # torch: ops, layers, threads
  tests/torch/test_functional.py
  tests/torch/test_matmul.py
  tests/torch/test_int8.py
  tests/torch/test_threads.py
  tests/torch/test_linear4bit.py
  tests/torch/test_linear8bit.py
  --deselect tests/torch/test_linear8bit.py::test_compile_fullgraph
  --deselect tests/torch/test_linear4bit.py::test_compile_fullgraph_inference_and_training
  tests/torch/test_hardening.py
  # JAX: every FFI handler, batched; the Flax projection forms (einsum, general, heads)
  tests/jax/test_functional.py
  tests/jax/test_matmul.py
  tests/jax/test_int8.py
  tests/jax/test_nn.py
  "tests/jax/test_nn_scan.py::test_nnx_scan_remat_matches_unrolled[nothing_saveable]"
  "tests/jax/test_flax_models.py::test_projection_bytes_and_output_against_the_oracle[q-BTD,NDH]"
  "tests/jax/test_flax_models.py::test_projection_bytes_and_output_against_the_oracle[general-in-heads]"
  "tests/jax/test_flax_models.py::test_int8_projection_is_the_int8_linear_on_its_rows[q-BTD,NDH]"
  # transformers (a q4 quantize folder loaded in a subprocess without bitsandbytes; a Llama
  # generate; a bf16 load of both kinds; a misaligned folder), peft (merge and train)
  "tests/torch/test_transformers.py::test_q4_quantize_folder_loads_without_bitsandbytes[nf4]"
  tests/torch/test_transformers.py::test_llama_generate_equals_replace_linear
  "tests/torch/test_hf_hardening.py::test_a_folder_loads_and_runs_in_any_float_dtype[torch.bfloat16-nf4]"
  "tests/torch/test_hf_hardening.py::test_a_folder_loads_and_runs_in_any_float_dtype[torch.bfloat16-int8]"
  tests/torch/test_hf_hardening.py::test_tensors_a_file_maps_misaligned_are_copied
  "tests/torch/test_peft.py::test_merge_requantizes_the_merged_weight[lora-nf4]"
  "tests/torch/test_peft.py::test_merge_requantizes_the_merged_weight[dora-int8]"
  "tests/torch/test_peft.py::test_adapters_train_and_only_adapters_do[lora-nf4]"
  # the q4 command (quantize and inspect, shards, model folders), checkpoints in both
  # frameworks, torch/JAX parity, the fuzz corpora
  tests/cli/test_cli.py::test_sharded_checkpoint
  tests/cli/test_cli.py::test_user_mistakes_are_one_line_and_leave_nothing
  tests/cli/test_folder_safety.py
  tests/parity/test_checkpoint.py
  --deselect tests/parity/test_checkpoint.py::test_torch_to_file_to_jax_to_file_to_torch
  tests/parity/test_same_bytes.py
  "tests/parity/test_load_quantized.py::test_both_frameworks_load_a_quantized_file[nf4-64-nested]"
  tests/fuzz/test_fuzz_regressions.py
)

jobs=${Q4_SANITIZE_JOBS:-}
if [[ -z $jobs ]]; then
  if "$python" -c "import xdist" 2>/dev/null; then jobs=2; else jobs=0; fi
fi
[[ $jobs =~ ^[0-9]+$ ]] || { echo "sanitize.sh: Q4_SANITIZE_JOBS must be a number, got '$jobs'" >&2; exit 2; }
xdist=()
[[ $jobs -gt 0 ]] && xdist=(-n "$jobs" --dist loadfile)

# --capture=sys: pytest's default fd capture would swallow the sanitizer's
# report when it aborts the process; this way it reaches stderr.
cmd=("$python" -m pytest -q -p no:cacheprovider --capture=sys ${xdist[@]+"${xdist[@]}"} "${tests[@]}" "$@")
echo "== sanitize: ASan + UBSan build of libq4.so (build/asan), CPU kernels only"
echo "== sanitize: scripts/asan_run.sh ${cmd[*]}"
start=$SECONDS
status=0
PYTHON=$python scripts/asan_run.sh "${cmd[@]}" || status=$?
elapsed=$((SECONDS - start))
if [[ $status -eq 0 ]]; then
  echo "== sanitize: passed, no sanitizer reports (${elapsed}s, build included)"
else
  echo "== sanitize: FAILED with status $status after ${elapsed}s (134 = a sanitizer report aborted the run; see its stack above)" >&2
fi
exit "$status"
