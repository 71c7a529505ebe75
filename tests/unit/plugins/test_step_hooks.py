"""Which step hooks MGPUPrecision dispatches (plugins/step_hooks.py): the ones somebody listens to."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_mgpu import MGPUPrecision
from lightning_mgpu.plugins.step_hooks import STEP_HOOKS


class _HookModule(pl.LightningModule):
    """A small regressor trained with SGD; ``listening``: it overrides ``on_after_backward`` (records the gradient)."""

    def __init__(self, listening: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.grads: list[torch.Tensor] = []
        if listening:
            self.on_after_backward = lambda: self.grads.append(self.layer.weight.grad.clone())  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y) * 100.0  # large gradients: clipping at 0.5 changes them

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _ClipFromStep2(pl.Callback):
    """Overrides none of the step hooks: sets ``trainer.gradient_clip_val`` from the second step on."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        trainer.gradient_clip_val = 0.5 if i >= 1 else None


class _StepCallback(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.norms.append(float(pl_module.layer.weight.grad.norm()))


def _hook_fit(
    monkeypatch: Any, plugins: list[Any], listening: bool, callbacks: tuple[Any, ...] = (), **trainer_kwargs: Any
) -> tuple[Any, ...]:
    """Three steps; the step hooks Lightning dispatched (hook name -> calls, module and callback dispatches)."""
    from pytorch_lightning.trainer import call

    dispatched: dict[str, int] = {}
    for name in ("_call_lightning_module_hook", "_call_callback_hooks"):
        original = getattr(call, name)

        def counting(trainer: Any, hook: str, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if hook in STEP_HOOKS:
                dispatched[hook] = dispatched.get(hook, 0) + 1
            return _original(trainer, hook, *args, **kwargs)

        monkeypatch.setattr(call, name, counting)
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(6, 4), torch.randn(6, 1))
    module, callback = _HookModule(listening), _StepCallback()
    listeners = [*callbacks, callback] if listening else list(callbacks)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, plugins=plugins, callbacks=listeners,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    monkeypatch.undo()
    return module.layer.weight.detach().clone(), dispatched, module.grads, callback.norms


def test_the_step_hooks_are_dispatched_only_where_somebody_listens(monkeypatch, tmp_path):
    """Lightning's precision plugin dispatches ``on_before_backward``, ``on_after_backward``,
    ``on_before_optimizer_step`` and ``configure_gradient_clipping`` every step, to the module and every callback,
    whether anything overrides them or not. MGPUPrecision dispatches the ones somebody listens to: a module and a
    callback that override a hook see it every step with the same values, clipping still clips, the weights are
    Lightning's to the bit; with a profiler on, every hook is dispatched, so its report lists what Lightning's would.
    Negative control: Lightning's own plugin dispatches all four in each of the 3 steps, to the module and to the
    callbacks."""
    lightnings, every, _, _ = _hook_fit(monkeypatch, [], listening=False)
    assert every == {hook: 6 for hook in STEP_HOOKS[:3]} | {"configure_gradient_clipping": 3}
    ours, dispatched, _, _ = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], listening=False)
    assert dispatched == {}
    assert torch.equal(ours, lightnings)

    clipped = {"gradient_clip_val": 0.5}
    lightnings, _, grads, norms = _hook_fit(monkeypatch, [], listening=True, **clipped)
    ours, dispatched, our_grads, our_norms = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], True, **clipped)
    assert dispatched == {"on_after_backward": 6, "on_before_optimizer_step": 6, "configure_gradient_clipping": 3}
    assert len(our_grads) == 3 and all(map(torch.equal, our_grads, grads))
    assert our_norms == norms and len(norms) == 3 and max(norms) > 0.5  # before clipping, and clipping mattered
    assert torch.equal(ours, lightnings)
    unclipped, _, _, _ = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], listening=True)
    assert not torch.equal(unclipped, ours)

    # clipping switched on during the fit by a callback that overrides none of the hooks: read at every step
    later = (_ClipFromStep2(),)
    lightnings, _, _, _ = _hook_fit(monkeypatch, [], listening=False, callbacks=later)
    ours, dispatched, _, _ = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], listening=False, callbacks=later)
    assert dispatched == {"on_before_optimizer_step": 4, "configure_gradient_clipping": 2}  # steps 2 and 3
    assert torch.equal(ours, lightnings)
    unclipped, _, _, _ = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], listening=False)
    assert not torch.equal(unclipped, ours)

    profiled = {"profiler": pl.profilers.SimpleProfiler(dirpath=tmp_path, filename="profile")}
    _, dispatched, _, _ = _hook_fit(monkeypatch, [MGPUPrecision("32-true")], listening=False, **profiled)
    assert dispatched == every
