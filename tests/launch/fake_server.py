"""Stand-in for the sampler server in supervisor tests: answers the routes `asyncgrpo doctor` reads.

Run as ``python fake_server.py --fake-mode MODE --fake-pid-file PATH <the builder's argv...>``; it takes
``--host``, ``--port``, ``--model``, ``--max-model-len``, ``--max-logprobs`` and ``--dtype`` from the real
command line so the test also checks that the builder's argv reaches the child. Modes:
ok (healthy), never_ready (``/health`` answers 503 forever), die (exits 3 at once), bad_logprobs
(reports ``raw_logprobs``: the doctor must fail).
"""

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fake-mode", default="ok")
    p.add_argument("--fake-pid-file", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-logprobs", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    args, _ = p.parse_known_args(sys.argv[1:])
    if args.fake_pid_file:
        with open(args.fake_pid_file, "w") as fh:
            fh.write(str(os.getpid()))
    print(f"fake server: mode {args.fake_mode} on port {args.port}", flush=True)
    if args.fake_mode == "die":
        print("fake server: CUDA out of memory (pretend)", flush=True)
        sys.exit(3)

    model_info = {"object": "list", "data": [{"id": args.model, "root": args.model,
                                              "max_model_len": args.max_model_len}]}
    server_info = {"vllm_config": {  # vLLM's /server_info?config_format=json shape
        "model_config": {"logprobs_mode": "raw_logprobs" if args.fake_mode == "bad_logprobs" else "processed_logprobs",
                         "max_logprobs": args.max_logprobs, "dtype": args.dtype, "max_model_len": args.max_model_len},
        "weight_transfer_config": {"backend": "nccl"}}, "vllm_env": {}, "system_env": {}}
    routes = {"/version": {"version": "0.1.0", "server": "asyncgrpo-embedded"}, "/v1/models": model_info,
              "/server_info": server_info}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                code = 503 if args.fake_mode == "never_ready" else 200
                self._send(code, b"", "text/plain")
            elif path == "/metrics":
                self._send(200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                                b"vllm:kv_cache_usage_perc 0.1\n", "text/plain")
            elif path in routes:
                self._send(200, json.dumps(routes[path]).encode(), "application/json")
            else:
                self._send(404, b"{}", "application/json")

        def _send(self, code, body, ctype):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True
    print("fake server: listening", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    time.sleep(0)


if __name__ == "__main__":
    main()
