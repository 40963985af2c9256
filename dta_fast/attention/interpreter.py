"""The Triton interpreter (``TRITON_INTERPRET=1``: the kernels on CPU, for tests) and the one fix it needs."""

from __future__ import annotations

import inspect
import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fix_interpreter_loop_bounds() -> None:
    """Let Triton 3.6's interpreter run these kernels under NumPy >= 2.4.

    The interpreter holds a scalar as a 1-element array and takes ``int()`` of
    it for a loop bound read from memory (``range(start, stop)`` below); NumPy
    2.4 refuses ``int()`` of a 1-D array. Later Triton releases squeeze the
    array first; this does the same where the installed interpreter does not.
    """
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return
    if list(inspect.signature(original).parameters) != ["tensor", "scope"]:
        return  # an interpreter this was not written for: leave it alone

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    _fix_interpreter_loop_bounds()
