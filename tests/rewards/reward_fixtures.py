"""User reward functions for the reward-pool tests (loaded by "module:function" in workers)."""

import os
import time


def length_ratio(prompt, response, answer):
    print("noise on stdout must not break the worker protocol")
    return len(response) / max(1, len(answer))


def sleepy(prompt, response, answer):
    if response == "hang":
        time.sleep(60)
    if response == "spin":
        while True:
            pass
    return 1.0


def broken(prompt, response, answer):
    if response == "raise":
        raise RuntimeError("user bug")
    if response == "nan":
        return float("nan")
    if response == "none":
        return None
    if response == "exit":
        os._exit(3)
    return 0.5
