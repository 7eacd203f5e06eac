"""Every error rayrb raises on purpose is a ``RayrbError`` (``rayrb/errors.py``) that also subclasses the builtin
it stands for. Read from the source: a builtin exception raised, or built to be raised later, anywhere in
``rayrb/`` fails here unless ``ALLOWED`` lists it with its reason. No Ray, no torch."""
from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pytest

from rayrb import errors

PACKAGE = Path(__file__).resolve().parents[1] / "rayrb"

# (module, builtin): why rayrb raises that builtin itself there. Keep it short: anything else takes a class of
# rayrb/errors.py (a new one only for a kind of error none of them stands for).
ALLOWED = {
    # a module's __getattr__: the import system's protocol (hasattr, from-import) is AttributeError itself
    ("rayrb", "AttributeError"): "module __getattr__",
    ("rayrb.integrations.rllib", "AttributeError"): "module __getattr__",
    # a wrapper's __getattr__ while unpickling (before its wrapped object is back): the attribute protocol itself
    ("rayrb.integrations.rllib.offline", "AttributeError"): "a wrapper's __getattr__",
    # abstract methods, which subclasses override: never raised to a user of rayrb
    ("rayrb.actors.shards", "NotImplementedError"): "abstract Shard methods",
    ("rayrb.core.sampler_base", "NotImplementedError"): "abstract Sampler method",
    ("rayrb.core.schedules", "NotImplementedError"): "abstract Schedule method",
    ("rayrb.durability.mirror", "NotImplementedError"): "abstract Mirror methods",
    ("rayrb.handle.local", "NotImplementedError"): "abstract Reader method",
    # the iterator protocol: the end of a stream, not an error
    ("rayrb.handle.sampling", "StopIteration"): "iterator protocol",
    # a pwrite that wrote nothing: the OS's failure, handled as every other OSError of a write is
    ("rayrb.io.files", "OSError"): "a write the OS did not make",
    # a call the GCS failed: handled by the coordinator as every OSError of a save or journal line
    ("rayrb.durability.mirror", "OSError"): "a copy the GCS did not keep",
    # a loader module that cannot be imported: the ImportError it is (raised from the one caught), with the
    # loader's name and what to install
    ("rayrb.io.datasets.registry", "ImportError"): "a dataset loader that cannot be imported",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_builtin_error(name: str) -> bool:
    found = getattr(builtins, name, None)
    return isinstance(found, type) and issubclass(found, BaseException)


def names(node: ast.AST) -> list[str]:
    """The plain names an exception expression may be: ``E``, ``E(...)``, ``(A if c else B)(...)``."""
    if isinstance(node, ast.Call):
        return names(node.func)
    if isinstance(node, ast.IfExp):
        return names(node.body) + names(node.orelse)
    return [node.id] if isinstance(node, ast.Name) else []


def builtin_errors(source: str) -> list[tuple[int, str]]:
    """``(line, builtin)`` for each builtin exception raised (``raise E``, ``raise E(...)``) or built
    (``E(...)``, to raise later) in ``source``. Re-raises (``raise``, ``raise e``, ``raise e.cause``) name no class."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            found |= {(node.lineno, n) for n in names(node.exc) if is_builtin_error(n)}
        elif isinstance(node, ast.Call):
            found |= {(node.lineno, n) for n in names(node.func) if is_builtin_error(n)}
    return sorted(found)


def package_builtin_errors() -> list[tuple[str, int, str]]:
    return [(module_name(p), line, name) for p in sorted(PACKAGE.rglob("*.py"))
            for line, name in builtin_errors(p.read_text())]


def test_rayrb_raises_its_own_errors():
    bare = [f"{m}:{line}: {name}" for m, line, name in package_builtin_errors() if (m, name) not in ALLOWED]
    assert bare == [], ("builtin exceptions raised in rayrb/ (use a class of rayrb/errors.py, or list it in "
                        "ALLOWED with its reason):\n" + "\n".join(bare))


def test_every_allowed_builtin_is_still_raised():
    used = {(m, name) for m, _, name in package_builtin_errors()}
    assert sorted(set(ALLOWED) - used) == []


@pytest.mark.parametrize("source, expected", [
    ('raise ValueError("x")', [(1, "ValueError")]),
    ("raise NotImplementedError", [(1, "NotImplementedError")]),
    ('raise (TypeError if a else ValueError)("x")', [(1, "TypeError"), (1, "ValueError")]),
    ('bad = KeyError("x")\nraise bad', [(1, "KeyError")]),
    ('raise RuntimeError("x") from e', [(1, "RuntimeError")]),
    ("raise\nraise e\nraise e.cause from None", []),
    ('raise SchemaError("x")\nraise errors.ChunkError("x")', []),
    ("try:\n    pass\nexcept ValueError:\n    pass\nisinstance(e, TypeError)", []),
])
def test_the_check_finds_builtin_errors(source, expected):
    assert builtin_errors(source) == expected


def classes() -> list[type]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]


@pytest.mark.parametrize("cls", classes(), ids=lambda c: c.__name__)
def test_each_error_says_when_it_is_raised_and_which_builtin_it_stands_for(cls):
    assert issubclass(cls, errors.RayrbError) and cls.__doc__
    builtin = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
    # HeldBack is returned, not raised, across the actor boundary: it stands for no builtin
    assert builtin or cls in (errors.RayrbError, errors.HeldBack), f"{cls.__name__} subclasses no builtin error"


def test_a_rayrb_error_is_caught_as_its_builtin():
    with pytest.raises(ValueError, match="x"):
        raise errors.InvalidArgumentError("x")
    with pytest.raises(KeyError):
        raise errors.MissingKeyError("x")
    assert issubclass(errors.DirectoryNotEmptyError, FileExistsError)
    assert issubclass(errors.CallTimeoutError, TimeoutError) and issubclass(errors.RowIndexError, IndexError)
