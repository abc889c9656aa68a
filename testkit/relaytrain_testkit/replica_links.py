"""Replica groups over real links, for tests: every stage of every pipeline a `LinkGroup`
over mutually authenticated loopback TLS links to the stages of the other pipelines that
hold the same layers, and calls run on threads of their own (as stages run)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from relaytrain_operator.domain.linkcerts import mint_link_credentials, stage_pem
from relaytrain_worker.pipeline.credentials import LinkCredentials
from relaytrain_worker.pipeline.transport import Link, connect, listen
from relaytrain_worker.replicas.arithmetic import segment_peers
from relaytrain_worker.replicas.group import LinkGroup

Peer = tuple[int, int]
"""A stage by (pipeline, stage)."""


def link_pair(me: LinkCredentials, them: LinkCredentials) -> tuple[Link, Link]:
    """A mutually authenticated loopback link: (my end, their end)."""
    listener = listen("127.0.0.1:0", credentials=them, expect=me.identity)
    try:
        with ThreadPoolExecutor(1) as dialer:
            mine = dialer.submit(
                connect, f"127.0.0.1:{listener.address[1]}", credentials=me, expect=them.identity
            )
            theirs = listener.accept(timeout=30)
            return mine.result(), theirs
    finally:
        listener.close()


def peer_credentials(splits: list[list[tuple[int, int]]]) -> dict[Peer, LinkCredentials]:
    """Every stage's link credentials (`splits[p]`: pipeline p's stages), under one fresh CA."""
    files = mint_link_credentials("test", "faults", [len(s) for s in splits], now=datetime.now(UTC))
    return {
        (p, k): LinkCredentials(*stage_pem(files, p, k))
        for p, split in enumerate(splits)
        for k in range(len(split))
    }


def peer_links(
    splits: list[list[tuple[int, int]]],
    order: dict[Peer, list[Peer]] | None = None,
    creds: dict[Peer, LinkCredentials] | None = None,
) -> dict[Peer, dict[Peer, Link]]:
    """Every stage's links to its peers (`order[stage]`: the order its links are listed in)."""
    creds = creds or peer_credentials(splits)
    links: dict[Peer, dict[Peer, Link]] = {me: {} for me in creds}
    for p, k in creds:
        for q, j in segment_peers(splits, p, k):
            if q > p:
                links[(p, k)][(q, j)], links[(q, j)][(p, k)] = link_pair(
                    creds[(p, k)], creds[(q, j)]
                )
    for me, peers in (order or {}).items():
        links[me] = {peer: links[me][peer] for peer in peers}
    return links


def link_groups(
    splits: list[list[tuple[int, int]]],
    order: dict[Peer, list[Peer]] | None = None,
    creds: dict[Peer, LinkCredentials] | None = None,
    shares: list[int] | None = None,
    slots: int | None = None,
) -> dict[Peer, LinkGroup]:
    """Every stage's `LinkGroup` over `peer_links` (pipeline p's share `shares[p]`, 1 each
    unless given; membership marks of `slots`, the pipeline count unless given)."""
    return {
        (p, k): LinkGroup.from_splits(
            splits, p, k, links, timeout=60, share=shares[p] if shares else 1, slots=slots
        )
        for (p, k), links in peer_links(splits, order, creds).items()
    }


def on_threads(calls: dict[int, Callable[[], Any]]) -> dict[int, Any]:
    """Run each call on its own thread; their results (or exceptions) by key."""
    out: dict[int, Any] = {}

    def run(key: int, call: Callable[[], Any]) -> None:
        try:
            out[key] = call()
        except BaseException as exc:  # reported by the test
            out[key] = exc

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a stage is still waiting"
    return out
