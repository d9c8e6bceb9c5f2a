"""Inputs of a run, made ready before any worker starts: task data, the model folder, the reward function.

- `data.task` (one of `TASKS`) with no `data.train_file`: the example task's files are generated under the run
  dir (RL prompts, SFT conversations; for arithmetic also preference pairs (DPO, RM), pretraining text and
  its Megatron indexed form).
- `model.preset` with no `model.path`: the tiny model is created under the run dir, then warm-started with a
  short plain SFT when `model.warm_start_steps > 0` (RL, DPO and the reward model; with
  `model.warm_start_backend: megatron` the RL runner does it on the policy's backend once Ray is up): on the
  task's Q/A pairs, or on its SFT conversations (multiply_tool: calculator-call traces with their results;
  code_functions: reference solutions).
Everything generated is reused when it already exists, so a resumed run starts from the same files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.config.schema import RL_ALGORITHMS, RunConfig
from rlhf.config.validate import PAIR_STAGES, check_teacher_layout
from rlhf.errors import ConfigError
from workers.rollout.config import is_vision_language

if TYPE_CHECKING:
    from rlhf.data.prompts import PromptLimit

# data.task -> (module:function writing its files, default val_size, whether the warm start trains on the SFT
# file's conversations (tool-call traces, reference code) rather than the RL file's (prompt, answer) pairs)
TASKS = {
    "arithmetic": ("rlhf.data.arithmetic:write_arithmetic_data", 200, False),
    "multiply_tool": ("rlhf.data.tool_tasks:write_multiply_tool_data", 200, True),
    "code_functions": ("rlhf.data.code_tasks:write_code_data", 100, True),
    "shapes": ("rlhf.data.shapes:write_shapes_data", 64, False),  # image prompts in WebDataset shards
}
# The RL prompt files a task writes (train, val) under the run's data dir: jsonl, or shard folders
RL_FILES = {"shapes": ("rl_train", "rl_val")}
DEFAULT_RL_FILES = ("rl_train.jsonl", "rl_val.jsonl")


def _task_data(cfg: RunConfig, out: Path) -> None:
    d = cfg.data
    if d.task not in TASKS:
        raise ConfigError(f"data.task: expected one of {', '.join(TASKS)} or null, got {d.task!r}")
    if cfg.algorithm.name == "pretrain" and d.task != "arithmetic":
        raise ConfigError(f"data.task: {d.task} has no pretraining text (only arithmetic has)")
    if cfg.algorithm.name in PAIR_STAGES and d.task != "arithmetic":
        raise ConfigError(f"data.task: {d.task} has no preference pairs (only arithmetic has)")
    import importlib

    spec, default_val, _ = TASKS[d.task]
    module, _, fn = spec.partition(":")
    write = getattr(importlib.import_module(module), fn)
    data_dir = out / "data"
    rl_train, rl_val = RL_FILES.get(d.task, DEFAULT_RL_FILES)
    if not (data_dir / rl_val).exists():
        write(data_dir, seed=d.seed, val_size=d.val_size or default_val)
    if cfg.algorithm.name in PAIR_STAGES:
        from rlhf.data.arithmetic import write_preference_data

        name = cfg.algorithm.name  # rm pairs: half with a random wrong sum (rlhf.data.arithmetic says why)
        if not (data_dir / f"{name}_val.jsonl").is_file():
            write_preference_data(data_dir, seed=d.seed, val_size=d.val_size or 200, name=name,
                                  random_share=0.5 if name == "rm" else 0.0)
        d.train_file, d.val_file = str(data_dir / f"{name}_train.jsonl"), str(data_dir / f"{name}_val.jsonl")
        d.val_size = 0
    elif cfg.algorithm.name in RL_ALGORITHMS:
        d.train_file, d.val_file, d.val_size = str(data_dir / rl_train), str(data_dir / rl_val), 0
    elif cfg.algorithm.name == "sft":
        d.train_file, d.val_file = str(data_dir / "sft_train.jsonl"), str(data_dir / "sft_val.jsonl")
    elif not d.data_prefix:  # pretrain: tokenise the task text into Megatron's indexed format once
        d.data_prefix = [str(data_dir / "pretrain_text_document")]


def _pretrain_index(cfg: RunConfig, out: Path) -> None:
    from rlhf.data.preprocess import preprocess_pretrain

    prefix = Path(cfg.data.data_prefix[0])
    if not prefix.with_suffix(".idx").is_file():
        preprocess_pretrain(out / "data" / "pretrain.jsonl", out / "data" / "pretrain", cfg.model.path,
                            append_eod=True, progress=False)


def _model(cfg: RunConfig, out: Path) -> None:
    m = cfg.model
    if m.path:
        if not (Path(m.path) / "config.json").is_file():
            raise ConfigError(f"model.path: {m.path} is not an HF model folder (no config.json)")
        from workers.megatron.hf_weights import HFTensorSource

        try:  # every safetensors header is read: a truncated file is a FileProblem now, not in a worker
            HFTensorSource(m.path).close()
        except ValueError as e:
            raise ConfigError(f"model.path: {e}") from None
        check_tokenizer(cfg)
        return
    from rlhf.tiny_models import create_tiny_model

    base = out / "model" / "init"
    if not (base / "model.safetensors").is_file():
        shutil.rmtree(base, ignore_errors=True)
        create_tiny_model(m.preset, base, seed=cfg.trainer.seed)
    m.path = str(base)
    if m.warm_start_steps > 0 and m.warm_start_backend == "megatron" and cfg.algorithm.name in RL_ALGORITHMS:
        if not cfg.data.task:
            raise ConfigError("model.warm_start_steps needs data.task (the task's Q/A pairs to fine-tune on)")
        return  # run_rl trains it once Ray is up (rlhf.driver.warmstart.megatron_sft)
    if m.warm_start_steps > 0 and cfg.algorithm.name in (*RL_ALGORITHMS, *PAIR_STAGES):
        warm = out / "model" / f"warm_start_{m.warm_start_steps}"
        if not (warm / "model.safetensors").is_file():
            if not cfg.data.task:
                raise ConfigError("model.warm_start_steps needs data.task (the task's Q/A pairs to fine-tune on)")
            shutil.rmtree(warm, ignore_errors=True)
            tmp = warm.with_name(warm.name + ".tmp")
            if is_vision_language(str(base)):  # image prompts: the Qwen2-VL loop, on the RL records with images
                from rlhf.data.prompts import load_prompt_dataset
                from rlhf.driver.warmstart.vl_sft import vl_sft_warm_start

                records, _ = load_prompt_dataset(cfg.data.train_file, seed=cfg.data.seed)
                vl_sft_warm_start(base, records, tmp, steps=m.warm_start_steps, batch_size=m.warm_start_batch,
                                  lr=m.warm_start_lr, seed=cfg.trainer.seed)
            else:
                from rlhf.driver.warmstart.hf_sft import sft_warm_start

                pairs = warm_start_items(cfg, out)
                sft_warm_start(base, pairs, tmp, steps=m.warm_start_steps, batch_size=m.warm_start_batch,
                               lr=m.warm_start_lr, seed=cfg.trainer.seed, tools=rollout_tool_schemas(cfg))
            tmp.rename(warm)
        m.path = str(warm)


def check_tokenizer(cfg: RunConfig) -> None:
    """The tokenizer of a given model folder (model.tokenizer_path, else model.path) loads, before any worker
    or engine starts: a folder without tokenizer files is one line naming it and the files looked for."""
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.errors import UserError

    field = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    try:
        load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    except UserError as e:
        raise ConfigError(f"{field}: {e}") from None


def check_teacher(cfg: RunConfig) -> None:
    """On-policy distillation compares the teacher's log-prob of each token the student sampled, so the two
    must share one tokenizer: the same token for the same id. The teacher's folder (its weights' headers, its
    tokenizer) is checked before any worker starts; a vocabulary that differs is one line naming a token."""
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.errors import UserError
    from workers.megatron.hf_weights import HFTensorSource

    path = cfg.teacher.model_path or ""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"teacher.model_path: {path} is not an HF model folder (no config.json); a teacher is an "
                          "HF export, e.g. the <output_dir>/hf of an earlier run")
    check_teacher_layout(cfg)
    try:
        HFTensorSource(path).close()
        teacher = load_tokenizer(path).get_vocab()
    except (UserError, ValueError, OSError) as e:
        raise ConfigError(f"teacher.model_path: {e}") from None
    student = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path).get_vocab()
    if teacher != student:
        diff = sorted(set(teacher.items()) ^ set(student.items()))
        tok, idx = diff[0]
        raise ConfigError(f"teacher.model_path: the teacher's tokenizer ({len(teacher)} tokens) is not the policy's "
                          f"({len(student)} tokens; e.g. {tok!r} -> {idx} in one of them only): distillation compares "
                          "log-probs of the same token ids, so the teacher needs the policy's tokenizer")


def megatron_warm_start_due(cfg: RunConfig, out: Path) -> bool:
    """Whether the RL runner warm-starts the tiny preset model on the Megatron backend (see `_model`)."""
    m = cfg.model
    return (m.warm_start_steps > 0 and m.warm_start_backend == "megatron" and cfg.algorithm.name in RL_ALGORITHMS
            and m.preset is not None and Path(m.path or "") == out / "model" / "init")


def rollout_tool_schemas(cfg: RunConfig) -> list[dict] | None:
    """The schemas of rollout.tools, as the rollout renders them into every prompt (None without tools)."""
    if not cfg.rollout.tools:
        return None
    from workers.agent.tools import load_tools, tool_schemas

    return tool_schemas(load_tools(list(cfg.rollout.tools)))


def warm_start_items(cfg: RunConfig, out: Path) -> list:
    """What the warm start trains on: the RL train file's (prompt, answer) pairs, or the conversations of the
    task's SFT train file (multi-turn tool-call traces; code tasks, whose RL answer is the hidden tests)."""
    from rlhf.data.prompts import load_prompt_dataset

    if cfg.data.task in TASKS and TASKS[cfg.data.task][2]:
        from rlhf.data.chat import normalize_conversation
        from rlhf.data.jsonl import read_jsonl

        path = out / "data" / "sft_train.jsonl"
        return [normalize_conversation(rec, f"{path}:{n}") for n, rec in read_jsonl(path)]
    # DPO, RM: the task's Q/A pairs are in its RL prompt file (their train file holds the preference pairs)
    qa = cfg.data.train_file if cfg.algorithm.name not in PAIR_STAGES else str(out / "data" / "rl_train.jsonl")
    train, _ = load_prompt_dataset(qa, answer_key=cfg.data.answer_key, seed=cfg.data.seed)
    return [(p["prompt"] or p["messages"], p["ground_truth"]) for p in train]


