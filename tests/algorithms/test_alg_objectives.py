"""The policy-objective registry: each objective against a per-sequence, per-token loop written from its
paper's equations (values and gradients), ppo_clip against `policy_loss` bit for bit, a throwaway objective
that reaches the loss and the config with no other edit, the Dr. GRPO preset and DAPO's overlong shaping."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import (
    OBJECTIVES,
    ObjectiveInputs,
    agg_loss,
    check_objective,
    kl_estimate,
    list_objectives,
    objective_loss,
    overlong_keep,
    overlong_penalty,
    policy_loss,
    register_objective,
)
from rlhf.config import load_config
from rlhf.driver.rl.advantages import add_advantages
from rlhf.errors import ConfigError
from workers.batch import Batch
from workers.roles.loss_config import PPOLossConfig

BASE = ["model.preset=tiny-qwen2"]
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float64)


def data(seed: int = 0, per_token_adv: bool = False, spread: float = 0.3):
    """logp (a leaf), old logp, advantages (one per row unless per_token_adv) and MASK, float64."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2 - 0.1
    logp = (old + spread * torch.randn(MASK.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    if per_token_adv:
        adv = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    else:
        adv = torch.tensor([1.3, -0.7, -1.1, 0.5], dtype=torch.float64)[:, None].expand(MASK.shape).clone()
    return logp, old, adv, MASK


def run(name: str, logp, old, adv, mask, agg: str = "token-mean", **options):
    loss, _, metrics = objective_loss(name, ObjectiveInputs(logp, old, adv, mask, agg_mode=agg), options)
    return loss, metrics


def tokens(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t] != 0]


def grad(loss: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(loss, logp, retain_graph=True)[0]


def assert_matches_reference(loss, ref, logp):
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad(loss, logp), grad(ref, logp), rtol=1e-10, atol=1e-12)


# ---- references from the papers' equations, one sequence and one token at a time ----------------------------

def gspo_reference(logp, old, adv, mask, lo, hi):
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = (prod_t pi/pi_old)^(1/|y_i|); mean_i of min(s A, clip(s) A)."""
    terms = []
    for i in range(mask.shape[0]):
        toks = tokens(mask, i)
        if not toks:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
        a = adv[i, toks[0]]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
    return sum(terms) / len(terms)


def gmpo_reference(logp, old, adv, mask, lo, hi):
    """GMPO (Zhao et al. 2025, eq. 5): mean_i of (prod_t |min(r A, clip(r, e^-lo, e^hi) A)|)^(1/|o_i|) sgn(A)."""
    terms = []
    for i in range(mask.shape[0]):
        toks = tokens(mask, i)
        if not toks:
            continue
        a = adv[i, toks[0]]
        prod = torch.ones((), dtype=logp.dtype)
        for t in toks:
            r = torch.exp(logp[i, t] - old[i, t])
            prod = prod * torch.abs(torch.minimum(r * a, torch.clamp(r, math.exp(-lo), math.exp(hi)) * a))
        terms.append(-(prod ** (1.0 / len(toks))) * torch.sign(a))
    return sum(terms) / len(terms)


def cispo_reference(logp, old, adv, mask, lo, hi):
    """CISPO (MiniMax-M1, eq. 4): sum over all tokens of sg(clip(r, 1-lo, 1+hi)) A log pi, / the token count."""
    total, n = torch.zeros((), dtype=logp.dtype), 0
    for i in range(mask.shape[0]):
        for t in tokens(mask, i):
            r = torch.exp(logp[i, t] - old[i, t]).detach()
            total = total - torch.clamp(r, 1 - lo, 1 + hi) * adv[i, t] * logp[i, t]
            n += 1
    return total / n


def sapo_reference(logp, old, adv, mask, tau_pos, tau_neg):
    """SAPO (Gao et al. 2025): mean_i of mean_t f(r) A with f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by A's sign."""
    terms = []
    for i in range(mask.shape[0]):
        toks = tokens(mask, i)
        if not toks:
            continue
        seq = torch.zeros((), dtype=logp.dtype)
        for t in toks:
            a = adv[i, t]
            tau = tau_pos if a > 0 else tau_neg
            r = torch.exp(logp[i, t] - old[i, t])
            seq = seq - torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        terms.append(seq / len(toks))
    return sum(terms) / len(terms)


def test_the_catalogue_is_registered():
    assert {"ppo_clip", "gspo", "gmpo", "cispo", "sapo"} <= set(list_objectives())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lo,hi", [(0.05, 0.08), (0.2, 0.28)])
def test_gspo_matches_the_sequence_level_reference(seed, lo, hi):
    logp, old, adv, mask = data(seed)
    loss, metrics = run("gspo", logp, old, adv, mask, "seq-mean-token-mean", clip_low=lo, clip_high=hi)
    assert_matches_reference(loss, gspo_reference(logp, old, adv, mask, lo, hi), logp)
    assert 0 < float(metrics["seq_clipfrac"]) <= 1 or lo > 0.1  # the narrow range clips some sequence


def test_gspo_clips_whole_sequences():
    logp, old, adv, mask = data(0, spread=0.0)
    with torch.no_grad():
        logp[0, :4] += 0.5  # only row 0's ratio leaves the range
    _, metrics = run("gspo", logp, old, adv, mask, "seq-mean-token-mean", clip_low=0.1, clip_high=0.1)
    assert float(metrics["seq_clipfrac"]) == pytest.approx(1 / 3)  # row 3 is padding
    assert float(metrics["clipfrac"]) == pytest.approx(4 / 11)  # all four tokens of row 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lo,hi", [(0.1, 0.15), (0.4, 0.4)])
def test_gmpo_matches_the_geometric_mean_reference(seed, lo, hi):
    logp, old, adv, mask = data(seed)
    loss, metrics = run("gmpo", logp, old, adv, mask, "seq-mean-token-mean", clip_low=lo, clip_high=hi)
    assert_matches_reference(loss, gmpo_reference(logp, old, adv, mask, lo, hi), logp)
    assert float(metrics["clipfrac"]) > 0 or lo > 0.1  # the narrow range clips some token


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lo,hi", [(0.1, 0.1), (0.99, 0.28)])
def test_cispo_matches_the_reinforce_reference(seed, lo, hi):
    logp, old, adv, mask = data(seed, per_token_adv=True)
    loss, metrics = run("cispo", logp, old, adv, mask, "token-mean", clip_low=lo, clip_high=hi)
    assert_matches_reference(loss, cispo_reference(logp, old, adv, mask, lo, hi), logp)
    assert float(metrics["clipfrac"]) > 0 or lo == 0.99


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    logp, old, adv, mask = data(0, per_token_adv=True, spread=2.0)  # most ratios far outside the clip range
    g_cispo = grad(run("cispo", logp, old, adv, mask, clip_low=0.1, clip_high=0.1)[0], logp)
    g_ppo = grad(run("ppo_clip", logp, old, adv, mask, clip_low=0.1, clip_high=0.1)[0], logp)
    live = mask.bool()
    assert int((g_cispo[live] != 0).sum()) == int(live.sum())
    assert int((g_ppo[live] == 0).sum()) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (4.0, 8.0)])
