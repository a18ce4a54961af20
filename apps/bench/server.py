"""What apps/bench_serve.py and apps/stress_serve.py share: the flags that name a running server, and an
httpx client for it with no cap on connections (every request of a storm is in flight at once)."""
from __future__ import annotations

import argparse

import httpx


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", help="default: the server's first model")


def client(args, timeout: float | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits)
