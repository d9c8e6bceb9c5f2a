"""`algorithms.preference_loss` equals TRL's loss computations (value and gradients, 1e-5) on fixed inputs.

TRL 1.16's `DPOTrainer._compute_loss` gives `sigmoid` (no label smoothing there) and `ipo` (log-ratios
averaged per answer token); it is run with a minimal trainer object and a stand-in model whose per-token
log-probs spread each sequence's log-prob over its answer tokens. Conservative DPO (`sigmoid` with label
smoothing) and `simpo` are TRL's `CPOTrainer.cpo_loss` (sigmoid / simpo) on the log-ratios, resp. the
length-averaged log-probs."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from algorithms import preference_loss

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="TRL is not installed (test extra: trl)")
trl_cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer", reason="TRL is not installed")

B, S = 6, 9


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S - 2, (2 * B,), generator=g)
    mask = torch.zeros(2 * B, S, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        mask[i, S - n:] = 1  # answer tokens at the end, after the prompt
    return {
        "logps": -torch.rand(2 * B, generator=g, dtype=torch.float64) * 8,  # [chosen; rejected]
        "ref": -torch.rand(2 * B, generator=g, dtype=torch.float64) * 8,
        "mask": mask,
    }


class _Model:
    """Stands in for the policy: per-token log-probs that sum to each row's sequence log-prob."""

    training = True

    def __init__(self, seq_logps: torch.Tensor, mask: torch.Tensor) -> None:
        shift = mask[:, 1:].to(seq_logps.dtype)
        self.log_probs = seq_logps[:, None] * shift / shift.sum(1, keepdim=True)
        self.n = mask.shape[0]

    def __call__(self, **_: object) -> SimpleNamespace:
        z = torch.zeros(self.n, S - 1, dtype=self.log_probs.dtype)
        return SimpleNamespace(log_probs=self.log_probs, entropy=z, mean_logits=z, is_top1=z.bool())


def _trl_dpo(inp: dict, seq_logps: torch.Tensor, loss_type: str, beta: float) -> torch.Tensor:
    model = _Model(seq_logps, inp["mask"])
    acc = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        model=model, accelerator=acc, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1)
    ref_c, ref_r = inp["ref"].chunk(2)
    batch = {"input_ids": torch.zeros(2 * B, S, dtype=torch.long), "attention_mask": torch.ones(2 * B, S),
             "completion_mask": inp["mask"], "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    return trl_dpo.DPOTrainer._compute_loss(trainer, model, batch, return_outputs=False)


def _ours(inp: dict, seq_logps: torch.Tensor, **kw: object) -> tuple[torch.Tensor, dict]:
    c, r = seq_logps.chunk(2)
    ref_c, ref_r = inp["ref"].chunk(2)
    n_c, n_r = inp["mask"][:, 1:].sum(1).chunk(2)
    losses, metrics = preference_loss(c, r, ref_c, ref_r, n_c, n_r, **kw)  # type: ignore[arg-type]
    return losses.mean(), metrics


def _both(fn_ref, fn_ours, inp):
    a = inp["logps"].clone().requires_grad_(True)
    b = inp["logps"].clone().requires_grad_(True)
    ref_loss, ours = fn_ref(a), fn_ours(b)
    ref_loss.backward()
    ours.backward()
    assert abs(ours.item() - ref_loss.item()) < 1e-5, (ours.item(), ref_loss.item())
    assert torch.allclose(b.grad, a.grad, atol=1e-5), (b.grad, a.grad)
    assert a.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("ipo", 0.1), ("ipo", 0.5)])
def test_dpo_losses_equal_trl_dpo_trainer(loss_type: str, beta: float) -> None:
    inp = _inputs(1)
    _both(lambda x: _trl_dpo(inp, x, loss_type, beta),
          lambda x: _ours(inp, x, loss=loss_type, beta=beta)[0], inp)


