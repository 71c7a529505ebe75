"""``import lightning_mgpu`` refuses a Lightning release older than 2.6.6 (a checkpoint's hyper-parameters could run
code in ``load_from_checkpoint``), and names a compromised one (2.6.2, 2.6.3) with the credentials to rotate."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mgpu import _namespace
from lightning_mgpu._namespace import OLDEST_LIGHTNING, unsafe_lightning_releases

ROOT = Path(__file__).resolve().parents[2]


def _installed(versions: dict[str, str]):
    def version_of(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    return version_of


@pytest.mark.parametrize("version", ["2.6.6", "2.6.7", "2.6.10", "2.7.0rc1", "3.0.0"])
def test_the_oldest_declared_release_and_newer_are_accepted(version):
    assert unsafe_lightning_releases(_installed({"lightning": version, "pytorch-lightning": version})) is None


def test_the_installed_releases_are_accepted():
    assert unsafe_lightning_releases() is None  # what this environment has (pyproject.toml's range)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.5", "2.5.6", "1.9.5"])
def test_a_release_before_the_fix_is_refused_with_the_advisory_and_the_upgrade_line(version):
    message = unsafe_lightning_releases(_installed({"pytorch-lightning": version}))
    assert message is not None
    assert f"refuses pytorch-lightning {version}" in message
    assert "GHSA-qqmf-gpg7-g8gw" in message and "load_from_checkpoint" in message
    assert f"pip install --upgrade 'pytorch-lightning>={OLDEST_LIGHTNING}'" in message
    assert "rotate" not in message  # not compromised, only vulnerable


@pytest.mark.parametrize("version", sorted(_namespace.COMPROMISED_LIGHTNING))
def test_a_compromised_release_is_named_with_the_credentials_to_rotate(version):
    message = unsafe_lightning_releases(_installed({"lightning": version, "pytorch-lightning": OLDEST_LIGHTNING}))
    assert message is not None
    assert f"lightning {version} was published with a credential-stealing payload" in message
    assert "GHSA-w37p-236h-pfx3" in message and "rotate the credentials" in message
    assert "'lightning>=2.6.6'" in message and "pytorch-lightning>=" not in message  # only the old one is named


def test_import_refuses_an_environment_with_a_compromised_release(tmp_path):
    """The refusal as a user meets it: a fresh interpreter whose ``lightning`` metadata says 2.6.3 (a dist-info
    folder ahead of site-packages) fails at ``import lightning_mgpu``, before torch is imported."""
    info = tmp_path / "lightning-2.6.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning\nVersion: 2.6.3\n")
    code = (
        "import sys\n"
        "try:\n    import lightning_mgpu\n"
        "except ImportError as e:\n    print(e)\n    print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refuses lightning 2.6.3" in out.stdout and "credential-stealing payload" in out.stdout
    assert out.stdout.strip().endswith("False")  # refused before anything of torch ran


def test_the_lightning_copy_is_imported_with_lightning_not_before_it():
    """``import lightning_mgpu`` in a ``pytorch_lightning`` script does not import ``lightning`` (about a second and a
    half of start-up); the preset names reach ``lightning.pytorch``'s registry as soon as ``lightning`` is imported,
    whichever submodule the user names first (after a look-up of ``lightning`` that imports nothing), and
    ``lightning``'s own loader is left in place."""
    code = (
        "import sys, lightning_mgpu\n"
        "print('before', 'lightning' in sys.modules, 'lightning_mgpu.lightning' in sys.modules)\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('lightning') is not None  # a look-up, as availability checks make\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "import lightning, importlib.machinery as m\n"
        "print('after', 'mgpu_ddp' in StrategyRegistry, 'mgpu_zero3' in StrategyRegistry)\n"
        "strategy = Trainer(strategy='mgpu_ddp', accelerator='cpu', devices=2, logger=False).strategy\n"
        "print('strategy', type(strategy).__module__)\n"
        "loader = lightning.__spec__.loader\n"
        "print('loader', isinstance(loader, m.SourceFileLoader), lightning.__loader__ is loader)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "before False False" in lines, out.stdout
    assert "after True True" in lines, out.stdout
    assert "strategy lightning_mgpu.lightning.strategies.ddp" in lines, out.stdout
    assert "loader True True" in lines, out.stdout