def prompt_limit(cfg: RunConfig) -> PromptLimit | None:
    """The prompt-length limit of an RL run: the model's context minus rollout.max_tokens, counted as the
    rollout engine tokenises prompts (chat template with the generation prompt, or raw text); None when
    the model's config names no maximum."""
    from rlhf.data.checks import max_positions
    from rlhf.data.prompts import PromptLimit

    context = max_positions(cfg.model.path)
    if context is None:
        return None
    max_tokens = cfg.rollout.max_tokens
    tokenizer = None

    def count(records: list) -> list[int]:
        nonlocal tokenizer
        from rlhf.data.tokenizer import load_tokenizer
        from workers.rollout.prompts import normalise

        tokenizer = tokenizer or load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        prompts = [r["prompt"] or r["messages"] for r in records]
        if tokenizer.chat_template is None and any(not isinstance(x, str) for x in prompts):
            raise ConfigError(f"{'model.tokenizer_path' if cfg.model.tokenizer_path else 'model.path'}: the "
                              f"tokenizer in {cfg.model.tokenizer_path or cfg.model.path} has no chat_template; "
                              f"the prompts of {cfg.data.train_file} are conversations, which need one")
        return [len(ids) for ids in normalise(prompts, tokenizer, rollout_tool_schemas(cfg)).ids]

    return PromptLimit(context - max_tokens, f"max_position_embeddings ({context}) - rollout.max_tokens "
                       f"({max_tokens}) = {context - max_tokens}", count, cfg.data.overlong_prompts)


