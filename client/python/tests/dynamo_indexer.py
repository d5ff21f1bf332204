"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1, `python -m dynamo.indexer`) as a
child process of a test, subscribed to kvcellard nodes' KV event and replay endpoints.

The indexer runs from the repository's .venv-dynamo (client/python/requirements-dynamo.txt; ctest
passes its Python as KVCELLAR_DYNAMO_PYTHON), whatever venv the test itself runs in. It needs no
etcd or NATS: `POST /register {"instance_id", "endpoint", "replay_endpoint", "model_name",
"block_size"}` names a node's ZMQ PUB endpoint, which it subscribes to, and its replay endpoint,
which it asks for the batches it missed (a gap in sequence numbers); it recomputes each block's hash from the event's token_ids (so it indexes only
events that carry them) and answers `POST /query {"token_ids": [...], "model_name": ...}` with,
per worker, the tokens of the longest prefix it holds, in total and per storage tier (`gpu`,
`cpu`, `disk`, each counting that tier and the faster ones). Observed with 1.6.1: medium "CPU"
is its host_pinned tier, "STORAGE" its disk tier, and an L3 page of another medium name is not
counted as disk.
"""
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvcellard_process import end_process

ROOT = Path(__file__).resolve().parents[3]


def dynamo_python():
    """The Python of .venv-dynamo; a failure under ctest (KVCELLAR_REQUIRE_ENGINES=1) when it is
    missing, else a skip."""
    py = os.environ.get("KVCELLAR_DYNAMO_PYTHON", str(ROOT / ".venv-dynamo" / "bin" / "python"))
    if not os.access(py, os.X_OK):
        msg = (f"{py} missing: deploy/install-deps.sh venvs makes .venv-dynamo "
               "(client/python/requirements-dynamo.txt)")
        if os.environ.get("KVCELLAR_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DynamoIndexer:
    """One indexer process for `workers` ({worker id: (ZMQ PUB endpoint, replay endpoint)}) of
    one model."""

    def __init__(self, workers, block_size, model, log_path):
        self.model = model
        self.port = free_port()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [dynamo_python(), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"dynamo.indexer exited: {Path(log_path).read_text()}"
            try:
                self._get("/health")
                break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "dynamo.indexer not up in 60 s"
            time.sleep(0.1)
        for worker, (endpoint, replay) in workers.items():
            self._post("/register", {"instance_id": worker, "endpoint": endpoint,
                                     "replay_endpoint": replay, "model_name": model,
                                     "block_size": block_size})
        # Ready once every worker's ZMQ listener is active; then the subscription still has to
        # reach each PUB socket (ZMQ's slow joiner): what is sent before that it gets by replay,
        # at the first gap it sees.
        while True:
            listed = self._get("/workers")
            states = [ls.get("status") for w in listed for ls in w.get("listeners", {}).values()]
            if len(states) == len(workers) and all(s == "active" for s in states):
                break
            assert time.monotonic() < deadline, f"dynamo.indexer listeners: {listed}"
            time.sleep(0.1)
        time.sleep(0.5)

    def _post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read() or b"null")

    def _get(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return json.loads(r.read() or b"null")

    def query(self, tokens):
        """{worker id: {"longest_matched", "gpu", "cpu", "disk"} in tokens} for a prompt."""
        out = self._post("/query", {"token_ids": [int(t) for t in tokens], "model_name": self.model})
        return {int(w): v for w, v in out.get("instances", {}).items()}

    def blocks(self, worker, tokens, block_size, tier="longest_matched"):
        """Leading blocks of `tokens` the worker holds (in `tier` or faster), per the indexer."""
        return self.query(tokens).get(worker, {}).get(tier, 0) // block_size

    def wait_blocks(self, worker, tokens, block_size, want, tier="longest_matched", timeout=5.0):
        """Seconds until the indexer's answer is `want` blocks (fails after `timeout`)."""
        t0 = time.monotonic()
        while True:
            got = self.blocks(worker, tokens, block_size, tier)
            if got == want:
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout, \
                f"worker {worker}: the indexer says {got} blocks ({tier}), not {want}"
            time.sleep(0.01)

    def close(self):
        end_process(self.proc)
        self.log.close()
