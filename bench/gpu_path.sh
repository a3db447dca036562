#!/usr/bin/env bash
# The GPU path in one short script (issues 23 and 24): the tutorial's minGPT (configs/mingpt/tutorial.yaml) with
# the GPU fragment (bf16, NCCL), once under DDP and once under FSDP2 with sharded checkpoints, each killed at
# moments `lit-ddp chaos` draws (printed seed), resumed automatically and compared with an uninterrupted run bit
# for bit; then `lit-ddp generate` from the FSDP2 run's sharded last.ckpt.
#
#   bash bench/gpu_path.sh [OUTDIR] [extra fit arguments...]
#
# A GPU machine runs it as it is (every GPU it has: trainer.devices -1), in 8 to 10 minutes on one H100: each launch
# there takes 20-30 s before its first step. Under torch < 2.13 (this workplace's GPU image has 2.11) DDP rejects
# configs/trainer/ddp.yaml's forward_sync_buffers: point GPU_PATH_DDP_CONFIG at a copy that has
# `broadcast_buffers: false` instead. Environment: GPU_PATH_STEPS (300), GPU_PATH_SEED (1), GPU_PATH_TUTORIAL_EPOCHS (3).
# On a CPU, to check the script only:
#   bash bench/gpu_path.sh runs/gpu_path --trainer.accelerator cpu --trainer.precision 32-true --data.batch_size 8 \
#     --trainer.devices 1 --data.num_workers 0 --model.model_type gpt-nano
# Prints one line per step ("== ... rc=N"); the runs and their logs stay under OUTDIR.
set -u
out=${1:-runs/gpu_path}
shift || true
steps=${GPU_PATH_STEPS:-300}
seed=${GPU_PATH_SEED:-1}
if [ -e "$out/ddp" ] || [ -e "$out/fsdp2" ] || [ -e "$out/tutorial" ]; then
    echo "bench/gpu_path.sh: $out holds an earlier run: remove it, or give another OUTDIR" >&2
    exit 2
fi
mkdir -p "$out"
py=${PYTHON:-python3}

$py - <<'EOF'
import torch, lightning
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"== torch {torch.__version__}, lightning {lightning.__version__}, {name}, "
      f"bf16: {torch.cuda.is_available() and torch.cuda.is_bf16_supported()}")
EOF

step() {  # step NAME SECONDS COMMAND...: runs it for at most SECONDS, its output to OUTDIR/NAME.log; prints its time and status
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: $((SECONDS - t0)) s, rc=$rc"
    tail -n 7 "$out/$name.log"
    return $rc
}

tutorial=(--config configs/mingpt/tutorial.yaml --config configs/checkpoint/fault_tolerant.yaml)
ddp=${GPU_PATH_DDP_CONFIG:-configs/trainer/ddp.yaml}
# The two chaos runs share the GPUs (exactness does not depend on timing; their tokens/s are a shared GPU's)
step chaos_ddp 400 $py -m lit_ddp chaos --launcher single --faults 2 --kinds kill term --seed "$seed" \
    --root "$out/ddp" --timeout 380 -- --config "$ddp" "${tutorial[@]}" \
    --config configs/trainer/gpu.yaml --trainer.max_steps "$steps" "$@" &
step chaos_fsdp2 400 $py -m lit_ddp chaos --launcher single --faults 2 --kinds kill term --seed "$seed" \
    --root "$out/fsdp2" --timeout 380 -- --config configs/trainer/fsdp.yaml "${tutorial[@]}" \
    --config configs/trainer/gpu.yaml --trainer.max_steps "$steps" "$@" &
wait
step generate 45 $py -m lit_ddp generate --ckpt_path "$out/fsdp2/faulted/checkpoints/last.ckpt" --max_new_tokens 200
# The tutorial as its README row runs it (3 of its 10 epochs by default, a checkpoint every 3) alone on the GPUs:
# its speed and losses
step tutorial "${GPU_PATH_TUTORIAL_LIMIT:-150}" $py -m lit_ddp fit --config "$ddp" \
    --config configs/mingpt/tutorial.yaml --config configs/trainer/gpu.yaml --trainer.default_root_dir "$out/tutorial" \
    --trainer.max_epochs "${GPU_PATH_TUTORIAL_EPOCHS:-3}" "$@"

# The uninterrupted runs: tokens/s and MFU (TokenThroughputMonitor; the mean of the logged points after the first)
# and the last losses
$py - "$out" <<'EOF'
import sys
from pathlib import Path
from lit_ddp.tensorboard import read_scalars, scalar_tags
for run in [*sorted(Path(sys.argv[1]).glob("*/reference")), Path(sys.argv[1]) / "tutorial"]:
    if not run.is_dir():
        continue
    tags = scalar_tags(run)
    for tag in ("train/device/items_per_sec", "train/device/mfu"):
        points = [v for _, v in read_scalars(run, tag)][1:] if tag in tags else []
        if points:
            print(f"== {run}: {tag} {sum(points) / len(points):,.4g} (mean of {len(points)})")
    for tag in ("train/loss", "val/loss"):
        if tag in tags:
            print(f"== {run}: {tag} at step {read_scalars(run, tag)[-1][0]}: {read_scalars(run, tag)[-1][1]:.4f}")
EOF
