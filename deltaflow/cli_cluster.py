"""The ``deltaflow`` subcommands that talk to running nodes: ``cluster status`` and ``node
drain``, with the client's credentials (``--token-file``, ``--tls-ca``, ``--tls-cert``,
``--tls-key``) and, to drain, the operator's (``--peer-token-file``, or a certificate with the
peer role)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import ssl
import sys
import time
from typing import TYPE_CHECKING, Any

from .cli_output import print_json
from .errors import ConnectionLostError, NodeUnavailableError
from .security import ClientTls, read_secret

if TYPE_CHECKING:
    from .server.peers import PeerClient

__all__ = ["add_cluster_commands", "peer_token_of", "token_of"]


def token_of(args: argparse.Namespace) -> str | None:
    """The token in ``--token-file``, stripped of surrounding whitespace (None: no file).

    Raises:
        UsageError: the file cannot be read or is empty.
    """
    return read_secret(args.token_file, "--token-file") if args.token_file else None


def peer_token_of(args: argparse.Namespace) -> str | None:
    """The peer token in ``--peer-token-file`` (None: no file), checked like the token."""
    path = args.peer_token_file
    return read_secret(path, "--peer-token-file") if path else None


def add_cluster_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser("cluster", help="inspect a cluster")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    status = csub.add_parser("status", help="members, liveness and the partition map")
    status.add_argument("--node", required=True, help="any node, host:port")
    status.add_argument(
        "--json",
        action="store_true",
        help="print the state as one JSON document (members, map, tables and their committers)",
    )
    _add_client_credentials(status)
    status.set_defaults(func=_cluster_status)

    node = sub.add_parser("node", help="act on one node")
    nsub = node.add_subparsers(dest="node_command", required=True)
    drain = nsub.add_parser(
        "drain",
        help="hand the node's partitions to its peers at once, finish its batches, stop it",
    )
    drain.add_argument("--node", required=True, help="the node, host:port")
    drain.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop")
    drain.add_argument(
        "--json",
        action="store_true",
        help='print {"node", "stopped", "seconds", "partitions"} as JSON (messages on stderr)',
    )
    _add_client_credentials(drain)
    drain.set_defaults(func=_node_drain)


def _client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The client side of ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` (None: plain text)."""
    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    return ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)


def _add_client_credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", help="file holding the client token")
    parser.add_argument(
        "--peer-token-file",
        help="file holding the peer token (operators: needed to drain a node that has one)",
    )
    parser.add_argument("--tls-ca", help="reach the node over TLS, trusting this CA (PEM)")
    parser.add_argument("--tls-cert", help="this client's certificate, for mutual TLS (PEM)")
    parser.add_argument("--tls-key", help="the key of --tls-cert (PEM)")


async def read_cluster(
    address: str, token: str | None, peer_token: str | None, tls: ssl.SSLContext | None
) -> dict[str, Any]:
    """The node's view of its cluster: with the client token (or none) as a client reads it;
    with only the peer token through a proven peer call, so that token is never sent.

    Raises:
        NodeUnavailableError, ConnectionLostError, AuthenticationError, TlsError: as
            :func:`deltaflow.client.router.fetch_cluster` says.
    """
    from .client.connection import explain_dropped, map_transport_errors
    from .client.router import fetch_cluster
    from .errors import AuthenticationError, TransportError

    if token is not None or peer_token is None:
        return await fetch_cluster(address, token, 5.0, tls)
    try:
        with map_transport_errors(address, tls):
            async with _operator(peer_token, tls) as operator:
                reply = await operator.call(address, "status")
    except TransportError as exc:
        await explain_dropped(address, exc, tls)
        raise
    except (ValueError, TypeError) as exc:
        raise NodeUnavailableError(f"node at {address} gave no usable answer: {exc}") from exc
    if reply.status in (401, 403) or (reply.status == 200 and not reply.proven):
        why = reply.body.get("error") or "it did not prove it holds the peer token"
        raise AuthenticationError(f"node at {address} and this operator disagree: {why}")
    if reply.status != 200:
        raise NodeUnavailableError(f"node at {address} answered {reply.status} for its map")
    return reply.body


def _operator(peer_token: str | None, tls: ssl.SSLContext | None) -> PeerClient:
    """This command as a peer call's caller: an operator proving the peer token."""
    from .server.peers import PeerClient

    return PeerClient(
        node_id="operator",
        address=f"{socket.gethostname()}:0",
        secret=peer_token,
        tls=tls,
        timeout=5.0,
    )


async def read_status(
    address: str, token: str | None, peer_token: str | None, tls: ssl.SSLContext | None
) -> dict[str, Any]:
    """The node's view of its cluster (:func:`read_cluster`), its ``tables`` gathered from
    every live member: each table any of them writes or commits, with its committer by this
    node's map, the nodes that write it (``writers``) and the last version its committer
    committed (``committed_version``)."""
    from .partitioning import PartitionMap

    body = await read_cluster(address, token, peer_token, tls)
    pmap = PartitionMap.from_wire(body["map"])
    views = [(body["node"], body.get("tables") or {})]
    for member in body["members"]:
        if member["live"] and not member.get("self"):
            with contextlib.suppress(NodeUnavailableError, ConnectionLostError):
                other = await read_cluster(member["address"], token, peer_token, tls)
                views.append((other["node"], other.get("tables") or {}))
    tables: dict[str, dict[str, Any]] = {}
    for node_id, known in views:
        for name, table in known.items():
            entry = tables.setdefault(
                name, {"committer": pmap.committer(name), "writers": [], "committed_version": None}
            )
            entry["writers"].append(node_id)
            version = table.get("committed_version")
            if isinstance(version, int) and (entry["committed_version"] or -1) < version:
                entry["committed_version"] = version
    body["tables"] = {name: tables[name] for name in sorted(tables)}
    return body


