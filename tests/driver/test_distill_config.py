"""On-policy distillation's refusals, each before any worker starts: the config's (rlhf/config/validate.py
`_check_teacher`) and the teacher folder's (rlhf/driver/warmstart/prepare.py `check_teacher`: its weights and
a tokenizer equal to the policy's)."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf.api import load_config, prepare_inputs
from rlhf.errors import ConfigError

BASE = ["model.preset=tiny-qwen2", "data.task=arithmetic", "data.val_size=8", "reference.enabled=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One run folder for the module: its task data and model are made once, by the first test that prepares."""
    return tmp_path_factory.mktemp("distill_run")


def test_a_teacher_needs_its_folder():
    with pytest.raises(ConfigError, match="teacher.model_path: on-policy distillation .* needs the teacher's HF"):
        load_config(None, [*BASE, "teacher.enabled=true"])


def test_a_teacher_folder_that_is_not_a_model_is_named_before_any_worker(tmp_path, run_dir):
    """The folder may be an earlier run's export, so the config loads without it; preparing the run checks it."""
    cfg = load_config(None, [*BASE, "teacher.enabled=true", f"teacher.model_path={tmp_path / 'export'}",
                             f"trainer.output_dir={run_dir}"])
    with pytest.raises(ConfigError, match="teacher.model_path: .*export is not an HF model folder"):
        prepare_inputs(cfg)


def test_the_teacher_layout_is_checked_against_the_teacher(tiny_model_factory, tmp_path, run_dir):
    path = tiny_model_factory("tiny-llama")  # 4 attention heads
    layout = [*BASE, "teacher.enabled=true", "teacher.parallel.tp=3", f"trainer.output_dir={run_dir}"]
    with pytest.raises(ConfigError, match="teacher.parallel.tp=3 does not divide the 4 attention heads"):
        load_config(None, [*layout, f"teacher.model_path={path}"])
    later = tmp_path / "later"  # the export appears after the config was loaded: preparing the run checks it
    cfg = load_config(None, [*layout, f"teacher.model_path={later}"])
    shutil.copytree(path, later)
    with pytest.raises(ConfigError, match="teacher.parallel.tp=3 does not divide the 4 attention heads"):
        prepare_inputs(cfg)


@pytest.mark.parametrize(("override", "words"), [
    ("algorithm.distill.kl_coef=-1", "algorithm.distill.kl_coef: expected a weight >= 0"),
    ("algorithm.distill.reward_weight=-0.5", "algorithm.distill.reward_weight: expected a weight >= 0"),
    ("algorithm.distill.kl_coef=0", "leave every advantage 0"),
    ("algorithm.name=sft", "algorithm.name=sft does not take"),
    ("teacher.lora.rank=4", "teacher.lora: LoRA adapters train the policy only"),
    ("algorithm.distill.mode=both", "algorithm.distill.mode: expected one of reverse_kl, forward_kl"),
    ("algorithm.name=ppo critic.enabled=true algorithm.distill.mode=forward_kl", "use algorithm.name=grpo"),
    ("rollout.mode=one_step_off algorithm.distill.mode=forward_kl", "rollout.mode=one_step_off schedules"),
])
def test_bad_distillation_settings_name_the_field(tiny_model_factory, override, words):
    path = tiny_model_factory("tiny-qwen2")
    with pytest.raises(ConfigError, match=words):
        load_config(None, [*BASE, "teacher.enabled=true", f"teacher.model_path={path}", *override.split()])


def test_another_family_with_the_same_tokenizer_is_accepted(tiny_model_factory, tmp_path, run_dir):
    teacher = tiny_model_factory("tiny-llama")
    cfg = load_config(None, [*BASE, "teacher.enabled=true", f"teacher.model_path={teacher}",
                             f"trainer.output_dir={run_dir}"])
    prepare_inputs(cfg)  # the policy is a Qwen2, the teacher a Llama: one tokenizer, so distillation runs


def test_a_teacher_with_another_tokenizer_is_refused_before_any_worker(tiny_model_factory, tmp_path, run_dir):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_factory("tiny-qwen2"), teacher)
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two ids swapped: same size, different meaning
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    cfg = load_config(None, [*BASE, "teacher.enabled=true", f"teacher.model_path={teacher}",
                             f"trainer.output_dir={run_dir}"])
    with pytest.raises(ConfigError, match="teacher.model_path: the teacher's tokenizer .* is not the policy's"):
        prepare_inputs(cfg)
