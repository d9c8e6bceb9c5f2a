"""A small plain-PyTorch SFT loop on an HF model: the warm start of the RL examples.

It trains on (prompt, answer) pairs with the loss on the answer and the end-of-turn token only (the LM
loss of the Megatron step, `workers.roles.lm.masked_token_nll`), or on whole conversations (tool-call traces:
the loss on every assistant turn, as `rlhf.data.chat` masks SFT data), and saves an HF folder. The full SFT
stage on the Megatron backend lives in the SFT driver; this loop exists so a policy can be warm-started
in seconds inside tests and examples.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


def _encode(tok, prompt: str | list, answer: str, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    p_ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True)
    if isinstance(p_ids, dict) or hasattr(p_ids, "keys"):
        p_ids = p_ids["input_ids"]
    a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return list(p_ids), a_ids


def _encode_item(tok, item: tuple[str | list, str] | list[dict],
                 tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """(ids, target): target[t] is 1 where token t is trained (the answer, or every assistant turn)."""
    if isinstance(item, list):  # a conversation
        from rlhf.data.chat import tokenize_conversation

        return tokenize_conversation(tok, item, tools)
    p, a = _encode(tok, *item, tools=tools)
    return p + a, [0] * len(p) + [1] * len(a)


def warm_start_optimizer(model: torch.nn.Module, lr: float, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with a 20-step warm-up and a linear decay to 10% over `steps`."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    return opt, sched


def warm_start_update(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any,
                      parts: list[tuple[dict[str, torch.Tensor], torch.Tensor]]) -> float:
    """One optimizer step on the LM loss of the tokens where `target` is 1 (`masked_token_nll`), over a
    batch given as `parts` (model inputs with `input_ids`, target): the loss is averaged over the targets
    of all parts, as if they were one batch; each part runs its own forward and backward. Returns the loss."""
    from workers.roles.lm import masked_token_nll

    total = sum(target[:, 1:].sum() for _, target in parts)
    opt.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for inputs, target in parts:
        ids = inputs["input_ids"]
        logits = model(**inputs).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = masked_token_nll(logp, target[:, 1:], normalizer=total)
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss_sum


def length_buckets(lengths: list[int], ratio: float = 1.5) -> list[list[int]]:
    """Indices of `lengths` grouped shortest first, a new group starting where a length exceeds `ratio` x
    the group's shortest: a batch of short answers and long tool-call traces is not padded to the longest."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda k: lengths[k]):
        if not groups or lengths[i] > ratio * lengths[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return groups


def _padded(items: list[tuple[list[int], list[int]]], pad: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded model inputs and the target mask (1 on the trained tokens) of encoded items."""
    width = max(len(seq) for seq, _ in items)
    ids = torch.full((len(items), width), pad, dtype=torch.long)
    target = torch.zeros((len(items), width))
    attn = torch.zeros((len(items), width), dtype=torch.long)
    for i, (seq, trained) in enumerate(items):
        ids[i, : len(seq)] = torch.tensor(seq)
        target[i, : len(seq)] = torch.tensor(trained, dtype=torch.float32)
        attn[i, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": attn}, target


def sft_warm_start(model_dir: str | Path, pairs: list[tuple[str | list, str]] | list[list[dict]],
                   out_dir: str | Path, steps: int = 300, batch_size: int = 128, lr: float = 1e-3,
                   seed: int = 0, tools: list[dict] | None = None) -> Path:
    """Fine-tune `model_dir` for `steps` AdamW steps on `pairs` ((prompt, answer) pairs, or conversations as
    message lists) and save the result to `out_dir`. `tools` (function schemas) are rendered into every
    prompt as the rollout renders them for the RL run that follows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True)
    model.train()
    encoded: dict[int, tuple[list[int], list[int]]] = {}  # encoded when first drawn: many items, few steps

    def draw() -> tuple[list[int], list[int]]:
        k = rng.randrange(len(pairs))
        if k not in encoded:
            encoded[k] = _encode_item(tok, pairs[k], tools)
        return encoded[k]

    opt, sched = warm_start_optimizer(model, lr, steps)
    for _ in range(steps):
        items = [draw() for _ in range(batch_size)]
        groups = length_buckets([len(seq) for seq, _ in items])
        warm_start_update(model, opt, sched, [_padded([items[i] for i in g], tok.pad_token_id) for g in groups])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@torch.no_grad()
def greedy_accuracy(model_dir: str | Path, pairs: list[tuple[str | list, str]], max_new_tokens: int = 8,
                    reward_fn=None) -> float:
    """Greedy-decode each prompt with HF `generate` and return the fraction scored 1 by `reward_fn`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from algorithms.rewards import get_reward_fn

    reward_fn = reward_fn or get_reward_fn("exact_match")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
    prompts = [_encode(tok, p, "")[0] for p, _ in pairs]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding for generation
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    hits = [float(reward_fn(p, t, a)) for (p, a), t in zip(pairs, texts)]
    return sum(hits) / max(len(hits), 1)
