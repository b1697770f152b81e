"""Checkpoints load transactionally (validate everything, then assign), and bad settings fail at
``register()`` before any training step. In-process: one Gloo rank where DDP needs a group."""
import datetime
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from ddp_workers import make_model
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.schedule import DenseWarmup
from multiprocess import free_port


def make_state(compressor=None, **kwargs):
    """A state with residuals for every parameter and step 5, as after 5 steps of training."""
    model = make_model("mlp")
    state = gc_ddp.CompressionState(compressor or gradcomp.TopK(0.1), named_parameters=model.named_parameters(),
                                    **kwargs)  # fmt: skip
    names = [name for name, _ in model.named_parameters()]
    numels = [p.numel() for _, p in model.named_parameters()]
    _, residual_out = state.residual_memory.buffers(names, numels, "cpu")
    residual_out.copy_(torch.linspace(-1, 1, residual_out.numel()))
    state.residual_memory.commit(names)
    state.step = 5
    return state


def snapshot(state):
    """The state dict, deep-copied (tensors cloned)."""
    saved = state.state_dict()
    return {**saved, "residuals": {k: v.clone() for k, v in saved["residuals"].items()}}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key == "residuals":
            assert a[key].keys() == b[key].keys()
            assert all(torch.equal(a[key][name], b[key][name]) for name in a[key])
        else:
            assert a[key] == b[key], key


def test_state_dict_records_format_compressor_world_size_rank_and_schedule():
    saved = make_state().state_dict()
    assert saved["format"] == 1 and saved["step"] == 5 and saved["world_size"] == 1 and saved["rank"] == 0
    assert saved["compressor"] == gradcomp.TopK(0.1).spec
    assert saved["schedule"] == DenseWarmup(2).state_dict()
    assert saved["transform"] is None
    assert all(v.dtype == torch.float32 and v.dim() == 1 for v in saved["residuals"].values())


def _corrupt(saved, how):
    bad = {**saved, "residuals": dict(saved["residuals"])}
    first = next(iter(bad["residuals"]))
    if how == "numel":
        bad["residuals"][first] = torch.zeros(bad["residuals"][first].numel() + 1)
    elif how == "one_element":
        bad["residuals"][first] = torch.ones(1)
    elif how == "nan":
        bad["residuals"][first] = torch.full_like(bad["residuals"][first], float("nan"))
    elif how == "2d":
        bad["residuals"][first] = bad["residuals"][first].view(1, -1)
    elif how == "int":
        bad["residuals"][first] = bad["residuals"][first].long()
    elif how == "unknown_name":
        bad["residuals"]["other_model.weight"] = torch.zeros(3)
    elif how == "step":
        bad["step"] = -1
    elif how == "step_type":
        bad["step"] = "7"
    elif how == "world_size_type":
        bad["world_size"] = 1.5
    elif how == "schedule":
        bad["schedule"] = DenseWarmup(7).state_dict()
    elif how == "missing":
        del bad["residuals"]
    elif how == "format":
        bad["format"] = 99
    elif how == "format_0":  # the keys of a checkpoint before formats were recorded
        bad = {k: v for k, v in bad.items() if k in ("step", "world_size", "residuals")}
    elif how in ("no_compressor", "no_schedule", "no_rank"):
        del bad[how[3:]]
    elif how == "unknown_key":
        bad["optimizer"] = {}
    elif how == "huge_step":
        bad["step"] = 2**70
    elif how == "rank_out_of_range":
        bad["rank"] = 1
    elif how == "float64_overflow":  # finite in float64, infinite in the float32 residuals are kept in
        bad["residuals"][first] = torch.full_like(bad["residuals"][first], 1e300, dtype=torch.float64)
    return bad


@pytest.mark.parametrize("how", ["numel", "one_element", "nan", "2d", "int", "unknown_name", "step", "step_type",
                                 "world_size_type", "schedule", "missing", "format", "format_0", "no_compressor",
                                 "no_schedule", "no_rank", "unknown_key", "huge_step", "rank_out_of_range",
                                 "float64_overflow"])  # fmt: skip
def test_a_rejected_load_raises_and_changes_nothing(how):
    source, target = make_state(), make_state()
    target.residual_memory.residual("0.weight").mul_(3)  # live state differs from the checkpoint
    target.step = 9
    before = snapshot(target)
    with pytest.raises(ValueError):
        target.load_state_dict(_corrupt(source.state_dict(), how))
    assert_same_state(snapshot(target), before)


def test_unknown_residuals_may_be_dropped_with_a_warning_when_asked():
    source, target = make_state(), make_state()
    bad = _corrupt(source.state_dict(), "unknown_name")
    with pytest.warns(UserWarning, match="other_model.weight"):
        target.load_state_dict(bad, unknown_residuals="warn")
    assert_same_state(snapshot(target), snapshot(source))


def test_another_compressor_or_rank_loads_with_a_warning_and_zero_residuals():
    saved = make_state(gradcomp.TwoBit(0.5)).state_dict()
    target = make_state(gradcomp.TopK(0.1))
    with pytest.warns(UserWarning, match="twobit.*reset"):
        target.load_state_dict(saved)
    assert target.step == 5 and target.residual_memory.keys() == []
    other_rank = {**make_state().state_dict(), "world_size": 2, "rank": 1}
    with pytest.warns(UserWarning, match="rank 1 of world size 2.*reset"):
        target.load_state_dict(other_rank)
    assert target.residual_memory.keys() == []


def test_a_good_checkpoint_round_trips():
    source, target = make_state(), make_state()
    target.residual_memory.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(source.state_dict())
    assert_same_state(snapshot(target), snapshot(source))
    source.step = 2**62  # the largest step a checkpoint may hold
    target.load_state_dict(source.state_dict())
    assert target.step == 2**62


# -- fail at register(), before any step ---------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_register_rejects_a_bad_backend_name_from_the_argument_or_the_environment(one_rank_group, monkeypatch):
    ddp = DDP(make_model("mlp"))
    with pytest.raises(ValueError, match="backend"):
        gc_ddp.register(ddp, gradcomp.TopK(0.1), backend="opencl")
    monkeypatch.setenv("GRADCOMP_BACKEND", "opencl")
    with pytest.raises(ValueError, match="GRADCOMP_BACKEND"):
        gc_ddp.register(DDP(make_model("mlp")), gradcomp.TopK(0.1))
    monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")  # cannot run on CPU tensors
    with pytest.raises(RuntimeError, match="cuda"):
        gc_ddp.register(DDP(make_model("mlp")), gradcomp.TwoBit(0.5))


def test_register_rejects_gradient_dtypes_the_compressor_cannot_take(one_rank_group):
    with pytest.raises(TypeError, match="float64"):
        gc_ddp.register(DDP(make_model("mlp").double()), gradcomp.TopK(0.1))
    gc_ddp.register(DDP(make_model("mlp").double()), gradcomp.Identity())  # a plain allreduce takes any dtype


def test_attaching_names_rejects_residuals_of_unknown_parameters():
    state = gc_ddp.CompressionState(gradcomp.TopK(0.1))
    state.load_state_dict({**state.state_dict(), "residuals": {"ghost.weight": torch.zeros(3)}})
    with pytest.raises(ValueError, match="ghost.weight"):
        state.attach(make_model("mlp").named_parameters())
