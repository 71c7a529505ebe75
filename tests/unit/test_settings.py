"""The typed settings behind the strategies' keyword arguments (lightning_mgpu/settings.py)."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest
from torch import nn

import lightning_mgpu
import lightning_mgpu.lightning
from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.settings import (
    LIGHTNING_KEYWORDS,
    DDPSettings,
    ShardedSettings,
    check_keywords,
    split_ddp_kwargs,
)


def test_a_single_wrap_modules_class_is_taken_as_a_one_element_list():
    assert ShardedSettings(wrap_modules=nn.Linear).wrap_modules == (nn.Linear,)  # type: ignore[arg-type]
    strategy = MGPUShardedStrategy(stage=3, wrap_modules=nn.Linear)  # type: ignore[arg-type]
    assert strategy.settings.wrap_modules == (nn.Linear,)


def test_ddp_keywords_of_torch_are_accepted_and_reach_distributed_data_parallel():
    strategy = MGPUDDPStrategy(bucket_cap_mb=10, broadcast_buffers=False)
    assert strategy.settings.all_ddp_kwargs == {
        "find_unused_parameters": False,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 10,
        "broadcast_buffers": False,
    }


def test_ddp_keywords_at_their_default_count_as_not_given():
    """LightningCLI passes every DistributedDataParallel argument it finds, at its default value."""
    assert split_ddp_kwargs({"dim": 0, "broadcast_buffers": None, "check_reduction": False}) == {}


def test_an_unknown_keyword_names_the_closest_valid_one():
    with pytest.raises(TypeError, match=r"'statc_graph' \(did you mean 'static_graph'\?\)"):
        check_keywords("MGPUDDPStrategy", ["statc_graph"], DDPSettings.keywords())


def test_settings_are_frozen_and_keep_the_values_given():
    settings = DDPSettings(comm_hook="fp16", timeout=timedelta(seconds=5))
    assert (settings.comm_hook, settings.timeout) == ("fp16", timedelta(seconds=5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.comm_hook = None  # type: ignore[misc]


def test_a_none_timeout_leaves_torch_its_default():
    assert DDPSettings(timeout=None).timeout is None


def test_the_periodic_strategies_refuse_the_ddp_options_they_have_no_use_for_in_their_settings():
    from lightning_mgpu.settings import LocalSGDSettings

    with pytest.raises(TypeError, match=r"S does not take comm_hook='fp16': it never all-reduces gradients"):
        LocalSGDSettings.ddp_kwargs("S", {"comm_hook": "fp16"})
    with pytest.raises(TypeError, match=r"S does not take micro_batch_size=4: micro-batching averages"):
        LocalSGDSettings.ddp_kwargs("S", {"micro_batch_size": 4})
    # the options at their "not given" values are dropped; DDP's buffer broadcast is replaced by the sync
    kept = LocalSGDSettings.ddp_kwargs("S", {"comm_hook": None, "static_graph": False, "bucket_cap_mb": 5})
    assert kept.pop("bucket_cap_mb") == 5
    assert kept == {next(iter(kept)): False} and next(iter(kept)) in ("broadcast_buffers", "forward_sync_buffers")
    # a buffer flag the user set is kept as given
    assert LocalSGDSettings.ddp_kwargs("S", {"broadcast_buffers": True}) == {"broadcast_buffers": True}


def test_a_buffer_flag_the_user_wrote_is_kept_where_it_equals_ddps_default(monkeypatch):
    """Before torch 2.13 DDP's ``broadcast_buffers`` defaulted to True: an explicit True for local SGD / DiLoCo
    was taken for "not given" and turned to False. Only None means "not given" now (DDP's signature of torch 2.11
    simulated; the negative control shows the simulation makes True DDP's default)."""
    from lightning_mgpu import settings
    from lightning_mgpu.settings import LocalSGDSettings, is_default_ddp_kwarg

    def ddp_of_torch_2_11(self, module, device_ids=None, dim=0, broadcast_buffers=True, bucket_cap_mb=None):
        pass

    monkeypatch.setattr(settings, "_DDP_PARAMETERS", inspect.signature(ddp_of_torch_2_11).parameters)
    assert is_default_ddp_kwarg("broadcast_buffers", True)  # negative control: True is the default here
    for value in (True, False):
        assert LocalSGDSettings.ddp_kwargs("S", {"broadcast_buffers": value}) == {"broadcast_buffers": value}


def test_the_auto_strategy_settings_are_checked_in_one_place():
    from lightning_mgpu import MGPUAutoStrategy
    from lightning_mgpu.planning import STRATEGIES, PlanError
    from lightning_mgpu.settings import AutoSettings

    assert AutoSettings().strategies == STRATEGIES
    assert AutoSettings(strategies=("mgpu_zero3", "mgpu_ddp"), micro_batch_size=4).strategies == ("mgpu_ddp",)
    with pytest.raises(ValueError, match=r"\['deepspeed'\]; choose from"):
        AutoSettings(strategies=("mgpu_ddp", "deepspeed"))
    with pytest.raises(ValueError, match="none given"):
        AutoSettings(strategies=())
    with pytest.raises(ValueError, match=r"headroom=1.5 must be a fraction in \[0, 1\)"):
        AutoSettings(headroom=1.5)
    with pytest.raises(PlanError, match="device_memory"):  # the planner's parser, in the strategy (not in settings)
        MGPUAutoStrategy(device_memory="eighty gigs")
    with pytest.raises(ValueError, match="micro_batch_size=4 works with mgpu_ddp and mgpu_zero1 only"):
        AutoSettings(strategies=("mgpu_zero3",), micro_batch_size=4)
    # the strategy builds them from its keywords, so the same errors come from Trainer(strategy=MGPUAutoStrategy(...))
    with pytest.raises(ValueError, match=r"headroom=-0.1"):
        MGPUAutoStrategy(headroom=-0.1)


def test_the_hybrid_mesh_shards_within_a_machine_by_default_and_replicates_across():
    hybrid = ShardedSettings(stage=3, mesh="hybrid")
    assert hybrid.mesh_shape(world_size=4, num_nodes=2) == (2, 2)
    assert hybrid.mesh_shape(world_size=16, num_nodes=2) == (2, 8)
    assert hybrid.mesh_shape(world_size=4, num_nodes=1) == (1, 4)  # one machine: one replica
    assert ShardedSettings(stage=2, mesh="hybrid", shard_size=1).mesh_shape(4, 2) == (4, 1)
    assert ShardedSettings(stage=3, mesh="hybrid", shard_size=4).mesh_shape(8, 2) == (2, 4)
    assert ShardedSettings(stage=3).mesh_shape(world_size=4, num_nodes=2) == (1, 4)  # flat


def test_a_hybrid_mesh_that_cannot_be_built_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"5 ranks do not split evenly over num_nodes=2.*shard_size=N"):
        ShardedSettings(stage=3, mesh="hybrid").mesh_shape(world_size=5, num_nodes=2)
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world size 4"):
        ShardedSettings(stage=3, mesh="hybrid", shard_size=3).mesh_shape(world_size=4, num_nodes=2)


