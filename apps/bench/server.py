"""What apps/bench_serve.py and apps/stress_serve.py share: the flags that name a running server, an httpx client
for it with no cap on connections (every request of a storm is in flight at once), and the first request, which
says in one line why a server cannot be used."""
from __future__ import annotations

import argparse

import httpx

from minfer.errors import MinferError


def base_url(text: str) -> str:
    """An argparse type: an http(s) URL with a host."""
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"give http://HOST:PORT, not {text!r}")
    return text


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", type=base_url, default="http://127.0.0.1:8000",
                   help="the server's root, without /v1 (default: %(default)s)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", help="default: the server's first model")


def client(args, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits)


async def first_model(client: httpx.AsyncClient, args) -> dict:
    """The first entry of the server's /v1/models; a MinferError that says what to fix when there is none."""
    url = args.base_url.rstrip("/")
    try:
        r = await client.get("/v1/models")
    except httpx.TimeoutException:
        raise MinferError(f"cannot reach {url}: no answer within {client.timeout.read} s (--timeout)") from None
    except httpx.TransportError as e:
        raise MinferError(f"cannot reach {url}: {str(e) or type(e).__name__}") from None
    if r.status_code == 401:
        raise MinferError(f"{url}/v1/models: 401 unauthorized: "
                          + ("check --api-key" if args.api_key else "the server wants a key; pass --api-key"))
    if r.status_code == 404 and url.endswith("/v1"):
        raise MinferError(f"{url}/v1/models: 404; drop /v1 from --base-url (the paths under /v1 are added)")
    text = " ".join(r.text[:200].split())
    if r.status_code != 200:
        raise MinferError(f"{url}/v1/models: {r.status_code} {text}")
    try:
        return r.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise MinferError(f"{url}/v1/models: not an OpenAI model list: {text}") from None
