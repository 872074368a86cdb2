"""Reinforcement learning (`python -m train.rl`): reward functions, rollouts from the policy, and the PPO /
GRPO / best-of-N loop on the one Trainer."""