def _cpo(loss_type: str, beta: float, eps: float, gamma: float = 0.0):
    self = SimpleNamespace(alpha=0.0, loss_type=loss_type, simpo_gamma=gamma, beta=beta, label_smoothing=eps,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    return lambda c, r: trl_cpo.CPOTrainer.cpo_loss(self, c, r)[0].mean()


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_conservative_dpo_equals_trl_smoothed_sigmoid(eps: float) -> None:
    inp = _inputs(2)
    cpo = _cpo("sigmoid", 0.2, eps)

    def ref(x):  # CPO's sigmoid on the policy-minus-reference log-ratios is conservative DPO
        lr = x - inp["ref"]
        return cpo(*lr.chunk(2))

    _both(ref, lambda x: _ours(inp, x, loss="sigmoid", beta=0.2, label_smoothing=eps)[0], inp)


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_equals_trl(beta: float, gamma: float, eps: float) -> None:
    inp = _inputs(3)
    cpo = _cpo("simpo", beta, eps, gamma)
    n = inp["mask"][:, 1:].sum(1)
    _both(lambda x: cpo(*(x / n).chunk(2)),
          lambda x: _ours(inp, x, loss="simpo", beta=beta, label_smoothing=eps, simpo_gamma=gamma)[0], inp)


def test_simpo_ignores_the_reference_and_metrics() -> None:
    inp = _inputs(4)
    c, r = inp["logps"].chunk(2)
    n = torch.full((B,), 3)
    loss, m = preference_loss(c, r, None, None, n, n, loss="simpo", beta=2.0)
    assert loss.shape == (B,)
    assert torch.allclose(m["rewards/margin"], 2.0 * (c - r) / 3)
    assert torch.equal(m["rewards/accuracy"], (c > r).double())
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss(c, r, None, None, n, n, loss="sigmoid")
    with pytest.raises(ValueError, match="unknown preference loss 'xpo'"):
        preference_loss(c, r, c, r, n, n, loss="xpo")
    with pytest.raises(ValueError, match="kto' needs the KL baseline"):
        preference_loss(c, r, c, r, n, n, loss="kto")


def test_bradley_terry_equals_trl_reward_trainer() -> None:
    """TRL 1.16's `RewardTrainer.compute_loss` (no margin, no centring) on a stand-in model whose logits are
    the scores [chosen; rejected]; ours is the per-pair loss, averaged here as TRL does."""
    from algorithms import bradley_terry_loss

    trl_rm = pytest.importorskip("trl.trainer.reward_trainer", reason="TRL is not installed")
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2 * B, generator=g, dtype=torch.float64) * 3

    class _RM:
        training = True

        def __init__(self, s: torch.Tensor) -> None:
            self.s = s

        def __call__(self, **_: object) -> SimpleNamespace:
            return SimpleNamespace(logits=self.s[:, None])

    def trl(x: torch.Tensor) -> torch.Tensor:
        model = _RM(x)
        acc = SimpleNamespace(gather=lambda t: t, gather_for_metrics=lambda t: t)
        trainer = SimpleNamespace(model=model, accelerator=acc, args=SimpleNamespace(center_rewards_coefficient=None),
                                  _total_train_tokens=0, _tp_size=1, _metrics={"train": defaultdict(list)})
        inputs = {"input_ids": torch.zeros(2 * B, S, dtype=torch.long), "attention_mask": torch.ones(2 * B, S)}
        return trl_rm.RewardTrainer.compute_loss(trainer, model, inputs)

    def ours(x: torch.Tensor) -> torch.Tensor:
        losses, m = bradley_terry_loss(*x.chunk(2))
        c, r = x.detach().chunk(2)
        assert torch.equal(m["accuracy"], (c > r).double()) and torch.allclose(m["margin"], c - r)
        return losses.mean()

    _both(trl, ours, {"logps": scores})


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
def test_nll_term_adds_the_chosen_answers_mean_token_nll(loss: str) -> None:
    """nll_coef > 0 (RPO) adds alpha x the chosen answer's mean token NLL to each pair's loss, and its
    gradient -alpha / n_chosen on the chosen log-prob; the rejected answer's gradient is unchanged."""
    inp = _inputs(5)
    c, r = inp["logps"].chunk(2)
    ref_c, ref_r = inp["ref"].chunk(2)
    n_c, n_r = inp["mask"][:, 1:].sum(1).chunk(2)
    grads = []
    for alpha in (0.0, 0.7):
        cc, rr = c.clone().requires_grad_(True), r.clone().requires_grad_(True)
        losses, m = preference_loss(cc, rr, ref_c, ref_r, n_c, n_r, loss=loss, beta=0.3, nll_coef=alpha)
        losses.sum().backward()
        grads.append((losses.detach(), cc.grad, rr.grad))
        assert torch.allclose(m["nll/chosen"], -c / n_c)
    (l0, gc0, gr0), (l1, gc1, gr1) = grads
    assert torch.allclose(l1 - l0, 0.7 * -c / n_c)
    assert torch.allclose(gc1 - gc0, -0.7 / n_c.double()) and torch.equal(gr1, gr0)
