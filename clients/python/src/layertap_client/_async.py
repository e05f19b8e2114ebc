"""The asynchronous client (httpx; install with ``pip install 'layertap-client[async]'``)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List, Optional

from ._common import (
    RETRY_STATUSES,
    LayertapError,
    Result,
    decompress,
    error_from_response,
    hidden_states_body,
    tokenize_body,
    parse_hidden_states,
    retry_delay,
)

try:
    import httpx
except ImportError:  # pragma: no cover - depends on the environment
    httpx = None  # type: ignore


class AsyncClient:
    """The async twin of :class:`layertap_client.Client`, with the same
    methods as coroutines and the same retry rules.

    >>> async with AsyncClient("http://127.0.0.1:8080") as c:
    ...     results = await c.hidden_states(["Hello"], layers=[-1])

    Many requests may be in flight at once (``asyncio.gather``); the server
    batches them. Decoding the answer (zstd + safetensors) runs in a worker
    thread so that it does not block the event loop.
    """

    def __init__(
        self,
        url: str,
        api_key: Optional[str] = None,
        timeout: float = 600,
        max_retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        max_connections: int = 64,
    ):
        if httpx is None:
            raise ImportError("AsyncClient needs httpx: pip install 'layertap-client[async]'")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        headers = {}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def _request(self, method: str, path: str, json_body: Any = None, binary: bool = False):
        headers = {"Accept-Encoding": "zstd" if binary else "identity"}
        attempt = 0
        while True:
            try:
                async with self._client.stream(method, self.url + path, json=json_body, headers=headers) as r:
                    # Raw bytes, undecoded: httpx decodes zstd by itself only when a
                    # zstd module is installed; decompress() checks the magic instead.
                    chunks = [c async for c in r.aiter_raw()]
                body = b"".join(chunks)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
                if attempt >= self.max_retries:
                    raise LayertapError(None, "connection_error", str(e) or type(e).__name__) from e
                await asyncio.sleep(retry_delay(attempt, None, self.backoff, self.max_backoff))
                attempt += 1
                continue
            except httpx.TimeoutException as e:
                raise LayertapError(None, "timeout", f"no answer within {self.timeout} s: {e}") from e
            if r.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(retry_delay(attempt, r.headers.get("Retry-After"), self.backoff, self.max_backoff))
                attempt += 1
                continue
            if not 200 <= r.status_code < 300:
                raise error_from_response(r.status_code, decompress(body))
            return r.status_code, r.headers, body

    async def _json(self, method: str, path: str, json_body: Any = None) -> Any:
        _, _, body = await self._request(method, path, json_body)
        return json.loads(decompress(body).decode("utf-8"))

    async def hidden_states(
        self,
        inputs: Any,
        layers: Any,
        dtype: Any = "bfloat16",
        as_torch: bool = False,
        split_special_tokens: bool = False,
        tokens: Any = None,
        allow_nonfinite: bool = False,
        dequantize: bool = True,
        logprobs: Any = None,
    ) -> List[Result]:
        """See :meth:`layertap_client.Client.hidden_states`."""
        body = hidden_states_body(inputs, layers, dtype, split_special_tokens, tokens, allow_nonfinite, logprobs)
        status, headers, data = await self._request("POST", "/v1/hidden-states", body, binary=True)
        rid = headers.get("x-request-id")
        return await asyncio.get_running_loop().run_in_executor(
            None,
            lambda: parse_hidden_states(
                data, as_torch=as_torch, request_id=rid, dequantize=dequantize, status=status
            ),
        )

    async def tokenize(self, inputs: Any, split_special_tokens: bool = False) -> List[Dict[str, List[int]]]:
        """See :meth:`layertap_client.Client.tokenize`."""
        return (await self._json("POST", "/v1/tokenize", tokenize_body(inputs, split_special_tokens)))["results"]

    async def info(self) -> Dict[str, Any]:
        """See :meth:`layertap_client.Client.info`."""
        return await self._json("GET", "/v1/info")

    async def ready(self) -> bool:
        """True when the server answers ``GET /ready`` with 200 (no retries)."""
        try:
            r = await self._client.get(self.url + "/ready", timeout=min(self.timeout, 10))
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def wait_until_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """Polls :meth:`ready` until it is true; raises ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not await self.ready():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.url} was not ready after {timeout} s")
            await asyncio.sleep(interval)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
