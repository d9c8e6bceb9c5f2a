"""lm-evaluation-harness tasks on our engine and local data: `lm_eval:<task or task.yaml>[:<file>[@<examples>]]`.

lm-eval (0.4.13) brings the task definition (prompt template, few-shot sampling, answer filters, metrics); we
bring the model (`EngineLM`, lm-eval's `LM` interface over the rollout engine: `loglikelihood` through our
option scoring, `generate_until` through `engine.generate`) and the data: a task whose `dataset_path` is on
the hub gets a local file in its place (`dataset_path: json|csv|parquet` with `data_files`), and one that
would still need the hub is refused before anything is loaded. The hub is never contacted (HF_HUB_OFFLINE).
Tasks that execute model-written code with lm-eval (`unsafe_code`) are refused: that code runs only in our
sandbox (`code:<file>`). A task YAML may name Python functions (`!function`): like `reward.fn`, it is the
user's own code and runs in this process."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.eval.items import Item, Task

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
_LOCAL_PATHS = {"json", "csv", "parquet", "text", "arrow"}


def offline() -> None:
    """No hub access from datasets, huggingface_hub or lm-eval, also where they were imported already."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = sys.modules["datasets"].config.HF_DATASETS_OFFLINE = True


def parse_spec(arg: str) -> tuple[str, Path | None, Path | None]:
    """`<task or yaml>[:<file>[@<examples file>]]` -> (task, data file, examples file)."""
    task, _, files = arg.partition(":")
    data, _, shots = files.partition("@")
    paths = [Path(p) if p else None for p in (data, shots)]
    for p in paths:
        if p is not None and not p.is_file():
            raise UserError(f"task lm_eval:{arg}: data file {p} not found")
        if p is not None and p.suffix not in LOCAL_BUILDERS:
            raise UserError(f"task lm_eval:{arg}: {p} must end in one of {', '.join(LOCAL_BUILDERS)}")
    if paths[0] and paths[1] and LOCAL_BUILDERS[paths[0].suffix] != LOCAL_BUILDERS[paths[1].suffix]:
        raise UserError(f"task lm_eval:{arg}: the examples file must have the data file's format ({paths[0].suffix})")
    return task, paths[0], paths[1]


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def task_config(name: str, spec: str) -> dict[str, Any]:
    """The task config (includes resolved) of a task YAML path or of a task lm-eval ships, checked against
    what we refuse before any Python module it names is imported (a task's module may reach for the hub)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = _task_file(name, spec)
    try:
        cfg = load_yaml(path, resolve_func=False)
        _refuse(name, cfg)
        return load_yaml(path, resolve_func=True)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a YAML error of any kind is the user's file
        raise UserError(f"task {name}: cannot read {path}: {str(e).splitlines()[0]}") from None


def _task_file(name: str, spec: str) -> Path:
    """The YAML file of `spec`: a path, or the file lm-eval ships for that task name."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if spec.endswith((".yaml", ".yml")):
        if not Path(spec).is_file():
            raise UserError(f"task {name}: task file {spec} not found")
        return Path(spec)
    for p in sorted(_lm_eval_tasks_dir().glob(f"**/{spec}.yaml")):  # most tasks live in <task>.yaml
        if load_yaml(p, resolve_func=False, recursive=False).get("task") == spec:
            return p
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index  # slow (reads every YAML), only for a task not in its own file
    entry = index.get(spec)
    if entry is None or entry.yaml_path is None:
        import difflib

        close = difflib.get_close_matches(spec, list(index), n=5)
        raise UserError(f"task {name}: lm-eval has no task {spec!r}" + (f"; close: {', '.join(close)}" if close else ""))
    return Path(entry.yaml_path)


def _refuse(name: str, cfg: dict[str, Any]) -> None:
    if "group" in cfg or "task_list" in cfg or isinstance(cfg.get("task"), list):
        raise UserError(f"task {name}: a group of lm-eval tasks; name one of its tasks (e.g. mmlu_abstract_algebra)")
    if "class" in cfg:
        raise UserError(f"task {name}: a Python task class; only YAML task definitions run here")
    if cfg.get("unsafe_code"):
        raise UserError(f"task {name}: lm-eval would execute model-written code outside our sandbox (unsafe_code); "
                        "use code:<file> (HumanEval or MBPP layout), which runs it in the sandbox")
    if cfg.get("output_type") == "loglikelihood_rolling":
        raise UserError(f"task {name}: perplexity tasks (loglikelihood_rolling) are not supported")


