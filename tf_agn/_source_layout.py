"""Makes `tf_agn.strategies` importable from a source checkout.

`setup.py` installs the top-level `strategies/` as `tf_agn/strategies`; in
a checkout this registers the top-level folder under that name.
"""

import importlib.util
import os
import sys


def attach_strategies(package_dir):
    """Imports `<checkout>/strategies` as `tf_agn.strategies` if needed."""
    if os.path.isdir(os.path.join(package_dir, "strategies")):
        return  # An installed copy: setup.py put it in place.
    source = os.path.join(os.path.dirname(package_dir), "strategies")
    init = os.path.join(source, "__init__.py")
    if "tf_agn.strategies" in sys.modules or not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location(
        "tf_agn.strategies", init, submodule_search_locations=[source]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["tf_agn.strategies"] = module
    spec.loader.exec_module(module)
