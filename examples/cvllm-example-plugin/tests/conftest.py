import sys
from importlib.util import find_spec
from pathlib import Path

# Normally the package is installed (`pip install -e .`) before its tests run; when it is not,
# import it from the source tree so the tests still run (they register the plugin by hand).
if find_spec("cvllm_example") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
