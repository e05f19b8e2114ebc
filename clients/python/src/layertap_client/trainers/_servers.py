"""Requests to one or more layertap servers for the trainers' drop-ins."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Union

from .._common import LayertapError, Result
from .._sync import Client


def server_list(servers: Union[str, Sequence[str]]) -> List[str]:
    """One URL, a comma-separated list of URLs, or a sequence of them, as a list."""
    if isinstance(servers, str):
        servers = servers.split(",")
    out = [s.strip().rstrip("/") for s in servers if s and s.strip()]
    if not out:
        raise ValueError("give at least one layertap server URL")
    if len(set(out)) != len(out):
        raise ValueError(f"a server is named twice: {out}")
    return out


def _worth_another_server(e: LayertapError) -> bool:
    """No answer, a timeout, or a 5xx: the server's fault, not the sample's."""
    return e.status is None or e.status >= 500 or e.status in (408, 429)


class Servers:
    """Clients of one or more layertap servers, shared by the threads of one process.

    Each request goes to the server with the fewest requests in flight (ties: the next in
    turn). A server that fails to answer (no connection, a timeout, a 5xx or 429 once the
    client's own retries are spent) is left alone for ``backoff`` seconds, doubling with each
    failure in a row up to ``max_backoff``, and the request goes to another; after
    ``retries`` such failures the request raises the last error. A 4xx (the request's own
    fault) raises at once. Nothing is dropped silently.

    Picklable: a DataLoader worker gets the settings and opens its own connections.
    """

    def __init__(
        self,
        servers: Union[str, Sequence[str]],
        api_key: Optional[str] = None,
        timeout: float = 600.0,
        retries: int = 8,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
    ):
        self.urls = server_list(servers)
        self.api_key = api_key
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._clients: Dict[str, Client] = {}
        self._in_flight = {u: 0 for u in self.urls}
        self._down_until = {u: 0.0 for u in self.urls}
        self._fails = {u: 0 for u in self.urls}
        self._turn = 0
        self._info: Optional[Dict[str, Any]] = None

    def __getstate__(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in ("urls", "api_key", "timeout", "retries", "backoff", "max_backoff")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def _client(self, url: str) -> Client:
        # one Client (one requests.Session) per server and thread: Sessions are not thread-safe
        key = f"{url}#{threading.get_ident()}"
        c = self._clients.get(key)
        if c is None:
            # a short retry budget per server: a server that does not answer is left for another
            c = Client(url, api_key=self.api_key, timeout=self.timeout, max_retries=2, max_backoff=self.max_backoff)
            self._clients[key] = c
        return c

    def _pick(self) -> str:
        with self._lock:
            now = time.monotonic()
            up = [u for u in self.urls if self._down_until[u] <= now] or sorted(self.urls, key=self._down_until.get)[:1]
            n = len(self.urls)
            order = sorted(up, key=lambda u: (self._in_flight[u], (self.urls.index(u) - self._turn) % n))
            url = order[0]
            self._turn = (self.urls.index(url) + 1) % n
            self._in_flight[url] += 1
            return url

    def _done(self, url: str, ok: bool) -> None:
        with self._lock:
            self._in_flight[url] -= 1
            if ok:
                self._fails[url] = 0
            else:
                self._fails[url] += 1
                wait = min(self.max_backoff, self.backoff * 2 ** (self._fails[url] - 1))
                self._down_until[url] = time.monotonic() + wait

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``Client.<method>(*args, **kwargs)`` on a server, moving to another on its failure."""
        last: Optional[LayertapError] = None
        for _ in range(self.retries + 1):
            url = self._pick()
            try:
                out = getattr(self._client(url), method)(*args, **kwargs)
            except LayertapError as e:
                self._done(url, ok=not _worth_another_server(e))
                if not _worth_another_server(e):
                    raise
                last = e
                wait = self._down_until[url] - time.monotonic()
                if all(self._down_until[u] > time.monotonic() for u in self.urls) and wait > 0:
                    time.sleep(min(wait, self.max_backoff))
                continue
            self._done(url, ok=True)
            return out
        assert last is not None
        raise LayertapError(last.status, last.type, f"{last.message} (after {self.retries + 1} attempts on {self.urls})")

    def hidden_states(self, inputs: Any, layers: Any, **kwargs: Any) -> List[Result]:
        """:meth:`layertap_client.Client.hidden_states` on one of the servers."""
        return self.call("hidden_states", inputs, layers, **kwargs)

    def hidden_states_split(
        self, inputs: Sequence[Any], layers: Any, request_tokens: int = 8192, max_requests: int = 4, **kwargs: Any
    ) -> List[Result]:
        """:meth:`hidden_states` of many token-id inputs, in requests of about ``request_tokens``
        tokens each, ``max_requests`` of them at a time over the servers; the results in the
        order of ``inputs``."""
        groups: List[List[int]] = [[]]
        size = 0
        for i, x in enumerate(inputs):
            n = len(x["input_ids"]) if isinstance(x, dict) and "input_ids" in x else len(x)
            if groups[-1] and size + n > request_tokens:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        if len(groups) == 1:
            return self.hidden_states(list(inputs), layers, **kwargs)
        out: List[Optional[Result]] = [None] * len(inputs)
        with ThreadPoolExecutor(max_workers=max(1, min(max_requests, len(groups)))) as pool:
            futures = [(g, pool.submit(self.hidden_states, [inputs[i] for i in g], layers, **kwargs)) for g in groups]
            for g, f in futures:
                for i, r in zip(g, f.result()):
                    out[i] = r
        return [r for r in out if r is not None]

    def info(self) -> Dict[str, Any]:
        """``GET /v1/info`` of a server (cached): ``num_layers``, ``hidden_size``, limits."""
        if self._info is None:
            self._info = self.call("info")
        return self._info
