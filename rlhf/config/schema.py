"""The schema of every option. YAML files in configs/ and command-line overrides are checked against it."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.agent.options import AgentOptions
from workers.megatron.optim_config import OptimConfig
from workers.roles.loss_config import PPOLossConfig, PreferenceLossConfig, ValueLossConfig
from workers.roles.options import RoleOptions
from workers.rollout.config import EngineOptions, SyncOptions
from workers.rollout.sampling import SamplingConfig


@dataclass
class ParallelConfig:
    """Megatron parallel layout of one role. world size = tp * cp * pp * dp.

    `cp` (context parallelism): each sequence is split over `cp` ranks in 2 x cp load-balanced chunks;
    attention all-gathers keys and values, the loss sees whole rows (workers.megatron.context_parallel).
    The batch is still split over `dp` only. Dense models without MLA, pp = 1.

    `ep` (MoE models): expert parallelism. The routed experts are split over `ep` ranks taken from the
    data-parallel ones (megatron-core lays expert layers out as tp x ep x expert-dp x pp on the same ranks),
    so `ep` divides `dp` and the experts; the batch is still split over `dp`."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1


@dataclass
class ResourceConfig:
    """Per-actor resources. On CPU, fractions of a CPU are allowed."""

    num_cpus_per_worker: float = 0.5
    num_gpus_per_worker: float = 0.0
    # CPU: torch intra-op threads per rank (None: Ray's default, one per whole CPU reserved). Phases of an RL
    # step run one after another, so a colocated role may use more threads than the CPUs it reserves.
    num_threads: int | None = None
    # how the role's placement group spreads it over nodes: pack | spread | strict_pack | strict_spread (Ray's
    # strategies). A tensor x context-parallel group always shares one bundle, so it stays inside a node;
    # spread puts the data-parallel replicas (and pipeline stages) on different nodes where it can
    placement: str = "pack"


@dataclass
class RoleConfig(RoleOptions):
    """A Megatron worker group: policy, reference, critic or reward model. What its ranks are built from
    (`RoleOptions`: micro_batch_size, dtype, offload, moe, lora) reaches them as it is."""

    enabled: bool = True
    model_path: str | None = None  # HF folder; defaults to model.path
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class ModelConfig:
    path: str | None = None  # HF model folder (config.json, safetensors, tokenizer)
    preset: str | None = None  # create this tiny preset under the run dir when path is unset
    tokenizer_path: str | None = None  # defaults to path
    # Warm start: a short plain SFT of the model on the task's Q/A pairs before RL or DPO (0 = none).
    warm_start_steps: int = 0
    warm_start_lr: float = 1e-3
    warm_start_batch: int = 128
    # hf: a transformers loop before any worker starts; megatron (RL): the same SFT on the Megatron engine at
    # the policy's parallel layout (EP included), by a policy group that runs before the RL roles start
    warm_start_backend: str = "hf"
    # megatron backend: stop the warm start early once the greedy accuracy on the RL held-out prompts reaches
    # this (checked every 10 steps from halfway through, on an HF export of the weights); null: run all steps
    warm_start_target_accuracy: float | None = None


@dataclass
class RolloutConfig(SamplingConfig, EngineOptions, SyncOptions, AgentOptions):
    """The vLLM engines: what a generate call samples (`SamplingConfig`), how the engines are built
    (`EngineOptions`), how the policy's weights reach them (`SyncOptions`) and multi-turn rollouts with tools
    or an environment (`AgentOptions`). The run's default of `n` is
    set in `RunConfig`; `seed` also seeds the engines."""

    # data-parallel engines, Ray actors rollout/0, rollout/1, ... (each with num_cpus / num_gpus); a generate
    # call splits its prompts across them, a prompt's n samples on one engine; every sync feeds every engine
    num_engines: int = 1
    # sync: generate, then train, then sync; one_step_off: the next step's generation runs (on the weights
    # before this step's update) while this step trains, so each batch is one policy version old; async: the
    # engines keep filling a buffer between steps (rlhf/driver/rl/async_buffer.py) and a step takes the oldest complete
    # groups, each token tagged with the policy version that produced it
    mode: str = "sync"
    # async: a group whose oldest token is more than this many weight syncs old is dropped (counted)
    max_staleness: int = 1
    # async: how staleness is bounded. drop_stale: groups more than max_staleness syncs old are dropped, and
    # the long answers are the ones that go stale (rollout/stale_dropped/length_q* counts them by length);
    # cap: a group starts only while fewer than (version + max_staleness) x prompts_per_step have started, so
    # its lag is bounded when it starts and none is dropped: the trained lengths follow the sampled ones
    admission: str = "drop_stale"
    # async: partial rollouts, at most this many new tokens per sample in a round; an unfinished sample
    # continues in the next round on the new weights (0: a round generates whole responses)
    partial_tokens: int = 0
    # policy: engine i shares placement-group bundle i with policy rank i (one pool; on GPU the same device),
    # and sleeps (frees its KV cache and weights) while the policy trains, waking before the sync. On CPU
    # sleep and wake are no-ops, but the placement and the calls are the same. null: a pool of their own.
    colocate_with: str | None = None
    # An agent of your own instead of the built-in rollout: `module:function`, run(client, task) -> reward | None,
    # called for n sessions per prompt in agent_workers processes (each call within agent_timeout_s, its
    # processes within agent_memory_mb) with an `openai.OpenAI` client of the run's OpenAI-compatible endpoint
    # and the prompt record; None: reward.fn scores the session's last answer. A session samples at most
    # max_turns completions and max_total_tokens tokens. docs/recipes/openai-agents.md
    openai_agent: str | None = None
    agent_timeout_s: float = 120.0
    agent_workers: int = 4
    agent_memory_mb: int = 4096


