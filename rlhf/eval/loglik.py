"""Log-likelihoods of continuations on the rollout engine: the scoring behind multiple-choice tasks, ours and
lm-evaluation-harness's (`EngineLM.loglikelihood`)."""

from __future__ import annotations

from typing import Any

from rlhf.eval.items import Item

SHORT_OPTION_TOKENS = 4  # options up to this long are scored token by token from the prefix cache


def option_logprobs(engine: Any, tokenizer: Any, items: list[Item]) -> list[list[float]]:
    """Sum of the log-probs of each option's tokens after its item's context, from the engine.

    Short options (MMLU's letters) are scored token by token: one next-token request per distinct prefix
    (context + the option's first j tokens), asking for the log-probs of every option token that follows it;
    those requests share their prefixes through the prefix cache. Longer options are scored whole by prompt
    log-probs (which vLLM computes without the cache)."""
    out: list[list[float]] = [[] for _ in items]
    prefixes: dict[tuple[int, ...], set[int]] = {}
    short: list[tuple[int, list[int], list[list[int]]]] = []
    seqs, spans = [], []
    for i, it in enumerate(items):
        ctx = context_ids(tokenizer, it.prompt)
        conts = [tokenizer.encode(c, add_special_tokens=False) for c in it.choices]
        if max(len(c) for c in conts) <= SHORT_OPTION_TOKENS:
            short.append((i, ctx, conts))
            for cont in conts:
                for j, tok in enumerate(cont):
                    prefixes.setdefault(tuple(ctx + cont[:j]), set()).add(tok)
        else:
            for cont in conts:
                seqs.append(ctx + cont)
                spans.append((i, len(ctx), len(cont)))
    if prefixes:
        keys = list(prefixes)
        lps = engine.next_token_logprobs([list(k) for k in keys], [sorted(prefixes[k]) for k in keys])
        table = {k: dict(zip(sorted(prefixes[k]), lp)) for k, lp in zip(keys, lps)}
        for i, ctx, conts in short:
            out[i] = [sum(table[tuple(ctx + c[:j])][t] for j, t in enumerate(c)) for c in conts]
    if seqs:
        scores = engine.score_all(seqs)[0]  # one engine's view is enough
        for lp, (i, start, n) in zip(scores, spans):
            out[i].append(sum(lp[start - 1:start - 1 + n]))
    return out


def context_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """The context's token ids; an empty context is the end-of-text token (something to condition on)."""
    ids = tokenizer.encode(prompt) if prompt else []
    return ids or [tokenizer.eos_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id]
