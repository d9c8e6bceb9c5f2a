"""Rank functions for the conversion tests (module level so spawned ranks can import them)."""

from __future__ import annotations

import torch


def _hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _loss(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> float:
    logits = logits[..., :vocab].float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1)).item()


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def parity_and_reshard(hf_dirs: list[str], mcore_dirs: dict[str, str], save_dirs: dict[str, str]) -> dict:
    """For each HF folder: load its weights into the megatron model of this world (TP/PP), compare the
    logits with transformers, and check that `iter_hf_weights` gives back the source tensors bit-exactly.
    For each `save_dirs[hf_dir]`: save the HF-loaded model there with dist_checkpointing. For each
    `mcore_dirs[hf_dir]` (a converted checkpoint): load it at this world's layout and return the loss. Returns per-rank results for the parent to assert on."""
    from megatron.core import parallel_state
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from workers.megatron.hf_weights import is_hf_weight_source, iter_hf_weights, load_hf_weights
    from workers.megatron.mcore_checkpoint import load_model, read_meta, save_model
    from workers.megatron.model_provider import build_gpt_model, forward_logits

    out: dict = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                 "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "models": {}}
    for hf_dir in hf_dirs:
        cfg = AutoConfig.from_pretrained(hf_dir)
        res: dict = {}
        model = build_gpt_model(cfg)
        res["filled"] = len(load_hf_weights(model, hf_dir, cfg))
        res["n_params"] = len(list(model.parameters())) + _expert_biases(model)
        ids = _batch(cfg.vocab_size)
        logits = _cpu(forward_logits(model, ids))
        ref = None
        if logits is not None:
            ref = _hf_logits(hf_dir, ids)
            res["padded_vocab"] = logits.shape[-1]
            res["max_abs_diff"] = (logits[..., : cfg.vocab_size] - ref).abs().max().item()
            res["hf_loss"] = _loss(ref, ids, cfg.vocab_size)
        source = load_file(f"{hf_dir}/model.safetensors")
        names, mismatched = [], []
        for name, tensor in iter_hf_weights(model, cfg):
            names.append(name)
            if not (tensor.dtype == source[name].dtype and torch.equal(tensor.cpu(), source[name])):
                mismatched.append(name)
        res["yielded"] = names if is_hf_weight_source() else []
        res["mismatched"] = mismatched
        if hf_dir in save_dirs:
            save_model(model, save_dirs[hf_dir])
        if hf_dir in mcore_dirs:
            meta = read_meta(mcore_dirs[hf_dir])
            model2 = build_gpt_model(cfg, padded_vocab=meta.padded_vocab_size, perform_initialization=False)
            load_model(model2, mcore_dirs[hf_dir])
            logits2 = _cpu(forward_logits(model2, ids))
            if logits2 is not None:
                res["ckpt_loss"] = _loss(logits2, ids, cfg.vocab_size)
        out["models"][hf_dir] = res
    out["value"] = _value_model_check(hf_dirs[0], ids=_batch(64))
    return out


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    """Megatron's output on the CPU, where the transformers reference runs."""
    return None if t is None else t.float().cpu()


def _expert_biases(model) -> int:
    """DeepSeek-V3's router expert biases: buffers that are filled like parameters."""
    return sum(1 for n, _ in model.named_buffers() if n.endswith("mlp.router.expert_bias"))


def _value_model_check(hf_dir: str, ids: torch.Tensor) -> dict:
    """A value model loaded from a causal-LM folder: values equal HF's final hidden state @ head weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.model_provider import build_gpt_model, forward_logits

    cfg = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(cfg, value_head=True)
    filled = load_hf_weights(model, hf_dir, cfg)
    values = _cpu(forward_logits(model, ids))
    res: dict = {"filled": len(filled), "n_params": len(list(model.parameters()))}
    if values is not None:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            hidden = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        ref = hidden @ model.output_layer.weight.detach().cpu().T
        res["shape"] = tuple(values.shape)
        res["max_abs_diff"] = (values - ref).abs().max().item()
        res["head"] = model.output_layer.weight.detach().clone()
    return res
