"""The RL warm start on the policy's own backend (`model.warm_start_backend: megatron`): the same short SFT as
the plain-transformers loop (`rlhf.driver.warmstart.hf_sft`: the task's (prompt, answer) pairs, loss on the answer
and the end of turn, `model.warm_start_batch` random pairs per step, warmup then linear decay to a tenth of
`model.warm_start_lr`, clipping at 1), but run by a policy worker group at the policy's parallel layout
(TP, EP, DP) on the Megatron engine, before the RL roles start. The result is exported as an HF folder
under the run dir, which the RL roles then load; a resumed run reuses it.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import torch

from rlhf.config.schema import RunConfig
from workers.batch import Batch, pad_sequences
from workers.config import build
from workers.megatron.optim_config import OptimSettings

WARMUP_STEPS = 20  # as the transformers loop's
TARGET_EVERY = 10  # model.warm_start_target_accuracy: steps between accuracy checks


def warm_start_dir(cfg: RunConfig, run_dir: Path) -> Path:
    m = cfg.model
    target = "" if m.warm_start_target_accuracy is None else f"_to{m.warm_start_target_accuracy:g}"
    return run_dir / "model" / f"warm_start_{m.warm_start_steps}_megatron{target}"


def lm_batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """The LM batch (workers/roles/lm.py layout) of encoded (ids, trained) items, right-padded."""
    from workers.roles.lm import lm_batch_from_rl

    ids, attn = pad_sequences([seq for seq, _ in items], pad_value=pad_id)
    target, _ = pad_sequences([trained for _, trained in items], pad_value=0)
    return lm_batch_from_rl(Batch({"input_ids": ids, "attention_mask": attn, "loss_mask": target.float()}))


def megatron_warm_start(cfg: RunConfig, run_dir: Path, items: list, held_out: list | None = None) -> Path:
    """Fine-tune `cfg.model.path` on `items` ((prompt, answer) pairs or conversations) for
    `model.warm_start_steps` steps on a policy group of the policy's layout; export the result (see
    module docstring) and return its folder, or return the folder of an earlier run's export. With
    `model.warm_start_target_accuracy`, every TARGET_EVERY steps from halfway through the weights are exported
    and greedy-decoded on the `held_out` (prompt, answer) pairs; the first export at or above the target ends
    the warm start."""
    from rlhf.driver.warmstart.hf_sft import _encode_item, greedy_accuracy
    from rlhf.driver.warmstart.prepare import rollout_tool_schemas
    from rlhf.workflow import role_group
    from workers.roles import PolicyWorker

    m = cfg.model
    out = warm_start_dir(cfg, run_dir)
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(m.tokenizer_path or m.path)
    tools = rollout_tool_schemas(cfg)  # rendered into the prompts as the rollout renders them
    encoded: dict[int, tuple[list[int], list[int]]] = {}  # items encoded when first drawn

    def item(k: int) -> tuple[list[int], list[int]]:
        if k not in encoded:
            encoded[k] = _encode_item(tok, items[k], tools)
        return encoded[k]

    steps = m.warm_start_steps
    optim = build(OptimSettings, cfg.policy.optim, lr=m.warm_start_lr, min_lr=m.warm_start_lr / 10,
                  warmup_steps=min(WARMUP_STEPS, steps - 1), lr_decay_style="linear", weight_decay=0.0,
                  clip_grad=1.0, total_steps=steps)
    group = role_group("policy", cfg.policy, cfg, run_dir, PolicyWorker, optimizer_steps=steps,
                       optim=optim)
    rng = random.Random(cfg.trainer.seed)
    target = m.warm_start_target_accuracy
    tmp = out.with_name(out.name + ".tmp")
    t0 = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            batch = lm_batch([item(rng.randrange(len(items))) for _ in range(m.warm_start_batch)],
                             tok.pad_token_id)
            res = group.train_lm_step(batch)
            if step == 1 or step % 50 == 0 or step == steps:
                print(f"warm start (megatron) step {step}/{steps}: loss {res['loss']:.4f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
            if target is not None and held_out and step >= steps // 2 and step % TARGET_EVERY == 0 and step < steps:
                export(group, tmp, m.tokenizer_path or m.path)
                acc = greedy_accuracy(tmp, held_out, max_new_tokens=cfg.rollout.max_tokens)
                print(f"warm start (megatron) step {step}/{steps}: held-out greedy accuracy {acc:.1%} "
                      f"(target {target:.1%})", flush=True)
                if acc >= target:
                    break
        else:
            export(group, tmp, m.tokenizer_path or m.path)
        tmp.rename(out)
    finally:
        group.shutdown()
    torch.manual_seed(cfg.trainer.seed)
    return out


def export(group, tmp: Path, tokenizer: str) -> None:
    """The policy group's weights as an HF folder at `tmp` (replaced)."""
    shutil.rmtree(tmp, ignore_errors=True)
    group.save_hf_weights(str(tmp), tokenizer)
