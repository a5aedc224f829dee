"""A package's public names stay what they are after its submodules are imported.

Importing ``hpdl.sr.X`` sets the attribute ``X`` on the package to the submodule; a public name
equal to a submodule's name would then become the module (``from hpdl.sr import evaluate``
gave a module once any test or job had imported ``hpdl.sr.evaluate``)."""

import importlib
import pkgutil
import types

import pytest

# Public names that are modules on purpose (Horovod's ``hvd.elastic``).
MODULES_BY_DESIGN = {"hpdl.torch": {"elastic"}}


@pytest.mark.parametrize("package", ["hpdl.sr", "hpdl.torch", "hpdl.spark", "hpdl.torch.spatial"])
def test_public_names_are_not_replaced_by_submodules(package):
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{info.name}")
    modules = {name for name in pkg.__all__ if isinstance(getattr(pkg, name), types.ModuleType)}
    assert modules == MODULES_BY_DESIGN.get(package, set())
