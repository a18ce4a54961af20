"""The benchmark apps' input handling: a bad flag is one line naming it and exit 1, checked before any model load or
GPU work (subprocesses of apps/*.py, no model loaded); the shared workload helpers directly."""
import json
import os
import random
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from test_cli import assert_one_line_error, env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(ROOT, "apps"))
from bench.workload import length_range, lengths, make_requests  # noqa: E402

from minfer.errors import MinferError  # noqa: E402


def app(name, *args, timeout=60):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "apps", f"{name}.py"), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env())
    return p.returncode, p.stdout, p.stderr


def assert_app_error(name, args, *needles):
    rc, out, err = app(name, *args)
    assert rc == 1, err
    assert_one_line_error(rc, out, err, *needles)


CPU = ["--backend", "ref", "--device", "cpu"]


@pytest.mark.parametrize("args, needles", [
    (["--num-requests", "0"], ["--num-requests", "[1, 1000000]"]),
    (["--num-requests", "100000000"], ["--num-requests", "1000000"]),  # a bound, not a MemoryError
    (["--input-len", "a:b"], ["--input-len", "'a:b'"]),
    (["--shared-prefix", "-5"], ["--shared-prefix", ">= 0"]),
    (["--ttft", "--beside", "2", "--max-num-seqs", "2"], ["--beside 2", "--max-num-seqs >= 3"]),
    (["--long-prompt-len", "64", "--num-requests", "2", "--max-num-seqs", "2"],
     ["--long-prompt-len", "--max-num-seqs >= 3"]),
    (["--decode-batch", "3", "--input-len", "8", "--max-num-seqs", "2"], ["--decode-batch 3", "--max-num-seqs 2"]),
    (["--decode-batch", "2", "--input-len", "0"], ["--input-len", "'0'"]),
    (["--json", "/nonexistent/dir/t.jsonl"], ["--json /nonexistent/dir/t.jsonl"]),  # before the load, not after the run
    (["--regex", "a", "--static"], ["--regex", "not --static"]),
    (["--json-schema", "{}", "--decode-batch", "2", "--input-len", "8"], ["--json-schema", "not --static"]),
    (["--json-schema", "{nope"], ["--json-schema is not JSON"]),
    (["--regex", "a(b"], ["--regex: ", "unclosed group"]),  # from the constraint's check, before the timed run
    (["--json-schema", "{}", "--regex", "a"], ["--regex", "not allowed with argument --json-schema"]),
])
def test_bench_throughput_bad_flags(args, needles):
    assert_app_error("bench_throughput", CPU + args, *needles)


@pytest.mark.parametrize("name, args, needles", [
    ("bench_e2e", ["--batch", "a"], ["--batch", "'a'"]),
    ("bench_e2e", ["--shape", "smollm2-135m", "--prompt-len", "9000", "--gen-len", "2"],
     ["--prompt-len 9000", "8192"]),
    ("benchmark", ["--kernel", "rmsnorm", "--path", "nope"], ["--path nope", "rmsnorm"]),
    ("benchmark", ["--kernel", "all", "--path", "nope"], ["--kernel all", "--path nope"]),
    ("benchmark", ["--kernel", "rmsnorm", "--shape", "5,6,7"], ["--shape 5,6,7", "2 numbers"]),
    ("benchmark", ["--kernel", "rmsnorm", "--min-calls", "0"], ["--min-calls", ">= 1"]),
    ("profile", ["--kernel", "rmsnorm", "--iters", "-1"], ["--iters", ">= 1"]),
    ("bench_load", ["--device", "foo"], ["--device 'foo'", "cpu, cuda or cuda:N"]),
])
def test_gpu_apps_check_flags_first(name, args, needles):
    """Checked before the GPU refusal (and before any model is made), so the same on any machine."""
    assert_app_error(name, args, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
@pytest.mark.parametrize("name, args", [("bench_e2e", []), ("benchmark", ["--kernel", "rmsnorm"]),
                                        ("profile", ["--kernel", "rmsnorm"])])
def test_gpu_apps_refuse_without_gpu(name, args):
    assert_app_error(name, args, f"{name} needs a CUDA GPU")


@pytest.mark.parametrize("name, args, needles", [
    ("bench_serve", ["--num-requests", "0"], ["--num-requests"]),
    ("bench_serve", ["--request-rate", "1e-300"], ["--request-rate 1e-300", "a day"]),
    ("bench_serve", ["--request-rate", "-inf"], ["--request-rate must be > 0"]),
    ("bench_serve", ["--max-concurrency", "0"], ["--max-concurrency", ">= 1"]),
    ("bench_serve", ["--base-url", "notaurl"], ["--base-url", "'notaurl'"]),
    ("stress_serve", ["--timeout", "nan"], ["--timeout", "> 0"]),
    ("stress_serve", ["--probe-copies", "-1"], ["--probe-copies", ">= 0"]),
])
def test_serve_apps_bad_flags(name, args, needles):
    assert_app_error(name, args, *needles)


class FakeServer(BaseHTTPRequestHandler):
    """/v1/models of a 256-token server behind an API key; 404 elsewhere."""

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.end_headers()
        elif self.path == "/v1/models":
            body = json.dumps({"data": [{"id": "m", "max_model_len": 256, "vocab_size": 100}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_serve_apps_say_why_the_server_cannot_be_used(fake_url):
    assert_app_error("bench_serve", ["--base-url", fake_url], "401", "pass --api-key")
    assert_app_error("bench_serve", ["--base-url", fake_url + "/v1", "--api-key", "k"], "drop /v1 from --base-url")
    # stress_serve: --max-tokens past the server's context is an error, not a silent cut to it
    assert_app_error("stress_serve", ["--base-url", fake_url, "--api-key", "k", "--max-tokens", "5000"],
                     "--max-tokens 5000", "256")
    with socket.socket() as s:  # a port with no server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert_app_error("bench_serve", ["--base-url", f"http://127.0.0.1:{port}"], f"cannot reach http://127.0.0.1:{port}")


def test_bench_serve_gives_up_on_a_silent_server():
    """A server that accepts the connection and never answers: --timeout, not a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes the handshakes; nothing ever reads or answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert_app_error("bench_serve", ["--base-url", url, "--timeout", "0.5"], f"cannot reach {url}", "0.5 s")


def test_lengths():
    assert length_range("8") == (8, 8) and length_range("2:5") == (2, 5)
    for bad in ("a:b", ":8", "8:", "1:2:3", "0", "5:2", ""):
        assert length_range(bad) is None, bad
    with pytest.raises(MinferError, match="--output-len '1:2:3'"):
        lengths("1:2:3", 2, random.Random(0), "--output-len")


def test_make_requests_draws_only_the_prefix_it_uses():
    """A shared prefix longer than every prompt draws only the ids the prompts hold (a billion would fill memory),
    and the requests are those of the longest prompt's prefix."""
    huge = make_requests(3, "4:8", "2", 100, seed=1, shared_prefix=10**12)
    assert huge == make_requests(3, "4:8", "2", 100, seed=1, shared_prefix=8)
    longest = max((ids for ids, _ in huge), key=len)
    assert all(ids == longest[:len(ids)] for ids, _ in huge)  # every prompt is the prefix
