"""plugins/precision.py: the strategy adopts Lightning's plugin and hands it what it needs through arguments."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_mgpu import MGPUPrecision
from lightning_mgpu.plugins.precision import PrecisionAdoption
from tests.host_syncs import HostSyncs


def test_lightnings_default_and_mixed_plugins_become_mgpu_precision():
    assert isinstance(PrecisionAdoption.adopt(Precision()), MGPUPrecision)
    adopted = PrecisionAdoption.adopt(MixedPrecision("bf16-mixed", device="cpu"))
    assert isinstance(adopted, MGPUPrecision) and adopted.mode == "bf16-mixed"


def test_another_plugin_is_kept():
    class Custom(Precision):
        pass

    plugin = Custom()
    assert PrecisionAdoption.adopt(plugin) is plugin


def test_the_gradient_sync_is_handed_to_the_plugin_and_called_before_clipping():
    plugin = MGPUPrecision("32-true")
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    synced: list[torch.optim.Optimizer] = []
    PrecisionAdoption.connect_gradient_sync(plugin, synced.append)
    plugin.clip_gradients(opt, clip_val=1.0)
    assert synced == [opt]
    PrecisionAdoption.connect_gradient_sync(plugin, None)
    plugin.clip_gradients(opt, clip_val=1.0)
    assert synced == [opt]


def test_a_plain_plugin_saves_the_state_it_is_given():
    state = {"weight": torch.ones(1)}
    assert PrecisionAdoption.with_masters(Precision(), nn.Linear(1, 1), state) is state


def test_the_loss_scale_is_the_scalers_and_one_without_a_scaler():
    """What the pipeline's backward starts from: the fp16 scaler's current scale (Lightning's own plugin's too)."""
    plugin = MGPUPrecision("16-mixed", init_scale=2.0**10)
    plugin.connect(nn.Linear(2, 1), [], [])
    assert PrecisionAdoption.loss_scale(plugin) == 2.0**10
    state = plugin.state_dict()
    state["scaler"]["scale"] = 2.0**4  # a resumed scale
    plugin.load_state_dict(state)
    assert PrecisionAdoption.loss_scale(plugin) == 2.0**4 == plugin.scaler.get_scale()  # type: ignore[union-attr]
    assert PrecisionAdoption.loss_scale(MGPUPrecision("bf16-mixed")) == 1.0
    assert PrecisionAdoption.loss_scale(Precision()) == 1.0
    lightning = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    assert PrecisionAdoption.loss_scale(lightning) == 8.0


def test_reading_the_loss_scale_does_not_wait_for_the_device():
    """The pipeline reads the scale every step: the plugin's kept value, not ``GradScaler.get_scale`` (an
    ``item`` on a GPU); Lightning's own plugin has only its scaler to ask (the counter's negative control)."""
    plugin = MGPUPrecision("16-mixed", init_scale=2.0**10)
    plugin.connect(nn.Linear(2, 1), [], [])
    lightning = MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    lightning.scaler.scale(torch.ones(()))  # type: ignore[union-attr]  # the scaler's scale tensor exists
    with HostSyncs() as syncs:
        for read in (plugin, lightning):
            syncs.open()
            PrecisionAdoption.loss_scale(read)
        syncs.close()
    assert syncs.counts() == [0, 1], syncs.per_step
    (site,) = syncs.per_step[1]
    assert site.startswith("get_scale @ lightning_mgpu/plugins/precision.py:"), site


def test_the_plugin_computes_on_the_meshs_device_when_the_shards_are_stored_on_the_host():
    """``MGPUPrecision("bf16-mixed")`` without a device takes the model's: under ``offload="cpu"`` FSDP2's shards are
    stored on the host and compute on their mesh's device, which autocast must target (not the host's)."""

    class Offloaded(torch.nn.Module):
        def parameters(self, recurse: bool = True) -> Any:
            yield SimpleNamespace(device=torch.device("cpu"), device_mesh=SimpleNamespace(device_type="cuda"))

    plugin = MGPUPrecision("bf16-mixed")
    plugin.connect(Offloaded(), [], [])
    assert plugin.device == "cuda"
    plain = MGPUPrecision("bf16-mixed")
    plain.connect(torch.nn.Linear(2, 2), [], [])
    assert plain.device == "cpu"
