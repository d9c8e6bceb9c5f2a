"""`rlhf preprocess`: tokenise jsonl into Megatron's indexed format (pretraining text, or SFT with --sft), or
(`--format llava`) write LLaVA-format image conversations as WebDataset shards."""

from __future__ import annotations

import argparse
from pathlib import Path

HF_TOKENIZER_TYPES = ("PretrainedFromHF", "HuggingFaceTokenizer")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenise jsonl into PREFIX_<key>_document.bin/.idx (or an SFT set with --sft, or "
        "--format llava: image conversations into WebDataset shards)",
        description="Tokenise a jsonl (or one-document-per-line .txt) file into Megatron's indexed dataset "
        "(PREFIX_<json-key>_document.bin/.idx). With --sft, tokenise conversations (OpenAI 'messages' or "
        "ShareGPT 'conversations') with the chat template into PREFIX_sft_input_ids and "
        "PREFIX_sft_assistant_mask. With --format llava, write a LLaVA JSON list (or jsonl) of "
        "{id, image, conversations} with the images of --images into DIR/shard-000000.tar, ... (raw "
        "conversations and image bytes, tokenised at train time), then read them back to verify.",
    )
    p.add_argument(
        "--format",
        choices=("indexed", "llava"),
        default="indexed",
        help="indexed: tokenise into Megatron's indexed format (default); llava: WebDataset shards",
    )
    p.add_argument(
        "--input", required=True, help="input .jsonl (or .txt: one document per line; llava: .json or .jsonl)"
    )
    p.add_argument("--output-prefix", help="output path prefix (indexed format: required)")
    p.add_argument(
        "--tokenizer",
        "--tokenizer-name-or-path",
        dest="tokenizer",
        help="local HF tokenizer or model folder (indexed format: required)",
    )
    p.add_argument("--images", help="llava: the folder the records' image names are relative to")
    p.add_argument("--output-dir", help="llava: folder for the shards (earlier shards in it are replaced)")
    p.add_argument("--shard-size", type=int, default=1000, help="llava: samples per shard (default: 1000)")
    p.add_argument(
        "--tokenizer-type",
        default="PretrainedFromHF",
        choices=HF_TOKENIZER_TYPES,
        help="accepted for compatibility; only HF tokenizer folders are supported",
    )
    p.add_argument(
        "--json-key", "--json-keys", dest="json_key", default="text", help="text field (default: text)"
    )
    p.add_argument("--workers", type=int, default=1, help="tokeniser processes (1 = in this process)")
    p.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document (eos) token to each doc"
    )
    p.add_argument(
        "--strict", action="store_true", help="fail on the first malformed line instead of skipping it"
    )
    p.add_argument(
        "--sft", action="store_true", help="build an SFT set from conversations (needs --seq-length)"
    )
    p.add_argument(
        "--seq-length", type=int, default=None, help="--sft: truncate conversations to this length"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlhf.errors import UserError

    if args.format == "llava":
        return run_llava(args)
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    for flag, value in (("--output-prefix", args.output_prefix), ("--tokenizer", args.tokenizer)):
        if value is None:
            raise UserError(f"{flag} is required (with --format indexed)")
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    if args.sft:
        from rlhf.data.checks import check_seq_length
        from rlhf.data.sft_indexed import preprocess_sft, sft_prefixes

        if args.seq_length is None:
            raise UserError("--sft needs --seq-length")
        if (Path(args.tokenizer) / "config.json").is_file():
            check_seq_length(args.seq_length, args.tokenizer)
        prefix, stats = preprocess_sft(
            args.input,
            args.output_prefix,
            args.tokenizer,
            args.seq_length,
            workers=args.workers,
            strict=args.strict,
            progress=not args.no_progress,
        )
        outputs: tuple[str, ...] = sft_prefixes(prefix)
    else:
        from rlhf.data.preprocess import preprocess_pretrain

        if args.seq_length is not None:
            raise UserError(
                "--seq-length only applies with --sft (pretraining samples are cut at train time)"
            )
        prefix, stats = preprocess_pretrain(
            args.input,
            args.output_prefix,
            args.tokenizer,
            json_key=args.json_key,
            workers=args.workers,
            append_eod=args.append_eod,
            strict=args.strict,
            progress=not args.no_progress,
        )
        outputs = (prefix,)
    print(stats.summary())
    for out in outputs:
        print(f"wrote {out}.bin and {out}.idx")
    return 0


def run_llava(args: argparse.Namespace) -> int:
    """Write the shards, then stream them back and check the counts match what was written."""
    from rlhf.data.jsonl import check_input_file
    from rlhf.data.llava_shards import count_shards, write_llava_shards
    from rlhf.errors import UserError

    for flag, value in (("--images", args.images), ("--output-dir", args.output_dir)):
        if value is None:
            raise UserError(f"{flag} is required with --format llava")
    if args.sft or args.seq_length is not None:
        raise UserError("--sft and --seq-length do not apply with --format llava (shards are tokenised at train time)")
    if args.shard_size < 1:
        raise UserError(f"--shard-size must be >= 1, got {args.shard_size}")
    check_input_file(args.input, "--input")
    if not Path(args.images).is_dir():
        raise UserError(f"--images {args.images} does not exist or is not a folder")
    stats = write_llava_shards(args.input, args.images, args.output_dir, args.shard_size, strict=args.strict)
    print(stats.summary())
    print(f"wrote {len(stats.shards)} shards to {args.output_dir}")
    samples, size, shards = count_shards(args.output_dir)
    print(f"read {samples} samples, {size} bytes from {shards} shards")
    if (samples, size, shards) != (stats.samples, stats.bytes, len(stats.shards)):
        raise UserError(f"{args.output_dir}: the shards read back do not match what was written ({stats.summary()})")
    return 0
