"""Batches in the driver's layout for the worker tests, and what they are checked against."""

from __future__ import annotations

import torch

from workers.batch import Batch, pad_sequences


def make_rl_batch(n: int = 8, vocab: int = 500, p_max: int = 6, r_max: int = 5, seed: int = 0) -> Batch:
    """Prompts left-padded to P, responses right-padded to R, random lengths (>= 1 token each)."""
    g = torch.Generator().manual_seed(seed)

    def seqs(lo: int, hi: int) -> list[torch.Tensor]:
        return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
                for _ in range(n)]

    p_ids, p_mask = pad_sequences(seqs(2, p_max), left=True)
    r_ids, r_mask = pad_sequences(seqs(1, r_max))
    batch = Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                   "responses": r_ids, "response_mask": r_mask})
    batch["advantages"] = torch.randn(r_ids.shape, generator=g) * r_mask
    return batch


def grouped_batch(prompts: int = 3, n: int = 4, seed: int = 0, vocab: int = 500, prompt_len: int = 4,
                  resp_len: tuple[int, int] = (1, 6)) -> Batch:
    """`prompts` prompts of different lengths (prompt_len + 2k), each with `n` responses of different
    lengths (in [resp_len[0], resp_len[1]))."""
    g = torch.Generator().manual_seed(seed)
    p_seqs, r_seqs = [], []
    for k in range(prompts):
        prompt = torch.randint(3, vocab, (prompt_len + 2 * k,), generator=g)
        for _ in range(n):
            p_seqs.append(prompt)
            r_seqs.append(torch.randint(3, vocab, (int(torch.randint(*resp_len, (1,), generator=g)),), generator=g))
    p_ids, p_mask = pad_sequences(p_seqs, left=True)
    r_ids, r_mask = pad_sequences(r_seqs)
    batch = Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                   "responses": r_ids, "response_mask": r_mask})
    batch["advantages"] = torch.randn(r_ids.shape, generator=g) * r_mask
    batch["returns"] = torch.randn(r_ids.shape, generator=g) * r_mask
    return batch


def lm_batch(seed: int):
    """An LM (SFT-style) batch of make_rl_batch's 8 sequences."""
    from workers.roles.lm import lm_batch_from_rl

    return lm_batch_from_rl(make_rl_batch(n=8, seed=seed).select(["input_ids", "attention_mask"]))


def micro_counts(batch) -> list[int]:
    """Micro-batches each DP rank of 2 runs for `batch` (prefix-shared packing, one row per micro-batch)."""
    from workers.dispatch import split_dp_args
    from workers.roles.micro import response_micros

    shards, _ = split_dp_args([batch], {}, 2, pad=True)
    return [len(response_micros(args[0], 1, [], torch.device("cpu"), pack="prefix")) for args, _ in shards]


def hf_response_logits(model_path: str, batch: Batch) -> torch.Tensor:
    """The logits [B, R, V] that predict each response token, from a plain transformers fp32 forward
    (position ids from the mask)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    am = batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp_min(0)).logits
    r = batch["responses"].shape[1]
    return logits[:, -r - 1:-1].float()


def hf_logprobs(model_path: str, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Response log-probs from a plain transformers fp32 forward, of the logits divided by `temperature`."""
    logits = hf_response_logits(model_path, batch)
    lp = torch.log_softmax(logits / temperature, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return lp * batch["response_mask"]