def local_data(name: str, cfg: dict[str, Any], data: Path | None, shots: Path | None) -> dict[str, Any]:
    """The config with its dataset replaced by local files (test split `test`, examples split `dev`), or
    unchanged when it already reads local files; a dataset that would come from the hub is refused."""
    if data is not None:
        files = {"test": str(data.resolve()), **({"dev": str(shots.resolve())} if shots else {})}
        cfg = {**cfg, "dataset_path": LOCAL_BUILDERS[data.suffix], "dataset_name": None,
               "dataset_kwargs": {"data_files": files}, "test_split": "test", "fewshot_split": "dev" if shots else None,
               "training_split": None, "validation_split": None}
        if shots is None and isinstance(cfg.get("fewshot_config"), dict):
            cfg["fewshot_config"] = {k: v for k, v in cfg["fewshot_config"].items() if k != "split"}
        return cfg
    path = str(cfg.get("dataset_path", ""))
    if (path in _LOCAL_PATHS and (cfg.get("dataset_kwargs") or {}).get("data_files")) or (path and Path(path).is_dir()):
        return cfg
    where = ", ".join(f"{k}: {cfg[k]}" for k in ("dataset_path", "dataset_name") if cfg.get(k))
    raise UserError(f"task {name}: its data is on the hub ({where}), which rlhf eval never downloads; give a local "
                    f"file: {name}:<test.jsonl>[@<examples.jsonl>] (the dataset's own fields), or a task YAML with "
                    "dataset_path: json and dataset_kwargs.data_files")


def load_harness_task(name: str, arg: str, limit: int | None, num_fewshot: int | None, seed: int) -> Task:
    """Build the lm-eval task (its data loaded from the local files now, so a bad file fails before the engine
    starts) with `num_fewshot` examples (None: the task's own default) drawn with `seed`."""
    offline()
    from lm_eval.tasks import TaskManager

    spec, data, shots = parse_spec(arg)
    cfg = local_data(name, task_config(name, spec), data, shots)
    try:
        lm_task = TaskManager(include_defaults=False).load([cfg])["tasks"]
    except Exception as e:  # noqa: BLE001 - datasets / jinja / lm-eval errors about the user's files
        raise UserError(f"task {name}: lm-eval cannot load it: {type(e).__name__}: {e}".splitlines()[0]) from None
    (task_name, obj), = lm_task.items()
    if num_fewshot is not None:
        obj.set_config(key="num_fewshot", value=num_fewshot)
    elif obj.get_config("num_fewshot") is None:
        obj.set_config(key="num_fewshot", value=0)
    obj.set_fewshot_seed(seed=seed)
    docs = list(obj.eval_docs)[:limit]
    stem = data.stem if data is not None else ""
    return Task(name, "harness", [Item(doc, None) for doc in docs], harness=obj,
                short=f"lm_eval:{task_name}" + (f":{stem}" if stem else ""),
                config={"lm_eval_task": task_name, "file": str(data) if data else None,
                        "fewshot_file": str(shots) if shots else None, "num_fewshot": obj.get_config("num_fewshot"),
                        "limit": limit, "output_type": obj.get_config("output_type")})


def evaluate_harness(engine: Any, tokenizer: Any, task: Task, opts: Any) -> dict[str, Any]:
    """Run lm-eval's evaluator on the task with our engine as its model; its metrics, in our result layout."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    from rlhf.eval.engine_lm import EngineLM

    obj = task.harness
    lm = EngineLM(engine, tokenizer, opts, greedy_check=obj.get_config("output_type") == "loglikelihood")
    # lm-eval's evaluator itself (simple_evaluate adds seeding of the process's global RNGs, which the training
    # driver keeps for itself, and environment reports); the few-shot seed was set when the task was loaded
    out = evaluate(lm=lm, task_dict=TaskManager(include_defaults=False).load([obj]), limit=task.config["limit"],
                   bootstrap_iters=1000, log_samples=True, confirm_run_unsafe_code=False)
    assert out is not None  # rank 0
    name = task.config["lm_eval_task"]
    raw = out["results"][name]
    metrics: dict[str, dict[str, float]] = {}
    for key, value in raw.items():
        metric, _, filt = key.partition(",")
        if not filt or "_stderr" in metric:
            continue
        se = raw.get(f"{metric}_stderr,{filt}")
        label = metric if filt == "none" else f"{metric}/{filt}"
        metrics[label] = {"value": float(value), "stderr": float(se) if isinstance(se, (int, float)) else 0.0}
    if not metrics:
        raise UserError(f"task {task.name}: lm-eval reported no metrics ({sorted(raw)})")
    main = next(iter(metrics))
    by_doc: dict[int, dict[str, Any]] = {}  # lm-eval logs a sample per document and filter: one per document
    for s in out["samples"][name]:
        d = by_doc.setdefault(s["doc_id"], {"doc_id": s["doc_id"], "arguments": s["arguments"], "target": s["target"],
                                            "responses": [r[0] if len(r) == 1 else r for r in s["resps"]],
                                            "filtered": {}})
        d["filtered"][s["filter"]] = {"responses": s["filtered_resps"], **{m: s[m] for m in s["metrics"] if m in s}}
    samples = list(by_doc.values())
    cfg = out["configs"][name]
    lm_cfg = {k: cfg.get(k) for k in ("output_type", "num_fewshot", "metric_list", "generation_kwargs",
                                      "fewshot_split", "description")}
    return {"metric": main, "value": metrics[main]["value"], "stderr": metrics[main]["stderr"],
            "n": out["n-samples"][name]["effective"],
            "config": {"kind": "harness", **task.config, "lm_eval": {**lm_cfg, "version": out["versions"].get(name)}},
            "metrics": metrics, "samples": samples}
