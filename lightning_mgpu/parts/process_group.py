"""Whether this process is in a torch process group (the one check every part and strategy makes)."""

from __future__ import annotations

import torch.distributed as dist


def group_is_up() -> bool:
    """True when ``torch.distributed`` is built in and the default process group is initialised.

    Example::

        world = dist.get_world_size() if group_is_up() else 1
    """
    return dist.is_available() and dist.is_initialized()