def test_lightning_cli_parses_compile_options():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MGPUShardedStrategy, "strategy")
    cfg = parser.parse_args(["--strategy.stage=3", '--strategy.compile={"backend": "aot_eager"}'])
    assert cfg.strategy.compile == {"backend": "aot_eager"}
    assert parser.parse_args(["--strategy.compile=true"]).strategy.compile is True


@pytest.mark.compat
@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_buffer_flag_reaches_ddp_as_given_on_the_installed_torch(value):
    """What ``MGPULocalSGDStrategy`` and ``MGPUDiLoCoStrategy`` hand the installed torch's DDP for
    ``broadcast_buffers=value``, a keyword left out read as DDP's own default, is ``value`` (torch 2.11's DDP defaults
    it to True, 2.13's to None: a True dropped there would reach DDP as None). Left out, it is False: the periodic
    sync averages the buffers instead."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mgpu import MGPUDiLoCoStrategy, MGPULocalSGDStrategy
    from lightning_mgpu._compat import strategy_ddp_kwargs

    default = inspect.signature(DistributedDataParallel.__init__).parameters["broadcast_buffers"].default
    for cls in (MGPULocalSGDStrategy, MGPUDiLoCoStrategy):
        assert strategy_ddp_kwargs(cls(broadcast_buffers=value)).get("broadcast_buffers", default) is value
        left_out = strategy_ddp_kwargs(cls())
        assert False in (left_out.get("broadcast_buffers"), left_out.get("forward_sync_buffers"))


# --- a misspelt option: one check (settings.strategy_options) for every strategy class, in both namespaces --------

NAMESPACES = {"pytorch_lightning": lightning_mgpu, "lightning": lightning_mgpu.lightning}
STRATEGIES = [
    "MGPUDDPStrategy",
    "MGPUShardedStrategy",
    "MGPULocalSGDStrategy",
    "MGPUDiLoCoStrategy",
    "MGPUAutoStrategy",
]


@pytest.mark.parametrize("namespace", list(NAMESPACES))
@pytest.mark.parametrize(
    ("name", "typo", "closest"),
    [
        ("MGPUShardedStrategy", "pipline_parallel_size", "pipeline_parallel_size"),
        ("MGPUDDPStrategy", "comm_hok", "comm_hook"),
        ("MGPUAutoStrategy", "devise_memory", "device_memory"),  # Python's bare "unexpected keyword" before
        ("MGPULocalSGDStrategy", "sync_evry", "sync_every"),
        ("MGPUDiLoCoStrategy", "outer_lrr", "outer_lr"),  # named another class's options before
    ],
)
def test_a_misspelt_option_names_the_closest_and_the_strategys_options(namespace, name, typo, closest):
    strategy_class = getattr(NAMESPACES[namespace], name)
    with pytest.raises(TypeError) as info:
        strategy_class(**{typo: 2})
    message = str(info.value)
    assert message.startswith(f"{name} got unknown keyword argument {typo!r} (did you mean {closest!r}")
    own = [k for k in inspect.signature(strategy_class.__init__).parameters if k not in ("self", "ddp_kwargs")]
    listed = message.split("Its options: ", 1)[1]
    assert all(k in listed for k in own if k not in LIGHTNING_KEYWORDS)


@pytest.mark.parametrize("namespace", list(NAMESPACES))
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_option_of_every_strategy_is_named_for_its_misspelling(namespace, name):
    strategy_class = getattr(NAMESPACES[namespace], name)
    options = [k for k in inspect.signature(strategy_class.__init__).parameters if k not in ("self", "ddp_kwargs")]
    assert len(options) > 10
    for option in options:
        typo = f"{option}_x"
        with pytest.raises(TypeError, match=rf"unknown keyword argument '{typo}' \(did you mean [^)]*'{option}'"):
            strategy_class(**{typo: 1})


def test_an_unknown_keyword_far_from_every_option_names_none():
    """Negative control: no "did you mean" for a name close to nothing (the nearest would mislead)."""
    with pytest.raises(TypeError) as info:
        MGPUDDPStrategy(completely_unrelated=1)
    assert "did you mean" not in str(info.value) and "Its options: " in str(info.value)
