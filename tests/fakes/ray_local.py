"""A one-machine Ray of a test's own, whatever else runs on the machine.

``ray.init()`` without an address attaches to the cluster named by ``RAY_ADDRESS`` or
to the one ``ray start`` last started here (and then refuses ``num_cpus``): a test
must never do that. ``address="local"`` always starts a new one, and a temporary
folder of its own keeps its sessions, sockets and the "current cluster" pointer away
from another cluster's.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def private_ray(ray: Any, **kwargs: Any) -> Iterator[Any]:
    """Start a new one-machine Ray (``ray.init(address="local", **kwargs)``) in a
    temporary folder; shut it down and remove the folder after the block.

    Yields:
        The ``ray`` module, connected.
    """
    # A short path: Ray's Unix sockets live below it (about 100 characters at most).
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    options = {"include_dashboard": False, "log_to_driver": False, **kwargs}
    ray.init(address="local", _temp_dir=folder, **options)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
