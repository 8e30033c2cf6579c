"""The job's store: where the protocols' state lives (docs/deploy.md, "The job's store").

Owns the store URL (:func:`parse_store_url`, pure), :func:`open_store` (a ``TCPStore`` hosted by one process of
the job, or etcd: :mod:`.etcd`), :func:`connect` (what every process of a job calls with the URL the launcher gave
it; each request bounded, :mod:`.bounded`), :func:`read_keys` (many keys, present or not, in one round trip where
the store can), :func:`job_url` (the URL of one job's keys on etcd), and leader election on etcd for a standby
coordinator (:mod:`.leader`). May import: nothing of the project outside this package; etcd3gw is imported only when
an etcd store is opened.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from torch.distributed import PrefixStore, Store, TCPStore

from titan_recover.recover.stores.bounded import BoundedStore

URL_FORMS = "HOST:PORT, tcp://HOST:PORT, etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
DEFAULT_ETCD_ROOT = "/titan_recover"
"""The root of every job's keys on etcd when the URL names no prefix."""

_ENDPOINT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>[0-9]+)$")


@dataclass(frozen=True)
class StoreAddress:
    """A parsed store URL: the kind of store, its servers' ``(host, port)`` and, for etcd, the key prefix in the
    URL (``""``: none)."""

    kind: Literal["tcp", "etcd"]
    endpoints: tuple[tuple[str, int], ...]
    path: str = ""


def parse_store_url(url: str) -> StoreAddress:
    """The store a URL names; ValueError saying what is wrong and the accepted forms (:data:`URL_FORMS`).

    ``HOST:PORT`` and ``tcp://HOST:PORT``: a TCPStore (port 0: a free one, for the process that hosts it).
    ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: etcd, one or more members' client ports, keys under ``/PREFIX``.
    IPv6 hosts are written in brackets: ``[::1]:2379``.
    """
    def bad(what: str) -> ValueError:
        return ValueError(f"store URL {url!r}: {what}; accepted forms: {URL_FORMS}")

    if not url.strip():
        raise bad("empty")
    scheme, sep, rest = url.strip().partition("://")
    if not sep:
        scheme, rest = "tcp", url.strip()
    if scheme not in ("tcp", "etcd"):
        raise bad(f"unknown scheme {scheme + '://'!r}")
    hosts, slash, path = rest.partition("/")
    if slash and scheme == "tcp":
        raise bad("a TCPStore URL has no path")
    if slash and "" in path.rstrip("/").split("/"):
        raise bad(f"an empty segment in the key prefix {'/' + path!r}")
    path = path.rstrip("/")
    if scheme == "tcp" and "," in hosts:
        raise bad("a TCPStore has one server")
    endpoints = []
    for item in hosts.split(","):
        m = _ENDPOINT.match(item)
        if not m:
            raise bad(f"{item!r} is not HOST:PORT" if item else "an empty HOST:PORT")
        port = int(m["port"])
        if not (0 if scheme == "tcp" else 1) <= port <= 65535:
            raise bad(f"port {port} out of range")
        endpoints.append((m["v6"] or m["host"], port))
    return StoreAddress(scheme, tuple(endpoints), "/" + path if path else "")


def etcd_prefix(address: StoreAddress, prefix: str | None) -> str:
    """The etcd key prefix of a job: the URL's prefix (default :data:`DEFAULT_ETCD_ROOT`), then ``prefix``. One of
    the two must name the job (ValueError otherwise): jobs sharing a cluster must not share keys."""
    job = (prefix or "").strip("/")
    if not address.path and not job:
        raise ValueError(f"an etcd store needs a per-job key prefix: etcd://HOST:PORT/PREFIX, or prefix= (keys then "
                         f"live under {DEFAULT_ETCD_ROOT}/<prefix>/)")
    return f"{address.path or DEFAULT_ETCD_ROOT}/{job}/" if job else f"{address.path}/"


def open_store(url: str, *, timeout: timedelta = timedelta(seconds=300), prefix: str | None = None,
               is_server: bool = False) -> Store:
    """The job's store that ``url`` names (:func:`parse_store_url`), with ``timeout`` as its timeout.

    A TCPStore URL gives a client (``is_server=False``, as a member connects: ``wait_for_workers=False``) or, with
    ``is_server=True``, the server itself (port 0: a free one; its ``.port`` tells which). An etcd URL gives an
    :class:`~.etcd.EtcdStore`, whose keys live under :func:`etcd_prefix`; there is nothing to host, so
    ``is_server`` makes no difference there. With ``prefix``, a TCPStore is wrapped in a ``PrefixStore`` so both
    kinds namespace keys alike (reach a wrapped server's port through ``.underlying_store.port``).
    """
    address = parse_store_url(url)
    if address.kind == "etcd":
        from titan_recover.recover.stores.etcd import EtcdStore

        return EtcdStore(address.endpoints, etcd_prefix(address, prefix), timeout=timeout)
    (host, port), = address.endpoints
    if port == 0 and not is_server:
        raise ValueError(f"store URL {url!r}: port 0 (a free one) only for the process that hosts the store")
    store = TCPStore(host, port, is_master=is_server, wait_for_workers=False, timeout=timeout)
    return PrefixStore(prefix, store) if prefix else store


def connect(url: str, timeout_s: float) -> Store:
    """A client of the job's store at ``url`` (``HOST:PORT`` of the TCPStore a launcher hosts, or the etcd URL of
    the job's keys, :func:`job_url`), with ``timeout_s`` as its timeout: what every process of a job opens with
    the address its launcher gave it (``TITAN_RECOVER_COORDINATOR``, ``--store``). Every request is bounded: a
    store that leaves one unanswered raises ``DistNetworkError`` (a TCPStore client: after ``timeout_s`` beyond its
    wait for keys, :class:`~.bounded.BoundedStore`; an etcd store: after its request timeout)."""
    store = open_store(url, timeout=timedelta(seconds=timeout_s))
    return BoundedStore(store, url) if parse_store_url(url).kind == "tcp" else store


def read_keys(store: Store, keys: Sequence[str]) -> list[bytes | None]:
    """The values of ``keys`` now, in order, None for a key that is absent (no waiting). A store that reads many
    keys in one request does (etcd: one transaction, :meth:`~.etcd.EtcdStore.read_present`); any other is asked
    ``check`` then ``get`` for each key (a TCPStore has no read that answers for a missing key without waiting)."""
    read_present = getattr(store, "read_present", None)
    if read_present is not None:
        return read_present(keys)
    return [store.get(key) if store.check([key]) else None for key in keys]


def host_port(host: str, port: int) -> str:
    """``HOST:PORT`` as a store URL names it: an IPv6 host in brackets (``[::1]:2379``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_JOB_SEGMENT = re.compile(r"[^A-Za-z0-9._-]+")


def job_url(url: str, *segments: str) -> str:
    """The etcd URL whose prefix holds one job's keys: ``url``'s prefix (default :data:`DEFAULT_ETCD_ROOT`), then
    ``segments`` (characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``). Opening it with no
    ``prefix`` gives the store :func:`open_store` gives for ``url`` with ``prefix="/".join(segments)``."""
    address = parse_store_url(url)
    if address.kind != "etcd":
        raise ValueError(f"store URL {url!r}: job_url is for etcd URLs")
    parts = [_JOB_SEGMENT.sub("_", s.strip("/")) or "_" for s in segments]
    hosts = ",".join(host_port(h, p) for h, p in address.endpoints)
    return f"etcd://{hosts}{address.path or DEFAULT_ETCD_ROOT}/" + "/".join(parts)
