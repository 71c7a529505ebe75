"""The typed settings behind the strategies' keyword arguments (lightning_mgpu/settings.py)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
from torch import nn

from lightning_mgpu import MGPUDDPStrategy, MGPUShardedStrategy
from lightning_mgpu.settings import DDPSettings, ShardedSettings, check_keywords, split_ddp_kwargs


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
    assert split_ddp_kwargs("S", {"dim": 0, "broadcast_buffers": None, "check_reduction": False}, []) == {}


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


@pytest.mark.parametrize(
    "name", ["MGPUDDPStrategy", "MGPUShardedStrategy", "MGPULocalSGDStrategy", "MGPUDiLoCoStrategy", "MGPUAutoStrategy"]
)
def test_compile_is_a_keyword_of_every_strategy_and_reaches_its_settings(name):
    """``compile`` in each public strategy's signature (LightningCLI reads it there) and in its launch settings,
    a dict of torch.compile options as given."""
    import inspect

    import lightning_mgpu

    cls = getattr(lightning_mgpu, name)
    assert inspect.signature(cls.__init__).parameters["compile"].default is False
    strategy = cls(compile={"mode": "max-autotune"})
    assert strategy.launch_settings.compile == {"mode": "max-autotune"}
    assert cls().launch_settings.compile is False


def test_lightning_cli_parses_compile_options():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(MGPUShardedStrategy, "strategy")
    cfg = parser.parse_args(["--strategy.stage=3", '--strategy.compile={"backend": "aot_eager"}'])
    assert cfg.strategy.compile == {"backend": "aot_eager"}
    assert parser.parse_args(["--strategy.compile=true"]).strategy.compile is True
