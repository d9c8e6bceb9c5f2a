"""`rlhf init-model` and the CLI's handling of bad input (clean message, non-zero exit, no traceback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlhf.cli import main


@pytest.fixture
def rlhf(capsys):
    """`rlhf ARGS` through the CLI's main in this process (HF offline: tests/conftest.py): exit code and output."""

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


def test_init_model_loads_offline(tmp_path, rlhf):
    out = tmp_path / "m"
    r = rlhf("init-model", "--preset", "tiny-qwen2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e5 < n_params < 5e6
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 has qkv bias
    text = tok.apply_chat_template([{"role": "user", "content": "What is 12+34?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok("What is 12+34? 46")["input_ids"]
    assert tok.decode(ids) == "What is 12+34? 46"
    assert all(len(tok.convert_ids_to_tokens(i).strip("Ġ")) <= 1 for i in tok("12345")["input_ids"])  # digits split
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size) and torch.isfinite(logits).all()


def test_init_model_llama(tmp_path, rlhf):
    r = rlhf("init-model", "--preset", "tiny-llama", "--out", str(tmp_path / "l"))
    assert r.returncode == 0, r.stderr
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tmp_path / "l")
    assert cfg.model_type == "llama" and not cfg.tie_word_embeddings


@pytest.mark.parametrize(
    "args, words",
    [
        (["init-model", "--preset", "nope", "--out", "{tmp}/x"], ["unknown preset 'nope'", "tiny-qwen2"]),
        (["init-model", "--preset", "tiny-qwen2", "--out", "{tmp}/full"], ["not empty", "--force"]),
    ],
)
def test_bad_input_is_clean(tmp_path, rlhf, args, words):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    r = rlhf(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one line (an unexpected exception fails the test)
    for w in words:
        assert w in r.stderr


def test_force_overwrites(tmp_path, rlhf):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    r = rlhf("init-model", "--preset", "tiny-qwen2", "--out", str(tmp_path / "full"), "--force")
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "full" / "keep.txt").exists()
