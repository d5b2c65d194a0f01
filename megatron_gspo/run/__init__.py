"""The life of one training run around the RL loop (`train.py`): its inputs checked before
anything starts, its directories, its console and metrics, how it stops and how it ends.

- `preflight.py`: input checks on every rank before anything starts (no megatron-core)
- `run_dir.py`: one run at a time per `logging.dir` / `checkpoint.dir`, never into an input
- `console.py`, `metrics_log.py`: our own output; metrics.jsonl, TensorBoard, W&B, train.log
- `stop.py`, `interrupt.py`: SIGTERM / Ctrl-C: finish the step, checkpoint, stop; one line
  while still starting
- `user_errors.py`: exit codes per fault kind, one line each
- `teardown.py`: how a rank ends (process groups first, then the interpreter)
- `faults.py`: planted-fault points for the fault tests (no-ops unless MGSPO_FAULT is set)
"""
