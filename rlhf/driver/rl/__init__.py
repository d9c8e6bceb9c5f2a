"""The RL stage: the run loop around a step function, the built-in GRPO and PPO steps, rewards, advantages and the async rollout buffer."""
