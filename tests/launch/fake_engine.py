"""Stand-in for one inference server behind the router (`asyncgrpo_cli.server.router`) in tests.

Run as ``python fake_engine.py --record DIR --port P``: answers ``/health``, ``/metrics`` (one running request
per engine, KV usage 0.1 x its index on the port), ``/v1/completions`` (the port that answered), ``/version``
(the port) and every POST route, appending ``<route> <body length>`` to ``DIR/<port>.log`` so a test sees which
engine got what. ``POST /pause`` answers 500 on port ``--fail-port``; ``POST /reset_prefix_cache`` answers
``{"success": false}`` on port ``--unreset-port``.
"""

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--record", required=True)
    p.add_argument("--fail-port", type=int, default=-1)
    p.add_argument("--unreset-port", type=int, default=-1)
    args = p.parse_args()
    log = os.path.join(args.record, f"{args.port}.log")
    with open(os.path.join(args.record, f"{args.port}.pid"), "w") as fh:
        fh.write(str(os.getpid()))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server API)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._send(200, "")
            elif path == "/metrics":
                self._send(200, "# HELP vllm:num_requests_running r\n# TYPE vllm:num_requests_running gauge\n"
                                'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
                                "# HELP vllm:kv_cache_usage_perc u\n# TYPE vllm:kv_cache_usage_perc gauge\n"
                                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {0.1 * (args.port % 10)}\n',
                           "text/plain")
            else:
                self._send(200, json.dumps({"port": args.port, "path": path}))

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?", 1)[0]
            with open(log, "a") as fh:
                fh.write(f"{path} {len(body)}\n")
            if path == "/pause" and args.port == args.fail_port:
                self._send(500, "engine failed on purpose")
            elif path == "/reset_prefix_cache" and args.port == args.unreset_port:
                self._send(200, json.dumps({"success": False, "port": args.port}))
            else:
                self._send(200, json.dumps({"port": args.port, "path": path, "query": self.path.partition("?")[2]}))

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