def load_rl_prompts(cfg: RunConfig, report: bool = True, check_lengths: bool = True) -> tuple[list, list]:
    """The run's (train, val) prompts with over-long ones dropped (a count on stdout when `report`) or
    refused, per data.overlong_prompts (`check_lengths` False: parsed only, no model needed). The last result
    is kept for a second call on the same files, settings and model (`prepare_inputs` checks the lengths,
    then the runner loads the prompts): counting means chat-templating and tokenising every prompt."""
    from rlhf.data.prompts import load_prompt_dataset

    d = cfg.data
    limit = prompt_limit(cfg) if check_lengths else None
    key = _prompts_key(cfg, limit)
    if _LAST_PROMPTS.get("key") != key:
        train, val = load_prompt_dataset(d.train_file, d.val_file, val_size=d.val_size, prompt_key=d.prompt_key,
                                         messages_key=d.messages_key, answer_key=d.answer_key, seed=d.seed,
                                         limit=limit)
        _LAST_PROMPTS.update(key=key, train=train, val=val, summary=limit.summary() if limit else "")
    if report and _LAST_PROMPTS["summary"]:
        print(_LAST_PROMPTS["summary"], flush=True)
    return [dict(r) for r in _LAST_PROMPTS["train"]], [dict(r) for r in _LAST_PROMPTS["val"]]  # callers' own


