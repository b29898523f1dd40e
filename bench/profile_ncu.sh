#!/usr/bin/env bash
# Stall reasons, pipe utilization and occupancy of numwatch's statistics kernel and Triton flash
# forward under Nsight Compute (bench/profile_ncu_targets.py says which launches). ncu locks the
# SM clock (1.36 GHz on the H200), so its durations are longer than bench_*.py's.
# Usage (GPU machine, repository root): bash bench/profile_ncu.sh OUT.txt
set -euo pipefail
out=${1:?output file}
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
stalls=""
for r in barrier branch_resolving dispatch_stall drain gmma imc_miss lg_throttle long_scoreboard \
    math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected \
    short_scoreboard sleeping tex_throttle wait; do
  stalls+="smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio,"
done
metrics="${stalls}smsp__average_warp_latency_per_inst_issued.ratio,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
"$ncu" --target-processes all -k "regex:_head_stats_kernel|_fwd_kernel" --metrics "$metrics" \
  python3 bench/profile_ncu_targets.py > "$out" 2>&1
