"""The run's checkpoints on disk: the `step_*` layout, save and load, `latest`, the manifest and
its verification (`store.py`); a save's write errors shared by every rank (`write.py`); the
checks of a resume against the checkpoint it resumes (`resume.py`). Megatron's own sharded
model and optimizer files are written by the adapter (`megatron/checkpoint.py`).
"""