def test_sapo_matches_the_soft_gate_reference(seed, tau_pos, tau_neg):
    logp, old, adv, mask = data(seed, per_token_adv=True)
    loss, metrics = run("sapo", logp, old, adv, mask, "seq-mean-token-mean", sapo_tau_pos=tau_pos,
                        sapo_tau_neg=tau_neg)
    assert_matches_reference(loss, sapo_reference(logp, old, adv, mask, tau_pos, tau_neg), logp)
    assert 0 < float(metrics["gate_weight_mean"]) <= 1


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    """At r = 1 the gate's slope is 1: SAPO's gradient equals the unclipped PPO (policy-gradient) one."""
    logp, _, adv, mask = data(0, per_token_adv=True)
    old = logp.detach().clone()
    g_sapo = grad(run("sapo", logp, old, adv, mask, sapo_tau_pos=3.0, sapo_tau_neg=5.0)[0], logp)
    g_pg = grad(run("ppo_clip", logp, old, adv, mask)[0], logp)
    torch.testing.assert_close(g_sapo, g_pg, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["gspo", "gmpo", "cispo", "sapo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_objectives_are_split_invariant_with_the_global_normaliser(name, agg):
    from algorithms import global_normalizer

    logp, old, adv, mask = data(3)
    n = global_normalizer(mask, agg)

    def loss_of(rows):
        x = ObjectiveInputs(logp[rows], old[rows], adv[rows], mask[rows], agg_mode=agg, normalizer=n,
                            horizon=mask.shape[1])
        return objective_loss(name, x, {})[0]

    whole = loss_of(slice(0, 4))
    torch.testing.assert_close(loss_of(slice(0, 2)) + loss_of(slice(2, 4)), whole, rtol=1e-12, atol=1e-12)


def test_empty_mask_gives_zero_loss_and_finite_metrics():
    logp, old, adv, _ = data(0)
    empty = torch.zeros_like(MASK)
    for name in list_objectives():
        loss, metrics = run(name, logp, old, adv, empty)
        assert float(loss.detach()) == 0.0, name
        assert all(math.isfinite(float(v)) for v in metrics.values()), name


# ---- ppo_clip is today's loss, bit for bit -----------------------------------------------------------------

@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_ppo_clip_is_policy_loss_exactly(agg, clip_c):
    logp, old, adv, mask = data(4, per_token_adv=True, spread=1.0)
    ent = torch.rand(mask.shape, dtype=torch.float64)
    ref_logp = old - 0.1
    norm = torch.tensor(7.0, dtype=torch.float64)
    opts = {**vars(PPOLossConfig(clip_low=0.2, clip_high=0.28, clip_c=clip_c)), "unrelated": 1}
    x = ObjectiveInputs(logp, old, adv, mask, agg_mode=agg, normalizer=norm)
    loss, parts, metrics = objective_loss("ppo_clip", x, opts, entropy=ent, entropy_coef=0.01, ref_logp=ref_logp,
                                          kl_coef=0.05, kl_kind="k3")
    # the worker's loss before the registry, written out
    pg, want_metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_c, agg, normalizer=norm)
    want = pg - 0.01 * agg_loss(ent, mask, agg, normalizer=norm)
    want = want + 0.05 * agg_loss(kl_estimate(logp, ref_logp, "k3"), mask, agg, normalizer=norm)
    assert torch.equal(loss, want) and torch.equal(parts["pg_loss"], pg.detach())
    assert torch.equal(parts["loss"], want.detach())
    assert metrics.keys() == want_metrics.keys() and all(torch.equal(metrics[k], want_metrics[k]) for k in metrics)
    assert torch.equal(grad(loss, logp), grad(want, logp))


def test_terms_are_left_out_at_zero_coefficients():
    logp, old, adv, mask = data(0)
    x = ObjectiveInputs(logp, old, adv, mask)
    _, parts, _ = objective_loss("ppo_clip", x, {}, entropy=torch.ones_like(old), entropy_coef=0.0,
                                 ref_logp=old, kl_coef=0.0)
    assert set(parts) == {"pg_loss", "loss"}


# ---- a new objective needs no other edit -------------------------------------------------------------------

def test_a_throwaway_objective_reaches_the_loss_and_the_config():
    def check(throwaway_scale: float = 2.0) -> None:
        if throwaway_scale <= 0:
            raise ValueError(f"throwaway_scale must be > 0, got {throwaway_scale}")

    seen = {}

    @register_objective("throwaway_test", check=check)
    def throwaway(x: ObjectiveInputs, *, clip_high: float = 0.0, throwaway_scale: float = 2.0):
        seen.update(clip_high=clip_high, throwaway_scale=throwaway_scale)
        return agg_loss(-throwaway_scale * x.advantages * x.logp, x.mask, x.agg_mode, x.normalizer), {}

    try:
        cfg = load_config(None, BASE + ["algorithm.policy_objective=throwaway_test", "algorithm.clip_high=0.3"])
        logp, old, adv, mask = data(0)
        x = ObjectiveInputs(logp, old, adv, mask)
        loss, parts, _ = objective_loss(cfg.algorithm.policy_objective, x, vars(cfg.algorithm))
        # the config's clip_high and the function's own default for the option the schema does not declare
        assert seen == {"clip_high": 0.3, "throwaway_scale": 2.0}
        torch.testing.assert_close(loss, agg_loss(-2.0 * adv * logp, mask))
        with pytest.raises(ValueError, match="throwaway_scale must be > 0"):
            check_objective("throwaway_test", {"throwaway_scale": -1.0})
    finally:
        OBJECTIVES.pop("throwaway_test", None)
    with pytest.raises(ConfigError, match="algorithm.policy_objective: expected one of .*gspo"):
        load_config(None, BASE + ["algorithm.policy_objective=throwaway_test"])


@pytest.mark.parametrize("override,words", [
    (["algorithm.policy_objective=sapo", "algorithm.sapo_tau_neg=0"], "sapo_tau_neg must be > 0"),
    (["algorithm.policy_objective=gmpo", "algorithm.clip_high=-0.1"], "algorithm.clip_high"),
])
def test_objective_options_are_checked_by_the_objective(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, BASE + override)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "gmpo", "cispo", "sapo"])
def test_every_objective_is_a_valid_config(name):
    assert load_config(None, BASE + [f"algorithm.policy_objective={name}"]).algorithm.policy_objective == name


