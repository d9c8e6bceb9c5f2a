"""Per-rank conversion steps, run in processes spawned by `workers.megatron.launch.run_distributed`."""

from __future__ import annotations

from pathlib import Path

from workers.file_problems import file_errors


def hf_to_mcore_rank(hf_dir: str, out_dir: str, dtype_name: str, padded_vocab: int) -> None:
    """Build this rank's model shard, fill it from the HF safetensors (streamed), save with dist_checkpointing."""
    from workers.dtypes import as_dtype
    from workers.megatron.hf_fields import load_model_config
    from workers.megatron.hf_weights import load_hf_weights
    from workers.megatron.mcore_checkpoint import save_model
    from workers.megatron.model_provider import build_gpt_model

    cfg = load_model_config(hf_dir)
    model = build_gpt_model(
        cfg, dtype=as_dtype(dtype_name), padded_vocab=padded_vocab, perform_initialization=False
    )
    load_hf_weights(model, hf_dir, cfg)
    with file_errors(out_dir, "write"):
        save_model(model, out_dir)


def mcore_to_hf_rank(ckpt_dir: str, out_dir: str, trust: bool = False) -> tuple[str, list[str]] | None:
    """Load the checkpoint at this world's TP/PP and stream this stage's HF tensors into one safetensors
    file (written by tp rank 0, dp rank 0 of each stage). Returns (file name, tensor names) on writers."""
    from megatron.core import parallel_state

    from workers.megatron.hf_map import expected_hf_shapes, hf_dtype
    from workers.megatron.hf_weights import is_hf_weight_source, iter_hf_weights, yielded_hf_names
    from workers.megatron.mcore_checkpoint import MODEL_SUBDIR, load_hf_config, load_model, read_meta
    from workers.megatron.model_provider import build_gpt_model
    from workers.megatron.safetensors_writer import StreamingSafetensorsWriter

    meta = read_meta(ckpt_dir)
    cfg = load_hf_config(ckpt_dir)
    model = build_gpt_model(
        cfg, dtype=meta.torch_dtype, padded_vocab=meta.padded_vocab_size, perform_initialization=False
    )
    with file_errors(Path(ckpt_dir) / MODEL_SUBDIR, "read", "checkpoint shard"):
        load_model(model, ckpt_dir, trust=trust)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    fname = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    writer = None
    names: list[str] = []
    with file_errors(Path(out_dir) / fname, "write"):
        if is_hf_weight_source():
            shapes = expected_hf_shapes(cfg)
            names = yielded_hf_names(model, cfg)
            writer = StreamingSafetensorsWriter(
                Path(out_dir) / fname, [(n, shapes[n], hf_dtype(n, meta.torch_dtype)) for n in names]
            )
        for name, tensor in iter_hf_weights(model, cfg):
            if writer is not None:
                writer.write(name, tensor)
        if writer is None:
            return None
        writer.close()
    return fname, names
