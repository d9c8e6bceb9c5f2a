"""The TRL side of bench/grpo_vs_trl.py: TRL's GRPOTrainer on CPU, driven from a JSON spec.

Run as `python bench/_trl_grpo.py SPEC.json` (a subprocess, so its threads and memory are its own). The spec
holds the same knobs our GRPO run gets (model, prompts, reward, samples per prompt, prompts per step, max
tokens, learning rate, clip range) plus a training-time budget (the sum of step times) or a step count. It
writes `result.json` into `spec["out_dir"]`: the per-step times, the logged TRL metrics, the greedy held-out
accuracy every `eval_every` steps (clock paused) and, when `eval_val` is set, after the last step; all
measured with `rlhf.driver.warmstart.hf_sft.greedy_accuracy` on the saved weights.

The TRL settings mirror configs/grpo_tiny.yaml: one policy update per generation batch (num_iterations=1,
steps_per_generation=1, the whole batch in one micro-batch), token-mean loss ("dapo"), group-std reward
scaling, beta=0 (no reference model), asymmetric clip 0.2/0.28, a constant learning rate, AdamW with
betas (0.9, 0.999), no weight decay and gradient clipping at 1.0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run(spec: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("WANDB_DISABLED", "true")
    import torch

    torch.set_num_threads(int(spec.get("threads", os.cpu_count() or 1)))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.driver.rl.rewards import builtin_reward_fn

    out = Path(spec["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    name = spec.get("reward", "exact_match")  # a name or module:function, as our driver
    if ":" in name:  # the peer scores in-process (our driver in reward processes)
        import importlib

        module, _, fn = name.partition(":")
        reward = getattr(importlib.import_module(module), fn)
    else:
        reward = builtin_reward_fn(name)

    def reward_fn(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward(p, t, a)) for p, t, a in zip(prompts, texts, answer)]

    reward_fn.__name__ = spec.get("reward", "exact_match").rpartition(":")[2]
    train = _records(spec["train_file"])
    ds = Dataset.from_list([{"prompt": r["messages"], "answer": str(r["answer"])} for r in train])

    n, ppstep = int(spec["n"]), int(spec["prompts_per_step"])
    total = n * ppstep
    micro = int(spec.get("micro_batch") or total)
    if total % micro:
        raise SystemExit(f"micro_batch {micro} does not divide the batch of {total} completions")
    budget = spec.get("budget_s")
    max_steps = int(spec.get("max_steps") or 100_000)
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        use_vllm=False,
        bf16=bool(spec.get("bf16")),  # mixed precision: fp32 weights, bf16 autocast (generation included)
        fp16=False,
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=float(spec.get("clip_grad", 1.0)),
        # One generation batch of n * prompts_per_step completions and one optimizer step per generation,
        # in micro-batches of `micro` (steps_per_generation defaults to gradient_accumulation_steps).
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=total // micro,
        num_generations=n,
        num_iterations=1,
        max_completion_length=int(spec["max_tokens"]),
        temperature=float(spec.get("temperature", 1.0)),
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=float(spec.get("clip_low", 0.2)),
        epsilon_high=float(spec.get("clip_high", 0.28)),
        loss_type="dapo",
        scale_rewards="group",
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=int(spec.get("seed", 0)),
        data_seed=int(spec.get("seed", 0)),
        dataloader_num_workers=0,
        generation_kwargs=spec.get("generation_kwargs") or None,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"

    steps: list[dict] = []

    from rlhf.driver.warmstart.hf_sft import greedy_accuracy

    val = [(r["messages"], str(r["answer"])) for r in _records(spec["val_file"])] if spec.get("val_file") else []
    eval_every = int(spec.get("eval_every") or 0)

    def evaluate(tag: str) -> float:
        """Greedy held-out accuracy of the current weights, by the same function our side's start uses."""
        d = out / tag
        model.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        acc = greedy_accuracy(d, val, max_new_tokens=int(spec["max_tokens"]))
        model.train()
        return acc

    class Clock(TrainerCallback):
        """Per-step times. The training clock is the sum of step times (begin to end of each optimizer step,
        generation included), so the periodic evaluations do not count; training stops at the first step
        end where the clock reaches the budget."""

        def __init__(self) -> None:
            self.t0: float | None = None
            self.t_step = 0.0
            self.train_s = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t_step = time.perf_counter()
            if self.t0 is None:
                self.t0 = self.t_step

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.train_s += now - self.t_step
            row = {"step": state.global_step, "step_time_s": now - self.t_step, "train_s": self.train_s,
                   "elapsed_s": now - self.t0}
            steps.append(row)
            if budget is not None and self.train_s >= float(budget):
                control.should_training_stop = True
            if val and eval_every and (state.global_step % eval_every == 0 or control.should_training_stop):
                row["val_accuracy"] = evaluate("eval_model")

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1].update({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    setup_s = time.perf_counter() - t_start
    trainer.train()
    train_wall_s = steps[-1]["elapsed_s"] if steps else 0.0
    result: dict = {"setup_s": setup_s, "steps": steps, "train_wall_s": train_wall_s,
                    "train_s": steps[-1]["train_s"] if steps else 0.0,
                    "num_steps": len(steps), "torch_threads": torch.get_num_threads()}
    if spec.get("eval_val"):
        result["val_accuracy"] = steps[-1]["val_accuracy"] if steps and "val_accuracy" in steps[-1] \
            else evaluate("hf")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/_trl_grpo.py SPEC.json")
    res = run(json.loads(Path(sys.argv[1]).read_text()))
    print(json.dumps({k: v for k, v in res.items() if k != "steps"}))
