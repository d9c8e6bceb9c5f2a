"""The same results on CUDA as on CPU (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from algorithms import (
    AGG_MODES,
    apply_kl_penalty,
    compute_advantages,
    entropy_from_logits,
    global_normalizer,
    kl_estimate,
    lm_loss,
    policy_loss,
    value_loss,
)


@pytest.mark.gpu
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    b, t, v = 6, 8, 11
    r = torch.randn(b, t, generator=gen)
    vals = torch.randn(b, t, generator=gen)
    m = (torch.arange(t)[None] < torch.tensor([8, 3, 5, 1, 0, 7])[:, None]).float()
    lp = -torch.rand(b, t, generator=gen)
    old = lp + 0.3 * torch.randn(b, t, generator=gen)
    z = torch.randn(b, t, v, generator=gen)
    labels = torch.randint(0, v, (b, t), generator=gen)
    ids = torch.tensor([0, 0, 1, 1, 2, 3])

    def run(dev):
        d = {
            k: x.to(dev)
            for k, x in dict(r=r, vals=vals, m=m, lp=lp, old=old, z=z, labels=labels, ids=ids).items()
        }
        out = []
        for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
            out += compute_advantages(
                name, token_level_rewards=d["r"], response_mask=d["m"], values=d["vals"], group_ids=d["ids"]
            )
        for mode in AGG_MODES:
            n = global_normalizer(d["m"], mode)
            out.append(policy_loss(d["lp"], d["old"], d["r"], d["m"], 0.2, 0.28, 3.0, mode, n)[0])
            out.append(value_loss(d["vals"], d["r"], d["old"], d["m"], 0.2, mode, n)[0])
            out.append(lm_loss(d["z"], d["labels"], d["m"], mode, n))
        out.append(entropy_from_logits(d["z"]))
        out += apply_kl_penalty(d["r"], kl_estimate(d["lp"], d["old"], "k3"), 0.1, d["m"])
        return [x.cpu() for x in out]

    for a, e in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
