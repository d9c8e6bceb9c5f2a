"""The workflow API: declare roles from a config, then write the RL step as plain Python over role handles.

    roles = Roles.create(cfg, run_dir)
    batch = roles.rollout.generate(prompts)          # n samples per prompt, with sampled logprobs
    batch = roles.reward(batch)                      # `scores` [B]; or generate(prompts, score=roles.reward):
                                                     # each engine's samples scored as they return
    batch = roles.reference.logprobs(batch)          # `ref_logprobs` [B, R] (a distillation teacher: roles.teacher)
    batch = roles.policy.logprobs(batch)             # `old_logprobs` [B, R]
    batch, _ = add_advantages(batch, cfg.algorithm, kl_coef)
    metrics = roles.policy.train(batch)
    roles.rollout.sync_weights(roles.policy)

Each handle wraps a worker group (or the rollout actor) and keeps the Batch field names in one place.
The built-in GRPO and PPO steps (`rlhf.driver.rl.grpo`, `rlhf.driver.rl.ppo`) are written with this API.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from algorithms import REFERENCE_FREE_LOSSES
from rlhf.config.schema import RewardConfig, RoleConfig, RunConfig
from rlhf.driver.rl.reward_judge import judge_group
from rlhf.driver.rl.rewards import RewardScorer
from workers.agent.options import AgentOptions
from workers.batch import Batch
from workers.config import build
from workers.megatron.optim_config import OptimSettings
from workers.roles.loss_config import PPOLossConfig, ValueLossConfig
from workers.roles.options import MegatronOptions
from workers.roles.routes import POLICY_ROUTES_KEY, ROUTES_KEY
from workers.vision.inputs import IMAGE_KEYS


def loss_config(cfg: RunConfig) -> PPOLossConfig:
    """The policy's loss settings from the algorithm section; KL is in the reward, not the loss, when
    algorithm.kl_in_reward."""
    a = cfg.algorithm
    return build(PPOLossConfig, a, kl_coef=0.0 if a.kl_in_reward else a.kl_coef)


def value_loss_config(cfg: RunConfig) -> ValueLossConfig:
    """The critic's loss settings from the algorithm section."""
    return build(ValueLossConfig, cfg.algorithm)


