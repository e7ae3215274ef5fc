"""User code by import path (`package.module:name` or `path/to/file.py:name`): resolved, checked, cached per process."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import traceback
from collections.abc import Callable
from pathlib import Path


class PluginError(ValueError):
    """An import path that does not give a usable callable; the message is one line naming the config key."""


_CACHE: dict[str, Callable] = {}


def split_spec(spec: str, key: str) -> tuple[str, str]:
    """(module or file, attribute) of `spec`, or one line saying what the form must be."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise PluginError(
            f"{key}={spec!r} must be 'package.module:function' or 'path/to/file.py:function' (a name after the colon)"
        )
    return where, name


def is_import_path(spec: str) -> bool:
    """A setting that names user code (`where:name`), not a built-in by its bare name."""
    return ":" in spec


def is_file_spec(spec: str) -> bool:
    return spec.rpartition(":")[0].endswith(".py")


def absolute_spec(spec: str, base: Path | None = None) -> str:
    """The spec with a relative file path made absolute (against `base`, else the working directory), so every
    rank and worker process finds the same file whatever directory it starts in."""
    if not is_file_spec(spec):
        return spec
    where, name = spec.rsplit(":", 1)
    path = Path(where).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return f"{path.resolve()}:{name}"


def _module_from_file(path: Path, key: str, spec: str):
    if not path.is_file():
        raise PluginError(f"{key}={spec!r}: file {str(path)!r} does not exist")
    # one module per file, under a name no package uses, registered so pickle and dataclasses find it
    name = f"areal_hpc_user.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        raise PluginError(f"{key}={spec!r}: importing {str(path)!r} failed: {type(e).__name__}: {e}") from None
    return module


def resolve(spec: str, key: str) -> Callable:
    """The callable `spec` names (imported once per process)."""
    if spec in _CACHE:
        return _CACHE[spec]
    where, name = split_spec(spec, key)
    if is_file_spec(spec):
        module = _module_from_file(Path(where), key, spec)
    else:
        try:
            module = importlib.import_module(where)
        except BaseException as e:  # a SyntaxError or an exception at import time counts as a failed import too
            raise PluginError(f"{key}={spec!r}: cannot import {where!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise PluginError(f"{key}={spec!r}: {where!r} has no attribute {name!r}")
    if not callable(fn):
        raise PluginError(f"{key}={spec!r}: {name!r} is a {type(fn).__name__}, not a function")
    _CACHE[spec] = fn
    return fn


def check_signature(
    fn: Callable, spec: str, key: str, args: tuple[str, ...], is_async: bool, keywords: tuple[str, ...] = ()
) -> None:
    """One line if `fn` cannot be called with the positional arguments `args` (names, for the message) and the
    keyword arguments `keywords`, or is (or is not) a coroutine function when `is_async` says otherwise."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        sig.bind(*args, **dict.fromkeys(keywords))
    except TypeError:
        call = ", ".join([*args, *(f"{k}=..." for k in keywords)])
        raise PluginError(
            f"{key}={spec!r}: {getattr(fn, '__name__', spec)}{sig} cannot be called as f({call})"
        ) from None
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else fn.__call__
    if inspect.iscoroutinefunction(target) != is_async:
        want = "an 'async def' function" if is_async else "a plain function, not 'async def'"
        raise PluginError(f"{key}={spec!r}: must be {want}")


_NOT_USERS = tuple(
    str(Path(p).resolve()) + "/"
    for p in {*filter(None, (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")))}
) + (str(Path(__file__).resolve().parent) + "/",)


def user_frame(err: BaseException) -> str:
    """Where user code raised `err`: "path/to/file.py:LINE" of the innermost frame outside this package, the
    standard library and installed packages (the user's file, not the library call that failed inside it); the
    innermost frame of all when none is the user's; "" without a traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_USERS)]
    f = (mine or frames)[-1]
    path = Path(f.filename)
    try:  # relative to where the run started, when it is below it: what the user typed in the config
        path = path.resolve().relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{path}:{f.lineno}"
