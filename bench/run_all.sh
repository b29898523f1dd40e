#!/usr/bin/env bash
# Reruns every benchmark whose figures the issues and README quote; results land in bench/results/.
# GPU benchmarks need a CUDA GPU (the figures were measured on an H200); CPU ones run anywhere.
# Usage: bench/run_all.sh [gpu|cpu|all]   (default: all)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
R=bench/results
py=${PYTHON:-python3}

if [[ $what == gpu || $what == all ]]; then
  $py bench/bench_tensor_stats.py --out $R/tensor_stats_h200.json
  $py bench/bench_power_iteration.py --out $R/power_iteration_h200.json
  $py bench/bench_attention_stats.py --out $R/attention_stats.json
  # the statistics against session 10's code (the commit of attention_stats.json), one process
  $py bench/ab_attention_stats.py --against 9fdd857 --out $R/attention_stats_ab_9fdd857_session21_h200.json
  $py bench/bench_flash_attention.py --out $R/flash_attention_h200.json
  $py bench/bias_gap_scan.py --out $R/flash_attention_bias_gap_scan_split_h200.json
  $py bench/sweep_flash_gluon.py --out $R/flash_attention_gluon_configs_h200.json
  # the Gluon forward's last kernel change (packed P̄ cvt) against its predecessor, one process
  $py bench/ab_flash_gluon.py --against 6a67384 --out $R/flash_attention_gluon_packed_cvt_h200.json
  $py bench/bench_flash_host.py --rounds 5 --out $R/flash_attention_host_h200.json
  # stall reasons and occupancy under Nsight Compute, where ncu is installed
  if command -v ncu >/dev/null || [[ -x /usr/local/cuda/bin/ncu ]]; then
    bash bench/profile_ncu.sh $R/ncu_stalls_h200.txt
  fi
  $py bench/bench_overhead.py --out $R/overhead_gpt2_h200.json
  # README's headline overhead figures (runs 31-33: 400-1000 interleaved steps)
  $py bench/bench_overhead.py --interleave --steps 1000 \
    --configs baseline,default,gradients_only,grads_spectral_every_step \
    --out $R/overhead_gpt2_h200_interleaved_rerun.json
  $py bench/bench_overhead.py --interleave --steps 400 \
    --configs baseline,default,attention_only,grads_spectral_every_step,everything_every_step,detect_anomaly,nan_check_hooks \
    --out $R/overhead_gpt2_h200_interleaved.json
  # the power iteration's CUDA graph against plain launches, in the same process
  $py bench/bench_overhead.py --interleave --steps 500 \
    --configs baseline,gradients_only,grads_spectral_every_step,grads_spectral_every_step_plain_launches,default,default_plain_launches \
    --out $R/overhead_gpt2_h200_interleaved_graphs.json
  # the hot-swap in training: every layer on the stabilized kernel against cuDNN
  $py bench/bench_overhead.py --interleave --steps 300 \
    --configs baseline,default,default_swapped_stabilized \
    --out $R/overhead_gpt2_h200_interleaved_swapped.json
  $py bench/profile_step.py --out $R/profile_step_h200.json
  $py bench/repro_logit_growth.py --device cuda --preset small --steps 3000 --batch 32 \
    --lr 0.1 --warmup 20 --max-seconds 40 --out $R/repro_logit_growth_h200.json
  $py bench/repro_logit_growth.py --device cuda --preset small --steps 3000 --batch 32 \
    --lr 0.03 --warmup 1 --mitigation spike --max-seconds 45 --runs unstable,mitigated \
    --out $R/repro_spike_h200.json
  # the spike-prone setting (warm-up 1, no clipping, beta2 0.99): spike-skip and QK-clip
  # mitigation, and the healthy control (warm-up 20, clip 1.0)
  sp="bench/repro_logit_growth.py --device cuda --preset small --steps 6000 --batch 32 --beta2 0.99"
  $py $sp --lr 3e-3 --safe-lr 1e-3 --warmup 1 --clip 0 --max-seconds 100 --mitigation spike \
    --out $R/repro_spike_late_h200.json
  $py $sp --lr 3e-3 --warmup 1 --clip 0 --max-seconds 80 --mitigation qk_clip --runs mitigated \
    --out $R/repro_spike_late_h200_qkclip.json
  $py $sp --safe-lr 1e-3 --warmup 20 --clip 1.0 --max-seconds 80 --runs control \
    --out $R/repro_spike_late_h200_safe_control.json
  # an LR back-off on loss_rise; both settings again at the default flush cadence (50 steps)
  $py $sp --lr 3e-3 --warmup 1 --clip 0 --max-seconds 100 --mitigation loss_rise --runs mitigated \
    --out $R/repro_spike_late_h200_loss_rise.json
  $py $sp --flush-every 50 --lr 3e-3 --warmup 1 --clip 0 --max-seconds 100 --runs unstable \
    --out $R/repro_spike_late_h200_flush50.json
  $py $sp --flush-every 50 --safe-lr 1e-3 --warmup 20 --clip 1.0 --max-seconds 80 --runs control \
    --out $R/repro_spike_late_h200_safe_control_flush50.json
  $py bench/repro_paper_mechanism.py --device cuda --preset small --steps 3000 --batch 32 \
    --lr 0.01 --max-seconds 40 --out $R/repro_paper_mechanism_h200.json
  $py bench/repro_paper_mechanism.py --device cuda --preset small --steps 3000 --batch 32 \
    --lr 0.003 --data sinks --no-pos-emb --max-seconds 45 \
    --out $R/repro_paper_mechanism_sinks_h200.json
  # the paper's mechanism failing a run (LR 2e-2): kernels, SDPA, seed 1, safe-LR controls
  pm="bench/repro_paper_mechanism.py --device cuda --preset small --steps 3000 --batch 32 --data sinks --no-pos-emb"
  $py $pm --lr 0.02 --max-seconds 90 --out $R/repro_paper_mechanism_sinks_h200_lr2e-2.json
  $py $pm --lr 0.02 --runs sdpa --max-seconds 80 --out $R/repro_paper_mechanism_sinks_h200_lr2e-2_sdpa.json
  $py $pm --lr 0.02 --seed 1 --max-seconds 80 --out $R/repro_paper_mechanism_sinks_h200_lr2e-2_seed1.json
  $py $pm --lr 0.003 --runs sdpa,paper_repro --max-seconds 45 \
    --out $R/repro_paper_mechanism_sinks_h200_lr3e-3_control.json
  # the paper's own fix (the shift) on its BF16-accumulating kernel, and intermediate LRs
  $py $pm --lr 0.02 --runs paper_stabilized --max-seconds 90 \
    --out $R/repro_paper_mechanism_sinks_h200_lr2e-2_paper_stabilized.json
  $py $pm --lr 0.02 --runs paper_stabilized --seed 1 --max-seconds 90 \
    --out $R/repro_paper_mechanism_sinks_h200_lr2e-2_paper_stabilized_seed1.json
  $py $pm --lr 0.01 --runs paper_repro,paper_stabilized,stabilized --max-seconds 62 \
    --out $R/repro_paper_mechanism_sinks_h200_lr1e-2.json
  $py $pm --lr 0.014 --runs paper_repro,paper_stabilized --max-seconds 62 \
    --out $R/repro_paper_mechanism_sinks_h200_lr1.4e-2.json
  # repeated-n-gram bursts with a lagging second moment (a spike trigger per OLMo 2)
  $py bench/repro_logit_growth.py --device cuda --preset small --steps 3000 --batch 32 \
    --data bursts --lr 0.01 --warmup 20 --beta2 0.999 --mitigation spike \
    --runs unstable,mitigated --max-seconds 45 --out $R/repro_spike_bursts_h200.json
