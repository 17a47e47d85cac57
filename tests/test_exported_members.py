"""``asyncflat.__all__`` names exactly the package's public members, and each one resolves."""

import types

import asyncflat


def test_all_names_resolve() -> None:
    for name in asyncflat.__all__:
        assert getattr(asyncflat, name) is not None, name


def test_all_is_complete() -> None:
    # Every public attribute of the package is exported, except its submodules (imported as a
    # side effect of importing the package) and typing helpers.
    public = {
        name
        for name in dir(asyncflat)
        if not name.startswith("_")
        and not isinstance(getattr(asyncflat, name), types.ModuleType)
        and name not in {"TYPE_CHECKING", "Any"}
    }
    assert public == set(asyncflat.__all__) - {"__version__"}


def test_all_has_no_duplicates() -> None:
    assert len(set(asyncflat.__all__)) == len(asyncflat.__all__)