# ---- Dr. GRPO preset ---------------------------------------------------------------------------------------

def test_dr_grpo_preset_is_a_checked_combination():
    with pytest.raises(ConfigError, match="algorithm.preset=dr_grpo stands for algorithm.norm_by_std=false, "
                                          "algorithm.loss_agg_mode=seq-mean-token-sum-norm"):
        load_config(None, BASE + ["algorithm.preset=dr_grpo"])
    cfg = load_config(None, BASE + ["algorithm.preset=dr_grpo", "algorithm.norm_by_std=false",
                                    "algorithm.loss_agg_mode=seq-mean-token-sum-norm"])
    assert cfg.algorithm.preset == "dr_grpo"
    with pytest.raises(ConfigError, match="algorithm.preset: expected one of dr_grpo"):
        load_config(None, BASE + ["algorithm.preset=nope"])


def test_the_run_names_its_preset_at_startup(capsys):
    from rlhf.driver.rl.runner import report_preset

    cfg = load_config(None, BASE + ["algorithm.preset=dr_grpo", "algorithm.norm_by_std=false",
                                    "algorithm.loss_agg_mode=seq-mean-token-sum-norm"])
    line = "algorithm preset dr_grpo: adv_estimator=grpo, norm_by_std=False, loss_agg_mode=seq-mean-token-sum-norm"
    assert report_preset(cfg) == line and capsys.readouterr().out.strip() == line
    assert report_preset(load_config(None, BASE)) is None and capsys.readouterr().out == ""


