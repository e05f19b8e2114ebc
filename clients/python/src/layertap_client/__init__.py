"""Python client for layertap: hidden states of chosen layers of a decoder LLM, over HTTP.

>>> from layertap_client import Client
>>> client = Client("http://127.0.0.1:8080")
>>> [r] = client.hidden_states(["Hello"], layers=[2, -1])
>>> r.hidden_states.shape  # [tokens, 2, hidden]

Layer indices follow Hugging Face ``output_hidden_states``: 0 is the embedding
output, i the output of decoder layer i, L (or -1) the final normed output;
``"final_prenorm"`` is the last decoder layer's output before the final norm.
"""

from ._common import FINAL_PRENORM, ChecksumMismatch, LayertapError, Result, verify_file
from ._safetensors import SafetensorsError, has_numpy_bfloat16
from ._safetensors import load as load_safetensors
from ._safetensors import load_file as load_safetensors_file
from ._sync import Client

__version__ = "0.1.0"


def __getattr__(name):  # AsyncClient imports httpx lazily
    if name == "AsyncClient":
        from ._async import AsyncClient

        return AsyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "ChecksumMismatch",
    "Client",
    "FINAL_PRENORM",
    "LayertapError",
    "Result",
    "SafetensorsError",
    "has_numpy_bfloat16",
    "load_safetensors",
    "load_safetensors_file",
    "verify_file",
]
