"""`SamplingConfig`: what one `generate` call samples, validated before the engine sees it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from workers.config import build


@dataclass
class SamplingConfig:
    """Sampling options of one generate call.

    `seed` None samples non-deterministically; with a seed, prompt i of the call samples with seeds
    `seed + i * n + j` (j < n), so every sample of the batch has its own stream and a call is reproducible.
    The returned logprobs are those of the engine's `logprobs_mode` (an engine option, see EngineConfig).
    """

    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # stop strings (not in the response)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = 0
    ignore_eos: bool = False

    def validate(self) -> SamplingConfig:
        """Raise ValueError naming the first bad field; return self."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingConfig.{name}={getattr(self, name)!r} is invalid: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be an integer > 0")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be finite and >= 0 (0 is greedy)")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must lie in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be None or an integer >= 0")
        return self

    def with_(self, **changes: Any) -> SamplingConfig:
        """A validated copy with `changes` applied."""
        return replace(self, **changes).validate()

    def to_vllm(self, seed: int | None = None, logprobs: bool = True):
        """The vLLM `SamplingParams` for one prompt (n samples); `seed` overrides self.seed."""
        from vllm import SamplingParams

        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else 0,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop) or None,
            stop_token_ids=list(self.stop_token_ids) or None,
            seed=seed if seed is not None else self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=0 if logprobs else None,
            flat_logprobs=True,  # one flat list per sample instead of a dict per token
            # vLLM detokenises token by token; it is only needed to find stop strings. Otherwise the
            # worker decodes all responses in one batched call afterwards.
            detokenize=bool(self.stop),
            skip_special_tokens=True,
        )


def as_sampling(sampling: SamplingConfig | dict[str, Any] | None) -> SamplingConfig:
    """A validated SamplingConfig from a SamplingConfig, a dict of its fields or None (the defaults)."""
    return build(SamplingConfig, sampling).validate()
