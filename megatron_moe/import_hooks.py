"""Work done right after a module is imported, and megatron-core's `jit_fuser` compiled on first call.

`after_import(name, fn)`: `fn(module)` once module `name` has run its code (now, if it has been imported). A finder
on `sys.meta_path` wraps that one module's loader; the module's source, file and tracebacks stay its own.

`deferred_compile`: megatron.core.jit sets `jit_fuser = torch.compile` as it loads, and ~40 of megatron-core's
functions are decorated with it while megatron-core imports. torch.compile imports dynamo and inductor: 3.5 s of
the 9 s each rank took to import megatron-core on the CI machine, though a CPU run seldom calls a fused function.
The stand-in takes the same arguments and compiles on a function's first call, when torch.compile's own wrapper
would first trace it: the same compiled code runs. The package's `__init__` installs it before megatron-core can
load; its probe is the Patch `deferred_jit_fuser` (platform/upstream_fixes.py).

Standard library only: `import megatron_moe` (the flag pass, `--help`) must not import torch.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable

JIT_MODULE = "megatron.core.jit"


class _Then(importlib.abc.Loader):
    """A module's own loader, then the hooks on the module it made."""

    def __init__(self, loader, hooks: list[Callable]):
        self._loader, self._hooks = loader, hooks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the module's own loader answers
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.hooks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:  # the finder that would have found it, without us
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Then(spec.loader, self.hooks.pop(fullname))
                return spec
        return None


_FINDER = _AfterImportFinder()


def after_import(name: str, fn: Callable) -> None:
    """Call `fn(module)` when module `name` has been imported: now if it has."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.hooks.setdefault(name, []).append(fn)


def deferred_compile(compile_: Callable) -> Callable:
    """`compile_` (torch.compile) as a decorator that compiles a function on its first call."""

    def decorator(fn=None, **options):
        if fn is None:  # @jit_fuser(...) with options
            return lambda f: decorator(f, **options)
        compiled = None

        @functools.wraps(fn)
        def compiled_on_first_call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_(fn, **options)
            return compiled(*args, **kwargs)

        compiled_on_first_call.deferred_compile = True
        return compiled_on_first_call

    return decorator


def _defer_jit_fuser(jit) -> None:
    import torch  # megatron.core.jit has imported it

    if jit.jit_fuser is torch.compile:  # else megatron-core chose another fuser (or none): left as it is
        jit.jit_fuser = deferred_compile(torch.compile)


def defer_megatron_core_compiles() -> None:
    """megatron-core's `jit_fuser`, from the first import of megatron.core on, compiles on first call. Where
    megatron-core was imported before (its functions decorated already), nothing changes."""
    if JIT_MODULE not in sys.modules:
        after_import(JIT_MODULE, _defer_jit_fuser)
