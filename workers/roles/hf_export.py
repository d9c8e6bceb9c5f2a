"""Export a live (TP/PP/DP-sharded) `MegatronEngine` model as an HF folder, streamed tensor by tensor.

Collective over the whole world. One rank per pipeline stage (tp 0, dp 0) writes that stage's tensors
to its own safetensors file while they are gathered over TP; rank 0 then writes the index (when there
are several files), config.json, the generation config and the tokenizer files. A LoRA model exports its
merged weights (W + s B A) there, and its adapters in PEFT's format under `adapter/`
(`workers.megatron.lora_peft`), loadable onto the base model with `peft.PeftModel.from_pretrained`.

A value-head model (reward model, critic) becomes an HF sequence-classification model: `score.weight`
instead of the LM head, `architectures: [<Family>ForSequenceClassification]`, `num_labels: 1` and
`pad_token_id` = the tokenizer's pad id. HF pools the logits at each row's last token that is not the pad
id, which is our `last_token_index` (the last token of the attention mask) whenever the padding uses the pad
id and the pad id occurs nowhere else in the sequences (a dedicated pad token, as in Qwen's and our tiny
tokenizers); a tokenizer whose pad is its eos gets a warning, since HF would then pool before a final eos.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("workers")
# copied from the model folder: generation defaults, and a vision-language model's image processor
_EXTRA_FILES = ("generation_config.json", "preprocessor_config.json")
ADAPTER_SUBDIR = "adapter"  # a LoRA model's PEFT adapter folder inside the export


def stage_file_name(stage: int, pp: int) -> str:
    return "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"


def _write_stage(engine: Any, out: Path) -> tuple[str, list[str]] | None:
    """This rank's part: stream its stage's HF tensors into a file when it is the stage's writer."""
    from megatron.core import parallel_state as ps

    from workers.megatron.hf_map import expected_hf_shapes, hf_dtype
    from workers.megatron.hf_weights import is_hf_weight_source, iter_hf_weights, yielded_hf_names
    from workers.megatron.safetensors_writer import StreamingSafetensorsWriter

    engine.finish_param_gather()
    cfg, model = engine.hf_config, engine.module
    fname = stage_file_name(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
    if not is_hf_weight_source():
        for _ in iter_hf_weights(model, cfg):  # the TP / EP gathers are collective: iterate in step
            pass
        return None
    shapes = expected_hf_shapes(cfg, value_head=engine.value_head)
    names = yielded_hf_names(model, cfg)
    with StreamingSafetensorsWriter(out / fname, [(n, shapes[n], hf_dtype(n, engine.dtype)) for n in names]) as writer:
        for name, tensor in iter_hf_weights(model, cfg):
            writer.write(name, tensor.to(hf_dtype(name, engine.dtype)))
    return fname, names


def _write_side_files(engine: Any, out: Path, tokenizer_path: str | None) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(engine.model_path)  # as written (engine.hf_config may be its language view)
    cfg.torch_dtype = engine.dtype
    tokenizer = None
    if tokenizer_path:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - the weights are still usable; say why the tokenizer is missing
            log.warning("export to %s: no tokenizer copied from %s (%s)", out, tokenizer_path, e)
    if engine.value_head:
        _as_sequence_classifier(cfg, tokenizer, out)
    cfg.save_pretrained(out)
    src = Path(engine.model_path)
    for name in _EXTRA_FILES if not engine.value_head else ():
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def sequence_classification_class(model_type: str) -> str:
    """transformers' `*ForSequenceClassification` class name of a model type (Qwen2ForSequenceClassification)."""
    from transformers.models.auto import modeling_auto

    names = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    if model_type not in names:
        raise ValueError(f"transformers has no sequence-classification model for model_type {model_type!r}")
    return names[model_type]


def _as_sequence_classifier(cfg: Any, tokenizer: Any, out: Path) -> None:
    """Make `cfg` describe the one-label sequence classifier of a value-head model (module docstring)."""
    cfg.architectures = [sequence_classification_class(cfg.model_type)]
    cfg.num_labels = 1
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = getattr(cfg, "pad_token_id", None) if pad is None else pad
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else getattr(cfg, "eos_token_id", None)
    if pad is None:
        log.warning("export to %s: no pad token id; HF's sequence classifier then scores the last column, "
                    "right for unpadded or left-padded batches only", out)
    elif pad == eos:
        log.warning("export to %s: the pad id %s is also the eos id; HF's sequence classifier pools the last "
                    "non-pad token, one before a final eos, where our reward model reads the eos", out, pad)
    cfg.pad_token_id = pad


def export_hf_folder(engine: Any, path: str | Path, tokenizer_path: str | None = None) -> Path:
    """Write the engine's full model as an HF folder at `path` (collective; see module docstring)."""
    from workers.megatron.hf_weights import write_hf_index

    out = Path(path)
    dist = torch.distributed
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
            stale.unlink()
    dist.barrier()
    part = _write_stage(engine, out)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    if rank == 0:
        files = dict(p for p in parts if p is not None)
        if len(files) > 1:
            write_hf_index(out, files)
        _write_side_files(engine, out, tokenizer_path)
    dist.barrier()
    if engine.lora is not None:  # the merged weights above, and the adapters alone in PEFT's format
        from workers.megatron.lora_peft import write_peft_adapter

        write_peft_adapter(engine, out / ADAPTER_SUBDIR)
    return out
