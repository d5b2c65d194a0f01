"""Environments for the multi-turn tests (loaded as "module:Class" in env workers only)."""

import os
import time


class ToolEnv:
    """An initial observation, then an observation after each of the first two model turns, then
    done with reward 0.25 * turns. Observations name the turn and the model text's length."""

    def reset(self, record):
        self.turn = 0
        self.answer = record["answer"]
        return f"[{record['prompt']}]"

    def step(self, text):
        self.turn += 1
        if self.turn < 3:
            return f"<{self.turn}:{len(text)}>", None, False
        return None, 0.25 * self.turn, True


class NoRewardEnv:
    """Never gives a reward: the reward function scores the episode's text."""

    def reset(self, record):
        return None

    def step(self, text):
        return "+", None, False


class PidEnv:
    def reset(self, record):
        return None

    def step(self, text):
        return None, float(os.getpid()), True


class BuggyEnv:
    def reset(self, record):
        if record["answer"] == "reset-bug":
            raise KeyError("no such task")
        self.mode = record["answer"]
        return None

    def step(self, text):
        if self.mode == "raise":
            raise ValueError("env bug in step")
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "bad":
            return "only two", 1.0
        return None, 1.0, True


def raising_reward(prompt, response, answer):
    raise RuntimeError("reward bug 42")
