"""When one rank fails, every rank stops, and each says which rank it was.

A rank that raises (in user code, a data loader, anywhere but a collective) *announces* its exception on the
rendezvous store before its process ends. A rank whose collective fails (gloo: "Connection closed/reset by
peer" when a peer's process died, "Timed out waiting" after the strategy's ``timeout`` when a peer is stuck)
takes a *roll call* on the same store: it marks itself present and waits a short grace period for every
other rank to be either present (its collective failed too) or announced (it raised). Ranks that are neither
were killed or are stuck outside collectives, e.g. in user code. The exception is then rewritten to name
them.

The store is torch's own TCPStore behind the default process group, so this needs no extra collective: it
still works when a peer is dead, where a gloo ``monitored_barrier`` would fail on the dead peer's closed
connection before it could say who else is missing. Lightning's own launches host it in rank 0's process
(torchrun: in the elastic agent); when rank 0's process is gone, the others say so.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_mgpu import comm
from lightning_mgpu._compat import default_store
from lightning_mgpu.comm import group_is_up

_PREFIX = "mgpu/failure"
# Errors a rank gets *because of another rank*: a peer's process is gone, a peer stopped answering, or the
# store host is gone. (gloo's wordings as of torch 2.4-2.13; NCCL's watchdog and store timeouts too.)
_COLLECTIVE = re.compile(
    r"Connection (closed|reset) by peer|Timed out waiting|timed out after|Broken pipe|"
    r"failed to pass monitoredBarrier|NCCL (communicator|error|watchdog)|DistNetworkError|DistStoreError|"
    r"Socket Timeout|Connection refused",
    re.IGNORECASE,
)


def is_peer_failure(exception: BaseException) -> bool:
    """True for the errors one rank gets when *another* rank died or stopped answering."""
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    return isinstance(exception, RuntimeError) and bool(_COLLECTIVE.search(str(exception)))


def _store(grace_s: float) -> Optional[Any]:
    if not group_is_up():
        return None
    try:
        store = default_store()
        store.set_timeout(timedelta(seconds=grace_s))  # every store call below gives up after the grace
        return store
    except Exception:  # a store that is gone or of another kind: no roll call
        return None


def announce(rank: int, exception: BaseException, grace_s: float = 2.0) -> None:
    """Post this rank's exception where the other ranks look when their collectives fail."""
    store = _store(grace_s)
    if store is None:
        return
    text = f"{type(exception).__name__}: {exception}".strip()
    try:
        store.set(f"{_PREFIX}/raised/{rank}", text[:4000])
    except Exception:  # the store host is gone too: the others will say it stopped answering
        pass


def roll_call(rank: int, world_size: int, grace_s: float) -> tuple[dict[int, str], list[int], bool]:
    """Mark this rank present; wait up to ``grace_s`` for every other rank to be present or announced.

    Returns (announced exceptions by rank, ranks that did not answer, whether the store was reachable)."""
    store = _store(grace_s)
    others = [r for r in range(world_size) if r != rank]
    if store is None:
        return {}, others, False
    raised: dict[int, str] = {}
    present: set[int] = set()
    try:
        store.set(f"{_PREFIX}/present/{rank}", "1")
        deadline = time.monotonic() + grace_s
        while True:
            for r in others:
                if r in raised or r in present:
                    continue
                if store.check([f"{_PREFIX}/raised/{r}"]):
                    raised[r] = store.get(f"{_PREFIX}/raised/{r}").decode(errors="replace")
                elif store.check([f"{_PREFIX}/present/{r}"]):
                    present.add(r)
            pending = [r for r in others if r not in raised and r not in present]
            if not pending or time.monotonic() > deadline:
                return raised, pending, True
            time.sleep(0.05)
    except Exception:  # the store's host (rank 0's process) is gone
        return raised, [r for r in others if r not in raised and r not in present], False


