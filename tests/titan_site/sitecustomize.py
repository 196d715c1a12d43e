"""Applies the CPU-only torchtitan shims (``tests/titan_shims.py``) in a process whose environment has
``PHOENIX_TITAN_CPU_SHIMS=1`` (the torchtitan tests put this folder on PYTHONPATH): when
``torchtitan.tools.utils`` is imported, then when ``torchtitan.trainer`` is. Nothing is imported before."""

import os
import sys

if os.environ.get("PHOENIX_TITAN_CPU_SHIMS") == "1":
    import importlib.abc
    import importlib.util

    class _AfterImport(importlib.abc.MetaPathFinder):
        hooks = {"torchtitan.tools.utils": "patch_utils", "torchtitan.trainer": "patch_rest"}

        def find_spec(self, name, path, target=None):
            if name not in self.hooks:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None:
                return None
            run, hook = spec.loader.exec_module, self.hooks[name]

            def exec_module(module):
                run(module)
                import titan_shims

                fn = getattr(titan_shims, hook)
                fn(module) if hook == "patch_utils" else fn()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())
