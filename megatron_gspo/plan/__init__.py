"""Before a job is allocated: does a config fit N nodes x G GPUs of M GB, and will the cluster
accept it (`python -m megatron_gspo.plan`). No torch at import: the planner runs on a Slurm login
node and in every sbatch script before anything starts.

- `planner.py`: the command line, the checks, the verdict and the launch files it emits
- `memory.py`: per-rank parameter counts from megatron-core on the `meta` device, memory and
  weight-sync estimates
- `launch.py`: what a launch needs besides a fitting layout (weights on disk, interpreters)
- `topology.py`: what a GPU cluster refuses that a CPU run never shows (also run by preflight)
- `gpu_stack.py`: the CUDA build against the driver, NCCL versions of the two interpreters
- `model_files.py`: a Hugging Face model directory checked as the loaders will read it
"""
