"""What rank 0's worker hands to the main process after a spawn or fork launch, and how the main process's objects
take it back (Lightning hands back the module's weights and ``callback_metrics``; the pack adds its own state).

The worker's side runs in rank 0 at the end of the launched call, the main process's side after the workers ended:
the weights (every rank: the sharded strategy gathers them), the communication ledger, ``mgpu_auto``'s decision, the
state of each callback with ``results_for_main_process`` (``DeviceMonitor``'s history) and of the strategy's parts
that hand theirs back (the pipeline's last step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional

import pytorch_lightning as pl


def _callbacks(trainer: pl.Trainer) -> list[Any]:
    # set on the Trainer at runtime by Lightning's callback connector (not a declared attribute)
    return list(getattr(trainer, "callbacks", []))


@dataclasses.dataclass(eq=False)
class WorkerResults:
    """What rank 0's worker hands to the main process after a spawn or fork launch, and how the main process's
    objects take it back: the module's weights (with the precision plugin's FP32 masters), the ledger, ``mgpu_auto``'s
    decision, the callbacks' and the strategy's parts' states. ``strategy``: the strategy launched; ``stats``: its
    ledger's counts (updated in place in the main process); ``module_state(state)``: the weights as the strategy saves
    them (the precision plugin's masters put in); ``full_module_state()``: the whole module's weights on
    every rank (the sharded strategy gathers them; default: the module's ``state_dict``); ``hand_back``: the parts
    whose state the main process gets, as callbacks' (each has ``results_for_main_process()`` and
    ``restore_results_from_worker(state)``: the pipeline's last step).

    Example (the strategy's runtime builds it and hands its methods to the fork/spawn launcher)::

        results = WorkerResults(strategy, ledger.stats, checkpoint_rules.module_state)
        weights, extra = results.weights, (results.results, results.restore)  # the launcher's weights=, results=
    """

    strategy: Any
    stats: Any
    module_state: Callable[[dict[str, Any]], dict[str, Any]]
    full_module_state: Optional[Callable[[], dict[str, Any]]] = None
    hand_back: Sequence[Any] = ()

    def weights(self) -> dict[str, Any]:
        """After a spawn/fork fit: the weights the main process's module gets (a collective: every rank)."""
        module = self.strategy.lightning_module
        assert module is not None
        state = self.full_module_state() if self.full_module_state is not None else module.state_dict()
        return self.module_state(state)

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """After a spawn/fork fit, in rank 0's worker: what the main process's objects get (as Lightning hands
        back ``callback_metrics``): the ledger, ``mgpu_auto``'s decision, the state of each callback that
        has ``results_for_main_process`` (``DeviceMonitor``'s history), keyed by its place in the callbacks, and
        that of the strategy's parts that hand theirs back (the pipeline's last step)."""
        callbacks = {
            i: (type(c).__name__, c.results_for_main_process())
            for i, c in enumerate(_callbacks(trainer))
            if callable(getattr(c, "results_for_main_process", None))
        }
        decision = getattr(self.strategy, "auto_decision", None)
        # dataclasses travel as dicts: Lightning moves the results to the CPU with apply_to_collection, which
        # refuses frozen dataclasses
        return {
            "comm_stats": dataclasses.asdict(self.stats),
            "auto_decision": (type(decision), dataclasses.asdict(decision)) if decision is not None else None,
            "callbacks": callbacks,
            "parts": [part.results_for_main_process() for part in self.hand_back],
        }

    def restore(self, trainer: pl.Trainer, results: dict[str, Any]) -> None:
        """In the main process, after a spawn/fork fit: rank 0's ledger (updated in place: the parts that count
        into it keep their reference), ``auto_decision`` and callback states (see
        :meth:`results`)."""
        stats = self.stats
        for name, value in results["comm_stats"].items():
            setattr(stats, name, value)
        if results["auto_decision"] is not None:
            kind, fields = results["auto_decision"]
            setattr(self.strategy, "auto_decision", kind(**fields))  # noqa: B010  # the strategy's public attribute
        present = _callbacks(trainer)
        for i, (kind, state) in results["callbacks"].items():
            callback: Any = present[i] if i < len(present) else None
            if type(callback).__name__ == kind and callable(getattr(callback, "restore_results_from_worker", None)):
                callback.restore_results_from_worker(state)
        for part, state in zip(self.hand_back, results.get("parts", ())):
            part.restore_results_from_worker(state)
