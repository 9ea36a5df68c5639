"""``--kv-transfer-config``: vLLM's JSON object for prefill/decode disaggregation, validated.

    {"kv_connector": "ZmqConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579}

``kv_producer`` (a prefill instance) serves the KV of finished prompts from a ZMQ ROUTER socket bound at
``kv_ip:kv_port``; ``kv_consumer`` (a decode instance) pulls it; ``kv_both`` does either per request. Only
``ZmqConnector`` is built; vLLM's other connector names are refused naming the field.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("ZmqConnector",)
DEFAULT_PORT = 14579
_FIELDS = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_transfer_timeout_s", "kv_connector_extra_config",
           "engine_id"}


@dataclass(frozen=True)
class KVTransferConfig:
    """A validated ``--kv-transfer-config``.

    Attributes:
        kv_connector: ``ZmqConnector``.
        kv_role: ``kv_producer`` | ``kv_consumer`` | ``kv_both``.
        kv_ip: the address the producer binds and advertises to decode instances (a loopback or local IP).
        kv_port: its TCP port (0: any free port, chosen at start; the advertised params carry it).
        kv_transfer_timeout_s: a producer frees blocks pinned for a transfer after this many seconds without
            the consumer's confirmation; a consumer gives up a pull (and recomputes) after as long without
            an answer (vLLM: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``; seconds).
        engine_id: names this instance in the transfer parameters it hands out ("" : a random id).
    """

    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_PORT
    kv_transfer_timeout_s: float = 30.0
    engine_id: str = ""

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_value(cls, value: KVTransferConfig | str | dict[str, Any] | None) -> KVTransferConfig | None:
        """Parse the flag's JSON text (or a dict, as ``LLM(kv_transfer_config=...)`` takes it).

        Raises:
            InvalidRequestError: not a JSON object, an unknown or unsupported key or connector, a bad role,
                address, port or timeout (``param`` is ``kv_transfer_config``; the message names the key).
        """
        if value is None or isinstance(value, KVTransferConfig):
            return value
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"kv_transfer_config: {msg}", param="kv_transfer_config")

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad(f"not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise bad("must be a JSON object")
        unknown = sorted(set(value) - _FIELDS)
        if unknown:
            raise bad(f"unsupported key {unknown[0]!r} (supported: {', '.join(sorted(_FIELDS))})")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict) or extra:
            raise bad("kv_connector_extra_config: ZmqConnector takes no extra config")
        connector = value.get("kv_connector", "ZmqConnector")
        if connector not in CONNECTORS:
            raise bad(f"kv_connector {connector!r} is not available (kvserve has: {', '.join(CONNECTORS)})")
        role = value.get("kv_role", "kv_both")
        if role not in ROLES:
            raise bad(f"kv_role {role!r} must be one of {', '.join(ROLES)}")
        ip = value.get("kv_ip", "127.0.0.1")
        try:
            ipaddress.ip_address(ip)
        except (ValueError, TypeError):
            raise bad(f"kv_ip {ip!r} is not an IP address") from None
        port = value.get("kv_port", DEFAULT_PORT)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise bad(f"kv_port {port!r} must be an integer in 0..65535")
        timeout = value.get("kv_transfer_timeout_s", 30.0)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise bad(f"kv_transfer_timeout_s {timeout!r} must be a positive number of seconds")
        engine_id = value.get("engine_id", "")
        if not isinstance(engine_id, str):
            raise bad("engine_id must be a string")
        return cls(connector, role, ip, port, float(timeout), engine_id)
