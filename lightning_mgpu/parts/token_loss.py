"""Token-normalised loss: the gradient of the mean over every token of the whole optimizer step.

Averaging a loss per micro-batch (what Lightning's accumulation and DDP's averaging do) weights a token of a short,
padded micro-batch more than a token of a long one, so padding, the accumulation factor and the world size change
the gradient. With ``loss_normalization="tokens"`` the ``training_step`` returns
``{"loss": <sum of per-token losses>, "num_tokens": <count>}``; the backward runs on that sum as usual (Lightning
divides it by ``accumulate_grad_batches`` = k, the reducer by the world size W). Gradients are linear in the
loss, so once the step's last backward has run the gradients hold ``sum of token-loss gradients / (W * k)``:
one scalar all-reduce of ``[tokens, summed loss]`` gives the step's global token count T, and every gradient is
multiplied by ``W * k / T``, before unscaling, clipping or any non-finite check reads it. The loss
``sum / T`` (the global token mean) is logged as ``loss_per_token``.

Ranks that compute the gradient of the same batch count its tokens each (the P stages of a pipeline, whose step
returns the sum over its micro-batches and their count; ``parts/pipeline/``): T is then counted P times and the
factor is ``W * k / (P * T)``, which is what the gradients synced over the ``W / P`` data replicas need.

Manual optimization: call ``self.trainer.strategy.add_tokens(num_tokens, loss_sum)`` for each micro-batch before
its ``opt.step()`` (the step runs inside ``training_step``, before a returned value could be read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from lightning_mgpu import comm
from lightning_mgpu._compat import in_lightning_hook
from lightning_mgpu.ledger import CommStats

LOG_NAME = "loss_per_token"


def _count(value: Union[int, float, Tensor]) -> float:
    return float(value.detach().sum()) if isinstance(value, Tensor) else float(value)


class TokenNormalization:
    """Counts the step's tokens and rescales the synced gradients by ``W * k / T``.

    Example::

        tokens = TokenNormalization()
        out = tokens.record({"loss": loss_sum, "num_tokens": 37})   # each micro-batch (returns the output)
        mean = tokens.rescale(model.parameters(), world_size=2, accumulate=3)  # after the step's last backward
    """

    def __init__(self, ledger: Optional[CommStats] = None) -> None:
        self.ledger = ledger
        self._tokens = 0.0
        self._loss = 0.0

    @staticmethod
    def tokens_of(output: Any) -> float:
        """The ``num_tokens`` of a ``training_step`` output; raises ``ValueError`` (naming the fix) where the output
        is not ``{"loss": ..., "num_tokens": ...}``."""
        if not isinstance(output, Mapping) or "num_tokens" not in output or "loss" not in output:
            got = sorted(output) if isinstance(output, Mapping) else type(output).__name__
            raise ValueError(
                f"loss_normalization='tokens' needs training_step to return {{'loss': <sum of per-token losses>, "
                f"'num_tokens': <count>}}; it returned {got}. Return the sum (not the mean) of the token losses "
                f"and the number of tokens in it, or leave loss_normalization unset."
            )
        return _count(output["num_tokens"])

    def counting(self, step: Callable[..., Any], module: Callable[[], Any]) -> Callable[..., Any]:
        """``step`` (one ``training_step`` call), its output's ``num_tokens`` counted when ``module()``, the
        LightningModule, optimizes automatically (manual optimization counts through ``add_tokens``)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            output = step(*args, **kwargs)
            lightning_module = module()
            if lightning_module is None or not lightning_module.automatic_optimization:
                return output
            return self.record(output)

        return counted

    def record(self, output: Any) -> Any:
        """Read ``num_tokens`` (and the summed loss) from a ``training_step`` output; returns it unchanged."""
        self.add(self.tokens_of(output), output["loss"])
        return output

    def add(self, num_tokens: Union[int, float, Tensor], loss_sum: Optional[Union[float, Tensor]] = None) -> None:
        """Count ``num_tokens`` (and their summed loss) towards the current optimizer step of this rank."""
        self._tokens += _count(num_tokens)
        if loss_sum is not None:
            self._loss += _count(loss_sum)

    def rescale(self, params: Iterable[Tensor], world_size: int, accumulate: int, group: Any = None) -> float:
        """After the step's last backward (gradients synced): one all-reduce of ``[tokens, loss]``, then every
        gradient times ``world_size * accumulate / T``. Returns the global token mean of the loss; a collective."""
        totals = torch.tensor([self._tokens, self._loss], dtype=torch.float64, device=comm.collective_device(group))
        if comm.group_is_up():
            comm.all_reduce(totals, group=group, ledger=self.ledger)
        self._tokens = self._loss = 0.0
        tokens, loss = float(totals[0]), float(totals[1])
        if tokens <= 0:
            raise ValueError(
                f"loss_normalization='tokens': the optimizer step counted {tokens:g} tokens over all ranks; "
                f"num_tokens must be > 0 in some micro-batch of every step."
            )
        factor = world_size * accumulate / tokens
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grad.mul_(factor)
        return loss / tokens

    def wrap_closure(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        strategy: Any,
        to_model: Callable[[Any], Any],
        accumulate: Callable[[], int],
    ) -> Callable[[], Any]:
        """``closure`` followed, after the step's last backward (gradients synced) and before unscaling, clipping and
        the optimizer step, by the rescale of ``optimizer``'s gradients (``to_model``: the precision plugin's way from
        an optimizer's parameter to the module's), and the step's mean loss logged as :data:`LOG_NAME` (the same on
        every rank). ``strategy``: Lightning's (module, world size); ``accumulate()``: the Trainer's
        ``accumulate_grad_batches`` now."""

        def rescaled() -> Any:
            out = closure()
            params = [to_model(p) for group in optimizer.param_groups for p in group["params"]]
            mean = self.rescale(params, strategy.world_size, accumulate())
            module = strategy.lightning_module
            if in_lightning_hook(module):
                module.log(LOG_NAME, mean, on_step=True, on_epoch=False, prog_bar=True)
            return out

        return rescaled
