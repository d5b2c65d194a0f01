"""The embedded CPU engine: SGLang's own HTTP app (`server.py`) served over a transformers model
in one process (`tokenizer_manager.py`, `model.py`), for CPU runs and tests where the SGLang
scheduler cannot run."""
