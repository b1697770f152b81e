"""The exchange interface and its registry: today's exchanges as members, the chain an engine tries,
and a new exchange added as one file (``exchange_plugin.py``) that the engine, the telemetry, the
settings check, the checkpoints and the cost model take up with no other change."""
import ast
import importlib
import pathlib
import sys

import pytest
import torch

import gradcomp
from gradcomp import costmodel, exchanges
from gradcomp.engine import Engine, Transport
from gradcomp.exchanges import registry
from gradcomp.settings import TRANSFORM_METHODS
from gradcomp.telemetry import Telemetry

REPO = pathlib.Path(__file__).resolve().parents[1]


class OneRank(Transport):
    """The collectives of a world of one rank: the average of one tensor is itself."""

    world_size, rank = 1, 0

    def __init__(self, can_allreduce=True):
        self._can_allreduce = can_allreduce

    def allreduce_average(self, tensor, name):
        return tensor

    def allreduce_sum(self, tensor, name):
        return tensor

    def allgather(self, buffer, name):
        return buffer.clone()

    def can_allreduce(self, dtype, device):
        return self._can_allreduce


@pytest.fixture
def plugin():
    """The exchange of ``exchange_plugin.py``, registered by importing that file, forgotten afterwards."""
    module = importlib.import_module("exchange_plugin")
    yield module.CountedGather
    registry._forget("counted_gather")
    sys.modules.pop("exchange_plugin", None)


def run(engine, grad, keys=("w",), group=0):
    handle = engine.start(grad, keys, [grad.numel()], group)
    average = engine.finish(handle, handle.work)
    engine.end_step()
    return average


# -- the registry ------------------------------------------------------------------------------
def test_todays_exchanges_are_members():
    assert {"dense", "allreduce", "allgather", "two_phase"} <= set(exchanges.names())
    assert exchanges.names(selectable=True) == ("allgather", "two_phase")
    assert exchanges.DEFAULT in exchanges.names(selectable=True, runnable=True)
    assert set(exchanges.names(automatic=True)) == {"dense", "allreduce"}
    for name in exchanges.names():
        assert exchanges.get(name).name == name


def test_an_engine_tries_the_automatic_exchanges_then_its_own_then_the_default():
    automatic = list(exchanges.names(automatic=True))
    assert [e.name for e in Engine(gradcomp.TopK(0.1)).exchanges] == automatic + ["allgather"]
    assert [e.name for e in Engine(gradcomp.TopK(0.1), exchange="two_phase").exchanges] == automatic + [
        "two_phase", "allgather"]


class Scattering(OneRank):
    """A transport that scatters (FSDP's reduce-scatter), of one rank."""

    scatters = True


def test_a_transport_that_scatters_gets_the_scattering_exchanges_only():
    assert exchanges.names(scatters=True) == ("dense_reduce_scatter", "reduce_scatter")
    engine = Engine(gradcomp.TopK(0.1), Scattering(), exchange="reduce_scatter")
    assert [e.name for e in engine.exchanges] == ["dense_reduce_scatter", "reduce_scatter"]
    assert engine.exchange_for(None, 4096, torch.float32, "cpu").name == "dense_reduce_scatter"
    assert engine.exchange_for(gradcomp.Identity(), 4096, torch.float32, "cpu").name == "dense_reduce_scatter"
    assert engine.exchange_for(gradcomp.TopK(0.1), 4096, torch.float32, "cpu").name == "reduce_scatter"
    with pytest.raises(ValueError, match=r"one of \('reduce_scatter',\) under a transport that scatters"):
        Engine(gradcomp.TopK(0.1), Scattering())  # the default, allgather, cannot give each rank its chunk
    stage = type("Stage", (), {name: lambda *a: None for name in TRANSFORM_METHODS})()
    with pytest.raises(ValueError, match="exchange='reduce_scatter' takes no optimizer-aware transform"):
        Engine(gradcomp.TopK(0.1), Scattering(), exchange="reduce_scatter", transform=stage)


@pytest.mark.parametrize("name", ["ring", "dense", "hierarchical", "sparse", "reduce_scatter", "dense_reduce_scatter",
                                  None])
def test_only_a_selectable_exchange_can_be_chosen(name):
    with pytest.raises(ValueError, match=r"exchange must be one of \('allgather', 'two_phase'\)"):
        Engine(gradcomp.TopK(0.1), exchange=name)


def test_exchange_name_checks_what_it_registers():
    with pytest.raises(ValueError, match="lower-case"):
        exchanges.exchange_name("Two Phase")
    with pytest.raises(TypeError, match="Exchange subclasses"):
        exchanges.exchange_name("plain")(object)
    allgather = exchanges.get("allgather")
    assert exchanges.exchange_name("allgather")(allgather) is allgather  # the same class again: a no-op

    class Another(allgather):
        pass

    with pytest.raises(ValueError, match="already registered"):
        exchanges.exchange_name("allgather")(Another)
    with pytest.raises(ValueError, match="unknown exchange 'ring'"):
        exchanges.get("ring")
    with pytest.raises(ValueError, match="unknown exchange"):
        costmodel.predict("ring", gradcomp.TopK(0.1), 100, costmodel.Cluster(2, costmodel.Link(0, 1e9)))


