"""Multi-turn agentic rollouts: tool-call parsing, tools and the agent loop on the rollout engine."""
