"""Step time of the GRPO example (configs/grpo_tiny.yaml through `rlhf train`) as the work grows.

Rows: 1x, 2x and 4x prompts per step (16, 32, 64 prompts x 8 samples), and 2x and 4x model width (hidden
and FFN sizes of arith-qwen2 times 2 and 4; heads unchanged, so head_dim 64 and 128). Every row runs the
example's config with only that change, from a random-init model of its width (no warm start, so every row
samples up to the same max_tokens and the rows differ only in the scaled quantity; the mean response length
is shown). The figure is the median step time after the first `--skip` steps; each row gives its ratio to
the 1x row, and for prompts the ratio per sample (1.0 = linear scaling, below 1 = better than linear).

`--nodes`: instead, the 1x row on a simulated Ray cluster (tests/helpers/local_cluster.py) of one node against two
nodes (a head of 1 CPU with the driver, a node of 2 CPUs): on one node the weights go through shared
memory; on two, the policy and the engine cannot all share the driver's node, so the sync goes over gloo
and every call crosses a node. The ratio is the cost of the network transport and the cross-node calls.

`--engines`: instead, the 1x row with one engine against two (rollout.num_engines=2, each engine 1 CPU
and 1 thread): the generate phase splits its prompts over the engines by load, and every sync feeds both.

Usage: python bench/scaling.py [--quick] [--steps N] [--nodes | --engines]. Runs go under runs/bench/scaling/.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C

CONFIG = "configs/grpo_tiny.yaml"
OUT = C.WORK / "scaling"


def overrides(model: Path, data: dict[str, Path], prompts: int, steps: int) -> list[str]:
    return [
        f"model.path={model}", "model.preset=null", "model.warm_start_steps=0",
        "data.task=null", f"data.train_file={data['rl_train']}", "data.val_file=null", "data.val_size=0",
        "data.messages_key=messages", f"data.prompts_per_step={prompts}",
        f"trainer.total_steps={steps}", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false",
        "trainer.progress_bar=false", "trainer.tensorboard=false",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps per row")
    p.add_argument("--steps", type=int, help="steps per row (default 12, 6 with --quick)")
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the median")
    p.add_argument("--nodes", action="store_true", help="one simulated node against two (see the docstring)")
    p.add_argument("--engines", action="store_true", help="one rollout engine against two (see the docstring)")
    args = p.parse_args(argv)
    steps = args.steps or (6 if args.quick else 12)
    skip = min(args.skip, steps - 1)
    from rlhf.config import load_config

    base = load_config(C.REPO / CONFIG, [], validate=False)
    pps = base.data.prompts_per_step
    print(C.machine_line(), flush=True)
    print(f"{CONFIG}: {pps} prompts x {base.rollout.n} samples, max_tokens {base.rollout.max_tokens}; "
          f"{steps} steps per row, median of steps {skip + 1}..{steps}", flush=True)
    data = C.arith_data(seed=0, val_size=200)
    if args.nodes:
        return nodes_rows(base, data, steps, skip, argv)
    if args.engines:
        return engines_rows(base, data, steps, skip, argv)
    rows_spec = [("1x", 1, 1), ("2x prompts", 2, 1), ("4x prompts", 4, 1), ("2x width", 1, 2), ("4x width", 1, 4)]
    results = []
    t_all = time.perf_counter()
    for name, pmul, width in rows_spec:
        model = C.model_dir(base.model.preset or "arith-qwen2", width=width, warm_steps=0)
        load = C.machine()["load1"]
        try:
            run = C.run_ours(CONFIG, overrides(model, data, pps * pmul, steps), OUT / name.replace(" ", "_"),
                             timeout_s=1800)
        except RuntimeError as e:  # report the row and go on with the others
            err = next((ln.strip() for ln in reversed(str(e).splitlines()) if "Error" in ln), str(e)[-300:])
            print(f"  {name}: FAILED: {err}", flush=True)
            results.append(dict(name=name, pmul=pmul, width=width, params=C.param_count(model), prompts=pps * pmul,
                                step_s=float("nan"), resp=float("nan"), phases={}, load=load, steps=0, error=err))
            continue
        rows = [r for r in run["rows"] if r.get("step", 0) >= 1]
        med = C.median(C.step_times(run["rows"], skip=skip))
        phases = {k: C.median(r.get(k, 0.0) for r in rows[skip:] or rows)
                  for k in sorted({k for r in rows for k in r if k.startswith("time/")})}
        results.append(dict(name=name, pmul=pmul, width=width, params=C.param_count(model), prompts=pps * pmul,
                            step_s=med, resp=C.median(r.get("response_length_mean", 0.0) for r in rows),
                            phases=phases, load=load, steps=len(rows)))
        print(f"  {name}: median step {med:.3f} s over {len(rows)} steps", flush=True)
    t1 = results[0]["step_s"]
    table_rows = []
    for r in results:
        ratio = r["step_s"] / t1
        per = ratio / r["pmul"] if r["pmul"] > 1 else None
        table_rows.append([
            r["name"], f"{r['params']:,}", r["prompts"] * base.rollout.n, r["resp"], r["step_s"], ratio,
            "-" if per is None else f"{per:.3f}",
            ", ".join(f"{k[5:]} {v:.3f}" for k, v in r["phases"].items()) or f"FAILED: {r.get('error', '')}",
            r["load"],
        ])
    print(C.table(["row", "params", "samples/step", "mean resp tokens", "median step s", "ratio to 1x",
                   "ratio per sample", "phases (median s)", "load"], table_rows))
    print(f"total {time.perf_counter() - t_all:.0f} s; command: python bench/scaling.py {' '.join(argv or sys.argv[1:])}")
    for r in results[1:]:
        print(C.ratio_line(f"scaling_{r['name'].replace(' ', '_')}_vs_1x", r["step_s"] / t1))
    failed = [r["name"] for r in results if r.get("error")]
    if failed:
        print(f"FAILED rows: {', '.join(failed)} (see the logs under {OUT})")
    return 1 if failed else 0


def engines_rows(base: Any, data: dict[str, Path], steps: int, skip: int, argv: list[str] | None) -> int:
    """The 1x row with one engine, then two (module docstring)."""
    model = C.model_dir(base.model.preset or "arith-qwen2", width=1, warm_steps=0)
    results = {}
    for engines in (1, 2):
        name = f"{engines} engine{'s' if engines > 1 else ''}"
        run = C.run_ours(CONFIG, [*overrides(model, data, base.data.prompts_per_step, steps),
                                  f"rollout.num_engines={engines}", "rollout.num_threads=1",
                                  f"trainer.ray_num_cpus={2 + engines}"],
                         OUT / name.replace(" ", "_"), timeout_s=1800)
        rows = [r for r in run["rows"] if r.get("step", 0) >= 1]
        if not rows:
            print(f"  {name}: FAILED (no steps; see {OUT / name.replace(' ', '_')}.log)")
            return 1
        results[name] = {k: C.median(r.get(k, 0.0) for r in rows[skip:] or rows)
                         for k in ("time/generate", "time/sync")}
        results[name]["step_s"] = C.median(C.step_times(run["rows"], skip=skip))
        results[name]["load"] = C.machine()["load1"]
        print(f"  {name}: median step {results[name]['step_s']:.3f} s", flush=True)
    one = results["1 engine"]
    print(C.table(["row", "median step s", "generate s", "sync s", "ratio to 1 engine", "load"],
                  [[n, r["step_s"], r["time/generate"], r["time/sync"], r["step_s"] / one["step_s"], r["load"]]
                   for n, r in results.items()]))
    print(f"command: python bench/scaling.py {' '.join(argv or sys.argv[1:])}")
    print(C.ratio_line("scaling_2_engines_vs_1", results["2 engines"]["step_s"] / one["step_s"]))
    print(C.ratio_line("scaling_generate_2_engines_vs_1", results["2 engines"]["time/generate"] / one["time/generate"]))
    return 0


def nodes_rows(base: Any, data: dict[str, Path], steps: int, skip: int, argv: list[str] | None) -> int:
    """The 1x row on one simulated node, then on two (module docstring)."""
    from tests.helpers.local_cluster import LocalCluster, NodeSpec

    model = C.model_dir(base.model.preset or "arith-qwen2", width=1, warm_steps=0)
    specs = {"1 node": [NodeSpec("head", "127.0.0.10", 3)],
             "2 nodes": [NodeSpec("head", "127.0.0.10", 1), NodeSpec("a", "127.0.0.2", 2)]}
    results = {}
    for name, nodes in specs.items():
        with LocalCluster(nodes, f"/tmp/rlhf-bench-{os.getpid()}") as cluster:
            run = C.run_ours(CONFIG, [*overrides(model, data, base.data.prompts_per_step, steps),
                                      f"trainer.ray_address={cluster.address}"],
                             OUT / name.replace(" ", "_"), timeout_s=1800, env=cluster.client_env())
        rows = [r for r in run["rows"] if r.get("step", 0) >= 1]
        if not rows:
            print(f"  {name}: FAILED (no steps; see {OUT / name.replace(' ', '_')}.log)")
            return 1
        results[name] = {"step_s": C.median(C.step_times(run["rows"], skip=skip)),
                         "sync_s": C.median(r.get("time/sync", 0.0) for r in rows[skip:] or rows),
                         "transport": "gloo" if name == "2 nodes" else "shm", "load": C.machine()["load1"]}
        print(f"  {name}: median step {results[name]['step_s']:.3f} s, sync {results[name]['sync_s']:.3f} s", flush=True)
    one = results["1 node"]
    print(C.table(["row", "median step s", "median sync s", "ratio to 1 node", "load"],
                  [[n, r["step_s"], r["sync_s"], r["step_s"] / one["step_s"], r["load"]] for n, r in results.items()]))
    print(f"command: python bench/scaling.py {' '.join(argv or sys.argv[1:])}")
    print(C.ratio_line("scaling_2_nodes_vs_1_node", results["2 nodes"]["step_s"] / one["step_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
