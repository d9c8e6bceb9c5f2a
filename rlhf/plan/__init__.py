"""`rlhf plan`: estimate memory and step time of parallel layouts and pick one.

- `model`: the numbers of a model (HF config.json, a tiny preset or a well-known model);
- `hardware`: GPU specs (peak bf16 FLOP/s, memory, NVLink and network bandwidth);
- `memory`: bytes per GPU of parameters, gradients, optimizer state, activations, KV cache;
- `estimate`: step time from a roofline (FLOPs, communication, pipeline bubble);
- `search`: enumerate layouts, rank them, explain a model that fits nowhere;
- `overlay`: the best layout as a config overlay for `rlhf train CONFIG OVERLAY`.
"""
