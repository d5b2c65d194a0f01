"""Isolated worker processes for user code: reward functions and tool environments run only
here (scrubbed environment, memory and CPU limits, wall timeout), never in the trainer."""
