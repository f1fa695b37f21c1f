"""An S3 endpoint that ignores conditional writes, as some S3-compatible stores do: a reverse
proxy (aiohttp) in front of a real S3 server that drops ``If-None-Match`` and ``If-Match`` from
every request, so a create of an existing key overwrites it. Commits on such a store could be
lost; deltaflow must refuse it (the refusal test starts it with :class:`.UnconditionalS3`).

The headers are covered by the request's signature, so the proxy signs each request again
(botocore's SigV4) with the credentials in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``.

Run: ``python -m deltaflow.testing.unconditional --upstream http://127.0.0.1:7070 --port P``.
"""

from __future__ import annotations

import argparse
from typing import Final

from aiohttp import ClientSession, web

__all__ = ["main"]

#: The request headers that make a write conditional: dropped.
CONDITIONS: Final = frozenset({"if-none-match", "if-match"})
#: Hop-by-hop headers the proxy's own client and server set.
_HOP: Final = frozenset({"content-length", "transfer-encoding", "connection"})


def app(upstream: str) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        session: ClientSession = request.app["session"]
        body = await request.read()
        url = upstream + request.rel_url.raw_path_qs
        dropped = CONDITIONS | _HOP | {"authorization", "x-amz-date", "host"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in dropped}
        async with session.request(
            request.method,
            url,
            headers=_signed(request.method, url, headers, body),
            data=body,
            allow_redirects=False,
            auto_decompress=False,
        ) as answer:
            answer_body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in _HOP}
            return web.Response(status=answer.status, headers=kept, body=answer_body)

    async def session(application: web.Application):  # type: ignore[no-untyped-def]
        application["session"] = ClientSession(skip_auto_headers=["User-Agent"])
        yield
        await application["session"].close()

    application = web.Application(client_max_size=1 << 30)
    application.cleanup_ctx.append(session)
    application.router.add_route("*", "/{tail:.*}", forward)
    return application


def _signed(method: str, url: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
    """``headers`` with a fresh SigV4 signature for the upstream request."""
    import os

    from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
    from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
    from botocore.credentials import Credentials  # type: ignore[import-untyped]

    credentials = Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    region = os.environ.get("AWS_REGION", "us-east-1")
    signing = AWSRequest(method=method, url=url, data=body, headers=headers)
    S3SigV4Auth(credentials, "s3", region).add_auth(signing)
    return dict(signing.headers.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
