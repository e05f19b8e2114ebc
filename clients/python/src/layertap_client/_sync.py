"""The synchronous client (requests)."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

import requests
import urllib3

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


class Client:
    """A client for a layertap server.

    >>> c = Client("http://127.0.0.1:8080")
    >>> [r] = c.hidden_states(["Hello"], layers=[2, -1])
    >>> r.hidden_states.shape  # [tokens, 2, hidden]

    Answers 429 (queue full) and 503 (not ready / draining), and failures to
    connect, are retried up to ``max_retries`` times, waiting as long as the
    server's ``Retry-After`` says or else backing off exponentially from
    ``backoff`` seconds up to ``max_backoff``. Other errors raise
    :class:`LayertapError`.
    """

    def __init__(
        self,
        url: str,
        api_key: Optional[str] = None,
        timeout: float = 600,
        max_retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        session: Optional[requests.Session] = None,
    ):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._session = session or requests.Session()
        self._headers: Dict[str, str] = {}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    # -- plumbing -----------------------------------------------------------------

    def _request(self, method: str, path: str, json_body: Any = None, binary: bool = False):
        """Sends one request with retries; returns (status, headers, body bytes) of a 2xx answer."""
        headers = dict(self._headers)
        # Ask for zstd explicitly (requests' default Accept-Encoding would get an
        # uncompressed answer) and read the bytes as they came, undecoded: whether
        # urllib3 decodes zstd itself depends on its version and on which zstd
        # module is installed. decompress() recognises a zstd frame by its magic.
        headers["Accept-Encoding"] = "zstd" if binary else "identity"
        attempt = 0
        while True:
            try:
                r = self._session.request(
                    method, self.url + path, json=json_body, headers=headers, timeout=self.timeout, stream=True
                )
                try:
                    body = r.raw.read(decode_content=False)
                finally:
                    r.close()
            except (requests.ConnectionError, urllib3.exceptions.ProtocolError) as e:
                # Includes connect timeouts and connections dropped mid-answer;
                # the API is side-effect free, so sending again is safe.
                if attempt >= self.max_retries:
                    raise LayertapError(None, "connection_error", str(e)) from e
                time.sleep(retry_delay(attempt, None, self.backoff, self.max_backoff))
                attempt += 1
                continue
            except (requests.Timeout, urllib3.exceptions.ReadTimeoutError) as e:
                raise LayertapError(None, "timeout", f"no answer within {self.timeout} s: {e}") from e
            if r.status_code in RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(retry_delay(attempt, r.headers.get("Retry-After"), self.backoff, self.max_backoff))
                attempt += 1
                continue
            body = decompress(body)
            if not 200 <= r.status_code < 300:
                raise error_from_response(r.status_code, body)
            return r.status_code, r.headers, body

    def _json(self, method: str, path: str, json_body: Any = None) -> Any:
        _, _, body = self._request(method, path, json_body)
        return json.loads(body.decode("utf-8"))

    # -- API ----------------------------------------------------------------------

    def hidden_states(
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
        """Hidden states of ``layers`` for each input; one :class:`Result` per input.

        ``inputs``: a list whose items are API dicts (``{"input_ids": [...]}``,
        ``{"text": ...}``, ``{"messages": [...]}``), or a ``str`` (text), a
        list of ints (input_ids) or a list of ``{"role", "content"}`` dicts
        (messages). ``layers``: Hugging Face ``hidden_states`` indices (0 =
        embeddings, i = output of decoder layer i, -1 = final normed output),
        and/or ``"final_prenorm"`` (the last decoder layer's output before
        the final norm). ``dtype``: ``"bfloat16"``, ``"float16"``,
        ``"float32"``, ``"float8_e4m3fn"`` (aliases ``"fp8"``, ``"f8_e4m3"``;
        also a torch dtype such as ``torch.float8_e4m3fn``), or ``None`` for
        the server's default.

        ``tokens`` picks the rows returned: ``"all"`` (the server's default),
        ``"assistant"`` (rows whose loss_mask is 1), ``{"last": k}``, or one
        list of ``[start, end)`` pairs per input; each Result then has
        ``positions``. ``allow_nonfinite=True`` accepts answers holding NaN or
        infinity (counted in ``Result.nonfinite``) instead of a 422.

        ``logprobs`` also asks for the teacher's top-k next-token
        log-probabilities of every returned row: an int k (1 to the server's
        ``max_top_k``, 64 by default), or ``{"top_k": k, "target": True}`` to
        add the log-probability of each row's actual next token. Each Result
        then has ``topk_ids``, ``topk_logprobs`` (and ``target_logprobs``).
        ``layers`` may then be ``[]`` (log-probabilities only).

        Returns numpy arrays; bfloat16 becomes float32 (exactly) unless
        ``ml_dtypes`` is installed, in which case it stays
        ``ml_dtypes.bfloat16``. ``as_torch=True`` returns torch tensors
        instead, in the dtype asked for (bfloat16 stays bfloat16). An fp8
        answer is returned dequantised to float32 (``dequantize=True``), or
        with ``dequantize=False`` as fp8 values (``ml_dtypes.float8_e4m3fn``,
        uint8 bits without ml_dtypes, ``torch.float8_e4m3fn``) with
        ``Result.hidden_states_scale``.

        The answer's checksums are verified before anything is returned; a
        mismatch raises :class:`LayertapError` with ``type="checksum_mismatch"``.
        """
        body = hidden_states_body(inputs, layers, dtype, split_special_tokens, tokens, allow_nonfinite, logprobs)
        status, headers, data = self._request("POST", "/v1/hidden-states", body, binary=True)
        return parse_hidden_states(
            data, as_torch=as_torch, request_id=headers.get("x-request-id"), dequantize=dequantize, status=status
        )

    def tokenize(self, inputs: Any, split_special_tokens: bool = False) -> List[Dict[str, List[int]]]:
        """What the server would feed the model: ``[{"input_ids": [...], "loss_mask": [...]}]`` per input."""
        return self._json("POST", "/v1/tokenize", tokenize_body(inputs, split_special_tokens))["results"]

    def info(self) -> Dict[str, Any]:
        """The server's model and limits (``GET /v1/info``)."""
        return self._json("GET", "/v1/info")

    def ready(self) -> bool:
        """True when the server answers ``GET /ready`` with 200 (no retries)."""
        try:
            r = self._session.get(self.url + "/ready", headers=self._headers, timeout=min(self.timeout, 10))
            return r.status_code == 200
        except requests.RequestException:
            return False

    def wait_until_ready(self, timeout: float = 300.0, interval: float = 0.2) -> None:
        """Polls :meth:`ready` until it is true; raises ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.url} was not ready after {timeout} s")
            time.sleep(interval)

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
