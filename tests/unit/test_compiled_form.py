"""The compiled form of the hot pure modules (kvherd/compiled.py) simulates exactly as the plain one.

Each workload runs in two fresh interpreters, one with KVHERD_PURE_PYTHON=1; every per-request
column, the engine step count and the summary must be identical. Without a compiled build
(installed with KVHERD_PURE_PYTHON=1) the comparison skips, or fails under
KVHERD_REQUIRE_COMPILED=1 (CI).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvherd import compiled

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT.parent / "shared" / "traces"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
SYNTHETIC = (
    "synthetic:requests=300,rate=40,input_mean=600,output_mean=60,num_groups=12,"
    "prefix_tokens=256,max_input=4096,seed=3"
)

# Child: one run; prints its form, a hash of every per-request column, the steps and the summary.
CHILD = """
import json, sys, xxhash
import numpy as np
from kvherd import compiled
from simulator.experiment import SimSettings, run_policy
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.synthetic import generate, parse_spec
from simulator.traces import head, load_trace

spec, instances, policy, migration, latency, count = sys.argv[1:]
if spec.startswith("synthetic:"):
    trace = generate(parse_spec(spec))
else:
    trace = head(load_trace(spec), int(count))
model = load_latency_model(latency)
config = InstanceConfig(num_blocks=model.kv_capacity_tokens // 16)
result = run_policy(trace, SimSettings(int(instances), model, config, migration), policy)
columns = {
    name: xxhash.xxh64_hexdigest(
        "\\0".join(col).encode() if col.dtype == object else np.ascontiguousarray(col).tobytes()
    )
    for name, col in result.columns.items()
}
print(json.dumps({
    "form": compiled.FORM,
    "columns": columns,
    "steps": result.num_steps,
    "summary": repr(sorted(result.summary.items())),
}))
"""

WORKLOADS = {
    "azure": (str(AZURE), "4", "kvherd", "none", "roofline:llama-2-7b:a100-80gb", "400"),
    "mooncake": (str(MOONCAKE), "16", "kvherd", "none", "roofline:llama-2-70b:a100-80gb:tp4", "80"),
    "synthetic": (SYNTHETIC, "4", "llumnix", "llumnix", "roofline:llama-2-7b:a100-80gb", "0"),
}


def _fingerprint(args: tuple[str, ...], pure: bool) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_PURE_PYTHON"}
    if pure:
        env["KVHERD_PURE_PYTHON"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _require_compiled() -> None:
    if all(compiled.built(m) is not None for m in compiled.MODULES):
        return
    if os.environ.get("KVHERD_REQUIRE_COMPILED") == "1":
        pytest.fail("no compiled build of kvherd.compiled.MODULES (pip install -e . builds it)")
    pytest.skip("installed without the compiled build (KVHERD_PURE_PYTHON=1 at install time)")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_compiled_and_plain_forms_simulate_identically(workload: str) -> None:
    _require_compiled()
    args = WORKLOADS[workload]
    if not args[0].startswith("synthetic:") and not Path(args[0]).is_file():
        pytest.skip(f"trace not here: {args[0]}")
    native, plain = _fingerprint(args, pure=False), _fingerprint(args, pure=True)
    assert (native["form"], plain["form"]) == ("compiled", "plain")
    assert native["columns"] == plain["columns"]
    assert native["steps"] == plain["steps"]
    assert native["summary"] == plain["summary"]


def test_the_plain_switch_loads_every_compiled_module_from_its_source() -> None:
    _require_compiled()
    names = ",".join(compiled.MODULES)
    code = (
        "import importlib, sys, kvherd.compiled as c\n"
        "mods = [importlib.import_module(m) for m in sys.argv[1].split(',')]\n"
        "print(c.FORM, *sorted({m.__file__.rpartition('.')[2] for m in mods}))"
    )
    forms = {}
    for pure in (False, True):
        env = {k: v for k, v in os.environ.items() if k != "KVHERD_PURE_PYTHON"}
        env.update({"KVHERD_PURE_PYTHON": "1"} if pure else {})
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        run = subprocess.run([sys.executable, "-c", code, names], env=env, capture_output=True)
        forms[pure] = run.stdout.decode().split()
    assert forms[False] == ["compiled", "so"]
    assert forms[True] == ["plain", "py"]


@pytest.mark.parametrize("state", ["whole", "stale", "missing", "none"])
def test_a_partial_or_stale_build_selects_the_plain_form(
    state: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit since the last build (or a module never built) must not run the old compiled code."""
    monkeypatch.delenv("KVHERD_PURE_PYTHON", raising=False)
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for module in compiled.MODULES:
        source = compiled.source(module)
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text("")
        if state != "none":
            ext = source.with_name(source.stem + suffix)
            ext.write_bytes(b"")
            os.utime(source, (1_000, 1_000))
            os.utime(ext, (2_000, 2_000))
    edited = compiled.source(compiled.MODULES[0])
    if state == "stale":
        os.utime(edited, (3_000, 3_000))
    if state == "missing":
        edited.with_name(edited.stem + suffix).unlink()
    if state in ("stale", "missing"):
        with pytest.warns(RuntimeWarning, match=compiled.MODULES[0]):
            reason = compiled._plain_reason()
        expected = "older than its source" if state == "stale" else "missing"
        assert reason is not None and expected in reason
    else:
        assert compiled._plain_reason() == (None if state == "whole" else "not built")
