"""A tiny LLM judge whose verdicts are known: an HF causal LM (tiny-llama's architecture and tokenizer) whose
weights are planted so that greedy decoding follows a bigram table.

Every attention and MLP block adds nothing to the residual stream (o_proj and down_proj are zero), so the
logits at a position depend on that position's token alone: the model is a bigram table. Each token of
`verdict` (and each trigger token) gets a basis direction of the hidden space as its embedding, every other
token the direction of the start state, and the output head maps a direction to the next token. After a
prompt that ends in one of the `triggers`' last tokens the judge says `verdict` and stops; after any other
prompt it stops at once (an empty, malformed verdict). Real weights run by the real engines: only the
numbers are chosen."""

from __future__ import annotations

from pathlib import Path

EMBED_SCALE, HEAD_SCALE = 4.0, 10.0


def planted_judge(out: Path, verdict: str = "Score: 9", triggers: tuple[str, ...] = ("0", "1", "2", "3", "4"),
                  base: str | Path | None = None, even_ids: bool = False) -> Path:
    """Write the judge's HF folder to `out` (from a copy of `base`, a tiny-llama folder, when given) and return
    it. With `even_ids` every ordinary token of even id is a trigger too (about half of a random text's last
    tokens)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from rlhf.tiny_models import create_tiny_model

    if base is not None:
        shutil.copytree(base, out, dirs_exist_ok=True)
    else:
        create_tiny_model("tiny-llama", out)
    tok = AutoTokenizer.from_pretrained(out)
    chain = tok.encode(verdict, add_special_tokens=False)
    starts = [tok.encode(t, add_special_tokens=False)[-1] for t in triggers]
    if even_ids:
        special = set(tok.all_special_ids)
        starts += [t for t in range(0, len(tok), 2) if t not in special and t not in chain and t not in starts]
    if len(set(chain)) != len(chain) or set(chain) & set(starts):
        raise ValueError(f"the verdict {verdict!r} repeats a token or shares one with a trigger")
    weights = load_file(out / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    hidden = embed.shape[1]
    if 2 + len(chain) > hidden:  # the start state, the triggers' state and one per verdict token
        raise ValueError("more states than hidden dimensions")

    def direction(state: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(state), hidden).float()

    embed.copy_(EMBED_SCALE * direction(0).expand_as(embed))  # the start state: stop at once
    head.zero_()
    head[tok.eos_token_id] = HEAD_SCALE * direction(0)
    state = 1
    trigger_state = state
    for t in starts:  # every trigger leads to the verdict's first token
        embed[t] = EMBED_SCALE * direction(trigger_state)
    head[chain[0]] = HEAD_SCALE * direction(trigger_state)
    for i, t in enumerate(chain):  # each verdict token leads to the next, the last to the end of the turn
        state += 1
        embed[t] = EMBED_SCALE * direction(state)
        nxt = chain[i + 1] if i + 1 < len(chain) else tok.eos_token_id
        head[nxt] = head[nxt] + HEAD_SCALE * direction(state)
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
