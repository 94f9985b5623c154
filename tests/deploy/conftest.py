"""Make the repository root importable when `router` is not installed as a package yet
(kvroute/router/__init__.py comes with the router branch; until then router/ is a namespace
package that the editable install does not map)."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("router") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
