"""lm-evaluation-harness's model interface (`lm_eval.api.model.LM`) over our rollout engine, so lm-eval task
definitions are scored by the engine that `rlhf eval` and training use (batched, prefix caching)."""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import LM

from rlhf.eval.items import Item
from rlhf.eval.loglik import context_ids, option_logprobs
from rlhf.progress import progress_bar

LL_CHUNK = 256  # requests per engine call: the bar moves between calls


class EngineLM(LM):
    """`loglikelihood` by our option scoring (`option_logprobs`: next-token log-probs through the prefix cache
    for short continuations, prompt log-probs for long ones); `generate_until` by `engine.generate`, with the
    task's stop strings and `max_gen_toks` (else `opts.max_tokens`). `greedy_check`: also say whether each
    continuation is the greedy one (a greedy generation per request; only `loglikelihood` tasks read it)."""

    def __init__(self, engine: Any, tokenizer: Any, opts: Any, greedy_check: bool = False) -> None:
        super().__init__()
        self.engine, self.tokenizer, self.opts, self.greedy_check = engine, tokenizer, opts, greedy_check

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        bar = progress_bar(len(requests), "loglikelihood", unit="req", enabled=self.opts.progress and not disable_tqdm,
                           leave=False)
        for start in range(0, len(requests), LL_CHUNK):
            chunk = [r.args for r in requests[start:start + LL_CHUNK]]
            lps = option_logprobs(self.engine, self.tokenizer, [Item(ctx, None, choices=[cont]) for ctx, cont in chunk])
            greedy = self._greedy(chunk) if self.greedy_check else [False] * len(chunk)
            out += [(lp[0], g) for lp, g in zip(lps, greedy)]
            bar.update(len(chunk))
        bar.close()
        return out

    def _greedy(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """Whether greedy decoding after each context produces exactly the continuation's tokens."""
        from workers.batch import Batch
        from workers.rollout import SamplingConfig

        ctxs = [context_ids(self.tokenizer, c) for c, _ in pairs]
        conts = [self.tokenizer.encode(c, add_special_tokens=False) for _, c in pairs]
        sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=max(len(c) for c in conts)).validate()
        res = self.engine.generate(Batch(meta={"prompt_ids": ctxs}), sampling)
        got = [row[mask.bool()].tolist() for row, mask in zip(res["responses"], res["response_mask"])]
        return [g[:len(c)] == c for g, c in zip(got, conts)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("perplexity tasks (loglikelihood_rolling) are not supported")

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from workers.batch import Batch
        from workers.rollout import SamplingConfig

        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            kw = r.args[1]
            until = kw.get("until", [])
            key = (tuple([until] if isinstance(until, str) else until), int(kw.get("max_gen_toks", self.opts.max_tokens)),
                   float(kw.get("temperature", 0.0)) if kw.get("do_sample", False) else 0.0)
            groups.setdefault(key, []).append(i)
        out = [""] * len(requests)
        bar = progress_bar(len(requests), "generate", unit="req", enabled=self.opts.progress and not disable_tqdm,
                           leave=False)
        for (until, max_tokens, temperature), idx in groups.items():
            sampling = SamplingConfig(n=1, temperature=temperature, max_tokens=max_tokens, seed=self.opts.seed,
                                      stop=list(until)).validate()
            for start in range(0, len(idx), LL_CHUNK):
                part = idx[start:start + LL_CHUNK]
                res = self.engine.generate(Batch(meta={"prompt": [requests[i].args[0] for i in part]}), sampling)
                for i, text in zip(part, res["response_text"]):
                    out[i] = text
                bar.update(len(part))
        bar.close()
        return out
