"""Before a run: inputs made ready (task data, model folder, reward) and the short SFT warm start of the RL examples."""
