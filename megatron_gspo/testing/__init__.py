"""Test and demo helpers: tiny local models and the multi-rank (gloo) harness."""
