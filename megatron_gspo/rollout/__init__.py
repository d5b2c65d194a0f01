"""The RL side of experience: the scheduler that fills each step's batch of scored groups
(over-sampling, dynamic sampling, partial and asynchronous rollouts), multi-turn episodes, and
`Rollout`, which turns engine samples into training sequences with rewards and advantages.

It talks to the engines only through `megatron_gspo.engines.protocols` and imports no Megatron.
"""
