"""The registry class (ctuq.registry.Registry): lazy provider import, registration rules, lookups and their errors."""

import sys
import textwrap

import pytest

from ctuq.registry import (
    CALIBRATIONS,
    DATA_FORMATS,
    LIKELIHOODS,
    PRIORS,
    RAY_TRANSFORMS,
    SOLVERS,
    Registry,
    RegistryError,
)


class Base:
    pass


def _provider(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A provider module ``name`` on a temporary path, whose import runs ``body``."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_the_first_lookup_imports_the_provider_once(tmp_path, monkeypatch):
    name = _provider(
        tmp_path,
        monkeypatch,
        "ctuq_test_provider_ok",
        """
        import test_registry as t
        IMPORTS = getattr(t, "IMPORTS", 0) + 1
        t.IMPORTS = IMPORTS

        class One(t.Base):
            name = "one"

        class Two(t.Base):
            name = "two"

        t.REG.set_base(t.Base)
        t.REG.register(One)
        t.REG.register(Two)
        """,
    )
    reg = Registry("toy thing", name, reserved=("auto",))
    monkeypatch.setattr(sys.modules[__name__], "REG", reg, raising=False)
    monkeypatch.setattr(sys.modules[__name__], "IMPORTS", 0, raising=False)
    assert "not loaded" in repr(reg) and name not in sys.modules
    assert reg.names() == ("one", "two") and reg.choices() == ("auto", "one", "two")
    assert list(reg) == ["one", "two"] and len(reg) == 2 and "one" in reg and reg["two"].__name__ == "Two"
    reg.names()
    assert sys.modules[__name__].IMPORTS == 1

    class Three(Base):
        name = "three"

    reg.register(Three)  # after the built-ins, which keep their order
    assert reg.names() == ("one", "two", "three")
    with pytest.raises(RegistryError, match="unknown toy thing 'four'; valid: one, two, three") as info:
        reg["four"]
    assert isinstance(info.value, KeyError) and str(info.value).startswith("unknown")
    assert reg.get("four") is None
    reg.unregister("three")
    reg.unregister("three")  # removing what is not there is a no-op
    assert reg.names() == ("one", "two")


def test_registration_rules():
    reg = Registry("toy thing", reserved=("auto",))
    reg.set_base(Base)

    class Good(Base):
        name = "good"

    class Other(Base):
        name = "good"

    class Nameless(Base):
        pass

    class Auto(Base):
        name = "auto"

    assert reg.register(Good) is Good and reg.register(Good) is Good  # the same class again: a no-op
    with pytest.raises(ValueError, match="the name 'good' is taken by 'Good'"):
        reg.register(Other)
    with pytest.raises(ValueError, match="has no name"):
        reg.register(Nameless)
    with pytest.raises(ValueError, match=r"the name 'auto' is reserved \(\['auto'\]\)"):
        reg.register(Auto)
    with pytest.raises(TypeError, match="is not a subclass of Base"):
        reg.register(int, name="int")
    assert reg.register(name="alias")(Other) is Other and reg["alias"] is Other
    assert reg.names() == ("good", "alias")


def test_a_provider_that_fails_to_import_is_retried(tmp_path, monkeypatch):
    name = _provider(
        tmp_path,
        monkeypatch,
        "ctuq_test_provider_broken",
        """
        import test_registry as t

        class Early(t.Base):
            name = "early"

        t.REG.register(Early)
        raise RuntimeError("the provider is broken")
        """,
    )
    reg = Registry("toy thing", name)
    monkeypatch.setattr(sys.modules[__name__], "REG", reg, raising=False)
    for _ in range(2):  # the error each time, not an empty registry that looks loaded
        with pytest.raises(RuntimeError, match="the provider is broken"):
            reg.names()
    assert "not loaded" in repr(reg)
    (tmp_path / f"{name}.py").write_text(
        "import test_registry as t\n\n\nclass Early(t.Base):\n    name = 'early'\n\n\nt.REG.register(Early)\n"
    )
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert reg.names() == ("early",)  # what the failed import registered went with it


def test_the_project_registries_name_their_providers():
    assert (SOLVERS.provider, RAY_TRANSFORMS.provider) == ("ctuq.inference.solvers", "ctuq.operators")
    assert SOLVERS.reserved == ("auto", "exact") and RAY_TRANSFORMS.reserved == ("auto",)
    for reg in (SOLVERS, PRIORS, LIKELIHOODS, CALIBRATIONS, DATA_FORMATS, RAY_TRANSFORMS):
        assert reg.names() and reg.base is not None, reg.kind  # loading sets the base class every entry subclasses
        assert all(issubclass(cls, reg.base) for cls in reg.values()), reg.kind