# ---- DAPO overlong shaping and filtering -------------------------------------------------------------------

def test_overlong_penalty_is_a_linear_band_before_the_limit():
    lengths = torch.tensor([0, 12, 13, 14, 16, 20, 25])
    got = overlong_penalty(lengths, max_len=20, buffer=8, factor=0.5)
    # band (12, 20]: 0 at 12, -0.5 at 20, beyond the limit stays at -0.5
    want = torch.tensor([0.0, 0.0, -0.5 / 8, -1.0 / 8, -0.25, -0.5, -0.5])
    torch.testing.assert_close(got, want)
    assert torch.equal(overlong_penalty(lengths, 20, 0), torch.zeros(7))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 20, 21)


def test_overlong_keep_zeroes_truncated_rows():
    out = overlong_keep(MASK, torch.tensor([True, False, False, True]))
    assert torch.equal(out[0], torch.zeros(5)) and torch.equal(out[1:3], MASK[1:3]) and out.dtype == MASK.dtype


def test_overlong_shaping_and_filtering_in_the_advantages():
    cfg = load_config(None, BASE + ["rollout.max_tokens=5", "algorithm.overlong_buffer=2",
                                    "algorithm.overlong_filter=true", "algorithm.norm_by_std=false"]).algorithm
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    batch = Batch({"response_mask": mask, "scores": torch.tensor([1.0, 1.0, 1.0, 0.0])},
                  {"group_id": [0, 0, 0, 0], "finish_reason": ["stop", "stop", "length", "stop"]})
    batch, metrics = add_advantages(batch, cfg, kl_coef=0.0, max_tokens=5)
    shaped = torch.tensor([1.0, 0.5, 0.0, 0.0])  # lengths 3, 4, 5, 2 against the band (3, 5]
    torch.testing.assert_close(batch["token_level_rewards"].sum(-1), shaped)
    torch.testing.assert_close(batch["advantages"][:, 0], shaped - shaped.mean())  # the truncated row counts
    assert torch.equal(batch["response_mask"][2], torch.zeros(5, dtype=mask.dtype))
    assert torch.equal(batch["response_mask"][[0, 1, 3]], mask[[0, 1, 3]])
    assert torch.equal(batch["scores"], torch.tensor([1.0, 1.0, 1.0, 0.0]))  # reward metrics stay the task's
    assert metrics["overlong/penalty_mean"] == pytest.approx(-0.375)
    assert metrics["overlong/filtered_fraction"] == pytest.approx(0.25)


def test_overlong_settings_are_checked():
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer"):
        load_config(None, BASE + ["rollout.max_tokens=8", "algorithm.overlong_buffer=9"])