@dataclass
class DataConfig:
    task: str | None = None  # arithmetic | multiply_tool | code_functions | shapes: generate the example task's data under the run dir
    train_file: str | None = None  # jsonl or parquet
    val_file: str | None = None  # held-out prompts; or split off the train file by val_size
    val_size: int = 0
    prompt_key: str = "prompt"  # raw text prompt, or
    messages_key: str | None = None  # chat messages (the chat template is applied)
    answer_key: str = "answer"  # ground truth given to the reward
    # prompts with more tokens (after the chat template) than the model's max_position_embeddings minus
    # rollout.max_tokens: "drop" them with a count when the data loads, or "fail" naming file:line
    overlong_prompts: str = "drop"
    prompts_per_step: int = 16
    seed: int = 0
    # SFT / pretraining
    seq_length: int = 128
    data_prefix: list[str] = field(default_factory=list)  # Megatron indexed data: [w1, p1, w2, p2] or [p]
    split: str = "949,50,1"
    pack: bool = False
    eod_mask_loss: bool = False


@dataclass(kw_only=True)
class JudgeConfig(EngineOptions):
    """`reward.judge`: a generative reward model (LLM judge) on rollout engines of its own (the engine
    settings, `EngineOptions`, as the rollout's). Each sample is scored by the judge's greedy verdict on
    `prompt_template`; docs/recipes/reward-services.md."""

    model_path: str | None = None  # an HF causal LM folder; set, the judge scores the training rollouts
    num_engines: int = 1
    # the judge's prompt: {prompt}, {response} and {ground_truth} are the sample's (no other {field}; a literal
    # brace is {{ or }})
    prompt_template: str = ("Rate the response to the prompt from 0 to 10.\n\nPrompt: {prompt}\n\nResponse: "
                            "{response}\n\nReference answer: {ground_truth}\n\nEnd with a line \"Score: <number>\".")
    chat: bool = True  # the prompt as a user turn of the judge's chat template (when its tokenizer has one)
    pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)"  # the verdict's score: this regex's first capture group
    # instead of pattern: the score of the verdict's first word (case-insensitive), e.g. {"yes": 1.0, "no": 0.0}
    choices: dict[str, float] = field(default_factory=dict)
    max_tokens: int = 32  # the verdict's length bound (greedy decoding)