COMPRESSORS = [None, gradcomp.Identity(), gradcomp.FP16(), gradcomp.BF16(), gradcomp.TopK(0.1), gradcomp.TwoBit(0.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("can_allreduce", [True, False])
def test_exactly_one_automatic_exchange_or_none_applies(dtype, can_allreduce):
    engine = Engine(gradcomp.TopK(0.1), OneRank(can_allreduce), min_numel=0)
    automatic = [e for e in engine.exchanges if e.automatic]
    for compressor in COMPRESSORS:
        taking = [e.name for e in automatic if e.applies(compressor, 4096, dtype, "cpu", engine.transport)]
        assert len(taking) <= 1, (compressor, taking)
        chosen = engine.exchange_for(compressor, 4096, dtype, "cpu")
        assert chosen.name == (taking[0] if taking else exchanges.DEFAULT)
    assert engine.exchange_for(None, 4096, dtype, "cpu").sends_gradient
    assert engine.exchange_for(gradcomp.TopK(0.1), 4096, torch.float64, "cpu").sends_gradient  # not compressed


def test_who_averages_decides_what_a_sum_reduction_multiplies_back():
    """The Horovod drop-in multiplies by P for op=Sum where the exchange averaged on its own."""
    averaged = {name for name in exchanges.names(runnable=True) if exchanges.get(name).averages_itself}
    assert averaged == {"allgather", "two_phase", "reduce_scatter", "allreduce"}


def test_telemetry_takes_the_registered_names_only():
    telemetry = Telemetry()
    for name in exchanges.names():
        telemetry.record(name, 1, 1, 0.0, name)
    with pytest.raises(ValueError, match="unknown mode 'ring'"):
        telemetry.record("g", 1, 1, 0.0, "ring")


# -- a new exchange is one new file ----------------------------------------------------------
def test_a_new_exchange_file_runs_in_the_engine_and_is_counted_saved_and_checked(plugin):
    assert exchanges.names(selectable=True) == ("allgather", "two_phase", "counted_gather")
    grad = torch.tensor([4.0, -1.0, 0.5, 2.0])
    mine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=0, min_numel=0, exchange="counted_gather")
    reference = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=0, min_numel=0, granularity="bucket")
    assert torch.equal(run(mine, grad.clone()), run(reference, grad.clone()))
    assert torch.equal(mine.residual_memory.residual("w"), reference.residual_memory.residual("w"))
    assert mine.stats()["last_step"]["groups"][0]["mode"] == "counted_gather"
    assert mine.settings_fingerprint([((4,), torch.float32)])["exchange"] == (
        "counted_gather", (("counted_gather", {"counts": "committed groups"}),))
    saved = mine.state_dict()
    assert saved["counted_gather"] == {"committed": 1}

    resumed = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=0, exchange="counted_gather")
    resumed.load_state_dict(saved)
    assert resumed.exchanges[-2].committed == 1
    with pytest.raises(ValueError, match="counted_gather"):
        resumed.load_state_dict(dict(saved, counted_gather={"committed": "one"}))
    assert resumed.exchanges[-2].committed == 1  # a rejected load changes nothing
    with pytest.warns(UserWarning, match="group counts of the counted gather exchange"):
        reference.load_state_dict(saved)

    cluster = costmodel.Cluster(4, costmodel.Link(1e-5, 1e9))
    assert costmodel.predict("counted_gather", gradcomp.TopK(0.01), 10_000, cluster).handed_bytes == (
        costmodel.predict("allgather", gradcomp.TopK(0.01), 10_000, cluster).handed_bytes)


def test_a_forgotten_exchange_leaves_the_registry_as_it_was(plugin):
    registry._forget("counted_gather")
    assert "counted_gather" not in exchanges.names()
    with pytest.raises(ValueError, match="unknown"):
        exchanges.get("counted_gather")


# -- the names of the exchanges live in gradcomp/exchanges/ only -----------------------------
#: String literals equal to an exchange's name that are something else: the transform slot's method.
NOT_AN_EXCHANGE = {("gradcomp/settings.py", "dense")}


def test_no_product_module_outside_the_exchanges_names_one():
    names = set(exchanges.names())
    found = []
    for path in sorted([*REPO.glob("gradcomp/**/*.py"), *REPO.glob("hooks/**/*.py")]):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("gradcomp/exchanges/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names and (relative, node.value) not in NOT_AN_EXCHANGE:
                found.append(f"{relative}:{node.lineno} {node.value!r}")
    assert not found, found
