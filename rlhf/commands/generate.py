"""`rlhf generate`: sample from an HF folder or a converted Megatron checkpoint on the rollout engine."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate answers with the vLLM rollout engine")
    p.add_argument("--model", required=True, help="HF model folder, a megatron checkpoint from `rlhf convert`, or a "
                                                   "training checkpoint (<run>/checkpoints/<step>/policy)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (sent as a user chat message unless --raw)")
    src.add_argument("--input", help="jsonl with `prompt` (text) or `messages` (chat) per line")
    p.add_argument("--output", help="write one jsonl row per prompt here instead of printing")
    p.add_argument("--raw", action="store_true", help="send prompts as raw text, without the chat template")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load a megatron checkpoint without a matching rlhf manifest (its pickles can run code)")
    p.set_defaults(func=run)


def _read_prompts(args: argparse.Namespace) -> list:
    from rlhf.data.jsonl import check_input_file, read_jsonl
    from rlhf.errors import UserError

    if args.prompt is not None:
        return [args.prompt if args.raw else [{"role": "user", "content": args.prompt}]]
    path = check_input_file(args.input, "--input")
    prompts = []
    for line_no, rec in read_jsonl(path):
        if isinstance(rec.get("messages"), list):
            prompts.append(rec["messages"])
        elif isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"] if args.raw else [{"role": "user", "content": rec["prompt"]}])
        else:
            raise UserError(f"{path}:{line_no}: expected a `prompt` string or a `messages` list")
    if not prompts:
        raise UserError(f"{path}: no prompts")
    return prompts


def hf_folder(model: str, tmp: str, trust: bool = False) -> str:
    from rlhf.errors import UserError

    path = Path(model)
    if (path / "config.json").is_file():
        from workers.megatron.hf_weights import HFTensorSource

        try:  # every safetensors header is read (a truncated file is a FileProblem) before the engine starts
            HFTensorSource(path).close()
        except ValueError as e:
            raise UserError(f"--model: {e}") from None
        return str(path)
    if path.is_dir():  # a converted megatron checkpoint, or a training one: export it to HF first
        from rlhf.conversion.convert import mcore_to_hf

        return str(mcore_to_hf(path, Path(tmp) / "hf", trust=trust))
    raise UserError(f"--model: {model} is neither an HF folder (config.json) nor a megatron checkpoint folder")


def run(args: argparse.Namespace) -> int:
    from rlhf.errors import UserError
    from workers.batch import Batch
    from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig

    prompts = _read_prompts(args)
    if args.output:
        from rlhf.paths import check_writable

        check_writable(args.output)  # a read-only or missing folder fails now, not after generating
    try:
        sampling = SamplingConfig(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                  max_tokens=args.max_tokens, seed=args.seed).validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="rlhf-generate-") as tmp:
        model = hf_folder(args.model, tmp, args.trust_checkpoint)
        engine = RolloutGroup(EngineConfig(model_path=model, dtype=args.dtype, kv_cache_gb=0.5), in_process=True)
        try:
            key = "prompt" if args.raw else "messages"
            out = engine.generate(Batch(meta={key: prompts}), sampling)
        finally:
            engine.shutdown()
    rows = []
    for i in range(len(prompts)):
        texts = out["response_text"][i * args.n: (i + 1) * args.n]
        rows.append({"prompt": out["prompt"][i * args.n], "responses": texts})
    if args.output:
        from rlhf.paths import staged_output_file

        with staged_output_file(args.output) as tmp, open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {args.output}")
    else:
        for row in rows:
            for t in row["responses"]:
                sys.stdout.write(json.dumps({"prompt": row["prompt"], "response": t}) + "\n")
    return 0
