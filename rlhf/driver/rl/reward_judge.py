"""`reward.judge`: a generative reward model (an LLM judge) on rollout engines of its own.

The judge is any HF causal LM, served by a second rollout group (workers.rollout.RolloutGroup named `judge`,
started beside the run's other roles by rlhf.workflow.Roles). Each sample becomes one judge prompt,
`reward.judge.prompt_template` with the sample's `{prompt}`, `{response}` and `{ground_truth}` (a user turn of
the judge's chat template with `reward.judge.chat`), and the judge's greedy verdict becomes a number
(algorithms.judge_verdicts.parse_verdict). A verdict that gives none is `malformed`; a judge prompt longer than
the judge's context less `reward.judge.max_tokens` is an error and is not sent. Both are scored by
`reward.on_error` (rlhf/driver/rl/rewards.py). The judge's engine time is `time/judge`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from algorithms.judge_verdicts import judge_prompt, parse_verdict
from rlhf.config.schema import JudgeConfig
from rlhf.driver.rl.reward_pool import Outcome
from workers.batch import Batch
from workers.config import build


def judge_group(jc: JudgeConfig, timeout_s: float, log_dir: Path) -> Any:
    """The judge's engines, started and ready (their logs under `log_dir/judge/`)."""
    from workers.rollout import EngineConfig, RolloutGroup

    assert jc.model_path
    engine = build(EngineConfig, jc, model_path=jc.model_path).validate()
    return RolloutGroup(engine, jc.num_engines, timeout_s=timeout_s, name="judge", log_dir=log_dir)


class Judge:
    """Scores samples with the judge engines `group` (a RolloutGroup of `jc.model_path`)."""

    def __init__(self, jc: JudgeConfig, group: Any) -> None:
        from rlhf.data.checks import max_positions
        from rlhf.data.tokenizer import load_tokenizer
        from workers.rollout.sampling import SamplingConfig

        assert jc.model_path
        self.group, self.template = group, jc.prompt_template
        self.pattern, self.choices = re.compile(jc.pattern), dict(jc.choices)
        self.tokenizer = load_tokenizer(jc.model_path)
        self.chat = jc.chat and bool(getattr(self.tokenizer, "chat_template", None))
        self.sampling = SamplingConfig(n=1, temperature=0.0, max_tokens=jc.max_tokens, seed=0).validate()
        self.max_prompt = (max_positions(jc.model_path) or 1 << 30) - jc.max_tokens
        self.seconds = 0.0

    def prompts(self, samples: Sequence[tuple[Any, Any, Any]]) -> tuple[list[list[int]], list[str]]:
        """The judge prompt of each sample: token ids and text."""
        from workers.rollout.prompts import normalise

        texts = [judge_prompt(self.template, *s) for s in samples]
        meta = ({"messages": [[{"role": "user", "content": t}] for t in texts]} if self.chat else {"prompt": texts})
        p = normalise(Batch(meta=meta), self.tokenizer)
        return p.ids, p.text

    def score(self, samples: Sequence[tuple[Any, Any, Any]]) -> list[Outcome]:
        """One Outcome per sample: the verdict's score, kind `malformed` (the verdict gives none) or an error
        (a judge prompt too long for the judge)."""
        if not samples:
            return []
        ids, texts = self.prompts(samples)
        out = [Outcome(kind="error", message=f"has a judge prompt of {len(x)} tokens, more than the judge's context "
                                             f"less reward.judge.max_tokens ({self.max_prompt})") for x in ids]
        fit = [i for i, x in enumerate(ids) if len(x) <= self.max_prompt]
        if fit:
            t0 = time.perf_counter()
            batch = self.group.generate(Batch(meta={"prompt_ids": [ids[i] for i in fit],
                                                    "prompt": [texts[i] for i in fit]}), self.sampling)
            self.seconds += time.perf_counter() - t0
            for i, verdict in zip(fit, batch["response_text"]):
                value = parse_verdict(verdict, self.pattern, self.choices)
                shown = verdict[:60] + ("..." if len(verdict) > 60 else "")
                out[i] = Outcome(value=value) if value is not None else Outcome(
                    kind="malformed", message=f"gave the malformed verdict {shown!r}")
        return out

    def pop_metrics(self) -> dict[str, float]:
        """`time/judge`: the judge engines' time since the last call."""
        out, self.seconds = {"time/judge": self.seconds}, 0.0
        return out

    def shutdown(self) -> None:
        self.group.shutdown()
