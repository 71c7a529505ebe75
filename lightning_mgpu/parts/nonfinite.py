"""Non-finite gradients stop every rank with the same error, never one rank only (which would hang the others
in their next collective) and never ranks disagreeing on whether a step happened.

With ``nonfinite="error"`` each rank looks at the gradients it holds once the step's last backward has run (after
the gradient sync: under DDP the average carries one rank's NaN to every rank; under ZeRO-2/3 only the owner of
the shard sees it), writes ``1 + index`` of its first non-finite parameter into its slot of a world-size vector,
and one all-reduce tells every rank what every rank found. If any slot is set, every rank raises the same
:class:`FloatingPointError` naming the ranks and parameters. Under the fp16 loss scaler an overflow is expected
and the scaler's own agreed check (``ShardedGradScaler``: ``found_inf`` all-reduced) makes every rank skip the
same step, so the check leaves that to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_mgpu import comm
from lightning_mgpu._compat import attached_trainer
from lightning_mgpu.ledger import CommStats


class NonFiniteCheck:
    """Example::

    check = NonFiniteCheck()
    check.check([(name, p) for name, p in model.named_parameters()], rank=0, world_size=1, step=0)
    """

    def __init__(self, ledger: Optional[CommStats] = None) -> None:
        self.ledger = ledger

    def check(
        self, named: Sequence[tuple[str, Tensor]], rank: int, world_size: int, step: int, group: Any = None
    ) -> None:
        """Raise the same :class:`FloatingPointError` on every rank if any rank's gradients hold NaN/Inf (a
        collective: call it on every rank)."""
        first = 0
        for index, (_, p) in enumerate(named):
            if p.grad is not None and not bool(torch.isfinite(comm.local_shard(p.grad)).all()):
                first = index + 1
                break
        found = torch.zeros(world_size, dtype=torch.int64, device=comm.collective_device(group))
        found[rank] = first
        if world_size > 1 and comm.group_is_up():
            comm.all_reduce(found, group=group, ledger=self.ledger)
        bad = [(r, int(i) - 1) for r, i in enumerate(found.tolist()) if i]
        if not bad:
            return
        where = "; ".join(f"rank {r}: parameter {named[i][0]!r}" for r, i in bad)
        raise FloatingPointError(
            f"Non-finite (NaN/Inf) gradient at optimizer step {step} ({where}; the first such parameter of each rank, "
            f"after the gradient sync, which spreads one rank's NaN to every rank that averages it). Every rank "
            f"stops here together. Look for a log of zero, a division by a zero count or an exploding loss in that "
            f"step's batch; gradient_clip_val does not help against NaN. nonfinite=None turns this check off."
        )

    def wrap_closure(
        self, optimizer: Any, closure: Callable[[], Any], strategy: Any, to_model: Callable[[Any], Any], scaled: bool
    ) -> Callable[[], Any]:
        """``closure`` followed, after the step's last backward (and the token rescale) and before unscaling,
        clipping and the step, by :meth:`check` of ``optimizer``'s gradients, each named by the module's parameter
        it belongs to (``to_model``: the precision plugin's way there). ``scaled``: fp16's loss scaler skips a
        non-finite step on every rank itself, so nothing is checked. ``strategy``: Lightning's (module, ranks)."""

        def checked() -> Any:
            out = closure()
            if scaled:
                return out
            module = strategy.lightning_module
            assert module is not None
            names = {id(p): name for name, p in module.named_parameters()}
            named = [
                (names.get(id(to_model(p)), f"param_groups[{g}][{i}]"), to_model(p))
                for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])
            ]
            trainer = attached_trainer(module)
            step = trainer.global_step if trainer is not None else 0
            self.check(named, strategy.global_rank, strategy.world_size, step)
            return out

        return checked