fi
if [[ $what == cpu || $what == all ]]; then
  $py bench/bench_overhead.py --preset demo --device cpu --batch 16 \
    --configs baseline,default,default_flush_every_1 --out $R/overhead_cpu_demo.json
  $py bench/bench_overhead.py --interleave --preset demo --device cpu --batch 16 --steps 200 \
    --configs baseline,default,grads_spectral_every_step,detect_anomaly,nan_check_hooks \
    --out $R/overhead_cpu_demo_interleaved.json
  $py bench/bench_scrape.py --out $R/scrape.json
  $py bench/profile_host_path.py --out $R/host_path_cpu.json
  $py bench/bench_flush_collectives.py --out $R/flush_collectives_cpu.json
  $py bench/repro_logit_growth.py --device cpu --preset tiny --steps 400 --lr 0.05 \
    --out $R/repro_logit_growth_cpu.json
fi
# the harness writes gzip (fast on the GPU machine): the report pages come from the full logs, the
# committed logs are thinned to the series the rules read and xz-compressed (bench/archive_log.py)
for log in $R/repro_*/*.jsonl.gz; do
  [[ -e $log ]] || continue
  $py -m numwatch report "$log" -o "${log%.jsonl.gz}.html"
  $py bench/archive_log.py "$log" "${log%.gz}.xz" && rm "$log"
done
# candidate spike rules replayed over the H200 logs (CPU; after the recompression above)
$py bench/replay_rules.py --out $R/rules_replay_h200_logs.json
$py bench/replay_rules.py --cadence 50 --out $R/rules_replay_h200_logs_cadence50.json
