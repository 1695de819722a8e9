"""The public API (``rlctl.__all__``) exports every error a plugin can raise or catch, as the same objects."""

from __future__ import annotations

import inspect

import rlctl
from rlctl.contracts import errors


def test_every_exported_error_is_exported_by_rlctl_too():
    missing = [name for name in errors.__all__ if name not in rlctl.__all__]
    assert missing == [], f"rlctl.__all__ lacks {missing}: add them to rlctl/__init__.py"
    for name in errors.__all__:
        assert getattr(rlctl, name) is getattr(errors, name)


def test_every_error_class_is_in_the_errors_module_all():
    defined = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.RlctlError) and obj.__module__ == errors.__name__}
    assert defined == set(errors.__all__)


def test_every_name_in_all_resolves():
    for name in rlctl.__all__:
        assert hasattr(rlctl, name), name