def sampling_temperature(cfg: RunConfig) -> float:
    """The temperature the policy's log-probs are taken at: the rollout's (1 for greedy rollouts), so the
    importance ratios compare the distribution the responses were sampled from."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def records_routes(cfg: RunConfig) -> bool:
    """Whether the rollout engine records its MoE routing (`routed_experts`): for routing replay
    (`policy.moe.routing_replay`), and for the routing mismatch of the steps that recompute the old
    log-probs. Dense models and multi-turn rollouts (tools, an environment) record none."""
    from rlhf.config.validate import model_shape

    if cfg.rollout.tools or cfg.rollout.env:
        return False
    shape = model_shape(cfg.model.path, cfg.model.preset)
    if shape is None or not shape.num_experts:
        return False
    return bool(cfg.policy.moe.routing_replay or cfg.algorithm.old_logprobs == "recompute")


def needs_reference(cfg: RunConfig) -> bool:
    """Whether the RL step uses the `reference` role: a KL term (algorithm.kl_coef > 0), or online DPO with a
    loss that compares with the reference (all but the reference-free ones)."""
    a = cfg.algorithm
    return a.kl_coef > 0 or (a.name == "online_dpo" and a.dpo.loss not in REFERENCE_FREE_LOSSES)


def role_group(role: str, rc: RoleConfig, cfg: RunConfig, run_dir: Path, worker_cls: type,
               optimizer_steps: int | None = None, pool=None, model_path: str | None = None, **init: Any):
    """The role's worker group; `model_path` (else the role's, else the run's model) is the HF folder it
    loads; its LR schedule spans `optimizer_steps` (default: the RL run's, one per mini-batch per PPO epoch
    per RL step)."""
    from workers.group import WorkerGroup

    par, a = rc.parallel, cfg.algorithm
    steps = optimizer_steps or max(1, cfg.trainer.total_steps * a.ppo_epochs * a.mini_batches)
    return WorkerGroup(  # the resources section's fields are WorkerGroup arguments of the same names
        role=role, worker_cls=worker_cls, tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, **vars(rc.resources),
        timeout_s=cfg.trainer.timeout_s, log_dir=run_dir / "logs", seed=cfg.trainer.seed, resource_pool=pool,
        init_kwargs=vars(build(MegatronOptions, rc, **{  # `init` may replace any of these (e.g. the optimizer)
            "model_path": model_path or rc.model_path or cfg.model.path,
            "optim": build(OptimSettings, rc.optim, total_steps=steps), "ep": par.ep, **init})),
    )


RESPONSE_KEYS = ["input_ids", "attention_mask", "responses", "response_mask"]


def model_view(batch: Batch, keys: list[str]) -> Batch:
    """`keys` of the batch plus the image inputs a vision-language model takes (when the batch has them)."""
    return batch.select([*keys, *(k for k in IMAGE_KEYS if k in batch)])


class PolicyHandle:
    """The policy (or reference) worker group; log-probs are taken at the rollout's `temperature`. With
    `routes` (the policy of an MoE run whose engine records its routing) the rollout's `routed_experts` go
    along (replayed with `policy.moe.routing_replay`) and the experts the policy used come back as
    `policy_routed_experts`."""

    def __init__(self, group: Any, temperature: float = 1.0, routes: bool = False) -> None:
        self.group, self.temperature, self.routes = group, temperature, routes

    def logprobs(self, batch: Batch, key: str = "old_logprobs", entropy: bool = False,
                 top1: str | None = None) -> Batch:
        """`key` [B, R]: the responses' log-probs; `entropy` too when asked; with `top1`, the greedy token id
        at each response position under that name."""
        routed = self.routes and ROUTES_KEY in batch
        out = self.group.compute_logprobs(model_view(batch, [*RESPONSE_KEYS, ROUTES_KEY] if routed else RESPONSE_KEYS),
                                          with_entropy=entropy, key=key, temperature=self.temperature,
                                          top1_key=top1)
        batch[key] = out[key]
        if top1:
            batch[top1] = out[top1].long()
        if entropy:
            batch["entropy"] = out["entropy"]
        if routed and POLICY_ROUTES_KEY in out:
            batch[POLICY_ROUTES_KEY] = out[POLICY_ROUTES_KEY]
        return batch

    def train(self, batch: Batch, loss: PPOLossConfig | dict[str, Any]) -> dict[str, float]:
        """One PPO update with `loss_config(cfg)`, log-probs at the rollout's temperature."""
        return self.group.train_step(batch, loss, temperature=self.temperature)

    def train_lm(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the LM loss on the responses of an RL-layout batch (its prompt and the tokens
        outside `response_mask` are context only): loss, tokens, grad_norm, lr."""
        from workers.roles.lm import lm_batch_from_rl

        prompt = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        targets = torch.cat([torch.zeros(len(batch), prompt), batch["response_mask"].float()], dim=1)
        return self.group.train_lm_step(lm_batch_from_rl(Batch({"input_ids": batch["input_ids"],
                                                                 "attention_mask": batch["attention_mask"],
                                                                 "loss_mask": targets})))

    def save(self, path: Path) -> None:
        self.group.save_checkpoint(str(path))

    def load(self, path: Path, load_optim: bool = True, trust: bool = False) -> None:
        """Load a `save` folder; one without a matching manifest only with `trust` (ckpt_manifest.py)."""
        self.group.load_checkpoint(str(path), load_optimizer=load_optim, trust=trust)

    def export_hf(self, path: Path, tokenizer_dir: str | None = None) -> None:
        """Write the full weights as an HF folder (safetensors, config, tokenizer files)."""
        self.group.save_hf_weights(str(path), tokenizer_path=tokenizer_dir)

    def shutdown(self) -> None:
        self.group.shutdown()


class CriticHandle(PolicyHandle):
    def train(self, batch: Batch, loss: ValueLossConfig | dict[str, Any]) -> dict[str, float]:  # type: ignore[override]
        """One value update with `value_loss_config(cfg)`."""
        return self.group.train_step(batch, loss)

    def values(self, batch: Batch) -> Batch:
        out = self.group.compute_values(model_view(batch, RESPONSE_KEYS))
        batch["values"] = out["values"]
        return batch


class RewardHandle:
    """A rule function (`reward.fn`, scored by `RewardScorer`), a reward service (`reward.url`; `reward.judge`,
    whose engines `Roles.create` starts and `attach_judge` hands over) or a reward-model group; adds `scores`
    [B]. With a service or a model beside the function, they score (`__call__`) and the rule checks
    (`check_scores`, validation's accuracy)."""

    def __init__(self, reward: RewardConfig | None, model_group: Any = None) -> None:
        self.config = reward
        self.scorer = RewardScorer(reward) if reward is not None and reward.fn else None
        self.service = RewardScorer.for_url(reward) if reward is not None and reward.url else None
        self.model_group = model_group

    def attach_judge(self, group: Any) -> None:
        """Score with the judge engines `group` (started by `Roles.create` for `reward.judge`)."""
        from rlhf.driver.rl.reward_judge import Judge

        assert self.config is not None
        self.service = RewardScorer.for_judge(self.config, Judge(self.config.judge, group))

    def __call__(self, batch: Batch) -> Batch:
        if "env_reward" in batch:  # an environment scored the trajectories (rollout.env)
            batch["scores"] = torch.tensor(batch["env_reward"], dtype=torch.float32)
        elif self.model_group is not None:
            batch["scores"] = self.model_group.compute_scores(model_view(batch, ["input_ids", "attention_mask"]))["scores"]
        elif self.service is not None or self.scorer is not None:
            gts = batch["ground_truth"] if "ground_truth" in batch else [None] * len(batch)
            scorer = self.service or self.scorer
            assert scorer is not None
            batch["scores"] = scorer.score(batch["prompt"], batch["response_text"], gts)
        return batch

    def check_scores(self, batch: Batch) -> torch.Tensor:
        """The scores validation's accuracy counts: the rule's when a reward model or service scores the batch
        and the prompts have ground truths, else the batch's `scores`."""
        gts = batch["ground_truth"] if "ground_truth" in batch else [None]  # noqa: SIM401 - Batch has no .get
        scored_elsewhere = self.model_group is not None or self.service is not None
        if not scored_elsewhere or self.scorer is None or all(g is None for g in gts):
            return batch["scores"]
        return self.scorer.score(batch["prompt"], batch["response_text"], gts)

    def pop_metrics(self) -> dict[str, float]:
        """Reward calls scored by the fallback since the last call (`reward/errors`, `reward/timeouts`, a
        judge's `reward/judge_malformed`), summed over the rule and the service; a judge's `time/judge`."""
        out: dict[str, float] = {}
        for scorer in (self.scorer, self.service):
            for k, v in (scorer.pop_metrics() if scorer is not None else {}).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def shutdown(self) -> None:
        for scorer in (self.scorer, self.service):
            if scorer is not None:
                scorer.shutdown()
        if self.model_group is not None:
            self.model_group.shutdown()


def prompt_batch(records: list[dict[str, Any]]) -> Batch:
    """Prompt records from `rlhf.data.prompts` as a Batch: chat `messages` (or raw `prompt`), `ground_truth`,
    and `images` when the records have some."""
    use_messages = all(r.get("messages") for r in records)
    meta = {"messages": [r["messages"] for r in records]} if use_messages else {"prompt": [r["prompt"] for r in records]}
    meta["ground_truth"] = [r.get("ground_truth") for r in records]
    if any(r.get("images") for r in records):  # image prompts: each one's images go to the engines
        meta["images"] = [list(r.get("images") or []) for r in records]
    return Batch(meta=meta)


class RolloutHandle:
    """The vLLM rollout engines (a RolloutGroup). `version` counts the weight syncs into them, and every
    sample carries the version that produced it (meta `policy_version`). What is generated is the handle's:
    single turns, multi-turn trajectories with tools or an environment, or (`rollout.openai_agent`) a user's
    agent sessions on the OpenAI-compatible endpoint. When, and on which weights (`rollout.mode`), is the run's
    rollout source's (`rlhf.driver.rl.sources`): it starts calls with `start` and is told before every weight
    sync (`before_sync`), so its work in flight finishes on the weights it started with."""

    def __init__(self, group: Any, sampling: Any, sync_config: Any, agent: AgentOptions | None = None,
                 colocated: bool = False) -> None:
        self.group, self.sampling, self.sync_config, self.agent = group, sampling, sync_config, agent
        self.colocated, self.asleep = colocated, False
        self.version = 0
        self.before_sync: Callable[[], None] = lambda: None  # set by the run's rollout source
        self.agents: Any = None  # rollout.openai_agent: agent sessions instead (rlhf/driver/rl/openai_agents.py)

    def generate(self, prompts: list[dict[str, Any]] | Batch, score: Callable[[Batch], Batch] | None = None,
                 **sampling: Any) -> Batch:
        """Sample responses for prompt records (`messages` or `prompt`, plus `ground_truth`) or a prompt Batch;
        with rollout.tools, multi-turn trajectories with tool calls. With `score` (e.g. `roles.reward`) each
        engine's samples are scored as they return, while the other engines still generate."""
        if self.agents is not None:  # rows tagged with the versions their calls ran on
            return self.agents.run(prompts, self.sampling.with_(**sampling) if sampling else self.sampling, score,
                                   self.version)
        return self.tag(self.start(prompts, sampling).result(score), self.version)

    def start(self, prompts: list[dict[str, Any]] | Batch, sampling: dict[str, Any]) -> Any:
        """Start generating for `prompts` on the weights the engines hold now; `.result(score)` of the returned
        call gives the Batch (untagged: `tag` it with the version it started at)."""
        params = self.sampling.with_(**sampling) if sampling else self.sampling
        return self.group.start_generate(prompts if isinstance(prompts, Batch) else prompt_batch(prompts), params,
                                         agent=self.agent)

    @staticmethod
    def tag(batch: Batch, version: int) -> Batch:
        """Every sample of `batch` carries `version`, the weights that produced it (meta `policy_version`)."""
        batch["policy_version"] = [version] * len(batch)
        return batch

    def sleep(self) -> None:
        """Colocated engines (rollout.colocate_with): free their memory for the policy's turn (GPU; a logged
        no-op on CPU); `sync_weights` wakes them. Engines placed apart stay as they are."""
        if self.colocated and not self.asleep:
            self.group.sleep(1)
            self.asleep = True

    def sync_weights(self, policy: PolicyHandle, verify: bool | None = None) -> dict[str, Any]:
        """Push the policy's weights into the engines (woken first if asleep); work in flight (a prefetched
        generation, the async buffer's round) finishes on the old weights first (`before_sync`)."""
        self.before_sync()
        if self.asleep:
            self.group.wake_up(None)
            self.asleep = False
        stats = self.group.sync_weights(policy.group, self.sync_config, verify=verify)
        self.version += 1
        return stats

    def shutdown(self) -> None:
        if self.agents is not None:
            self.agents.shutdown()
        self.group.shutdown()


def _rollout_handle(cfg: RunConfig, run_dir: Path, temp: float, pool: Any = None,
                    teacher: bool = False) -> RolloutHandle:
    """The run's rollout group (its engines started and ready; in `pool`'s bundles when colocated) with its
    sampling, sync and agent settings. `teacher`: engines of the same settings serving `teacher.model_path`
    (algorithm.distill.mode=forward_kl), never synced, with no routing, LoRA or agent sessions."""
    from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig, SyncConfig

    # Sampled-token logprobs after temperature (the sampling distribution) when it is not 1.
    mode = "raw_logprobs" if temp == 1.0 else "processed_logprobs"
    r = cfg.rollout
    lora_rank = cfg.policy.lora.rank if r.sync_lora_adapter and cfg.policy.lora is not None and not teacher else 0
    engine = build(EngineConfig, r, model_path=cfg.teacher.model_path if teacher else cfg.model.path,
                   tokenizer_path=cfg.model.tokenizer_path, logprobs_mode=mode,
                   return_routed_experts=records_routes(cfg) and not teacher, max_lora_rank=lora_rank,
                   enable_sleep_mode=pool is not None).validate()
    group = RolloutGroup(engine, r.num_engines, timeout_s=cfg.trainer.timeout_s,
                         name="teacher-rollout" if teacher else "rollout", log_dir=run_dir / "logs",
                         resource_pool=pool)
    agent = build(AgentOptions, r) if r.tools or r.env else None
    sampling = build(SamplingConfig, r).validate()
    handle = RolloutHandle(group, sampling, build(SyncConfig, r, timeout_s=cfg.trainer.timeout_s,
                                                     policy_dtype=cfg.policy.dtype), agent,
                           colocated=pool is not None)
    if r.openai_agent and not teacher:
        from rlhf.driver.rl.openai_agents import AgentRollout

        try:
            handle.agents = AgentRollout(cfg, group)
        except BaseException:
            group.shutdown()
            raise
    return handle


def prompt_encoder(tokenizer_path: str) -> Any:
    """`encode(records)`: prompt records' token ids and texts exactly as the engines make them (the chat
    template for `messages`; `workers.rollout.prompts.normalise`), for the async buffer's first rounds."""
    from rlhf.data.tokenizer import load_tokenizer
    from workers.rollout.prompts import normalise

    tokenizer = load_tokenizer(tokenizer_path)

    def encode(records: list[dict[str, Any]]) -> tuple[list[list[int]], list[str]]:
        p = normalise(prompt_batch(records), tokenizer)
        return p.ids, p.text

    return encode


def colocated_pool(cfg: RunConfig) -> Any:
    """rollout.colocate_with=policy: one placement group whose bundle i holds policy rank i and engine i
    (each bundle: the policy rank's CPUs and GPUs plus an engine's CPUs; the engine shares the rank's GPU), else
    None."""
    if cfg.rollout.colocate_with != "policy":
        return None
    from workers.group.pool import ResourcePool

    par, res, r = cfg.policy.parallel, cfg.policy.resources, cfg.rollout
    return ResourcePool("colocated", par.tp * par.cp * par.pp * par.dp, res.num_cpus_per_worker + r.num_cpus,
                        res.num_gpus_per_worker, placement=res.placement, timeout_s=min(cfg.trainer.timeout_s, 60.0))


@dataclass
class Roles:
    policy: PolicyHandle
    rollout: RolloutHandle
    reward: RewardHandle
    reference: PolicyHandle | None = None
    critic: CriticHandle | None = None
    teacher: PolicyHandle | None = None  # on-policy distillation (the `teacher` section)
    teacher_rollout: RolloutHandle | None = None  # distillation on the teacher's samples (distill.mode=forward_kl)
    pool: Any = None  # the placement group colocated roles share (rollout.colocate_with), removed last

    @classmethod
    def create(cls, cfg: RunConfig, run_dir: str | Path) -> Roles:
        """Start every enabled role of `cfg` (Ray must be initialised). Every group (the Megatron roles, the
        rollout engines, the judge's with reward.judge) starts in its own thread: each start is mostly imports
        and model building in its own processes, so a run waits for the slowest, not for their sum. When one
        fails, the others are waited for and shut down, and the first failure is raised."""
        from workers.roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardModelWorker

        run_dir = Path(run_dir)
        reward = RewardHandle(cfg.reward)  # resolve before any worker starts
        temp = sampling_temperature(cfg)
        shared = colocated_pool(cfg)
        starts: dict[str, Callable[[], Any]] = {
            "rollout": lambda: _rollout_handle(cfg, run_dir, temp, shared),
            "policy": lambda: PolicyHandle(role_group("policy", cfg.policy, cfg, run_dir, PolicyWorker, pool=shared),
                                           temp, routes=records_routes(cfg)),
        }
        if cfg.reward.judge.model_path:
            starts["judge"] = lambda: judge_group(cfg.reward.judge, cfg.trainer.timeout_s, run_dir / "logs")
        if cfg.reference.enabled and needs_reference(cfg):
            starts["reference"] = lambda: PolicyHandle(role_group("reference", cfg.reference, cfg, run_dir,
                                                                  ReferenceWorker), temp)
        if cfg.teacher.enabled and cfg.algorithm.distill.mode == "forward_kl":  # the teacher samples
            starts["teacher_rollout"] = lambda: _rollout_handle(cfg, run_dir, temp, teacher=True)
        elif cfg.teacher.enabled:  # the teacher scores the student's samples
            starts["teacher"] = lambda: PolicyHandle(role_group("teacher", cfg.teacher, cfg, run_dir, ReferenceWorker),
                                                     temp)
        if cfg.critic.enabled:
            starts["critic"] = lambda: CriticHandle(role_group("critic", cfg.critic, cfg, run_dir, CriticWorker))
        if cfg.reward.model_path:  # the config is left as saved: reward.model_path is passed, not written
            starts["reward_model"] = lambda: role_group("reward_model", cfg.reward_model, cfg, run_dir,
                                                        RewardModelWorker, model_path=cfg.reward.model_path)
        pool = ThreadPoolExecutor(len(starts), thread_name_prefix="roles-start")
        futures = {name: pool.submit(fn) for name, fn in starts.items()}
        pool.shutdown(wait=False)
        try:
            wait(futures.values())
            failed = [e for e in (f.exception() for f in futures.values()) if e is not None]
            if failed:
                raise failed[0]
        except BaseException:
            wait(futures.values())  # (an interrupt) what is still starting, then shut everything down
            up = [f.result() for f in futures.values() if f.exception() is None]
            for h in [*up, reward, *([shared] if shared else [])]:
                try:
                    h.shutdown()
                except Exception:  # noqa: BLE001 - the first failure is the one reported
                    pass
            raise
        started = {name: f.result() for name, f in futures.items()}
        if "judge" in started:
            reward.attach_judge(started.pop("judge"))
        if "reward_model" in started:
            reward.model_group = started.pop("reward_model")
        return cls(reward=reward, pool=shared, **started)

    def all(self) -> list[Any]:
        """Every handle that holds workers (the reward only when it is a reward-model group)."""
        reward = self.reward if self.reward.model_group is not None else None
        return [h for h in (self.policy, self.reference, self.teacher, self.critic, reward, self.rollout,
                            self.teacher_rollout) if h is not None]

    def shutdown(self) -> None:
        reward = [] if self.reward.model_group is not None else [self.reward]  # its processes, if any
        for h in [*self.all(), *reward, *([self.pool] if self.pool is not None else [])]:
            try:
                h.shutdown()
            except Exception:  # noqa: BLE001 - shut the other roles down too
                pass
