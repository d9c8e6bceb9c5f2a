"""Online DPO (`algorithm.name: online_dpo`): preference learning from the policy's own samples.

Each step samples `rollout.n` >= 2 responses per prompt on the rollout engine and scores them with the run's
reward (rule, `module:function`, reward model or judge: `generate_and_score`, as GRPO does). In every prompt
group the best-scored response becomes the chosen answer and the worst-scored one the rejected answer; a group
whose scores are all equal teaches no preference and is skipped (`online_dpo/kept_fraction`). The pairs take
one optimizer step of the policy's DPO step (`workers.roles.dpo_step`, the loss of `algorithm.dpo`), against the
frozen `reference` role's log-probs of the same answers unless the loss is reference-free (simpo, orpo), and the
new weights are synced into the engines, so the next step samples from the updated policy.
"""

from __future__ import annotations

import torch

from algorithms import REFERENCE_FREE_LOSSES
from rlhf.data.sft import collate_sft, sample_tensors
from rlhf.driver.rl.context import StepContext, rollout_metrics
from rlhf.driver.rl.grpo import generate_and_score
from rlhf.workflow import Roles
from workers.batch import Batch
from workers.config import build
from workers.roles.dpo_step import SIDES
from workers.roles.loss_config import PreferenceLossConfig
from workers.rollout.syncer import SYNC_METRICS

Pair = tuple[int, int]  # (chosen row, rejected row) of the rollout batch


def best_worst_pairs(batch: Batch) -> tuple[list[Pair], int]:
    """(pairs, groups): per prompt group (`group_id`, in order of first appearance) the row with the highest
    score as chosen and the row with the lowest as rejected; among tied rows the first one (the samples are
    i.i.d., so the first is as good as a random pick). Groups whose scores are all equal are skipped: they
    hold no preference. `groups` counts every group, skipped or not."""
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(batch["group_id"]):
        rows.setdefault(int(g), []).append(i)
    scores = batch["scores"].float().tolist()
    pairs = []
    for members in rows.values():
        best = max(members, key=lambda i: (scores[i], -i))  # the highest score, the first row among ties
        worst = min(members, key=lambda i: (scores[i], i))  # the lowest score, the first row among ties
        if scores[best] > scores[worst]:
            pairs.append((best, worst))
    return pairs, len(rows)


def sample_item(batch: Batch, row: int) -> dict[str, torch.Tensor]:
    """One rollout row as an SFT item (`rlhf.data.sft.sample_tensors`): prompt and response ids without the
    padding, the loss on the response tokens the model wrote (`response_mask`: tool output in a multi-turn
    trajectory is not trained)."""
    ids, attn = batch["input_ids"][row], batch["attention_mask"][row].bool()
    prompt_width = ids.shape[0] - batch["responses"].shape[1]  # [prompt left-padded | response right-padded]
    mask = torch.cat([torch.zeros(prompt_width, dtype=torch.long), batch["response_mask"][row].long()])
    return sample_tensors(ids[attn].numpy(), mask[attn].numpy())


def preference_batch(batch: Batch, pairs: list[Pair]) -> Batch:
    """The DPO step's pair layout (`workers.roles.dpo_step`): `chosen_<k>` / `rejected_<k>` for k in tokens,
    labels, loss_mask, position_ids, both sides padded to the longest sequence of the pairs."""
    items = {side: [sample_item(batch, pair[s]) for pair in pairs] for s, side in enumerate(SIDES)}
    width = max(int(it["tokens"].numel()) for side in items.values() for it in side)
    out: dict[str, torch.Tensor] = {}
    for side, side_items in items.items():
        for k, v in collate_sft(side_items, 0, width).items():  # padding is masked out of the loss
            out[f"{side}_{k}"] = v
    return Batch(out)


def online_dpo_step(roles: Roles, ctx: StepContext) -> dict[str, float]:
    """Sample and score n responses per prompt, take a DPO step on each group's best-vs-worst pair, sync."""
    cfg = ctx.cfg
    batch = generate_and_score(roles, ctx)
    pairs, groups = best_worst_pairs(batch)
    pairs = pairs[: len(pairs) - len(pairs) % cfg.policy.parallel.dp]  # the DP ranks split the pairs evenly
    out = {**rollout_metrics(batch), "online_dpo/pairs": float(len(pairs)),
           "online_dpo/kept_fraction": len(pairs) / max(groups, 1)}
    if not pairs:  # every group tied: nothing to prefer, the weights stay as they are
        return out
    roles.rollout.sleep()  # colocated engines free their memory for the policy's turn; the sync wakes them
    loss = build(PreferenceLossConfig, cfg.algorithm.dpo)
    pair_batch = preference_batch(batch, pairs)
    if loss.loss not in REFERENCE_FREE_LOSSES:  # the validator asks for reference.enabled (Roles.create starts it)
        assert roles.reference is not None, "online DPO with a reference loss starts the reference role"
        with ctx.phase("reference"):
            ref = roles.reference.group.compute_pair_logps(pair_batch)
        for side in SIDES:
            pair_batch[f"ref_{side}_logps"] = ref[f"{side}_logps"]
    with ctx.phase("train"):
        train_metrics = roles.policy.group.train_preference_step(pair_batch, loss)
    with ctx.phase("sync"):
        synced = roles.rollout.sync_weights(roles.policy)
    # one optimizer step: the RL run's non-finite guard counts skipped updates as num_steps / skipped_steps
    return {**out, **train_metrics, "num_steps": 1.0, "skipped_steps": float(train_metrics.get("skipped", 0.0)),
            "rollout/version": float(roles.rollout.version),
            "sync/bytes": synced["sync/bytes"], **{k: synced[k] for k in SYNC_METRICS if k in synced}}
