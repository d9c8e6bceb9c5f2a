"""An OpenAI-compatible endpoint over the rollout engines, for agents written against the `openai` client."""
