"""plugins/precision.py: the strategy adopts Lightning's plugin and hands it what it needs through arguments."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_mgpu import MGPUPrecision
from lightning_mgpu.plugins import precision as precision_module
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


class _AdamWModule(pl.LightningModule):
    """A small regressor trained with AdamW (``fused`` or not); batch 2 gets an infinite gradient."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.layer = nn.Linear(4, 1)
        self.weights: list[torch.Tensor] = []  # before each batch, and after the last

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.weights.append(self.layer.weight.detach().clone())
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def on_after_backward(self) -> None:
        if len(self.weights) == 3:  # the third batch
            self.layer.weight.grad[0, 0] = float("inf")

    def on_train_end(self) -> None:
        self.weights.append(self.layer.weight.detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=self.fused)


def _bf16_fit(fused: bool) -> tuple[_AdamWModule, MGPUPrecision, HostSyncs]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
    module, plugin = _AdamWModule(fused), MGPUPrecision("bf16-mixed")
    with HostSyncs() as syncs:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=5, plugins=[plugin], callbacks=[syncs.callback()],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    return module, plugin, syncs


def test_bf16_skips_a_nonfinite_step_on_the_device_without_waiting_when_the_optimizer_is_fused():
    """``bf16-mixed`` skips a step whose gradients hold inf/NaN. With a fused optimizer (``AdamW(fused=True)``) the
    flag goes to the optimizer's own kernel, as torch's ``GradScaler`` gives it: no step waits for the device, the
    skipped step leaves the weights and the optimizer's step count as they were, and the count of skipped steps is
    read when asked. Negative control: the same module with the default AdamW waits once per step (the flag is read
    on the host to decide)."""
    module, plugin, syncs = _bf16_fit(fused=True)
    assert syncs.counts() == [0] * 5, syncs.per_step
    w = module.weights
    assert torch.equal(w[2], w[3])  # the third step was skipped
    assert all(not torch.equal(w[i], w[i + 1]) for i in (0, 1, 3, 4))  # the others moved the weights
    assert [float(state["step"]) for state in module.trainer.optimizers[0].state.values()] == [4.0, 4.0]
    assert plugin.skipped_steps == 1 and plugin.optimizer_steps == 5
    plain, plain_plugin, plain_syncs = _bf16_fit(fused=False)
    # the plugin's read of the flag, once per step (the foreach AdamW's own reads of its step counts are counted too
    # on CPU, where the counter cannot tell a host tensor: on a GPU those counts stay on the host)
    source, start = inspect.getsourcelines(precision_module.any_nonfinite)
    site = (
        f"item @ lightning_mgpu/plugins/precision.py:{start + next(i for i, t in enumerate(source) if '.item()' in t)}"
    )
    reads = [sum(n for where, n in step.items() if where.startswith(f"{site} ")) for step in plain_syncs.per_step]
    assert reads == [1] * 5, plain_syncs.per_step
    assert plain_plugin.skipped_steps == 1 and torch.equal(plain.weights[2], plain.weights[3])
    torch.testing.assert_close(w[-1], plain.weights[-1])  # fused and foreach AdamW: the same steps