_LAST_PROMPTS: dict[str, Any] = {}


def _prompts_key(cfg: RunConfig, limit: PromptLimit | None) -> tuple:
    """What the loaded prompts depend on: the files (path, size, modification time), the data settings, and
    for the length check the limit, the tokenizer's folder (its files' times) and the tool schemas."""
    def stamp(path: str | None) -> tuple:
        if not path or not Path(path).exists():
            return (path,)
        st = Path(path).stat()
        return path, st.st_size, st.st_mtime_ns

    d = cfg.data
    files = (stamp(d.train_file), stamp(d.val_file), d.val_size, d.prompt_key, d.messages_key, d.answer_key, d.seed)
    if limit is None:
        return files
    tok = Path(cfg.model.tokenizer_path or cfg.model.path)
    tok_files = tuple(stamp(str(f)) for f in sorted(tok.glob("*"))) if tok.is_dir() else (str(tok),)
    tools = json.dumps(rollout_tool_schemas(cfg), sort_keys=True)
    return files, limit.max_prompt_tokens, limit.mode, tok_files, tools


def _check_eval_tasks(cfg: RunConfig) -> None:
    """Load trainer.eval_tasks once so that a bad name or data file fails before the warm start (the run
    loads them again, before Ray starts, for use)."""
    t = cfg.trainer
    if t.eval_every:
        from rlhf.eval.tasks import load_task

        for name in t.eval_tasks:
            load_task(name, t.eval_limit, seed=t.seed)


def prepare_inputs(cfg: RunConfig) -> RunConfig:
    """Generate or check the run's inputs in place and return `cfg`; raise UserError on bad input."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rl = cfg.algorithm.name in RL_ALGORITHMS
    if cfg.data.task and not cfg.data.train_file:
        _task_data(cfg, out)
    if rl:
        from rlhf.driver.rl.rewards import check_reward_fn

        if cfg.reward.fn:  # also beside reward.model_path: it scores validation
            check_reward_fn(cfg.reward)
        if cfg.rollout.openai_agent:
            from rlhf.driver.rl.openai_agents import check_agent_fn

            check_agent_fn(cfg.rollout)
        if cfg.reward.model_path and not (Path(cfg.reward.model_path) / "config.json").is_file():
            raise ConfigError(f"reward.model_path: {cfg.reward.model_path} is not an HF model folder (no config.json); "
                              f"train a reward model with algorithm.name=rm (e.g. configs/rm_tiny.yaml), which "
                              f"exports one to <output_dir>/hf")
        judge = cfg.reward.judge.model_path
        if judge and not (Path(judge) / "config.json").is_file():
            raise ConfigError(f"reward.judge.model_path: {judge} is not an HF model folder (no config.json)")
        if not cfg.data.train_file:
            raise ConfigError(f"data.train_file: expected a jsonl or parquet prompt file (or data.task: one of "
                              f"{', '.join(TASKS)})")
        load_rl_prompts(cfg, report=False, check_lengths=False)  # a bad file fails before any model work
        _check_eval_tasks(cfg)
    if cfg.algorithm.name in PAIR_STAGES:  # a bad pair (chosen == rejected, empty answer) fails before model work
        from rlhf.driver.stages.pairs import check_pair_files

        check_pair_files(cfg)
    _model(cfg, out)
    if rl:  # after _model: prompt lengths are counted with the model's tokenizer and chat template
        load_rl_prompts(cfg, report=False)
        if cfg.teacher.enabled:
            check_teacher(cfg)
    if cfg.algorithm.name == "pretrain" and cfg.data.task and cfg.data.data_prefix:
        _pretrain_index(cfg, out)
    return cfg
