"""The offline stages: pretraining and SFT (lm), and the preference stages DPO and the reward model (pairs, dpo, rm)."""
