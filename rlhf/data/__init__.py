"""Data for pretraining, SFT and RL: cleaning, tokenising to Megatron's indexed format, datasets, loaders.

Modules (imported directly; this package imports nothing heavy):
- `tokenizer`: load an HF tokenizer folder; `MegatronTokenizerAdapter` for megatron-core datasets.
- `jsonl`: streaming jsonl reading with file:line errors.
- `clean`: `rlhf clean` (strip, whitespace normalisation, short-doc and exact-duplicate removal).
- `preprocess`: `rlhf preprocess` jsonl/txt -> `P_<key>_document.bin/.idx` (multiprocess tokenising).
- `pretrain`: `build_pretrain_datasets` on megatron-core's GPTDataset / BlendedMegatronDatasetBuilder.
- `chat`: ShareGPT / OpenAI conversations -> token ids + assistant mask via the chat template.
- `packing`: sequence packing (samples into rows, each row's segments).
- `sft`: `SFTDataset` and `collate_sft` (batch keys and shapes documented there).
- `sft_indexed`: `rlhf preprocess --sft`, pre-tokenised SFT sets in the indexed format.
- `prompts`: `load_prompt_dataset` and `PromptLoader` for RL.
- `arithmetic`: the tiny arithmetic example task.
- `checks`: up-front validation (`check_seq_length`, data prefixes, split strings).
"""
