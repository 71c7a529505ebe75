"""Manual optimization under DDP: each optimizer's gradients are averaged once, when it steps.

DDP's reducer stays out of the step (it would sync every backward, and wait forever for the gradients of
the parameters ``toggle_model`` switched off); this part syncs what the stepping optimizer needs, in the
step's closure (after its backward, before unscaling and ``on_before_optimizer_step``), or earlier when the
precision plugin asks (``clip_gradients`` between ``manual_backward`` and ``opt.step()`` clips the global
gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from typing import Any, Callable, Optional

import torch
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_mgpu.comm import CommStats, allreduce_gradients
from lightning_mgpu.parts.optimizers import unwrap_optimizer


class ManualGradientSync:
    """Per optimizer: the parameters to average (trainable at set-up, in optimizer order), and a guard that
    refuses a raw ``torch.optim`` step (its gradients would not be averaged).

    Example::

        sync = ManualGradientSync(compress=None, bucket_cap_mb=25.0)
        sync.setup(optimizers, world_size=2)
        with sync.stepping():
            optimizer.step(sync.wrap_closure(optimizer, closure, group, ledger))
    """

    def __init__(self, compress: Optional[str], bucket_cap_mb: float = 25.0) -> None:
        self.compress = compress
        self.bucket_cap_mb = bucket_cap_mb
        self._params: dict[int, list[torch.Tensor]] = {}
        self._synced: set[int] = set()
        self._guards: list[RemovableHandle] = []
        self._in_step = False
        self._ranks = 1

    def setup(
        self,
        optimizers: Iterable[Optimizer],
        world_size: int,
        model_parameter: Callable[[torch.Tensor], torch.Tensor] = lambda p: p,
    ) -> None:
        """``model_parameter``: the parameter whose gradient backward writes (master-weight precision keeps FP32
        copies in the optimizer; their half-precision model parameters are synced, before the copy)."""
        self.teardown()
        self._ranks = world_size
        for opt in optimizers:
            seen: set[int] = set()  # per optimizer: a parameter shared by two optimizers is synced for each
            params = []
            for group in opt.param_groups:
                for p in group["params"]:
                    p = model_parameter(p)
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
            self._params[id(opt)] = params
            self._guards.append(opt.register_step_pre_hook(self._refuse_unsynced_step))

    def teardown(self) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards = []
        self._params = {}

    @contextlib.contextmanager
    def stepping(self) -> Generator[None, None, None]:
        """Around the strategy's optimizer step: a raw step outside it is refused; each optimizer syncs once."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            self._synced.clear()

    def wrap_closure(self, optimizer: Any, closure: Callable[[], Any], group: Any, ledger: CommStats) -> Callable:
        inner = unwrap_optimizer(optimizer)
        if id(inner) not in self._params:
            raise MisconfigurationException(
                f"{type(inner).__name__} was not returned by configure_optimizers, so mgpu_ddp cannot sync its "
                f"gradients. Create every optimizer in configure_optimizers."
            )

        def synced_closure() -> Any:
            out = closure()
            self.sync(inner, group, ledger)
            return out

        return synced_closure

    def sync(self, optimizer: Any, group: Any, ledger: CommStats) -> None:
        """Average ``optimizer``'s gradients across ranks, once per step."""
        inner = unwrap_optimizer(optimizer)
        params = self._params.get(id(inner))
        if params is None or id(inner) in self._synced:
            return
        allreduce_gradients(
            params, group=group, compress=self.compress, ledger=ledger, bucket_cap_mb=self.bucket_cap_mb
        )
        self._synced.add(id(inner))

    def _refuse_unsynced_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self._in_step:
            raise MisconfigurationException(
                f"{type(optimizer).__name__}.step() was called on the raw torch optimizer, so its gradients were "
                f"not averaged across the {self._ranks} ranks and the replicas would drift apart. Step through "
                f"Lightning's wrapper: `opt = self.optimizers()` (not `use_pl_optimizer=False` or an optimizer "
                f"kept from configure_optimizers), then `opt.step()`."
            )