@dataclass
class RewardConfig:
    fn: str | None = "exact_match"  # a name in algorithms.list_rewards() or "module:function"
    # A reward-model group instead of the function: an HF folder with `score.weight` (what `algorithm.name: rm`
    # exports) or a causal LM (its value head then starts untrained). With both set, the model scores the
    # training rollouts and `fn` still scores validation (val/accuracy); val/reward_mean is the model's.
    model_path: str | None = None
    # A call of reward.fn that raises, returns anything but a finite number or takes longer than timeout_s
    # (module:function rewards run in num_workers processes): "fallback" scores it fallback_score and counts it
    # (reward/errors, reward/timeouts); "fail" stops the run naming the function and the sample.
    on_error: str = "fallback"  # fallback | fail
    fallback_score: float = 0.0
    timeout_s: float = 30.0
    num_workers: int = 2
    # The memory of each reward process and everything it starts, together: a memory cgroup where the driver
    # can make one (run as root), else the process's address-space limit. The reward processes are the
    # kernel's first OOM victims either way; a call that goes over the bound is scored by on_error.
    memory_mb: int = 4096
    # A user's verifier over HTTP scores the training rollouts instead (rlhf/driver/rl/reward_url.py; the JSON
    # contract: docs/recipes/reward-services.md): POSTs of batch_size samples, at most max_concurrency in flight,
    # each within timeout_s in all; one that fails as a whole (no connection, timeout, HTTP 429 or 5xx) is sent
    # again up to `retries` times, after backoff_s, 2 x backoff_s, ...; failed samples are scored by on_error
    url: str | None = None
    batch_size: int = 32  # reward.url: samples per request
    max_concurrency: int = 4  # reward.url: requests in flight at once
    retries: int = 2  # reward.url: more attempts of a request that failed as a whole
    backoff_s: float = 0.5  # reward.url: seconds before the first retry, doubled for each next one
    # an LLM judge scores the training rollouts instead (one of url, judge.model_path and model_path)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class DPOConfig(PreferenceLossConfig):
    """`algorithm.name: dpo`: the preference loss (`PreferenceLossConfig`) and where the reference log-probs
    come from. "precompute": one forward pass of the starting policy over the train and validation pairs
    before the first step, cached in the run dir (``reference_logps.safetensors``) for resumes. "group": a
    frozen reference worker group (the `reference` section: layout, micro batch, resources) with the
    starting weights computes each batch's reference log-probs during the step (no cache, one more model in
    memory)."""

    reference: str = "precompute"


@dataclass
class DistillConfig:
    """On-policy distillation, on when the `teacher` role is enabled (``algorithms/distill.py``): the teacher
    scores the student's own samples, and each response token's advantage becomes
    reward_weight x the task reward's advantage + kl_coef x (log p_teacher - log p_student), the negative
    per-token reverse KL to the teacher. reward_weight 0: pure distillation (the task reward is only logged).

    mode forward_kl (GKD's supervised case, sequence-level KD): a second rollout engine serves the teacher, and
    the student takes an LM step on the teacher's samples (their response tokens), the sampled estimate of the
    forward KL(teacher || student) up to the teacher's entropy; kl_coef and reward_weight do not apply there."""

    mode: str = "reverse_kl"  # reverse_kl: on the student's samples (on-policy) | forward_kl: on the teacher's
    kl_coef: float = 1.0
    reward_weight: float = 0.0
    # take the batch's mean of (log p_teacher - log p_student) out of every token's term: the same expected
    # gradient with less variance (without it, nearly every sampled token is pushed down: the mean is -KL)
    baseline: bool = False


# the algorithms that run the RL loop (rollout engines, rewards, weight sync): `run_rl`
RL_ALGORITHMS = ("grpo", "ppo", "online_dpo")


