"""megatron_moe.import_hooks: work after a module loads, and megatron-core's fused functions compiled on first call."""

import inspect
import subprocess
import sys

from megatron_moe.import_hooks import after_import, deferred_compile
from tests.conftest import shell_env


def test_a_hook_runs_once_the_module_has_run_its_code_and_leaves_it_its_own(tmp_path, monkeypatch):
    (tmp_path / "hooked_mod.py").write_text("VALUE = 1\n\ndef f():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("hooked_mod", lambda module: seen.append(module.VALUE) or setattr(module, "VALUE", 2))
    assert seen == []  # not before it is imported
    import hooked_mod

    assert seen == [1] and hooked_mod.f() == 2  # after its code, before the importer reads it
    assert hooked_mod.__file__ == str(tmp_path / "hooked_mod.py")
    assert "return VALUE" in inspect.getsource(hooked_mod.f)  # its own loader still answers for its source
    del sys.modules["hooked_mod"]
    import hooked_mod as again  # the hook ran once: a second import is plain

    assert again.VALUE == 1 and seen == [1]
    del sys.modules["hooked_mod"]


def test_a_hook_on_a_module_already_imported_runs_now():
    seen = []
    after_import("inspect", seen.append)
    assert seen == [inspect]


def test_a_deferred_compile_compiles_on_the_first_call_only_with_the_options_given():
    compiled = []

    def compile_(fn, **options):
        compiled.append(options)
        return lambda *args: ("compiled", fn(*args))

    @deferred_compile(compile_)
    def plain(x):
        return x + 1

    @deferred_compile(compile_)(dynamic=False)
    def with_options(x):
        return x * 2

    assert compiled == [] and plain.__name__ == "plain" and plain.__wrapped__(1) == 2
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3) and compiled == [{}]
    assert with_options(3) == ("compiled", 6) and compiled == [{}, {"dynamic": False}]


# A fresh process: megatron-core imported after megatron_moe loads neither dynamo nor inductor, and its fused
# GELU (decorated with jit_fuser) compiles when first called and gives the eager formula's values.
_FRESH = """
import sys
import megatron_moe
import torch
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.jit import jit_fuser
assert not any(m.startswith(("torch._dynamo", "torch._inductor")) for m in sys.modules), "dynamo at import"
assert getattr(bias_gelu, "deferred_compile", False), bias_gelu
x, b = torch.linspace(-3, 3, 16), torch.full((16,), 0.25)
y = x + b
expected = y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))
torch.testing.assert_close(bias_gelu(b, x), expected)
assert "torch._dynamo" in sys.modules  # compiled at that first call
print("ok")
"""


def test_megatron_core_loads_without_dynamo_and_its_fused_functions_compile_on_first_call():
    out = subprocess.run([sys.executable, "-c", _FRESH], env=shell_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
