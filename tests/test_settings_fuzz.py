"""A settings fuzzer over real Gloo ranks: drawn per-rank configurations (compressor, density,
threshold, exchange, Auto's parameters, schedule, optimizer stage and its parameters, dtype,
world size 2-4). Each must either train with bitwise-equal replicas (ranks configured alike) or
raise SettingsMismatchError on every rank at step 0 (ranks configured differently): never a
hang, a signal, another error or a divergence.

Cost: 240 configurations in three sets of long-lived rank processes (one per world size), each
configuration a fresh small DDP model trained 4 steps; about 2-3 minutes on 2 shared cores.
"""
import copy
import random

import pytest

import settings_fuzz_workers as workers
from multiprocess import spawn

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

COUNTS = {2: 110, 3: 70, 4: 60}  # configurations per world size (>= 200 in all)
DEADLINE_S = 150  # per world size; the ranks stop together past it (the test then fails)


def draw_base(rng):
    """One valid configuration (every rank's, before a perturbation)."""
    kind = rng.choice(["topk", "twobit", "fp16"])
    spec = {"topk": f"topk:{rng.choice([0.01, 0.05, 0.2])}", "twobit": f"twobit:{rng.choice([0.5, 0.25, 'rms'])}",
            "fp16": "fp16"}[kind]
    config = {"spec": spec, "exchange": "allgather", "warmup": rng.choice([0, 1, 2]), "ramp": None,
              "min_numel": rng.choice([0, 64]), "dtype": "float32", "policy": None, "transform": None}
    flavour = rng.choice(["plain", "plain", "two_phase", "policy", "adamw", "adamw", "half"])
    if kind == "topk" and rng.random() < 0.3:
        config["ramp"] = rng.choice([1, 2])
    if flavour == "two_phase" and kind != "fp16":
        config["exchange"] = "two_phase"
    elif flavour == "policy":
        config["warmup"] = max(1, config["warmup"])  # Auto measures the link during dense steps
        config["policy"] = {"dense_margin": rng.choice([0.05, 0.2]), "recheck_every": rng.choice([0, 2, 100]),
                            "link_margin": rng.choice([0.5, 1.0]),
                            "candidates": tuple(rng.sample(["fp16", "twobit:0.5", "topk:0.01"], 2))}
    elif flavour == "adamw" and kind != "fp16":
        config["transform"] = ("adamw", {"freeze_step": rng.choice([1, 2]),
                                         "exchange": rng.choice(["momentum", "gradient"]),
                                         "lr": rng.choice([1e-3, 2e-3])})
    elif flavour == "half":
        config["dtype"] = rng.choice(["float16", "bfloat16"])
    return config


def perturb(rng, config):
    """A copy of ``config`` with one setting changed (still a valid configuration on its own)."""
    changed = copy.deepcopy(config)
    options = ["spec", "warmup", "min_numel"]
    if changed["policy"] is not None:
        options += ["policy"] * 3
    if changed["transform"] is not None:
        options += ["transform"] * 3
    if changed["policy"] is None and changed["transform"] is None:
        # Not the dtype: DDP itself broadcasts the parameters at construction, before gradcomp runs.
        options += ["exchange"]
    field = rng.choice(options)
    if field == "spec":
        changed["spec"] = next(s for s in rng.sample(["topk:0.02", "twobit:0.75", "topk:0.3", "twobit:rms"], 4)
                               if s != config["spec"])
        if changed["ramp"] is not None and not changed["spec"].startswith("topk"):
            changed["ramp"] = None
    elif field == "warmup":
        changed["warmup"] = config["warmup"] + 1
    elif field == "min_numel":
        changed["min_numel"] = 64 if config["min_numel"] == 0 else 0
    elif field == "exchange":
        changed["exchange"] = "allgather" if config["exchange"] == "two_phase" else "two_phase"
        if changed["spec"] == "fp16":
            changed["spec"] = "topk:0.05"  # so that the exchange matters
    elif field == "policy":
        key = rng.choice(["dense_margin", "recheck_every", "link_margin"])
        changed["policy"][key] = {"dense_margin": 0.5, "recheck_every": 7, "link_margin": 3.0}[key]
    else:
        name, arguments = changed["transform"]
        key = rng.choice(sorted(arguments))
        arguments[key] = {"freeze_step": 3, "lr": 5e-3}.get(key)
        if key == "exchange":
            arguments["exchange"] = "gradient" if config["transform"][1]["exchange"] == "momentum" else "momentum"
    return changed


def draw(world_size, count, seed):
    """``count`` configurations: each a list of per-rank configs, about half of them differing."""
    rng = random.Random(seed)
    drawn = []
    for _ in range(count):
        base = draw_base(rng)
        per_rank = [base] * world_size
        if rng.random() < 0.5:
            odd = perturb(rng, base)
            ranks = rng.sample(range(world_size), rng.randint(1, world_size - 1))
            per_rank = [odd if r in ranks else base for r in range(world_size)]
        drawn.append(per_rank)
    return drawn


@pytest.mark.parametrize("world_size", sorted(COUNTS))
def test_drawn_settings_run_alike_or_fail_alike_at_step_0(tmp_path, world_size):
    configs = draw(world_size, COUNTS[world_size], seed=world_size)
    results, codes = spawn(workers.fuzz_worker, world_size, str(tmp_path), configs, DEADLINE_S,
                                       timeout_s=DEADLINE_S + 120, pg_timeout_s=30, check=False)
    assert codes == [0] * world_size, f"ranks exited with {codes} (a signal, a crash or a hang)"
    assert "stopped" not in results[0], f"the deadline passed after {len(results[0]) - 1} configurations"
    assert len(results[0]) == len(configs)
    for index, per_rank in enumerate(configs):
        outcome = results[0][index]
        alike = all(c == per_rank[0] for c in per_rank)
        errors = [results[r][index]["error"] for r in range(world_size)]
        what = f"configuration {index}: {per_rank if not alike else per_rank[0]}; errors {errors}"
        if alike:
            assert all(o == (workers.OK, workers.STEPS) for o in outcome["outcomes"]), what
            assert outcome["equal"], f"replicas diverged in {what}"
        else:
            assert all(o == (workers.MISMATCH, 0) for o in outcome["outcomes"]), what
