"""MasterWeights: the FP32 master copy of a half model that :class:`~lightning_mgpu.MGPUPrecision` keeps in its
master modes (``"16-master"`` / ``"bf16-master"``) outside FSDP2.

The module's weights are half; each optimizer parameter group holds an FP32 master of every half parameter in it.
A step moves the half gradients into the masters, the optimizer steps the masters, and the masters are copied
back to the half weights. Checkpoints hold the masters (the weights at full precision), and a restore refreshes
them. Under FSDP2 FSDP's own sharded FP32 parameters are the master copy and this object stays empty.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mgpu import comm

__all__ = ["MasterWeights"]


class MasterWeights:
    """FP32 masters of a module's half parameters, held by the optimizers in place of the half parameters.

    Args:
        dtype: the half dtype the module is cast to.

    Attributes:
        pairs: ``(master, half model parameter)`` for every master, in the order they were made.

    Example:

        >>> from torch import nn
        >>> masters = MasterWeights(torch.bfloat16)
        >>> model = masters.convert(nn.Linear(2, 2))  # FP32 values kept, the module cast to bf16
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> masters.attach([optimizer], world_size=1)  # the optimizer now steps FP32 masters
        >>> master = optimizer.param_groups[0]["params"][0]
        >>> model.weight.dtype, master.dtype, masters.model_parameter(master) is model.weight
        (torch.bfloat16, torch.float32, True)
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        # FP32 copies taken before the module is cast (convert -> attach)
        self._fp32_source: dict[int, Tensor] = {}
        self._model_param: dict[int, Tensor] = {}  # id(master) -> half model parameter
        self._master_of: dict[int, Tensor] = {}  # id(half model parameter) -> master
        self.pairs: list[tuple[Tensor, Tensor]] = []  # (master, half model parameter)
        self._requires_grad: list[bool] = []  # the half parameters' flags while a backward mirrors the toggle

    def convert(self, module: nn.Module) -> nn.Module:
        """Keeps FP32 copies of the module's floating-point parameters, then casts the module to half."""
        # The masters start from the FP32 weights (a loaded fp32 checkpoint included), not from their rounding
        self._fp32_source = {
            id(p): p.detach().to(torch.float32, copy=True) for p in module.parameters() if p.is_floating_point()
        }
        return module.to(dtype=self.dtype)

    def attach(self, optimizers: list[Optimizer], world_size: int) -> None:
        """Points every optimizer parameter group at FP32 masters of its half parameters; with ``world_size`` > 1
        the masters just taken are rank 0's."""
        for opt in optimizers:
            for group in opt.param_groups:
                masters = []
                for p in group["params"]:
                    if id(p) in self._model_param:  # already a master (a second fit() in this process)
                        masters.append(p)
                        continue
                    master = self._master_of.get(id(p))
                    if master is None:
                        src = self._fp32_source.get(id(p), p.detach())
                        master = src.to(device=p.device, dtype=torch.float32, copy=True).requires_grad_(p.requires_grad)
                        self._model_param[id(master)] = p
                        self._master_of[id(p)] = master
                        self.pairs.append((master, p))
                    masters.append(master)
                group["params"] = masters
        if self._fp32_source and world_size > 1:
            # DDP copied rank 0's weights into the half parameters when it wrapped the model; the masters were
            # taken before that, from each rank's own initialisation: rank 0's are the ones to train
            with torch.no_grad():
                for master, _ in self.pairs:
                    comm.broadcast(master, src=0)
        self._fp32_source = {}

    def model_parameter(self, param: Tensor) -> Tensor:
        """The half model parameter behind a master (``param`` itself if it is not a master)."""
        return self._model_param.get(id(param), param)

    def clear_half_grads_on_zero_grad(self, optimizer: Optimizer) -> None:
        """Makes ``optimizer.zero_grad()`` clear the half gradients of its masters' parameters too."""
        # optimizer.zero_grad() clears the masters' gradients; the half gradients accumulated since the last
        # step (e.g. a GAN's generator backward reaching the discriminator) must go too, as they would in FP32.
        if getattr(optimizer, "_mgpu_zero_grad_wrapped", False):
            return
        original = optimizer.zero_grad
        masters = self

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none)
            for group in optimizer.param_groups:
                for m in group["params"]:
                    p = masters._model_param.get(id(m))
                    if p is not None:
                        p.grad = None

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        optimizer._mgpu_zero_grad_wrapped = True  # type: ignore[attr-defined]

    def mirror_requires_grad(self) -> None:
        """Before a manual-optimization backward: the half parameters take their masters' ``requires_grad``."""
        # Lightning's toggle_optimizer switches requires_grad on the optimizer's parameters, the masters:
        # mirror it onto the half parameters for this backward (autograd accumulates no gradient into a
        # leaf whose requires_grad is off), so the toggled-off optimizer's weights get none, as in FP32.
        # restore_requires_grad switches them back: the next forward must build the graph through every weight.
        self._requires_grad = [p.requires_grad for _, p in self.pairs]
        for master, p in self.pairs:
            p.requires_grad_(master.requires_grad)

    def restore_requires_grad(self) -> None:
        """After the backward: the half parameters' own ``requires_grad`` flags again."""
        if self._requires_grad:
            for (_, p), flag in zip(self.pairs, self._requires_grad):
                p.requires_grad_(flag)
            self._requires_grad = []

    def grads_to_masters(self, optimizer: Optimizer) -> None:
        """The half gradients of the optimizer's masters become the masters' FP32 gradients."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                for m in group["params"]:
                    p = self._model_param.get(id(m))
                    if p is None:
                        continue
                    if p.grad is None:
                        m.grad = None
                    elif m.grad is None:
                        m.grad = p.grad.to(torch.float32, copy=True)
                    else:
                        m.grad.copy_(p.grad)
                    p.grad = None  # the half gradient is now in the master's

    def masters_to_model(self, optimizer: Optimizer) -> None:
        """The optimizer's stepped masters copied back to the half weights."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                for m in group["params"]:
                    p = self._model_param.get(id(m))
                    if p is not None:
                        p.copy_(m)

    def fp32_state_dict(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the module's state dict) with each parameter's FP32 master in place of its half value."""
        if not self.pairs:
            return state
        state = dict(state)
        for name, p in module.named_parameters(remove_duplicate=False):  # a tied weight under every name
            master = self._master_of.get(id(p))
            if master is not None and name in state:
                state[name] = master.detach().clone()
        return state

    def load(self, module: nn.Module, state: dict[str, Any]) -> None:
        """The masters of the module's parameters take the values in ``state`` (a checkpoint's FP32 weights)."""
        with torch.no_grad():
            for name, p in module.named_parameters(remove_duplicate=False):
                master = self._master_of.get(id(p))
                if master is not None and name in state:
                    master.copy_(state[name])
