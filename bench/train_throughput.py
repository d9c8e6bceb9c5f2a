"""Policy train_step throughput: our Megatron PolicyWorker (a Ray actor, megatron-core on CPU) against a
plain HF transformers model with torch AdamW doing the same PPO micro-batches.

Same model (preset small-qwen2 by default, ~30M Qwen2, fp32), same batch (B sequences of a left-padded
prompt and a right-padded response of random length), same micro-batches, same loss (PPO clipped
surrogate with the global token-mean normaliser from `algorithms`), gradient clipping and an AdamW step
per mini-batch. Both sides use the same number of torch threads and are timed end to end per
train_step (ours as the driver pays it: dispatch, the step in the actor, metrics back), one step of each
in turn. Tokens/s counts real (unpadded) tokens (median step). The RATIO is the median over the
alternating pairs of HF step time / our step time: the two steps of a pair ran under about the same
load from other processes, which on a shared machine moves single step times by 2-3x.
Where the difference comes from: the batch is padded to its longest prompt and response (the layout the
driver and rollout produce); HF computes every padded position, our worker packs each micro-batch's
sequences into as few rows as possible (block-diagonal attention) and so skips most of the padding.
Prints both rates and `RATIO train_throughput_vs_hf <ours / HF>`.
The MoE row (`--moe`): the same with `small-qwen2`'s attention and width as a Qwen2-MoE (8 routed experts,
top-2, expert FFN 704 = half the dense one, a gated shared expert of 704; ~2.5x the parameters, about the
dense model's compute per token): transformers' Qwen2-MoE against our Megatron engine (sequential experts on
CPU), `RATIO train_throughput_vs_hf_moe`.
Usage: python bench/train_throughput.py [--preset small-qwen2] [--moe] [--batch 16] [--micro 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from workers.batch import Batch, pad_sequences


def moe_preset(base: str) -> str:
    """Register (in this process) `base` as a Qwen2-MoE: 8 experts, top-2, expert and shared FFN half of the
    dense one (see the module docstring)."""
    import dataclasses

    from rlhf import tiny_models

    p = tiny_models.get_preset(base)
    name = f"{base}-moe"
    tiny_models.PRESETS[name] = dataclasses.replace(p, family="qwen2_moe", extra={
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": p.intermediate_size // 2,
        "shared_expert_intermediate_size": p.intermediate_size // 2, "norm_topk_prob": False})
    return name


def make_batch(n: int, vocab: int, prompt_len: int, resp_len: int, seed: int = 0) -> Batch:
    """Prompts of prompt_len/2..prompt_len tokens, responses of resp_len/4..resp_len tokens."""
    g = torch.Generator().manual_seed(seed)

    def seqs(lo: int, hi: int) -> list[torch.Tensor]:
        return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
                for _ in range(n)]

    p_ids, p_mask = pad_sequences(seqs(prompt_len // 2, prompt_len), left=True)
    r_ids, r_mask = pad_sequences(seqs(resp_len // 4, resp_len))
    batch = Batch({"input_ids": torch.cat([p_ids, r_ids], 1), "attention_mask": torch.cat([p_mask, r_mask], 1),
                   "responses": r_ids, "response_mask": r_mask})
    batch["advantages"] = torch.randn(r_ids.shape, generator=g) * r_mask
    return batch


def hf_step(model, opt, batch: Batch, micro: int, clip: float) -> None:
    """One PPO train_step the plain way: micro-batches accumulate, then clip and AdamW."""
    from algorithms import global_normalizer, policy_loss

    r = batch["responses"].shape[1]
    norm = global_normalizer(batch["response_mask"], "token-mean")
    opt.zero_grad(set_to_none=True)
    for mb in batch.chunks(micro):
        am = mb["attention_mask"]
        logits = model(input_ids=mb["input_ids"], attention_mask=am,
                       position_ids=(am.cumsum(-1) - 1).clamp_min(0)).logits[:, -r - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
        mask = mb["response_mask"].float()
        loss, _ = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mask, 0.2, 0.2, normalizer=norm)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def run_both(path: str, batch: Batch, micro: int, steps: int, threads: int, lr: float
             ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Alternate one timed step of ours and one of HF (the first of each warms up), so that a change in
    machine load hits both sides alike. Returns wall-clock step times in seconds (ours, hf) and the CPU
    seconds each side's process used per step (ours: the policy actor's, as its train_step reports)."""
    import ray
    from transformers import AutoModelForCausalLM

    from workers.group import WorkerGroup
    from workers.roles import PolicyWorker

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ray.init(num_cpus=threads, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ours, hf, ours_cpu, hf_cpu = [], [], [], []
    try:
        with tempfile.TemporaryDirectory() as logs:
            group = WorkerGroup("policy", PolicyWorker, num_cpus_per_worker=threads, num_threads=threads,
                                timeout_s=900, log_dir=logs,
                                init_kwargs={"model_path": path, "micro_batch_size": micro,
                                             "optim": {"lr": lr, "clip_grad": 1.0, "weight_decay": 0.0}})
            try:
                for i in range(steps + 1):
                    t0 = time.perf_counter()
                    m = group.train_step(batch, micro_batch_size=micro)
                    t1, c1 = time.perf_counter(), time.process_time()
                    hf_step(model, opt, batch, micro, clip=1.0)
                    t2, c2 = time.perf_counter(), time.process_time()
                    if i:
                        ours.append(t1 - t0)
                        hf.append(t2 - t1)
                        ours_cpu.append(m["cpu_s"])
                        hf_cpu.append(c2 - c1)
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    return ours, hf, ours_cpu, hf_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small-qwen2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--resp-len", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--moe", action="store_true", help="the preset as a Qwen2-MoE (see the module docstring)")
    args = ap.parse_args()

    from rlhf.tiny_models import create_tiny_model, get_preset

    if args.moe:
        args.preset = moe_preset(args.preset)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(create_tiny_model(args.preset, Path(tmp) / args.preset))
        batch = make_batch(args.batch, get_preset(args.preset).vocab_size, args.prompt_len, args.resp_len)
        batch["old_logprobs"] = torch.zeros_like(batch["advantages"])  # ratio = exp(logp): a real PPO step
        tokens = int(batch["attention_mask"].sum())
        lr = 1e-5
        ours, hf, ours_cpu, hf_cpu = run_both(path, batch, args.micro, args.steps, args.threads, lr)
    # Steps alternate (ours, HF, ours, HF, ...), so the two steps of a pair ran under about the same load
    # from other processes; the ratio is the median over the pairs of HF step time / our step time.
    pair = statistics.median(h / o for o, h in zip(ours, hf))
    ours_tps, hf_tps = tokens / statistics.median(ours), tokens / statistics.median(hf)
    print(f"model {args.preset}, batch {args.batch} x (prompt <= {args.prompt_len} + response <= {args.resp_len}), "
          f"{tokens} real tokens, micro-batch {args.micro}, {args.threads} threads, {args.steps} steps each "
          f"(alternating, after one warm-up step each)")
    for name, tps, times, cpu in (("ours (megatron PolicyWorker.train_step via Ray)", ours_tps, ours, ours_cpu),
                                  ("HF transformers + torch AdamW", hf_tps, hf, hf_cpu)):
        print(f"{name:48s} {tps:8.1f} tok/s (median step), {tokens / min(times):8.1f} best; "
              f"step s {[round(t, 2) for t in times]}, CPU s {[round(c, 2) for c in cpu]}")
    print(f"median-step ratio {ours_tps / hf_tps:.3f}; CPU-time ratio (median HF CPU s / ours) "
          f"{statistics.median(hf_cpu) / statistics.median(ours_cpu):.3f}; load1 {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"RATIO train_throughput_vs_hf{'_moe' if args.moe else ''} {pair:.3f}")


if __name__ == "__main__":
    main()