@dataclass
class AlgorithmConfig(PPOLossConfig, ValueLossConfig):
    """The training algorithm and its RL math (``algorithms/``).

    The names the choice fields accept come from the registries in ``algorithms``; any other name is
    rejected with the list:

    - ``adv_estimator``: ``algorithms.list_advantage_estimators()``: gae, grpo, rloo,
      reinforce_plus_plus, reinforce_plus_plus_baseline, and any added with
      ``register_advantage_estimator``. The grouped ones give a group of equal scores exactly 0.
    - ``kl_kind``: ``algorithms.KL_KINDS``: k1, k2, k3, abs and their straight-through ``+`` forms
      (``k3+``: the value of k3, the gradient of k2). verl's names are accepted as aliases with the
      same meaning (``algorithms.KL_ALIASES``): kl = k1, mse = k2, low_var_kl = k3, also with ``+``
      (verl's abs is ours). verl's ``full`` is not supported.
    - ``loss_agg_mode``: ``algorithms.AGG_MODES``, verl's ``loss_agg_mode`` names with verl's meaning:
      token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.
    - ``kl_ctrl``: ``algorithms.KL_CONTROLLERS``: fixed, adaptive.

    Dual clip is off by default (``clip_c: null``), unlike verl, which applies it with c = 3
    (``clip_ratio_c``); set ``clip_c: 3.0`` to match a verl run. verl's ``clip_ratio_low`` /
    ``clip_ratio_high`` are ``clip_low`` / ``clip_high`` and ``norm_adv_by_std_in_grpo`` is
    ``norm_by_std``.
    """

    # grpo | ppo | online_dpo (DPO on the best-vs-worst of the policy's own samples) | sft | pretrain | dpo | rm
    # (a reward model on preference pairs)
    name: str = "grpo"
    adv_estimator: str = "grpo"
    norm_by_std: bool = True  # grpo: divide by the group std (false: Dr. GRPO)
    gamma: float = 1.0
    lam: float = 1.0
    kl_in_reward: bool = False  # False: KL as a loss term (the policy's kl_coef is then 0)
    kl_ctrl: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    # DAPO's dynamic sampling: drop the groups whose rewards are all equal and refill the batch, in at most
    # max_resample_rounds rounds; a round draws the missing groups x oversample_factor prompts (the factor:
    # 1 / the share of groups expected to be informative), not a whole step's
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    oversample_factor: float = 2.0
    # algorithms.ALGORITHM_PRESETS: a named combination of the settings above, checked (not applied) by the
    # validator. dr_grpo: adv_estimator grpo, norm_by_std false, loss_agg_mode seq-mean-token-sum-norm
    preset: str | None = None
    # DAPO's overlong reward shaping (algorithms/overlong.py): a response longer than rollout.max_tokens -
    # overlong_buffer tokens loses up to overlong_penalty_factor of its score, linearly over the buffer (0: off)
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    # DAPO's overlong filtering: responses cut at rollout.max_tokens train nothing (their loss mask is zeroed;
    # they still count in their group's advantage baseline)
    overlong_filter: bool = False
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class TrainerConfig:
    total_steps: int = 10
    output_dir: str = "runs/default"
    seed: int = 0
    save_every: int = 0  # 0: only at the end
    val_every: int = 0  # 0: only at the start and the end
    # RL: `rlhf eval` tasks (e.g. [humaneval, "rg:basic_arithmetic", "mc:mmlu_test.csv"]) on the current policy
    # through the running engine every eval_every steps and after the last (file tasks zero-shot, lm_eval: tasks
    # with their own few-shot default); logged as eval/<task>/<metric>, a file task by its stem
    # (eval/mc:mmlu_test/acc). 0: off.
    eval_every: int = 0
    eval_tasks: list[str] = field(default_factory=list)
    eval_limit: int | None = 100  # items per task
    eval_max_tokens: int = 256
    resume: str = "never"  # never | auto
    export_hf: bool = True
    timeout_s: float = 300.0  # every remote call
    # SIGTERM / SIGINT: finish the step, checkpoint, exit 143 / 130 within this many seconds; keep it below
    # the scheduler's kill delay (Kubernetes terminationGracePeriodSeconds, Slurm KillWait)
    stop_grace_s: float = 120.0
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    dashboard: bool = False  # embedded Ray only: start the dashboard on 127.0.0.1:8265 (about 7 s more)
    global_batch_size: int = 0  # SFT / pretrain: sequences per optimizer step; 0 = micro * dp
    eval_iters: int = 2
    progress_bar: bool = True
    tensorboard: bool = True
    # Weights & Biases (pip install wandb, or the `tracking` extra): run name = output_dir's name, files under
    # <output_dir>/wandb. offline needs no account or network (`wandb sync` uploads later).
    wandb: bool = False
    wandb_project: str = "rlhf"
    wandb_mode: str = "offline"  # offline | online | disabled
    # SFT / pretrain: start from a checkpoint (a run dir, its checkpoints/ folder, a step-N folder or a role
    # folder); with --resume the run's own latest checkpoint wins. The two flags are Megatron's
    # --no-load-optim (fresh optimizer, scheduler and step) and --no-load-rng.
    load: str | None = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    # Load (trainer.load, --resume) a checkpoint folder without a matching rlhf manifest (sha256 of every
    # file, written at save): its pickles can run code, so only for checkpoints from a trusted source.
    trust_checkpoint: bool = False


@dataclass
class RunConfig:
    """The whole run. Sections mirror the roles of one RL step."""

    model: ModelConfig = field(default_factory=ModelConfig)
    policy: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=lambda: RoleConfig(enabled=False))
    reward_model: RoleConfig = field(default_factory=lambda: RoleConfig(enabled=False))
    # on-policy distillation (algorithm.distill): a frozen teacher, `teacher.model_path` (an HF folder with the
    # policy's tokenizer; any size or family), run as a Megatron group like the reference
    teacher: RoleConfig = field(default_factory=lambda: RoleConfig(enabled=False))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(n=8))
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
