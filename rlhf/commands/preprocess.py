"""`rlhf preprocess`: tokenise jsonl into Megatron's indexed format (pretraining text, or SFT with --sft)."""

from __future__ import annotations

import argparse
from pathlib import Path

HF_TOKENIZER_TYPES = ("PretrainedFromHF", "HuggingFaceTokenizer")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenise jsonl into PREFIX_<key>_document.bin/.idx (or an SFT set with --sft)",
        description="Tokenise a jsonl (or one-document-per-line .txt) file into Megatron's indexed dataset "
        "(PREFIX_<json-key>_document.bin/.idx). With --sft, tokenise conversations (OpenAI 'messages' or "
        "ShareGPT 'conversations') with the chat template into PREFIX_sft_input_ids and "
        "PREFIX_sft_assistant_mask.",
    )
    p.add_argument("--input", required=True, help="input .jsonl (or .txt: one document per line)")
    p.add_argument("--output-prefix", required=True, help="output path prefix")
    p.add_argument(
        "--tokenizer",
        "--tokenizer-name-or-path",
        dest="tokenizer",
        required=True,
        help="local HF tokenizer or model folder",
    )
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

    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
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
        outputs = sft_prefixes(prefix)
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