def explain(
    rank: int, world_size: int, grace_s: float, timeout: Optional[timedelta], error: str
) -> tuple[str, list[int]]:
    """What this rank can say about the others after its collective failed with ``error``, and the ranks that
    did not answer the roll call."""
    raised, missing, reachable = roll_call(rank, world_size, grace_s)
    unanswered = list(missing)
    parts = [f"rank {r} of {world_size} failed with {text}" for r, text in sorted(raised.items())]
    if not reachable and 0 in missing:
        parts.append(
            f"rank 0 of {world_size} is gone: the rendezvous store its process hosts does not answer (rank 0 was "
            f"killed or crashed; its own log or exit status says how)"
        )
        missing = [r for r in missing if r != 0]
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world_size}"
        if re.search(r"timed out|timeout", error, re.IGNORECASE):
            waited = f" after {timeout.total_seconds():g} s (the strategy's timeout)" if timeout is not None else ""
            parts.append(
                f"{who} stopped answering: the collective timed out{waited} and {who.split(' of ')[0]} did not "
                f"answer a roll call within {grace_s:g} s (stuck outside collectives, e.g. in user code or a data "
                f"loader, or killed)"
            )
        else:
            parts.append(
                f"{who} is gone: its connection closed and it did not answer a roll call within {grace_s:g} s (killed "
                f"or crashed without raising: SIGKILL, out of memory, a segfault)"
            )
    if not parts:
        parts.append("every other rank answered (its collective failed too); the cause is in this error")
    text = f"lightning-mgpu: {'; '.join(parts)}. Rank {rank} stopped waiting and is ending; original error: "
    return text, unanswered


def prepend(exception: BaseException, text: str) -> None:
    """Put ``text`` in front of the exception's message (Lightning's ``_augment_message`` does the same)."""
    if exception.args and isinstance(exception.args[0], str):
        exception.args = (text + exception.args[0], *exception.args[1:])
    else:
        exception.args = (text + str(exception), *exception.args[1:])


class FailureHandling:
    """The strategy side of the failure path: how long the roll call waits, and what a rank does when an
    exception ends its part of the job.

    Example::

        failures = FailureHandling(timeout=timedelta(minutes=30))
        missing = failures.end_group_after(exception, rank=0, world_size=2)
    """

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self.timeout = timeout

    def roll_call_s(self) -> float:
        """How long a rank whose collective failed waits for the others to answer: a quarter of the timeout,
        within [2 s, 10 s] (the healthy ranks fail in the same collective within moments of each other)."""
        return min(10.0, max(2.0, self.timeout.total_seconds() / 4)) if self.timeout else 5.0

    def end_group_after(self, exception: BaseException, rank: int, world_size: int) -> list[int]:
        """One rank failed: say which, and leave the group so that no rank waits for it.

        A rank whose own code raised announces it and keeps its process group: the group is healthy, and a
        script that catches the exception on every rank (a pruning callback, say) fits again on it; when the
        process ends instead, its connections close and the peers' collectives fail at once. A rank whose
        collective failed because of another rank takes a roll call, names the ranks that raised or stopped
        answering, and leaves the broken group. Returns the ranks that did not answer the roll call (the popen
        launcher kills those of its children). Runs once per exception: from the launcher in the workers and
        in popen's rank 0, then again (a no-op) from Lightning's ``on_exception``."""
        done = getattr(exception, "_mgpu_missing_ranks", None)
        if done is not None:
            return list(done)
        missing: list[int] = []
        if group_is_up() and world_size > 1:
            grace_s = self.roll_call_s()
            if is_peer_failure(exception):
                text, missing = explain(rank, world_size, grace_s, self.timeout, str(exception))
                prepend(exception, text)
                comm.abandon_groups()
            else:
                announce(rank, exception, grace_s)
        try:
            exception._mgpu_missing_ranks = missing  # type: ignore[attr-defined]
        except (AttributeError, TypeError):  # a few built-in exception types take no attributes
            pass
        return missing
