"""The examples in hvd_topk's docstrings run, as written, in one process (world size 1).

Examples that need a multi-rank job, root or a user's script are plain text (``::`` blocks), not
``>>>`` prompts, so every prompt in the package is executed here.
"""
import doctest
import importlib
import pkgutil

import pytest

import hvd_topk

MODULES = sorted(m.name for m in pkgutil.walk_packages(hvd_topk.__path__, "hvd_topk."))


def test_every_module_is_listed():
    assert "hvd_topk.compression" in MODULES and "hvd_topk.transports.split_reduce" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(hvd, name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed"