def _cluster_status(args: argparse.Namespace) -> int:
    from .security import client_context

    tls = client_context(_client_tls(args))
    try:
        body = asyncio.run(read_status(args.node, token_of(args), peer_token_of(args), tls))
    except (NodeUnavailableError, ConnectionLostError) as exc:
        print(f"cannot reach node {args.node}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        body.pop("challenge", None)  # a peer call's, of no use to a reader
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    print(
        f"node {body['node']} at {body['address']}, {body['partitions']} partitions, "
        f"map v{body['map']['version']}"
    )
    identity = body.get("identity")
    if identity:
        print(
            f"identity: cluster {identity['cluster_id']}, warehouse {identity['warehouse']}, "
            f"{identity['partitions']} partitions"
        )
    if body.get("refused"):
        print(f"REFUSED: {body['refused']}")
        print("  this node owns no partition; the map below is the cluster's")
    print("members:")
    owners = body["map"]["owners"]
    for m in body["members"]:
        owned = sum(1 for o in owners if o == m["node"])
        print(
            f"  {m['node'] or '?':<16} {m['address']:<22} {_state_label(m):<7} partitions={owned}"
        )
        if m.get("refused") and not m.get("self"):  # its own reason is printed above
            print(f"      {m['refused']}")
    print("partition map:")
    for node_id in sorted(set(owners)):
        parts = [str(i) for i, o in enumerate(owners) if o == node_id]
        print(f"  {node_id}: {' '.join(parts)}")
    if body["tables"]:
        print("tables:")
        for name, table in body["tables"].items():
            version = table["committed_version"]
            at = f" at v{version}" if version is not None else ""
            print(
                f"  {name:<24} committer={table['committer']}{at}  "
                f"writers={','.join(sorted(table['writers']))}"
            )
    return 0


def _node_drain(args: argparse.Namespace) -> int:
    import aiohttp

    from .security import client_context, url

    tls = client_context(_client_tls(args))
    token = token_of(args)
    peer_token = peer_token_of(args)

    async def run() -> int:
        # Checks the credentials and TLS first, sending no secret to an unproven node.
        body = await read_cluster(args.node, token, peer_token, tls)
        others = [m["address"] for m in body["members"] if m["live"] and not m.get("self")]
        ssl_option = tls if tls is not None else True
        started = time.monotonic()
        # The drain is a peer call: it proves the peer token (on a loopback cluster with one
        # token, the client token) without sending it.
        async with _operator(peer_token or token, tls) as operator:
            reply = await operator.call(args.node, "drain")
        if reply.status != 202:
            why = reply.body.get("error") or f"status {reply.status}"
            print(f"node {args.node} refused the drain: {why}", file=sys.stderr)
            return 2
        say = sys.stderr if args.json else sys.stdout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            print(f"node {body['node']} at {args.node} is draining", flush=True, file=say)
            while time.monotonic() - started < args.timeout:
                try:
                    async with http.get(url(args.node, "/healthz", tls), ssl=ssl_option):
                        pass
                except (aiohttp.ClientError, OSError):
                    break
                await asyncio.sleep(0.1)
            else:
                print(f"node {args.node} still runs after {args.timeout:g}s", file=sys.stderr)
                if args.json:
                    print_json({"node": body["node"], "stopped": False, "seconds": None})
                return 1
        seconds = time.monotonic() - started
        print(f"node {body['node']} stopped {seconds:.1f}s later", file=say)
        # The survivors learn of the departure by the node's leave call or their own polls;
        # report their map once it no longer names the drained node (or the time is up).
        owners: list[str] = []
        while others:
            for other in others:
                with contextlib.suppress(NodeUnavailableError, ConnectionLostError):
                    owners = (await read_cluster(other, token, peer_token, tls))["map"]["owners"]
                    break
            if body["node"] not in owners or time.monotonic() - started >= args.timeout:
                break
            await asyncio.sleep(0.1)
        counts = {n: owners.count(n) for n in sorted(set(owners))}
        if args.json:
            print_json({
                "node": body["node"], "stopped": True, "seconds": round(seconds, 3),
                "partitions": counts,
            })  # fmt: skip
        elif counts:
            print("partitions now: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
        return 0

    return asyncio.run(run())


def _state_label(member: dict[str, object]) -> str:
    """``live`` in lower case, trouble in upper case (``DEAD``, ``LEFT``, ``REFUSED``)."""
    state = member.get("state") or ("live" if member["live"] else "dead")  # older nodes
    return "live" if state == "live" else str(state).upper()
