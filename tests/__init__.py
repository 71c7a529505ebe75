"""The tests, and their `lightning` namespace copy ``tests.lightning_ns``: the same files loaded again with
``pytorch_lightning`` -> ``lightning.pytorch``, ``lightning_mgpu`` -> ``lightning_mgpu.lightning`` and ``tests`` ->
``tests.lightning_ns`` in their imports (the package's own mechanism, ``lightning_mgpu/_namespace.py``), subfolders
included (``tests.lightning_ns.unit.test_presets``). ``tests/integration/test_namespaces.py`` runs the compatibility
subset (``-m compat``) from that copy. Installed here, in the package every test module and worker imports first, so
that spawned workers unpickle the copy's functions too."""

import os

try:
    from lightning_mgpu import _namespace
except ImportError:  # a test that proves a checkpoint loads without the pack blocks `lightning_mgpu` on purpose
    _namespace = None  # type: ignore[assignment]

if _namespace is not None:
    _namespace.install(
        _namespace.MirrorFinder(
            "tests",
            "tests.lightning_ns",
            [os.path.dirname(__file__)],
            renames={**_namespace.LIGHTNING_RENAMES, "tests": "tests.lightning_ns"},
            requires="lightning",
        )
    )
