"""The chaos suite: faults injected into real fleets (agents killed or hung, migrations cut at each
stage, floods, fuzzed bodies, forged tokens). Its tests start fleets with the integration suite's
helpers (``tests/integration/test_proxy.py``: `agents`, `running_proxy`), on the path here so that
``python -m pytest tests/chaos`` runs on its own; ``tests/support`` is on it from tests/conftest.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
